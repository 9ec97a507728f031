"""Streaming DiLoCo fragments: the one rule that cuts the parameters into F fragments.

It lives in the core, beside the schedule, so that every driver cuts the same
fragments: the simulator (experiments/sim/engine/run.py), the daemons and the
in-process run (``run_fragments``), and the audit.

A fragment is a contiguous range ``[lo, hi)`` of the flat vector (parameters in
the layout's name-sorted order, common/flat.py).  Two cuts (``CUTS``):

- ``values`` (the run configuration's default): fragment f is exactly
  ``[numel * f // F, numel * (f + 1) // F)``, cut inside a parameter where the
  boundary falls, so every fragment holds the same number of values (within one)
  and the peak bytes of a sync fall by F.
- ``params``: fragments of whole parameters, each cut at the parameter boundary
  nearest the even target (the simulator's registered cells use it).  With the
  name-sorted order a fragment is a run of layers (``blocks.0.*``, ``blocks.1.*``,
  ... then ``ln_f``, ``wpe``, ``wte``), and its size is bounded below by the
  largest parameter (the tied embedding on the small presets).

F = 1 is ordinary DiLoCo with either cut: one fragment holding everything, offset 0.
A fragment's ``pieces`` name the parameters (or parts of one) it holds, which is
what a driver that keeps its parameters by name reads and writes (the simulator's
replica sets); the daemons and the in-process run only slice ``[lo, hi)``.

Fragment f syncs on the run's schedule staggered by o_f = f * h_g // F steps
(``Fragment.offset``, passed to ``common/schedule.py``'s ``Schedule``, which owns
the rule: at the end of step t it syncs regionally when ``(t - o_f) % h_r == 0``
and globally when ``(t - o_f) % h_g == 0`` or t is the last step).  The first
round of a fragment with o_f > 0 is therefore o_f steps long, and at the last
step every fragment that did not just sync globally does a final global sync, so
the final model contains every replica's last steps of every fragment; see the
simulator's ``FragmentSync`` (experiments/sim/engine/run.py) for the pending-merge
rule at that flush.

Invariants: fragments partition ``[0, numel)`` in order, each holds >= 1 value
(``params``: >= 1 whole parameter); the pieces of all fragments cover every
value once; F = 1 is one fragment at offset 0, the schedule of the daemons and
the in-process run; a fragment never has two merges in flight because tau < h_r.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hypertrain.common.errors import ConfigError
from hypertrain.common.flat import ParamLayout

if TYPE_CHECKING:
    from hypertrain.common.config import RunConfig


CUTS = ("values", "params")
"""The cut rules, by name; ``values`` first: the run configuration's default."""
ISLAND_CALLS = 4
"""With streaming fragments, the most calls an island has in flight to its relay at once:
its fragments' pushes of the run's last step, then their final fetches, go this many at a
time.  A relay of such a run refuses to start with a per-caller cap (``calls_per_peer``)
below ``min(fragments, ISLAND_CALLS)``; the default cap is 4."""


def cut_problem(cut: str) -> str | None:
    """What is wrong with ``cut`` as a cut rule's name (None: it is one of ``CUTS``), for
    every place that takes one to say in its own words."""
    return None if cut in CUTS else f"must be one of {', '.join(CUTS)}, got {cut!r}"


def fragment_offset(index: int, n_fragments: int, h_g: int) -> int:
    """Fragment ``index``'s stagger: ``index * h_g // n_fragments`` steps."""
    return (index * h_g) // n_fragments


@dataclass(frozen=True, slots=True)
class Piece:
    """Values ``[start, stop)`` of one parameter, flattened (all of it, or a part)."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Fragment:
    """A contiguous range of the flat layout, and the parameter pieces it holds."""

    index: int
    pieces: tuple[Piece, ...]
    lo: int
    """First flat offset (inclusive)."""
    hi: int
    """Last flat offset (exclusive)."""
    offset: int
    """Step offset of its schedule (0 <= offset < h_g)."""

    @classmethod
    def whole(cls, numel: int) -> Fragment:
        """The one fragment of a run that is not split: every value, offset 0."""
        return cls(index=0, pieces=(), lo=0, hi=numel, offset=0)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def run_fragments(cfg: RunConfig, layout: ParamLayout) -> list[Fragment]:
    """The fragments of ``cfg``'s run (``RunConfig.fragments`` cut by
    ``RunConfig.fragment_cut``; one, the whole model, by default): what every node and
    island of the run cuts."""
    return partition(layout, cfg.fragments, cfg.topology.h_g, cfg.fragment_cut)


def partition(layout: ParamLayout, n_fragments: int, h_g: int, cut: str) -> list[Fragment]:
    """Split ``layout`` into ``n_fragments`` fragments of near-equal size by ``cut``
    (``CUTS``), staggered over h_g."""
    if (problem := cut_problem(cut)) is not None:
        raise ConfigError(f"streaming: fragment cut {problem}")
    limit = layout.numel if cut == "values" else len(layout.names)
    if not 1 <= n_fragments <= limit:
        what = "values" if cut == "values" else "parameters"
        raise ConfigError(
            f"streaming: fragments must be in [1, {limit}] (the model's {what}), got {n_fragments}"
        )
    if n_fragments > h_g:
        raise ConfigError(f"streaming: fragments ({n_fragments}) must be <= h_g ({h_g})")
    if cut == "values":
        bounds = [layout.numel * f // n_fragments for f in range(n_fragments + 1)]
    else:
        bounds = _param_bounds(layout, n_fragments)
    return [
        Fragment(
            index=f,
            pieces=_pieces(layout, lo, hi),
            lo=lo,
            hi=hi,
            offset=fragment_offset(f, n_fragments, h_g),
        )
        for f, (lo, hi) in enumerate(itertools.pairwise(bounds))
    ]


def _pieces(layout: ParamLayout, lo: int, hi: int) -> tuple[Piece, ...]:
    """The parameters, or parts of them, that flat range ``[lo, hi)`` covers, in order."""
    out = []
    for name, shape, off in zip(layout.names, layout.shapes, layout.offsets, strict=True):
        n = math.prod(shape)
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append(Piece(name=name, shape=shape, start=a - off, stop=b - off))
    return tuple(out)


def _param_bounds(layout: ParamLayout, n_fragments: int) -> list[int]:
    """The ``params`` cut's flat boundaries: at whole parameters, each nearest its even target."""
    n_params = len(layout.names)
    ends = [*layout.offsets[1:], layout.numel]
    bounds, start = [0], 0  # start: index of the next fragment's first parameter
    for f in range(n_fragments - 1):
        target = layout.numel * (f + 1) / n_fragments
        stop = start + 1  # at least one parameter
        # leave at least one parameter for each remaining fragment
        limit = n_params - (n_fragments - f - 1)
        while stop < limit and ends[stop - 1] < target:
            stop += 1
        # take the cut nearer the target
        if stop - 1 > start and abs(ends[stop - 2] - target) < abs(ends[stop - 1] - target):
            stop -= 1
        bounds.append(ends[stop - 1])
        start = stop
    bounds.append(layout.numel)
    return bounds
