"""The pre-registered designs of the parity experiment (docs/design.md §7), their hashes, and
their files.

Write a registration (once per design; the file is committed)::

    python -m hypertrain.sim.study.prereg --write-prereg experiments/sim/parity_prereg.json
    python -m hypertrain.sim.study.prereg --check experiments/sim/parity_prereg.json
    python -m hypertrain.sim.study.prereg --check      # every registration of the repository

The repository registers four designs, each in its own file (``REGISTRATIONS``): the
parity grid (``registered_design``, ``parity_prereg.json``), its second registration
(``parity2_design``, ``parity2_prereg.json``: eta chosen on selection seeds, verdicts on
fresh seeds, the DP lr swept on both sides, H1 at three H_r, an H_g = 100 arm), the cost of churn
(``churn_design``, ``churn_prereg.json``: flat DiLoCo at M = 8, H_g = 10 with islands
dropped from each round at a registered probability, its paired no-churn arm and its
data-parallel controls) and H2 at proxy scale (``h2_design``, ``h2_prereg.json``: flat
M = 1 and 32 at H_g = 30 on the full scale's model, one seed, exploratory).  A file is checked against the design registered at its path;
any other path against the parity design.

The design is one frozen dataclass tree (``Design``: seeds, scales, margins,
alpha, caps, the inner-optimizer settings, the divergence rule, and the cells)
built by ``registered_design()``.  Its JSON form (``Design.to_dict``) is the
``design`` section of the file; the file also holds ``registered_utc`` (UTC,
ISO-8601, ``...Z``), ``design_sha256`` and ``format``.

Invariants:

- ``design_sha256 = sha256(canonical_json(design section))``, where
  ``canonical_json`` is sorted keys, no whitespace, ASCII, no NaN.  Every field of
  the design (every cell, scale, margin, seed) is inside the hashed section, so
  changing any of them changes the hash.  The registration time, the format tag
  and the device (CPU or CUDA) are outside it.
- ``load_prereg`` recomputes the hash of the section as stored and refuses the
  file (``PreregError`` naming both hashes) if it differs; it then requires the
  section to parse into a ``Design`` and serialize back to exactly the same
  dict, so no field can be missing, extra, or silently defaulted.
- Cells are dicts with a stable, readable ``id`` derived from their factors
  (``flat-M8-Hg30``, ``hier-2x4-Hr5-Hg30``, ``mech-M8-Hg30-muon``, ``dp-adamw``);
  every reference a cell makes (its controls and baselines) names a cell of the
  design, and every scale includes the cells its cells are compared with.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hypertrain.sim.study.design import (
    Cell,
    CellKind,
    Design,
    Divergence,
    InnerSettings,
    Margins,
    PreregError,
    Scale,
)

__all__ = [
    "CHURN_PATH",
    "H2_PATH",
    "PARITY2_PATH",
    "REGISTRATIONS",
    "Cell",
    "Design",
    "Divergence",
    "InnerSettings",
    "Margins",
    "Prereg",
    "PreregError",
    "Scale",
    "canonical_json",
    "churn_cells",
    "churn_design",
    "churn_scales",
    "design_for",
    "design_hash",
    "h2_cells",
    "h2_design",
    "h2_scales",
    "load_prereg",
    "main",
    "parity2_cells",
    "parity2_design",
    "parity2_scales",
    "registered_cells",
    "registered_design",
    "registered_scales",
    "utc_stamp",
    "verify_registered",
    "write_prereg",
]

FORMAT = "hypertrain-parity-prereg/1"
DEFAULT_PATH = Path(__file__).resolve().parents[1] / "parity_prereg.json"
HASH_RULE = (
    "sha256 of canonical JSON of the design section: sorted keys, separators (',', ':'), ASCII"
)
_UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


# -- the registered grid ---------------------------------------------------------------

FLAT_M = (1, 2, 4, 8, 16, 32)
HIERARCHIES = ((2, 4), (4, 4), (2, 8))
H_G = (10, 30, 100)
H_R = (1, 5, 10)
MECHANISM_M = (4, 8, 16, 32)
MECHANISM_H_G = 30
OUTER_LRS = (0.4, 0.6, 0.8, 1.0)
"""The starting grid for eta_g of docs/design.md §5.4, with momentum 0.9."""
OUTER_MOMENTUM = 0.9
CPU_TINY_OUTER_LRS = (0.05, 0.1, 0.2, 0.4)
"""cpu-tiny's Nesterov sweep.  Its 300 steps give 10 or 30 outer steps, where the
starting grid overshoots: the first registration (2026-11-29T10:28:30Z, the §5.4 grid)
found the loss rising with eta from 0.4 in every arm that ran.  Log-spaced, so a
best eta anywhere from about 0.07 to 0.3 is bracketed."""
INNER_LR = 3e-3
"""The matched inner lr: every arm and the primary DP control."""
CONTROL_SECOND_LR = 6e-3
"""The second DP control lr (sensitivity): the control's batch is M times each
replica's, so a larger step is its most plausible better setting."""
STREAM_FRAGMENTS = 3
STREAM_TAU = 1


