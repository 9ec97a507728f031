"""What the simulator runs and what it reports: ``SimJob`` and ``JobResult``.

One ``SimJob`` is one cell x seed x outer learning rate at one scale: the
model, the steps, the global batch B, the topology (flat M = R regions of one
island, a hierarchy R x n_r, or the data-parallel control), the inner and outer
optimizers, the two codecs, streaming fragments and overlap, the anneal, LAWA,
and the evaluation.  ``run_job`` (run.py) turns it into a ``JobResult``.

Invariants:
- Every field is validated in ``__post_init__`` (``ConfigError`` naming it),
  including what the role cores would refuse (a sparseloco outer optimizer
  without a sparseloco global codec): a job that constructs is a job that runs.
- ``design_dict()`` holds every field that changes the numbers; the execution
  fields ``path``, ``device`` and ``threads`` are outside it (and outside
  ``key()``), because the per-replica and batched paths and CPU vs CUDA compute
  the same function (tests/unit/test_sim_engine.py; ``device_equivalence_check``).
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

from hypertrain.common.config import RunConfig, TopologyConfig
from hypertrain.common.errors import ConfigError
from hypertrain.common.model import ModelConfig, preset
from hypertrain.common.optim import InnerConfig
from hypertrain.common.outer import OuterConfig

ExecPath = Literal["batched", "per_replica"]
Anneal = Literal["full_m", "m1"]
DEVICE_ENV = "HYPERTRAIN_SIM_DEVICE"
EXECUTION_FIELDS = ("path", "device", "threads")
"""Fields outside the design: they choose how a job runs, not what it computes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimJob:
    """One simulated training run (see the module docstring)."""

    model: str | ModelConfig = "proxy"
    """A preset name (common/model.py) or the ModelConfig of a reduced registered scale."""
    steps: int = 3000
    """Inner steps per replica; a multiple of h_g (unless ``dp``)."""
    global_batch: int = 32
    """B: sequences per step over all replicas (the DP control's batch)."""
    seed: int = 0
    """Fixes the initialization and the sample stream (all arms of a seed see the same data)."""
    dp: bool = False
    """The data-parallel control: one replica on the whole global batch, no outer loop."""
    regions: int = 1
    """R.  Flat DiLoCo with M replicas is R = M, islands_per_region = 1, h_r = h_g."""
    islands_per_region: int = 1
    """n_r: islands per region (N = R * n_r replicas)."""
    h_r: int = 30
    """Regional sync interval in inner steps (plain averaging, eta_r = 1)."""
    h_g: int = 30
    """Global sync interval; a multiple of h_r.  Also the LAWA and eval cadence for ``dp``."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    regional_codec: str = "fp32"
    """Island -> relay codec (error feedback at the island)."""
    global_codec: str = "fp32"
    """Relay -> aggregator codec (error feedback at the relay)."""
    ef_beta: float = 1.0
    fragments: int = 1
    """Streaming DiLoCo: F parameter fragments synced on staggered steps (1 = off)."""
    tau: int = 0
    """Overlap: a merge for sync step s is applied at s + tau (0 <= tau < h_r)."""
    anneal: Anneal = "full_m"
    """full_m: the WSD decay runs on the full hierarchy.  m1: from the last global sync at
    or before the decay start, all replicas are merged (fixed-order fp32 mean) after every
    step, i.e. M_eff = 1 (S3); needs fragments = 1 and tau = 0."""
    lawa_k: int = 0
    """Final held-out loss of the mean of the last k checkpoints (0 = off)."""
    lawa_every: int = 0
    """Checkpoint cadence in steps (0 = h_g, one per global round)."""
    eval_points: int = 8
    """Held-out evaluations along the run (the last one is at ``steps``)."""
    holdout: int = 512
    """Held-out windows evaluated: the first n of the registered 512."""
    holdout_seed: int = 0
    """Seed choosing the 512 holdout windows (fixed across seeds, so arms share them)."""
    diverge_ratio: float = 1.0
    """Divergent (and stopped) when a held-out loss at any eval point exceeds this multiple of
    the initial one; any non-finite loss or parameter is divergent too (design.Divergence)."""
    data: str | None = None
    """Prepared dataset folder; None = the built-in corpus."""
    path: ExecPath = "batched"
    """Execution only: ``batched`` (one stacked model) or ``per_replica`` (M models)."""
    device: str | None = None
    """Execution only: cpu | cuda | cuda:N; None = $HYPERTRAIN_SIM_DEVICE, else cpu."""
    threads: int | None = None
    """Execution only: torch intra-op threads (None = leave the process setting)."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"sim job: {msg}")

        self.model_config()  # a known preset or a validated ModelConfig
        for name in ("steps", "global_batch", "regions", "islands_per_region", "h_r", "h_g"):
            if getattr(self, name) < 1:
                raise bad(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fragments < 1 or self.eval_points < 1 or self.lawa_k < 0 or self.lawa_every < 0:
            raise bad("need fragments >= 1, eval_points >= 1, lawa_k >= 0, lawa_every >= 0")
        if not 1 <= self.holdout <= 512:
            raise bad(f"holdout must be in [1, 512], got {self.holdout}")
        if self.seed < 0 or self.holdout_seed < 0 or not self.diverge_ratio > 0:
            raise bad("seeds must be >= 0 and diverge_ratio > 0")
        if self.global_batch % self.n_replicas:
            raise bad(f"{self.n_replicas} replicas do not divide global_batch {self.global_batch}")
        if self.path not in ("batched", "per_replica"):
            raise bad(f"path must be batched|per_replica, got {self.path!r}")
        if self.anneal not in ("full_m", "m1"):
            raise bad(f"anneal must be full_m|m1, got {self.anneal!r}")
        if self.threads is not None and self.threads < 1:
            raise bad("threads must be >= 1")
        if self.dp:
            if (self.regions, self.islands_per_region, self.fragments, self.tau) != (1, 1, 1, 0):
                raise bad("the data-parallel control has one replica, no fragments and tau 0")
            if self.anneal != "full_m" or self.h_r != self.h_g:
                raise bad("the data-parallel control has no anneal variant and h_r == h_g")
        if not self.dp and self.steps % self.h_g:
            raise bad(f"steps ({self.steps}) must be a multiple of h_g ({self.h_g})")
        if self.fragments > self.h_g:
            raise bad(f"fragments ({self.fragments}) must be <= h_g ({self.h_g}) to stagger")
        if self.anneal == "m1" and (self.fragments != 1 or self.tau):
            raise bad("anneal m1 needs fragments = 1 and tau = 0 (all replicas equal at its start)")
        if self.fragments > 1 and self.steps < self.h_g:
            raise bad("streaming needs at least one full global round")
        self.core_config()  # topology, codecs, outer: validated by the core's own RunConfig

    # -- derived ---------------------------------------------------------------------
    @property
    def n_replicas(self) -> int:
        """N = R * n_r (1 for the data-parallel control)."""
        return self.regions * self.islands_per_region

    def model_config(self) -> ModelConfig:
        return preset(self.model) if isinstance(self.model, str) else self.model

    def core_config(self) -> RunConfig:
        """The ``RunConfig`` the role cores (RegionCore, GlobalCore) are built from.

        The cores read only the codecs, ``ef_beta``, the topology and the outer
        optimizer; ``model`` is the job's preset (or ``tiny`` for a ModelConfig,
        which the cores never read).  Region names are zero-padded so that their
        sorted order (the aggregation order) is the replica index order."""
        width = len(str(self.regions - 1))
        try:
            return RunConfig(
                model=self.model if isinstance(self.model, str) else "tiny",
                seed=self.seed,
                steps=self.h_g * max(1, self.steps // self.h_g),
                batch_per_island=self.global_batch // self.n_replicas,
                topology=TopologyConfig(
                    regions=tuple(f"r{k:0{width}d}" for k in range(self.regions)),
                    islands_per_region=self.islands_per_region,
                    h_r=self.h_r,
                    h_g=self.h_g,
                    tau=self.tau,
                ),
                inner=self.inner,
                outer=self.outer,
                regional_codec=self.regional_codec,
                global_codec=self.global_codec,
                ef_beta=self.ef_beta,
            )
        except ConfigError as e:
            raise ConfigError(f"sim job: {e}") from None

    def resolved_device(self) -> str:
        """``device``, else $HYPERTRAIN_SIM_DEVICE, else ``cpu``."""
        return self.device or os.environ.get(DEVICE_ENV, "").strip() or "cpu"

    def replace(self, **changes: Any) -> SimJob:
        return dataclasses.replace(self, **changes)

    # -- serialization ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["inner"] = dataclasses.asdict(self.inner)
        d["outer"] = self.outer.to_dict()
        if isinstance(self.model, ModelConfig):
            d["model"] = dataclasses.asdict(self.model)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SimJob:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"sim job: unknown field(s) {', '.join(unknown)}")
        try:
            if isinstance(d.get("model"), dict):
                d["model"] = ModelConfig(**d["model"])
            if isinstance(d.get("inner"), dict):
                d["inner"] = InnerConfig(**d["inner"])
            if isinstance(d.get("outer"), dict):
                d["outer"] = OuterConfig(**d["outer"])
            return cls(**d)
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


def flat_job(m: int, h: int, **kw: Any) -> SimJob:
    """Flat DiLoCo with ``m`` replicas syncing every ``h`` steps (R = m, n_r = 1)."""
    return SimJob(regions=m, islands_per_region=1, h_r=h, h_g=h, **kw)


def dp_job(**kw: Any) -> SimJob:
    """The data-parallel control (one replica, global batch B, no outer loop)."""
    kw.setdefault("h_g", kw.pop("h", 30))
    kw.setdefault("h_r", kw["h_g"])
    return SimJob(dp=True, **kw)


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
    final_params: torch.Tensor | None = None
    """The final global parameters (flat, CPU); not serialized by ``to_dict``."""

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("final_params")
        for name in ("final_loss", "final_loss_raw", "initial_loss"):
            d[name] = _finite_or_none(d[name])
        d["curve"] = [[s, _finite_or_none(v)] for s, v in self.curve]  # JSON pairs
        d["train_curve"] = [[s, _finite_or_none(v)] for s, v in self.train_curve]
        return d
