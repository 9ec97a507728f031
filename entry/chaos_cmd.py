"""``hypertrain sim chaos``: the deterministic fault simulation of the whole cluster.

    hypertrain sim chaos --seeds 10000              # seeds 0..9999 on the toy model
    hypertrain sim chaos --seed 17 --trace          # one schedule: its events, the first broken invariant
    hypertrain sim chaos --model tiny --seeds 20    # the real tiny model
    hypertrain sim chaos --seeds 200 --plant count_duplicate_twice   # show that it finds a bug

Prints ``N schedules, K events, V invariant violations`` and, for each violation, its
seed and the invariant; exits 1 if any.  ``--json FILE`` also writes the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hypertrain.common import planted


def cmd_chaos(args: argparse.Namespace) -> int:
    from hypertrain.sim.chaos.runner import Outcome, run_schedule, run_seeds

    if args.seed is not None:
        planted.enable(args.plant)
        o = run_schedule(args.seed, args.model, trace=args.trace)
        if args.trace:
            print(f"seed {o.seed}: config {json.dumps(o.config, sort_keys=True)}")
            for line in o.trace:
                print(line)
        print(
            f"1 schedules, {o.events} events, {int(o.violation is not None)} invariant violations"
        )
        if o.violation:
            print(f"seed {o.seed}: {o.violation}")
        return 1 if o.violation else 0

    def progress(o: Outcome) -> None:
        if o.violation and not args.quiet:
            print(f"seed {o.seed}: {o.violation}", flush=True)

    first = args.first
    s = run_seeds(
        range(first, first + args.seeds),
        args.model,
        processes=args.processes,
        plant=args.plant,
        on_outcome=progress,
    )
    print(s.line() + f" ({s.seconds:.1f} s, {s.schedules / max(s.seconds, 1e-9):.1f} schedules/s)")
    if args.json:
        doc: dict[str, Any] = {
            "schedules": s.schedules,
            "events": s.events,
            "violations": [{"seed": o.seed, "violation": o.violation} for o in s.violations],
            "seconds": s.seconds,
            "model": args.model,
            "plant": args.plant,
            "first_seed": first,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if s.violations:
        worst = s.violations[0]
        print(f"reproduce: hypertrain sim chaos --seed {worst.seed} --trace", file=sys.stderr)
    return 1 if s.violations else 0


def register(sub: Any) -> None:
    """Add ``chaos`` to the ``hypertrain sim`` subcommands."""
    from pathlib import Path

    p = sub.add_parser("chaos", help="the deterministic fault simulation of a whole cluster")
    p.add_argument("--seeds", type=int, default=100, help="how many schedules (default 100)")
    p.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--seed", type=int, help="run this one schedule")
    p.add_argument("--trace", action="store_true", help="with --seed: print every event")
    p.add_argument("--model", default="toy", help="toy (default) or a model preset, e.g. tiny")
    p.add_argument("--processes", type=int, default=2, help="worker processes (default 2)")
    p.add_argument(
        "--plant", choices=planted.KNOWN, help="turn on a known bug (to show it is found)"
    )
    p.add_argument("--quiet", action="store_true", help="no line per violation")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.set_defaults(func=cmd_chaos)
