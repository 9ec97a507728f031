"""Servicer plumbing shared by the relay and the aggregator: the server half of the
gRPC transport, in front of a node (common/rounds/node.py).

- :class:`Intake`: receive one pushed delta (chunked, digest-checked, spooled), hand it
  to the node (which decides, publishes, tapes), and answer with a PushAck or the
  decision's status.  A transfer refused before it is a delta (bad framing, too large,
  corrupt) is only counted (``hypertrain_refusals_untaped_total``), never taped: it
  comes from nobody known (``RelayNode.tapes_refusal`` says what a node tapes).
- :class:`MergeBoard`: the lock every node call runs under, the condition blocked
  fetches wait on, and who has downloaded each merge (``serve``): a node writes a round's
  checkpoint once every member has it (``CHECKPOINT_HOLD_S``).
- The cutoff clock (in ``Intake``): when the node's machine asks for one (an
  ``ArmCutoff`` effect: the first delivery of a step, at a level with a cutoff), a timer
  raises ``node.cutoff(step)`` that many seconds later, under the same lock; the node
  tapes it and commits if the quorum delivered.  A step that completed first ignores it.

Everything after the transfer runs under the board's lock, so a node sees one call at a
time, exactly as the in-process transport delivers them.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import tensor_digest
from hypertrain.common.rounds.machines import (
    JOIN,
    LEAVE,
    ArmCutoff,
    Committed,
    Cut,
    Decision,
    Delta,
    Effect,
    MemberRequest,
    Membership,
    Publish,
)
from hypertrain.common.rounds.node import AggregatorNode, RelayNode
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire import spool
from hypertrain.wire.chunks import discard, merge_chunks, publish, receive_delta
from hypertrain.wire.daemon import durable_or_die, fault_point, log_event
from hypertrain.wire.errors import WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.options import trim_heap
from hypertrain.wire.protocol_codes import STATUS
from hypertrain.wire.server import Shutdown

T = TypeVar("T")
WAIT_SLICE_S = 0.5
#: The longest a fetch is held waiting for its merge; then it is answered
#: DEADLINE_EXCEEDED ("not committed yet") and the caller asks again.  Short, so a
#: waiting caller gets to check whether it was asked to stop, and the caller's own
#: deadline is left for the download.
HOLD_S = 2.0
#: The longest a relay or the aggregator holds back a round's checkpoint for its members
#: to download the round's merge first (``MergeBoard.wait_served``, ``NodeStore.hold_s``).
#: Writing a model-sized state is CPU work (its bytes copied into the page cache) that
#: took the cores from serving the merge on a small host; the round is durable by its
#: tape entry before the merge is served, so the checkpoint only shortens a restart.  A
#: member that never fetches (dead) delays it this long, and the next push settles it
#: first in any case.
CHECKPOINT_HOLD_S = 10.0


def merge_header(cfg: RunConfig, merge: Committed, fragment: int | None = None) -> pb.MergeHeader:
    """The wire header of ``merge`` (of streaming ``fragment``, when the run is split)."""
    return pb.MergeHeader(
        run_id=cfg.run_id,
        round=merge.round,
        sync_step=merge.sync_step,
        merge_step=merge.merge_step,
        kind=merge.kind,
        digest=merge.payload_digest or tensor_digest(merge.payload),
        numel=merge.payload.numel(),
        commitment=json.dumps(merge.commitment.to_dict(), sort_keys=True, separators=(",", ":")),
        members=list(merge.commitment.members),
        receipts=list(merge.receipts),
        **({} if fragment is None else {"fragment": fragment}),
    )


def log_cutoff(role: str, cut: Cut, since_first_s: float | None, **where: object) -> None:
    """The log line of a cutoff: who had delivered, who had not, the quorum, and how long
    after the step's first delivery it came (None: the clock was started by a restart)."""
    rec = cut.record
    log_event(
        "cutoff",
        role=role,
        **where,
        round=rec.round,
        step=rec.sync_step,
        present=",".join(rec.present),
        absent=",".join(rec.absent),
        quorum=rec.quorum,
        waiting=cut.waiting,
        **({} if since_first_s is None else {"since_first_s": round(since_first_s, 3)}),
    )


