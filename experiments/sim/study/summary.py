"""The grid's outputs: ``parity_grid.csv`` and ``summary.json`` (docs/design.md §7.11), from
the rows on disk.

    from hypertrain.sim.study.summary import summarize
    summary = summarize(None, "cpu-tiny")   # any time, also while the grid runs

Every number comes from stats.py; this module only pairs the rows into the
registered comparisons.  ``summary.json`` holds, keyed for the doc checker:

- ``eta_edges``: the swept cells whose chosen eta is the lowest or the highest of their
  sweep (not bracketed on that side) and those chosen inside it, with counts.
- ``counts``: done / divergent / error / censored over the registered jobs;
  ``prereg`` (hash, time, file), ``scale`` (the registered scale), ``invocations``.
- ``cells[<id>]``: the chosen eta (``select_outer_lr``, with the winner's-curse
  note at the top level), per-seed losses, ``vs_control`` (the DP control at the
  matched inner lr: the primary verdict) and ``vs_best_control`` (the better of
  the two control lrs: the sensitivity verdict), each with gaps, the 90% CI,
  TOST and power; ``verdict`` / ``verdict_sensitivity`` are the exact words of
  docs/design.md §7.4.
- ``negative_control``, ``h1[<hierarchy>]`` (vs flat M = R and flat M = R * n_r),
  ``h2["Hg<h>"]`` (best eta vs M), ``h3`` (ranking, promotion rule, promoted),
  ``h4["Hg<h>"]`` (mean gap vs M, with per-M CIs), ``power`` (one line per verdict).
- ``churn[<cell>]`` (a churn registration): the cost of churn, the churn arm against its
  no-churn baseline, each at its chosen eta, paired by seed ((L_churn - L_base) / L_base,
  CI, TOST at the same margin, power), the same difference at each eta of the sweep, and
  the absences the runs drew (per seed: sync steps, absences, rate, steps that waited for
  a late island to reach the quorum).

A comparison missing data (a censored, error or divergent seed) is computed on
the seeds both arms have and says which are missing; with fewer than two seeds
its verdict is "equivalence not demonstrated" (classification ``undefined``).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hypertrain.sim.study.grid import (
    INVOCATIONS_FILE,
    GridJob,
    check_folder,
    default_out,
    eta_choices,
    load_checked,
    plan_with_rows,
    read_rows,
    runs_files,
    verdict_waiting,
    verdict_waiting_cells,
)
from hypertrain.sim.study.prereg import Cell, Design, Prereg
from hypertrain.sim.study.stats import (
    EtaChoice,
    Losses,
    best_control,
    compare,
    h1_test,
    h2_eta_trend,
    h4_gap_trend,
    paired_ci,
    rank_mechanisms,
    to_jsonable,
)

CSV_FILE = "parity_grid.csv"
SUMMARY_FILE = "summary.json"
WINNERS_CURSE = (
    "The outer lr of each cell is chosen on the same seeds its verdict is computed on "
    "(lowest mean held-out loss among non-divergent etas, ties to the smaller eta). "
    "Taking the minimum of several noisy means biases the reported loss of a swept cell "
    "downward (the winner's curse): its gap to the unswept DP control is optimistic, "
    "by up to the spread of the eta means; docs/design.md §7.6 accepts this bias and requires "
    "saying so."
)
WINNERS_CURSE_FRESH = (
    "The outer lr of each arm (and the best DP learning rate of the sensitivity comparison) "
    "is chosen on the selection seeds alone; every verdict is computed on the fresh verdict "
    "seeds, run after the choice at the chosen eta, so the reported gaps carry no winner's "
    "curse.  Each arm's winners_curse entry gives its gap on the selection seeds beside "
    "its gap on the verdict seeds.  Their difference is the bias the choice would have "
    "added plus the sampling error of the few selection seeds' gap, which every arm shares "
    "in part through the same DP control runs (each control's selection_mean_loss beside "
    "its mean_loss shows how far its selection seeds stray); winners_curse_over_arms sums "
    "the differences up over the arms and splits them into the control's term and the rest "
    "(the arm's own change: the choice's bias and the arm's chance)."
)
CSV_COLUMNS = (
    "job_id", "cell", "kind", "seed", "eta", "status", "final_loss", "final_loss_raw",
    "initial_loss", "steps_done", "diverged_at", "wall_s", "steps_per_s", "path", "device",
    "key", "reason", "error", "finished_utc",
)  # fmt: skip


def _csv_rows(jobs: list[GridJob], latest: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for j in jobs:
        r = latest.get(j.job_id)
        base = {"job_id": j.job_id, "cell": j.cell.id, "kind": j.cell.kind, "seed": j.seed}
        base.update(eta=j.eta, key=j.sim.key(), status="censored")
        if r is not None:
            base.update({k: r.get(k) for k in CSV_COLUMNS if k in r})
        out.append({k: ("" if base.get(k) is None else base.get(k)) for k in CSV_COLUMNS})
    return out


def _cell_info(c: Cell) -> dict[str, Any]:
    keys = ("kind", "m", "regions", "islands_per_region", "h_g", "h_r", "outer", "inner",
            "inner_lr", "fragments", "tau", "anneal", "lawa", "control", "control_alt")  # fmt: skip
    info = {k: getattr(c, k) for k in keys}
    if c.kind == "churn":
        info.update(drop=c.drop, baseline=c.baseline)
    return info


def _job_counts(jobs: list[GridJob], latest: Mapping[str, dict[str, Any]]) -> dict[str, int]:
    counts = {"total": len(jobs), "done": 0, "divergent": 0, "error": 0, "censored": 0}
    for j in jobs:
        counts[latest.get(j.job_id, {}).get("status", "censored")] += 1
    return counts


def _losses_of(
    design: Design, scale: str, jobs: list[GridJob], latest: Mapping[str, dict[str, Any]]
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]], dict[str, EtaChoice]]:
    """(per cell, the per-seed held-out losses its verdicts use (arms: at the chosen eta);
    the same on the selection seeds; the eta choices).  Without verdict seeds the two are
    the same seeds."""
    choices = eta_choices(design, scale, jobs, latest)
    selection: dict[str, dict[int, float]] = {c: ch.losses for c, ch in choices.items()}
    verdict: dict[str, dict[int, float]] = {}
    for j in jobs:
        r = latest.get(j.job_id)
        if j.verdict and r is not None and r["status"] == "divergent":
            # A verdict seed that diverged is never dropped: its NaN makes every comparison
            # with it undefined, so "equivalence not demonstrated" (docs/design.md §7.4).
            verdict.setdefault(j.cell.id, {})[j.seed] = math.nan
            continue
        if r is None or r["status"] != "done" or r.get("final_loss") is None:
            continue  # error, censored: missing; a selection seed that diverged: see select
        if j.verdict:
            verdict.setdefault(j.cell.id, {})[j.seed] = float(r["final_loss"])
        elif j.eta is None:
            selection.setdefault(j.cell.id, {})[j.seed] = float(r["final_loss"])
    if not design.verdict_seeds:
        return selection, selection, choices
    for c in design.cells_of(scale):
        verdict.setdefault(c.id, {})
    return verdict, selection, choices


def _comparisons(
    design: Design,
    scale: str,
    losses: Mapping[str, Losses],
    selection: Mapping[str, Losses],
    choices: Mapping[str, EtaChoice],
) -> dict[str, Any]:
    """Per cell, its verdicts on ``losses``; the best control (sensitivity) is chosen on
    ``selection`` (with verdict seeds, the selection seeds' losses)."""
    delta, alpha = design.margins.heldout_rel, design.alpha
    in_scale = {c.id for c in design.cells_of(scale)}
    fresh = bool(design.verdict_seeds)
    cells: dict[str, Any] = {}
    for c in design.cells_of(scale):
        entry: dict[str, Any] = _cell_info(c)
        entry["losses"] = losses.get(c.id, {})
        vals = list(entry["losses"].values())
        entry["mean_loss"] = math.fsum(vals) / len(vals) if vals else None
        if fresh:
            entry["selection_losses"] = selection.get(c.id, {})
            chosen = list(entry["selection_losses"].values())
            entry["selection_mean_loss"] = math.fsum(chosen) / len(chosen) if chosen else None
        if c.kind != "control" and c.control is not None:
            ch = choices[c.id]
            entry["chosen_eta"] = ch.eta
            entry["eta_selection"] = ch
            primary = compare(c.id, losses.get(c.id, {}), c.control, losses.get(c.control, {}),
                              delta, alpha)  # fmt: skip
            ctrls = [x for x in c.sensitivity_controls() if x in in_scale]
            best = best_control(selection, ctrls)
            sens = compare(c.id, losses.get(c.id, {}), best, losses.get(best, {}), delta, alpha)
            entry.update(
                vs_control=primary, verdict=primary.tost.verdict, best_control=best,
                vs_best_control=sens, verdict_sensitivity=sens.tost.verdict,
                power=primary.power,
            )  # fmt: skip
            if fresh:  # the winner's curse, measured: the same gap on the seeds that chose
                sel = compare(c.id, selection.get(c.id, {}), c.control,
                              selection.get(c.control, {}), delta, alpha)  # fmt: skip
                entry["selection_vs_control"] = sel
                a, b = sel.tost.ci, primary.tost.ci
                entry["winners_curse"] = {
                    "selection_gap": a.mean if a.n else None, "selection_n": a.n,
                    "verdict_gap": b.mean if b.n else None, "verdict_n": b.n,
                    "verdict_minus_selection": b.mean - a.mean if a.n and b.n else None,
                }  # fmt: skip
        cells[c.id] = entry
    return cells


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def _spread(vals: Mapping[str, float]) -> dict[str, Any]:
    """Count, positives, mean and extremes (with their arms) of per-arm values."""
    xs = list(vals.values())
    return {
        "positive": sum(v > 0 for v in xs),
        "mean": math.fsum(xs) / len(xs),
        "min": min(xs),
        "max": max(xs),
        "min_arm": min(vals, key=lambda k: vals[k]),
        "max_arm": max(vals, key=lambda k: vals[k]),
    }


def _curse_over_arms(design: Design, cells: Mapping[str, Any]) -> dict[str, Any]:
    """The winners_curse differences (verdict gap minus selection gap) over the DiLoCo
    arms (the negative control, with one eta, has no choice to be cursed by), and how
    much of each the arm's DP control alone accounts for.

    With means of losses (a for the arm, d for its control; s the selection seeds, v
    the verdict seeds) the difference a_v/d_v - a_s/d_s splits exactly into a control
    term (a_s/d_s) (d_s/d_v - 1), what the control's own change between the two seed
    sets (no choice in it: ``control_shift``) does to the gap, and the rest,
    (a_v - a_s)/d_v: the arm's own change, which holds the choice's bias and the arm's
    chance.  The gaps are means of per-seed ratios, not ratios of means, so the split
    applied to them (``control_term`` = (1 + selection gap) x control shift, ``rest`` =
    the difference minus it) is close, not exact.  Arms whose difference is missing or
    not finite (a divergent seed) are left out and named."""
    diffs: dict[str, float] = {}
    terms: dict[str, float] = {}
    shifts: dict[str, float] = {}
    left_out: list[str] = []
    for c in design.cells:
        if c.id not in cells or c.kind in ("control", "negative_control"):
            continue
        wc = cells[c.id].get("winners_curse")
        if wc is None:
            continue
        diff, gap_s = wc.get("verdict_minus_selection"), wc.get("selection_gap")
        control = c.control or ""
        ctl = cells.get(control, {})
        d_s, d_v = ctl.get("selection_mean_loss"), ctl.get("mean_loss")
        if not (_finite(diff) and _finite(gap_s) and _finite(d_s) and _finite(d_v)):
            left_out.append(c.id)
            continue
        diffs[c.id] = diff
        shifts[control] = d_s / d_v - 1.0
        terms[c.id] = (1.0 + gap_s) * shifts[control]
    if not diffs:
        return {"arms": 0, "left_out": left_out}
    return {
        "arms": len(diffs),
        **_spread(diffs),
        "left_out": left_out,
        "control_shift": shifts,
        "control_term": _spread(terms),
        "rest": _spread({k: diffs[k] - terms[k] for k in diffs}),
    }


def _trends(design: Design, scale: str, cells: Mapping[str, Any]) -> tuple[Any, Any]:
    alpha = design.alpha
    flat = [c for c in design.cells_of(scale) if c.kind == "flat"]
    h2: dict[str, Any] = {}
    h4: dict[str, Any] = {}
    for hg in sorted({c.h_g for c in flat if c.h_g is not None}):
        at = sorted((c for c in flat if c.h_g == hg), key=lambda c: c.m)
        etas = {c.m: cells[c.id]["chosen_eta"] for c in at}
        eta_trend = h2_eta_trend(etas, alpha, label=f"H2 best eta vs M at H_g = {hg}")
        h2[f"Hg{hg}"] = {"trend": eta_trend, "verdict": eta_trend.verdict,
                         "eta_by_m": {str(m): e for m, e in etas.items()}}  # fmt: skip
        gaps: dict[int, float | None] = {}
        per_m = {}
        for c in at:
            ci = cells[c.id]["vs_control"].tost.ci
            gaps[c.m] = ci.mean if ci.n >= 2 else None  # a one-seed mean is not an estimate
            per_m[str(c.m)] = {"cell": c.id, "n": ci.n, "mean": ci.mean, "lo": ci.lo, "hi": ci.hi}
        trend = h4_gap_trend(gaps, alpha, label=f"H4 gap to DP vs M at H_g = {hg}")
        h4[f"Hg{hg}"] = {"trend": trend, "verdict": trend.verdict, "gap_by_m": per_m}
    return h2, h4


CHURN_RULE = (
    "each island is absent from each sync step with probability p, drawn from the seed and "
    "the step alone (u < p, u uniform from random.Random('hypertrain-churn/<seed>/<step>')); "
    "flat DiLoCo: its region's forward is left out of the global merge; the merge is the "
    "fixed-order mean over the members present; the absent island takes the step's merge; "
    "below the quorum (half the members, rounded up) the step waits for the late islands "
    "with the largest u first until the quorum is present"
)


def _absence(row: dict[str, Any] | None, m: int) -> dict[str, Any] | None:
    """What a churn run drew: sync steps, absences, their rate, steps that waited."""
    if row is None or row.get("status") not in ("done", "divergent") or "absent" not in row:
        return None
    entries = row["absent"]
    gone = sum(len(e[1]) for e in entries)
    return {"syncs": len(entries), "absent": gone,
            "rate": gone / (len(entries) * m) if entries else None,
            "waited_steps": sum(1 for e in entries if e[2] > 0),
            "waited": sum(int(e[2]) for e in entries)}  # fmt: skip


def _churn(
    design: Design,
    scale: str,
    jobs: list[GridJob],
    latest: Mapping[str, dict[str, Any]],
    losses: Mapping[str, Losses],
    choices: Mapping[str, EtaChoice],
) -> dict[str, Any]:
    """Each churn cell against its no-churn baseline (see the module docstring)."""
    delta, alpha = design.margins.heldout_rel, design.alpha
    at: dict[tuple[str, float | None, int], dict[str, Any]] = {}
    for j in jobs:
        r = latest.get(j.job_id)
        if r is not None:
            at[(j.cell.id, j.eta, j.seed)] = r

    def done(cell: str, eta: float | None) -> dict[int, float]:
        out = {}
        for seed in design.seeds:
            r = at.get((cell, eta, seed))
            if r is not None and r["status"] == "done" and r.get("final_loss") is not None:
                out[seed] = float(r["final_loss"])
        return out

    churn: dict[str, Any] = {}
    for c in design.cells_of(scale):
        if c.kind != "churn" or c.baseline is None:
            continue
        base = c.baseline
        cost = compare(c.id, losses.get(c.id, {}), base, losses.get(base, {}), delta, alpha)
        by_eta = {}
        for eta in design.sweep(c, scale):
            pair = compare(c.id, done(c.id, eta), base, done(base, eta), delta, alpha)
            by_eta[f"{eta:g}"] = {"n": len(pair.seeds), "mean": pair.tost.ci.mean,
                                  "gaps": pair.gaps}  # fmt: skip
        chosen = choices[c.id].eta
        seeds = {}
        for seed in design.seeds:
            a = _absence(at.get((c.id, chosen, seed)), c.m)
            if a is not None:
                seeds[str(seed)] = a
        n_syncs = sum(a["syncs"] for a in seeds.values())
        n_gone = sum(a["absent"] for a in seeds.values())
        churn[c.id] = {
            "cell": c.id, "baseline": base, "drop": c.drop, "m": c.m, "h_g": c.h_g,
            "chosen_eta": chosen, "baseline_eta": choices[base].eta if base in choices else None,
            "cost": cost, "verdict": cost.tost.verdict, "classification":
            cost.tost.classification, "cost_by_eta": by_eta,
            "absence": {"by_seed": seeds, "syncs": n_syncs, "absent": n_gone,
                        "rate": n_gone / (n_syncs * c.m) if n_syncs else None,
                        "waited_steps": sum(a["waited_steps"] for a in seeds.values())},
        }  # fmt: skip
    return churn


def build_summary(pre: Prereg, scale: str, out: Path) -> tuple[dict[str, Any], list[Any]]:
    """(summary.json's content, the CSV rows) from the rows in ``out``."""
    design = pre.design
    rows = read_rows(out)
    check_folder(rows, pre, scale, out)
    jobs, latest, stale = plan_with_rows(design, scale, rows)
    losses, selection, choices = _losses_of(design, scale, jobs, latest)
    cells = _comparisons(design, scale, losses, selection, choices)
    waiting_cells = verdict_waiting_cells(design, scale, jobs, latest)
    for cid, entry in cells.items():
        entry["jobs"] = counts_ = _job_counts([j for j in jobs if j.cell.id == cid], latest)
        if cid in waiting_cells:  # its verdict jobs, not planned before its eta is chosen
            n = len(design.verdict_seeds)
            counts_.update(total=counts_["total"] + n, censored=counts_["censored"] + n)
    coverage = {
        "complete": [c for c, e in cells.items()
                     if e["jobs"]["done"] + e["jobs"]["divergent"] == e["jobs"]["total"]],
        "partial": [c for c, e in cells.items()
                    if 0 < e["jobs"]["done"] + e["jobs"]["divergent"] < e["jobs"]["total"]],
        "not_run": [c for c, e in cells.items() if e["jobs"]["done"] + e["jobs"]["divergent"] == 0],
    }  # fmt: skip
    edges: dict[str, list[str]] = {"lowest": [], "highest": [], "interior": []}
    for cid, e in cells.items():
        if e.get("chosen_eta") is not None and len(e["eta_selection"].sweep) > 1:
            edges[e["eta_selection"].at_edge or "interior"].append(cid)
    eta_edges = {**edges, "n_swept": sum(len(v) for v in edges.values()),
                 **{f"n_{k}": len(v) for k, v in edges.items()}}  # fmt: skip
    delta, alpha = design.margins.heldout_rel, design.alpha
    scale_cells = design.cells_of(scale)

    neg: dict[str, Any] = {}
    for c in scale_cells:
        if c.kind == "negative_control" and c.control is not None:
            cmp_ = cells[c.id]["vs_control"]
            diffs = [abs(g) for g in cmp_.gaps]
            neg = {"cell": c.id, "control": c.control, "comparison": cmp_,
                   "verdict": cmp_.tost.verdict, "max_abs_rel_diff": max(diffs, default=None),
                   "expected": "identical to the DP control within 1e-5 (same function)"}  # fmt: skip

    h1 = {}
    for c in scale_cells:
        if c.kind == "hier" and c.baseline and c.baseline_full:
            r = h1_test(losses, c.id, c.baseline, c.baseline_full, delta, alpha)
            h1[c.id] = {"result": r, "flat_r": c.baseline, "flat_n": c.baseline_full,
                        "verdict_vs_flat_r": r.vs_flat_r.tost.verdict,
                        "verdict_vs_flat_n": r.vs_flat_n.tost.verdict}  # fmt: skip
    h2, h4 = _trends(design, scale, cells)

    baselines = {c.id: c.baseline for c in scale_cells if c.kind == "mechanism" and c.baseline}
    ranking = []
    for m in rank_mechanisms(losses, baselines, design.promotion_sd):
        ci = paired_ci(m.improvements, design.ci_level)
        ranking.append(dict(to_jsonable(m), ci_lo=ci.lo, ci_hi=ci.hi, half_width=ci.half_width))
    h3 = {"rule": f"promoted iff mean paired improvement over flat DiLoCo at the same M > "
                  f"{design.promotion_sd:g} sd of the per-seed improvement",
          "ranking": ranking, "promoted": [r["cell"] for r in ranking if r["promoted"]],
          "by_cell": {r["cell"]: r for r in ranking}}  # fmt: skip

    power = {}
    for cid, e in cells.items():
        if "vs_control" in e:
            p = e["power"]
            power[cid] = {"verdict": e["verdict"], "n": p.n, "mean_gap": p.mean, "sd": p.sd,
                          "half_width": p.half_width, "seeds_for_half_width":
                          p.seeds_for_half_width, "seeds_for_equivalence":
                          p.seeds_for_equivalence, "power_at_n": p.power_at_n,
                          "seeds_for_power": p.seeds_for_power, "power_at_half_width_seeds":
                          p.power_at_half_width_seeds}  # fmt: skip
    counts = _job_counts(jobs, latest)
    waiting, _ = verdict_waiting(design, scale, jobs, latest, None)
    counts.update(total=counts["total"] + waiting, censored=counts["censored"] + waiting)
    invocations = read_rows(out, INVOCATIONS_FILE)  # every shard's too, by end time
    summary = {
        "protocol": design.protocol,
        "prereg": {
            "file": pre.path.name,
            "design_sha256": pre.design_sha256,
            "registered_utc": pre.registered_utc,
        },
        "scale": design.scale(scale),
        "seeds": design.seeds,
        **({"verdict_seeds": design.verdict_seeds} if design.verdict_seeds else {}),
        "delta": delta,
        "alpha": alpha,
        "ci_level": design.ci_level,
        "counts": counts,
        "coverage": coverage,
        "stale_rows_ignored": stale,
        "job_seconds_total": math.fsum(r.get("wall_s") or 0.0 for r in latest.values()),
        "invocations": invocations,
        "wall_s_total": math.fsum(i.get("wall_s", 0.0) for i in invocations),
        "selection_rule": design.selection_rule,
        "winners_curse": WINNERS_CURSE_FRESH if design.verdict_seeds else WINNERS_CURSE,
        **(
            {"winners_curse_over_arms": _curse_over_arms(design, cells)}
            if design.verdict_seeds
            else {}
        ),
        "eta_edges": eta_edges,
        "cells": cells,
        "negative_control": neg,
        "h1": h1,
        "h2": h2,
        "h3": h3,
        "h4": h4,
        "power": power,
    }
    churn = _churn(design, scale, jobs, latest, losses, choices)
    if churn:  # a churn registration
        summary.update(churn=churn, churn_rule=CHURN_RULE)
    return to_jsonable(summary), _csv_rows(jobs, latest)


def summarize(
    prereg: str | Path | None, scale: str, out: str | Path | None = None, plots: bool = True
) -> dict[str, Any]:
    """Write ``parity_grid.csv``, ``summary.json`` (and the plots) into ``out``; return the summary."""
    pre = load_checked(prereg)
    out = Path(out) if out is not None else default_out(scale, prereg)
    if not runs_files(out):
        out.mkdir(parents=True, exist_ok=True)
    summary, csv_rows = build_summary(pre, scale, out)
    tmp = out / (CSV_FILE + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS))
        w.writeheader()
        w.writerows(csv_rows)
    os.replace(tmp, out / CSV_FILE)
    tmp = out / (SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, sort_keys=False, allow_nan=False) + "\n")
    os.replace(tmp, out / SUMMARY_FILE)
    if plots:
        from hypertrain.sim.study.plots import make_plots

        make_plots(summary, read_rows(out), out)
    return summary