def _cell(cid: str, kind: CellKind, r: int, n: int, h: tuple[int, int] | None, **kw: Any) -> Cell:
    """A cell with the registered defaults; ``h`` is (h_g, h_r), None for a control."""
    inner = kw.get("inner", "adamw")
    arm = h is not None
    base: dict[str, Any] = dict(
        id=cid, kind=kind, regions=r, islands_per_region=n, m=r * n,
        h_g=h[0] if h else None, h_r=h[1] if h else None,
        outer="nesterov" if arm else None, outer_lrs=OUTER_LRS if arm else (),
        outer_momentum=OUTER_MOMENTUM if arm else 0.0, inner=inner, inner_lr=INNER_LR,
        fragments=1, tau=0, anneal="full_m", lawa=False, regional_codec="fp32",
        global_codec="fp32", control=f"dp-{inner}" if arm else None,
        control_alt=f"dp-{inner}-lr2" if arm else None, baseline=None, baseline_full=None,
        hypotheses=(),
    )  # fmt: skip
    base.update(kw)
    return Cell(**base)


MECHANISMS: dict[str, dict[str, Any]] = {
    "sparseloco": dict(outer="sparseloco", outer_momentum=0.0, global_codec="sparseloco"),
    "muon": dict(inner="muon"),
    "stream": dict(fragments=STREAM_FRAGMENTS),
    "stream-overlap": dict(fragments=STREAM_FRAGMENTS, tau=STREAM_TAU),
    "anneal-m1": dict(anneal="m1"),
    "lawa": dict(lawa=True),
}
"""H3's mechanisms, each a change to flat DiLoCo (nesterov, adamw, no streaming,
anneal at full M, no LAWA) at the same M and H_g."""


def registered_cells() -> tuple[Cell, ...]:
    """The full grid of docs/design.md §7: controls, the negative control, flat, hierarchies,
    mechanisms."""
    cells = [
        _cell(f"dp-{inner}{sfx}", "control", 1, 1, None, inner=inner, inner_lr=lr)
        for inner in ("adamw", "muon")
        for sfx, lr in (("", INNER_LR), ("-lr2", CONTROL_SECOND_LR))
    ]
    # Negative control: M = 1, H = 1 with plain averaging is data-parallel training.
    negctl = dict(outer="average", outer_lrs=(1.0,), outer_momentum=0.0, hypotheses=("NC",))
    cells.append(_cell("negctl-M1-H1-average", "negative_control", 1, 1, (1, 1), **negctl))
    cells += [
        _cell(f"flat-M{m}-Hg{hg}", "flat", m, 1, (hg, hg), hypotheses=("H2", "H4"))
        for hg in H_G
        for m in FLAT_M
    ]
    cells += [
        _cell(f"hier-{r}x{n}-Hr{hr}-Hg{hg}", "hier", r, n, (hg, hr), hypotheses=("H1",),
              baseline=f"flat-M{r}-Hg{hg}", baseline_full=f"flat-M{r * n}-Hg{hg}")
        for hg in H_G
        for r, n in HIERARCHIES
        for hr in H_R
    ]  # fmt: skip
    hg = MECHANISM_H_G
    cells += [
        _cell(f"mech-M{m}-Hg{hg}-{name}", "mechanism", m, 1, (hg, hg), hypotheses=("H3",),
              baseline=f"flat-M{m}-Hg{hg}", **kw)
        for m in MECHANISM_M
        for name, kw in MECHANISMS.items()
    ]  # fmt: skip
    return tuple(cells)


