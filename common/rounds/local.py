"""The whole cluster in one process: nodes, islands, and a message network between them.

``hypertrain run --local`` and the fault simulation (``hypertrain sim chaos``) run the
same real parts the daemons run: relay and aggregator nodes (``node.py``: machine,
tape, published inputs, checkpoints, recovery) and islands (``IslandRounds`` over an
island core), talking through the in-process transport below instead of gRPC.

The network delivers calls in virtual time.  A call (push, fetch, report) is one
message to the callee, which answers at once by calling the node (``transport.py``),
and one message back.  A ``LinkPolicy`` decides when each message arrives: at once and
in order for a plain run; late, twice, or never for the fault simulation.  A message
to a node that is down, or an answer to a caller that crashed since it asked, is lost.

Clients wait as the daemons do, in virtual time: a call without an answer after
``TIMEOUT`` is sent again; "not now" (``PRECONDITION``) and "not committed yet" are
asked again after ``RETRY``.  Any other refusal of an island's or relay's own call is
a protocol failure and stops the run (``ProtocolFailure``).

Nodes crash where a ``Crash`` is raised (a store's crash hook, between two durable
writes) or when the fault simulation says so between events: their memory is dropped,
their folder kept; ``restart`` rebuilds them from it exactly as a restarted daemon does.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import HypertrainError
from hypertrain.common.fragments import Fragment
from hypertrain.common.roles import IslandState
from hypertrain.common.rounds.island import IslandRounds
from hypertrain.common.rounds.machines import (
    JOIN,
    LEAVE,
    PRECONDITION,
    ArmCutoff,
    Committed,
    Decision,
    Delta,
    Effect,
    MemberRequest,
)
from hypertrain.common.rounds.node import AggregatorNode, RelayNode
from hypertrain.common.rounds.store import (
    FRAGMENT_DIR,
    NodeStore,
    atomic_write,
    load_state,
    no_crash,
    save_state,
)
from hypertrain.common.rounds.store import Crash as CrashHook
from hypertrain.common.rounds.transport import LocalUpstream
from hypertrain.common.schedule import PendingMerge
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import AGGREGATOR_KEY, island_key, relay_key
from hypertrain.common.trust.receipts import Witness

TIMEOUT = 10.0
"""Virtual seconds a caller waits for an answer before it sends the call again."""
RETRY = 1.0
"""Virtual seconds before asking again after "not now" or "not committed yet"."""
R = TypeVar("R")


class Crash(Exception):
    """Raised inside a node where its process dies (a crash point or the simulation)."""


class ProtocolFailure(HypertrainError):
    """A call was refused in a way that no fault excuses: the protocol is broken."""


class LinkPolicy(Protocol):
    """When each message from ``src`` to ``dst`` sent at ``now`` arrives ([]: lost)."""

    def deliveries(self, src: str, dst: str, now: float) -> list[float]: ...


class Immediate:
    """Every message arrives at once, in the order sent."""

    def deliveries(self, src: str, dst: str, now: float) -> list[float]:
        return [now]


class Network:
    """A virtual clock and the events scheduled on it (ties run in the order scheduled)."""

    def __init__(self, policy: LinkPolicy | None = None) -> None:
        self.policy: LinkPolicy = policy or Immediate()
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.trace: Callable[[str], None] | None = None
        """Receives one line per delivered call and answer (the fault simulation's --trace)."""

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._seq), fn))

    def send(self, src: str, dst: str, fn: Callable[[], None]) -> None:
        for t in self.policy.deliveries(src, dst, self.now):
            self.at(t, fn)

    def step(self) -> bool:
        """Run the next event; False when none is left."""
        if not self._heap:
            return False
        self.now, _, fn = heapq.heappop(self._heap)
        self.events += 1
        fn()
        return True

    def call(
        self,
        src: Actor,
        dst: Actor,
        request: Callable[[], R],
        on_reply: Callable[[R], None],
        what: str = "",
    ) -> None:
        """Send ``request`` to ``dst``; its answer back to ``src`` (if both survive)."""
        inc = src.incarnation

        def deliver_request() -> None:
            if self.trace:
                self.trace(
                    f"t={self.now:.2f} {src.name} -> {dst.name} {what}"
                    f"{'' if dst.alive else ' (down: lost)'}"
                )
            if not dst.alive:
                return
            try:
                reply = request()
            except Crash:
                dst.crash()
                return
            self.send(dst.name, src.name, lambda: deliver_reply(reply))

        def deliver_reply(reply: R) -> None:
            if self.trace:
                self.trace(
                    f"t={self.now:.2f} {dst.name} -> {src.name} answer to {what}: {_brief(reply)}"
                )
            if src.alive and src.incarnation == inc:
                try:
                    on_reply(reply)
                except Crash:
                    src.crash()

        self.send(src.name, dst.name, deliver_request)


