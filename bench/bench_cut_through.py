"""The relay's cut-through on links of their own: the M = 2 sync with it and without it.

    .venv/bin/python bench/bench_cut_through.py                       # P = 2.5e7, 1gbit links
    .venv/bin/python bench/bench_cut_through.py --rate 500mbit --repeats 3 --json out.json

Root only (``ip netns``, ``tc``).  Every daemon of a 1-region, 2-island run gets a
network namespace of its own, made by this bench and removed at its end: the aggregator,
the relay and each island, joined in a star through the relay by veth pairs (private
addresses 10.250.k.0/30, inside those namespaces only), each pair rate-limited to
``--rate`` in both directions by a token bucket (``tc ... tbf``), as islands, a relay and
an aggregator in different datacenters each sit behind a link of their own.  (On the
host's one loopback every transfer shares the machine's two cores, which the sync
already keeps busy: there, serving the merge earlier cannot make it faster;
bench_sync_scale.py measures that case.)  The daemons speak mutual TLS, since plaintext
is served on loopback only.

The run is bench_sync_scale.py's part B (``run_sync_wall``: real island daemons training a
P-parameter model, h_r = h_g = 2, steps = 6, int8 deltas), once with the relays'
default (``cut_through``: the islands download the global merge from the relay while it
arrives from the aggregator) and once with ``--no-cut-through`` (only once it has
arrived), alternating, ``--repeats`` times each.  Figure: ``cut_through_over_whole``, the
median sync wall time with cut-through over that without, both measured in this run.
Beside it, both as multiples of ``link_s``, the time the sync's bytes take on the links
of its critical path one after another (delta island -> relay, forward relay ->
aggregator, merge aggregator -> relay, merge relay -> island), at the rate the bench
measured on one such link (raw TCP, ``sendall`` / ``recv_into``, 64 MiB).  Without
cut-through the merge crosses its two links one after the other; with it, at once, so
the figure's floor is about (link_s - one merge's link time) / link_s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sync_scale as bss

from hypertrain.common.config import RunConfig
from hypertrain.common.trust.certs import ensure_certs
from hypertrain.common.trust.keys import daemon_key_names
from hypertrain.up import identity_flags

AGG_PORT, RELAY_PORT = 7070, 7071
PROBE_PORT = 7090
PROBE_BYTES = 64 << 20


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


class Star:
    """Network namespaces for the aggregator, the relay and ``islands`` islands, each
    island and the aggregator joined to the relay by a veth pair limited to ``rate``."""

    def __init__(self, rate: str, islands: int) -> None:
        tag = f"htct{os.getpid() % 100000}"
        self.rate = rate
        self.ns = {"aggregator": f"{tag}-agg", "relay": f"{tag}-rel"}
        self.ns |= {f"island{k}": f"{tag}-i{k}" for k in range(islands)}
        self.links: list[tuple[str, str, str]] = []  # (side a, side b, subnet's 3rd octet)
        self.links.append(("aggregator", "relay", "0"))
        self.links += [("relay", f"island{k}", str(k + 1)) for k in range(islands)]
        self.made: list[str] = []

    def address(self, who: str, toward: str) -> str:
        """``who``'s address on its link with ``toward``."""
        for a, b, octet in self.links:
            if {a, b} == {who, toward}:
                return f"10.250.{octet}.{1 if who == a else 2}"
        raise KeyError((who, toward))

    def prefix(self, who: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[who]]

    def __enter__(self) -> Star:
        try:
            for ns in self.ns.values():
                sh("ip", "netns", "add", ns)
                self.made.append(ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            for k, (a, b, octet) in enumerate(self.links):
                va, vb = f"{self.ns[a][:9]}x{k}a", f"{self.ns[b][:9]}x{k}b"
                sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
                for who, dev, host in ((a, va, 1), (b, vb, 2)):
                    ns = self.ns[who]
                    sh("ip", "link", "set", dev, "netns", ns)
                    sh("ip", "-n", ns, "addr", "add", f"10.250.{octet}.{host}/30", "dev", dev)
                    sh("ip", "-n", ns, "link", "set", dev, "up")
                    sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                       "tbf", "rate", self.rate, "burst", "1mb", "latency", "100ms")  # fmt: skip
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self.made):  # its veth ends go with it
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        self.made.clear()


def link_rate(star: Star) -> float:
    """Bytes per second of raw TCP over the relay -> island0 link (best of 3)."""
    server = (
        "import socket,sys\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('{star.address('island0', 'relay')}', {PROBE_PORT})); s.listen(1)\n"
        "print('ready', flush=True)\n"
        f"buf=bytearray({PROBE_BYTES}); v=memoryview(buf)\n"
        "for _ in range(3):\n"
        "    c,_=s.accept(); n=0\n"
        f"    while n<{PROBE_BYTES}:\n"
        "        k=c.recv_into(v[n:]); n+=k\n"
        "        if not k: break\n"
        "    c.sendall(b'k'); c.close()\n"
    )
    client = (
        "import socket,time,os\n"
        f"data=os.urandom({PROBE_BYTES}); best=1e9\n"
        "for _ in range(3):\n"
        f"    c=socket.create_connection(('{star.address('island0', 'relay')}', {PROBE_PORT}))\n"
        "    t=time.perf_counter(); c.sendall(data); c.recv(1)\n"
        "    best=min(best,time.perf_counter()-t); c.close()\n"
        f"print({PROBE_BYTES}/best)\n"
    )
    srv = subprocess.Popen(
        [*star.prefix("island0"), sys.executable, "-c", server], stdout=subprocess.PIPE, text=True
    )
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        out = subprocess.run(
            [*star.prefix("relay"), sys.executable, "-c", client],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        )
        return float(out.stdout.strip())
    finally:
        srv.kill()
        srv.wait()


