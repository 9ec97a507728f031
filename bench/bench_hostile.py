"""An honest run's time while hostile callers saturate the call caps, against the same
run without them, measured in one go (issue 14); and the daemons' peak memory in both.

    .venv/bin/python bench/bench_hostile.py                   # 2 pairs of runs, table
    .venv/bin/python bench/bench_hostile.py --pairs 3 --json experiments/results/bench_hostile.json

Each pair runs the same small cluster over mutual TLS (``hypertrain up``'s daemons: an
aggregator, a relay per region, the islands) twice, once clean and once under attack,
in alternating order.  The attack, from the moment the relays listen to the run's end:

- an ``intruder`` holding a certificate of the run's CA (no member) keeps its cap of
  silent pushes open at every relay and at the aggregator, opening a new one as soon as
  one is ended by the idle bound;
- the intruder calls Status in a loop (refused RESOURCE_EXHAUSTED: its cap is held);
- a client without a certificate connects in a loop (refused in the TLS handshake).

The loops are paced (``FLOOD_HZ`` calls a second each, one new connection a second
without a certificate): the attacker shares this machine's two cores, where a real one
would not, and each of its plaintext attempts builds a new gRPC channel in Python.  Figures: the honest run's wall time
from the islands' start to the run's end (``hostile_over_clean``: the best hostile
run over the best clean one; target <= 1.3), and the relay's and aggregator's peak
resident memory (VmHWM, sampled until they exit), next to one delta's size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # not gRPC's notes on each fork
TARGET = 1.3
FLOOD_HZ = 10.0
PLAINTEXT_HZ = 1.0
IDLE_S = 5
CAP = 4


def _peak_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Attack:
    """The hostile callers of the module docstring, until ``stop``."""

    def __init__(self, keys: Path, targets: dict[str, str]) -> None:
        from hypertrain.common.trust.certs import cert_path, issue
        from hypertrain.wire.tls import Security

        if not cert_path(keys, "intruder").exists():
            issue(keys, "intruder")
        self.security = Security.of(keys, "intruder")
        self.targets = targets  # daemon name -> address
        self.stop = threading.Event()
        self.counts: dict[str, int] = {"held": 0, "refused": 0, "handshake": 0}
        self.threads = [
            threading.Thread(target=fn, args=(name, addr), daemon=True)
            for name, addr in targets.items()
            for fn in (self._hold, self._flood, self._plaintext)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _stub(self, name: str, addr: str) -> tuple[Any, Any]:
        from hypertrain.wire.client import aggregator_stub, relay_stub

        channel = self.security.channel(addr, name)
        stub = aggregator_stub(channel) if name == "aggregator" else relay_stub(channel)
        push = stub.PushRegional if name == "aggregator" else stub.PushDelta
        return stub, push

    def _hold(self, name: str, addr: str) -> None:
        """Keep CAP silent pushes open, reopening each one that is ended."""
        _, push = self._stub(name, addr)

        def silent() -> Any:
            self.stop.wait()
            yield from ()

        calls: list[Any] = []
        while not self.stop.is_set():
            calls = [c for c in calls if not c.done()]
            while len(calls) < CAP:
                calls.append(push.future(silent()))
                self.counts["held"] += 1
            self.stop.wait(0.2)

    def _flood(self, name: str, addr: str) -> None:
        import grpc

        from hypertrain.v1 import hypertrain_pb2 as pb

        stub, _ = self._stub(name, addr)
        while not self.stop.wait(1 / FLOOD_HZ):
            try:
                stub.Status(pb.StatusRequest(), timeout=5)
            except grpc.RpcError:
                self.counts["refused"] += 1

    def _plaintext(self, name: str, addr: str) -> None:
        import grpc

        from hypertrain.v1 import hypertrain_pb2 as pb
        from hypertrain.wire.client import relay_stub

        while not self.stop.wait(1 / PLAINTEXT_HZ):
            with grpc.insecure_channel(addr) as channel:
                try:
                    relay_stub(channel).Status(pb.StatusRequest(), timeout=5)
                except grpc.RpcError:
                    self.counts["handshake"] += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def one_run(cfg: Any, work: Path, hostile: bool) -> dict[str, Any]:
    """One honest run (clean or under attack): its wall time and the daemons' peaks."""
    from hypertrain.common.trust.certs import init_daemons
    from hypertrain.common.trust.keys import daemon_key_names
    from hypertrain.up import (
        Progress,
        config_toml,
        relay_addresses,
        start_cluster,
        start_island,
        supervise,
    )

    run_dir = work / ("hostile" if hostile else "clean") / str(time.monotonic_ns())
    run_dir.mkdir(parents=True)
    bounds = f"call_idle_s = {IDLE_S}\ncalls_per_peer = {CAP}\n"
    (run_dir / "run.toml").write_text(
        config_toml(cfg) + f"\n[relay]\n{bounds}\n[aggregator]\n{bounds}"
    )
    init_daemons(run_dir / "keys", daemon_key_names(cfg.topology))
    progress = Progress(cfg, quiet=True)
    islands = cfg.topology.island_ids()
    children = start_cluster(cfg, run_dir, progress, hold=islands)
    attack = None
    peaks: dict[str, int] = {}
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.wait(0.2):
            for c in children[: 1 + len(cfg.topology.regions) * cfg.topology.relay_shards]:
                peaks[c.name] = max(peaks.get(c.name, 0), _peak_kib(c.proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        addrs = relay_addresses(children)
        if hostile:
            targets = {"aggregator": children[0].wait_listening()}
            targets |= {f"relay-{r}": a for r, a in addrs.items()}
            attack = Attack(run_dir / "keys", targets)
            attack.start()
            time.sleep(1.0)  # the caps are held before the islands start
        sampler.start()
        t0 = time.perf_counter()
        for i in islands:
            children.append(start_island(run_dir, progress, i, addrs[cfg.topology.region_of(i)]))
        failed = supervise(children, deadline_s=600)
        wall = time.perf_counter() - t0
    finally:
        stop_sampling.set()
        if attack is not None:
            attack.close()
        for c in reversed(children):
            c.stop(grace=5)
    if failed is not None:
        raise RuntimeError(f"the honest run failed: {failed.failure_message()}")
    return {
        "wall_s": wall,
        "digest": progress.final_digest,
        "peak_mib": {k: v / 1024 for k, v in peaks.items()},
        "attack": dict(attack.counts) if attack else {},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=2, help="clean/hostile pairs (best is kept)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from hypertrain.common.codec import make_codec
    from hypertrain.common.config import RunConfig
    from hypertrain.common.roles import initial_parameters

    cfg = RunConfig.from_dict(
        {
            "steps": args.steps,
            "holdout_windows": 16,
            "regional_codec": "int8",
            "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
        }
    )
    layout, theta = initial_parameters(cfg)
    delta_bytes = len(make_codec(cfg.regional_codec).encode(theta))
    runs: dict[str, list[dict[str, Any]]] = {"clean": [], "hostile": []}
    with TemporaryDirectory(prefix="bench-hostile-") as tmp:
        for i in range(args.pairs):
            order = [False, True] if i % 2 == 0 else [True, False]
            for hostile in order:
                r = one_run(cfg, Path(tmp), hostile)
                runs["hostile" if hostile else "clean"].append(r)
                print(
                    f"{'hostile' if hostile else 'clean':<8} wall {r['wall_s']:6.2f} s  "
                    f"peak MiB {json.dumps({k: round(v) for k, v in r['peak_mib'].items()})}  "
                    f"attack {r['attack']}",
                    flush=True,
                )
    digests = {r["digest"] for rs in runs.values() for r in rs}
    clean = min(r["wall_s"] for r in runs["clean"])
    hostile = min(r["wall_s"] for r in runs["hostile"])
    ratio = hostile / clean

    def peak(kind: str, role: str) -> float:
        return max(v for r in runs[kind] for k, v in r["peak_mib"].items() if k.startswith(role))

    out = {
        "hostile_over_clean": ratio,
        "clean_wall_s": clean,
        "hostile_wall_s": hostile,
        "same_digest": len(digests) == 1,
        "delta_kib": delta_bytes / 1024,
        "model_fp32_kib": 4 * layout.numel / 1024,
        "relay_peak_mib_clean": peak("clean", "relay"),
        "relay_peak_mib_hostile": peak("hostile", "relay"),
        "aggregator_peak_mib_clean": peak("clean", "aggregator"),
        "aggregator_peak_mib_hostile": peak("hostile", "aggregator"),
        "calls_per_peer": CAP,
        "call_idle_s": IDLE_S,
        "flood_hz": FLOOD_HZ,
        "plaintext_hz": PLAINTEXT_HZ,
        "pairs": args.pairs,
        "runs": runs,
    }
    print(
        f"honest run under attack / clean: {ratio:.3f} (target <= {TARGET}) "
        f"{'PASS' if ratio <= TARGET else 'FAIL'}; final digests agree: {out['same_digest']}\n"
        f"peak RSS MiB, clean -> hostile: relay {out['relay_peak_mib_clean']:.0f} -> "
        f"{out['relay_peak_mib_hostile']:.0f}, aggregator {out['aggregator_peak_mib_clean']:.0f}"
        f" -> {out['aggregator_peak_mib_hostile']:.0f} (one delta {out['delta_kib']:.0f} KiB, "
        f"the fp32 model {out['model_fp32_kib']:.0f} KiB)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ratio <= TARGET and out["same_digest"] else 1


if __name__ == "__main__":
    sys.exit(main())