def _brief(reply: object) -> str:
    if isinstance(reply, Decision):
        return f"{reply.code}{' (duplicate)' if reply.duplicate else ''}: {reply.reason}"
    if isinstance(reply, Committed):
        return f"the {reply.kind} merge of step {reply.sync_step}"
    return "not committed yet" if reply is None else type(reply).__name__


class Observer:
    """What the fault simulation watches (every method is a no-op here)."""

    def pushed(self, node: str, delta: Delta, decision: Decision) -> None: ...

    def committed(self, node: str, effect: Effect) -> None: ...

    def applied(
        self, island: str, kind: str, sync_step: int, base: torch.Tensor, fragment: int = 0
    ) -> None: ...

    def finished(self, island: str, theta: torch.Tensor) -> None: ...

    def crashed(self, name: str) -> None: ...


class Actor:
    """A process of the cluster: it can be down, and each start is a new incarnation."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.net = cluster.net
        self.name = name
        self.alive = True
        self.incarnation = 0

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` after ``delay`` unless this incarnation is gone by then."""
        inc = self.incarnation

        def run() -> None:
            if self.alive and self.incarnation == inc:
                try:
                    fn()
                except Crash:
                    self.crash()

        self.net.at(self.net.now + delay, run)

    def crash(self) -> None:
        """Die: lose everything in memory (the folder stays)."""
        if self.alive:
            self.alive = False
            self._drop()
            self.cluster.observer.crashed(self.name)

    def restart(self) -> None:
        """Start again from the folder (a crash point during recovery kills it again)."""
        if not self.alive:
            self.incarnation += 1
            self.alive = True
            try:
                self._start()
            except Crash:
                self.crash()

    def _drop(self) -> None: ...

    def _start(self) -> None: ...


@dataclass
class _Call:
    """One outstanding client call: sent again on timeout until answered."""

    attempt: int = 0
    busy: bool = False


