"""Streaming fragments: the bytes one sync puts on the wire, for F = 1, 2, 4 (issue 16).

    .venv/bin/python bench/bench_streaming.py --json experiments/results/bench_streaming.json
    .venv/bin/python bench/bench_streaming.py --preset tiny --rounds 2      # a smoke run

Runs the in-process cluster (the relays, the aggregator and the islands of
``hypertrain run --local``, every delta really encoded and aggregated) on the proxy
preset with tau = 1, once per fragment count, and records every push as it is made
(``Observer.pushed``): per island and step, the encoded bytes it pushed to its relay
(all fragments that sync at that step), and per relay and step the bytes it forwarded
to the aggregator.  The peak of each over the run's steps but the last is what a link must carry at
once: with F fragments staggered over the global interval it drops to the largest
fragment's.  At the last step every fragment syncs (the final flush, docs/design.md
§3.5), so that step carries the whole model whatever F is; it is reported apart.
Ratios are against F = 1 measured in the same run.

Two schedules: ``flat`` (H_r = H_g = 30, the simulator's proxy schedule; one level, as in
Streaming DiLoCo) and ``hier`` (H_r = 5, H_g = 30): with two levels the fragments'
regional syncs fall on the same steps wherever their offsets agree modulo H_r (for F = 4:
offsets 0, 7, 15, 22, so fragments 0 and 2 sync regionally together), and the island's
peak drops less; the relays' global peak still drops to one fragment's.

Fragments are cut by the run configuration's default, ``values`` (``common/fragments.py``):
F equal ranges of the flat vector, cut inside a parameter where a boundary falls, so the
largest holds 1/F of the values.  For comparison the bench reports, without running it,
the largest fragment of the ``params`` cut (whole parameters, the simulator's registered
cells; ``params_cut_share``: 30.7% of the values at F = 4 on the 4-layer proxy) and the
best any contiguous cut at whole parameters could do (``best_whole_cut``, exhaustive):
on the proxy the params cut is that best, so the 0.3 target needs the values cut.

``--daemons``: also the islands' blocked share (the part of an island's wall time spent
waiting for its pushes and merges: ``blocked_share`` of its ``event=done`` line) with the
real daemons (``hypertrain up``, 2 x 2 islands or ``--topology RxN``, the flat schedule,
tau = 1) for each F, one run after the other on this machine, ``--repeats`` times (3),
the order of F turned by one each time; the peak bytes of a push there too (its
``event=sync`` lines' ``bytes``, the step's pushes of every fragment).  A run's figure is
its islands' largest share; the F's figure is the mean of its runs' (each run's is kept:
``blocked_share_max_runs``), since one run's moves by a point or two with how the two
cores are shared.  Each island's blocked time is split (means over islands and runs, in
seconds): ``blocked_start_s``, at its first merge (it also absorbs the islands' start-up
skew), ``blocked_rounds_s``, at every later merge of the run, and ``blocked_end_s``, the
final state after its last step (every fragment syncs there).

``--step-seconds P`` (with ``--daemons``): each island trains at most one step per P
seconds (``HYPERTRAIN_STEP_SECONDS``, services/island/daemon.py), so that islands sharing
this machine's two cores step at a steady rate, as an island on accelerators of its own
does. Unpaced, four islands, two relays and the aggregator share two cores: an island's
step time varies from step to step and the islands drift apart between merges, so every
merge waits for the island that fell behind, and F = 4 meets that at four times as many
merges. Paced (P above the step's time under this load), what an island waits for is the
sync itself: its transfer and the relays' and aggregator's work, each hidden behind tau
steps. The pace changes no bit of the run.

The islands do not start training at the same moment (each loads torch and its data on
the same two cores), and one that starts s seconds before the last must wait those s
seconds for it, at its first merge or, paced, partly at the end (after the first merge the
islands keep the phase they have then): waiting that no F changes, and one run's largest
share moves by most of a point with it.  So each run also gives each island's start skew
(its wall time minus the shortest: every island ends within a few tens of milliseconds of
the others, at the final merge; the run's largest is ``start_skew_s_max``) and the largest
blocked share net of it (``blocked_net_share_max``), and each F's figures are compared with
F = 1's in the same repeat (``blocked_share_diff_mean``, ``blocked_net_share_diff_mean``,
with their standard errors over the repeats, ``..._diff_se``).  ``--fragments 1,4`` runs
only those counts (1, the baseline, among them), to spend the repeats where they are needed.

``--rate 40mbit`` (with ``--daemons``; root, ``ip`` and ``tc``): the same runs once more,
each inside a network namespace of its own whose loopback sends through a token bucket
at that rate (``tc qdisc ... tbf``), so every link of the cluster shares one limited
path, as a slow WAN would; the namespace is made for the run and removed after it.
Where bandwidth, not a sync's fixed cost, is what an island waits for, F smaller pushes
each hidden behind the same tau steps block it less than one large one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.data import SampleStream
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import partition
from hypertrain.common.reference import model_cluster, open_dataset
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.local import Observer
from hypertrain.common.rounds.machines import Decision, Delta
from hypertrain.common.trust.ledger import flat_digest
from hypertrain.procs import parse_logfmt

SCHEDULES = {"flat": (30, 30), "hier": (5, 30)}


class _Bytes(Observer):
    """Encoded bytes accepted per (sender, step)."""

    def __init__(self) -> None:
        self.by_step: dict[tuple[str, int], int] = defaultdict(int)

    def pushed(self, node: str, delta: Delta, decision: Decision) -> None:
        if decision.accepted and not decision.duplicate:
            self.by_step[(delta.sender, delta.sync_step)] += len(delta.data)


def measure(preset: str, fragments: int, h_r: int, h_g: int, rounds: int) -> dict[str, Any]:
    cfg = RunConfig.from_dict(
        {
            "model": preset,
            "steps": rounds * h_g,
            "batch_per_island": 2,
            "fragments": fragments,
            "topology": {
                "regions": ["eu", "us"],
                "islands_per_region": 2,
                "h_r": h_r,
                "h_g": h_g,
                "tau": 1,
            },
        }
    )
    torch.set_num_threads(1)
    layout, theta0 = initial_parameters(cfg)
    stream = SampleStream(open_dataset(cfg), cfg.model_config().seq_len, cfg.global_batch, 0)
    seen = _Bytes()
    cluster = model_cluster(cfg, layout, theta0, stream, observer=seen)
    frags = cluster.fragments
    t0 = time.perf_counter()
    theta = cluster.run_lockstep()
    seconds = time.perf_counter() - t0
    islands = set(cfg.topology.island_ids())
    last = cfg.steps
    up = [b for (who, t), b in seen.by_step.items() if who in islands and t < last]
    fwd = [b for (who, t), b in seen.by_step.items() if who not in islands and t < last]
    up_last = [b for (who, t), b in seen.by_step.items() if who in islands and t == last]
    sizes = [f.numel for f in frags] if frags else [layout.numel]
    return {
        "fragments": fragments,
        "numel": layout.numel,
        "largest_fragment_share": max(sizes) / layout.numel,
        "cut": cfg.fragment_cut,
        "params_cut_share": max(f.numel for f in partition(layout, fragments, h_g, "params"))
        / layout.numel,
        "best_whole_cut_share": best_whole_cut(layout, fragments),
        "island_peak_bytes": max(up),
        "island_syncs": len(up) // cfg.topology.n_islands + 1,
        "island_last_step_bytes": max(up_last),
        "island_bytes_total": sum(up),
        "relay_peak_bytes": max(fwd),
        "relay_bytes_total": sum(fwd),
        "seconds": seconds,
        "final_digest": flat_digest(theta),
    }


def best_whole_cut(layout: ParamLayout, fragments: int) -> float:
    """The smallest largest-fragment share any cut of the parameters into ``fragments``
    contiguous runs of whole parameters can reach (the floor of the partition rule's kind;
    exhaustive, by dynamic programming over the cut points)."""
    ends = [*layout.offsets[1:], layout.numel]
    sizes = [b - a for a, b in zip(layout.offsets, ends, strict=True)]
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    count = len(sizes)

    @functools.cache
    def best(first: int, parts: int) -> int:
        if parts == 1:
            return prefix[count] - prefix[first]
        return min(
            max(prefix[cut] - prefix[first], best(cut, parts - 1))
            for cut in range(first + 1, count - parts + 2)
        )

    return best(0, fragments) / layout.numel


@contextlib.contextmanager
def limited_loopback(rate: str | None) -> Iterator[list[str]]:
    """The argv prefix that runs a command in a fresh network namespace whose loopback is
    limited to ``rate`` by a token bucket (none: no prefix, the host's loopback)."""
    if rate is None:
        yield []
        return
    name = f"ht-bench-{os.getpid()}"

    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, text=True)

    sh("ip", "netns", "add", name)
    try:
        sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
           "rate", rate, "burst", "256kb", "latency", "400ms")  # fmt: skip
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


