"""The parity design as types: cells, scales, margins, and the design that holds them
(docs/design.md §7).

Pure data with validation; no file I/O and no hashing (prereg.py does those,
and builds the registered instance).  Every class is a frozen dataclass whose
``__post_init__`` raises ``PreregError`` naming the field; ``Design.to_dict``
is the JSON shape of the ``design`` section of the pre-registration file, and
``Design.from_dict`` is its strict inverse (missing or unknown fields are
errors, never defaults).

Invariants:

- Cell ids are unique and match ``[A-Za-z0-9._-]+``; a cell's references (its
  data-parallel controls, its H1/H3 baselines) name cells of the right kind.
- Every scale's cells exist, its steps are a multiple of each of their ``h_g``,
  its global batch divides evenly over each cell's M replicas, and it includes
  every control and baseline its cells are compared with.
- ``ci_level == 1 - 2 * alpha`` (the TOST duality the verdict relies on).
- A ``churn`` cell is its baseline (a flat or hierarchy cell) with ``drop`` > 0 and
  nothing else changed; every other cell has ``drop`` = 0, which its JSON leaves out, so
  a design registered before the field existed keeps its canonical form and hash.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from hypertrain.common.errors import ConfigError

CellKind = Literal["control", "negative_control", "flat", "hier", "mechanism", "churn"]
_KINDS = ("control", "negative_control", "flat", "hier", "mechanism", "churn")
_OMITTED_AT_DEFAULT: dict[str, Any] = {"drop": 0.0, "control_sweep": ()}
"""Cell fields left out of the design's JSON (so out of its hash) while at their default:
a design registered before such a field existed keeps its canonical form and hash."""
_DESIGN_OMITTED_AT_DEFAULT: dict[str, Any] = {"verdict_seeds": ()}
"""The same for the design's own fields."""
_ID = re.compile(r"^[A-Za-z0-9._-]+$")


class PreregError(ConfigError):
    """A design value is invalid, or a pre-registration file is missing, malformed or altered."""