class _Client(Actor):
    """Calls that retry like the daemons' peers (timeout, "not now", "not yet")."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        super().__init__(cluster, name)
        self.calls: dict[str, _Call] = {}

    def _drop(self) -> None:
        self.calls = {}

    def ask(
        self,
        slot: str,
        dst: Actor,
        request: Callable[[], R],
        on_reply: Callable[[R], bool],
        what: str = "",
    ) -> None:
        """Call ``dst`` until ``on_reply`` returns True (done); False: ask again after RETRY."""
        call = self.calls.setdefault(slot, _Call())
        call.attempt += 1
        call.busy = True
        attempt = call.attempt

        def answered(reply: R) -> None:
            if call.attempt != attempt or not call.busy:
                return  # an answer to an earlier try, or the call is over
            call.attempt += 1  # cancels the pending timeout
            call.busy = False  # over, unless on_reply asks again on this slot (the next merge)
            if not on_reply(reply):
                call.busy = True
                self.later(RETRY, lambda: self.ask(slot, dst, request, on_reply, what))

        def timed_out() -> None:
            if call.attempt == attempt and call.busy:
                self.ask(slot, dst, request, on_reply, what)

        self.net.call(self, dst, request, answered, what)
        self.later(TIMEOUT, timed_out)


def _refused(who: str, what: str, decision: Decision) -> ProtocolFailure:
    return ProtocolFailure(f"{who}: {what} refused ({decision.code}): {decision.reason}")


class IslandActor(_Client):
    """An island: trains, pushes at sync steps, fetches and applies pinned merges."""

    def __init__(
        self,
        cluster: Cluster,
        island_id: str,
        make_core: Callable[[], IslandState],
        key: SigningKey | None,
        state_dir: Path | None,
    ) -> None:
        super().__init__(cluster, island_id)
        self.make_core = make_core
        self.key = key
        self.state_path = state_dir / "island.pt" if state_dir is not None else None
        # Nodes keep tapes only in a folder: without one there is nothing to witness.
        self.witness = Witness(
            state_dir,
            island_key(island_id),
            cluster.cfg.run_id,
            cluster.trusted if state_dir is not None else None,
        )
        region = cluster.cfg.topology.region_of(island_id)
        self.relay_names = [relay_key(m) for m in cluster.shards.members((region,))]
        """The region's relay, or its shards in shard order."""
        split = cluster.cfg.fragments > 1
        self.fragment_relays = [
            [cluster.fragment_name(n, f if split else None) for n in self.relay_names]
            for f in range(cluster.cfg.fragments)
        ]
        """Per streaming fragment, the names of its relay (or shards)."""
        self.sent_bytes = 0
        self.sends = 0
        self.member = island_id in cluster.cfg.membership.initial((island_id,))
        """Is it a member, as far as its relay's last answer said?"""
        self.training: int | None = None
        """The incarnation whose training loop runs (``Cluster.start_training``)."""
        self._start()

    def _start(self) -> None:
        self.core = self.make_core()
        self.rounds = IslandRounds(self.core, self.cluster.cfg.run_id, self.witness)
        if self.state_path is not None and self.state_path.exists():
            self.rounds.load_rejoin_state(load_state(self.state_path))
        self.wake: Callable[[], None] | None = None  # the sleeping training loop, if any
        self.unacked: set[tuple[int, int]] = set()
        """The pushes not acknowledged, as (sync step, index among the step's deltas): with
        streaming fragments an island pushes one fragment's delta while an earlier step's,
        another fragment's, may still be on its way (tau > 0); every one is asked until it
        is answered, and the island fetches once all are."""
        self.parts: dict[int, Committed] = {}  # the merge being fetched, by shard
        self.waiting: list[PendingMerge[int]] = []
        self.sync_next = False  # the last step's sync waits for the merges in ``waiting``
        self.final_wait = False
        self.done = False
        self.healing: tuple[int, str] | None = None  # the merge a join named, being fetched
        self.leaving = False
        self.joining = False  # asking its relay to take it in (``begin``)
        if any(self.rounds.pendings):  # restarted with merges to take (with fragments)
            self.waiting = self.rounds.due()
            self.final_wait = self.rounds.final_due() is not None

    @property
    def ready(self) -> bool:
        """Can train its next step now?"""
        return (
            self.alive
            and not self.done
            and not self.rounds.finished
            and not self.waiting
            and not self.sync_next
            and not self.final_wait
            and not self.joining
            and self.healing is None
            and not self.leaving
        )

    def _member_call(self, change: str) -> None:
        """Ask the region's relay to take this island in (``JOIN``: then fetch the merge
        it names and heal to it) or to let it go (``LEAVE``: then stop, like a daemon that
        got SIGTERM)."""
        if self.cluster.cfg.fragments > 1:
            raise HypertrainError(f"island {self.name}: no joins or leaves with fragments yet")
        relay = self.cluster.relays[self.relay_names[0]]
        request = MemberRequest(
            self.cluster.cfg.run_id, change, self.name, self.core.step, int(self.net.now * 1e9)
        )
        if self.key is not None:
            request = request.signed(self.key.sign(request.message()))

        def on_reply(d: Decision) -> bool:
            if d.code == PRECONDITION:
                return False
            if not d.accepted and d.over:
                self.stop()  # too late: the run ended (or ends before it could join)
                return True
            if not d.accepted:
                raise _refused(self.name, change, d)
            if change == LEAVE:
                self.member = False
                self.stop()  # its folder stays; started again, it joins again
                return True
            self.member, self.joining = True, False
            start = self.rounds.join_from(d.start)
            if start is not None:
                self.waiting = []
                self.healing = start
                self._fetch(*start)
            else:
                self._next()
            return True

        self.ask("member", relay, lambda: relay.endpoint.member(request), on_reply, change)

    def stop(self) -> None:
        """Stop for good, as a daemon does after a leave (not a crash: nobody restarts it);
        the run is complete without it."""
        self.alive = False
        self._drop()
        self.cluster.gone.add(self.name)

    def begin(self) -> None:
        """Its training loop starts: like the island daemon, it first asks its relay to
        take it in (a member is told so; any other island joins and heals to the merge
        the relay names).  Lockstep runs (``step_together``) skip this: their islands are
        all members throughout."""
        if self.cluster.cfg.fragments > 1:  # every island is a member throughout
            self._next()  # a restarted island first takes the merges it waited for
            return
        if not self.joining:
            self.joining = True
            self.cluster.gone.discard(self.name)  # started again after a leave
            self._member_call(JOIN)

    def leave(self) -> None:
        """Announce a leave once the push in flight is acknowledged (SIGTERM to a daemon)."""
        if not self.alive or self.done or not self.member:
            return
        self.leaving = True
        if self.unacked or self.joining:
            self.later(RETRY, self.leave)
            return
        self._member_call(LEAVE)

    def train(self) -> float:
        return self.core.train_step()

    def after_train(self) -> None:
        """After an inner step: push at a sync step, then ask for the merges now due (at
        the last step, first the merges still pending: ``IslandRounds.before_sync``)."""
        first = self.rounds.before_sync()
        if first:
            self.waiting, self.sync_next = first, True
            self._next()
            return
        self._sync()

    def _sync(self) -> None:
        deltas = self.rounds.after_step()
        if deltas:
            self.sends += 1
            self.unacked |= {(deltas[0].sync_step, i) for i in range(len(deltas))}
        for i, delta in enumerate(deltas):
            if self.key is not None:
                delta = delta.signed(self.key.sign(delta.transfer_message()))
            self.sent_bytes += len(delta.data)
            names = self.fragment_relays[delta.fragment or 0]
            self._push(i, names[i % len(names)], delta)
        self.waiting = self.rounds.due()
        self.final_wait = self.rounds.final_due() is not None
        self._next()

    def _push(self, shard: int, name: str, delta: Delta) -> None:
        """Push ``delta`` to relay ``name`` (``shard``: its index among this step's pushes)."""
        relay = self.cluster.relays[name]
        slot = f"push{delta.sync_step}.{shard}"  # its own: a later push does not cancel it

        def on_reply(d: Decision) -> bool:
            # Stale: the step closed without this island at its cutoff; like the daemon,
            # it takes the step's merge instead (its delta is not aggregated).
            if d.accepted or d.stale:
                self.calls.pop(slot, None)  # answered: the slot is not asked on again
                self.unacked.discard((delta.sync_step, shard))
                if not self.unacked:
                    self._next()
                return True
            if d.code == PRECONDITION:
                return False
            raise _refused(self.name, f"push of step {delta.sync_step}", d)

        self.ask(
            slot,
            relay,
            lambda: relay.endpoint.push(delta),
            on_reply,
            f"push {delta.sync_step}",
        )

    def _next(self) -> None:
        """Fetch the first merge waited for, once this island's own push is acknowledged;
        with nothing left to wait for, wake the training loop (``wake``) if it sleeps."""
        if self.ready and self.wake is not None:
            wake, self.wake = self.wake, None
            wake()
        if self.unacked:  # its own pushes first
            return
        if self.rounds.finished and self.rounds.stops_early and not self.done:
            self.rounds.stop()  # its last delta is in: an anneal does not keep it
            self._finished()
            return
        if self.waiting:
            head = self.waiting[0]
            self._fetch(head.sync_step, head.kind, head.item)
        elif self.sync_next:
            self.sync_next = False
            self._sync()
        elif self.final_wait:
            final = self.rounds.final_due()
            assert final is not None
            self._fetch(final.sync_step, "global", final.item)

    def _fetch(self, step: int, kind: str, fragment: int = 0) -> None:
        """Fetch the merge of ``step`` (of ``fragment``) from every relay shard; apply it
        once all are in."""
        self.parts = {}
        names = self.fragment_relays[fragment]
        for shard, name in enumerate(names):
            self._fetch_part(shard, name, step, kind, fragment, len(names))

    def _fetch_part(
        self, shard: int, name: str, step: int, kind: str, fragment: int, count: int
    ) -> None:
        relay = self.cluster.relays[name]

        def on_reply(got: Committed | Decision | None) -> bool:
            if got is None:
                return False
            if isinstance(got, Decision):
                raise _refused(self.name, f"fetch of step {step}", got)
            if got.sync_step >= step:  # the merge asked for, or a newer global one
                self.parts[shard] = got
            if len(self.parts) == count:
                parts, self.parts = [self.parts[i] for i in range(count)], {}
                if len({(p.sync_step, p.kind) for p in parts}) > 1:
                    # Shards answered different merges (one already holds a newer round
                    # only): ask them all again a little later.
                    self.later(RETRY, lambda: self._fetch(step, kind, fragment))
                elif parts[0].sync_step != step or self.healing is not None:
                    self.healing = None
                    self._healed(parts[0], self.rounds.join(parts, fragment=fragment), fragment)
                else:
                    self._merged(parts[0], self.rounds.join(parts, fragment=fragment))
            return True

        self.ask(
            f"fetch{shard}",
            relay,
            lambda: relay.endpoint.fetch(self.name, step, kind),
            on_reply,
            f"fetch {kind} {step}",
        )

    def _merged(self, merge: Committed, payload: torch.Tensor) -> None:
        obs = self.cluster.observer
        if self.final_wait and not self.waiting:
            if not self.rounds.finish(payload):  # more fragments' final states to fetch
                self._next()
                return
            self.final_wait = False
            self._finished()
            return
        pm = self.waiting.pop(0)
        self.rounds.apply(pm, payload)
        obs.applied(self.name, pm.kind, pm.sync_step, self.core.base, pm.item)
        if pm.kind == "global" and not self.sync_next:  # not before the last step's sync
            self._save()
        self._next()

    def _healed(self, merge: Committed, payload: torch.Tensor, fragment: int = 0) -> None:
        """Left behind (the relay answered with a newer global merge), or joining (the
        merge its join named): rejoin from it."""
        obs = self.cluster.observer
        self.waiting = []
        self.final_wait = False
        self.rounds.heal(merge.sync_step, payload)
        obs.applied(self.name, merge.kind, merge.sync_step, self.core.base, fragment)
        if self.rounds.finished:  # it rejoined at the run's end: the final merge
            self._finished()
            return
        self._save()
        self._next()

    def _finished(self) -> None:
        """Its work is over.  Holding the run's final state, it reports that to each of
        its relays (every shard, every fragment's), as the island daemon does: a relay's
        work ends once every member of the last step has (``RelayNode.applied``).  An
        island an ``islands:K`` anneal stopped is no member at the end: no report."""
        self.done = True
        self.cluster.observer.finished(self.name, self.core.params())
        if self.rounds.stops_early:
            return
        for name in dict.fromkeys(n for names in self.fragment_relays for n in names):
            self._report_final(name)

    def _report_final(self, name: str) -> None:
        relay, steps, slot = self.cluster.relays[name], self.cluster.cfg.steps, f"report.{name}"

        def reported(d: Decision | None) -> bool:
            if d is None:
                self.calls.pop(slot, None)  # answered: the slot is not asked on again
                return True
            if d.code == PRECONDITION:
                return False
            raise _refused(self.name, "report of the final state", d)

        def request() -> Decision | None:  # the relay's endpoint now (it may restart)
            return relay.endpoint.report_applied(self.name, steps)

        self.ask(slot, relay, request, reported, f"report {steps}")

    def _save(self) -> None:
        """After a global merge: the state this island rejoins from after a crash (with
        fragments, and the merges it still waits for)."""
        if self.state_path is not None:
            state = self.rounds.rejoin_state(self.waiting)
            atomic_write(self.state_path, save_state(state), sync=False)