REGIONS = ("eu", "us", "ap", "sa")


def blocked_parts(log: str) -> tuple[float, float, float]:
    """An island's blocked seconds from its log: at its first merge, at the later ones,
    and after its last step (its ``event=sync`` lines' cumulative ``blocked_s``, and its
    ``event=done`` line's)."""
    marks = [float(m) for m in re.findall(r"event=sync .*? blocked_s=([0-9.e-]+)", log)]
    done = re.search(r"event=done .*? blocked_s=([0-9.e-]+)", log)
    assert done is not None
    total = float(done.group(1))
    if not marks:
        return 0.0, 0.0, total
    return marks[0], marks[-1] - marks[0], total - marks[-1]


def net_of_start_skew(blocked: list[float], walls: list[float]) -> tuple[float, float]:
    """The islands' largest start skew and largest blocked share net of it, from each
    island's blocked and wall seconds (its ``event=done`` line).  Every island ends within a
    few tens of milliseconds of the others (at the final merge), so one whose wall time is
    longer by s started training s earlier than the last to start: s it must spend waiting
    for that one, at its first merge or at the end, whatever F is."""
    skews = [w - min(walls) for w in walls]
    net = [(b - s) / w for b, s, w in zip(blocked, skews, walls, strict=True)]
    return max(skews), max(net)


