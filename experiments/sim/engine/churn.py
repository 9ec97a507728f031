"""Churn in the simulator: islands absent from sync steps, drawn from a seed.

A job with ``drop = p > 0`` (``SimJob.drop``) leaves each island out of each sync step
with probability p, the way the daemons go ahead without a member that missed its
level's cutoff (docs/design.md §4.10):

- **Who is absent.** At a sync step s every island i (replica order) draws
  ``u_i`` uniform in [0, 1) from ``random.Random(f"hypertrain-churn/{seed}/{s}")``:
  Python's own generator seeded by a string (sha512 of it), apart from the training's
  torch generators, so the data stream and the initialization are those of the run
  without churn.  The island is late (absent) when ``u_i < p``.  The draws depend on
  the seed and the step only, not on p or the outer learning rate: every eta of a seed
  sees the same absences, and an island absent at p = 0.1 is absent at p = 0.3 too.
- **At which level.** An island is absent from the merge that takes its delta with
  others: its region's merge when the region has more than one island (hierarchies;
  the regions all forward), and, in flat DiLoCo (one island per region, whose relay
  can only wait for it), its region's forward at the global merge.  So flat runs draw
  at global sync steps only; runs with n_r > 1 at every sync step.
- **The merge** is the fixed-order mean over the members present (``RegionCore.merge``
  and ``GlobalCore.step`` are given only their inputs), as in the daemons.
- **The absent member** trained its steps on its own data, encoded its delta (its
  error feedback moves as the encode left it) and was refused as stale; it then takes
  the step's merge like every member (with the overlap rule when tau > 0).  Its inner
  optimizer state is kept.  This is a late member answered with the merge of its own
  step (§4.10, "Stale deltas"); a member left behind further would heal from a later
  global merge with a zero residual, which one missed step never requires.  With the
  lossless fp32 codecs of the registered cells every residual is zero either way.
- **Below the quorum** (``MembershipConfig.quorum`` at its default: half the members,
  rounded up, at least one) the daemons wait for late members to deliver.  Here the
  step waits for the late islands in order of their draws, largest ``u`` first (the
  least late), until the quorum is present; they count as present.  Deterministic, no
  extra draw, and still nested in p.

``drop = 0`` builds no ``Churn`` at all: the run is the run without churn, bit for bit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypertrain.common.config import MembershipConfig
from hypertrain.common.schedule import SyncKind


@dataclass(frozen=True, slots=True)
class Absence:
    """Who misses one sync step."""

    step: int
    absent: tuple[int, ...]
    """Replica indices left out of the merge, ascending."""
    waited: int
    """Late islands the step waited for to reach its quorum (present after all)."""


class Churn:
    """The absence draw of one job (see the module docstring)."""

    def __init__(
        self,
        p: float,
        seed: int,
        regions: int,
        islands_per_region: int,
        membership: MembershipConfig | None = None,
    ) -> None:
        if not 0.0 < p < 1.0:
            raise ValueError(f"churn: p must be in (0, 1), got {p}")
        membership = membership or MembershipConfig()
        self.p = p
        self.seed = seed
        self.n = regions * islands_per_region
        n_r = islands_per_region
        self.level: SyncKind
        if n_r == 1:  # flat: the island's region is absent from the global merge
            self.level = "global"
            self.groups = [tuple(range(regions))]
            self.quorum = membership.quorum("global", regions)
        else:  # a hierarchy: the island is absent from its region's merge
            self.level = "regional"
            self.groups = [tuple(range(k * n_r, (k + 1) * n_r)) for k in range(regions)]
            self.quorum = membership.quorum("regional", n_r)

    def applies(self, level: SyncKind) -> bool:
        """Does the draw apply at a sync step of ``level``?"""
        return self.level == "regional" or level == "global"

    def draws(self, step: int) -> list[float]:
        """``u_i`` for every replica at sync step ``step`` (replica order)."""
        rng = random.Random(f"hypertrain-churn/{self.seed}/{step}")
        return [rng.random() for _ in range(self.n)]

    def at(self, step: int) -> Absence:
        """Who is absent from sync step ``step``."""
        u = self.draws(step)
        absent: list[int] = []
        waited = 0
        for group in self.groups:
            late = [i for i in group if u[i] < self.p]
            short = self.quorum - (len(group) - len(late))
            if short > 0:  # below the quorum: wait for the least late, largest u first
                back = set(sorted(late, key=lambda i: (-u[i], i))[:short])
                late = [i for i in late if i not in back]
                waited += short
            absent += late
        return Absence(step, tuple(sorted(absent)), waited)