class RelayActor(_Client):
    """A relay: serves its islands, forwards to the aggregator, applies global updates."""

    def __init__(
        self,
        cluster: Cluster,
        region: str,
        theta0: torch.Tensor,
        folder: Path | None,
        key: SigningKey | None,
        shard: int = 0,
        fragment: Fragment | None = None,
    ) -> None:
        """``fragment``: the streaming fragment it serves (None: the run is not split)."""
        member = cluster.shards.member(region, shard)
        super().__init__(cluster, cluster.fragment_name(relay_key(member), fragment))
        self.region, self.shard, self.member = region, shard, member
        self.fragment = fragment
        start, end = cluster.shards.bounds(shard)
        self.theta0 = theta0[start:end] if cluster.shards.sharded else theta0
        if fragment is not None:
            self.theta0 = theta0[fragment.lo : fragment.hi]
        self.folder = folder
        self.key = key
        self.final_reported = False
        self._start()

    def _start(self) -> None:
        c = self.cluster
        store = c.store(self.folder, self.key, self.name) if self.folder is not None else None
        self.node = RelayNode(
            c.cfg,
            self.region,
            self.theta0,
            store,
            c.trusted,
            self.shard,
            c.theta0.numel() if self.fragment is None else None,
            fragment=None if self.fragment is None else self.fragment.index,
        )
        self.endpoint = _Served(self, self.node)
        self.forwarding = False
        self.node.recover()
        self.endpoint.rearm()
        self.kick()

    def _drop(self) -> None:
        super()._drop()
        if self.node.store is not None and self.node.store.tape is not None:
            self.node.store.tape.close()  # the process is gone: no closing checkpoint

    def kick(self) -> None:
        """Forward the region's delta if one waits for its global update; in a region
        nobody is a member of, follow the global rounds instead."""
        fwd = self.node.outbox
        if fwd is None and not self.forwarding and self.node.machine.idle:
            if self.cluster.lockstep and not self.follows_now():
                return  # lockstep: kicked again once the aggregator has the merge
            self.forwarding = True
            self._fetch_global(self.node.machine.follow_step, follow=True)
            return
        if fwd is None or self.forwarding:
            reporting = "report" in self.calls and self.calls["report"].busy
            if self.node.done and not (self.final_reported or self.forwarding or reporting):
                self._report_final()
            return
        self.forwarding = True
        agg = self.aggregator
        delta = self.node.forward_delta(fwd, self.key)

        def pushed(d: Decision) -> bool:
            if d.accepted or d.stale:  # stale: the round went ahead without this region
                self._fetch_global(fwd.sync_step)
                return True
            if d.code == PRECONDITION:
                return False
            raise _refused(self.name, f"forward of step {fwd.sync_step}", d)

        self.ask("forward", agg, lambda: agg.endpoint.push(delta), pushed, f"push {fwd.sync_step}")

    def follows_now(self) -> bool:
        """Idle (no member left in the region), with the aggregator's merge of the step it
        follows committed: a follow fetch now is answered at once.  In lockstep the relay
        fetches only then (``Cluster.step_together``): a fetch that waits keeps polling, and
        the network never goes quiet between two steps."""
        machine = self.node.machine
        merge = self.aggregator.node.machine.merge_for(machine.follow_step)
        return machine.idle and merge is not None

    @property
    def aggregator(self) -> AggregatorActor:
        """The aggregator (of this relay's fragment)."""
        return self.cluster.aggregators[0 if self.fragment is None else self.fragment.index]

    def _fetch_global(self, step: int, follow: bool = False) -> None:
        agg = self.aggregator

        def fetched(got: Committed | Decision | None) -> bool:
            if follow and not self.node.machine.idle:  # an island joined meanwhile
                self.forwarding = False
                self.later(0.0, self.kick)
                return True
            if got is None:
                return False
            if isinstance(got, Decision):
                raise _refused(self.name, f"fetch of the global merge of step {step}", got)
            # A newer round than the forwarded one: the region was left behind; the
            # machine rejoins it there.
            self.node.on_global(got)
            self.forwarding = False
            # After this reply is done with: the next call may use the same slot.
            self.later(0.0, self.kick)
            return True

        self.ask(
            "global",
            agg,
            lambda: agg.endpoint.fetch(self.member, step, "global"),
            fetched,
            f"fetch global {step}",
        )

    def _report_final(self) -> None:
        agg = self.aggregator
        steps = self.cluster.cfg.steps

        def reported(d: Decision | None) -> bool:
            if d is None:
                self.final_reported = True
                return True
            if d.code == PRECONDITION:
                return False
            raise _refused(self.name, "report of the final state", d)

        self.ask(
            "report",
            agg,
            lambda: agg.endpoint.report_applied(self.member, steps),
            reported,
            f"report {steps}",
        )


