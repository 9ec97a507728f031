"""Streaming DiLoCo fragments: the one rule that cuts the parameters into F fragments.

It lives in the core, beside the schedule, so that every driver cuts the same
fragments: the simulator today (experiments/sim/engine/run.py), the daemons and the
in-process run once they sync by fragment (issue 16).

Parameters (in the flat layout's name-sorted order, common/flat.py) are split
into F fragments of whole parameters, contiguous in the flat vector and of
roughly equal size; with the name-sorted order a fragment is a run of layers
(``blocks.0.*``, ``blocks.1.*``, ... then ``ln_f``, ``wpe``, ``wte``).  F = 1 is
ordinary DiLoCo: one fragment holding everything, offset 0.

Fragment f syncs on the run's schedule staggered by o_f = f * h_g // F steps
(``Fragment.offset``, passed to ``common/schedule.py``'s ``Schedule``, which owns
the rule: at the end of step t it syncs regionally when ``(t - o_f) % h_r == 0``
and globally when ``(t - o_f) % h_g == 0`` or t is the last step).  The first
round of a fragment with o_f > 0 is therefore o_f steps long, and at the last
step every fragment that did not just sync globally does a final global sync, so
the final model contains every replica's last steps of every fragment; see the
simulator's ``FragmentSync`` (experiments/sim/engine/run.py) for the pending-merge
rule at that flush.

Invariants: fragments partition ``[0, numel)`` in order, each holds >= 1
parameter; F = 1 is one fragment at offset 0, the schedule of the daemons and the
in-process run; a fragment never has two merges in flight because tau < h_r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hypertrain.common.errors import ConfigError
from hypertrain.common.flat import ParamLayout

if TYPE_CHECKING:
    from hypertrain.common.config import RunConfig


def fragment_offset(index: int, n_fragments: int, h_g: int) -> int:
    """Fragment ``index``'s stagger: ``index * h_g // n_fragments`` steps."""
    return (index * h_g) // n_fragments


@dataclass(frozen=True, slots=True)
class Fragment:
    """A contiguous run of whole parameters in the flat layout."""

    index: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    lo: int
    """First flat offset (inclusive)."""
    hi: int
    """Last flat offset (exclusive)."""
    offset: int
    """Step offset of its schedule (0 <= offset < h_g)."""

    @classmethod
    def whole(cls, numel: int) -> Fragment:
        """The one fragment of a run that is not split: every value, offset 0."""
        return cls(index=0, names=(), shapes=(), lo=0, hi=numel, offset=0)

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def sizes(self) -> list[int]:
        """Element count of each parameter, in order."""
        out = []
        for s in self.shapes:
            n = 1
            for d in s:
                n *= d
            out.append(n)
        return out


def run_fragments(cfg: RunConfig, layout: ParamLayout) -> list[Fragment]:
    """The fragments of ``cfg``'s run (``RunConfig.fragments``; one, the whole model, by
    default): what every node and island of the run cuts."""
    return partition(layout, cfg.fragments, cfg.topology.h_g)


def partition(layout: ParamLayout, n_fragments: int, h_g: int) -> list[Fragment]:
    """Split ``layout`` into ``n_fragments`` fragments of near-equal size, staggered over h_g."""
    n_params = len(layout.names)
    if not 1 <= n_fragments <= n_params:
        raise ConfigError(f"streaming: fragments must be in [1, {n_params}], got {n_fragments}")
    if n_fragments > h_g:
        raise ConfigError(f"streaming: fragments ({n_fragments}) must be <= h_g ({h_g})")
    ends = [*layout.offsets[1:], layout.numel]
    cuts: list[int] = []  # index one past the last parameter of each fragment
    start = 0
    for f in range(n_fragments):
        if f == n_fragments - 1:
            cuts.append(n_params)
            break
        target = layout.numel * (f + 1) / n_fragments
        stop = start + 1  # at least one parameter
        # leave at least one parameter for each remaining fragment
        limit = n_params - (n_fragments - f - 1)
        while stop < limit and ends[stop - 1] < target:
            stop += 1
        # take the cut nearer the target
        if stop - 1 > start and abs(ends[stop - 2] - target) < abs(ends[stop - 1] - target):
            stop -= 1
        cuts.append(stop)
        start = stop
    frags, first = [], 0
    for f, stop in enumerate(cuts):
        frags.append(
            Fragment(
                index=f,
                names=layout.names[first:stop],
                shapes=layout.shapes[first:stop],
                lo=layout.offsets[first],
                hi=ends[stop - 1],
                offset=fragment_offset(f, n_fragments, h_g),
            )
        )
        first = stop
    return frags