def _cpu_cells() -> tuple[str, ...]:
    ids = ["dp-adamw", "dp-adamw-lr2", "dp-muon", "dp-muon-lr2", "negctl-M1-H1-average"]
    ids += [f"flat-M{m}-Hg{h}" for h in (10, 30) for m in FLAT_M]
    ids += [f"hier-{r}x{n}-Hr5-Hg30" for r, n in HIERARCHIES]
    ids += [f"mech-M8-Hg30-{k}" for k in MECHANISMS]
    return tuple(ids)


def registered_scales() -> tuple[Scale, ...]:
    """full (docs/design.md §7.3), cpu-tiny (what a 2-core CPU finishes in hours), smoke (tests)."""
    tiny: dict[str, Any] = dict(model="tiny", n_layer=2, d_model=64, n_head=4, seq_len=64)
    return (
        Scale(
            name="full",
            note="S6 full scale: 4 layers, d_model 128, seq 256, 3000 steps, every cell",
            steps=3000,
            model="proxy",
            n_layer=4,
            d_model=128,
            n_head=4,
            seq_len=256,
            global_batch=32,
            holdout_windows=512,
            warmup_steps=100,
            cells=None,
            wall_clock_cap_s=86_400,
            process_cap=8,
        ),
        Scale(
            name="cpu-tiny",
            note="reduced: tiny model, 300 steps, H_g 10 and 30, hierarchies at H_r 5, "
            "mechanisms at M 8, Nesterov eta swept 0.05-0.4 (the first registration's "
            "0.4-1.0 had its best at 0.4 for every arm); about an hour on 2 idle cores",
            steps=300,
            **tiny,
            global_batch=32,
            holdout_windows=256,
            warmup_steps=20,
            cells=_cpu_cells(),
            wall_clock_cap_s=2 * 3600,
            process_cap=2,
            nesterov_outer_lrs=CPU_TINY_OUTER_LRS,
        ),
        Scale(
            name="smoke",
            note="a few steps of four cells, for the test suite",
            steps=20,
            **tiny,
            global_batch=8,
            holdout_windows=16,
            warmup_steps=2,
            cells=("dp-adamw", "dp-adamw-lr2", "negctl-M1-H1-average", "flat-M2-Hg10"),
            wall_clock_cap_s=600,
            process_cap=2,
        ),
    )


def registered_design() -> Design:
    """The design registered in experiments/sim/parity_prereg.json."""
    return Design(scales=registered_scales(), cells=registered_cells())


# -- the cost of churn (a registration of its own) -------------------------------------

CHURN_PATH = DEFAULT_PATH.with_name("churn_prereg.json")
CHURN_M = 8
CHURN_H_G = 10
"""Flat DiLoCo at M = 8, H_g = 10: at cpu-tiny the parity grid's M = 8 arm there had an
interior best eta with smooth means over the sweep (at H_g = 30 the means jumped between
0.1 and 0.2), and 30 rounds of 8 islands give 240 draws per run, so the realized absence
rate of a run stays near p (docs/parity.md, "The cost of churn")."""
CHURN_DROPS = (0.1, 0.3)
"""The registered per-island, per-round drop probabilities; p = 0 is the baseline arm."""


