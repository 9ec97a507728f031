"""hypertrain-relay: serves the islands of one region.

    hypertrain-relay --region eu --aggregator 127.0.0.1:7070 --listen 127.0.0.1:0 [--config run.toml]

RPCs (proto/hypertrain/v1/hypertrain.proto, service Relay):
- PushDelta: an island streams its encoded delta; it is verified (sha256,
  codec, shape, run, round, step, membership) by the sans-I/O RelayMachine,
  kept under its digest in ``<state-dir>/published/`` and counted once.
- FetchMerge: blocks until the merge of a sync step exists (the regional mean,
  or the aggregator's new global parameters), then streams it as fp32.
- Status.

At every global sync step the relay forwards its committed regional delta to
the aggregator (a background thread, so PushDelta answers at once) and fetches
the new global parameters.  The relay forwards; it never sums across regions.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest, tensor_digest
from hypertrain.common.errors import ConfigError
from hypertrain.common.protocol import Committed, Effect, Forward, Publish, RelayMachine
from hypertrain.common.roles import initial_parameters
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import (
    TRANSFER_FIELDS,
    forward_body,
    regional_merge_body,
    transfer_message,
)
from hypertrain.common.trust.tape import Entry, TapeWriter
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.chunks import merge_chunks
from hypertrain.wire.daemon import atomic_write, fault_point, log_event
from hypertrain.wire.errors import WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.peers import Peer
from hypertrain.wire.rounds import Intake, MergeBoard, taped_delta, taped_inputs
from hypertrain.wire.server import Shutdown, maps_errors

#: Marker file: the aggregator has been told that the final state is durable here.
FINAL_REPORTED = "final-reported"
#: How long a relay tries to report the final state before giving up (the aggregator
#: may already have ended the run).
FINAL_REPORT_WAIT_S = 60.0


class RelayService:
    """The Relay servicer: validate and translate; the RelayMachine decides."""

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
    ) -> None:
        self.cfg = cfg
        self.region = region
        _, theta0 = initial_parameters(cfg)
        self.numel = theta0.numel()
        self.machine = RelayMachine(cfg, region, theta0, trusted)
        self.key = key
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        tape = TapeWriter.open(state_dir / "tape", cfg.run_id, key) if key else None
        self.aggregator = aggregator
        self.shutdown = shutdown
        self.board = MergeBoard(cfg, shutdown, state_dir / "final")
        self.metrics = metrics or Metrics("relay")
        self.intake = Intake(state_dir, self.numel, self.board, self.metrics, region, tape)
        self.forwards: queue.Queue[Forward | None] = queue.Queue()
        self._recover()
        self.forwarder = threading.Thread(target=self._forward_loop, name="forwarder", daemon=True)
        self.forwarder.start()

    # -- RPCs -----------------------------------------------------------------------
    @maps_errors
    def PushDelta(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushAck:
        return self.intake.push(chunks, self.machine.on_delta, self._on_effect)

    def _on_effect(self, effect: Effect) -> None:
        if isinstance(effect, Committed):
            fault_point("relay_before_merge_entry")
            self.intake.record("regional_merge", regional_merge_body(self.cfg, effect))
            self._log_commit(effect)
        elif isinstance(effect, Forward):
            self.intake.record("forward", forward_body(effect))
            fault_point("relay_after_forward_entry")
            self.forwards.put(effect)

    @maps_errors
    def FetchMerge(self, request: pb.MergeRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        if request.run_id != self.cfg.run_id:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"wrong run {request.run_id!r}")
        if request.requester not in self.machine.level.members:
            raise WireError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{request.requester!r} is not an island of {self.region}",
            )
        merge = self.board.wait(self.machine.merge_for, request.sync_step, context)
        if merge.kind != request.kind:
            raise WireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the merge of step {request.sync_step} is {merge.kind}, not {request.kind}",
            )
        header = self.board.header(merge)
        yield from merge_chunks(header, merge.payload)
        if merge.kind == "global" and request.sync_step == self.cfg.steps:
            self.board.fetched_final(
                request.requester,
                self.machine.level.members,
                "run complete: every island has the final merge",
            )

    @maps_errors
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        with self.board.cond:
            return pb.StatusReply(
                run_id=self.cfg.run_id,
                role=f"relay/{self.region}",
                round=self.machine.level.open_step // self.cfg.topology.h_g,
                last_step=self.machine.level.open_step - self.cfg.topology.h_r,
                state_digest=tensor_digest(self.machine.core.base),
                done=self.machine.done,
                config_digest=self.cfg.digest,
            )

    # -- forwarding to the aggregator -----------------------------------------------
    def _forward_loop(self) -> None:
        while True:
            fwd = self.forwards.get()
            if fwd is None:
                return
            try:
                self._forward(fwd)
            except Exception as e:  # the run cannot go on without the aggregator
                log_event("error", role="relay", region=self.region, message=str(e))
                self.shutdown.request(f"forwarding failed: {e}")
                return

    def _forward(self, fwd: Forward, taped: dict[str, Any] | None = None) -> None:
        """Push the region's delta, fetch theta_{g+1}, apply it, checkpoint.

        ``taped``: the ``global_applied`` body already on the tape (recovery redoes a
        round whose checkpoint a crash cut off): checked, not recorded again."""
        t0 = time.perf_counter()
        header = pb.TransferHeader(
            run_id=self.cfg.run_id,
            round=fwd.round,
            sync_step=fwd.sync_step,
            sender=self.region,
            digest=blob_digest(fwd.data),
            size=len(fwd.data),
            codec=fwd.codec,
        )
        if self.key is not None:
            header.signature = self.key.sign(
                transfer_message(*(getattr(header, f) for f in TRANSFER_FIELDS))
            )
        stop = lambda: self.shutdown.requested  # noqa: E731
        self.aggregator.push(header, fwd.data, stop)
        self.metrics.sent_bytes.labels("relay", "global", self.region).inc(len(fwd.data))
        request = pb.MergeRequest(
            run_id=self.cfg.run_id, requester=self.region, sync_step=fwd.sync_step, kind="global"
        )
        agg_header, theta = self.aggregator.fetch(request, self.numel, stop)
        with self.board.cond:
            merge = self.machine.on_global(fwd.sync_step, theta)
            body = {
                "round": fwd.round,
                "sync_step": fwd.sync_step,
                "merge_step": merge.merge_step,
                "theta": merge.post_digest,
            }
            if taped is None:
                self.intake.record("global_applied", body)
            elif taped != body:
                raise ConfigError(
                    f"relay {self.region}: the aggregator's state for step {fwd.sync_step} "
                    f"({body['theta']}) is not the one on this relay's tape ({taped['theta']})"
                )
            self.save_checkpoint(fwd.round)
            final = fwd.sync_step == self.cfg.steps
            self.board.headers[fwd.sync_step] = (
                agg_header  # islands get the aggregator's commitment
            )
            self.board.cond.notify_all()
        log_event(
            "global",
            role="relay",
            region=self.region,
            round=fwd.round,
            step=fwd.sync_step,
            bytes=len(fwd.data),
            seconds=round(time.perf_counter() - t0, 4),
        )
        if final:  # durable here: the aggregator may stop once every relay says so
            self._report_final()

    def _report_final(self) -> None:
        """Report the final state applied and durable; keep trying for a while even when
        this relay is already stopping (the aggregator waits for every report)."""
        give_up = time.monotonic() + FINAL_REPORT_WAIT_S
        self.aggregator.report_applied(
            self.region, self.cfg.steps, lambda: time.monotonic() > give_up
        )
        atomic_write(self.state_dir / FINAL_REPORTED, b"")

    def save_checkpoint(self, round_: int) -> None:
        """After global round ``round_``: what a segment audit of this region starts from."""
        core = self.machine.core
        tape = self.intake.tape
        state = {
            "run_id": self.cfg.run_id,
            "region": self.region,
            "round": round_,
            "theta": core.theta,
            "residual": core.feedback.residual,
            "tape_seq": tape.next_seq if tape else 0,
            "tape_head": tape.head if tape else "",
            "config_digest": self.cfg.digest,
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write(self.state_dir / "checkpoints" / f"round-{round_:06d}.pt", buf.getvalue())

    # -- restart --------------------------------------------------------------------
    def _recover(self) -> None:
        """After a restart: resume from the last checkpoint, then redo from the tape and
        the published inputs what came after it, checking every redone merge and
        forward against its tape entry bit for bit.

        A global round whose theta was taped but not checkpointed is fetched again
        from the aggregator (it keeps the last round) and checked against the tape;
        a forward on the tape without its global merge is sent again (the aggregator
        answers an identical resend as a duplicate); merges the crash cut off before
        they were taped are taped now.  Islands meanwhile wait (UNAVAILABLE), then
        re-send what the relay may not have acknowledged: answered as duplicates."""
        tape = self.intake.tape
        checkpoints = sorted((self.state_dir / "checkpoints").glob("round-*.pt"))
        if tape is None:
            if checkpoints or any(self.intake.published.iterdir()):
                raise ConfigError(
                    f"{self.state_dir} holds the state of an earlier start but this relay keeps "
                    "no tape (no --signing-key), so it cannot resume: start it with its key, "
                    "or with a new --state-dir for a new run"
                )
            return
        entries = tape.entries
        start, resumed_round = 0, None
        if checkpoints:
            ck = torch.load(checkpoints[-1], weights_only=True)
            if (ck["run_id"], ck["region"]) != (self.cfg.run_id, self.region) or ck.get(
                "config_digest", self.cfg.digest
            ) != self.cfg.digest:
                raise ConfigError(
                    f"{checkpoints[-1]} belongs to another run, region or config; "
                    "use a new --state-dir"
                )
            start = int(ck["tape_seq"])
            if len(entries) < start or (start and entries[start - 1].hash != ck["tape_head"]):
                raise ConfigError(
                    f"tape {tape.path} does not contain what {checkpoints[-1]} recorded "
                    f"({start} entries ending in {ck['tape_head'][:16]})"
                )
            resumed_round = int(ck["round"])
            accepted = taped_inputs(entries[:start])
            sync_step = (resumed_round + 1) * self.cfg.topology.h_g
            self.machine.restore(ck["theta"], ck["residual"], sync_step, accepted)
        elif not entries:
            return  # a fresh start
        self._redo(entries[start:])  # before the server and the forwarder start: alone
        if self.machine.done and not (self.state_dir / FINAL_REPORTED).exists():
            # The final checkpoint was written, its report perhaps not, and the aggregator
            # waits for it.  It may also have been sent just before the crash and the
            # aggregator be gone: then give up after a while (it only ends the aggregator).
            try:
                self._report_final()
            except WireError as e:
                log_event("warning", role="relay", region=self.region, message=str(e))
        if self.machine.done:  # islands that had the final merge before the restart are done
            self.board.check_final(
                self.machine.level.members, "run complete: every island has the final merge"
            )
        log_event(
            "recovered",
            role="relay",
            region=self.region,
            checkpoint_round=resumed_round,
            entries_redone=len(entries) - start,
            open_step=self.machine.level.open_step,
        )

    def _redo(self, entries: Sequence[Entry]) -> None:
        """Feed taped inputs back through the machine; check what it does against the tape."""
        cfg = self.cfg
        pending: list[Effect] = []  # computed by the redo, their entries not seen yet
        forwarded: Forward | None = None
        for e in entries:
            b = e.body
            if e.kind == "input":
                delta = taped_delta(cfg.run_id, e, self.intake.published)
                decision, effects = self.machine.on_delta(delta)
                if not decision.accepted or decision.duplicate:
                    raise ConfigError(f"cannot redo tape entry {e.seq}: {decision.reason}")
                pending.extend(x for x in effects if not isinstance(x, Publish))
            elif e.kind in ("regional_merge", "forward"):
                effect = pending.pop(0) if pending else None
                redone = (
                    regional_merge_body(cfg, effect)
                    if isinstance(effect, Committed)
                    else forward_body(effect)
                    if isinstance(effect, Forward)
                    else None
                )
                if redone != b:
                    raise ConfigError(
                        f"tape entry {e.seq} ({e.kind}): the redone round differs from the tape"
                    )
                if isinstance(effect, Forward):
                    forwarded = effect
            elif e.kind == "global_applied":
                if forwarded is None or forwarded.sync_step != b["sync_step"]:
                    raise ConfigError(f"tape entry {e.seq}: a global merge without its forward")
                self._forward(forwarded, taped=b)
                forwarded = None
        for effect in pending:  # the crash came before these were taped
            with self.board.cond:
                self._on_effect(effect)
            if isinstance(effect, Forward):
                forwarded = None  # _on_effect queued it
        if forwarded is not None:  # taped, but its global merge never came back
            self.forwards.put(forwarded)

    def _log_commit(self, c: Committed) -> None:
        log_event(
            "round",
            role="relay",
            region=self.region,
            round=c.round,
            step=c.sync_step,
            members=",".join(c.commitment.members),
            bytes=c.input_bytes,
            commit=c.commitment.digest[:16],
        )

    def close(self) -> None:
        # The forwarder first (it may be reporting the final round, or applying a global
        # round that it must tape before its checkpoint), then the tape.
        self.forwards.put(None)
        self.forwarder.join(timeout=FINAL_REPORT_WAIT_S)
        self.intake.close()
        with self.board.cond:
            self.board.cond.notify_all()
