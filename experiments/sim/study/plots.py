"""The grid's plots (PNG, matplotlib Agg, headless): curves, gap vs M, mechanism ranking,
and for a churn registration the cost of churn.

    make_plots(summary, rows, out_dir)   # -> [curves.png, gap_vs_m.png, mechanisms.png]
                                         #    a churn registration: [curves.png, churn.png]

Drawn from ``summary.json`` and the rows of ``parity_runs.jsonl`` only; a cell
with no finished seed is left out of a panel (and its absence is visible in the
legend), never invented.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

CURVES_FILE = "curves.png"
GAP_FILE = "gap_vs_m.png"
MECH_FILE = "mechanisms.png"
CHURN_FILE = "churn.png"


def mean_curve(
    rows: Sequence[Mapping[str, Any]], cell: str, eta: float | None
) -> tuple[list[int], list[float], int]:
    """(steps, mean held-out loss over the finished seeds, number of seeds) of a cell at eta."""
    curves = [
        r["curve"]
        for r in rows
        if r.get("cell") == cell and r.get("status") == "done" and r.get("eta") == eta
    ]
    if not curves:
        return [], [], 0
    steps = [int(s) for s, _ in curves[0]]
    means = []
    for i in range(len(steps)):
        vals = [c[i][1] for c in curves if len(c) > i and c[i][1] is not None]
        means.append(sum(vals) / len(vals) if vals else math.nan)
    return steps, means, len(curves)


def _latest(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    by_id: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        by_id[str(r.get("job_id"))] = r
    return list(by_id.values())


def _draw(ax: Axes, rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any],
          cell: str, **style: Any) -> list[float]:  # fmt: skip
    c = summary["cells"].get(cell)
    if c is None:
        return []
    eta = c.get("chosen_eta")
    if c["kind"] != "control" and eta is None:
        return []
    steps, ys, n = mean_curve(rows, cell, eta)
    if not steps:
        return []
    label = cell + ("" if eta is None else f" (eta {eta:g})") + f" n={n}"
    ax.plot(steps, ys, label=label, **style)
    return ys


def _finish(ax: Axes, title: str, ys: list[float]) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("inner step")
    ax.set_ylabel("held-out cross-entropy")
    ax.grid(alpha=0.3)
    finite = [y for y in ys if math.isfinite(y)]
    if finite:
        lo = min(finite)
        ax.set_ylim(lo - 0.02 * abs(lo), lo + 0.35 * abs(lo))  # the interesting end of the run
    if ax.lines:
        ax.legend(fontsize=6.5, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no finished runs yet", ha="center", transform=ax.transAxes)


def plot_curves(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    rows = _latest(rows)
    cells = summary["cells"]
    flat = sorted((c for c in cells.items() if c[1]["kind"] == "flat"), key=lambda c: c[1]["m"])
    hgs = sorted({c["h_g"] for _, c in flat})
    hier = [cid for cid, c in cells.items() if c["kind"] == "hier"]
    mech = [cid for cid, c in cells.items() if c["kind"] == "mechanism"]
    churn = [cid for cid, c in cells.items() if c["kind"] == "churn"]
    panels = len(hgs) + bool(hier) + bool(mech) + bool(churn)
    ncol = 2 if panels > 1 else 1
    nrow = math.ceil(panels / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 4.2 * nrow), squeeze=False)
    flat_axes = list(axes.ravel())
    cmap = plt.get_cmap("viridis")
    k = 0
    control = next((c["control"] for _, c in flat if c.get("control")), None)
    control_alt = next((c["control_alt"] for _, c in flat if c.get("control_alt")), None)
    for hg in hgs:
        ax, ys = flat_axes[k], []
        k += 1
        if control:
            ys += _draw(ax, rows, summary, control, color="black", lw=2)
        if control_alt:
            ys += _draw(ax, rows, summary, control_alt, color="gray", ls="--")
        at = [(cid, c) for cid, c in flat if c["h_g"] == hg]
        for i, (cid, _) in enumerate(at):
            ys += _draw(ax, rows, summary, cid, color=cmap(i / max(1, len(at) - 1)))
        _finish(ax, f"Flat DiLoCo vs data-parallel, H_g = {hg}", ys)
    if hier:
        ax, ys = flat_axes[k], []
        k += 1
        for i, cid in enumerate(hier):
            col = plt.get_cmap("tab10")(i)
            c = cells[cid]
            ys += _draw(ax, rows, summary, cid, color=col, lw=2)
            base = summary.get("h1", {}).get(cid, {})
            for ref, ls in ((base.get("flat_r"), "--"), (base.get("flat_n"), ":")):
                if ref and not any(line.get_label().startswith(ref + " ") for line in ax.lines):
                    ys += _draw(ax, rows, summary, ref, color=col, ls=ls)
            del c
        _finish(ax, "H1: hierarchies (solid) vs flat M = R (--) and M = R*n_r (:)", ys)
    if mech:
        ax, ys = flat_axes[k], []
        k += 1
        bases = sorted({cells[m].get("baseline") or "" for m in mech} - {""})
        for b in bases:
            ys += _draw(ax, rows, summary, b, color="black", lw=2)
        for i, cid in enumerate(mech):
            ys += _draw(ax, rows, summary, cid, color=plt.get_cmap("tab10")(i))
        _finish(ax, "H3: mechanisms vs flat DiLoCo at the same M (black)", ys)
    if churn:
        ax, ys = flat_axes[k], []
        k += 1
        if control:
            ys += _draw(ax, rows, summary, control, color="black", lw=2)
        for b in sorted({cells[c]["baseline"] for c in churn}):
            ys += _draw(ax, rows, summary, b, color="tab:blue", lw=2)
        for i, cid in enumerate(sorted(churn, key=lambda c: cells[c]["drop"])):
            ys += _draw(ax, rows, summary, cid, color=plt.get_cmap("autumn")(0.15 + 0.5 * i))
        _finish(ax, "churn: islands dropped with probability p (no churn: blue)", ys)
    for ax in flat_axes[k:]:
        ax.set_visible(False)
    fig.suptitle(_title(summary, "held-out loss, mean over seeds, at each cell's chosen eta"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(summary: Mapping[str, Any], what: str) -> str:
    sc = summary["scale"]
    return (
        f"{what}\nscale {sc['name']}: {sc['steps']} steps, {sc['n_layer']}x{sc['d_model']} "
        f"model, seq {sc['seq_len']}, batch {sc['global_batch']}"
    )


def plot_gap(summary: Mapping[str, Any], path: Path) -> None:
    """Gap to data-parallel (primary control) against M, with 90% CI bars."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    delta = 100 * summary["delta"]
    ax.axhspan(-delta, delta, color="tab:green", alpha=0.12, label=f"margin +-{delta:g}%")
    ax.axhline(0, color="black", lw=0.8)
    series: list[tuple[str, list[tuple[float, Mapping[str, Any]]], str]] = []
    for hg, h4 in sorted(summary.get("h4", {}).items()):
        pts = [(float(m), g) for m, g in h4["gap_by_m"].items()]
        series.append((f"flat, {hg.replace('Hg', 'H_g = ')}", pts, "o-"))
    hier = [(cid, c) for cid, c in summary["cells"].items() if c["kind"] == "hier"]
    if hier:
        pts = [(float(c["m"]), {"n": c["vs_control"]["tost"]["ci"]["n"],
                                "tag": f"{c['regions']}x{c['islands_per_region']}",
                                **{k: c["vs_control"]["tost"]["ci"][k] for k in ("mean", "lo", "hi")}})
               for _, c in hier]  # fmt: skip
        series.append(("hierarchies (R x n_r at M = N)", pts, "s"))
    n_series = max(1, len(series))
    for j, (label, pts, fmt) in enumerate(series):
        pts = sorted(((m, g) for m, g in pts if g.get("mean") is not None), key=lambda p: p[0])
        if not pts:
            continue
        off = 2 ** (0.06 * (j - (n_series - 1) / 2))  # dodge the series apart on the log axis
        xs = [m * off for m, _ in pts]
        ys = [100 * g["mean"] for _, g in pts]
        lo = [100 * (g["mean"] - g["lo"]) if g.get("lo") is not None else 0.0 for _, g in pts]
        hi = [100 * (g["hi"] - g["mean"]) if g.get("hi") is not None else 0.0 for _, g in pts]
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=fmt, capsize=3, label=label, ms=5)
        for x, y, (_, g) in zip(xs, ys, pts, strict=True):
            if g.get("tag"):
                ax.annotate(g["tag"], (x, y), xytext=(6, 0), textcoords="offset points",
                            fontsize=7, va="center")  # fmt: skip
    neg = summary.get("negative_control") or {}
    nci = (neg.get("comparison") or {}).get("tost", {}).get("ci", {})
    if nci.get("mean") is not None:
        ax.plot([1], [100 * nci["mean"]], "kx", ms=8, label="negative control (M = 1, H = 1)")
    ax.set_xscale("log", base=2)
    ms = sorted({int(c["m"]) for c in summary["cells"].values()})
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.set_xlabel("replicas M (log scale)")
    ax.set_ylabel("gap to DP  (L - L_dp) / L_dp  [%]")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_title(summary, "gap to data-parallel vs M, mean and 90% paired-t CI"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_mechanisms(summary: Mapping[str, Any], path: Path) -> None:
    """H3: mean paired improvement over flat DiLoCo, 90% CI, the promotion threshold."""
    ranking = summary.get("h3", {}).get("ranking", [])
    fig, ax = plt.subplots(figsize=(10, 0.55 * max(3, len(ranking)) + 1.8))
    names, means, los, his, cols = [], [], [], [], []
    for r in reversed(ranking):  # best at the top
        mean = r.get("mean")
        ok = mean is not None and len(r["seeds"]) >= 2
        note = f"n={len(r['seeds'])}" if ok else "no paired seeds: censored or divergent"
        names.append(f"#{r['rank']} {r['cell']}  ({note})")
        means.append(100 * mean if ok else 0.0)
        los.append(100 * (mean - r["ci_lo"]) if ok and r.get("ci_lo") is not None else 0.0)
        his.append(100 * (r["ci_hi"] - mean) if ok and r.get("ci_hi") is not None else 0.0)
        cols.append("tab:green" if r.get("promoted") else "tab:gray")
        thr = r.get("threshold")
        if thr is not None:
            ax.plot([100 * thr], [len(names) - 1], marker="|", ms=14, color="tab:red")
    ys = list(range(len(names)))
    ax.barh(ys, means, xerr=[los, his], color=cols, capsize=3)
    ax.set_yticks(ys, names, fontsize=8)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("improvement over flat DiLoCo at the same M, (L_base - L) / L_base [%]")
    what = "H3 ranking: mean, 90% CI; red tick = 2 sd threshold; green = promoted"
    fig.suptitle(_title(summary, what), fontsize=9)
    if not ranking:
        ax.text(0.5, 0.5, "no mechanism cells at this scale", ha="center", transform=ax.transAxes)
    elif all(len(r["seeds"]) < 2 or r.get("mean") is None for r in ranking):
        note = "no mechanism has two paired seeds yet: nothing to rank"
        ax.text(0.5, 0.5, note, ha="center", transform=ax.transAxes, color="tab:red")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_churn(summary: Mapping[str, Any], path: Path) -> None:
    """The cost of churn against p (paired with p = 0), and each arm's gap to DP, 90% CIs."""
    cells, churn = summary["cells"], summary.get("churn", {})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    delta = 100 * summary["delta"]
    bases = sorted({c["baseline"] for c in churn.values()})
    panels = (
        ("cost of churn  (L_p - L_0) / L_0  [%]", [(0.0, None)] + [
            (c["drop"], c["cost"]["tost"]["ci"]) for c in churn.values()]),
        ("gap to DP  (L - L_dp) / L_dp  [%]", [
            (cells[cid]["drop"] if cells[cid]["kind"] == "churn" else 0.0,
             cells[cid]["vs_control"]["tost"]["ci"])
            for cid in [*bases, *churn] if "vs_control" in cells.get(cid, {})]),
    )  # fmt: skip
    for ax, (label, pts) in zip(axes, panels, strict=True):
        ax.axhspan(-delta, delta, color="tab:green", alpha=0.12, label=f"margin +-{delta:g}%")
        ax.axhline(0, color="black", lw=0.8)
        xs, ys, lo, hi = [], [], [], []
        for p, ci in sorted(pts, key=lambda q: q[0]):
            if ci is None:  # p = 0 against itself: zero by definition
                ci = {"mean": 0.0, "lo": 0.0, "hi": 0.0}
            if ci.get("mean") is None:
                continue
            xs.append(100 * p)
            ys.append(100 * ci["mean"])
            lo.append(100 * (ci["mean"] - ci["lo"]) if ci.get("lo") is not None else 0.0)
            hi.append(100 * (ci["hi"] - ci["mean"]) if ci.get("hi") is not None else 0.0)
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=3, ms=5, label="mean, 90% CI")
        else:
            ax.text(0.5, 0.5, "no finished runs yet", ha="center", transform=ax.transAxes)
        ax.set_xlabel("drop probability p per island and round [%]")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(summary, "the cost of churn, paired by seed, at each arm's chosen eta"),
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(
    summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], out: Path
) -> list[Path]:
    """Every plot of the summary's registration: a churn registration draws the curves and
    the cost of churn; any other, the curves, the gap against M and the mechanisms."""
    if summary.get("churn"):
        paths = [out / CURVES_FILE, out / CHURN_FILE]
        plot_curves(summary, rows, paths[0])
        plot_churn(summary, paths[1])
        return paths
    paths = [out / CURVES_FILE, out / GAP_FILE, out / MECH_FILE]
    plot_curves(summary, rows, paths[0])
    plot_gap(summary, paths[1])
    plot_mechanisms(summary, paths[2])
    return paths