def churn_cells() -> tuple[Cell, ...]:
    """The DP controls, flat DiLoCo at M = 8, H_g = 10 (the paired no-churn arm, p = 0),
    and the same arm with each registered drop probability."""
    parity = {c.id: c for c in registered_cells()}
    base = dataclasses.replace(parity[f"flat-M{CHURN_M}-Hg{CHURN_H_G}"], hypotheses=("C",))
    cells = [parity["dp-adamw"], parity["dp-adamw-lr2"], base]
    cells += [
        dataclasses.replace(base, id=f"churn-M{CHURN_M}-Hg{CHURN_H_G}-p{p:g}", kind="churn",
                            drop=p, baseline=base.id)
        for p in CHURN_DROPS
    ]  # fmt: skip
    return tuple(cells)


def churn_scales() -> tuple[Scale, ...]:
    """cpu-tiny as the parity grid registers it (the same jobs, cell for cell), and smoke."""
    tiny = next(s for s in registered_scales() if s.name == "cpu-tiny")
    ids = tuple(c.id for c in churn_cells())
    churn = f"churn-M{CHURN_M}-Hg{CHURN_H_G}-p{max(CHURN_DROPS):g}"
    return (
        dataclasses.replace(
            tiny,
            note="the cost of churn: flat DiLoCo at M 8, H_g 10, islands dropped from each "
            "round with p 0.1 and 0.3, the paired p = 0 arm, both AdamW DP controls; the "
            "model, steps, batch, holdout and Nesterov sweep of the parity grid's cpu-tiny; "
            "about 15 minutes on one core",
            cells=ids,
            wall_clock_cap_s=3600,
        ),
        Scale(
            name="smoke",
            note="a few steps of the churn arm, its baseline and its control, for the tests",
            steps=20,
            model="tiny",
            n_layer=2,
            d_model=64,
            n_head=4,
            seq_len=64,
            global_batch=8,
            holdout_windows=16,
            warmup_steps=2,
            cells=("dp-adamw", f"flat-M{CHURN_M}-Hg{CHURN_H_G}", churn),
            wall_clock_cap_s=600,
            process_cap=2,
            nesterov_outer_lrs=(0.2,),
        ),
    )


def churn_design() -> Design:
    """The design registered in experiments/sim/churn_prereg.json."""
    gap = (
        "(L_cell - L_dp) / L_dp per seed; the cost of churn: (L_churn - L_base) / L_base per "
        "seed against the same arm without churn, each arm at its own chosen eta, tested "
        "(TOST) at the same margin"
    )
    return Design(protocol="S6-churn", gap=gap, scales=churn_scales(), cells=churn_cells())


# -- H2 at proxy scale (a registration of its own) -------------------------------------

H2_PATH = DEFAULT_PATH.with_name("h2_prereg.json")
H2_M = (1, 32)
H2_H_G = 30
"""Flat DiLoCo at the ends of the parity grid's M range, at H_g = 30 (100 outer steps in
the full scale's 3000): at cpu-tiny the best eta fell with M (docs/parity.md, H2), against
what proxy-scale studies report; this asks whether the model and the run length of the
``full`` scale turn it around."""


def h2_cells() -> tuple[Cell, ...]:
    """The AdamW DP control and flat DiLoCo at M = 1 and 32, H_g = 30, with the starting eta
    grid of docs/design.md §5.4 (0.4-1.0).  Only the matched-lr control: its gap is context
    here, the question is the best eta's direction."""
    parity = {c.id: c for c in registered_cells()}
    cells = [parity["dp-adamw"]]
    cells += [
        dataclasses.replace(parity[f"flat-M{m}-Hg{H2_H_G}"], control_alt=None, hypotheses=("H2",))
        for m in H2_M
    ]
    return tuple(cells)