# -- the pieces of the design ---------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Margins:
    """Equivalence margins (docs/design.md §7.5)."""

    heldout_rel: float = 0.005
    """Relative held-out cross-entropy gap: the primary margin (0.5%)."""
    mmlu_points: float = 1.0
    """GPU stage: MMLU, cloze-style at proxy scale, in points."""
    benchmark_mean_points: float = 1.0
    """GPU stage: mean over the benchmark suite, in points."""
    gsm8k_points: float = 2.0
    """GPU stage: GSM8K, only at 7B and above, in points."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise PreregError(f"margins: {f.name} must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerSettings:
    """Inner-optimizer settings shared by every cell (common/optim.py InnerConfig)."""

    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    decay_fraction: float = 0.2
    """WSD decay: the last 20% of steps (docs/design.md §3.4); the anneal phase of §3.6."""
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Divergence:
    """When a run counts as divergent (recorded, and excluded from the eta selection)."""

    nonfinite: bool = True
    """Any non-finite training or held-out loss."""
    max_heldout_ratio: float = 1.0
    """Final held-out loss above this multiple of the held-out loss at initialization."""

    def check(self, initial: float, final: float, saw_nonfinite: bool) -> tuple[bool, str]:
        """(divergent?, reason) for one run."""
        if self.nonfinite and (saw_nonfinite or not math.isfinite(final)):
            return True, "non-finite loss"
        if final > self.max_heldout_ratio * initial:
            return (
                True,
                f"held-out {final:.6g} > {self.max_heldout_ratio:g} x initial {initial:.6g}",
            )
        return False, ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    """A registered scale: model, steps, batch, holdout, which cells, and the caps."""

    name: str
    note: str
    steps: int
    """Inner steps per replica; a multiple of every included cell's h_g."""
    model: str
    """Model preset (common/model.py PRESETS); its shape is repeated below."""
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    global_batch: int
    """Sequences per step across all replicas (the DP control's batch)."""
    holdout_windows: int
    """Held-out windows evaluated (the first n of the fixed 512)."""
    warmup_steps: int
    cells: tuple[str, ...] | None
    """Cell ids run at this scale; None = every cell of the design."""
    wall_clock_cap_s: int
    """The runner stops starting jobs after this many seconds (the rest are censored)."""
    process_cap: int
    """At most this many worker processes."""
    nesterov_outer_lrs: tuple[float, ...] | None = None
    """The eta_g sweep of every Nesterov cell at this scale; None = the cells' own sweep
    (the starting grid of docs/design.md §5.4).  A short run has few outer steps, so its best
    eta can lie below the starting grid; a scale registers the sweep that brackets it."""

    def __post_init__(self) -> None:
        where = f"scale {self.name!r}"
        if not _ID.match(self.name):
            raise PreregError(f"{where}: name must match {_ID.pattern}")
        for name in ("steps", "n_layer", "d_model", "n_head", "seq_len", "global_batch"):
            if getattr(self, name) < 1:
                raise PreregError(f"{where}: {name} must be >= 1")
        if self.d_model % self.n_head:
            raise PreregError(
                f"{where}: n_head {self.n_head} does not divide d_model {self.d_model}"
            )
        if not 1 <= self.holdout_windows <= 512:
            raise PreregError(f"{where}: holdout_windows must be in [1, 512]")
        if not 0 <= self.warmup_steps < self.steps:
            raise PreregError(f"{where}: warmup_steps must be in [0, steps)")
        if self.wall_clock_cap_s < 1 or self.process_cap < 1:
            raise PreregError(f"{where}: wall_clock_cap_s and process_cap must be >= 1")
        lrs = self.nesterov_outer_lrs
        if lrs is not None and (
            not lrs or not all(e > 0 for e in lrs) or list(lrs) != sorted(set(lrs))
        ):
            raise PreregError(
                f"{where}: nesterov_outer_lrs must be distinct positive values, ascending"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Cell:
    """One arm of the grid.  Fields that do not apply are None (controls have no H)."""

    id: str
    kind: CellKind
    regions: int
    """R; a flat run is R = M regions of one island each; a control is 1."""
    islands_per_region: int
    """n_r."""
    m: int
    """Total replicas N = R * n_r."""
    h_g: int | None
    h_r: int | None
    outer: Literal["nesterov", "average", "sparseloco"] | None
    outer_lrs: tuple[float, ...]
    """The eta_g sweep; the reported eta follows the selection rule (stats.select_outer_lr)."""
    outer_momentum: float
    inner: Literal["adamw", "muon"]
    inner_lr: float
    fragments: int
    """Streaming fragments (1 = no streaming)."""
    tau: int
    """Merge delay in steps (0 = no overlap)."""
    anneal: Literal["full_m", "m1"]
    lawa: bool
    regional_codec: str
    global_codec: str
    control: str | None
    """The data-parallel control at the matched inner lr (primary comparison)."""
    control_alt: str | None
    """The data-parallel control at the second lr (sensitivity: best of the two)."""
    baseline: str | None
    """H1: flat M = R at the same H_g; H3: flat DiLoCo at the same M."""
    baseline_full: str | None
    """H1 only: flat M = R * n_r at the same H_g."""
    hypotheses: tuple[str, ...]
    drop: float = 0.0
    """Churn: the probability that an island is absent from a sync step (SimJob.drop); > 0
    exactly for ``churn`` cells, whose baseline is the same arm without churn.  Left out of
    the JSON (and the hash) at 0."""
    control_sweep: tuple[str, ...] = ()
    """The data-parallel controls (one per inner lr) the sensitivity comparison takes the
    best of; () = ``control`` and ``control_alt``.  Left out of the JSON (and the hash) at
    ()."""

    def __post_init__(self) -> None:
        where = f"cell {self.id!r}"
        if not _ID.match(self.id):
            raise PreregError(f"{where}: id must match {_ID.pattern}")
        if self.kind not in _KINDS:
            raise PreregError(f"{where}: unknown kind {self.kind!r}")
        if isinstance(self.drop, bool) or not isinstance(self.drop, (int, float)):
            raise PreregError(f"{where}: drop must be a number")
        if not 0.0 <= self.drop < 1.0 or (self.drop > 0) != (self.kind == "churn"):
            raise PreregError(f"{where}: drop must be in (0, 1) for a churn cell, 0 otherwise")
        if self.kind == "churn" and (self.baseline is None or self.fragments != 1
                                     or self.anneal != "full_m"):  # fmt: skip
            raise PreregError(
                f"{where}: a churn cell names its baseline and has one fragment, anneal full_m"
            )
        if self.regions < 1 or self.islands_per_region < 1:
            raise PreregError(f"{where}: regions and islands_per_region must be >= 1")
        if self.m != self.regions * self.islands_per_region:
            raise PreregError(f"{where}: m must be regions * islands_per_region")
        if self.inner not in ("adamw", "muon") or not self.inner_lr > 0:
            raise PreregError(f"{where}: inner must be adamw|muon with lr > 0")
        if self.anneal not in ("full_m", "m1") or self.fragments < 1 or self.tau < 0:
            raise PreregError(f"{where}: bad anneal, fragments or tau")
        if self.kind == "control":
            if (self.h_g, self.h_r, self.outer, self.outer_lrs, self.m) != (
                None,
                None,
                None,
                (),
                1,
            ):
                raise PreregError(f"{where}: a control has m = 1 and no H, outer or eta sweep")
            return
        if self.h_g is None or self.h_r is None or self.h_r < 1 or self.h_g % self.h_r:
            raise PreregError(f"{where}: h_g must be a multiple of h_r >= 1")
        if self.tau >= self.h_r:
            raise PreregError(f"{where}: tau must be < h_r")
        if self.outer not in ("nesterov", "average", "sparseloco"):
            raise PreregError(f"{where}: outer must be nesterov|average|sparseloco")
        if not self.outer_lrs or not all(e > 0 for e in self.outer_lrs):
            raise PreregError(f"{where}: outer_lrs must be a non-empty list of positive values")
        if self.outer == "sparseloco" and not self.global_codec.startswith("sparseloco"):
            raise PreregError(f"{where}: the sparseloco outer needs a sparseloco global_codec")
        if self.control is None:
            raise PreregError(f"{where}: every arm names its data-parallel control")
        if self.control_sweep and (
            self.control_alt is not None
            or self.control not in self.control_sweep
            or len(set(self.control_sweep)) != len(self.control_sweep)
        ):
            raise PreregError(
                f"{where}: a control_sweep lists distinct controls, its control among them, "
                "and replaces control_alt (None)"
            )

    def refs(self) -> dict[str, str]:
        """The cells this one is compared with, by role (a control sweep's as
        ``control_sweep[i]``)."""
        roles = ("control", "control_alt", "baseline", "baseline_full")
        out = {r: v for r in roles if (v := getattr(self, r)) is not None}
        out.update({f"control_sweep[{i}]": c for i, c in enumerate(self.control_sweep)})
        return out

    def sensitivity_controls(self) -> tuple[str, ...]:
        """The controls the sensitivity comparison takes the best of."""
        if self.control_sweep:
            return self.control_sweep
        return tuple(c for c in (self.control, self.control_alt) if c is not None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Design:
    """Everything the hash covers."""

    protocol: str = "S6"
    seeds: tuple[int, ...] = (0, 1, 2)
    """Every job's seeds; with ``verdict_seeds``, the selection seeds: the eta sweep (and
    the best control lr) is chosen on these alone."""
    verdict_seeds: tuple[int, ...] = ()
    """Fresh seeds the verdicts are computed on: each arm runs them at the eta chosen on
    ``seeds``, every control runs them too.  () = the verdicts use ``seeds`` (the eta is
    chosen on the verdict's own seeds: the winner's curse).  Left out of the JSON (and the
    hash) at ()."""
    primary_metric: str = "heldout_ce"
    """Held-out cross-entropy on the fixed holdout windows."""
    gap: str = "(L_cell - L_dp) / L_dp per seed"
    alpha: float = 0.05
    """Per one-sided test (TOST)."""
    ci_level: float = 0.90
    """Paired-t interval; must equal 1 - 2 * alpha."""
    margins: Margins = field(default_factory=Margins)
    promotion_sd: float = 2.0
    """H3: promote a mechanism whose mean paired improvement over flat DiLoCo at the
    same M exceeds this many sd of the paired difference across seeds."""
    selection_rule: str = (
        "per cell, the outer lr with the lowest mean held-out loss over the seeds among "
        "etas with no divergent run; ties to the smaller eta"
    )
    lawa_checkpoints: int = 5
    """LAWA cells average the last this-many global-round checkpoints (one per H_g steps;
    in a short run they reach back before the decay starts)."""
    inner: InnerSettings = field(default_factory=InnerSettings)
    divergence: Divergence = field(default_factory=Divergence)
    scales: tuple[Scale, ...] = ()
    cells: tuple[Cell, ...] = ()

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise PreregError("design: seeds must be distinct and non-empty")
        if len(set(self.verdict_seeds)) != len(self.verdict_seeds) or set(self.verdict_seeds) & set(
            self.seeds
        ):
            raise PreregError("design: verdict_seeds must be distinct and not selection seeds")
        if self.verdict_seeds and len(self.verdict_seeds) < 2:
            raise PreregError("design: a verdict needs at least 2 verdict_seeds")
        if not 0 < self.alpha < 0.5 or abs(self.ci_level - (1 - 2 * self.alpha)) > 1e-12:
            raise PreregError("design: need 0 < alpha < 0.5 and ci_level = 1 - 2 * alpha")
        if not self.promotion_sd > 0 or self.lawa_checkpoints < 1:
            raise PreregError("design: promotion_sd must be > 0 and lawa_checkpoints >= 1")
        by_id = {c.id: c for c in self.cells}
        if len(by_id) != len(self.cells):
            raise PreregError("design: cell ids must be unique")
        for c in self.cells:
            for role, ref in c.refs().items():
                want = "control" if role.startswith("control") else "flat"
                ok = (want, "hier") if c.kind == "churn" and role == "baseline" else (want,)
                if ref not in by_id or by_id[ref].kind not in ok:
                    raise PreregError(f"cell {c.id!r}: {role} {ref!r} is not a {want} cell")
            if c.kind == "churn":
                self._check_churn(c, by_id[c.baseline or ""])
        if len({s.name for s in self.scales}) != len(self.scales):
            raise PreregError("design: scale names must be unique")
        for s in self.scales:
            self._check_scale(s, by_id)

    @staticmethod
    def _check_churn(c: Cell, base: Cell) -> None:
        """A churn cell is its baseline with ``drop`` > 0: nothing else may differ."""
        same = dataclasses.replace(
            c, id=base.id, kind=base.kind, drop=base.drop, baseline=base.baseline,
            baseline_full=base.baseline_full, hypotheses=base.hypotheses,
        )  # fmt: skip
        if same != base:
            raise PreregError(
                f"cell {c.id!r}: a churn cell must equal its baseline {base.id!r} but for "
                "its id, kind, drop and hypotheses"
            )

    def _check_scale(self, s: Scale, by_id: dict[str, Cell]) -> None:
        ids = s.cells if s.cells is not None else tuple(by_id)
        for cid in ids:
            c = by_id.get(cid)
            if c is None:
                raise PreregError(f"scale {s.name!r}: unknown cell {cid!r}")
            if c.h_g is not None and s.steps % c.h_g:
                raise PreregError(f"scale {s.name!r}: steps {s.steps} not a multiple of {cid} h_g")
            if s.global_batch % c.m:
                raise PreregError(f"scale {s.name!r}: global_batch not divisible by {cid} m")
            for role, ref in c.refs().items():
                if role != "control_alt" and ref not in ids:
                    raise PreregError(f"scale {s.name!r}: {cid} needs its {role} {ref!r}")

    def scale(self, name: str) -> Scale:
        for s in self.scales:
            if s.name == name:
                return s
        raise PreregError(
            f"no scale {name!r} (registered: {', '.join(s.name for s in self.scales)})"
        )

    def cells_of(self, scale: str) -> tuple[Cell, ...]:
        """The cells run at ``scale``, in design order."""
        ids = self.scale(scale).cells
        return self.cells if ids is None else tuple(c for c in self.cells if c.id in set(ids))

    def sweep(self, cell: Cell, scale: str) -> tuple[float, ...]:
        """The etas ``cell`` runs at ``scale``: the scale's Nesterov sweep where it registers
        one, else the cell's own; () for a control."""
        lrs = self.scale(scale).nesterov_outer_lrs
        return lrs if lrs is not None and cell.outer == "nesterov" else cell.outer_lrs

    def cell(self, cell_id: str) -> Cell:
        for c in self.cells:
            if c.id == cell_id:
                return c
        raise PreregError(f"no cell {cell_id!r}")

    @property
    def verdict_seeds_or_seeds(self) -> tuple[int, ...]:
        """The seeds the verdicts are computed on."""
        return self.verdict_seeds or self.seeds

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _plain(dataclasses.asdict(self))
        for name, default in _DESIGN_OMITTED_AT_DEFAULT.items():
            if out[name] == _plain(default):
                del out[name]
        for cell in out["cells"]:
            for name, default in _OMITTED_AT_DEFAULT.items():
                if cell[name] == _plain(default):
                    del cell[name]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Design:
        nested = {"margins": Margins, "inner": InnerSettings, "divergence": Divergence}
        _expect_keys(cls, d, "design", optional=set(_DESIGN_OMITTED_AT_DEFAULT))
        kwargs: dict[str, Any] = {k: _leaf(nested[k], v, k) for k, v in d.items() if k in nested}
        kwargs["scales"] = tuple(_leaf(Scale, s, f"scales[{i}]") for i, s in enumerate(d["scales"]))
        kwargs["cells"] = tuple(
            _leaf(Cell, c, f"cells[{i}]", optional=set(_OMITTED_AT_DEFAULT))
            for i, c in enumerate(d["cells"])
        )
        kwargs["seeds"] = tuple(d["seeds"])
        kwargs["verdict_seeds"] = tuple(d.get("verdict_seeds", ()))
        rest = {k: v for k, v in d.items() if k not in kwargs}
        return cls(**kwargs, **rest)


def _plain(obj: Any) -> Any:
    """Tuples as lists, recursively (the JSON shape)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _expect_keys(cls: Any, d: Any, where: str, optional: set[str] | None = None) -> None:
    """``d`` has exactly the fields of ``cls``, but for those in ``optional`` (left out at
    their default)."""
    if not isinstance(d, dict):
        raise PreregError(f"{where}: expected an object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    missing = sorted(names - set(d) - (optional or set()))
    extra = sorted(set(d) - names)
    if missing or extra:
        raise PreregError(f"{where}: missing fields {missing}, unknown fields {extra}")


def _leaf(cls: Any, d: Any, where: str, optional: set[str] | None = None) -> Any:
    _expect_keys(cls, d, where, optional)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise PreregError(f"{where}: {e}") from None