def linked_cluster(star: Star, cut_through: bool):  # type: ignore[no-untyped-def]
    """A ``bench_sync_scale.Cluster`` whose daemons run in ``star``'s namespaces."""

    class Linked(bss.Cluster):
        def __init__(self, cfg: RunConfig, run_dir: Path, events: Any, poller: Any) -> None:
            super().__init__(cfg, run_dir, events, poller)
            ensure_certs(run_dir / "keys", daemon_key_names(cfg.topology))

        def identity(self, name: str) -> tuple[str, ...]:
            return identity_flags(self.run_dir / "keys", name)  # TLS: not on loopback

        def place(self, name: str) -> list[str]:
            who = "island" + name.rsplit("-", 1)[1] if name.startswith("island-") else name
            return star.prefix("relay" if who.startswith("relay") else who)

        def start(self, islands: bool) -> dict[str, str]:
            from hypertrain.up import ISLAND_NICE

            d = self.run_dir
            agg_at = f"{star.address('aggregator', 'relay')}:{AGG_PORT}"
            agg = self.spawn(
                "aggregator",
                "hypertrain.aggregator",
                *("--listen", agg_at, "--state-dir", str(d / "aggregator")),
            )
            agg.wait_listening(bss.DAEMON_TIMEOUT_S)
            (region,) = self.cfg.topology.regions
            relay = self.spawn(
                f"relay-{region}",
                "hypertrain.relay",
                *("--region", region, "--aggregator", agg_at),
                *("--listen", f"0.0.0.0:{RELAY_PORT}", "--state-dir", str(d / "relay")),
                *(() if cut_through else ("--no-cut-through",)),
            )
            relay.wait_listening(bss.DAEMON_TIMEOUT_S)
            for island in self.cfg.topology.island_ids():
                _, _, index = island.rpartition("-")
                at = f"{star.address('relay', 'island' + index)}:{RELAY_PORT}"
                self.spawn(
                    f"island-{island}",
                    "hypertrain.island",
                    *("--region", region, "--index", index, "--relay", at),
                    *("--state-dir", str(d / f"island-{island}")),
                    nice=ISLAND_NICE,
                )
            return {region: f"0.0.0.0:{RELAY_PORT}"}

    return Linked


@contextlib.contextmanager
def _folder(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    work = Path(tempfile.mkdtemp(prefix="bench-cut-through-"))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=2.5e7, help="model parameters P")
    ap.add_argument("--rate", default="1gbit", help="each link's rate (tc units)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("bench_cut_through: needs root, ip and tc (network namespaces)", file=sys.stderr)
        return 2
    mcfg = bss.shape_for(args.params)
    P = bss.param_count(mcfg)
    runs: dict[str, list[dict[str, Any]]] = {"whole": [], "cut_through": []}
    with Star(args.rate, 2) as star, _folder(args.keep) as work:
        rate = link_rate(star)
        print(f"# P = {P:,}, links {args.rate}: raw TCP {rate / 1e6:.0f} MB/s on one link")
        for k in range(args.repeats):
            for mode in ("whole", "cut_through"):
                out = work / f"{mode}-{k}"
                got = bss.run_sync_wall(
                    mcfg,
                    ("eu",),
                    2,
                    "int8",
                    out,
                    rate,
                    args.verbose,
                    900,
                    make_cluster=linked_cluster(star, mode == "cut_through"),
                )
                runs[mode].append(got)
                print(
                    f"{mode:12s} run {k}: median sync {got['median_sync_s']:.2f} s "
                    f"({got['ratio']:.2f}x link), after commit {got['median_after_commit_s']:.2f} s"
                )
                if args.keep is None:
                    shutil.rmtree(out, ignore_errors=True)
    syncs = {
        mode: statistics.median(s["sync_s"] for r in rs for s in r["syncs"] if s["step"] != 2)
        for mode, rs in runs.items()
    }
    link_s = runs["whole"][0]["tcp_s"]
    merge_s = 4 * P / rate
    result = {
        "params": P,
        "rate": args.rate,
        "link_bytes_per_s": rate,
        "link_s": link_s,
        "merge_link_s": merge_s,
        "whole_sync_s": syncs["whole"],
        "cut_through_sync_s": syncs["cut_through"],
        "whole_over_link": syncs["whole"] / link_s,
        "cut_through_over_link": syncs["cut_through"] / link_s,
        "cut_through_over_whole": syncs["cut_through"] / syncs["whole"],
        "floor_over_whole": (syncs["whole"] - merge_s) / syncs["whole"],
        "repeats": args.repeats,
        "runs": {
            mode: [{k: v for k, v in r.items() if k not in ("syncs",)} for r in rs]
            for mode, rs in runs.items()
        },
    }
    print(
        f"sync wall: whole {syncs['whole']:.2f} s ({result['whole_over_link']:.2f}x link_s), "
        f"cut-through {syncs['cut_through']:.2f} s ({result['cut_through_over_link']:.2f}x); "
        f"cut_through_over_whole {result['cut_through_over_whole']:.3f} "
        f"(one merge's link time {merge_s:.2f} s of link_s {link_s:.2f} s)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
