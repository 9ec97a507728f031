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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest, tensor_digest
from hypertrain.common.keys import SigningKey, TrustedKeys
from hypertrain.common.ledger import (
    TRANSFER_FIELDS,
    forward_body,
    regional_merge_body,
    transfer_message,
)
from hypertrain.common.protocol import Committed, Effect, Forward, RelayMachine
from hypertrain.common.roles import initial_parameters
from hypertrain.common.tape import TapeWriter
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.chunks import merge_chunks
from hypertrain.wire.daemon import atomic_write, log_event
from hypertrain.wire.errors import WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.peers import Peer
from hypertrain.wire.rounds import Intake, MergeBoard
from hypertrain.wire.server import Shutdown, maps_errors


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
        self.board = MergeBoard(cfg, shutdown)
        self.metrics = metrics or Metrics("relay")
        self.intake = Intake(state_dir, self.numel, self.board, self.metrics, region, tape)
        self.forwards: queue.Queue[Forward | None] = queue.Queue()
        self.forwarder = threading.Thread(target=self._forward_loop, name="forwarder", daemon=True)
        self.forwarder.start()

    # -- RPCs -----------------------------------------------------------------------
    @maps_errors
    def PushDelta(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushAck:
        return self.intake.push(chunks, self.machine.on_delta, self._on_effect)

    def _on_effect(self, effect: Effect) -> None:
        if isinstance(effect, Committed):
            self.intake.record("regional_merge", regional_merge_body(self.cfg, effect))
            self._log_commit(effect)
        elif isinstance(effect, Forward):
            self.intake.record("forward", forward_body(effect))
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

    def _forward(self, fwd: Forward) -> None:
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
            self.intake.record(
                "global_applied",
                {
                    "round": fwd.round,
                    "sync_step": fwd.sync_step,
                    "merge_step": merge.merge_step,
                    "theta": merge.post_digest,
                },
            )
            self.save_checkpoint(fwd.round)
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
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write(self.state_dir / "checkpoints" / f"round-{round_:06d}.pt", buf.getvalue())

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
        self.intake.close()
        self.forwards.put(None)
        with self.board.cond:
            self.board.cond.notify_all()