class AggregatorActor(Actor):
    """The aggregator: serves the relays."""

    def __init__(
        self,
        cluster: Cluster,
        theta0: torch.Tensor,
        folder: Path | None,
        key: SigningKey | None,
        fragment: Fragment | None = None,
    ) -> None:
        """``fragment``: the streaming fragment it serves (None: the run is not split)."""
        super().__init__(cluster, cluster.fragment_name("aggregator", fragment))
        self.fragment = fragment
        self.theta0 = theta0 if fragment is None else theta0[fragment.lo : fragment.hi]
        self.folder = folder
        self.key = key
        self._start()

    def _start(self) -> None:
        c = self.cluster
        store = c.store(self.folder, self.key, self.name) if self.folder is not None else None
        fragment = None if self.fragment is None else self.fragment.index
        self.node = AggregatorNode(c.cfg, self.theta0, store, c.trusted, fragment=fragment)
        self.endpoint = _Served(self, self.node)
        self.node.recover()
        self.endpoint.rearm()
        self.warm()

    def warm(self) -> None:
        """Hold the next outer step's memory ready, as the daemon's warm-up does between
        rounds (``GlobalCore.warm``), so that here too (the in-process cluster, the fault
        simulation) the forwards are summed as they come (``GlobalCore.offer``)."""
        m = self.node.machine
        if not m.done:
            m.core.warm()

    def _drop(self) -> None:
        if self.node.store is not None and self.node.store.tape is not None:
            self.node.store.tape.close()


