"""What goes wrong in one fault schedule, drawn from its seed.

A seed fixes everything: the cluster (regions, islands, sync intervals, tau, codecs,
outer optimizer, relay shards per region, membership, LAWA, the anneal, streaming
fragments), the network (per message: delay, loss, duplication; partitions of
links for a while), and the crashes (nodes killed between events and restarted after
a while, and crash points inside a node's durable writes where it dies mid-sequence).
Two runs of one seed make the same choices in the same order, so any failure is
reproduced by its seed alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypertrain.common.config import TOY_MODEL, RunConfig
from hypertrain.common.errors import ConfigError
from hypertrain.common.optim import InnerConfig
from hypertrain.common.rounds.local import Crash
from hypertrain.common.rounds.store import MIN_KEEP_ROUNDS
from hypertrain.common.schedule import anneal_start
from hypertrain.common.shards import shard_unit
from hypertrain.common.toy import TOY_NUMEL

REGIONS = ("a", "b", "c")


def draw_keep_rounds(seed: int) -> int:
    """How many global rounds the nodes of ``seed``'s schedule keep (``NodeStore.prune``):
    the fewest allowed in a third of the schedules, all of them otherwise; from a
    generator of its own, so that every other draw is the seed's as before pruning
    existed."""
    return random.Random(f"keep-rounds-{seed}").choice((0, 0, MIN_KEEP_ROUNDS))


def draw_config(rng: random.Random, seed: int, model: str = TOY_MODEL) -> RunConfig:
    """A small cluster configuration, different per seed."""
    n_regions = rng.choice((1, 2, 2, 3))
    n_r = rng.choice((1, 2, 2, 3))
    h_r = rng.choice((1, 2, 3))
    k = rng.choice((1, 2, 3))
    rounds = rng.choice((2, 3))
    tau = rng.randrange(h_r)
    codec = rng.choice(("int8", "int8", "fp32", "sparseloco+zstd"))
    outer = rng.choice(("nesterov", "nesterov", "average"))
    # Relay shards from a generator of their own, so that the draws above and the fault
    # schedule drawn next from ``rng`` are those of the seed before shards existed.
    units = TOY_NUMEL // shard_unit(codec, "fp32") if model == TOY_MODEL else 3
    shards = min(random.Random(f"relay-shards-{seed}").choice((1, 1, 2, 3)), max(1, units))
    # Cutoffs (virtual seconds) and quorums, likewise from a generator of their own: half
    # the schedules wait for every member, as before cutoffs existed.
    member_rng = random.Random(f"membership-{seed}")
    membership: dict[str, object] = {}
    if member_rng.random() < 0.5 and shards == 1:  # cutoffs need one relay per region
        membership = {
            "regional_cutoff_s": member_rng.choice((3.0, 10.0, 30.0)),
            "global_cutoff_s": member_rng.choice((3.0, 10.0, 30.0)),
            "regional_quorum": member_rng.choice((0.5, 1, 1.0)),
            "global_quorum": member_rng.choice((0.5, 1, 1.0)),
        }
    # An island on standby, which joins mid-run (``Churn``): a third of the schedules with
    # one relay per region and a region of two islands or more.
    join_rng = random.Random(f"joins-{seed}")
    if shards == 1 and n_r >= 2 and join_rng.random() < 1 / 3:
        region = join_rng.choice(REGIONS[:n_regions])
        membership["standby"] = [f"{region}-{n_r - 1}"]
    # LAWA over the last 1 or 2 global rounds in half the schedules, likewise; an anneal
    # (at H_r = 1, or on the first 1 or 2 islands) in a third of those with tau = 0.
    lawa = random.Random(f"lawa-{seed}").choice((0, 0, 1, 2))
    start = anneal_start(h_r * k * rounds, h_r * k, InnerConfig().decay_fraction)
    annealable = tau == 0 and start is not None
    anneal_rng = random.Random(f"anneal-{seed}")
    anneal = "full_m"
    if annealable and anneal_rng.random() < 1 / 3:
        modes = ["h_r1"]
        # the decay on the first 1 or 2 islands (not from step 0: they would train none)
        if shards == 1 and "standby" not in membership and start:
            modes += [f"islands:{n}" for n in (1, 2) if n < n_regions * n_r]
        anneal = anneal_rng.choice(modes)
    # Streaming fragments (2 or 3, at most h_g) in half the schedules that have none of
    # what fragments do not combine with yet (relay shards, cutoffs, standby islands),
    # likewise from a generator of their own.
    fragments = 1
    if shards == 1 and not membership:
        fragments = min(random.Random(f"fragments-{seed}").choice((1, 1, 2, 3)), h_r * k)
    d = {
        "run_id": f"chaos-{seed}",
        "lawa": min(lawa, rounds),
        "anneal": anneal,
        "model": model,
        # One data seed for every schedule: the faults differ by seed, and the
        # fault-free result of a cluster shape is then computed once per process.
        "seed": 0,
        "steps": h_r * k * rounds,
        "batch_per_island": 2,
        "holdout_windows": 8,
        "regional_codec": codec,
        "topology": {
            "regions": list(REGIONS[:n_regions]),
            "islands_per_region": n_r,
            "h_r": h_r,
            "h_g": h_r * k,
            "tau": tau,
            "relay_shards": shards,
        },
        "outer": {"name": outer},
        "membership": membership,
    }
    if fragments > 1:
        try:
            return RunConfig.from_dict({**d, "fragments": fragments})
        except ConfigError:  # an anneal some fragment has no global sync before
            pass
    return RunConfig.from_dict(d)


@dataclass
class Churn:
    """Membership changes of one schedule: when the standby island (if any) starts and
    joins, and which island leaves when (and whether, and when, it starts again and joins
    back).  Drawn from a generator of its own, so that schedules without churn are those
    of the seed before joins existed."""

    join: tuple[str, float] | None = None
    leave: tuple[str, float] | None = None
    back: float | None = None

    @classmethod
    def draw(cls, seed: int, cfg: RunConfig, horizon: float) -> Churn:
        rng = random.Random(f"churn-{seed}")
        topo = cfg.topology
        standby = cfg.membership.standby
        join = (standby[0], rng.uniform(0, horizon / 3)) if standby else None
        leave = back = None
        # Only an island with another member in its region leaves: a region that everyone
        # left holds up every global round without a global cutoff (by design).  Nor does
        # one that an islands:K anneal keeps: with them gone nobody trains the decay.
        kept = cfg.anneal_kept() or ()
        can = [
            i
            for r in sorted(topo.regions)
            for i in cfg.membership.initial(topo.islands_of(r))
            if len(cfg.membership.initial(topo.islands_of(r))) >= 2 and i not in kept
        ]
        # (Nor with streaming fragments: no joins or leaves there yet.)
        if topo.relay_shards == 1 and cfg.fragments == 1 and can and rng.random() < 0.3:
            island = rng.choice(can)
            leave = (island, rng.uniform(0, horizon / 3))
            if rng.random() < 0.5:
                back = leave[1] + rng.uniform(1.0, horizon / 3)
        return cls(join, leave, back)


@dataclass
class Faults:
    """The network's and the crash points' faults for one schedule (a ``LinkPolicy``)."""

    rng: random.Random
    drop: float
    duplicate: float
    max_delay: float
    partitions: list[tuple[frozenset[str], float, float]] = field(default_factory=list)
    """(pair of nodes, from, until): every message between them is lost meanwhile."""
    point_crash: float = 0.0
    """Probability that a node dies at each crash point it passes (while the budget lasts)."""
    point_budget: int = 0
    crashes_at_points: list[str] = field(default_factory=list)

    @classmethod
    def draw(cls, rng: random.Random, names: list[str], horizon: float) -> Faults:
        quiet = rng.random() < 0.1  # some schedules have no faults at all
        f = cls(
            rng=rng,
            drop=0.0 if quiet else rng.choice((0.0, 0.02, 0.05, 0.1)),
            duplicate=0.0 if quiet else rng.choice((0.0, 0.02, 0.05, 0.1)),
            max_delay=0.0 if quiet else rng.choice((0.0, 0.5, 2.0, 5.0)),
            point_crash=0.0 if quiet else rng.choice((0.0, 0.02, 0.05)),
            point_budget=0 if quiet else rng.randrange(0, 4),
        )
        if not quiet:
            for _ in range(rng.randrange(0, 3)):
                a, b = rng.sample(names, 2)
                start = rng.uniform(0, horizon)
                f.partitions.append((frozenset((a, b)), start, start + rng.uniform(1, 30)))
        return f

    def deliveries(self, src: str, dst: str, now: float) -> list[float]:
        rng = self.rng
        for pair, start, end in self.partitions:
            if start <= now < end and src in pair and dst in pair:
                return []
        if rng.random() < self.drop:
            return []
        out = [now + rng.uniform(0, self.max_delay)]
        if rng.random() < self.duplicate:
            out.append(now + rng.uniform(0, self.max_delay))
        return out

    def hook(self, node: str) -> CrashAt:
        return CrashAt(self, node)


@dataclass
class CrashAt:
    """A node store's crash hook: the node dies at a crash point, as the draw says."""

    faults: Faults
    node: str

    def __call__(self, point: str) -> None:
        f = self.faults
        if f.point_budget > 0 and f.rng.random() < f.point_crash:
            f.point_budget -= 1
            f.crashes_at_points.append(f"{self.node}@{point}")
            raise Crash(f"{self.node} crashed at {point}")
