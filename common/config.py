"""The run configuration, shared by daemons, in-process runs and the simulator.

One frozen dataclass tree; loaded from TOML (``RunConfig.from_toml``) or a
dict, overridden field by field (``with_overrides``), and serialized
canonically (``to_dict``) for the tape and for run ids.

Invariants: every field is validated in ``__post_init__`` and a bad value
raises ConfigError naming the field; nothing here reads the environment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypertrain.common.codec import parse_codec_spec
from hypertrain.common.data.sampling import HOLDOUT_WINDOWS
from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.fragments import cut_problem, fragment_offset
from hypertrain.common.model import ModelConfig, preset
from hypertrain.common.optim import InnerConfig
from hypertrain.common.outer import OuterConfig
from hypertrain.common.schedule import anneal_start, anneal_starts
from hypertrain.common.shards import Shards, shard_unit

ANNEAL_MODES = ("full_m", "h_r1", "islands:K")
"""``RunConfig.anneal``'s values: the decay on the full hierarchy (the control), at
H_r = 1, or on the run's first K islands (``islands:1``, ``islands:2``, ...)."""


def anneal_islands(mode: str) -> int | None:
    """K of an ``islands:K`` anneal mode (None for another mode; ConfigError if malformed)."""
    if not mode.startswith("islands:"):
        return None
    try:
        k = int(mode.removeprefix("islands:"))
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError(f"run: anneal {mode!r}: K in islands:K must be an integer >= 1")
    return k


@dataclass(frozen=True, kw_only=True, slots=True)
class TopologyConfig:
    """Islands, regions and the two sync intervals (docs/design.md §2)."""

    regions: tuple[str, ...] = ("eu", "us")
    """Region names; aggregation order is their sorted order."""
    islands_per_region: int = 2
    """n_r: islands in each region (N = len(regions) * n_r)."""
    h_r: int = 10
    """Regional sync interval in inner steps."""
    h_g: int = 20
    """Global sync interval in inner steps; a multiple of h_r (K = h_g / h_r)."""
    tau: int = 0
    """Merge delay: a merge for sync step s is applied at s + tau (0 <= tau < h_r)."""
    relay_shards: int = 1
    """S: relay processes per region, each owning a contiguous range of the parameters
    (``hypertrain-relay --shard i/S``; the rule is in common/shards.py).  The result is
    bit-identical for every S; omitted from the canonical config when 1."""

    def __post_init__(self) -> None:
        if not self.regions or len(set(self.regions)) != len(self.regions):
            raise ConfigError(f"topology: regions must be distinct and non-empty: {self.regions}")
        for r in self.regions:
            if not r or not all(c.isalnum() or c in "_." for c in r):
                raise ConfigError(f"topology: region name {r!r} must be alphanumeric")
        if self.islands_per_region < 1:
            raise ConfigError("topology: islands_per_region must be >= 1")
        if self.h_r < 1 or self.h_g < 1 or self.h_g % self.h_r:
            raise ConfigError(f"topology: h_g ({self.h_g}) must be a multiple of h_r ({self.h_r})")
        if not 0 <= self.tau < self.h_r:
            raise ConfigError(f"topology: tau must satisfy 0 <= tau < h_r, got {self.tau}")
        if not isinstance(self.relay_shards, int) or self.relay_shards < 1:
            raise ConfigError(f"topology: relay_shards must be >= 1, got {self.relay_shards!r}")

    @property
    def n_islands(self) -> int:
        return len(self.regions) * self.islands_per_region

    def islands_of(self, region: str) -> tuple[str, ...]:
        return tuple(f"{region}-{k}" for k in range(self.islands_per_region))

    def island_ids(self) -> tuple[str, ...]:
        """All island ids, grouped by sorted region; the index is the data slice."""
        return tuple(i for r in sorted(self.regions) for i in self.islands_of(r))

    def region_of(self, island: str) -> str:
        region, _, _ = island.rpartition("-")
        if region not in self.regions or island not in self.islands_of(region):
            raise ConfigError(f"topology: {island!r} is not an island of this run")
        return region


