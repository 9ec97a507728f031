"""The round schedule: which step syncs at which level, when its merge applies, which round.

Every driver asks this module and none re-derives any of it: the island daemon, the
in-process run (common/rounds/local.py), the simulator (both execution paths), the
round machines, the daemons' recovery and the auditor (docs/design.md §3).

Steps are 1-based: "step t" is the t-th inner step, and a sync "at step t" happens
after it.  With sync intervals ``h_r`` (regional) and ``h_g = K * h_r`` (global):

- step t syncs globally when ``(t - offset) % h_g == 0`` or t is the last step, else
  regionally when ``(t - offset) % h_r == 0``, else not at all (``Schedule.sync_kind``);
  ``offset`` is a streaming fragment's stagger (0 for the whole model);
- the merge of sync step s is applied at step ``s + tau`` (``Schedule.merge_step``),
  except after the last step, where every member takes the final global state;
- sync step s belongs to global round ``(s - 1) // h_g`` (0-based, ``Schedule.round_of``);
- an island that an ``islands:K`` anneal stops ends at the anneal's first step (its
  schedule's ``steps``; ``Schedule.of(cfg, island=...)``; a streaming fragment's own);
- the anneal at H_r = 1 (``RunConfig.anneal = "h_r1"``): after the anneal's first step
  ``anneal_at`` (the last global sync step at or before the inner schedule's decay starts,
  ``anneal_start``; a streaming fragment's own last one), every step syncs regionally,
  and globally as before;
- with tau > 0 a member keeps training through the overlap and then takes the merged
  state plus the progress it made since the sync step (``overlap_merge``).

Invariants: everything here is a pure function of the configuration and the step; a
``PendingMerges`` queue hands out each merge exactly once, at its pinned step, and
refuses to let one be skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

import torch

from hypertrain.common import planted
from hypertrain.common.errors import HypertrainError
from hypertrain.common.fragments import fragment_offset

if TYPE_CHECKING:
    from hypertrain.common.config import RunConfig

SyncKind = Literal["regional", "global"]
"""The level of a sync step (a global sync includes its regional one)."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Schedule:
    """The sync schedule of one run (or of one streaming fragment of it)."""

    h_r: int
    """Regional sync interval in inner steps."""
    h_g: int
    """Global sync interval; a multiple of ``h_r``."""
    tau: int
    """Merge delay: the merge of sync step s applies at s + tau (0 <= tau < h_r)."""
    steps: int
    """The run's last step (inner steps per island)."""
    offset: int = 0
    """A streaming fragment's stagger in steps (0 <= offset < h_g); 0 for the whole model."""
    anneal_at: int | None = None
    """The anneal at H_r = 1: every step after this global sync step syncs (None: no anneal)."""
    fragment: int | None = None
    """The streaming fragment this schedule is of (None: the run is not split; the whole
    model syncs on one schedule)."""

    def __post_init__(self) -> None:
        if self.h_r < 1 or self.h_g % self.h_r or self.h_g < 1:
            raise HypertrainError(
                f"schedule: h_g ({self.h_g}) must be a multiple of h_r ({self.h_r})"
            )
        if not 0 <= self.tau < self.h_r:
            raise HypertrainError(f"schedule: tau must satisfy 0 <= tau < h_r, got {self.tau}")
        if not 0 <= self.offset < self.h_g:
            raise HypertrainError(f"schedule: offset must be in [0, h_g), got {self.offset}")
        if self.anneal_at is not None and (
            (self.anneal_at - self.offset) % self.h_g
            or not self.offset <= self.anneal_at < self.steps
            or self.tau
        ):
            raise HypertrainError(
                f"schedule: the anneal starts at a global sync step before the last step, "
                f"with tau 0 (got step {self.anneal_at}, tau {self.tau}, offset {self.offset})"
            )

    @classmethod
    def of(cls, cfg: RunConfig, fragment: int | None = None, island: str | None = None) -> Schedule:
        """The run's schedule; of streaming ``fragment`` f (None with ``cfg.fragments`` 1),
        staggered by ``fragment_offset``; for ``island``, that island's: with an
        ``islands:K`` anneal an island that does not train the decay ends at the anneal's
        first step (of the fragment: ``RunConfig.anneal_step_of``), where it pushes its last
        delta of it."""
        t = cfg.topology
        if (fragment is None) != (cfg.fragments == 1) or not 0 <= (fragment or 0) < cfg.fragments:
            raise HypertrainError(
                f"schedule: fragment {fragment} of a run with {cfg.fragments} fragments"
            )
        offset = 0 if fragment is None else fragment_offset(fragment, cfg.fragments, t.h_g)
        start = cfg.anneal_step_of(fragment)
        at = start if cfg.anneal == "h_r1" else None
        steps = cfg.steps
        kept = cfg.anneal_kept()
        if island is not None and kept is not None and island not in kept:
            assert start is not None
            steps = start
        return cls(
            h_r=t.h_r,
            h_g=t.h_g,
            tau=t.tau,
            steps=steps,
            offset=offset,
            anneal_at=at,
            fragment=fragment,
        )

    def annealing(self, step: int) -> bool:
        """Is ``step`` (1-based) in the anneal, where every step syncs?"""
        return self.anneal_at is not None and step > self.anneal_at

    # -- which steps sync -------------------------------------------------------------
    def sync_kind(self, step: int) -> SyncKind | None:
        """The sync done after ``step`` (1-based), if any."""
        u = step - self.offset
        if u % self.h_g == 0 or step == self.steps:
            return "global"
        if u % self.h_r == 0 or self.annealing(step):
            return "regional"
        return None

    def interval(self, level: SyncKind) -> int:
        """Steps between two syncs of ``level`` (before any anneal)."""
        return self.h_g if level == "global" else self.h_r

    def is_sync_step(self, step: int, level: SyncKind) -> bool:
        """Does ``level`` sync after ``step``?  (A global sync includes its regional one.)"""
        if not 1 <= step <= self.steps:
            return False
        kind = self.sync_kind(step)
        return kind is not None and (level == "regional" or kind == "global")

    def first_sync_step(self, level: SyncKind) -> int:
        return self.next_sync_step(level, 0)

    def next_sync_step(self, level: SyncKind, step: int) -> int:
        """The first sync step of ``level`` after ``step`` (past the last step: where the
        grid of ``level`` would put it)."""
        if level == "regional" and self.annealing(step + 1):
            return step + 1
        n, o = self.interval(level), self.offset
        s = o + ((step - o) // n + 1) * n
        return self.steps if step < self.steps < s else s

    def prev_sync_step(self, level: SyncKind, step: int) -> int:
        """The last sync step of ``level`` before ``step`` (0: none)."""
        if level == "regional" and self.annealing(step - 1):
            return step - 1
        n, o = self.interval(level), self.offset
        s = max(o + ((step - 1 - o) // n) * n, 0)
        return self.steps if s < self.steps < step else s

    def sync_steps(self, level: SyncKind, after: int = 0, until: int | None = None) -> list[int]:
        """Every sync step of ``level`` in ``(after, until]`` (default: the whole run), in
        order."""
        end = self.steps if until is None else min(until, self.steps)
        out, s = [], self.next_sync_step(level, after)
        while s <= end:
            out.append(s)
            s = self.next_sync_step(level, s)
        return out

    # -- merges and rounds ------------------------------------------------------------
    def merge_step(self, sync_step: int) -> int:
        """The step at which the merge of ``sync_step`` is applied."""
        return sync_step + self.tau + (1 if planted.on("merge_one_step_late") else 0)

    def applies_in_run(self, sync_step: int) -> bool:
        """Is the merge of ``sync_step`` applied at a step of the run?  The last step's is not:
        after it every member takes the final global state (``is_final``)."""
        return self.merge_step(sync_step) <= self.steps and sync_step < self.steps

    def is_final(self, sync_step: int) -> bool:
        return sync_step == self.steps

    @property
    def _first_global(self) -> int:
        return self.offset or self.h_g

    def round_of(self, sync_step: int) -> int:
        """The global round (0-based) sync step ``sync_step`` belongs to (with an offset o,
        round 0 ends at step o, and the run's last step closes one more round)."""
        return (sync_step - self._first_global + self.h_g - 1) // self.h_g

    def global_step_of(self, round_: int) -> int:
        """The global sync step that closes round ``round_``."""
        if self.offset and round_ == self.rounds - 1:
            return self.steps
        return self._first_global + round_ * self.h_g

    @property
    def rounds(self) -> int:
        """Global rounds in the run (one more with an offset: its last is cut short)."""
        return self.steps // self.h_g + (1 if self.offset else 0)

    @property
    def syncs_per_round(self) -> int:
        """K = h_g / h_r regional syncs per global round."""
        return self.h_g // self.h_r


def anneal_start(steps: int, h_g: int, decay_fraction: float, offset: int = 0) -> int | None:
    """The anneal's first step: the last global sync step at or before the inner schedule's
    decay starts (its merge applied; the WSD decay spans the last ``decay_fraction`` of the
    steps); None where that is the last step (no anneal).  The simulator's M = 1 anneal
    starts there too.  A streaming fragment's (``offset`` > 0) is the last of its own global
    sync steps at or before the decay's start; None where the decay starts before its first
    (a run configuration refuses that)."""
    decay = round(decay_fraction * steps)
    start = offset + (steps - decay - offset) // h_g * h_g
    return start if offset <= start < steps else None


def anneal_starts(
    steps: int, h_g: int, decay_fraction: float, fragments: int = 1
) -> list[int | None]:
    """Each streaming fragment's anneal start (``anneal_start`` at its offset; one entry,
    the whole model's, when the run is not split)."""
    return [
        anneal_start(steps, h_g, decay_fraction, fragment_offset(f, fragments, h_g))
        for f in range(fragments)
    ]


def overlap_merge(merged: torch.Tensor, now: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """tau > 0: the merged state plus the local progress made during the overlap,
    ``merged + (now - snapshot)`` (``snapshot``: the member's state at the sync step)."""
    return merged + (now - snapshot)


@dataclass(slots=True)
class PendingMerge(Generic[T]):
    """A merge computed for ``sync_step``, to be applied at ``merge_step``."""

    sync_step: int
    merge_step: int
    kind: SyncKind
    item: T


@dataclass(slots=True)
class PendingMerges(Generic[T]):
    """Merges waiting for their pinned step, handed out in sync-step order.

    ``due(step)`` returns (and removes) the merges pinned to ``step``; one pinned to an
    earlier step that was never taken is an error, never silently applied late."""

    schedule: Schedule
    _queue: list[PendingMerge[T]] = field(default_factory=list)

    def add(self, sync_step: int, kind: SyncKind, item: T) -> PendingMerge[T]:
        if self._queue and self._queue[-1].sync_step > sync_step:
            raise HypertrainError(
                f"pending merges: sync step {sync_step} after {self._queue[-1].sync_step}"
            )
        p = PendingMerge(sync_step, self.schedule.merge_step(sync_step), kind, item)
        self._queue.append(p)
        return p

    def due(self, step: int) -> list[PendingMerge[T]]:
        """The merges pinned to ``step``, removed from the queue."""
        if self._queue and self._queue[0].merge_step < step:
            late = self._queue[0]
            raise HypertrainError(
                f"the merge of sync step {late.sync_step} was pinned to step {late.merge_step} "
                f"and not applied; now at step {step}"
            )
        n = 0
        while n < len(self._queue) and self._queue[n].merge_step == step:
            n += 1
        out, self._queue = self._queue[:n], self._queue[n:]
        return out

    def flush(self) -> list[PendingMerge[T]]:
        """Everything still pending, removed (the end of a run, or a fragment's last sync)."""
        out, self._queue = self._queue, []
        return out

    def peek(self) -> PendingMerge[T] | None:
        return self._queue[0] if self._queue else None

    def __iter__(self) -> Iterator[PendingMerge[T]]:
        """The merges waiting, in order (nothing removed)."""
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)