def refusal(decision: Decision) -> WireError:
    """The status a refused call is answered with."""
    return WireError(
        STATUS[decision.code], decision.reason, stale=decision.stale, over=decision.over
    )


class MergeBoard:
    """The lock around a node, wire headers of its merges, and a condition to wait on."""

    def __init__(self, cfg: RunConfig, shutdown: Shutdown, fragment: int | None = None) -> None:
        """``fragment``: the streaming fragment whose node it guards (None: not split)."""
        self.cfg = cfg
        self.shutdown = shutdown
        self.fragment = fragment
        self.cond = threading.Condition()
        self.headers: dict[tuple[int, str, int, int], pb.MergeHeader] = {}
        self._headers_lock = threading.Lock()  # header() is called outside ``cond``
        self.served: dict[tuple[int, str], set[str]] = {}
        """(sync step, kind) -> who downloaded that merge to its last byte (the two
        newest such keys)."""

    def wait(
        self,
        fetch: Callable[[int], T | Decision | None],
        sync_step: int,
        context: grpc.ServicerContext,
    ) -> T:
        """Block (under ``cond``) until ``fetch(sync_step)`` has the merge (or whatever
        else it answers that is not a refusal); abort if the call ends, the daemon stops,
        or the node refuses."""
        until = time.monotonic() + HOLD_S
        with self.cond:
            while True:
                got = fetch(sync_step)
                if isinstance(got, Decision):
                    raise refusal(got)
                if got is not None:
                    return got
                if self.shutdown.requested:
                    raise WireError(grpc.StatusCode.UNAVAILABLE, "shutting down")
                if not context.is_active():
                    raise WireError(grpc.StatusCode.CANCELLED, "caller went away")
                left = until - time.monotonic()
                if left <= 0:
                    raise WireError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the merge of sync step {sync_step} is not committed yet; ask again",
                    )
                self.cond.wait(min(WAIT_SLICE_S, left))

    def header(self, merge: Committed) -> pb.MergeHeader:
        """The wire header of ``merge`` (its payload's digest computed once, outside any
        lock; concurrent fetches of a merge not cached yet may both compute it).  Only the
        headers of the two newest sync steps are kept: every relay shard's part of a round
        has its own."""
        # A relay shard's part of a global merge is a view of its own range of it.
        key = (merge.sync_step, merge.kind, merge.payload.data_ptr(), merge.payload.numel())
        with self._headers_lock:
            h = self.headers.get(key)
        if h is None:
            h = merge_header(self.cfg, merge, self.fragment)
            with self._headers_lock:
                self.headers[key] = h
                steps = sorted({k[0] for k in self.headers})
                for old in [k for k in self.headers if k[0] not in steps[-2:]]:
                    del self.headers[old]
        return h

    def serve(
        self,
        merge: Committed,
        requester: str,
        members: tuple[str, ...] = (),
        when_all: Callable[[], None] | None = None,
    ) -> Iterator[Any]:
        """The parts of ``merge`` for ``requester``; once its last part was taken, note
        that ``requester`` has it and, when every one of ``members`` has it, call
        ``when_all`` (under ``cond``).  A download cut short counts for nothing."""
        parts = merge_chunks(self.header(merge), merge.payload)
        yield next(parts)
        fault_point("merge_header_served")  # crash tests: a download cut after its header
        yield from parts
        with self.cond:
            self.note_served(merge, requester, members, when_all)

    def note_served(
        self,
        merge: Committed,
        requester: str,
        members: tuple[str, ...] = (),
        when_all: Callable[[], None] | None = None,
    ) -> None:
        """(under ``cond``) ``requester`` has ``merge`` to its last byte (``serve``)."""
        got = self.served.setdefault((merge.sync_step, merge.kind), set())
        got.add(requester)
        for old in sorted(self.served)[:-2]:
            del self.served[old]
        if when_all is not None and set(members) <= got:
            when_all()
        self.cond.notify_all()

    def wait_served(
        self, sync_step: int, kind: str, members: tuple[str, ...], stop: Callable[[], bool]
    ) -> bool:
        """Wait until every one of ``members`` has downloaded the merge (``serve``), at
        most ``CHECKPOINT_HOLD_S`` and not once ``stop()`` or a shutdown is asked for;
        True if they all have it."""
        want = set(members)
        until = time.monotonic() + CHECKPOINT_HOLD_S
        with self.cond:
            while not want <= self.served.get((sync_step, kind), set()):
                left = until - time.monotonic()
                if left <= 0 or stop() or self.shutdown.requested:
                    return False
                self.cond.wait(min(WAIT_SLICE_S, left))
            return True

    def check_final(self, node: RelayNode | AggregatorNode, reason: str) -> None:
        """Ask to shut down with ``reason`` once every member has the final merge."""
        with self.cond:
            if node.done and node.all_final():
                self.shutdown.request(reason)


