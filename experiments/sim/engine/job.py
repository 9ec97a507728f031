"""What the simulator runs and what it reports: ``SimJob`` and ``JobResult``.

One ``SimJob`` is one cell x seed x outer learning rate at one scale.  It is the
core's ``RunConfig`` (``SimJob.run``: the model, the steps, the seed, the topology,
B = N x batch_per_island, the inner and outer optimizers, the two codecs, error
feedback, the data and the held-out windows) plus only what the simulator has of
its own: the data-parallel control, streaming fragments, the anneal, LAWA, the
evaluation points and holdout seed, the divergence rule, and the execution fields.
A field added to ``RunConfig`` exists once: the job carries it in ``run``, ``build``
and ``from_dict`` accept it under its name, and ``to_dict`` (so ``key()``) names it
once it differs from its default.  ``run_job`` (run.py) turns a job into a
``JobResult``.

Jobs are usually made from the flat vocabulary of ``to_dict`` (``model``, ``steps``,
``global_batch``, ``regions``, ``h_g``, ...)::

    SimJob.build(regions=2, islands_per_region=4, h_r=5, h_g=30, steps=300, model="tiny")
    flat_job(8, 30, steps=300)      # R = M regions of one island, h_r = h_g
    dp_job(h=30, steps=300)         # the data-parallel control
    job.replace(seed=1)             # flat names, or the dataclass fields (run=..., path=...)

and every run-side name of that vocabulary is a read-only property (``job.h_g`` is
``job.run.topology.h_g``, ``job.global_batch`` is ``job.run.global_batch``, ...).

How the flat vocabulary maps onto the run (what it meant before the job held one):

- regions R are named ``r0``, ``r1``, ... zero-padded, so that their sorted order (the
  cores' aggregation order) is the replica order; replica i is ``island_ids()[i]``;
- ``global_batch`` B is ``run.batch_per_island`` x N, N = R x n_r (B must divide);
- a model that is no preset (the registered reduced scales) is ``run.model_shape``;
- ``holdout`` is ``run.holdout_windows``; ``run.run_id`` and ``run.threads`` stay at
  their defaults (``SimJob.threads`` is the execution setting);
- the data-parallel control (``dp_steps`` set: one replica on the whole batch, no
  outer loop) has R = n_r = 1, h_r = h_g = its eval and LAWA cadence, and trains
  ``dp_steps`` steps, which need not be a multiple of h_g; its ``run.steps`` is
  h_g x max(1, dp_steps // h_g), as a RunConfig needs (the cores never run it).

Invariants:
- Every field is validated (``RunConfig``'s own checks, then ``__post_init__``;
  ``ConfigError`` naming the field), including what the role cores would refuse (a
  sparseloco outer optimizer without a sparseloco global codec): a job that
  constructs is a job that runs.
- ``design_dict()`` holds every field that changes the numbers; the execution
  fields ``path``, ``device`` and ``threads`` are outside it (and outside
  ``key()``), because the per-replica and batched paths and CPU vs CUDA compute
  the same function (tests/unit/test_sim_engine.py; ``device_equivalence_check``).
- ``to_dict()`` (and so ``key()``) is the flat form the registered grids' results were
  keyed by; ``from_dict`` reads it back.
- ``JobResult.to_dict()`` is strict JSON: non-finite floats become ``None``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hypertrain.common.config import CUSTOM_MODEL, RunConfig, TopologyConfig, anneal_islands
from hypertrain.common.errors import ConfigError
from hypertrain.common.fragments import cut_problem, fragment_offset
from hypertrain.common.model import ModelConfig
from hypertrain.common.optim import InnerConfig
from hypertrain.common.outer import OuterConfig
from hypertrain.common.schedule import anneal_starts

ExecPath = Literal["batched", "per_replica"]
Anneal = str
"""full_m | m1 | h_r1 | islands:K (docs/design.md §3.6)."""
DEVICE_ENV = "HYPERTRAIN_SIM_DEVICE"
EXECUTION_FIELDS = ("path", "device", "threads")
"""Fields outside the design: they choose how a job runs, not what it computes."""

FLAT_FIELDS = (
    "model", "steps", "global_batch", "seed", "dp", "regions", "islands_per_region", "h_r",
    "h_g", "inner", "outer", "regional_codec", "global_codec", "ef_beta", "fragments", "tau",
    "anneal", "lawa_k", "lawa_every", "eval_points", "holdout", "holdout_seed",
    "diverge_ratio", "data", "path", "device", "threads",
)  # fmt: skip
"""The flat vocabulary of ``build``, ``to_dict`` and ``replace``, in ``to_dict`` order (run
fields the mapping does not name come in addition, see ``RUN_EXTRAS``)."""
SIM_EXTRAS = ("drop", "fragment_cut")
"""The simulator's own fields that ``to_dict`` (so ``key()``) names only where they differ
from their default: a job without them keeps the key it had before they existed."""
_SIM_DEFAULTS: dict[str, Any] = {"drop": 0.0, "fragment_cut": "params"}

SIM_RUN_DEFAULTS: dict[str, Any] = dict(
    model="proxy", steps=3000, global_batch=32, regions=1, islands_per_region=1, h_r=30,
    h_g=30, regional_codec="fp32",
)  # fmt: skip
"""The simulator's defaults where they differ from RunConfig's (the proxy of
docs/design.md §8 at B = 32, one replica, H = 30, no compression); every other run-side
default is RunConfig's."""