def h2_scales() -> tuple[Scale, ...]:
    """proxy: the ``full`` scale's model, steps, batch and holdout for these three cells;
    smoke: the same cells for the tests."""
    full = next(s for s in registered_scales() if s.name == "full")
    smoke = next(s for s in registered_scales() if s.name == "smoke")
    ids = tuple(c.id for c in h2_cells())
    return (
        dataclasses.replace(
            full,
            name="proxy",
            note="H2 at proxy scale, exploratory: the full scale's model (4 layers, d_model "
            "128, seq 256), 3000 steps, global batch 32 and 512 held-out windows; flat M 1 and "
            "32 at H_g 30, eta 0.4-1.0, one seed; about 7 CPU-hours, run across sessions",
            cells=ids,
            wall_clock_cap_s=12 * 3600,
            process_cap=2,
        ),
        dataclasses.replace(
            smoke,
            note="a few steps of the three cells, for the tests",
            steps=30,
            global_batch=32,
            cells=ids,
            nesterov_outer_lrs=(0.4, 1.0),
        ),
    )


def h2_design() -> Design:
    """The design registered in experiments/sim/h2_prereg.json: one seed, so no verdict;
    the report is each M's loss over eta and its best eta (exploratory)."""
    return Design(protocol="S6-h2-proxy", seeds=(0,), scales=h2_scales(), cells=h2_cells())


# -- the second parity registration: fresh verdict seeds, the DP lr on both sides --------

PARITY2_PATH = DEFAULT_PATH.with_name("parity2_prereg.json")
PARITY2_DP_LRS = (1e-3, 2e-3, INNER_LR, 6e-3)
"""The DP control's learning rates: both sides of the matched 3e-3 (the first registration
tried only 3e-3 and 6e-3).  The primary verdict is against the matched rate; the
sensitivity verdict against the best of these on the selection seeds."""
PARITY2_SELECTION_SEEDS = (0, 1, 2)
PARITY2_VERDICT_SEEDS = tuple(range(100, 120))
"""20 fresh seeds.  80% TOST power at the cpu-tiny spreads needs 97-300 (docs/parity.md,
Power): the registered cap, what 2 cores finish in a few hours, falls short of that, and
the report says by how much."""
PARITY2_H_G = (10, 30)
PARITY2_H100_M = 8
"""The H = 100 arm: flat M = 8, three outer steps in 300."""


def _dp_id(lr: float) -> str:
    return "dp-adamw" if lr == INNER_LR else f"dp-adamw-lr{lr:g}"


def parity2_cells() -> tuple[Cell, ...]:
    """AdamW DP at four lrs, the negative control, flat M 1-32 at H_g 10 and 30, flat M 8 at
    H_g 100, and the three hierarchies at H_r 1, 5 and 10 (H_g 30); every arm's primary
    control is DP at the matched lr and its sensitivity control the best of the four."""
    sweep = tuple(_dp_id(lr) for lr in PARITY2_DP_LRS)
    dp = [_cell(_dp_id(lr), "control", 1, 1, None, inner_lr=lr) for lr in PARITY2_DP_LRS]
    arm: dict[str, Any] = dict(control="dp-adamw", control_alt=None, control_sweep=sweep)
    negctl = dict(outer="average", outer_lrs=(1.0,), outer_momentum=0.0, hypotheses=("NC",))
    cells = [*dp, _cell("negctl-M1-H1-average", "negative_control", 1, 1, (1, 1), **negctl, **arm)]
    flat = [(m, hg) for hg in PARITY2_H_G for m in FLAT_M] + [(PARITY2_H100_M, 100)]
    cells += [
        _cell(f"flat-M{m}-Hg{hg}", "flat", m, 1, (hg, hg), hypotheses=("H2", "H4"), **arm)
        for m, hg in flat
    ]
    hg = MECHANISM_H_G
    cells += [
        _cell(f"hier-{r}x{n}-Hr{hr}-Hg{hg}", "hier", r, n, (hg, hr), hypotheses=("H1",),
              baseline=f"flat-M{r}-Hg{hg}", baseline_full=f"flat-M{r * n}-Hg{hg}", **arm)
        for r, n in HIERARCHIES
        for hr in H_R
    ]  # fmt: skip
    return tuple(cells)


