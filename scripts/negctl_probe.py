#!/usr/bin/env python3
"""Where the negative control leaves its DP control, seed by seed.

    .venv/bin/python scripts/negctl_probe.py 100 110 116 117 \
        --out experiments/results/parity2-cpu-tiny/negctl_probe.json

Reruns a registration's negative-control job and its DP control job at each seed, the
DP control with its evaluation cadence set to the negative control's (the same
evaluation steps, about eight in a run), so that the two held-out curves are evaluated
at the same steps (the cadence changes no training step), and writes both curves and
their relative difference per step.  Both reruns must reproduce the final held-out
losses of the grid's rows, of this registration's design, bit for bit (checked).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hypertrain.sim.engine.job import SimJob
from hypertrain.sim.engine.run import run_job
from hypertrain.sim.study.grid import default_out, job_for, load_checked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("seeds", nargs="+", type=int)
    ap.add_argument("--prereg", default="experiments/sim/parity2_prereg.json")
    ap.add_argument("--scale", default="cpu-tiny")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    pre = load_checked(args.prereg)
    design = pre.design
    scale = design.scale(args.scale)
    neg_cell = next(c for c in design.cells_of(args.scale) if c.kind == "negative_control")
    ctl_cell = next(c for c in design.cells_of(args.scale) if c.id == neg_cell.control)
    rows_file = default_out(args.scale, args.prereg) / "parity_runs.jsonl"
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line]
    result: dict[str, object] = {
        "prereg": Path(args.prereg).name, "scale": args.scale, "negative_control": neg_cell.id,
        "control": ctl_cell.id, "seeds": {},
    }  # fmt: skip
    (eta,) = design.sweep(neg_cell, args.scale)  # the negative control has one eta
    for seed in args.seeds:
        neg = run_job(job_for(design, scale, neg_cell, seed, eta)).to_dict()
        ctl_job = job_for(design, scale, ctl_cell, seed, None).to_dict()
        ctl_job["h_r"], ctl_job["h_g"] = neg_cell.h_r, neg_cell.h_g  # evaluate where neg does
        ctl = run_job(SimJob.from_dict(ctl_job)).to_dict()
        for cell, res in ((neg_cell, neg), (ctl_cell, ctl)):
            grid = [r for r in rows if r["cell"] == cell.id and r["seed"] == seed
                    and r["design_sha256"] == pre.design_sha256 and r["status"] == "done"]  # fmt: skip
            if not grid or grid[-1]["final_loss"] != res["final_loss"]:
                print(f"negctl_probe: seed {seed}: the rerun of {cell.id} differs from the "
                      "grid's row (or the grid has none)", file=sys.stderr)  # fmt: skip
                return 1
        steps = []
        for (s, a), (s2, b) in zip(neg["curve"], ctl["curve"], strict=True):
            assert s == s2, (s, s2)
            steps.append({"step": s, "negative_control": a, "control": b, "rel": (a - b) / b})
        result["seeds"][str(seed)] = {  # type: ignore[index]
            "steps": steps, "final_rel": steps[-1]["rel"], "first_rel": steps[0]["rel"],
            "first_step": steps[0]["step"],
        }  # fmt: skip
        print(f"seed {seed}: " + ", ".join(f"{x['step']}: {x['rel']:+.1e}" for x in steps))
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