def daemons(
    preset: str,
    fragments: int,
    rounds: int,
    rate: str | None = None,
    topology: str = "2x2",
    step_seconds: float | None = None,
) -> dict[str, Any]:
    """One ``hypertrain up`` run (flat schedule, tau = 1): the islands' blocked shares and
    the parts of their blocked time (``blocked_parts``), and the largest push before the
    last step, from their logs (``rate``: on a loopback limited to it,
    ``limited_loopback``; ``topology``: regions x islands per region; ``step_seconds``: each
    island paced to one step per that many seconds, ``HYPERTRAIN_STEP_SECONDS``)."""
    n_regions, per_region = (int(x) for x in topology.split("x"))
    h = 30
    with (
        tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp,
        limited_loopback(rate) as prefix,
    ):
        run_dir = Path(tmp) / "run"
        argv = [*prefix, sys.executable, "-m", "hypertrain", "up", "--preset", preset]
        argv += ["--steps", str(rounds * h), "--h-r", str(h), "--h-g", str(h), "--tau", "1"]
        argv += ["--batch", "2", "--regions", ",".join(REGIONS[:n_regions])]
        argv += ["--islands-per-region", str(per_region)]
        argv += ["--fragments", str(fragments), "--run-dir", str(run_dir)]
        t0 = time.perf_counter()
        env = dict(os.environ)
        if step_seconds is not None:
            env["HYPERTRAIN_STEP_SECONDS"] = str(step_seconds)
        out = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
        seconds = time.perf_counter() - t0
        if out.returncode != 0:
            raise SystemExit(f"hypertrain up failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        shares, pushes, save_waits, walls, blocked = [], [], [], [], []
        parts: list[tuple[float, float, float]] = []
        for log in sorted((run_dir / "logs").glob("island-*.log")):
            text = log.read_text()
            parts.append(blocked_parts(text))
            done = next(
                (e for e in map(parse_logfmt, text.splitlines()) if e.get("event") == "done"), None
            )
            assert done is not None, log
            shares.append(float(done["blocked_share"]))
            blocked.append(float(done["blocked_s"]))
            walls.append(float(done["wall_s"]))
            if "save_wait_s" in done:
                save_waits.append(float(done["save_wait_s"]))
            for m in re.finditer(r"event=sync .*?step=(\d+) .*?bytes=(\d+)", text):
                if int(m.group(1)) < rounds * h:
                    pushes.append(int(m.group(2)))
        digest = re.search(r"final state digest ([0-9a-f]+)", out.stdout)
    skew, net_share = net_of_start_skew(blocked, walls)
    return {
        "fragments": fragments,
        "topology": topology,
        "save_wait_s_max": max(save_waits) if save_waits else None,
        "rate": rate or "",
        "step_seconds": step_seconds,
        "blocked_share_max": max(shares),
        "blocked_share_mean": sum(shares) / len(shares),
        "start_skew_s_max": skew,
        "blocked_net_share_max": net_share,
        **{
            f"blocked_{name}_s": sum(p[i] for p in parts) / len(parts)
            for i, name in enumerate(("start", "rounds", "end"))
        },
        "push_peak_bytes": max(pushes),
        "seconds": seconds,
        "final_digest": digest.group(1) if digest else "",
    }


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One F's runs: the mean of each measure (the digest and the push peak are the same in
    every run: a check), and each run's largest share."""
    first = runs[0]
    for r in runs[1:]:
        for k in ("final_digest", "push_peak_bytes"):
            if r[k] != first[k]:
                raise SystemExit(f"F = {first['fragments']}: {k} differs between runs")
    out = dict(first)
    for k in ("blocked_share_max", "blocked_share_mean", "blocked_start_s", "blocked_rounds_s",
              "blocked_end_s", "seconds", "start_skew_s_max", "blocked_net_share_max"):  # fmt: skip
        out[k] = sum(r[k] for r in runs) / len(runs)
    out["save_wait_s_max"] = max((r["save_wait_s_max"] or 0.0) for r in runs)
    out["blocked_share_max_runs"] = [r["blocked_share_max"] for r in runs]
    out["blocked_net_share_max_runs"] = [r["blocked_net_share_max"] for r in runs]
    out["runs"] = len(runs)
    return out


