"""``hypertrain up --chaos SEED``: the local cluster under seeded process faults.

Before the run, a plan is drawn from ``random.Random(f"chaos-up-{SEED}")`` and printed:
distinct islands (never the one on standby) to

- SIGKILL for good, at a step in the first half of the run;
- SIGKILL and start again a few seconds later (same ``--state-dir``: it resumes from its
  own state; its log is a new file, ``logs/island-<id>.restart1.log``);
- SIGSTOP for longer than the regional cutoff, then SIGCONT (a straggler: its delta comes
  back stale and it takes the merge, or heals from a later global one);

and a step in the middle of the run at which the island on standby
(``membership.standby``) is started: it asks its relay to join by itself.

An action is done when its island (the join: any island) logs a ``sync`` at or past its
step, never at a wall-clock time.  The plan keeps a quorum of every region alive: an
island killed for good counts as absent for the rest of the run, and the two temporary
actions of one region are done one after the other (the second waits until the first
island is back: it logged a sync, or healed).

Afterwards: what chaos did, the members of every round from the tapes (present, absent,
joins and leaves, per regional step and per global round), how long after its first
delivery each cutoff came (``since_first_s`` of the ``event=cutoff`` lines), and the
audit of the run folder (``audit_run``).  Its exit code is 0 only if the run finished,
every island that was not killed for good finished on the aggregator's final digest, and
the audit is OK.
"""

from __future__ import annotations

import itertools
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import HypertrainError
from hypertrain.common.trust.audit import AuditError, Auditor, RunLayout, audit_run
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.schema import (
    GlobalAppliedEntry,
    GlobalMergeEntry,
    MemberEntry,
    Record,
    RegionalMergeEntry,
    records,
)
from hypertrain.common.trust.tape import verify_tape
from hypertrain.procs import Child

KILL, RESTART, STALL, JOIN = "kill", "restart", "stall", "join"
REGIONAL_CUTOFF_S = 3.0
"""The regional cutoff ``--chaos`` uses when none is given: the default cluster's steps
take a fraction of a second, so a few seconds is long past any healthy member."""
MIN_ROUNDS = 4
"""Global rounds a chaos run needs: the join (in the middle) must leave a round to join."""
RESTART_AFTER_S = (1.0, 3.0)
"""Seconds from the kill of the island to restart to its restart (drawn)."""
STALL_PAST_CUTOFF_S = (2.0, 4.0)
"""Seconds a straggler stays stopped past the regional cutoff (drawn)."""
BACK_EVENTS = ("sync", "healed", "done")
"""An island's log events that show it is back in the run after a restart or a stall."""


def default_global_cutoff(regional_s: float) -> float:
    """The global cutoff ``--chaos`` uses when none is given: well past the regional one,
    so that a region waiting on the cutoff of its dead island is not left out of the
    global round for it."""
    return 2 * regional_s + 4


@dataclass(frozen=True, slots=True)
class ChaosAction:
    kind: str
    """``KILL`` (for good), ``RESTART``, ``STALL`` or ``JOIN``."""
    island: str
    step: int
    """Done when ``island`` (a join: any island) logs a sync of this step or a later one."""
    seconds: float = 0.0
    """``RESTART``: from the kill to the start again; ``STALL``: from SIGSTOP to SIGCONT."""

    def describe(self) -> str:
        if self.kind == KILL:
            return f"SIGKILL {self.island} for good"
        if self.kind == RESTART:
            return f"SIGKILL {self.island}, start it again {self.seconds:.1f} s later"
        if self.kind == STALL:
            return f"SIGSTOP {self.island} for {self.seconds:.1f} s, then SIGCONT"
        return f"start {self.island} (on standby): it joins the run"


@dataclass(frozen=True, slots=True)
class ChaosPlan:
    seed: int
    cfg: RunConfig
    """The run's config: the user's, with what ``notes`` says changed."""
    notes: tuple[str, ...]
    actions: tuple[ChaosAction, ...]
    """In the order of their steps."""

    @property
    def standby(self) -> str:
        return self.cfg.membership.standby[0]

    def of(self, kind: str) -> ChaosAction:
        return next(a for a in self.actions if a.kind == kind)

    def lines(self) -> list[str]:
        mem = self.cfg.membership
        out = [
            f"chaos seed {self.seed}: regional cutoff {mem.regional_cutoff_s:g} s, global "
            f"cutoff {mem.global_cutoff_s:g} s, {self.cfg.topology.islands_per_region} islands "
            f"per region, {self.standby} on standby"
        ]
        out += [f"  chaos: {n}" for n in self.notes]
        for a in self.actions:
            who = "an island" if a.kind == JOIN else a.island
            out.append(f"  plan: when {who} syncs step {a.step}: {a.describe()}")
        return out