class _Served(LocalUpstream):
    """A node's endpoint as the network delivers calls to it: the observer sees each
    decision, a relay forwards what completes a global step, the final fetch is counted."""

    def __init__(self, actor: RelayActor | AggregatorActor, node: RelayNode | AggregatorNode):
        super().__init__(node)
        self.actor = actor

    def push(self, delta: Delta) -> Decision:
        decision, effects = self.node.push(delta)
        obs = self.actor.cluster.observer
        obs.pushed(self.actor.name, delta, decision)
        if decision.accepted and not decision.duplicate:
            self._effects(effects)
        if isinstance(self.actor, RelayActor):
            self.actor.kick()
        else:
            self.actor.warm()  # (after a step: its new theta took the spare)
        return decision

    def member(self, request: MemberRequest) -> Decision:
        """A join or leave: the observer sees what it completed (a leave may commit the
        open step), and a relay forwards what completes a global step."""
        assert isinstance(self.node, RelayNode) and isinstance(self.actor, RelayActor)
        decision, effects = self.node.on_member(request)
        if decision.accepted and not decision.duplicate:
            self._effects(effects)
        self.actor.kick()
        return decision

    def _effects(self, effects: list[Effect]) -> None:
        obs = self.actor.cluster.observer
        for e in effects:
            if isinstance(e, ArmCutoff):  # the cutoff clock, in virtual time
                self.actor.later(e.seconds, functools.partial(self.cutoff, e.sync_step))
            else:
                obs.committed(self.actor.name, e)

    def cutoff(self, step: int) -> None:
        """The cutoff of ``step`` (this incarnation's clock): the node decides and tapes."""
        decision, effects = self.node.cutoff(step)
        if decision.accepted and not decision.duplicate:
            self._effects(effects)
        if isinstance(self.actor, RelayActor):
            self.actor.kick()

    def rearm(self) -> None:
        """After a (re)start: the clock of an open step that replayed deliveries."""
        arm = self.node.machine.level.armed()
        if arm is not None:
            self._effects([arm])

    def fetch(
        self,
        requester: str,
        sync_step: int,
        kind: str,
        out: torch.Tensor | None = None,
        tap: Any = None,
    ) -> Committed | Decision | None:
        got = super().fetch(requester, sync_step, kind)
        if isinstance(got, Committed) and got.kind == "regional" and got.payload.numel():
            # The answer travels as bytes would: a relay's regional payload is its live
            # base, which its next merge moves, possibly before a late answer arrives.
            got = dataclasses.replace(got, payload=got.payload.clone())
        return got