def paired(r: dict[str, Any], base: dict[str, Any], key: str = "blocked_share") -> None:
    """Add to ``r`` (one F's summary) its runs' ``<key>_max`` minus F = 1's in the same
    repeat (``<key>_diff_runs``: each repeat runs every F one after the other, so the two
    share the machine's state of that moment), their mean and its standard error
    (``<key>_diff_mean``, ``<key>_diff_se``; 0 with one repeat)."""
    diffs = [a - b for a, b in zip(r[f"{key}_max_runs"], base[f"{key}_max_runs"], strict=True)]
    n = len(diffs)
    r[f"{key}_diff_runs"] = diffs
    r[f"{key}_diff_mean"] = statistics.fmean(diffs)
    r[f"{key}_diff_se"] = statistics.stdev(diffs) / n**0.5 if n > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="proxy")
    ap.add_argument("--rounds", type=int, default=3, help="global rounds per run (>= 2)")
    ap.add_argument("--daemons", action="store_true", help="also the blocked share (up runs)")
    ap.add_argument(
        "--rate",
        default=None,
        help="with --daemons: also on a loopback limited to RATE (tc tbf), e.g. 40mbit",
    )
    ap.add_argument("--topology", default="2x2", help="with --daemons: REGIONSxISLANDS, "
                    "e.g. 1x2 (one island per core here)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3, help="with --daemons: runs per F")
    ap.add_argument("--fragments", default="1,2,4", help="with --daemons: the fragment counts "
                    "to run, comma-separated, 1 among them (the baseline)")  # fmt: skip
    ap.add_argument("--step-seconds", type=float, default=None, help="with --daemons: pace "
                    "each island to one step per this many seconds (HYPERTRAIN_STEP_SECONDS)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not re.fullmatch(r"[1-4]x[1-9]", args.topology):
        ap.error(f"--topology takes REGIONSxISLANDS (1-4 regions), got {args.topology!r}")
    if args.step_seconds is not None and not args.step_seconds > 0:
        ap.error(f"--step-seconds takes a positive number of seconds, got {args.step_seconds}")
    if not re.fullmatch(r"[1-9](,[1-9])*", args.fragments) or "1" not in args.fragments.split(","):
        ap.error(
            f"--fragments takes counts like 1,4 (with 1, the baseline), got {args.fragments!r}"
        )
    if args.rounds < 2:
        ap.error("--rounds must be >= 2: the peak is taken over the steps before the last")
    res: dict[str, Any] = {
        "preset": args.preset,
        "tau": 1,
        "rounds": args.rounds,
        "machine": platform.machine(),
        "schedules": {},
    }
    for name, (h_r, h_g) in SCHEDULES.items():
        runs = [measure(args.preset, f, h_r, h_g, args.rounds) for f in (1, 2, 4)]
        base = runs[0]
        print(f"{name} (H_r = {h_r}, H_g = {h_g}, tau = 1), {args.preset}, {base['numel']} values")
        for r in runs:
            r["island_peak_ratio"] = r["island_peak_bytes"] / base["island_peak_bytes"]
            r["relay_peak_ratio"] = r["relay_peak_bytes"] / base["relay_peak_bytes"]
            print(
                f"  F = {r['fragments']}: island peak {r['island_peak_bytes'] / 1024:8.1f} KiB "
                f"per sync ({r['island_peak_ratio']:.3f} of F = 1), relay forward peak "
                f"{r['relay_peak_bytes'] / 1024:8.1f} KiB ({r['relay_peak_ratio']:.3f}); "
                f"largest fragment {r['largest_fragment_share']:.3f} of the values (cut "
                f"{r['cut']}; the params cut's {r['params_cut_share']:.3f}, the best at whole "
                f"parameters {r['best_whole_cut_share']:.3f}); "
                f"{r['island_syncs']} syncs per island, "
                f"{r['island_last_step_bytes'] / 1024:.1f} KiB at the last step; "
                f"{r['seconds']:.1f} s"
            )
        res["schedules"][name] = {"h_r": h_r, "h_g": h_g, "runs": runs}
    if args.rate is not None and not args.daemons:
        ap.error("--rate goes with --daemons")
    for key, rate in (("daemons", None), ("daemons_limited", args.rate)):
        if not args.daemons or (key == "daemons_limited" and rate is None):
            continue
        fs = tuple(sorted({int(f) for f in args.fragments.split(",")}))
        runs: dict[int, list[dict[str, Any]]] = {f: [] for f in fs}
        for k in range(args.repeats):  # F's order turned by one each time
            for f in fs[k % len(fs) :] + fs[: k % len(fs)]:
                runs[f].append(
                    daemons(
                        args.preset,
                        f,
                        args.rounds,
                        rate,
                        args.topology,
                        args.step_seconds,
                    )
                )
        up = [summarize_runs(runs[f]) for f in fs]
        link = f"loopback limited to {rate}" if rate else "loopback"
        if args.step_seconds is not None:
            link += f", islands paced to {args.step_seconds} s a step"
        print(f"daemons (hypertrain up {args.topology}, H_r = H_g = 30, tau = 1, {link}, "
              f"{args.repeats} runs per F), {args.preset}")  # fmt: skip
        for r in up:
            paired(r, up[0])
            paired(r, up[0], "blocked_net_share")
            r["blocked_share_ratio"] = r["blocked_share_max"] / up[0]["blocked_share_max"]
            r["push_peak_ratio"] = r["push_peak_bytes"] / up[0]["push_peak_bytes"]
            each = ", ".join(f"{100 * x:.1f}" for x in r["blocked_share_max_runs"])
            print(
                f"  F = {r['fragments']}: islands blocked at most {100 * r['blocked_share_max']:.1f}% "
                f"(runs {each}; mean over islands {100 * r['blocked_share_mean']:.1f}%; "
                f"{r['blocked_share_ratio']:.2f} of F = 1's; against F = 1 in the same repeat "
                f"{100 * r['blocked_share_diff_mean']:+.2f} +- {100 * r['blocked_share_diff_se']:.2f} "
                f"points; net of the start skew (a run's largest {r['start_skew_s_max']:.3f} s) "
                f"{100 * r['blocked_net_share_max']:.2f}%, against F = 1 "
                f"{100 * r['blocked_net_share_diff_mean']:+.2f} +- "
                f"{100 * r['blocked_net_share_diff_se']:.2f} points); per island "
                f"{r['blocked_start_s']:.3f} s at its first merge, {r['blocked_rounds_s']:.3f} s at "
                f"the later ones, {r['blocked_end_s']:.3f} s at the end; largest push "
                f"{r['push_peak_bytes'] / 1024:.1f} KiB ({r['push_peak_ratio']:.3f}); "
                f"{r['seconds']:.0f} s a run"
            )
        res[key] = up
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
