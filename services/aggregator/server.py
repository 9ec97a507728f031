"""hypertrain-aggregator: the global state and the outer optimizer.

    hypertrain-aggregator --listen 127.0.0.1:0 --state-dir agg [--config run.toml]

RPCs (service Aggregator):
- PushRegional: a relay streams its committed regional delta for a global
  round; the sans-I/O AggregatorMachine verifies it; it is kept under its
  digest in ``<state-dir>/published/``.  When every region has delivered, the
  fixed-order (sorted region) mean goes through the outer optimizer, and the
  new state is written durably (``state.pt``: temp file, fsync, rename).
- FetchGlobal: blocks until the round of a sync step is applied, streams theta.
- Status.

Held-out loss is evaluated on a background thread after each round (it never
delays the round) and logged as ``event=eval``.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

from hypertrain.common.aggregate import Commitment
from hypertrain.common.config import RunConfig
from hypertrain.common.data import HOLDOUT_WINDOWS, holdout_windows
from hypertrain.common.digest import state_digest
from hypertrain.common.errors import ConfigError
from hypertrain.common.model import build_model, evaluate, preset
from hypertrain.common.protocol import AggregatorMachine, Committed, Effect
from hypertrain.common.reference import open_dataset
from hypertrain.common.roles import initial_parameters
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import global_merge_body
from hypertrain.common.trust.tape import Entry, TapeWriter
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.chunks import merge_chunks
from hypertrain.wire.daemon import atomic_write, fault_point, log_event
from hypertrain.wire.errors import WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.rounds import Intake, MergeBoard, taped_delta, taped_inputs
from hypertrain.wire.server import Shutdown, maps_errors


class Evaluator:
    """Held-out loss of each new global state, on its own thread and model."""

    def __init__(self, cfg: RunConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        mcfg = preset(cfg.model)
        holdout = holdout_windows(open_dataset(cfg), mcfg.seq_len, n=HOLDOUT_WINDOWS, seed=cfg.seed)
        self.windows = holdout.windows[: cfg.holdout_windows]
        self.model = build_model(mcfg, seed=cfg.seed)
        self.layout, _ = initial_parameters(cfg)
        self.jobs: queue.Queue[tuple[int, int, torch.Tensor] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="eval", daemon=True)
        self.thread.start()

    def submit(self, round_: int, step: int, theta: torch.Tensor) -> None:
        self.jobs.put((round_, step, theta))

    def _run(self) -> None:
        # Held-out loss is for people, not for the run: at the lowest CPU priority
        # (per thread on Linux) it never steals time from islands on a shared host.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while (job := self.jobs.get()) is not None:
            round_, step, theta = job
            self.layout.load(self.model, theta)
            loss = evaluate(self.model, self.windows)
            self.metrics.heldout_loss.labels("aggregator").set(loss)
            log_event(
                "eval", role="aggregator", round=round_, step=step, heldout_loss=round(loss, 6)
            )

    def close(self, finish: bool = True) -> None:
        """Stop after the queued evaluations (``finish``: the run's final held-out loss
        is part of its result), or only wait a little for the one in progress (a stop
        mid-run: at the lowest priority on a busy host it may take long, and a held-out
        loss is not worth holding up a stop)."""
        self.jobs.put(None)
        self.thread.join(timeout=None if finish else 5)


class AggregatorService:
    """The Aggregator servicer: validate and translate; the AggregatorMachine decides."""

    def __init__(
        self,
        cfg: RunConfig,
        state_dir: Path,
        shutdown: Shutdown,
        metrics: Metrics | None = None,
        key: SigningKey | None = None,
        trusted: TrustedKeys | None = None,
    ) -> None:
        self.cfg = cfg
        self.layout, theta0 = initial_parameters(cfg)
        self.numel = theta0.numel()
        self.machine = AggregatorMachine(cfg, theta0, trusted)
        state_dir.mkdir(parents=True, exist_ok=True)
        tape = TapeWriter.open(state_dir / "tape", cfg.run_id, key) if key else None
        self.state_dir = state_dir
        self.shutdown = shutdown
        self.board = MergeBoard(cfg, shutdown, state_dir / "final")
        self.metrics = metrics or Metrics("aggregator")
        self.intake = Intake(state_dir, self.numel, self.board, self.metrics, tape=tape)
        self.t_first = 0.0  # first regional arrival of the open round (for the round log)
        self.evaluator = Evaluator(cfg, self.metrics)
        if self._recover() is None:
            self.evaluator.submit(-1, 0, theta0.clone())
        elif self.machine.done:  # restarted after the run: done if every relay reported
            self.board.check_final(
                self.machine.level.members, "run complete: every relay has applied the final state"
            )

    @maps_errors
    def PushRegional(self, chunks: Iterator[Any], context: grpc.ServicerContext) -> pb.PushAck:
        self.t_first = self.t_first or time.perf_counter()
        return self.intake.push(chunks, self.machine.on_regional, self._on_effect)

    def _on_effect(self, effect: Effect) -> None:
        if isinstance(effect, Committed):
            self._persist(effect)

    @maps_errors
    def FetchGlobal(self, request: pb.MergeRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        if request.run_id != self.cfg.run_id:
            raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"wrong run {request.run_id!r}")
        if request.requester not in self.machine.level.members:
            raise WireError(
                grpc.StatusCode.PERMISSION_DENIED, f"{request.requester!r} is not a region"
            )
        merge = self.board.wait(self.machine.merge_for, request.sync_step, context)
        yield from merge_chunks(self.board.header(merge), merge.payload)

    @maps_errors
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        if request.requester or request.applied_step:
            self._applied(request)
        with self.board.cond:
            return pb.StatusReply(
                run_id=self.cfg.run_id,
                role="aggregator",
                round=self.machine.round,
                last_step=self.machine.level.open_step - self.cfg.topology.h_g,
                state_digest=state_digest(self.layout.unflatten(self.machine.core.theta)),
                done=self.machine.done,
                config_digest=self.cfg.digest,
            )

    def _persist(self, c: Committed) -> None:
        """Record the round on the tape, then write the new global state durably
        (the checkpoint a restart or a segment audit starts from), log the round,
        queue the held-out eval.  The tape entry comes first: it is the commit record;
        a crash before the checkpoint is written is repaired from it on restart."""
        fault_point("before_tape")
        self.intake.record("global_merge", global_merge_body(self.cfg, c))
        fault_point("after_tape")
        tape = self.intake.tape
        self._write_checkpoint(c, tape.next_seq if tape else 0, tape.head if tape else "")
        digest = state_digest(self.layout.unflatten(self.machine.core.theta))
        log_event(
            "round",
            seconds=round(time.perf_counter() - self.t_first, 4),
            role="aggregator",
            round=c.round,
            step=c.sync_step,
            members=",".join(c.commitment.members),
            bytes=c.input_bytes,
            state=digest[:16],
        )
        if c.sync_step == self.cfg.steps:
            log_event("final", role="aggregator", step=c.sync_step, digest=digest)
        self.evaluator.submit(c.round, c.sync_step, c.payload)
        self.t_first = 0.0

    def _write_checkpoint(self, c: Committed, tape_seq: int, tape_head: str) -> None:
        buf = io.BytesIO()
        torch.save(
            {
                "run_id": self.cfg.run_id,
                "config_digest": self.cfg.digest,
                "round": c.round,
                "sync_step": c.sync_step,
                "theta": self.machine.core.theta,
                "outer": self.machine.core.outer.state_dict(),
                "tape_seq": tape_seq,
                "tape_head": tape_head,
            },
            buf,
        )
        data = buf.getvalue()
        atomic_write(self.state_dir / "checkpoints" / f"round-{c.round:06d}.pt", data)
        fault_point("between_checkpoints")
        atomic_write(self.state_dir / "state.pt", data)

    def _applied(self, request: pb.StatusRequest) -> None:
        """A relay reports the global merge of ``applied_step`` applied and durable.

        The aggregator's work ends when every relay has reported the run's last step,
        not when each fetched it: a relay killed between fetching the final state and
        its checkpoint fetches it again after its restart, so the aggregator must
        still be there."""
        if request.requester not in self.machine.level.members:
            raise WireError(
                grpc.StatusCode.PERMISSION_DENIED, f"{request.requester!r} is not a region"
            )
        if request.applied_step == self.cfg.steps:
            if self.machine.merge_for(self.cfg.steps) is None:
                raise WireError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the last step {self.cfg.steps} is not applied here yet",
                )
            self.board.fetched_final(
                request.requester,
                self.machine.level.members,
                "run complete: every relay has applied the final state",
            )

    def _recover(self) -> int | None:
        """After a restart: resume from ``state.pt``, then redo from the tape what came
        after it (a round taped but not checkpointed; inputs accepted for the open
        round), checking each recomputed round against its tape entry bit for bit.
        Returns the number of rounds redone, or None on a fresh start."""
        path = self.state_dir / "state.pt"
        tape = self.intake.tape
        start = 0
        if path.exists():
            ck = torch.load(path, weights_only=True)
            if ck["run_id"] != self.cfg.run_id or ck["config_digest"] != self.cfg.digest:
                raise ConfigError(f"{path} belongs to another run or config; use a new --state-dir")
            self.machine.restore(ck["theta"], ck["outer"], int(ck["sync_step"]))
            start = int(ck["tape_seq"])
            if tape is not None:  # a relay re-sending a forward we took: a duplicate
                self.machine.level.accepted.update(taped_inputs(tape.entries[:start]))
        elif tape is None or not tape.entries:
            return None
        redone = 0
        if tape is not None:
            if len(tape.entries) < start:
                raise ConfigError(f"tape {tape.path} is shorter than {path} recorded ({start})")
            redone = self._redo(tape.entries[start:])
            self._serve_last_round(tape.entries)
        log_event(
            "recovered",
            role="aggregator",
            round=self.machine.round,
            rounds_redone=redone,
            open_step=self.machine.level.open_step,
        )
        return redone

    def _serve_last_round(self, entries: Sequence[Entry]) -> None:
        """Relays that had not fetched the last completed round before the crash can."""
        last = next((e for e in reversed(entries) if e.kind == "global_merge"), None)
        if last is None or self.machine.merge_for(last.body["sync_step"]) is not None:
            return
        b = last.body
        members = tuple(m for m, _ in b["members"])
        commitment = Commitment(b["codec"], members, tuple(d for _, d in b["members"]), b["mean"])
        self.machine.merges[b["sync_step"]] = Committed(
            "global",
            b["round"],
            b["sync_step"],
            b["merge_step"],
            commitment,
            self.machine.core.theta.clone(),
            "global",
            post_digest=b["post_state"],
        )

    def _redo(self, entries: Sequence[Entry]) -> int:
        """Feed taped inputs back through the machine; check each redone round."""
        committed: Committed | None = None
        redone = 0
        for e in entries:
            if e.kind == "input":
                delta = taped_delta(self.cfg.run_id, e, self.intake.published)
                decision, effects = self.machine.on_regional(delta)
                if not decision.accepted:
                    raise ConfigError(f"cannot redo tape entry {e.seq}: {decision.reason}")
                committed = next((x for x in effects if isinstance(x, Committed)), committed)
            elif e.kind == "global_merge":
                if committed is None or committed.sync_step != e.body["sync_step"]:
                    raise ConfigError(f"tape entry {e.seq}: its inputs are not on the tape")
                if global_merge_body(self.cfg, committed) != e.body:
                    raise ConfigError(f"tape entry {e.seq}: redone round differs from the tape")
                self._write_checkpoint(committed, e.seq + 1, e.hash)
                committed, redone = None, redone + 1
        if committed is not None:  # completed by its taped inputs, crashed before its entry
            self._persist(committed)
            redone += 1
        return redone

    def close(self) -> None:
        self.intake.close()
        self.evaluator.close(finish=self.machine.done)
        with self.board.cond:
            self.board.cond.notify_all()
