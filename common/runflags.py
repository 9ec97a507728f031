"""Run-config flags shared by ``hypertrain run``, ``hypertrain up`` and the daemons.

``--config FILE`` reads the ``[run]`` table of a TOML file (common/config.py's
RunConfig); each flag below overrides one field.  Every driver resolves its
config through :func:`run_config_from_args`, so a flag means the same thing
everywhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hypertrain.common.config import RunConfig, load_tables, preset_holdout_windows


def _count_or_fraction(text: str) -> int | float:
    """``3`` is a count, ``0.5`` (or ``1.0``) a fraction (common/config.py MembershipConfig)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _names(text: str) -> list[str]:
    """``eu-2,us-2``: comma-separated island ids ("" for none)."""
    return [n.strip() for n in text.split(",") if n.strip()]


# Flags of `run` that override RunConfig fields: flag -> (dotted field, type).
RUN_FLAGS: dict[str, tuple[str, Any]] = {
    "--run-id": ("run_id", str),
    "--preset": ("model", str),
    "--seed": ("seed", int),
    "--steps": ("steps", int),
    "--batch": ("batch_per_island", int),
    "--islands-per-region": ("topology.islands_per_region", int),
    "--h-r": ("topology.h_r", int),
    "--h-g": ("topology.h_g", int),
    "--tau": ("topology.tau", int),
    "--relay-shards": ("topology.relay_shards", int),
    "--regional-codec": ("regional_codec", str),
    "--global-codec": ("global_codec", str),
    "--outer": ("outer.name", str),
    "--eta": ("outer.eta", float),
    "--mu": ("outer.mu", float),
    "--inner": ("inner.name", str),
    "--lr": ("inner.lr", float),
    "--data": ("data", str),
    "--threads": ("threads", int),
    "--holdout-windows": ("holdout_windows", int),
    "--lawa": ("lawa", int),
    "--fragments": ("fragments", int),
    "--fragment-cut": ("fragment_cut", str),
    "--anneal": ("anneal", str),
    "--regional-cutoff": ("membership.regional_cutoff_s", float),
    "--global-cutoff": ("membership.global_cutoff_s", float),
    "--regional-quorum": ("membership.regional_quorum", _count_or_fraction),
    "--global-quorum": ("membership.global_quorum", _count_or_fraction),
    "--standby": ("membership.standby", _names),
}


def add_run_config_flags(p: argparse.ArgumentParser) -> None:
    """The shared run-config flags: ``--config FILE`` plus one flag per field above."""
    p.add_argument("--config", type=Path, help="TOML file with a [run] table")
    p.add_argument("--regions", help="comma-separated region names (default eu,us)")
    for flag, (dest, typ) in RUN_FLAGS.items():
        p.add_argument(flag, type=typ, dest=dest.replace(".", "__"), help=f"overrides {dest}")


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    run_table = load_tables(args.config).get("run", {}) if args.config else {}
    cfg = RunConfig.from_dict(run_table)
    changes: dict[str, Any] = {}
    for dest, _ in RUN_FLAGS.values():
        value = getattr(args, dest.replace(".", "__"))
        if value is not None:
            changes[dest] = value
    if args.regions:
        changes["topology.regions"] = [r.strip() for r in args.regions.split(",")]
    name = changes.get("model")
    if (
        name is not None and "holdout_windows" not in changes and "holdout_windows" not in run_table
    ):  # the preset's own evaluation size, unless one was asked for
        changes["holdout_windows"] = preset_holdout_windows(name)
    return cfg.with_overrides(**changes) if changes else cfg
