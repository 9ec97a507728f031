"""hypertrain-relay: serves the islands of one region.

    hypertrain-relay --region eu --aggregator 127.0.0.1:7070 --listen 127.0.0.1:0 [--config run.toml]

RPCs (proto/hypertrain/v1/hypertrain.proto, service Relay):
- PushDelta: an island streams its encoded delta; the transfer is verified (digest,
  size) and handed to the region's ``RelayNode`` (common/rounds/node.py), which decides
  (codec, shape, run, round, step, membership, signature), keeps it under its digest in
  ``<state-dir>/published/`` and tapes it before the push is answered.
- FetchMerge: blocks until the merge of a sync step exists (the relay's regional base after
  it, or the aggregator's new global parameters), then streams it as fp32.
- Status.

At every global sync step the node's forward waits in its outbox; a background thread
(so PushDelta answers at once) pushes it to the aggregator, fetches the new global
parameters and hands them to the node as an event.  The relay forwards; it never sums
across regions.  A restart resumes from the node's checkpoint and tape (``recover``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.pages import populate
from hypertrain.common.rounds.machines import (
    Committed,
    Decision,
    Effect,
    Forward,
    MemberRequest,
)
from hypertrain.common.rounds.node import RelayNode
from hypertrain.common.rounds.store import FRAGMENT_DIR, NodeStore, atomic_write
from hypertrain.common.rounds.transport import Unavailable
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import island_key
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.cutthrough import ABANDONED, APPLIED, CutThrough, Through
from hypertrain.wire.daemon import (
    durable_or_die,
    fault_point,
    log_event,
    log_pruned,
    log_swept,
    memory_fields,
    starting_parameters,
)
from hypertrain.wire.errors import StaleDelta, WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.options import CHECKPOINT_NICE, lower_priority, trim_heap
from hypertrain.wire.peers import Peer
from hypertrain.wire.rounds import Intake, MergeBoard, merge_header
from hypertrain.wire.server import Shutdown, fragment_of, maps_errors, push_fragment
from hypertrain.wire.tls import PLAINTEXT, Callers, Security
from hypertrain.wire.upstream import GrpcUpstream, Patient, merge_of

#: How often an idle forwarder checks whether its region has no member left to follow
#: the global rounds for (``RelayService._follow``).
FOLLOW_POLL_S = 1.0
#: Marker file: the aggregator has been told that the final state is durable here.
FINAL_REPORTED = "final-reported"
#: How long a relay tries to report the final state before giving up (the aggregator
#: may already have ended the run).
FINAL_REPORT_WAIT_S = 60.0
RELAY_DONE = "run complete: every island has the final merge"


class RelayService:
    """The Relay servicer: receive and translate; the RelayNode decides."""

    def __init__(
        self,
        cfg: RunConfig,
        region: str,
        state_dir: Path,
        aggregator: Peer,
        shutdown: Shutdown,
        metrics: Metrics | None = None,
        key: SigningKey | None = None,
        trusted: TrustedKeys | None = None,
        shard: int = 0,
        security: Security = PLAINTEXT,
        fragment: tuple[int, torch.Tensor] | None = None,
        cut_through: bool = True,
        keep_rounds: int = 0,
    ) -> None:
        """``shard``: which of the region's relay shards this is (common/shards.py); it
        keeps, serves and forwards only its range of the parameters.  ``security``: with
        TLS, each island may act only as itself (``tls.Callers``).  ``fragment``: the
        streaming fragment it serves (its index and initial values; ``RelayFragments``
        runs one per fragment), in ``<state-dir>/fragment-<index>``.  ``cut_through``:
        serve each global merge to the islands while it arrives (``wire/cutthrough.py``).
        ``keep_rounds``: the global rounds whose checkpoints and inputs it keeps
        (``NodeStore.prune``; 0: all)."""
        self.cfg = cfg
        self.region = region
        index = None
        if fragment is None:
            _, theta0 = starting_parameters(cfg)
        else:
            index, theta0 = fragment
            state_dir = state_dir / f"{FRAGMENT_DIR}-{index}"
        model_numel = theta0.numel()
        shards = cfg.shards(model_numel)
        if shards.sharded:  # keep only this shard's range
            start, end = shards.bounds(shard)
            theta0 = theta0[start:end].clone()
        self.numel = theta0.numel()
        state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir = state_dir
        where: dict[str, object] = {"shard": shards.label(shard)} if shards.sharded else {}
        if index is not None:
            where["fragment"] = index
        store = NodeStore(
            state_dir,
            cfg.run_id,
            key,
            crash=fault_point,
            keep_rounds=keep_rounds,
            # the trash emptied behind the islands' transfers, as checkpoints are written
            writer_init=lambda: lower_priority(CHECKPOINT_NICE),
            on_prune=log_pruned("relay", {"region": region, **where}),
            on_sweep=log_swept("relay", {"region": region, **where}),
        )
        self.node = RelayNode(
            cfg,
            region,
            theta0,
            store,
            trusted,
            shard,
            model_numel,
            security.ca_fingerprint,
            fragment=index,
        )
        self.member = self.node.member
        """This relay's id at the aggregator (its region, or ``region/i``)."""
        self.where = where
        """What log lines add to ``region`` to say which relay this is."""
        self.key = key
        self.peer = aggregator
        self.shutdown = shutdown
        self.aggregator = Patient(
            # No buffer kept across downloads: the relay keeps each global state (it is
            # the merge it serves its islands).  An fp32 one downloads into the spent
            # forward's memory (``_forward``), any other into a fresh tensor.
            GrpcUpstream(aggregator, cfg.run_id, self.numel, reuse_buffer=False, fragment=index),
            f"Aggregator {aggregator.address}",
            lambda: self.shutdown.requested,
            lambda message: log_event(
                "waiting", role="relay", region=region, **self.where, message=message
            ),
        )
        self.callers = Callers(
            security, {i: island_key(i) for i in cfg.topology.islands_of(region)}
        )
        self.board = MergeBoard(cfg, shutdown, index)
        self.metrics = metrics or Metrics("relay")
        self.intake = Intake(
            self.node,
            self.board,
            self.metrics,
            region,
            self._on_effect,
            where={"region": region, **self.where},
        )
        self.wake = threading.Event()
        self.cut_through = cut_through
        self.through: CutThrough | None = None
        """The global merge on its way from the aggregator, served as it arrives."""
        self._closing = False
        self._recover()
        self.intake.rearm()
        # Checkpoints are written on a thread of their own, at a lower CPU priority than
        # the forwarder's transfers (CHECKPOINT_NICE).
        self.checkpointer = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="checkpoint",
            initializer=lambda: lower_priority(CHECKPOINT_NICE),
        )
        # Warms the next round's memory and spool files (``_warm``) beside the forwarder,
        # which must not wait behind it for the next forward; below the islands' CPU
        # priority, as the checkpoints are (it starts while they may still take the merge).
        self.warmer = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="warm",
            initializer=lambda: lower_priority(CHECKPOINT_NICE),
        )
        self.forwarder = threading.Thread(target=self._forward_loop, name="forwarder", daemon=True)
        self.forwarder.start()

    # -- RPCs -----------------------------------------------------------------------
    @maps_errors
    def PushDelta(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushAck:
        return self.intake.push(
            chunks, lambda header: self.callers.check(context, header.sender, "push")
        )

    def _on_effect(self, effect: Effect) -> None:
        if isinstance(effect, Committed):
            self._log_commit(effect)
        elif isinstance(effect, Forward):
            self.wake.set()

    @maps_errors
    def FetchMerge(self, request: pb.MergeRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        self.callers.check(context, request.requester, "fetch")
        got = self.board.wait(
            lambda s: self._merge_or_through(request, s), request.sync_step, context
        )
        if isinstance(got, Through):
            yield from self._serve_through(got, request.requester, context)
        else:
            assert isinstance(got, Committed)
            # The final merge counts once its island reports it kept (Status), not here.
            yield from self.board.serve(got, request.requester)

    def _merge_or_through(
        self, request: pb.MergeRequest, sync_step: int
    ) -> Committed | Decision | Through | None:
        """(under the board's lock) The merge of ``sync_step``, a refusal, or, while that
        merge is on its way from the aggregator, a stream of it as it arrives
        (``wire/cutthrough.py``); None: not yet."""
        got = self.node.fetch(request.run_id, request.requester, sync_step, request.kind)
        cut = self.through
        if (
            got is not None
            or cut is None
            or cut.sync_step != sync_step
            or request.requester not in cut.takers
            or request.kind != "global"
        ):
            return got
        now = cut.current()
        if now is None:
            return None
        attempt, upstream_header, tensor = now
        if cut.preview is None or cut.preview[0] != attempt:
            header = None
            try:
                preview = self.node.preview_global(merge_of(upstream_header, tensor))
            except Exception:  # a header that does not parse: no preview (whatever the
                preview = None  # error, on_global refuses it there, not the islands here)
            if preview is not None:
                header = merge_header(self.cfg, preview, self.board.fragment)
            cut.preview = (attempt, header)
        header = cut.preview[1]
        return None if header is None else Through(cut, attempt, header, tensor)

    def _serve_through(
        self, t: Through, requester: str, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        """One island's download of the global merge while it arrives; its last chunk
        once the node applied the merge and serves it under the same header."""
        cut = t.cut
        applied: list[Committed] = []  # the merge as the node serves it (finish)

        def alive() -> bool:
            return not (self.shutdown.requested or self._closing) and context.is_active()

        def finish() -> bool:
            with self.board.cond:
                got = self.node.fetch(self.cfg.run_id, requester, cut.sync_step, "global")
                if not isinstance(got, Committed) or got.payload.data_ptr() != t.tensor.data_ptr():
                    return False  # not this merge (the island left meanwhile, say): ask again
                if self.board.header(got) == t.header:
                    applied.append(got)
                    return True
            # preview_global and on_global disagree: a bug, not a fault
            log_event("warning", role="relay", region=self.region, **self.where,
                      step=cut.sync_step, island=requester,
                      message="the global merge served while it arrived has another "
                      "header than the one the relay applied; its download is cut short")  # fmt: skip
            return False

        try:
            yield from cut.stream(t.attempt, t.header, t.tensor, alive, finish)
        except WireError as e:
            log_event("cut_short", role="relay", region=self.region, **self.where,
                      step=cut.sync_step, island=requester, message=e.message)  # fmt: skip
            raise
        with self.board.cond:
            self.board.note_served(applied[0], requester)
            cut.served.append(requester)

    @maps_errors
    def Member(self, request: pb.MemberChange, context: grpc.ServicerContext) -> pb.MemberReply:
        self.callers.check(context, request.member, request.change or "join or leave")
        decision = self.intake.member(
            MemberRequest(
                request.run_id,
                request.change,
                request.member,
                request.step,
                request.issued,
                request.signature,
            )
        )
        return pb.MemberReply(
            duplicate=decision.duplicate,
            has_start=decision.start is not None,
            start=decision.start or 0,
            message=decision.reason,
        )

    @maps_errors
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        m = self.node.machine
        if request.requester or request.applied_step:  # an island reports a merge applied
            self.callers.check(context, request.requester, "report")
            self.intake.report(request.requester, request.applied_step)
            self.board.check_final(self.node, RELAY_DONE)
        with self.board.cond:
            return pb.StatusReply(
                run_id=self.cfg.run_id,
                role=f"relay/{self.member}",
                round=m.open_round,
                last_step=m.schedule.prev_sync_step("regional", m.level.open_step),
                # the regional base, or the last global parameters while a global round
                # is pending: the machine's record, not a pass over the model per call
                state_digest=m.state_digest(),
                done=m.done,
                config_digest=self.cfg.digest,
            )

    # -- forwarding to the aggregator -----------------------------------------------
    def _forward_loop(self) -> None:
        self._warm_soon()  # before the first round's deltas (not while a forward is out)
        while not self._closing:
            self.wake.wait(FOLLOW_POLL_S)  # woken by a forward, or to check for idleness
            self.wake.clear()
            if self._closing:
                return
            try:
                self._forward()
            except Exception as e:  # the run cannot go on without the aggregator
                log_event("error", role="relay", region=self.region, **self.where, message=str(e))
                # another build's aggregator (wire format): 2, a restart cannot help
                mismatch = isinstance(e, WireError) and e.mismatch
                self.shutdown.request(
                    f"forwarding failed: {e}", failed=True, code=2 if mismatch else 1
                )
                return

    def _forward(self) -> None:
        """Push the region's delta, fetch theta_{g+1}, hand it to the node (which
        checkpoints and tapes it), report the final state.  The delta's bytes are held
        only until the aggregator acknowledged them (``RelayNode.forward_sent``), not
        while theta_{g+1} downloads; an fp32 forward's memory is where it downloads
        (``RegionCore.forward_room``)."""
        with self.board.cond:
            fwd = self.node.outbox
            idle = fwd is None and self.node.machine.idle
        if idle:
            self._follow()
            return
        if fwd is None:
            return
        t0 = time.perf_counter()
        step, size = fwd.sync_step, len(fwd.data)
        delta = self.node.forward_delta(fwd, self.key)
        # fp32: the global merge downloads into the forward's own memory once it is
        # acknowledged (resident pages; fresh ones would be faulted in inside the sync)
        room = self.node.machine.core.forward_room(fwd.data)
        del fwd
        try:
            self.aggregator.push(delta)
        except StaleDelta as e:
            # The global round went ahead without this region at its cutoff: the forward
            # is not aggregated; the relay takes the round's global merge all the same.
            self.metrics.rejected.labels("relay", self.region, "stale").inc()
            log_event("stale", role="relay", region=self.region, **self.where, step=step,
                      message=e.message)  # fmt: skip
        del delta
        with self.board.cond:
            self.node.forward_sent(step)
            # The islands may download the global merge while it arrives here (an empty
            # list of takers: none does).
            takers = self._takers(step) if self.cut_through else ()
            cut = self.through = CutThrough(step, takers, self._wake_fetches)
        trim_heap()  # before a model-sized download: the push's chunks, freed on gRPC's threads
        self.metrics.sent_bytes.labels("relay", "global", self.region).inc(size)
        try:
            got = self.aggregator.fetch(self.member, step, "global", out=room, tap=cut)
            with self.board.cond:  # islands fetch it now, while the relay writes it down
                if self.intake.closed:  # this thread outlived close's join: a restart fetches it
                    return
                # A later round than ``step`` when the rounds went on without this region:
                # the node rejoins it there (RelayMachine.on_global).
                merge = self.node.on_global(got, defer=True)
                members = self._takers(merge.sync_step)
                self.through = None
                cut.end(APPLIED)
                self.board.cond.notify_all()
        finally:
            cut.end(ABANDONED)  # unless applied: the downloads served from it stop
            with self.board.cond:
                if self.through is cut:
                    self.through = None
        del got, room
        # The checkpoint once the islands that take the merge have it (or
        # CHECKPOINT_HOLD_S): written beside their downloads it took the cores from them.
        # Not longer than the round stays unsettled (a push settles it first, the one
        # that makes the next forward too).
        node = self.node
        self.board.wait_served(
            merge.sync_step, merge.kind, members, lambda: self._closing or node.settled
        )
        if self.intake.closed:
            return  # as above: the restarted relay fetches the merge again
        with durable_or_die(
            "relay", f"global step {merge.sync_step}", region=self.region, **self.where
        ):
            try:
                job = self.checkpointer.submit(node.write_checkpoint)
            except RuntimeError:  # closed while this thread outlived its join: write it here
                node.write_checkpoint()
            else:
                job.result()
            with self.board.cond:
                self.node.settle()
        trim_heap()  # the round's transfer buffers, freed on the gRPC threads' heaps
        log_event(
            "global",
            role="relay",
            region=self.region,
            **self.where,
            round=merge.round,
            step=step,
            bytes=size,
            seconds=round(time.perf_counter() - t0, 4),
            cut_through=len(cut.served),
            **memory_fields(),
        )
        if self.node.done:  # durable here: the aggregator may stop once every relay says so
            self._report_final()
        else:
            self._warm_soon()

    def _warm_soon(self) -> None:
        with contextlib.suppress(RuntimeError):  # closing: nothing to warm for
            self.warmer.submit(self._warm)

    def _warm(self) -> None:
        """Fault in the memory the next round's base will be written into, now, while the
        islands train (``RegionCore.warm``, ``pages.populate``): the first delta's sum would
        otherwise pay for it inside the sync; and make the spool files of the islands' next
        deltas ready (``Intake.warm``), which their transfers would otherwise pay for.
        Outside the lock: it writes no byte of the state.  Only while no forward is out
        (its memory is the spent base's: a second one would be a third model-sized buffer,
        over the relay's bound)."""
        with self.board.cond:
            m = self.node.machine
            idle = self._closing or m.global_pending is not None or m.done
            frame = None if idle else m.core.warm()
        if frame is not None:
            populate(frame)
        if not idle:
            self.intake.warm()

    def _follow(self) -> None:
        """Nobody is a member of this region (everyone left): take the global rounds as
        they come (``RelayMachine.idle``), so that an island joining later starts from a
        recent merge and the relay ends with the run.  One fetch, held by the aggregator a
        few seconds while the round is not committed; the loop asks again."""
        step = self.node.machine.follow_step
        try:
            got = self.aggregator.upstream.fetch(self.member, step, "global")
        except Unavailable:
            return
        if not isinstance(got, Committed):
            return  # not committed yet (or refused: said at the next forward)
        with self.board.cond:
            if self.intake.closed or not self.node.machine.idle:
                return  # closed; or an island joined meanwhile: its region carries itself
            # Checked (a receipt that fails refuses it, nothing applied: raised as on the
            # forwarding path), applied, then checkpointed and taped here, where a store
            # failure ends the process as it does there: no joiner may fetch a merge this
            # relay's tape does not hold.
            merge = self.node.on_global(got, defer=True)
            with durable_or_die(
                "relay", f"followed global step {merge.sync_step}", region=self.region,
                **self.where,
            ):  # fmt: skip
                self.node.settle()
            self.board.cond.notify_all()
        log_event("global", role="relay", region=self.region, **self.where, round=merge.round,
                  step=merge.sync_step, followed=True)  # fmt: skip
        if self.node.done:
            self._report_final()
            self.board.check_final(self.node, RELAY_DONE)  # no island waits for it

    def _wake_fetches(self) -> None:
        with self.board.cond:
            self.board.cond.notify_all()

    def _takers(self, sync_step: int) -> tuple[str, ...]:
        """The islands that download the global merge of ``sync_step`` (under the lock):
        the step's members that go on from it (an island an islands:K anneal stops there,
        or one that leaves, does not), or all of them at the run's last step (before the
        merge is applied, too)."""
        m = self.node.machine
        members = m.level.members_of(sync_step)
        if m.done or m.schedule.is_final(sync_step):
            return members
        going_on = set(m.level.members)
        return tuple(x for x in members if x in going_on)

    def _report_final(self) -> None:
        """Report the final state applied and durable; keep trying for a while even when
        this relay is already stopping (the aggregator waits for every report)."""
        give_up = time.monotonic() + FINAL_REPORT_WAIT_S
        self.aggregator.report_applied(
            self.member, self.cfg.steps, lambda: time.monotonic() > give_up
        )
        atomic_write(self.state_dir / FINAL_REPORTED, b"")

    # -- restart --------------------------------------------------------------------
    def _recover(self) -> None:
        """After a restart: the node resumes from its checkpoint and tape (no network);
        then a forward still waiting for its global update is sent again (the aggregator
        answers an identical resend as a duplicate), and a final state not yet reported is
        reported.  Islands meanwhile wait (UNAVAILABLE), then re-send what the relay may
        not have acknowledged: answered as duplicates."""
        node = self.node
        node.recover()
        if not node.recovered:  # a fresh start
            return
        if node.outbox is not None:
            self.wake.set()
        if node.done and not (self.state_dir / FINAL_REPORTED).exists():
            # The final checkpoint was written, its report perhaps not, and the aggregator
            # waits for it.  It may also have been sent just before the crash and the
            # aggregator be gone: then give up after a while (it only ends the aggregator).
            try:
                self._report_final()
            except WireError as e:
                log_event("warning", role="relay", region=self.region, **self.where, message=str(e))
        self.board.check_final(node, RELAY_DONE)
        log_event("recovered", role="relay", region=self.region, **self.where, **node.recovered)

    def _log_commit(self, c: Committed) -> None:
        absent = getattr(c.record, "absent", None)
        log_event(
            "round",
            role="relay",
            region=self.region,
            **self.where,
            round=c.round,
            step=c.sync_step,
            members=",".join(c.commitment.members),
            **({"absent": ",".join(absent)} if absent else {}),
            bytes=c.input_bytes,
            commit=c.commitment.digest[:16],
            **memory_fields(),
        )

    def close(self) -> None:
        # The forwarder first (it may be reporting the final round, or applying a global
        # round that it must checkpoint and tape), then the tape.
        self._closing = True
        self.wake.set()
        self.forwarder.join(timeout=FINAL_REPORT_WAIT_S)
        self.checkpointer.shutdown(wait=not self.forwarder.is_alive())
        self.warmer.shutdown(wait=True, cancel_futures=True)
        self.intake.close()
        with self.board.cond:
            self.board.cond.notify_all()


class RelayFragments:
    """The Relay servicer of a run split into streaming fragments: one ``RelayService``
    per fragment (its own node, folder, tape, forwarder and merges), each call handed to
    the fragment it names.  The relay stops when every fragment's run is complete
    (``PartShutdown``), or at once when one fails."""

    def __init__(self, parts: list[RelayService]) -> None:
        self.parts = parts
        self.where = parts[0].where | {"fragments": len(parts)}
        self.where.pop("fragment", None)

    @maps_errors
    def PushDelta(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushAck:
        index, chunks = push_fragment(chunks, len(self.parts))
        return self.parts[index].PushDelta(chunks, context)

    @maps_errors
    def FetchMerge(self, request: pb.MergeRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        index = fragment_of(request, len(self.parts))
        yield from self.parts[index].FetchMerge(request, context)

    @maps_errors
    def Member(self, request: pb.MemberChange, context: grpc.ServicerContext) -> pb.MemberReply:
        raise WireError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "joins and leaves are not supported with streaming fragments yet",
        )

    @maps_errors
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self.parts[fragment_of(request, len(self.parts))].Status(request, context)

    def close(self) -> None:
        for part in self.parts:
            part.close()
