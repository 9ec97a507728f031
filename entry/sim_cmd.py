"""``hypertrain sim``: the parity grid of docs/design.md §7, its summary, its pre-registration,
the device check; and ``chaos``, the fault simulation (chaos_cmd.py).

    hypertrain sim prereg --check [PATH]             # the registered files match their hashes
    hypertrain sim prereg --write-prereg [PATH]      # register the design (a new hash)
    hypertrain sim grid --scale cpu-tiny [--processes 2] [--wall-cap 2000] [--max-jobs N]
                        [--out DIR] [--device cuda] [--prereg PATH]
    hypertrain sim summarize --scale cpu-tiny [--out DIR] [--no-plots]   # alias: summary
    hypertrain sim grid --scale full --shard I/N --out SHARED   # one of N machines; then summarize
    hypertrain sim grid --prereg experiments/sim/churn_prereg.json --scale cpu-tiny
    hypertrain sim grid --prereg experiments/sim/parity2_prereg.json --scale cpu-tiny
    hypertrain sim device-check --device cuda [--scale cpu-tiny] [--steps 60]
    hypertrain sim cross-check --scale cpu-tiny --with DIR   # shared jobs, bit for bit

``grid`` resumes from its results folder (default experiments/results/<study>-<scale>,
the study named by the registration file: parity, or churn for churn_prereg.json):
jobs already done or divergent there are not run again; a design with verdict seeds
(parity2_prereg.json) runs each arm's verdict jobs once its eta is chosen, in the same
invocation; it writes the summary and
the plots at the end (a shard does not: the others may still be writing).  Caps
(processes, wall clock) are the registered ones and may only be lowered.  The device ($HYPERTRAIN_SIM_DEVICE or --device) is outside the
design hash; ``device-check`` runs real grid jobs of the scale, shortened, on CPU
and on the device and refuses a device that disagrees beyond 0.05% relative.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hypertrain import chaos_cmd

_PROG = "hypertrain sim"


def _common(p: argparse.ArgumentParser, scale_default: str | None = None) -> None:
    p.add_argument("--scale", required=scale_default is None, default=scale_default,
                   help="a scale the --prereg design registers (parity: full | cpu-tiny | "
                        "smoke; parity2, churn: cpu-tiny | smoke; h2: proxy | smoke)")  # fmt: skip
    p.add_argument("--prereg", type=Path, default=None,
                   help="pre-registration file (default experiments/sim/parity_prereg.json)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default experiments/results/<study>-<scale>, the "
                        "study named by the registration file: parity, parity2, churn, h2)")  # fmt: skip


def cmd_grid(args: argparse.Namespace) -> int:
    from hypertrain.sim.study.grid import parse_shard, run_grid
    from hypertrain.sim.study.summary import summarize

    shard = parse_shard(args.shard) if args.shard is not None else None
    rep = run_grid(
        args.prereg, args.scale, args.out, processes=args.processes, wall_cap_s=args.wall_cap,
        max_jobs=args.max_jobs, device=args.device, path=args.path, shard=shard,
        poll_s=args.poll, checkpoint_every_s=args.checkpoint_every or None,
    )  # fmt: skip
    if shard is not None:  # the other shards may still be writing: summarize once all are done
        print(f"shard {shard[0]} of {shard[1]} done; when every shard is, run "
              f"`hypertrain sim summarize --scale {args.scale}` on the results folder")  # fmt: skip
        return 0 if rep.counts["error"] == 0 else 1
    summary = summarize(args.prereg, args.scale, args.out, plots=not args.no_plots)
    _print_verdicts(summary)
    return 0 if rep.counts["error"] == 0 else 1


def cmd_summarize(args: argparse.Namespace) -> int:
    from hypertrain.sim.study.summary import summarize

    _print_verdicts(summarize(args.prereg, args.scale, args.out, plots=not args.no_plots))
    return 0


def cmd_cross_check(args: argparse.Namespace) -> int:
    from hypertrain.sim.study.grid import RUNS_FILE, default_out, runs_files
    from hypertrain.sim.study.summary import CROSS_CHECK_FILE, cross_check

    out = args.out if args.out is not None else default_out(args.scale, args.prereg)
    for d in (out, args.other):
        if not runs_files(Path(d)):
            print(f"{_PROG} cross-check: no {RUNS_FILE} in {d}", file=sys.stderr)
            return 2
    r = cross_check(out, args.other)
    print(f"cross-check: {r['shared_jobs']} shared jobs, {r['identical']} identical, "
          f"{len(r['differing'])} differ; {Path(out) / CROSS_CHECK_FILE}")  # fmt: skip
    if not r["shared_jobs"]:
        print(f"{_PROG} cross-check: the two folders share no finished job", file=sys.stderr)
        return 1
    return 0 if not r["differing"] else 1


def _print_verdicts(s: dict[str, Any]) -> None:
    c = s["counts"]
    print(
        f"summary {s['scale']['name']} (design {s['prereg']['design_sha256'][:12]}): "
        f"{c['total']} jobs: done {c['done']}, divergent {c['divergent']}, error {c['error']}, "
        f"censored {c['censored']}"
    )
    cov = s.get("coverage", {})
    print(f"  cells complete {len(cov.get('complete', []))}, partial "
          f"{len(cov.get('partial', []))}, not run {len(cov.get('not_run', []))}")  # fmt: skip
    neg = s.get("negative_control") or {}
    if neg:
        print(f"  negative control {neg['cell']}: {neg['verdict']}")
    for hid, h in s.get("h1", {}).items():
        n_r, n_n = (h["result"][k]["tost"]["ci"]["n"] for k in ("vs_flat_r", "vs_flat_n"))
        print(f"  H1 {hid}: vs {h['flat_r']} ({n_r} paired seeds): {h['verdict_vs_flat_r']}; "
              f"vs {h['flat_n']} ({n_n} paired seeds): {h['verdict_vs_flat_n']}")  # fmt: skip
    for hg, h in s.get("h2", {}).items():
        if h["trend"]["n"] >= 2:  # one M (a churn registration): no trend to test
            print(f"  H2 {hg}: {h['verdict']}")
    for r in s.get("h3", {}).get("ranking", []):
        word = "promoted" if r["promoted"] else "not promoted"
        print(f"  H3 #{r['rank']} {r['cell']}: {word} ({r['reason']})")
    for hg, h in s.get("h4", {}).items():
        if h["trend"]["n"] >= 2:
            print(f"  H4 {hg}: {h['verdict']}")
    for cid, c in s.get("churn", {}).items():
        ci = c["cost"]["tost"]["ci"]
        cost = "n/a" if ci["mean"] is None else f"{100 * ci['mean']:+.2f}%"
        print(f"  churn {cid}: vs {c['baseline']} ({ci['n']} paired seeds): cost {cost}, "
              f"{c['verdict']}; vs DP: {s['cells'][cid]['verdict']}")  # fmt: skip


def cmd_prereg(args: argparse.Namespace) -> int:
    from hypertrain.sim.study import prereg

    argv = ["--check"] if args.check is not None else ["--write-prereg"]
    path = args.check if args.check is not None else args.write_prereg
    if path:
        argv.append(path)
    return prereg.main(argv)


def cmd_device_check(args: argparse.Namespace) -> int:
    from hypertrain.sim.engine.device import (
        DEFAULT_REL_TOL,
        DeviceMismatch,
        device_equivalence_check,
    )
    from hypertrain.sim.study.grid import default_out, load_checked, plan_jobs

    pre = load_checked(args.prereg)
    jobs = plan_jobs(pre.design, args.scale)
    # A few real arms, one seed and the middle eta of each sweep: DP, flat, hierarchy, mechanisms.
    picked, kinds = [], set()
    for j in jobs:
        sweep = pre.design.sweep(j.cell, args.scale)
        mid = sweep[len(sweep) // 2] if sweep else None
        tag = (j.cell.kind, j.cell.inner, j.cell.fragments > 1)
        if j.seed == pre.design.seeds[0] and j.eta == mid and tag not in kinds:
            kinds.add(tag)
            picked.append(j.sim)
    picked = picked[: args.max_jobs]
    rel = args.rel_tol if args.rel_tol is not None else DEFAULT_REL_TOL
    print(f"device check: {len(picked)} jobs of scale {args.scale}, ~{args.steps} steps each, "
          f"cpu vs {args.device}, tolerance {rel:.4%} relative")  # fmt: skip
    out = args.out if args.out is not None else default_out(args.scale, args.prereg)
    try:
        report = device_equivalence_check(picked, args.device, rel, steps=args.steps)
        ok = True
    except DeviceMismatch as e:
        print(f"{_PROG} device-check: FAILED: {e}", file=sys.stderr)
        return 1
    for row in report.rows:
        print(f"  {row['key']}: cpu {row['cpu_loss']} {args.device} {row['device_loss']} "
              f"rel {row['rel_diff']}")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    print(f"device check {'ok' if ok else 'FAILED'}: {args.device} agrees with cpu within "
          f"{rel:.4%} on {len(report.rows)} jobs; report {out / 'device_check.json'}")  # fmt: skip
    return 0


def register(sub: Any) -> None:
    """Add ``sim`` and its subcommands to the top-level subparsers."""
    sim = sub.add_parser(
        "sim", help="the simulator: parity grid, summary, prereg (docs/design.md §7); chaos"
    )
    ss = sim.add_subparsers(dest="sim_command", required=True)

    g = ss.add_parser("grid", help="run (or resume) the registered grid of a scale")
    _common(g)
    g.add_argument("--processes", type=int, help="worker processes (<= the registered cap)")
    g.add_argument("--wall-cap", type=float, metavar="S",
                   help="start no job after S seconds (<= the registered cap)")  # fmt: skip
    g.add_argument("--max-jobs", type=int, metavar="N", help="start at most N jobs this time")
    g.add_argument("--device", help="cpu | cuda | cuda:N (default $HYPERTRAIN_SIM_DEVICE, cpu)")
    g.add_argument("--path", choices=("batched", "per_replica"), default="batched")
    g.add_argument("--shard", metavar="I/N",
                   help="run shard I (0-based) of N: every N-th job of the plan from the I-th, "
                        "writing files of its own, so N machines can share one --out")  # fmt: skip
    g.add_argument("--poll", type=float, default=30.0, metavar="S",
                   help="a shard whose verdict jobs wait for another shard's selection jobs "
                        "looks at --out every S seconds (default 30)")  # fmt: skip
    g.add_argument("--checkpoint-every", type=float, default=300.0, metavar="S",
                   help="a job in flight saves its state to <out>/checkpoints every S seconds "
                        "and resumes from it after an interruption (default 300; 0: never)")  # fmt: skip
    g.add_argument("--no-plots", action="store_true")
    g.set_defaults(func=cmd_grid)

    s = ss.add_parser(
        "summarize", aliases=["summary"], help="write parity_grid.csv, summary.json and the plots"
    )
    _common(s)
    s.add_argument("--no-plots", action="store_true")
    s.set_defaults(func=cmd_summarize)

    p = ss.add_parser("prereg", help="check or write the pre-registration file")
    grp = p.add_mutually_exclusive_group(required=True)
    grp.add_argument("--check", nargs="?", const="", metavar="PATH",
                     help="verify PATH; without PATH every registration of the repository")  # fmt: skip
    grp.add_argument("--write-prereg", nargs="?", const="", metavar="PATH")
    p.set_defaults(func=cmd_prereg)

    d = ss.add_parser("device-check", help="CPU-vs-device equivalence on shortened grid jobs")
    _common(d, scale_default="cpu-tiny")
    d.add_argument("--device", default="cuda")
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--max-jobs", type=int, default=4)
    d.add_argument("--rel-tol", type=float, default=None, help="default 5e-4 (0.05%%)")
    d.set_defaults(func=cmd_device_check)

    x = ss.add_parser("cross-check", help="compare the jobs two results folders share, exactly")
    _common(x)
    x.add_argument("--with", dest="other", type=Path, required=True, metavar="DIR",
                   help="the other results folder")  # fmt: skip
    x.set_defaults(func=cmd_cross_check)

    chaos_cmd.register(ss)