CROSS_CHECK_FILE = "cross_check.json"


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when inside it (reports stay portable)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def cross_check(out: str | Path, other: str | Path) -> dict[str, Any]:
    """Compare the finished jobs two results folders share, bit for bit.

    Jobs are matched by their design key (``SimJob.key``: model, data, steps, seed,
    optimizers, eta, ...; not the registration), so a job registered twice, or run twice
    on two machines, is found in both.  A shared job must have the same status, the same
    final and initial held-out loss and the same curve, compared as floats exactly.
    Writes ``cross_check.json`` into ``out`` and returns it."""
    out, other = Path(out), Path(other)
    mine, theirs = (
        {r["key"]: r for r in read_rows(d) if r.get("status") in ("done", "divergent")}
        for d in (out, other)
    )
    shared = sorted(set(mine) & set(theirs), key=lambda k: mine[k]["job_id"])
    fields = ("status", "final_loss", "initial_loss", "curve")
    differing = [mine[k]["job_id"] for k in shared
                 if any(mine[k].get(f) != theirs[k].get(f) for f in fields)]  # fmt: skip
    diffs = [abs(mine[k]["final_loss"] - theirs[k]["final_loss"]) for k in shared
             if mine[k].get("final_loss") is not None
             and theirs[k].get("final_loss") is not None]  # fmt: skip
    report = {
        "folder": _shown(out),
        "other": _shown(other),
        "rule": "jobs matched by design key; status, held-out losses and curve compared exactly",
        "shared_jobs": len(shared),
        "identical": len(shared) - len(differing),
        "differing": differing,
        "max_abs_final_loss_diff": max(diffs) if diffs else None,
        "shared_job_ids": [mine[k]["job_id"] for k in shared],
    }
    with (out / CROSS_CHECK_FILE).open("w") as f:
        json.dump(report, f, indent=1)
    return report