def parity2_scales() -> tuple[Scale, ...]:
    """cpu-tiny as the first registration has it (model, steps, batch, holdout, eta sweep)
    with this design's cells; smoke: a few steps of the controls and two flat arms."""
    tiny = next(s for s in registered_scales() if s.name == "cpu-tiny")
    smoke = next(s for s in registered_scales() if s.name == "smoke")
    controls = tuple(_dp_id(lr) for lr in PARITY2_DP_LRS)
    return (
        dataclasses.replace(
            tiny,
            note="the second registration: cpu-tiny's model, steps, batch, holdout and eta "
            "sweep; eta (and the best DP lr) chosen on 3 selection seeds, verdicts on 20 fresh "
            "seeds; DP lr 1e-3 to 6e-3; H1 at H_r 1, 5 and 10; an H_g = 100 arm; about 4 "
            "CPU-hours",
            cells=None,
            wall_clock_cap_s=6 * 3600,
        ),
        dataclasses.replace(
            smoke,
            note="a few steps of the four DP controls, the negative control and flat M 2 at "
            "H_g 10, for the tests",
            cells=(*controls, "negctl-M1-H1-average", "flat-M2-Hg10"),
            nesterov_outer_lrs=(0.2, 0.4),
        ),
    )


def parity2_design() -> Design:
    """The design registered in experiments/sim/parity2_prereg.json."""
    return Design(
        seeds=PARITY2_SELECTION_SEEDS,
        verdict_seeds=PARITY2_VERDICT_SEEDS,
        selection_rule="per arm, the outer lr with the lowest mean held-out loss over the "
        "selection seeds among etas with no divergent run, ties to the smaller eta; the "
        "sensitivity control is the DP lr with the lowest mean over the selection seeds",
        scales=parity2_scales(),
        cells=parity2_cells(),
    )


REGISTRATIONS = {
    DEFAULT_PATH: registered_design,
    CHURN_PATH: churn_design,
    H2_PATH: h2_design,
    PARITY2_PATH: parity2_design,
}
"""The repository's registration files and the design each must register."""


def design_for(path: str | Path | None) -> Design:
    """The design the repository registers at ``path``; the parity design for any other."""
    target = Path(path).resolve() if path is not None else DEFAULT_PATH.resolve()
    for known, build in REGISTRATIONS.items():
        if known.resolve() == target:
            return build()
    return registered_design()


# -- hashing and the file ---------------------------------------------------------------


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, ASCII, NaN refused: the bytes the hash is over."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def design_hash(design: Design | dict[str, Any]) -> str:
    """sha256 hex digest of the canonical JSON of the design section."""
    d = design.to_dict() if isinstance(design, Design) else design
    return hashlib.sha256(canonical_json(d).encode("ascii")).hexdigest()


@dataclass(frozen=True, slots=True)
class Prereg:
    """A loaded (or just written) registration whose hash has been verified."""

    path: Path
    design: Design
    design_sha256: str
    registered_utc: str


def utc_stamp(now: datetime | None = None) -> str:
    """ISO-8601 UTC with a Z suffix, to the second."""
    now = now or datetime.now(UTC)
    if now.tzinfo is None or now.utcoffset() is None:
        raise PreregError("registration time must be timezone-aware")
    return now.astimezone(UTC).strftime(_UTC_FORMAT)


def write_prereg(path: str | Path, design: Design, now: datetime | None = None) -> Prereg:
    """Register ``design`` at ``path``: the design, its hash and the UTC time, written atomically."""
    path = Path(path)
    digest, stamp = design_hash(design), utc_stamp(now)
    doc = {
        "format": FORMAT,
        "registered_utc": stamp,
        "hash_rule": HASH_RULE,
        "design_sha256": digest,
        "design": design.to_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_layout(doc) + "\n")
    os.replace(tmp, path)
    return Prereg(path, design, digest, stamp)