_RUN_MAPPED = frozenset({
    "model", "model_shape", "seed", "steps", "batch_per_island", "topology", "inner", "outer",
    "regional_codec", "global_codec", "ef_beta", "data", "holdout_windows",
})  # fmt: skip
_RUN_FIXED = frozenset({
    "run_id", "threads", "membership", "robust", "lawa", "anneal", "fragments", "fragment_cut",
})  # fmt: skip
"""RunConfig fields that are not the simulator's: a job's run keeps their defaults (the
simulator has no clock and takes no cutoffs, its islands are all honest: robust rules
are the daemons' defence against hostile ones, and its LAWA is its own ``lawa_k`` and
``lawa_every``, with the same arithmetic; its anneal is its own ``anneal``, whose ``h_r1``
is the system's, and its streaming fragments its own ``fragments`` and ``fragment_cut``,
cut by the system's rule)."""
_TOPO_MAPPED = frozenset({"regions", "islands_per_region", "h_r", "h_g", "tau"})
_TOPO_FIXED = frozenset({"relay_shards"})
"""TopologyConfig fields that are not the simulator's: how many processes a region's relay
runs as changes no bit of a run (common/shards.py), so a job keeps the default."""
RUN_EXTRAS = tuple(
    f.name for f in dataclasses.fields(RunConfig) if f.name not in _RUN_MAPPED | _RUN_FIXED
)
"""RunConfig fields the flat vocabulary does not map: taken under their own names."""
TOPOLOGY_EXTRAS = tuple(
    f.name for f in dataclasses.fields(TopologyConfig) if f.name not in _TOPO_MAPPED | _TOPO_FIXED
)
"""TopologyConfig fields the flat vocabulary does not map: taken under their own names."""
_DEFAULT_RUN = RunConfig().to_dict()
_DEFAULT_CUT = RunConfig().fragment_cut


def region_names(regions: int) -> tuple[str, ...]:
    """``r0``, ``r1``, ...: zero-padded so that sorted order is replica order."""
    width = len(str(regions - 1))
    return tuple(f"r{k:0{width}d}" for k in range(regions))


