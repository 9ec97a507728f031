"""How much of the in-process reference run is spent outside training.

    .venv/bin/python bench/bench_reference.py [--steps 60] [--json experiments/results/bench_reference.json]

Runs the reference run on the ``proxy`` preset with 4 islands (2 regions x 2)
and reports the share of wall time spent outside forward/backward/optimizer
steps (codecs, aggregation, digests, merges) against the training time of the
same run: the target is under 5%.  Held-out evaluation is reported apart (it
is measurement, not training).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.reference import run_reference

TARGET = 0.05


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--codec", default="int8", help="regional codec")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cfg = RunConfig(
        model="proxy", steps=args.steps, regional_codec=args.codec, batch_per_island=8
    ).with_overrides(**{"topology.h_r": 5, "topology.h_g": 10})
    res = run_reference(cfg)
    busy = res.seconds_train + res.seconds_sync
    share = res.seconds_sync / busy
    rows = {
        "preset": cfg.model,
        "islands": cfg.topology.n_islands,
        "steps": cfg.steps,
        "regional_codec": cfg.regional_codec,
        "seconds_train": round(res.seconds_train, 3),
        "seconds_sync": round(res.seconds_sync, 3),
        "seconds_eval": round(res.seconds_eval, 3),
        "sync_share": round(share, 5),
        "target": TARGET,
        "pass": share < TARGET,
    }
    print(f"{'figure':32s} {'value':>10s}")
    print(f"{'train (fwd/bwd/opt) seconds':32s} {res.seconds_train:10.2f}   <- baseline")
    print(f"{'sync (codec/aggregate/digest) s':32s} {res.seconds_sync:10.3f}")
    print(
        f"{'sync share of train+sync':32s} {share:10.4f}   target < {TARGET}  "
        f"{'PASS' if share < TARGET else 'FAIL'}"
    )
    print(f"{'held-out eval seconds (apart)':32s} {res.seconds_eval:10.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