@dataclass
class Cluster:
    """Every node and island of one run in this process (see the module docstring)."""

    cfg: RunConfig
    theta0: torch.Tensor
    make_core: Callable[[str], IslandState]
    run_dir: Path | None = None
    """Folders and tapes go here (None: everything in memory, no tape)."""
    keys: dict[str, SigningKey] = field(default_factory=dict)
    trusted: TrustedKeys | None = None
    policy: LinkPolicy | None = None
    observer: Observer = field(default_factory=Observer)
    crash_hook: Callable[[str], CrashHook] = field(default=lambda name: no_crash)
    """For each node name, the crash hook its store calls (the fault simulation's)."""
    gone: set[str] = field(default_factory=set)
    """Islands that left for good: the run is complete without them."""
    lockstep: bool = False
    """Driven by ``step_together``: idle relays fetch only merges already committed."""
    fragments: list[Fragment] | None = None
    """The run's streaming fragments (``fragments.run_fragments``); needed when
    ``cfg.fragments`` > 1: then every relay and the aggregator run once per fragment
    (``fragment_name``), each on its range and schedule, in a folder of its own."""
    keep_rounds: int = 0
    """The global rounds whose checkpoints and inputs each node keeps (``NodeStore.prune``,
    the daemons' ``--keep-rounds``; 0: all)."""

    def __post_init__(self) -> None:
        topo = self.cfg.topology
        self.net = Network(self.policy)
        self.shards = self.cfg.shards(self.theta0.numel())
        d = self.run_dir
        split: list[Fragment | None] = [None]
        if self.cfg.fragments > 1:
            if self.fragments is None or len(self.fragments) != self.cfg.fragments:
                raise HypertrainError(
                    f"cluster: a run with {self.cfg.fragments} fragments needs their ranges"
                )
            split = list(self.fragments)

        def folder(name: str, f: Fragment | None) -> Path | None:
            if d is None:
                return None
            return d / name if f is None else d / name / f"{FRAGMENT_DIR}-{f.index}"

        self.aggregators = [
            AggregatorActor(
                self, self.theta0, folder("aggregator", f), self.keys.get(AGGREGATOR_KEY), f
            )
            for f in split
        ]
        self.aggregator = self.aggregators[0]
        """The aggregator (of fragment 0 when the run is split)."""
        self.relays = {
            self.fragment_name(relay_key(m), f): RelayActor(
                self,
                r,
                self.theta0,
                folder(relay_key(m), f),
                self.keys.get(relay_key(m)),
                i,
                f,
            )
            for f in split
            for r in sorted(topo.regions)
            for i in range(self.shards.count)
            for m in [self.shards.member(r, i)]
        }
        self.islands = {
            i: IslandActor(
                self,
                i,
                lambda i=i: self.make_core(i),  # type: ignore[misc]
                self.keys.get(island_key(i)),
                d / f"island-{i}" if d else None,
            )
            for i in topo.island_ids()
        }

    @staticmethod
    def fragment_name(name: str, fragment: Fragment | int | None) -> str:
        """The name of node ``name``'s part that serves ``fragment`` (itself for None)."""
        if fragment is None:
            return name
        index = fragment if isinstance(fragment, int) else fragment.index
        return f"{name}.f{index}"

    def store(self, folder: Path, key: SigningKey | None, name: str) -> NodeStore:
        return NodeStore(
            folder,
            self.cfg.run_id,
            key,
            sync=False,
            crash=self.crash_hook(name),
            keep_rounds=self.keep_rounds,
        )

    @property
    def actors(self) -> dict[str, Actor]:
        out: dict[str, Actor] = {a.name: a for a in self.aggregators}
        out.update(self.relays)
        out.update(self.islands)
        return out

    @property
    def complete(self) -> bool:
        """Every island (but those gone) holds the final state and reported it to its
        relays, and every relay reported it to the aggregator: each node's work is over."""
        return (
            all(i.done for n, i in self.islands.items() if n not in self.gone)
            and all(a.alive and a.node.all_final() for a in self.aggregators)
            and all(r.alive and r.node.all_final() for r in self.relays.values())
        )

    def start_training(self, island: IslandActor, step_time: float) -> None:
        """Let ``island`` train one step every ``step_time`` virtual seconds whenever it is
        not waiting (this incarnation: a crash ends the loop; call again after a restart).
        One loop per incarnation: a second start of the same one is refused, as a second
        daemon on the same folder would be."""
        if not island.alive:
            raise HypertrainError(f"island {island.name} is down: restart it first")
        if island.training == island.incarnation:
            raise HypertrainError(
                f"island {island.name} already trains (incarnation {island.incarnation})"
            )
        island.training = island.incarnation
        island.begin()

        def run() -> None:
            if not island.ready:  # waiting for a merge: sleep until it is applied
                if not island.done:
                    island.wake = lambda: island.later(step_time, run)
                return
            if self.net.trace:
                self.net.trace(
                    f"t={self.net.now:.2f} {island.name} trains step {island.core.step + 1}"
                )
            island.train()
            island.after_train()
            if not island.done:
                island.later(step_time, run)

        island.later(step_time, run)

    def drive(self, max_events: int, after_event: Callable[[], None] = lambda: None) -> int:
        """Run events until the cluster is complete; returns the events run.  Raises
        ProtocolFailure when nothing is left to happen or ``max_events`` pass first."""
        n = 0
        while not self.complete:
            if not self.net.step():
                raise ProtocolFailure(
                    f"stuck: nothing left to happen at t={self.net.now:.1f}: {describe(self)}"
                )
            n += 1
            after_event()
            if n > max_events:
                raise ProtocolFailure(
                    f"stuck: not done after {max_events} events: {describe(self)}"
                )
        return n

    def step_together(self, losses: list[float] | None = None) -> None:
        """Lockstep: every island does its next step (if ``losses`` is None, trained here;
        else already trained, their losses given), then pushes, then the network runs until
        every merge pinned to this step has been applied.  ProtocolFailure if one cannot."""
        self.lockstep = True
        islands = self.training()
        if losses is None:
            for i in islands:
                i.train()
        for i in islands:
            i.after_train()
        self.run_until_quiet()
        while following := [
            r for r in self.relays.values() if r.alive and not r.forwarding and r.follows_now()
        ]:  # relays with no member left follow the global rounds they did not forward to
            for r in following:
                r.kick()
            self.run_until_quiet()
        stuck = [i.name for i in islands if not (i.ready or i.done)]
        if stuck:
            raise ProtocolFailure(f"islands {stuck} still wait at step {islands[0].core.step}")

    def training(self) -> list[IslandActor]:
        """The islands still training (an ``islands:K`` anneal stops the others)."""
        return [i for i in self.islands.values() if not i.done]

    def run_lockstep(self) -> torch.Tensor:
        """The whole run in lockstep, fault-free; returns the final global parameters."""
        if self.cfg.membership.standby:
            raise HypertrainError(
                "islands on standby join while the run goes on: run it event by event "
                "(start_training and drive), not in lockstep"
            )
        for _ in range(self.cfg.steps):
            self.step_together()
        return self.final_theta()

    def run_until_quiet(self, limit: int = 1_000_000) -> None:
        for _ in range(limit):
            if not self.net.step():
                return
        raise ProtocolFailure(f"the network did not go quiet after {limit} events")

    def final_theta(self) -> torch.Tensor:
        """The final global parameters (joined from every fragment's aggregator)."""
        parts = []
        for a in self.aggregators:
            merge = a.node.machine.merge_for(self.cfg.steps)
            if merge is None:
                raise ProtocolFailure(f"the run ended without {a.name}'s final global merge")
            parts.append(merge.payload)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def lawa_average(self) -> torch.Tensor | None:
        """The LAWA average (RunConfig.lawa) each fragment's aggregator published, joined;
        None while any has not."""
        parts = [a.node.averaged for a in self.aggregators]
        if any(p is None for p in parts):
            return None
        payloads = [p.payload for p in parts if p is not None]
        return payloads[0] if len(payloads) == 1 else torch.cat(payloads)

    def global_theta(self) -> torch.Tensor:
        """The newest global parameters, joined from every fragment's aggregator (each
        fragment's state after its last global merge)."""
        parts = [a.node.machine.core.theta for a in self.aggregators]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def describe(cluster: Cluster) -> dict[str, Any]:
    """Where each actor stands (for traces and failure messages)."""
    out: dict[str, Any] = {}
    for name, a in cluster.actors.items():
        if isinstance(a, IslandActor):
            out[name] = {"alive": a.alive, "step": a.core.step, "done": a.done}
        elif isinstance(a, RelayActor | AggregatorActor):
            out[name] = {"alive": a.alive, "open": a.node.machine.level.open_step}
    return out
