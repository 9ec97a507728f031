"""``hypertrain plan``: steps, outer steps and bandwidth of a proposed run (docs/design.md §5).

    hypertrain plan --model gpt-125m --islands 12 --regions 3 --h-r 10 --h-g 100 \\
        --batch 32 --tokens 10B --step-time 0.5
    hypertrain plan --config deploy/configs/run.toml --step-time 0.5 --tokens 50B --json
    hypertrain plan ... --bench-json experiments/results/bench_codecs.json   # measured b_v

Prints the global batch, total steps T, global outer steps S_g (a ``WARNING:`` line when
S_g < 1000), then per level (regional every H_r, global every H_g) and codec: rho, b_v,
bytes per sender per sync, the required rate with full overlap in bytes/s and Gbit/s and
the link class it needs.  ``--json`` prints the same as one JSON object instead.
Formulas and link classes: common/planner/plan.py.  Bad input exits 2 with one line
``hypertrain plan: error: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.model import PRESETS
from hypertrain.common.planner.plan import (
    DEFAULT_CODECS,
    LINK_CLASSES,
    CodecMeasurement,
    Plan,
    PlanInput,
    make_plan,
    measurements_from_bench,
    parameter_count,
    parse_count,
)

_PROG = "hypertrain plan"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan`` to the top-level parser."""
    p = subparsers.add_parser(
        "plan",
        help="steps, outer steps and bandwidth per level of a proposed run (docs/design.md §5)",
        description=(
            "Apply the planner's formulas (docs/design.md §5) to a proposed run. Counts take "
            "decimal suffixes (125M, 10B) or exponents (1e10). With --config, a run config's [run] "
            "table supplies the model, topology, batch and codecs (and D = steps * N * b * "
            "seq_len); flags override it."
        ),
    )
    # Numbers are read as text and checked by the handler, so every bad value is one
    # `hypertrain plan: error:` line with exit code 2.
    p.add_argument("--config", type=Path, metavar="FILE", help="run config TOML ([run] table)")
    p.add_argument(
        "--model",
        metavar="PRESET|COUNT",
        help=f"preset ({', '.join(PRESETS)}) or parameter count (e.g. 1.3B)",
    )
    p.add_argument("--seq-len", metavar="N", help="tokens per sequence (default: the preset's)")
    p.add_argument("--islands", metavar="N", help="N: islands (model replicas)")
    p.add_argument("--regions", metavar="R|NAMES", help="R, or comma-separated region names")
    p.add_argument("--h-r", metavar="STEPS", help="regional sync interval H_r")
    p.add_argument("--h-g", metavar="STEPS", help="global sync interval H_g (a multiple of H_r)")
    p.add_argument("--batch", metavar="SEQS", help="b: sequences per island per step")
    p.add_argument("--tokens", metavar="D", help="training tokens (e.g. 10B)")
    p.add_argument("--step-time", metavar="SECONDS", help="t_step: seconds per inner step")
    p.add_argument(
        "--regional-codec",
        action="append",
        metavar="SPEC",
        help=f"codec to cost at the regional level; repeatable (default: {', '.join(DEFAULT_CODECS)})",
    )
    p.add_argument("--global-codec", action="append", metavar="SPEC", help="same, global level")
    p.add_argument(
        "--bench-json",
        type=Path,
        metavar="PATH",
        help="use measured bits per parameter and throughput from bench/bench_codecs.py --json",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Handler of ``plan``; returns the exit code."""
    try:
        inp = plan_input_from_args(args)
        measured: dict[str, CodecMeasurement] = {}
        if args.bench_json is not None:
            measured = _read_bench(args.bench_json)
        plan = make_plan(inp, measured)
    except HypertrainError as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = plan.to_dict()
        doc["bench_json"] = str(args.bench_json) if args.bench_json is not None else None
        print(json.dumps(_json_safe(doc), indent=2))
    else:
        print(render(plan, args.bench_json))
    return 0


def plan_input_from_args(args: argparse.Namespace) -> PlanInput:
    """Resolve flags (over an optional run config) into a validated PlanInput."""
    base: dict[str, Any] = {}
    if args.config is not None:
        from hypertrain.common.config import RunConfig

        cfg = RunConfig.from_toml(args.config)
        topo = cfg.topology
        base = {
            "model": cfg.model,
            "islands": topo.n_islands,
            "regions": len(topo.regions),
            "h_r": topo.h_r,
            "h_g": topo.h_g,
            "batch": cfg.batch_per_island,
            "steps": cfg.steps,
            "regional_codecs": (cfg.regional_codec,),
            "global_codecs": (cfg.global_codec,),
        }
    model = args.model if args.model is not None else base.get("model")
    if model is None:
        raise ConfigError("--model is required (a preset name or a parameter count), or --config")
    if model in PRESETS:
        params, preset_seq = parameter_count(PRESETS[model]), PRESETS[model].seq_len
    else:
        try:
            params, preset_seq = parse_count(model, "--model"), None
        except ConfigError:
            raise ConfigError(
                f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) "
                "nor a parameter count like 125M or 1.3e9"
            ) from None
    seq_len = _count(args.seq_len, "--seq-len", preset_seq)
    islands = _count(args.islands, "--islands", base.get("islands"))
    regions = _regions(args.regions, base.get("regions"))
    batch = _count(args.batch, "--batch", base.get("batch"))
    h_r = _count(args.h_r, "--h-r", base.get("h_r"))
    h_g = _count(args.h_g, "--h-g", base.get("h_g"))
    steps = base.get("steps")
    derived_tokens = steps * islands * batch * seq_len if steps is not None else None
    tokens = _count(args.tokens, "--tokens", derived_tokens)
    if args.step_time is None:
        raise ConfigError("--step-time SECONDS is required (seconds per inner step)")
    try:
        step_seconds = float(args.step_time)
    except ValueError:
        raise ConfigError(f"--step-time must be seconds, got {args.step_time!r}") from None
    if not (math.isfinite(step_seconds) and step_seconds > 0):
        raise ConfigError(f"--step-time must be positive seconds, got {args.step_time!r}")
    return PlanInput(
        params=params,
        seq_len=seq_len,
        islands=islands,
        regions=regions,
        h_r=h_r,
        h_g=h_g,
        batch_per_island=batch,
        tokens=tokens,
        step_seconds=step_seconds,
        regional_codecs=tuple(args.regional_codec or base.get("regional_codecs", DEFAULT_CODECS)),
        global_codecs=tuple(args.global_codec or base.get("global_codecs", DEFAULT_CODECS)),
        model=model,
    )


def _count(text: str | None, flag: str, default: int | None) -> int:
    if text is None:
        if default is None:
            raise ConfigError(f"{flag} is required")
        return default
    return parse_count(text, flag)


def _regions(text: str | None, default: int | None) -> int:
    """``--regions 3`` or ``--regions eu,us,ap`` (names: anything with a comma or a leading letter)."""
    if text is not None and ("," in text or text.strip()[:1].isalpha()):
        names = [r.strip() for r in text.split(",")]
        if not all(names) or len(set(names)) != len(names):
            raise ConfigError(f"--regions: names must be distinct and non-empty, got {text!r}")
        return len(names)
    return _count(text, "--regions", default)


def _read_bench(path: Path) -> dict[str, CodecMeasurement]:
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"--bench-json {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--bench-json {path}: invalid JSON: {e}") from None
    try:
        return measurements_from_bench(doc)
    except ConfigError as e:
        raise ConfigError(f"--bench-json {path}: {e}") from None


def _json_safe(value: Any) -> Any:
    """JSON has no infinity; none of the plan's numbers is infinite, but keep it strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


# -- text ---------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    """Decimal units, like link rates (1 MB = 10^6 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def render(plan: Plan, bench: Path | None = None) -> str:
    """The plan as text for a person (``--json`` has the same numbers)."""
    i = plan.inputs
    what = f"preset {i.model}" if i.model in PRESETS else "given size"
    lines = [
        f"model: {what}, P = {i.params:,} parameters, seq_len {i.seq_len:,}",
        f"topology: N = {i.islands} islands in R = {i.regions} regions (n_r = {i.islands_per_region}), "
        f"H_r = {i.h_r}, H_g = {i.h_g} (K = {i.h_g // i.h_r}), t_step = {i.step_seconds:g} s",
        f"global batch B_glob = N * b = {i.islands} * {i.batch_per_island} = {plan.global_batch:,} "
        f"sequences ({plan.tokens_per_step:,} tokens per step)",
        f"total steps T = D / (B_glob * seq_len) = {i.tokens:,} / {plan.tokens_per_step:,} = {plan.total_steps:,.1f}",
        f"global outer steps S_g = T / H_g = {plan.outer_steps:,.1f}",
    ]
    lines += [f"WARNING: {w}" for w in plan.warnings]
    if bench is not None:
        lines.append(
            f"b_v: measured from {bench} where the codec is listed there, else the formula"
        )
    width = max(len(c.codec) for lv in plan.levels for c in lv.codecs)
    for lv in plan.levels:
        fan = (
            f"n_r = {lv.fan_in} islands -> each relay"
            if lv.sender == "island"
            else f"R = {lv.fan_in} relays -> the aggregator"
        )
        lines += [
            "",
            f"{lv.level} level: every H = {lv.h} steps = {lv.interval_seconds:g} s, "
            f"{lv.syncs:,.1f} syncs; senders: {fan}",
            f"  {'codec':<{width}} {'rho':>8} {'b_v':>7} {'bytes/sync':>11} {'rate':>12} {'Gbit/s':>9}  link class",
        ]
        for c in lv.codecs:
            lines.append(
                f"  {c.codec:<{width}} {c.rho:>8.4g} {c.b_v:>7.4g} {_bytes(c.bytes_per_sync):>11} "
                f"{_bytes(c.rate_bytes_per_s) + '/s':>12} {c.rate_gbps:>9.4g}  {c.link}"
                + ("" if c.source == "formula" else f"  [{c.source}]")
            )
            if c.encode_seconds is not None or c.decode_seconds is not None:
                enc = "-" if c.encode_seconds is None else f"{c.encode_seconds:.3g} s"
                dec = "-" if c.decode_seconds is None else f"{c.decode_seconds:.3g} s"
                lines.append(
                    f"  {'':<{width}}   measured throughput: encode {enc} per {lv.sender}, "
                    f"decode {dec} per {lv.receiver} ({lv.fan_in} inputs) per sync"
                )
        lines.append(
            f"  merges return as fp32: {_bytes(lv.fetch_bytes_per_sync)} per {lv.sender} per sync, "
            f"{lv.fetch_rate_gbps:.4g} Gbit/s: {lv.fetch_link}"
        )
    lines += [
        "",
        "rate = bytes / (H * t_step): the sync's transfer overlaps the next H steps; bytes = P * rho * b_v / 8",
        "link classes: " + "; ".join(c.label for c in LINK_CLASSES),
    ]
    return "\n".join(lines)