class Intake:
    """Receives pushed deltas into the node's spool and hands them to the node."""

    def __init__(
        self,
        node: RelayNode | AggregatorNode,
        board: MergeBoard,
        metrics: Metrics,
        region: str = "",
        on_effect: Callable[[Effect], None] = lambda e: None,
        after_cutoff: Callable[[], None] = lambda: None,
        where: dict[str, object] | None = None,
    ) -> None:
        """``region``: the relay's region ("" at the aggregator), a metrics label.
        ``on_effect``: told each effect a push or a cutoff made durable (under the lock);
        ``after_cutoff``: called after a cutoff event was handled (outside the lock)."""
        self.node = node
        self.on_effect = on_effect
        self.after_cutoff = after_cutoff
        self.timers: dict[int, threading.Timer] = {}
        self.where = where or {}
        """What log lines say of this daemon besides its role (region, shard)."""
        self.armed_at: dict[int, float] = {}  # sync step -> when its clock started
        self.cut_at: dict[int, float] = {}  # sync step -> when its cutoff was taken
        self._closed = False
        store = node.store
        self.spool = store.spool if store is not None else None
        self.published = store.published if store is not None else None
        if store is not None:
            spool.remove_stale(store.spool)  # transfers cut off by a crash were never accepted
        self.max_size = node.max_delta_bytes
        self._sizes: dict[str, tuple[int, int]] = {}  # sender -> (step, bytes) last taken
        self._warming = threading.Lock()  # one warm-up at a time; a close waits for it
        self.board = board
        self.metrics = metrics
        self.labels = (metrics.role, region)
        metrics.untaped.labels(*self.labels)  # exported at 0 from the start
        self.level = "regional" if metrics.role == "relay" else "global"

    def _taped(self, effect: Effect) -> None:
        if self.node.store is not None and self.node.store.tape is not None:
            self.metrics.tape_entries.labels(*self.labels).inc()
            cp = self.node.store.tape.last_checkpoint
            if cp is not None:
                self.metrics.tape_checkpoint.labels(*self.labels).set(cp.size)

    def push(
        self,
        chunks: Iterator[Any],
        admit: Callable[[pb.TransferHeader], None] = lambda header: None,
    ) -> pb.PushAck:
        """Receive a delta and hand it to the node; ``admit`` may refuse it on its header
        (``receive_delta``)."""
        try:
            # The spool file's fsync overlaps the node's decoding and merge; the publisher
            # waits for it before the delta is linked into place and taped.
            rx = receive_delta(
                chunks, max_size=self.max_size, spool_dir=self.spool, admit=admit, wait=False
            )
        except WireError as e:  # not a delta yet, from nobody known: counted, not taped
            self.metrics.rejected.labels(*self.labels, e.code.name.lower()).inc()
            self.metrics.untaped.labels(*self.labels).inc()
            raise
        h = rx.header
        delta = Delta(
            h.run_id,
            h.round,
            h.sync_step,
            h.sender,
            rx.digest,
            h.codec,
            rx.data,
            h.signature,
            shard=h.shard,
            fragment=h.fragment if h.HasField("fragment") else None,
        )
        published = self.published

        def publisher(d: Delta) -> None:
            assert published is not None
            publish(rx, published)

        stopping, taped = False, False
        with self.board.cond:
            if self._closed:
                stopping = True
            else:
                t0 = time.perf_counter()
                # A store failure here (a spool fsync, the tape, a published file, a
                # checkpoint) leaves the live state ahead of the tape: nothing more may be
                # taped or served, so the process ends, as a kill at this line would end
                # it, and a restart recovers from the tape.
                with durable_or_die(
                    self.metrics.role, f"push from {h.sender} for step {h.sync_step}", **self.where
                ):
                    decision, effects = self.node.push(delta, publisher)
                if decision.accepted and not decision.duplicate:
                    self._handle(effects, t0)
                    self.board.cond.notify_all()
                taped = self.node.refusal_taped
        if stopping:
            discard(rx)
            raise WireError(
                grpc.StatusCode.UNAVAILABLE, f"this {self.metrics.role} is stopping: push again"
            )
        if not decision.accepted or decision.duplicate:
            discard(rx)  # outside the lock: it may wait for the file's fsync
            if not decision.accepted:
                self.metrics.rejected.labels(*self.labels, decision.code).inc()
                if not taped:
                    self.metrics.untaped.labels(*self.labels).inc()
                raise refusal(decision)
            return pb.PushAck(digest=rx.digest, duplicate=True)
        # Validating the input (decompressing, decoding its positions) allocated and freed
        # on this gRPC thread's own heap: give that memory back before the next transfer.
        trim_heap()
        return pb.PushAck(digest=rx.digest)

    def warm(self) -> int:
        """Make the spool ready for the next step's transfers (``spool.prepare``): one
        warm file per delta taken at the latest step, of its size; how many it made.  For
        a driver between rounds, outside the lock (it writes files)."""
        if self.spool is None:
            return 0
        with self._warming:
            with self.board.cond:
                if self._closed or not self._sizes:
                    return 0
                last = max(step for step, _ in self._sizes.values())
                sizes = [n for step, n in self._sizes.values() if step == last]
                self._sizes = {s: v for s, v in self._sizes.items() if v[0] == last}
            return spool.prepare(self.spool, sizes)

    def report(self, requester: str, step: int) -> None:
        """A member's report that it applied and keeps the merge of ``step`` (an island
        to its relay, a relay to the aggregator): recorded under the lock
        (``applied``); a refusal is raised as its gRPC status."""
        with self.board.cond:
            refused = self.node.applied(requester, step)
        if refused is not None:
            raise refusal(refused)

    def member(self, request: MemberRequest) -> Decision:
        """An island's join or leave (a relay's intake): decided and taped under the lock;
        a refusal is raised as its gRPC status (nothing taped: it changes nothing)."""
        node = self.node
        if not isinstance(node, RelayNode):
            raise WireError(grpc.StatusCode.UNIMPLEMENTED, "joins and leaves go to a relay")
        with self.board.cond:
            if self._closed:
                raise WireError(grpc.StatusCode.UNAVAILABLE, "this relay is stopping: ask again")
            t0 = time.perf_counter()
            with durable_or_die("relay", f"{request.change} of {request.member}", **self.where):
                decision, effects = node.on_member(request)
            if decision.accepted and not decision.duplicate:
                self._handle(effects, t0)
            self.board.cond.notify_all()
        if not decision.accepted:
            self.metrics.rejected.labels(*self.labels, decision.code).inc()
            raise refusal(decision)
        if not decision.duplicate:  # a forward a leave completed went to on_effect (_handle)
            log_event(
                request.change,
                role="relay",
                island=request.member,
                message=decision.reason,
                **self.where,
            )
        return decision

    def _handle(self, effects: list[Effect], t0: float) -> None:
        """Metrics, cutoff timers and ``on_effect`` for effects the node made durable."""
        m, (role, region) = self.metrics, self.labels
        for effect in effects:
            if isinstance(effect, ArmCutoff):
                self._arm(effect)
                continue
            self._taped(effect)
            if isinstance(effect, Publish):
                size = len(effect.delta.data)
                self._sizes[effect.delta.sender] = (effect.delta.sync_step, size)
                m.received_bytes.labels(role, self.level, region).inc(size)
                m.delta_size.labels(role, self.level, region).observe(size)
                continue
            if isinstance(effect, Membership):
                rec = effect.record
                m.member_changes.labels(role, region, rec.change).inc()
                m.region_members.labels(role, region).set(
                    len(self.node.machine.level.members_for(rec.sync_step))
                )
                if rec.change == LEAVE:  # no longer a member: no absence streak to show
                    with contextlib.suppress(KeyError):
                        m.absent_streak.remove(role, region, rec.member)
            if isinstance(effect, Cut):
                step, now = effect.record.sync_step, time.monotonic()
                self.cut_at[step] = now
                armed = self.armed_at.pop(step, None)
                log_cutoff(role, effect, None if armed is None else now - armed, **self.where)
                m.cutoffs.labels(role, region).inc()
                m.quorum_waiting.labels(role, region).set(int(effect.waiting))
            if isinstance(effect, Committed):
                absent = getattr(effect.record, "absent", None) or ()
                m.absent.labels(role, region).set(len(absent))
                if effect.record is not None:  # this level's own commit
                    for member in effect.commitment.members:
                        m.absent_streak.labels(role, region, member).set(0)
                    for member in absent:
                        m.absent_streak.labels(role, region, member).inc()
                m.quorum_waiting.labels(role, region).set(0)
                self.armed_at.pop(effect.sync_step, None)
                timer = self.timers.pop(effect.sync_step, None)
                if timer is not None:  # the step completed before its cutoff
                    timer.cancel()
                cut = self.cut_at.pop(effect.sync_step, None)
                if cut is not None:
                    m.cutoff_to_commit.labels(role, region).observe(time.monotonic() - cut)
                m.aggregate_seconds.labels(role, region).observe(time.perf_counter() - t0)
                m.rounds.labels(role, region, effect.level).inc()
                m.members.labels(role, region).set(len(effect.commitment.members))
                m.last_step.labels(role, region).set(effect.sync_step)
                m.last_round.labels(role, region).set(effect.round)
            self.on_effect(effect)

    # -- the cutoff clock ----------------------------------------------------------------
    def rearm(self) -> None:
        """After a (re)start: the open step's clock, if replayed deliveries need one (it
        runs its whole length again from now; the cutoff entry, when it comes, is what
        counts); and a relay's membership metrics, from the start (zero changes so far)."""
        with self.board.cond:
            arm = self.node.machine.level.armed()
            if arm is not None:
                self._arm(arm)
            if isinstance(self.node, RelayNode):
                m, (role, region) = self.metrics, self.labels
                for change in (JOIN, LEAVE):
                    m.member_changes.labels(role, region, change)
                m.region_members.labels(role, region).set(len(self.node.machine.members))

    def _arm(self, arm: ArmCutoff) -> None:
        if self._closed or arm.sync_step in self.timers:
            return
        self.armed_at[arm.sync_step] = time.monotonic()
        timer = threading.Timer(arm.seconds, self._fire, (arm.sync_step,))
        timer.daemon = True
        timer.name = f"cutoff-{arm.sync_step}"
        self.timers[arm.sync_step] = timer
        timer.start()

    @property
    def closed(self) -> bool:
        """The node is closed (``close``): nothing more is decided or taped here."""
        return self._closed

    def _fire(self, step: int) -> None:
        with self.board.cond:
            self.timers.pop(step, None)
            if self._closed:
                return
            t0 = time.perf_counter()
            with durable_or_die(self.metrics.role, f"cutoff of step {step}", **self.where):
                decision, effects = self.node.cutoff(step)
            if decision.accepted and not decision.duplicate:
                self._handle(effects, t0)
            self.board.cond.notify_all()
        self.after_cutoff()

    def close(self) -> None:
        """On shutdown: no more cutoffs, a final signed tape checkpoint, then no more
        entries."""
        with self.board.cond:
            self._closed = True
            for timer in self.timers.values():
                timer.cancel()
            self.timers.clear()
            self.node.close()
        if self.spool is not None:
            with self._warming:  # after a warm-up in flight: none is left behind
                spool.discard_warm(self.spool)