KNOWN_TABLES = ("aggregator", "island", "relay", "run")
"""The top-level tables a config file may hold: ``[run]`` (``RunConfig``) and one table
of settings per daemon kind (common/settings.py).  Every reader of a config file refuses
anything else, so a mistyped table (``[rnu]``) is an error, not silently ignored."""


CUSTOM_MODEL = "custom"
"""``RunConfig.model`` of a run whose ``model_shape`` is given (no preset has this name)."""
TOY_MODEL = "toy"
"""``RunConfig.model`` of the fault simulation's toy: a small vector, no decoder
(common/toy.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MembershipConfig:
    """When a sync step may commit without every member (docs/design.md §4.10).

    A level (a region's relay, or the aggregator) commits a sync step when every current
    member has delivered; or, once the cutoff of that step was reached, with the members
    that delivered, if they meet the level's quorum.  The cutoff is an event: the daemons
    raise it ``*_cutoff_s`` seconds after the step's first delivery, the fault simulation
    schedules it, and it is taped, so a replay needs no clock.  Omitted from the canonical
    config while every field has its default (no cutoff: every member is waited for)."""

    regional_cutoff_s: float = 0.0
    """Seconds from a regional sync step's first delivery to its cutoff; 0: no cutoff."""
    global_cutoff_s: float = 0.0
    """Seconds from a global sync step's first delivery to its cutoff; 0: no cutoff."""
    regional_quorum: int | float = 0.5
    """Islands of a region needed to commit at a cutoff: an int is a count, a float in
    (0, 1] a fraction of the region's members (rounded up, at least 1)."""
    global_quorum: int | float = 0.5
    """Regions needed to commit a global round at a cutoff (count or fraction, as above);
    a region with relay shards counts only when every one of its shards delivered."""
    standby: tuple[str, ...] = ()
    """Islands of the topology that are not members when the run starts: each may join
    it later (its relay tapes the join; it starts from the merge the relay names).  Any
    island may also leave (SIGTERM) and join again.  Omitted from the canonical config
    while empty."""

    def __post_init__(self) -> None:
        standby = self.standby
        if not isinstance(standby, tuple) or not all(isinstance(i, str) for i in standby):
            raise ConfigError(f"membership: standby must be a list of island ids, got {standby!r}")
        if len(set(standby)) != len(standby):
            raise ConfigError(f"membership: standby names an island twice: {list(standby)}")
        for name in ("regional_cutoff_s", "global_cutoff_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (0 <= value < float("inf"))
            ):
                raise ConfigError(f"membership: {name} must be a number of seconds >= 0")
        for name in ("regional_quorum", "global_quorum"):
            q = getattr(self, name)
            if isinstance(q, bool) or not isinstance(q, int | float):
                raise ConfigError(f"membership: {name} must be a count or a fraction, got {q!r}")
            if isinstance(q, int) and q < 1:
                raise ConfigError(f"membership: {name} as a count must be >= 1, got {q}")
            if isinstance(q, float) and not 0 < q <= 1:
                raise ConfigError(f"membership: {name} as a fraction must be in (0, 1], got {q}")

    def initial(self, islands: tuple[str, ...]) -> tuple[str, ...]:
        """The members of a region whose islands are ``islands`` when the run starts."""
        return tuple(i for i in islands if i not in self.standby)

    @property
    def has_cutoffs(self) -> bool:
        """Can a step of either level go ahead without some member (and leave it behind)?"""
        return bool(self.regional_cutoff_s or self.global_cutoff_s)

    def cutoff_s(self, level: str) -> float:
        """The cutoff of a ``"regional"`` or ``"global"`` sync step, in seconds (0: none)."""
        return self.regional_cutoff_s if level == "regional" else self.global_cutoff_s

    def quorum(self, level: str, units: int) -> int:
        """Units (islands of a region, or regions) a ``level`` needs to commit at a cutoff,
        out of ``units``: never more than ``units``, never less than 1."""
        q = self.regional_quorum if level == "regional" else self.global_quorum
        need = q if isinstance(q, int) else math.ceil(q * units - 1e-9)
        return max(1, min(units, need))


ROBUST_RULES = ("mean", "clip", "trimmed_mean")


@dataclass(frozen=True, kw_only=True, slots=True)
class RobustConfig:
    """Defences of a region's mean against islands that send well-formed but hostile
    deltas (docs/design.md): bounds on a delta's L2 norm, and the rule that combines a
    step's deltas.  Regional only: the aggregator's inputs are the relays' forwards.
    Omitted from the canonical config while every field has its default (the plain mean,
    no bound)."""

    rule: str = "mean"
    """How a regional sync step's deltas are combined: ``mean`` (fixed-order fp32 mean);
    ``clip`` (each delta scaled down to at most ``clip`` times the median of the step's
    deltas' norms, then the mean); ``trimmed_mean`` (per coordinate, the ``trim``
    largest and ``trim`` smallest values are left out; fewer when the step has too few
    deltas to leave one)."""
    clip: float = 2.0
    """``clip``: the largest norm a delta keeps, as a multiple of the step's median."""
    trim: int = 1
    """``trimmed_mean``: values left out at each end, per coordinate."""
    max_norm: float = 0.0
    """An island's delta whose L2 norm is above this is refused when it arrives (taped
    with its norm); 0: no bound."""
    norm_median: float = 0.0
    """At a regional commit with at least 3 deltas, a delta whose norm is above this
    multiple of the median norm is left out of the mean (the merge entry names it with
    its norm); 0: never."""

    def __post_init__(self) -> None:
        if self.rule not in ROBUST_RULES:
            raise ConfigError(
                f"robust: rule must be one of {', '.join(ROBUST_RULES)}, got {self.rule!r}"
            )
        for name in ("clip", "max_norm", "norm_median"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < float("inf"):
                raise ConfigError(f"robust: {name} must be a finite number >= 0, got {v!r}")
        if self.rule == "clip" and not self.clip >= 1:
            raise ConfigError(
                f"robust: clip must be >= 1 (a multiple of the median), got {self.clip}"
            )
        if self.norm_median and self.norm_median < 1:
            raise ConfigError(
                f"robust: norm_median must be 0 (off) or >= 1, got {self.norm_median}"
            )
        if isinstance(self.trim, bool) or not isinstance(self.trim, int) or self.trim < 1:
            raise ConfigError(f"robust: trim must be an integer >= 1, got {self.trim!r}")

    @property
    def plain(self) -> bool:
        """The plain mean of every delta: nothing to measure at a commit."""
        return self.rule == "mean" and not self.norm_median


#: Held-out tokens a run evaluates by default when a preset is chosen on the command line
#: (``preset_holdout_windows``): 512 windows of the tiny preset's 64 tokens is 32,768 tokens;
#: twice that keeps every tiny run's 512.  With 512 windows at gpt-125m (1024 tokens
#: each, 2 cores, one thread) the aggregator's evaluation of round 0 ended 14 minutes after
#: the islands finished training, and ``hypertrain up``, which waits for the final one, was
#: still waiting 15 minutes after training.
HOLDOUT_TOKENS = 65536


def preset_holdout_windows(name: str) -> int:
    """The held-out windows a run of preset ``name`` evaluates unless told otherwise: as
    many as make ``HOLDOUT_TOKENS`` tokens, at most the registered 512 (tiny 512, proxy 256,
    small 128, gpt-125m 64).  Always the first windows of the same registered set."""
    return max(1, min(HOLDOUT_WINDOWS, HOLDOUT_TOKENS // preset(name).seq_len))


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything that changes the numbers of a run."""

    run_id: str = "local"
    """Name of the run; every message and tape entry carries it."""
    model: str = "tiny"
    """Model preset (common/model.py PRESETS), or ``"custom"`` with ``model_shape``."""
    model_shape: ModelConfig | None = None
    """The decoder's shape when it is no preset (the simulator's reduced scales); then
    ``model`` is ``"custom"``, which no preset lookup accepts.  None for a preset run: then
    absent from ``to_dict``, so such a run's dict, digest and TOML do not mention it."""
    seed: int = 0
    """Fixes the initialization and the sample stream."""
    steps: int = 200
    """Inner steps per island; a multiple of topology.h_g."""
    batch_per_island: int = 32
    """b: sequences per island per step (global batch = N * b)."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    regional_codec: str = "int8"
    """Codec of island -> relay deltas (with error feedback at the islands)."""
    global_codec: str = "fp32"
    """Codec of relay -> aggregator deltas (with error feedback at the relays)."""
    ef_beta: float = 1.0
    """Error-feedback decay at the senders (1.0 keeps the whole residual)."""
    data: str | None = None
    """Prepared dataset directory; None = the built-in corpus."""
    holdout_windows: int = HOLDOUT_WINDOWS
    """Held-out windows evaluated (the first n of the registered 512; docs/design.md §7).
    The command line's ``--preset`` sets it by the preset's window length
    (``preset_holdout_windows``) unless ``--holdout-windows`` or the config file does."""
    anneal: str = "full_m"
    """The decay phase (docs/design.md §3.6): ``full_m``, the control, trains it on the
    full hierarchy as the stable phase; ``h_r1`` (the anneal at M = 1 within each region)
    syncs every island with its region after every step from the last global sync step at
    or before the inner schedule's decay starts (common/schedule.py ``anneal_start``),
    global syncs unchanged; ``islands:K`` trains the decay on the run's first K islands
    (``anneal_kept``): the others push their delta of that step, take its global merge and
    stop, and the regions left without an island follow the global rounds.  The switch is
    taped by the relays and the aggregator.  With streaming fragments each fragment
    switches after its own last global sync step at or before the decay's start
    (``anneal_step_of``); an island the anneal stops leaves each fragment there.  ``h_r1``
    needs tau = 0; ``islands:K`` works with overlap."""
    lawa: int = 0
    """LAWA: the run's final model is also published as the fixed-order fp32 mean of the
    aggregator's states after its last ``lawa`` global rounds (common/optim.py
    ``LawaSum``; 0: off); with streaming fragments, each fragment's mean over its own last
    ``lawa`` global rounds, joined.  Choose it so those rounds fall in the schedule's
    decay."""
    fragments: int = 1
    """Streaming DiLoCo (docs/design.md §3.8): the parameters are cut into this many
    fragments (common/fragments.py ``partition``), fragment f syncs on the schedule
    staggered by ``f * h_g // fragments`` steps, with its own rounds, error feedback and
    outer state at every node; 1: the whole model syncs at once."""
    fragment_cut: str = "values"
    """How the fragments are cut (common/fragments.py ``CUTS``): ``values``, F equal
    ranges of the flat vector (cut inside a parameter where a boundary falls: the peak
    bytes of a sync fall by F), or ``params``, at whole parameters (the simulator's
    registered cells); absent from ``to_dict`` while ``values``."""
    threads: int = 1
    """Intra-op threads per island.  CPU GEMM results depend on the thread
    count, so it is part of the config: equal threads give equal bits."""
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    """Cutoffs and quorums (absent from ``to_dict`` while all default)."""
    robust: RobustConfig = field(default_factory=RobustConfig)
    """Norm bounds and the regional combination rule (absent from ``to_dict`` while all
    default)."""

    def __post_init__(self) -> None:
        if self.model_shape is None:
            if self.model == CUSTOM_MODEL:
                raise ConfigError(f"run: model {CUSTOM_MODEL!r} needs a model_shape")
            if self.model != TOY_MODEL:
                preset(self.model)
        elif not isinstance(self.model_shape, ModelConfig) or self.model != CUSTOM_MODEL:
            raise ConfigError(
                f"run: a model_shape (ModelConfig) goes with model {CUSTOM_MODEL!r}, "
                f"got model {self.model!r} and model_shape {self.model_shape!r}"
            )
        for name in ("run_id",):
            value = getattr(self, name)
            if not value or not all(c.isalnum() or c in "-_." for c in value):
                raise ConfigError(f"run: {name} {value!r} must be non-empty [A-Za-z0-9._-]")
        if self.steps < 1 or self.steps % self.topology.h_g:
            raise ConfigError(
                f"run: steps ({self.steps}) must be a positive multiple of h_g ({self.topology.h_g})"
            )
        if self.batch_per_island < 1 or self.threads < 1:
            raise ConfigError("run: batch_per_island and threads must be >= 1")
        if not 1 <= self.holdout_windows <= HOLDOUT_WINDOWS:
            raise ConfigError(
                f"run: holdout_windows must be in [1, {HOLDOUT_WINDOWS}], got {self.holdout_windows}"
            )
        rounds = self.steps // self.topology.h_g
        k = anneal_islands(self.anneal)
        if self.anneal not in ANNEAL_MODES and k is None:
            raise ConfigError(
                f"run: anneal must be one of {', '.join(ANNEAL_MODES)}, got {self.anneal!r}"
            )
        if k is not None and not k < self.topology.n_islands:
            raise ConfigError(
                f"run: anneal {self.anneal}: K must be below the run's "
                f"{self.topology.n_islands} islands"
            )
        if k is not None and (self.membership.standby or self.topology.relay_shards > 1):
            raise ConfigError(
                f"run: anneal {self.anneal} does not work with standby islands or relay shards yet"
            )
        if self.anneal != "full_m":
            if self.topology.tau and self.anneal == "h_r1":
                raise ConfigError(
                    f"run: anneal {self.anneal} needs tau = 0 (every step syncs in the anneal, "
                    f"and a merge must apply before the next sync), got tau {self.topology.tau}"
                )
            if anneal_start(self.steps, self.topology.h_g, self.inner.decay_fraction) is None:
                raise ConfigError(
                    f"run: anneal {self.anneal}: no global sync step before the last one is at "
                    f"or before the decay's start (steps {self.steps}, h_g {self.topology.h_g}, "
                    f"inner decay_fraction {self.inner.decay_fraction}): nothing to anneal"
                )
        if k is not None and 0 in self.anneal_starts:
            raise ConfigError(
                f"run: anneal {self.anneal}: the decay starts before the first global sync "
                f"step (steps {self.steps}, h_g {self.topology.h_g}, inner decay_fraction "
                f"{self.inner.decay_fraction}): the islands it stops would train no step"
            )
        if not 0 <= self.lawa <= rounds:
            raise ConfigError(
                f"run: lawa must be in [0, {rounds}] (the run's global rounds), got {self.lawa}"
            )
        if not 1 <= self.fragments <= self.topology.h_g:
            raise ConfigError(
                f"run: fragments must be in [1, h_g = {self.topology.h_g}] (their syncs are "
                f"staggered over a global interval), got {self.fragments}"
            )
        if (problem := cut_problem(self.fragment_cut)) is not None:
            raise ConfigError(f"run: fragment_cut {problem}")
        if self.fragments > 1:
            unsupported = [
                name
                for name, on in (
                    ("standby islands", bool(self.membership.standby)),
                    ("membership cutoffs", self.membership.has_cutoffs),
                    ("relay shards", self.topology.relay_shards > 1),
                    ("a robust rule or norm bound", not self.robust.plain),
                )
                if on
            ]
            if unsupported:
                raise ConfigError(
                    f"run: fragments > 1 does not work with {', '.join(unsupported)} yet"
                )
            if self.anneal != "full_m":
                for f, start in enumerate(self.anneal_starts):
                    if start is None:
                        raise ConfigError(
                            f"run: anneal {self.anneal}: fragment {f} has no global sync step "
                            f"at or before the decay's start (its first is step "
                            f"{fragment_offset(f, self.fragments, self.topology.h_g)}; steps "
                            f"{self.steps}, h_g {self.topology.h_g}, inner decay_fraction "
                            f"{self.inner.decay_fraction}): it would have nothing to switch after"
                        )
        if not 0 < self.ef_beta <= 1:
            raise ConfigError(f"run: ef_beta must be in (0, 1], got {self.ef_beta}")
        for name in ("regional_codec", "global_codec"):
            try:
                parse_codec_spec(getattr(self, name))
            except HypertrainError as e:
                raise ConfigError(f"run: {name}: {e}") from None
        for island in self.membership.standby:
            try:
                self.topology.region_of(island)
            except ConfigError:
                raise ConfigError(
                    f"membership: standby island {island!r} is not an island of this run "
                    f"(islands: {', '.join(self.topology.island_ids())})"
                ) from None
        if self.membership.standby and self.topology.relay_shards > 1:
            raise ConfigError(
                "run: standby islands (joins at run time) do not work with relay_shards > 1 "
                "yet; use one relay per region"
            )
        if self.membership.has_cutoffs and self.topology.relay_shards > 1:
            # A region's shards can be left behind unevenly (one shard's forward used, its
            # other's refused as stale) and then wait on each other: not supported yet.
            raise ConfigError(
                "run: membership cutoffs do not work with relay_shards > 1 yet; "
                "use one relay per region, or no cutoff"
            )
        if not self.robust.plain and self.topology.relay_shards > 1:
            raise ConfigError(
                "run: a robust rule or norm_median works on whole deltas: not with "
                "relay_shards > 1 yet"
            )
        if self.outer.name == "sparseloco" and not self.global_codec.startswith("sparseloco"):
            raise ConfigError(
                "run: the sparseloco outer optimizer needs a sparseloco global_codec "
                "(its top-k with error feedback runs at the senders)"
            )

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"run: unknown config key(s): {', '.join(unknown)}")
        try:
            if "topology" in d:
                topo = dict(d["topology"])
                if "regions" in topo:
                    topo["regions"] = tuple(topo["regions"])
                d["topology"] = TopologyConfig(**topo)
            if "inner" in d:
                d["inner"] = InnerConfig(**d["inner"])
            if "outer" in d:
                d["outer"] = OuterConfig(**d["outer"])
            if "membership" in d:
                mem = dict(d["membership"])
                if "standby" in mem:
                    mem["standby"] = tuple(mem["standby"])
                d["membership"] = MembershipConfig(**mem)
            if "robust" in d:
                d["robust"] = RobustConfig(**d["robust"])
            if isinstance(d.get("model_shape"), dict):
                d["model_shape"] = ModelConfig(**d["model_shape"])
            return cls(**d)
        except TypeError as e:  # unknown nested key, wrong arity
            raise ConfigError(f"run: {e}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        """The ``[run]`` table of the config file at ``path`` (absent: the defaults).

        ConfigError if the file cannot be read, is not TOML, or holds anything at the top
        level but the tables of ``KNOWN_TABLES`` (the daemons' tables are read by
        common/settings.py, with the same rule)."""
        doc = load_tables(path)
        return cls.from_dict(doc.get("run", {}))

    def with_overrides(self, **changes: Any) -> RunConfig:
        """A copy with top-level fields, or dotted nested ones (``"topology.h_r"``), replaced."""
        d = self.to_dict()
        for key, value in changes.items():
            *parents, leaf = key.split(".")
            node = d
            for p in parents:
                node = node.setdefault(p, {})  # a section to_dict leaves out when default
            node[leaf] = value
        return RunConfig.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["topology"]["regions"] = list(self.topology.regions)
        if self.model_shape is None:
            del d["model_shape"]
        if not self.lawa:  # configs from before LAWA keep their digest
            del d["lawa"]
        if self.fragments == 1:  # ... and from before fragments
            del d["fragments"]
        if self.fragment_cut == "values":  # ... and from before the cut had a choice
            del d["fragment_cut"]
        if self.anneal == "full_m":  # ... and from before the anneal
            del d["anneal"]
        if self.topology.relay_shards == 1:  # configs from before shards keep their digest
            del d["topology"]["relay_shards"]
        if self.robust == RobustConfig():  # ... and from before robust rules
            del d["robust"]
        if self.membership == MembershipConfig():  # ... and from before cutoffs
            del d["membership"]
        elif not self.membership.standby:  # ... and from before joins
            del d["membership"]["standby"]
        else:
            d["membership"]["standby"] = list(self.membership.standby)
        return d

    @property
    def anneal_step(self) -> int | None:
        """The anneal's first step: its switch follows the merge of this global sync step
        (None: no anneal, ``full_m``); fragment 0's when the run is split
        (``anneal_step_of``)."""
        return self.anneal_step_of(None if self.fragments == 1 else 0)

    @property
    def anneal_stop_step(self) -> int | None:
        """The last step of an island an ``islands:K`` anneal stops: the anneal's first step,
        or with streaming fragments the latest fragment's (None: no such anneal)."""
        if anneal_islands(self.anneal) is None:
            return None
        return max(s or 0 for s in self.anneal_starts)  # (every one is set in a valid config)

    @property
    def anneal_starts(self) -> list[int | None]:
        """Each streaming fragment's anneal start (common/schedule.py ``anneal_starts``; one,
        the whole model's, when the run is not split; empty without an anneal)."""
        if self.anneal == "full_m":
            return []
        return anneal_starts(self.steps, self.topology.h_g, self.inner.decay_fraction,
                             self.fragments)  # fmt: skip

    def anneal_step_of(self, fragment: int | None) -> int | None:
        """Streaming fragment ``fragment``'s anneal start (None: the run is not split): the
        last of its own global sync steps at or before the decay's start, so each fragment
        switches after one of its global merges, as the whole model does."""
        starts = self.anneal_starts
        return starts[fragment or 0] if starts else None

    def anneal_kept(self) -> tuple[str, ...] | None:
        """The islands that train the decay of an ``islands:K`` anneal: the first K of the
        run's island order (``TopologyConfig.island_ids``: regions sorted, then by index),
        so the decay stays in as few regions as it can; None for another mode."""
        k = anneal_islands(self.anneal)
        return None if k is None else self.topology.island_ids()[:k]

    def shards(self, numel: int) -> Shards:
        """How ``numel`` parameters are split between each region's relay shards."""
        return Shards(
            self.topology.relay_shards, numel, shard_unit(self.regional_codec, self.global_codec)
        )

    def model_config(self) -> ModelConfig:
        """The decoder's shape: ``model_shape``, else the preset ``model``."""
        return self.model_shape if self.model_shape is not None else preset(self.model)

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON of the config."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def canonical_json(self) -> str:
        """The config's canonical JSON (sorted keys, no spaces): what ``digest`` hashes and
        the aggregator's tape opens with (``GenesisEntry``)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def global_batch(self) -> int:
        return self.topology.n_islands * self.batch_per_island


def load_tables(path: str | Path) -> dict[str, dict[str, Any]]:
    """The top-level tables of the TOML file at ``path``; ConfigError if it cannot be
    read, is not TOML, or holds anything but the tables of KNOWN_TABLES."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path}: invalid TOML: {e}") from None
    known = ", ".join(KNOWN_TABLES)
    for name, value in doc.items():
        if name not in KNOWN_TABLES:
            what = f"table [{name}]" if isinstance(value, dict) else f"top-level key {name!r}"
            raise ConfigError(f"config {path}: unknown {what} (known tables: {known})")
        if not isinstance(value, dict):
            raise ConfigError(f"config {path}: [{name}] must be a table, got {kind_of(value)}")
    return doc


def kind_of(value: object) -> str:
    """How a TOML value's type reads in a message ("a string", "an integer", ...)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str | Path):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"