def keeps_quorum(cfg: RunConfig, dead: Sequence[str], temporary: Sequence[str]) -> bool:
    """Does every region keep its regional quorum alive, before and after its standby
    island joins, with the islands ``dead`` gone for good and one of its ``temporary``
    ones (restarted or stopped: done one after the other) down at a time?"""
    topo, mem = cfg.topology, cfg.membership
    for region in topo.regions:
        islands = topo.islands_of(region)
        n_dead = sum(i in islands for i in dead)
        n_temp = min(1, sum(i in islands for i in temporary))
        initial = mem.initial(islands)
        for members in {len(initial), len(islands)}:  # before and after the join
            if members - n_dead - n_temp < mem.quorum("regional", members):
                return False
    return True


def plan_chaos(cfg: RunConfig, seed: int, island_ranks: int = 1) -> ChaosPlan:
    """The config a chaos run uses and what it will do, drawn from ``seed`` alone (the
    same for the same config and seed).  HypertrainError for what it cannot do."""
    topo, mem = cfg.topology, cfg.membership
    if topo.relay_shards > 1:
        raise HypertrainError(
            f"--chaos needs one relay per region (relay shards: {topo.relay_shards}); "
            "cutoffs and joins do not work with relay shards yet"
        )
    if island_ranks != 1:
        raise HypertrainError(
            f"--chaos needs one rank per island, not --island-ranks {island_ranks}"
        )
    if len(mem.standby) > 1:
        raise HypertrainError(
            f"--chaos adds one island mid-run; the config has {len(mem.standby)} on standby "
            f"({', '.join(mem.standby)})"
        )
    notes: list[str] = []
    changes: dict[str, object] = {}
    if topo.islands_per_region < 3:
        changes["topology.islands_per_region"] = 3
        notes.append("3 islands per region (one of them is added mid-run)")
    regional = mem.regional_cutoff_s or REGIONAL_CUTOFF_S
    if not mem.regional_cutoff_s:
        changes["membership.regional_cutoff_s"] = regional
        notes.append(f"--regional-cutoff {regional:g} (none given)")
    if not mem.global_cutoff_s:
        changes["membership.global_cutoff_s"] = default_global_cutoff(regional)
        notes.append(f"--global-cutoff {default_global_cutoff(regional):g} (none given)")
    cfg = cfg.with_overrides(**changes) if changes else cfg
    rng = random.Random(f"chaos-up-{seed}")
    if not mem.standby:
        region = rng.choice(sorted(cfg.topology.regions))
        island = cfg.topology.islands_of(region)[-1]
        cfg = cfg.with_overrides(**{"membership.standby": [island]})
        notes.append(f"--standby {island} (none given)")
    topo, mem = cfg.topology, cfg.membership
    rounds = cfg.steps // topo.h_g
    if rounds < MIN_ROUNDS:
        raise HypertrainError(
            f"--chaos needs at least {MIN_ROUNDS} global rounds (steps >= {MIN_ROUNDS} * h_g); "
            f"this run has {rounds}"
        )
    standby = mem.standby[0]
    candidates = [i for i in topo.island_ids() if i != standby]
    triples = [t for t in itertools.permutations(candidates, 3) if keeps_quorum(cfg, t[:1], t[1:])]
    if not triples:
        raise HypertrainError(
            "--chaos: no choice of islands to kill, restart and stop keeps the regional "
            f"quorum ({mem.regional_quorum}) of every region; add islands "
            "(--islands-per-region) or lower --regional-quorum"
        )
    kill, restart, stall = rng.choice(triples)
    syncs = range(topo.h_r, cfg.steps + 1, topo.h_r)

    def step_in(lo: float, hi: float) -> int:
        return rng.choice([s for s in syncs if lo <= s <= hi])

    steps = cfg.steps
    kill_at = step_in(topo.h_r, (steps - 1) / 2)  # the first half
    restart_at, stall_at = step_in(topo.h_r, 0.6 * steps), step_in(topo.h_r, 0.6 * steps)
    join_at = step_in(steps / 4, steps / 2)  # the middle, with rounds left to join
    restart_s = round(rng.uniform(*RESTART_AFTER_S), 1)
    stall_s = round(mem.regional_cutoff_s + rng.uniform(*STALL_PAST_CUTOFF_S), 1)
    actions = [
        ChaosAction(KILL, kill, kill_at),
        ChaosAction(RESTART, restart, restart_at, restart_s),
        ChaosAction(STALL, stall, stall_at, stall_s),
        ChaosAction(JOIN, standby, join_at),
    ]
    order = {k: n for n, k in enumerate((KILL, RESTART, STALL, JOIN))}
    actions.sort(key=lambda a: (a.step, order[a.kind]))
    return ChaosPlan(seed, cfg, tuple(notes), tuple(actions))