def _layout(obj: Any, depth: int = 0) -> str:
    """JSON for people: objects and lists expanded to depth 2, so each cell is one line.

    Layout only; the hash is over ``canonical_json`` of the parsed design, so
    whitespace in the file never matters.
    """
    pad, inner = " " * depth, " " * (depth + 1)
    flat_list = isinstance(obj, list) and not any(isinstance(v, (dict, list)) for v in obj)
    if depth > 2 or not isinstance(obj, (dict, list)) or not obj or flat_list:
        return json.dumps(obj, sort_keys=True, separators=(", ", ": "), allow_nan=False)
    if isinstance(obj, dict):
        keys = sorted(obj, key=lambda k: (k == "design", k))  # the long section last
        items = [f"{inner}{json.dumps(k)}: {_layout(obj[k], depth + 1)}" for k in keys]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + _layout(v, depth + 1) for v in obj) + "\n" + pad + "]"


def load_prereg(path: str | Path) -> Prereg:
    """Read a registration; refuse it unless its design hashes to the stored hash."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise PreregError(f"prereg {path}: no such file (register with --write-prereg)") from None
    except (OSError, ValueError) as e:
        raise PreregError(f"prereg {path}: unreadable: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PreregError(f"prereg {path}: not a {FORMAT} file")
    for key in ("registered_utc", "design_sha256", "design"):
        if key not in doc:
            raise PreregError(f"prereg {path}: missing {key!r}")
    stored, actual = doc["design_sha256"], design_hash(doc["design"])
    if stored != actual:
        raise PreregError(
            f"prereg {path}: design hash mismatch: the file records {stored} but its design "
            f"hashes to {actual}; the design changed after registration, register it anew "
            "with --write-prereg"
        )
    try:
        datetime.strptime(doc["registered_utc"], _UTC_FORMAT)
    except (TypeError, ValueError):
        raise PreregError(
            f"prereg {path}: registered_utc {doc['registered_utc']!r} is not "
            "UTC ISO-8601 (YYYY-MM-DDTHH:MM:SSZ)"
        ) from None
    try:
        design = Design.from_dict(doc["design"])
    except (TypeError, AttributeError, KeyError) as e:  # a field of the wrong JSON type
        raise PreregError(f"prereg {path}: malformed design: {e!r}") from None
    if design.to_dict() != doc["design"]:
        raise PreregError(f"prereg {path}: the design section does not round-trip exactly")
    return Prereg(path, design, stored, doc["registered_utc"])


def verify_registered(path: str | Path, design: Design) -> Prereg:
    """Load ``path`` and require that it registers exactly ``design`` (both hashes named)."""
    pre = load_prereg(path)
    want = design_hash(design)
    if pre.design_sha256 != want:
        raise PreregError(
            f"prereg {pre.path}: registers design {pre.design_sha256}, but the design to run "
            f"hashes to {want}; register it anew with --write-prereg"
        )
    return pre


def main(argv: Sequence[str] | None = None) -> int:
    """``--write-prereg [PATH]`` registers the design of PATH (``design_for``);
    ``--check [PATH]`` verifies a file, without PATH every registration of the repository."""
    ap = argparse.ArgumentParser(
        prog="python -m hypertrain.sim.study.prereg", description=__doc__.split("\n")[0]
    )
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-prereg", nargs="?", const=str(DEFAULT_PATH), metavar="PATH")
    group.add_argument("--check", nargs="?", const="", metavar="PATH")
    args = ap.parse_args(argv)
    try:
        if args.check is not None:
            paths = [Path(args.check)] if args.check else list(REGISTRATIONS)
            for p in paths:
                pre = verify_registered(p, design_for(p))
                print(
                    f"prereg ok: {pre.path} design_sha256={pre.design_sha256} registered {pre.registered_utc}"
                )
            return 0
        path = Path(args.write_prereg)
        design = design_for(path)
        if path.exists():
            try:
                pre = verify_registered(path, design)
                print(
                    f"prereg unchanged: {path} already registers {pre.design_sha256} "
                    f"(registered {pre.registered_utc})"
                )
                return 0
            except PreregError as e:
                print(f"prereg: re-registering ({e})", file=sys.stderr)
        pre = write_prereg(path, design)
        print(
            f"prereg written: {path} design_sha256={pre.design_sha256} registered {pre.registered_utc}"
        )
        return 0
    except PreregError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