def _plain(value: Any) -> Any:
    """A config dataclass as the dict ``RunConfig.from_dict`` parses; anything else as is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class SimJob:
    """One simulated training run (see the module docstring)."""

    run: RunConfig
    """The core's run configuration; ``core_config()`` is this run."""
    dp_steps: int | None = None
    """Set: the data-parallel control (one replica on the whole global batch, no outer
    loop), trained for dp_steps inner steps; None: DiLoCo on ``run.topology``."""
    fragments: int = 1
    """Streaming DiLoCo: F parameter fragments synced on staggered steps (1 = off)."""
    fragment_cut: str = "params"
    """How the fragments are cut (common/fragments.py ``CUTS``): ``params`` (whole
    parameters, the registered cells' cut; the simulator's default) or ``values`` (equal
    value ranges, the run configuration's default); only with fragments > 1."""
    anneal: Anneal = "full_m"
    """full_m: the WSD decay runs on the full hierarchy.  m1: from the last global sync at
    or before the decay start, all replicas are merged (fixed-order fp32 mean) after every
    step, i.e. M_eff = 1 (docs/design.md §3.6); needs fragments = 1 and tau = 0.  h_r1 and
    islands:K are the system's (a streaming fragment switches at its own start); h_r1
    needs tau 0."""
    lawa_k: int = 0
    """Final held-out loss of the mean of the last k checkpoints (0 = off)."""
    lawa_every: int = 0
    """Checkpoint cadence in steps (0 = h_g, one per global round; with streaming
    fragments, each fragment's own global rounds, as the system's aggregators keep them)."""
    eval_points: int = 8
    """Held-out evaluations along the run (the last one is at ``steps``)."""
    holdout_seed: int = 0
    """Seed choosing the 512 holdout windows (fixed across seeds, so arms share them)."""
    diverge_ratio: float = 1.0
    """Divergent (and stopped) when a held-out loss at any eval point exceeds this multiple of
    the initial one; any non-finite loss or parameter is divergent too (design.Divergence)."""
    drop: float = 0.0
    """Churn: the probability that an island is absent from a sync step (0 = never; then the
    run is the run without churn, bit for bit).  Drawn per island and sync step from the seed
    alone, apart from the training's random numbers; an absent island's delta is left out of
    the merge, and it takes the merge like the others (engine/churn.py)."""
    path: ExecPath = "batched"
    """Execution only: ``batched`` (one stacked model) or ``per_replica`` (M models)."""
    device: str | None = None
    """Execution only: cpu | cuda | cuda:N; None = $HYPERTRAIN_SIM_DEVICE, else cpu."""
    threads: int | None = None
    """Execution only: torch intra-op threads (None = leave the process setting)."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"sim job: {msg}")

        run, topo = self.run, self.run.topology
        if run.run_id != _DEFAULT_RUN["run_id"] or run.threads != _DEFAULT_RUN["threads"]:
            raise bad("run.run_id and run.threads stay at their defaults (threads: SimJob.threads)")
        if run.lawa:
            raise bad("run.lawa stays 0: the simulator's LAWA is lawa_k (and lawa_every)")
        if run.anneal != "full_m":
            raise bad("run.anneal stays full_m: the simulator's anneal is its own anneal field")
        if run.fragments != 1 or run.fragment_cut != _DEFAULT_CUT:
            raise bad(
                "run.fragments and run.fragment_cut stay at their defaults: the simulator's "
                "are its own fields"
            )
        if topo.regions != region_names(len(topo.regions)):
            raise bad(
                f"run.topology.regions must be {region_names(len(topo.regions))} (sorted order "
                f"= replica order), got {topo.regions}"
            )
        if self.fragments < 1 or self.eval_points < 1 or self.lawa_k < 0 or self.lawa_every < 0:
            raise bad("need fragments >= 1, eval_points >= 1, lawa_k >= 0, lawa_every >= 0")
        if run.seed < 0 or self.holdout_seed < 0 or not self.diverge_ratio > 0:
            raise bad("seeds must be >= 0 and diverge_ratio > 0")
        if self.path not in ("batched", "per_replica"):
            raise bad(f"path must be batched|per_replica, got {self.path!r}")
        try:
            few = anneal_islands(self.anneal)
        except ConfigError:
            few = 0
        if self.anneal not in ("full_m", "m1", "h_r1") and not few:
            raise bad(f"anneal must be full_m|m1|h_r1|islands:K, got {self.anneal!r}")
        if few and few >= self.n_replicas:
            raise bad(f"anneal {self.anneal}: K must be below the {self.n_replicas} replicas")
        if self.threads is not None and self.threads < 1:
            raise bad("threads must be >= 1")
        if self.dp_steps is not None:
            if self.dp_steps < 1:
                raise bad(f"dp_steps must be >= 1, got {self.dp_steps}")
            if (self.n_replicas, self.fragments, self.tau) != (1, 1, 0):
                raise bad("the data-parallel control has one replica, no fragments and tau 0")
            if self.anneal != "full_m" or self.h_r != self.h_g:
                raise bad("the data-parallel control has no anneal variant and h_r == h_g")
            if run.steps != self.h_g * max(1, self.dp_steps // self.h_g):
                raise bad(
                    f"the data-parallel control's run.steps ({run.steps}) must be h_g x "
                    f"max(1, steps // h_g) for its {self.dp_steps} steps and h_g {self.h_g}"
                )
        if self.fragments > self.h_g:
            raise bad(f"fragments ({self.fragments}) must be <= h_g ({self.h_g}) to stagger")
        if self.anneal == "m1" and self.fragments != 1:
            raise bad("anneal m1 needs fragments = 1 (all replicas equal at its start)")
        if self.anneal in ("m1", "h_r1") and self.tau:
            raise bad(f"anneal {self.anneal} needs tau = 0 (every step syncs in it)")
        if self.anneal != "full_m" and self.fragments > 1:
            starts = anneal_starts(self.steps, self.h_g, self.inner.decay_fraction, self.fragments)
            for f, start in enumerate(starts):
                if start is None:
                    raise bad(
                        f"anneal {self.anneal}: fragment {f} has no global sync step at or "
                        f"before the decay's start (its first is step "
                        f"{fragment_offset(f, self.fragments, self.h_g)})"
                    )
        if (problem := cut_problem(self.fragment_cut)) is not None:
            raise bad(f"fragment_cut {problem}")
        if self.fragments == 1 and self.fragment_cut != _SIM_DEFAULTS["fragment_cut"]:
            raise bad("fragment_cut is only set with fragments > 1 (one fragment is not cut)")
        if self.fragments > 1 and self.steps < self.h_g:
            raise bad("streaming needs at least one full global round")
        if not 0.0 <= self.drop < 1.0:
            raise bad(f"drop must be in [0, 1), got {self.drop}")
        if self.drop and (
            self.dp_steps is not None or self.fragments != 1 or self.anneal != "full_m"
        ):
            raise bad("drop needs a DiLoCo run without fragments and with anneal full_m")

    @property
    def lawa_per_fragment(self) -> bool:
        """LAWA over each streaming fragment's own last global rounds (its default cadence
        with fragments, as the system's aggregators keep them), else of the joined state
        every ``lawa_every`` (or h_g) steps."""
        return bool(self.lawa_k) and self.fragments > 1 and not self.lawa_every

    @classmethod
    def of_run(cls, cfg: RunConfig, **fields: Any) -> SimJob:
        """The simulator's job for the system's run ``cfg`` (the in-process run's and the
        daemons'): the run fields the simulator keeps as its own (fragments and their cut,
        the anneal, LAWA over the last global rounds) moved to them; ``fields`` sets the
        rest (``path``, ``eval_points``, ...)."""
        run = cfg.with_overrides(fragments=1, fragment_cut=_DEFAULT_CUT, anneal="full_m", lawa=0)
        split = cfg.fragments > 1
        return cls(
            run=run,
            fragments=cfg.fragments,
            fragment_cut=cfg.fragment_cut if split else _SIM_DEFAULTS["fragment_cut"],
            anneal=cfg.anneal,
            lawa_k=cfg.lawa,
            **fields,
        )

    @classmethod
    def build(cls, **fields: Any) -> SimJob:
        """A job from the flat vocabulary (``FLAT_FIELDS``; the simulator's defaults, then
        RunConfig's).  ``model``, ``inner`` and ``outer`` may be configs or their dicts."""

        def bad(msg: str) -> ConfigError:
            return ConfigError(f"sim job: {msg}")

        unknown = sorted(set(fields) - {*FLAT_FIELDS, *SIM_EXTRAS, *RUN_EXTRAS, *TOPOLOGY_EXTRAS})
        if unknown:
            raise bad(f"unknown field(s) {', '.join(unknown)}")
        f = {**SIM_RUN_DEFAULTS, **fields}
        own = {k: f.pop(k) for k in _OWN_FIELDS if k in f}
        for name in ("steps", "global_batch", "regions", "islands_per_region", "h_r", "h_g"):
            if f[name] < 1:
                raise bad(f"{name} must be >= 1, got {f[name]}")
        dp, steps, h_g = bool(f.pop("dp", False)), f.pop("steps"), f["h_g"]
        batch, regions, n_r = f.pop("global_batch"), f.pop("regions"), f.pop("islands_per_region")
        if batch % (regions * n_r):
            raise bad(f"{regions * n_r} replicas do not divide global_batch {batch}")
        model = f.pop("model")
        run: dict[str, Any] = {
            "steps": h_g * max(1, steps // h_g) if dp else steps,
            "batch_per_island": batch // (regions * n_r),
            "topology": {"regions": region_names(regions), "islands_per_region": n_r},
        }
        if isinstance(model, str):
            run["model"] = model
        else:
            run.update(model=CUSTOM_MODEL, model_shape=_plain(model))
        if "holdout" in f:
            run["holdout_windows"] = f.pop("holdout")
        for name, value in f.items():
            in_topology = name in _TOPO_MAPPED or name in TOPOLOGY_EXTRAS
            (run["topology"] if in_topology else run)[name] = _plain(value)
        try:
            parsed = RunConfig.from_dict(run)
        except ConfigError as e:
            raise bad(str(e)) from None
        return cls(run=parsed, dp_steps=steps if dp else None, **own)

    # -- the run-side names of the flat vocabulary (read-only) -------------------------
    @property
    def model(self) -> str | ModelConfig:
        """A preset name (common/model.py) or the ModelConfig of a reduced registered scale."""
        return self.run.model_shape if self.run.model_shape is not None else self.run.model

    @property
    def steps(self) -> int:
        """Inner steps per replica; a multiple of h_g (unless ``dp``)."""
        return self.dp_steps if self.dp_steps is not None else self.run.steps

    @property
    def global_batch(self) -> int:
        """B: sequences per step over all replicas (the DP control's batch)."""
        return self.run.global_batch

    @property
    def seed(self) -> int:
        """Fixes the initialization and the sample stream (all arms of a seed see the same data)."""
        return self.run.seed

    @property
    def dp(self) -> bool:
        """The data-parallel control: one replica on the whole global batch, no outer loop."""
        return self.dp_steps is not None

    @property
    def regions(self) -> int:
        """R, the number of regions (their names: ``run.topology.regions``)."""
        return len(self.run.topology.regions)

    @property
    def islands_per_region(self) -> int:
        """n_r: islands per region (N = R * n_r replicas)."""
        return self.run.topology.islands_per_region

    @property
    def h_r(self) -> int:
        """Regional sync interval in inner steps (plain averaging, eta_r = 1)."""
        return self.run.topology.h_r

    @property
    def h_g(self) -> int:
        """Global sync interval; a multiple of h_r.  Also the LAWA and eval cadence (``dp``)."""
        return self.run.topology.h_g

    @property
    def tau(self) -> int:
        """Overlap: a merge for sync step s is applied at s + tau (0 <= tau < h_r)."""
        return self.run.topology.tau

    @property
    def inner(self) -> InnerConfig:
        return self.run.inner

    @property
    def outer(self) -> OuterConfig:
        return self.run.outer

    @property
    def regional_codec(self) -> str:
        """Island -> relay codec (error feedback at the island)."""
        return self.run.regional_codec

    @property
    def global_codec(self) -> str:
        """Relay -> aggregator codec (error feedback at the relay)."""
        return self.run.global_codec

    @property
    def ef_beta(self) -> float:
        return self.run.ef_beta

    @property
    def holdout(self) -> int:
        """Held-out windows evaluated: the first n of the registered 512."""
        return self.run.holdout_windows

    @property
    def data(self) -> str | None:
        """Prepared dataset folder; None = the built-in corpus."""
        return self.run.data

    # -- derived ---------------------------------------------------------------------
    @property
    def n_replicas(self) -> int:
        """N = R * n_r (1 for the data-parallel control)."""
        return self.run.topology.n_islands

    def model_config(self) -> ModelConfig:
        return self.run.model_config()

    def core_config(self) -> RunConfig:
        """The ``RunConfig`` the role cores (RegionCore, GlobalCore) are built from: ``run``.

        Region names are zero-padded so that their sorted order (the aggregation order)
        is the replica index order."""
        return self.run

    def resolved_device(self) -> str:
        """``device``, else $HYPERTRAIN_SIM_DEVICE, else ``cpu``."""
        return self.device or os.environ.get(DEVICE_ENV, "").strip() or "cpu"

    def replace(self, **changes: Any) -> SimJob:
        """A copy with fields replaced: the dataclass fields (``run``, ``path``, ...) or
        the flat vocabulary (``steps``, ``h_g``, ``seed``, ...), not both."""
        if changes.keys() <= _FIELDS:
            return dataclasses.replace(self, **changes)
        return SimJob.build(**{**self.flat(), **changes})

    # -- serialization ---------------------------------------------------------------
    def flat(self) -> dict[str, Any]:
        """The job in the flat vocabulary of ``build`` (configs as objects)."""
        d = {name: getattr(self, name) for name in (*FLAT_FIELDS, *SIM_EXTRAS)}
        d.update({name: getattr(self.run, name) for name in RUN_EXTRAS})
        d.update({name: getattr(self.run.topology, name) for name in TOPOLOGY_EXTRAS})
        return d

    def to_dict(self) -> dict[str, Any]:
        """The flat vocabulary as JSON; run fields it does not map only where not default."""
        d = {name: getattr(self, name) for name in FLAT_FIELDS if name not in EXECUTION_FIELDS}
        d["inner"] = dataclasses.asdict(self.inner)
        d["outer"] = self.outer.to_dict()
        if isinstance(self.model, ModelConfig):
            d["model"] = dataclasses.asdict(self.model)
        run = self.run.to_dict()
        for name in RUN_EXTRAS:
            if run[name] != _DEFAULT_RUN[name]:
                d[name] = run[name]
        for name in TOPOLOGY_EXTRAS:
            if run["topology"][name] != _DEFAULT_RUN["topology"][name]:
                d[name] = run["topology"][name]
        for name in SIM_EXTRAS:
            if getattr(self, name) != _SIM_DEFAULTS[name]:
                d[name] = getattr(self, name)
        d.update({name: getattr(self, name) for name in EXECUTION_FIELDS})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SimJob:
        try:
            return cls.build(**d)
        except TypeError as e:
            raise ConfigError(f"sim job: {e}") from None

    def design_dict(self) -> dict[str, Any]:
        """Every field that changes the numbers (the execution fields removed)."""
        d = self.to_dict()
        for name in EXECUTION_FIELDS:
            d.pop(name)
        return d

    def key(self) -> str:
        """A stable id of the design: sha256 of its canonical JSON, 16 hex digits."""
        canon = json.dumps(self.design_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


_FIELDS = frozenset(f.name for f in dataclasses.fields(SimJob))
_OWN_FIELDS = tuple(sorted(_FIELDS - {"run", "dp_steps"}))
"""The simulator's own fields (the flat vocabulary names them as they are)."""


def flat_job(m: int, h: int, **kw: Any) -> SimJob:
    """Flat DiLoCo with ``m`` replicas syncing every ``h`` steps (R = m, n_r = 1)."""
    return SimJob.build(regions=m, islands_per_region=1, h_r=h, h_g=h, **kw)


def dp_job(**kw: Any) -> SimJob:
    """The data-parallel control (one replica, global batch B, no outer loop)."""
    kw.setdefault("h_g", kw.pop("h", 30))
    kw.setdefault("h_r", kw["h_g"])
    return SimJob.build(dp=True, **kw)


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(slots=True)
class JobResult:
    """What one job reports.  Divergence is a result, not an exception."""

    key: str
    """``SimJob.key()`` of the job."""
    final_loss: float
    """Held-out cross-entropy at the end: of the LAWA average when lawa_k > 0, else of the
    final global parameters.  NaN when the run diverged."""
    final_loss_raw: float
    """Held-out loss of the final global parameters (no LAWA)."""
    initial_loss: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, held-out loss of the global parameters) at the eval points."""
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    """(last step, mean training loss over replicas and the steps since the previous point)."""
    diverged: bool = False
    diverged_at: int | None = None
    reason: str = ""
    steps_done: int = 0
    anneal_start: int | None = None
    """m1 anneal: the step after which replicas were merged every step."""
    n_params: int = 0
    seconds: float = 0.0
    """Wall time of the whole job (set-up, training, syncs, evaluation)."""
    seconds_train: float = 0.0
    """Forward, backward and inner-optimizer steps."""
    seconds_sync: float = 0.0
    """Codecs, aggregation, outer steps and merges."""
    seconds_eval: float = 0.0
    steps_per_s: float = 0.0
    """Inner steps per second of training and syncs (evaluation excluded)."""
    path: str = ""
    device: str = ""
    absent: list[tuple[int, tuple[int, ...], int]] = field(default_factory=list)
    """Churn (``drop`` > 0): for every sync step the draw applies to, (step, the replicas
    absent from it, how many late islands the step waited for to reach its quorum); empty
    without churn (engine/churn.py)."""
    resumed_from: list[int] = field(default_factory=list)
    """The steps the run was resumed after, from its checkpoint (run_job); empty for a run
    that never stopped.  Its result is the same either way."""
    final_params: torch.Tensor | None = None
    """The final global parameters (flat, CPU); not serialized by ``to_dict``."""
    lawa_params: torch.Tensor | None = None
    """The LAWA average (lawa_k > 0; flat, CPU); not serialized by ``to_dict``."""

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("final_params")
        d.pop("lawa_params")
        for name in ("final_loss", "final_loss_raw", "initial_loss"):
            d[name] = _finite_or_none(d[name])
        d["curve"] = [[s, _finite_or_none(v)] for s, v in self.curve]  # JSON pairs
        d["train_curve"] = [[s, _finite_or_none(v)] for s, v in self.train_curve]
        d["absent"] = [[s, list(gone), waited] for s, gone, waited in self.absent]
        return d