# -- the run ------------------------------------------------------------------------------
@dataclass
class _Down:
    """A restarted or stopped island, until it is back (one per region at a time)."""

    action: ChaosAction
    at: int
    """Its sync step when it was killed or stopped."""
    source: str | None = None
    """The child whose events say it is back (set once restarted, or continued)."""
    back_step: int | None = None


StartIsland = Callable[[str, str], Child]
"""(island id, child label) -> the started island (``up.start_island`` for this run)."""


class ChaosRunner:
    """Does a plan's actions as the islands' syncs come in (on a thread of its own).

    ``children`` is the run's list of children: restarted and added islands are appended
    to it, and every child it kills is in ``expected`` before it is killed."""

    def __init__(
        self,
        plan: ChaosPlan,
        children: list[Child],
        start_island: StartIsland,
        processes: Path | None = None,
    ) -> None:
        self.plan = plan
        self.cfg = plan.cfg
        self.children = children
        self.start_island = start_island
        self.processes = processes
        self.expected: set[Child] = set()
        self.current = {c.name.removeprefix("island-"): c for c in children}
        self.synced: dict[str, int] = {}
        self.top = 0
        self.pending = list(plan.actions)
        self.did: list[tuple[ChaosAction, str, _Down | None]] = []
        self.killed: list[str] = []
        self.joined: list[str] = []
        self.down: dict[str, _Down] = {}
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.stopped: set[Child] = set()
        self.cutoffs: list[dict[str, str]] = []
        self.relay_changes: list[dict[str, str]] = []
        self.finished: dict[str, dict[str, str]] = {}
        """Each island's ``done`` event: its stale deltas and heals."""
        self.errors: list[str] = []
        self._events: queue.Queue[tuple[str, dict[str, str]]] = queue.Queue()
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    # -- wiring -------------------------------------------------------------------------
    def watch(self, source: str, e: dict[str, str]) -> None:
        """Every parsed log line of every child (``Progress.watchers``)."""
        self._events.put((source, e))

    def start(self) -> None:
        self._thread.start()

    def busy(self) -> bool:
        """An island is killed and not started again yet: the run is not over."""
        with self._lock:
            return any(d.action.kind == RESTART and d.source is None for d in self.down.values())

    def stop(self) -> None:
        """Stop acting; continue a stopped island (so that it can be stopped cleanly).
        Events still coming in (the last lines of the children) are read by the report."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            for child in self.stopped:
                self._signal(child, signal.SIGCONT)
            self.stopped.clear()
            self.timers.clear()

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                item: tuple[str, dict[str, str]] | None = self._events.get(timeout=0.05)
            except queue.Empty:
                item = None
            with self._lock:
                try:
                    if item is not None:
                        self._note(*item)
                    self._timers_due()
                    self._trigger()
                except Exception as exc:  # said in the report; the run goes on
                    self.errors.append(f"{type(exc).__name__}: {exc}")

    def _note(self, source: str, e: dict[str, str]) -> None:
        kind, role = e.get("event"), e.get("role")
        if kind == "cutoff":
            self.cutoffs.append(e)
        elif role == "relay" and kind in ("join", "leave"):
            self.relay_changes.append(e)
        if role != "island" or "island" not in e:
            return
        island = e["island"]
        if kind == "done":
            self.finished[island] = e
        step = int(e["step"]) if kind == "sync" else None
        if step is not None:
            self.synced[island] = max(step, self.synced.get(island, 0))
            self.top = max(self.top, step)
        down = self.down.get(self.cfg.topology.region_of(island))
        if down is None or down.action.island != island or down.source != source:
            return
        if kind in BACK_EVENTS and (down.action.kind == RESTART or step is None or step > down.at):
            down.back_step = int(e.get("step", self.cfg.steps))
            del self.down[self.cfg.topology.region_of(island)]

    def _timers_due(self) -> None:
        now = time.monotonic()
        due = [t for t in self.timers if t[0] <= now]
        self.timers = [t for t in self.timers if t[0] > now]
        for _, act in due:
            act()

    def _trigger(self) -> None:
        for action in list(self.pending):
            if action.kind == JOIN:
                if self.top < action.step:
                    continue
                at = self.top
            else:
                at = self.synced.get(action.island, 0)
                region = self.cfg.topology.region_of(action.island)
                if at < action.step or (action.kind != KILL and region in self.down):
                    continue
            self.pending.remove(action)
            getattr(self, f"_{action.kind}")(action, at)

    def _signal(self, child: Child, sig: signal.Signals) -> None:
        if child.proc.poll() is None:
            os.kill(child.proc.pid, sig)

    def _spawn(self, island: str, label: str) -> Child:
        child = self.start_island(island, label)
        self.current[island] = child
        self.children.append(child)
        if self.processes is not None:
            with self.processes.open("a") as f:
                f.write(f"{child.name} {child.proc.pid}\n")
        return child

    # -- the actions ----------------------------------------------------------------------
    def _kill(self, action: ChaosAction, at: int) -> None:
        child = self.current[action.island]
        self.expected.add(child)
        self._signal(child, signal.SIGKILL)
        self.killed.append(action.island)
        self.did.append(
            (action, f"SIGKILL {action.island} for good (its last sync: step {at})", None)
        )

    def _restart(self, action: ChaosAction, at: int) -> None:
        child = self.current[action.island]
        self.expected.add(child)
        self._signal(child, signal.SIGKILL)
        down = _Down(action, at)
        self.down[self.cfg.topology.region_of(action.island)] = down
        label = f"{child.name}.restart1"

        def again() -> None:
            try:
                down.source = self._spawn(action.island, label).name
            except Exception:  # not busy any more: the island will not finish
                down.source = ""
                raise

        self.timers.append((time.monotonic() + action.seconds, again))
        self.did.append(
            (
                action,
                f"SIGKILL {action.island} (its last sync: step {at}), started it again "
                f"{action.seconds:.1f} s later (log logs/{label}.log)",
                down,
            )
        )

    def _stall(self, action: ChaosAction, at: int) -> None:
        child = self.current[action.island]
        self._signal(child, signal.SIGSTOP)
        self.stopped.add(child)
        down = _Down(action, at)
        self.down[self.cfg.topology.region_of(action.island)] = down

        def resume() -> None:
            self._signal(child, signal.SIGCONT)
            self.stopped.discard(child)
            down.source = child.name

        self.timers.append((time.monotonic() + action.seconds, resume))
        self.did.append(
            (
                action,
                f"SIGSTOP {action.island} (its last sync: step {at}), SIGCONT "
                f"{action.seconds:.1f} s later",
                down,
            )
        )

    def _join(self, action: ChaosAction, at: int) -> None:
        self._spawn(action.island, f"island-{action.island}")
        self.joined.append(action.island)
        self.did.append(
            (action, f"started {action.island} (on standby) as an island synced step {at}", None)
        )

    # -- the report -----------------------------------------------------------------------
    def _drain(self) -> None:
        """Take in the events the thread did not (it is stopped before the children are,
        whose last lines may come after); called with the lock held."""
        while True:
            try:
                self._note(*self._events.get_nowait())
            except queue.Empty:
                return

    def report_lines(self) -> list[str]:
        """What chaos did: call it once the children are stopped (their logs read)."""
        with self._lock:
            self._drain()
            out = ["chaos did:"]
            for action, text, down in self.did:
                more = ""
                if down is not None:
                    more = (
                        "; not back before the run ended"
                        if down.back_step is None
                        else f"; its first sync after that: step {down.back_step}"
                    )
                if action.kind != KILL:
                    done = self.finished.get(action.island)
                    more += (
                        "; it did not finish"
                        if done is None
                        else f"; it finished (stale deltas {done.get('stale', '?')}, heals "
                        f"{done.get('heals', '?')})"
                    )
                out.append(f"  planned at step {action.step}: {text}{more}")
            for c in self.relay_changes:
                out.append(f"  relay {c.get('region', '?')}: {c.get('message', '')}")
            for action in self.pending:
                out.append(f"  not done (the run ended first): {action.describe()}")
            out += [f"  chaos error: {e}" for e in self.errors]
            return out

    def survivors(self) -> list[str]:
        """The islands that should have finished: all but those killed for good and the
        standby island if it was never started."""
        with self._lock:
            self._drain()
            return [
                i
                for i in self.cfg.topology.island_ids()
                if i not in self.killed and (i != self.plan.standby or i in self.joined)
            ]


# -- reading the run ------------------------------------------------------------------------
def _tape(path: Path, trusted: TrustedKeys) -> list[Record]:
    return records(verify_tape(path, trusted).entries)


def _names(members: Sequence[str] | None) -> str:
    return ",".join(members or ()) or "-"


def members_lines(run_dir: Path, cfg: RunConfig, trusted: TrustedKeys) -> list[str]:
    """The members of every round from the run's tapes: per global round the aggregator's
    members and absent regions, per region its regional steps' members and absent
    islands, its joins and leaves, and a region's rejoin after it was left behind."""
    topo = cfg.topology
    global_of = {
        r.round: r
        for r in _tape(run_dir / "aggregator" / "tape", trusted)
        if isinstance(r, GlobalMergeEntry)
    }
    regions = {
        region: _tape(run_dir / f"relay-{region}" / "tape", trusted)
        for region in sorted(topo.regions)
    }
    rounds = cfg.steps // topo.h_g
    out = ["members of every round (from the tapes; absent: went ahead without them at a cutoff):"]
    for g in range(rounds):
        merge = global_of.get(g)
        if merge is None:
            out.append(
                f"  round {g + 1}/{rounds} (global step {topo.h_g * (g + 1)}): no global merge"
            )
        else:
            absent = f" absent {_names(merge.absent)}" if merge.absent else ""
            out.append(
                f"  round {g + 1}/{rounds} (global step {merge.sync_step}): "
                f"{_names([m for m, _ in merge.members])}{absent}"
            )
        for region, recs in regions.items():
            for r in recs:
                if getattr(r, "round", None) != g:
                    continue
                if isinstance(r, RegionalMergeEntry):
                    absent = f" absent {_names(r.absent)}" if r.absent else ""
                    out.append(
                        f"    {region} step {r.sync_step}: {_names([m for m, _ in r.members])}{absent}"
                    )
                elif isinstance(r, MemberEntry):
                    start = (
                        "" if r.start is None else f", starting from the merge of step {r.start}"
                    )
                    out.append(
                        f"    {region} {r.member} {r.change}s from step {r.sync_step}{start}"
                    )
                elif isinstance(r, GlobalAppliedEntry) and r.rejoined_from is not None:
                    out.append(
                        f"    {region} rejoined at step {r.sync_step} (its forward of step "
                        f"{r.rejoined_from} came after the cutoff)"
                    )
    return out


