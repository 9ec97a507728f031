"""Test-only switches that plant known bugs, so the fault simulation can show it finds them.

A checker that never fails proves nothing.  Each name below turns on one deliberate bug
in the round code; ``hypertrain sim chaos --plant NAME`` (and tests/unit/test_chaos.py)
runs schedules with it and expects an invariant to break within a documented number of
seeds.  Nothing outside those runs turns a switch on: the set is empty unless
``enable`` is called, and no daemon or environment variable can enable it.

- ``count_duplicate_twice``: a machine (relay or aggregator: the membership code both
  share) counts an identical resend that arrives while its step is still open as one
  more delivery, so the step can commit before every member delivered (its mean then
  leaves a member out).
- ``merge_one_step_late``: islands apply each merge one step after its pinned step.
- ``publish_after_tape``: a node tapes an accepted input before it keeps the input's
  bytes, so a crash between the two leaves a taped input that cannot be replayed.
- ``members_ignore_leaves``: a relay's membership fold forgets leaves, so it still waits
  for (or names absent) an island that left: found only by a checker that folds the
  taped changes itself.
- ``no_sweep``: a node that resumes leaves what a crash left in its folder (an input
  published whose entry was never taped stays forever): found by the end-of-schedule
  check that no node's folder holds such leftovers.
"""

from __future__ import annotations

KNOWN = (
    "count_duplicate_twice",
    "merge_one_step_late",
    "publish_after_tape",
    "members_ignore_leaves",
    "no_sweep",
)
_ON: set[str] = set()


def enable(name: str | None) -> None:
    """Turn on the planted bug ``name`` (None: turn every switch off)."""
    _ON.clear()
    if name is None:
        return
    if name not in KNOWN:
        raise ValueError(f"unknown planted bug {name!r} (known: {', '.join(KNOWN)})")
    _ON.add(name)


def active() -> str | None:
    """The planted bug switched on, if any."""
    return next(iter(_ON), None)


def on(name: str) -> bool:
    """Is the planted bug ``name`` switched on?"""
    return name in _ON
