"""Speed of the fault simulation (``hypertrain sim chaos``) at the toy size.

    .venv/bin/python bench/bench_chaos.py [--seeds 300] [--json experiments/results/bench_chaos.json]

Runs the first ``--seeds`` fault schedules in this process (one core) and, as the
baseline measured in the same run, the same clusters without faults, stores, tapes or
audit (the in-process cluster in lockstep, which is what ``hypertrain run --local``
does): the ratio says what the faults, the durable nodes, the invariant checks and the
audit cost on top of the round engine itself.  It reports events per second and
schedules per second, and what 10,000 schedules take on 2 worker processes (the
schedules are independent, so two workers halve the time on two idle cores).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.local import Cluster
from hypertrain.common.toy import ToyIsland
from hypertrain.sim.chaos.faults import draw_config
from hypertrain.sim.chaos.runner import run_schedule

SLOW_SEEDS = 10_000
WORKERS = 2


def _fault_free(seed: int) -> float:
    cfg = draw_config(random.Random(seed), seed)
    t0 = time.perf_counter()
    _, theta0 = initial_parameters(cfg)
    Cluster(cfg, theta0, lambda i: ToyIsland(cfg, i, theta0)).run_lockstep()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    run_schedule(0)  # warm up (imports, caches)
    seeds = range(args.seeds)
    base = sum(_fault_free(s) for s in seeds)
    t0 = time.perf_counter()
    events, violations = 0, 0
    for s in seeds:
        o = run_schedule(s)
        events += o.events
        violations += o.violation is not None
    chaos = time.perf_counter() - t0
    per_schedule = chaos / args.seeds
    projected = per_schedule * SLOW_SEEDS / WORKERS
    rows = {
        "seeds": args.seeds,
        "events": events,
        "violations": violations,
        "seconds_chaos": round(chaos, 3),
        "seconds_fault_free": round(base, 3),
        "ratio_to_fault_free": round(chaos / base, 2),
        "events_per_second": round(events / chaos, 1),
        "schedules_per_second": round(args.seeds / chaos, 2),
        "projected_10000_seeds_2_workers_s": round(projected, 1),
    }
    print(f"{'figure':40s} {'value':>12s}")
    print(f"{'fault-free in-process runs, seconds':40s} {base:12.2f}   <- baseline")
    print(f"{'fault schedules, seconds':40s} {chaos:12.2f}")
    print(f"{'ratio to the fault-free runs':40s} {chaos / base:12.2f}")
    print(f"{'events per second (one core)':40s} {events / chaos:12.0f}")
    print(f"{'schedules per second (one core)':40s} {args.seeds / chaos:12.2f}")
    print(f"{'10,000 seeds on 2 workers, seconds':40s} {projected:12.0f}")
    print(f"{'invariant violations':40s} {violations:12d}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