def cutoff_lines(cfg: RunConfig, cutoffs: list[dict[str, str]]) -> list[str]:
    """How long after its step's first delivery each cutoff came, per level."""
    mem = cfg.membership
    out = ["cutoffs (event=cutoff; since_first_s: from the step's first delivery to the cutoff, "
           "where the step commits when its quorum delivered):"]  # fmt: skip
    for level, role in (("regional", "relay"), ("global", "aggregator")):
        cut_s = mem.cutoff_s(level)
        mine = [c for c in cutoffs if c.get("role") == role]
        timed = [float(c["since_first_s"]) for c in mine if "since_first_s" in c]
        waiting = sum(c.get("waiting") == "True" for c in mine)
        if not timed:
            out.append(f"  {level} (cutoff {cut_s:g} s): {len(mine)} cutoffs")
            continue
        lo, hi = min(timed), max(timed)
        verdict = "within" if hi <= cut_s + 1 else "NOT within"
        out.append(
            f"  {level} (cutoff {cut_s:g} s): {len(mine)} cutoffs, {lo:.3f}-{hi:.3f} s after "
            f"the first delivery ({verdict} the cutoff plus one second: at most "
            f"{hi - cut_s:+.3f} s)"
            + (f"; {waiting} below the quorum, waiting" if waiting else "")
            + (
                f"; {len(mine) - len(timed)} clocks started again by a restart"
                if len(timed) < len(mine)
                else ""
            )
        )
    return out


def audit_line(run_dir: Path) -> tuple[str, str | None]:
    """The audit's verdict line, and the final digest it recomputed (None: it failed):
    from the oldest round every node kept, when they pruned (``--keep-rounds``)."""
    try:
        trusted = TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")
        start = Auditor(RunLayout.of(run_dir), trusted).pruned_from()
        report = audit_run(run_dir, trusted, start)
    except AuditError as e:
        return f"audit FAILED: {e}", None
    except HypertrainError as e:
        return f"audit error: {e}", None
    return report.summary(), report.final_digest
