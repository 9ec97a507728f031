#!/usr/bin/env python3
"""Print the result tables of a parity grid as markdown whose every number is a checked tag.

    python scripts/parity_tables.py experiments/results/parity-cpu-tiny/summary.json > /tmp/t.md

The tables (negative control per seed, each arm against data-parallel, the eta
sweep, H1, H2/H4, the H3 ranking, power) are what docs/parity.md quotes; each
value is printed inside a ``<!--num FILE:KEY ...-->`` tag of
scripts/check_doc_numbers.py, formatted exactly as the checker will format it, so
pasting a table into a doc cannot introduce a typed number.  Prose around the
tables is written by hand (and tags its numbers the same way).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from check_doc_numbers import Problem, printed_text, resolve  # the checker beside this script

ROOT = Path(__file__).resolve().parents[1]


class Tags:
    """Formats values of one result file as checker tags (a null prints n/a, unscaled)."""

    def __init__(self, rel: str, data: dict[str, Any]) -> None:
        self.rel = rel
        self.data = data

    def __call__(self, key: str, fmt: str | None = None, scale: float | None = None) -> str:
        v = resolve(self.data, key)
        spec = f"{self.rel}:{key}"
        if v is None or isinstance(v, (bool, str)):
            printed = printed_text(v)
        else:
            x = v * scale if scale is not None else v
            if scale is not None:
                spec += f" x{scale:g}"
            if fmt is not None:
                spec += f" {fmt}"
                printed = fmt % x
            else:
                printed = repr(x)
        return f"<!--num {spec}-->{printed}<!--/num-->"

    def opt(self, key: str, fmt: str | None = None, scale: float | None = None) -> str:
        """The tag of ``key``, or blank where the file has no such key (a job not run yet)."""
        try:
            return self(key, fmt, scale)
        except Problem:
            return ""


def q(name: str) -> str:
    return f'["{name}"]'


def tables(t: Tags) -> str:
    d = t.data
    cells: dict[str, Any] = d["cells"]
    out: list[str] = []

    fresh = "verdict_seeds" in d  # verdicts on fresh seeds (a second-generation design)
    # The seeds the verdicts (and the losses tabled per seed) are computed on.
    vkey = "verdict_seeds" if fresh else "seeds"
    nc = d["negative_control"]
    if nc:  # registrations without a negative control (the exploratory ones) skip it
        out.append("#### Negative control, per seed\n")
        ctl = nc.get("control", "dp-adamw")
        alt = cells[ctl].get("control_alt") or f"{ctl}-lr2"
        ncell = nc["cell"]
        cols = [ctl, ncell] + ([alt] if alt in cells else [])
        head = f"| seed | DP control `{ctl}` | negative control |"
        out.append(head + (" DP at the second lr |" if alt in cells else ""))
        out.append("|---|" + "---|" * len(cols))
        for i, seed in enumerate(d[vkey]):
            s = q(str(seed))
            row = [t(f"{vkey}[{i}]")]
            row += [t.opt(f"cells{q(c)}.losses{s}", "%.6f") for c in cols]
            out.append("| " + " | ".join(row) + " |")

    controls = [cid for cid, c in cells.items() if c["kind"] == "control"]
    if len(controls) > 1:  # the DP controls: optimizers, learning rates
        out.append("\n#### The DP controls\n")
        head = "| control | inner optimizer | inner lr |"
        if fresh:
            head += " mean held-out loss, selection seeds | mean held-out loss, verdict seeds |"
        else:
            head += " mean held-out loss |"
        out.append(head)
        out.append("|---|---|---|" + ("---|---|" if fresh else "---|"))
        for cid in controls:
            k = f"cells{q(cid)}"
            line = f"| `{cid}` | {t(k + '.inner')} | {t(k + '.inner_lr')} |"
            if fresh:
                line += f" {t.opt(k + '.selection_mean_loss', '%.4f')} |"
            out.append(line + f" {t(k + '.mean_loss', '%.4f')} |")

    out.append("\n#### Each arm against data-parallel (gap in %, paired by seed)\n")
    out.append(
        "| cell | M | chosen eta | seeds | mean gap | 90% CI | verdict (primary) | "
        "verdict (sensitivity: best DP lr) |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for cid, c in cells.items():
        if c["kind"] == "control":
            continue
        k = f"cells{q(cid)}"
        if c.get("chosen_eta") is None:
            out.append(f"| `{cid}` | {t(k + '.m')} | not selected | | | | "
                       f"{t(k + '.verdict')} | {t(k + '.verdict_sensitivity')} |")  # fmt: skip
            continue
        ci = f"{k}.vs_control.tost.ci"
        out.append(
            f"| `{cid}` | {t(k + '.m')} | {t(k + '.chosen_eta')} | {t(ci + '.n')} | "
            f"{t(ci + '.mean', '%+.2f', 100.0)} | [{t(ci + '.lo', '%+.2f', 100.0)}, {t(ci + '.hi', '%+.2f', 100.0)}] | "
            f"{t(k + '.verdict')} | {t(k + '.verdict_sensitivity')} (`{c.get('best_control')}`) |"
        )

    if fresh:
        out.append(
            "\n#### The winner's curse, measured: each arm's gap to its DP control on the "
            "selection seeds (where its eta was chosen) and on the fresh verdict seeds\n"
        )
        out.append("| cell | chosen eta | selection seeds | gap there | verdict seeds | gap there | "
                   "verdict minus selection |")  # fmt: skip
        out.append("|---|---|---|---|---|---|---|")
        for cid, c in cells.items():
            if "winners_curse" not in c:
                continue
            k = f"cells{q(cid)}.winners_curse"
            out.append(
                f"| `{cid}` | {t(f'cells{q(cid)}.chosen_eta')} | {t(k + '.selection_n')} | "
                f"{t(k + '.selection_gap', '%+.2f', 100.0)} | {t(k + '.verdict_n')} | "
                f"{t(k + '.verdict_gap', '%+.2f', 100.0)} | "
                f"{t(k + '.verdict_minus_selection', '%+.2f', 100.0)} |"
            )
        if d.get("winners_curse_over_arms", {}).get("arms"):
            k = "winners_curse_over_arms"
            out.append(
                f"\nOver the {t(k + '.arms')} DiLoCo arms, the verdict gap exceeds the selection "
                f"gap for {t(k + '.positive')}; the difference averages "
                f"{t(k + '.mean', '%+.2f', 100.0)} points, from "
                f"{t(k + '.min', '%+.2f', 100.0)} (`{d[k]['min_arm']}`) to "
                f"{t(k + '.max', '%+.2f', 100.0)} (`{d[k]['max_arm']}`)."
            )

    out.append("\n#### The eta sweep: mean held-out loss over the seeds at each eta\n")
    etas = sorted({float(e) for c in cells.values()
                   for e in ((c.get("eta_selection") or {}).get("mean_by_eta") or {})})  # fmt: skip
    out.append("| cell | " + " | ".join(f"eta {e:g}" for e in etas) + " | chosen at an end |")
    out.append("|---|" + "---|" * (len(etas) + 1))
    for cid, c in cells.items():
        by_eta = (c.get("eta_selection") or {}).get("mean_by_eta") or {}
        if c["kind"] in ("control", "negative_control") or not by_eta:
            continue
        keys = {float(e): e for e in by_eta}
        row = []
        for e in etas:
            if e not in keys:
                row.append("")
                continue
            cell = t(f"cells{q(cid)}.eta_selection.mean_by_eta{q(keys[e])}", "%.4f")
            row.append(f"**{cell}**" if e == c.get("chosen_eta") else cell)
        has_edge = "at_edge" in c["eta_selection"]  # summaries before the field: blank
        edge = t(f"cells{q(cid)}.eta_selection.at_edge") if has_edge else ""
        out.append(f"| `{cid}` | " + " | ".join(row) + f" | {edge} |")

    out.append("\n#### H1: hierarchy against flat (gap in %, paired by seed)\n")
    out.append(
        "| hierarchy | against | seeds | mean gap | 90% CI | verdict | sd of the gaps, % | "
        "TOST power at n seeds, % | seeds for 80% power |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for hid, h in d["h1"].items():
        for side, ref_key in (("vs_flat_r", "flat_r"), ("vs_flat_n", "flat_n")):
            ci = f"h1{q(hid)}.result.{side}.tost.ci"
            pw = f"h1{q(hid)}.result.{side}.power"
            ref = h[ref_key]
            out.append(
                f"| `{hid}` | `{ref}` | {t(ci + '.n')} | {t(ci + '.mean', '%+.2f', 100.0)} | "
                f"[{t(ci + '.lo', '%+.2f', 100.0)}, {t(ci + '.hi', '%+.2f', 100.0)}] | "
                f"{t(f'h1{q(hid)}.verdict_{side}')} | {t(ci + '.sd', '%.2f', 100.0)} | "
                f"{t.opt(pw + '.power_at_n', '%.1f', 100.0)} | {t.opt(pw + '.seeds_for_power')} |"
            )

    out.append("\n#### H2 and H4: trends in M\n")
    for hyp, what in (("h2", "best eta"), ("h4", "mean gap to DP")):
        for hg in d[hyp]:
            k = f"{hyp}{q(hg)}"
            tau = t(k + ".trend.tau", "%.2f")
            out.append(
                f"- {hyp.upper()} {hg} ({what} against M): {t(k + '.verdict')}; tau {tau}, "
                f"one-sided p {t(k + '.trend.p_one_sided', '%.3f')}, n {t(k + '.trend.n')}"
            )
        if hyp == "h2":
            for hg, v in d["h2"].items():
                parts = [f"M = {m}: {t(f'h2{q(hg)}.eta_by_m{q(m)}')}" for m in v["eta_by_m"]]
                out.append(f"  - {hg}, best eta by M: " + ", ".join(parts))

    if d["h3"].get("ranking"):
        out.append("\n#### H3: mechanisms ranked by paired improvement over flat DiLoCo\n")
        out.append(
            "| rank | mechanism | against | seeds | mean improvement, % of loss | sd, % | "
            "promotion threshold, % | promoted |"
        )
        out.append("|---|---|---|---|---|---|---|---|")
        for i, r in enumerate(d["h3"]["ranking"]):
            k = f"h3.ranking[{i}]"
            n = len(r["seeds"])
            out.append(
                f"| {t(k + '.rank')} | `{r['cell']}` | `{r['baseline']}` | {n} | "
                f"{t(k + '.mean', '%+.2f', 100.0)} | {t(k + '.sd', '%.2f', 100.0)} | "
                f"{t(k + '.threshold', '%.2f', 100.0)} | {t(k + '.promoted')} |"
            )

    out.append("\n#### Power\n")
    # Summaries written before TOST power was computed have no power columns: blank.
    has_power = all("power_at_n" in v for v in d["power"].values())
    out.append(
        "| cell | seeds | seed spread (sd of the gaps), % | 90% half-width at n seeds, % | "
        "seeds for a half-width inside the margin | seeds to demonstrate equivalence "
        "if mean and sd held | TOST power at n seeds, % | seeds for 80% power | "
        "power at the half-width count, % |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for cid in d["power"]:
        k = f"power{q(cid)}"
        powers = (
            f"{t(k + '.power_at_n', '%.1f', 100.0)} | {t(k + '.seeds_for_power')} | "
            f"{t(k + '.power_at_half_width_seeds', '%.1f', 100.0)}"
            if has_power
            else " |  | "
        )
        out.append(
            f"| `{cid}` | {t(k + '.n')} | {t(k + '.sd', '%.2f', 100.0)} | "
            f"{t(k + '.half_width', '%.2f', 100.0)} | {t(k + '.seeds_for_half_width')} | "
            f"{t(k + '.seeds_for_equivalence')} | {powers} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("summary", help="summary.json of a grid, relative to the repository")
    args = ap.parse_args(argv)
    path = Path(args.summary)
    full = path if path.is_absolute() else ROOT / path
    try:
        data = json.loads(full.read_text())
    except (OSError, ValueError) as e:
        print(f"parity_tables: cannot read {args.summary}: {e}", file=sys.stderr)
        return 2
    rel = full.resolve().relative_to(ROOT).as_posix()
    sys.stdout.write(tables(Tags(rel, data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
