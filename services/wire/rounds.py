"""Servicer plumbing shared by the relay and the aggregator.

- :class:`Intake`: receive one pushed delta (chunked, sha256-checked, spooled),
  let the sans-I/O machine decide, publish or discard the bytes, and answer
  with a PushAck or the decision's status.  Everything after the transfer
  runs under the board's lock, so decisions are serialized.
- :class:`MergeBoard`: committed merges with their wire headers, and the
  condition that blocked fetches wait on.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import tensor_digest
from hypertrain.common.errors import ConfigError
from hypertrain.common.protocol import Committed, Decision, Delta, Effect, Publish
from hypertrain.common.trust.tape import Entry, TapeWriter
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire import spool
from hypertrain.wire.chunks import discard, publish, receive_delta
from hypertrain.wire.daemon import atomic_write
from hypertrain.wire.errors import WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.protocol_codes import STATUS
from hypertrain.wire.server import Shutdown

WAIT_SLICE_S = 0.5
#: The longest a fetch is held waiting for its merge; then it is answered
#: DEADLINE_EXCEEDED ("not committed yet") and the caller asks again.  Short, so a
#: waiting caller gets to check whether it was asked to stop, and the caller's own
#: deadline is left for the download.
HOLD_S = 2.0


def merge_header(cfg: RunConfig, merge: Committed) -> pb.MergeHeader:
    return pb.MergeHeader(
        run_id=cfg.run_id,
        round=merge.round,
        sync_step=merge.sync_step,
        merge_step=merge.merge_step,
        kind=merge.kind,
        digest=tensor_digest(merge.payload),
        numel=merge.payload.numel(),
        commitment=json.dumps(merge.commitment.to_dict(), sort_keys=True, separators=(",", ":")),
        members=list(merge.commitment.members),
    )


class MergeBoard:
    """Committed merges with their wire headers, and a condition to wait on them."""

    def __init__(self, cfg: RunConfig, shutdown: Shutdown, final_dir: Path | None = None) -> None:
        """``final_dir``: where the members that have the final merge are recorded (one
        empty file each), so a restarted daemon still knows who is done."""
        self.cfg = cfg
        self.shutdown = shutdown
        self.cond = threading.Condition()
        self.headers: dict[int, pb.MergeHeader] = {}
        self.final_dir = final_dir
        self.final_fetches: set[str] = set()
        if final_dir is not None and final_dir.is_dir():
            self.final_fetches = {f.name for f in final_dir.iterdir() if not f.name.startswith(".")}

    def wait(self, lookup: Any, sync_step: int, context: grpc.ServicerContext) -> Committed:
        """Block (under ``cond``) until ``lookup(sync_step)`` exists; abort if the call ends."""
        until = time.monotonic() + HOLD_S
        with self.cond:
            while True:
                merge = lookup(sync_step)
                if merge is not None:
                    return merge
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

    def fetched_final(self, requester: str, members: tuple[str, ...], reason: str) -> None:
        """Record that ``requester`` has the run's final merge; once every member has it,
        the daemon's work is done and it asks to shut down with ``reason``."""
        with self.cond:
            if self.final_dir is not None and requester not in self.final_fetches:
                atomic_write(self.final_dir / requester, b"")
            self.final_fetches.add(requester)
            self.check_final(members, reason)

    def check_final(self, members: tuple[str, ...], reason: str) -> None:
        """Ask to shut down with ``reason`` if every member has the final merge."""
        with self.cond:
            if self.final_fetches >= set(members):
                self.shutdown.request(reason)

    def header(self, merge: Committed) -> pb.MergeHeader:
        h = self.headers.get(merge.sync_step)
        if h is None or h.kind != merge.kind:
            h = self.headers[merge.sync_step] = merge_header(self.cfg, merge)
            for old in sorted(self.headers)[:-8]:
                del self.headers[old]
        return h


def input_body(d: Delta) -> dict[str, Any]:
    """The tape body of an accepted input (its membership in the round)."""
    return {
        "round": d.round,
        "sync_step": d.sync_step,
        "sender": d.sender,
        "digest": d.digest,
        "size": len(d.data),
        "codec": d.codec,
        "signature": d.signature.hex(),
    }


def taped_delta(run_id: str, e: Entry, published: Path) -> Delta:
    """The delta of a taped ``input`` entry, its bytes read back from ``published``
    (the inverse of :func:`input_body`; what a restarted daemon redoes)."""
    b = e.body
    path = published / b["digest"]
    if not path.is_file():
        raise ConfigError(f"tape entry {e.seq}: published input {path} is missing")
    return Delta(
        run_id,
        b["round"],
        b["sync_step"],
        b["sender"],
        b["digest"],
        b["codec"],
        path.read_bytes(),
        bytes.fromhex(b["signature"]),
    )


def taped_inputs(entries: Sequence[Entry]) -> dict[tuple[int, str], str]:
    """(sync_step, sender) -> digest of every taped ``input`` entry: what was accepted."""
    return {
        (e.body["sync_step"], e.body["sender"]): e.body["digest"]
        for e in entries
        if e.kind == "input"
    }


class Intake:
    """Receives pushed deltas into ``<state_dir>/spool`` and publishes accepted ones."""

    def __init__(
        self,
        state_dir: Path,
        numel: int,
        board: MergeBoard,
        metrics: Metrics,
        region: str = "",
        tape: TapeWriter | None = None,
    ) -> None:
        """``region``: the relay's region ("" at the aggregator), a metrics label.
        ``tape``: where accepted inputs, rejections and merges are recorded."""
        self.tape = tape
        self.taped = tape is not None
        self.closed = False
        self.published = state_dir / "published"
        self.spool = state_dir / "spool"
        for d in (self.published, self.spool):
            d.mkdir(parents=True, exist_ok=True)
        spool.remove_stale(self.spool)  # transfers cut off by a crash were never accepted
        # An encoded delta is never larger than fp32 plus a header: bound what we accept.
        self.max_size = 4 * numel + (1 << 16)
        self.board = board
        self.metrics = metrics
        self.labels = (metrics.role, region)
        self.level = "regional" if metrics.role == "relay" else "global"

    def record(self, kind: str, body: dict[str, Any]) -> None:
        """Append one entry to the tape (callers hold ``board.cond``); after ``close`` of a
        taped intake, raise: an entry that cannot be taped must not be acted on."""
        if self.closed and self.taped:
            raise RuntimeError(f"tape closed: cannot record {kind}")
        if self.tape is not None:
            self.tape.append(kind, body)
            self.metrics.tape_entries.labels(*self.labels).inc()
            cp = self.tape.last_checkpoint
            if cp is not None:
                self.metrics.tape_checkpoint.labels(*self.labels).set(cp.size)

    def close(self) -> None:
        """On shutdown: a final signed checkpoint, so the tape's end is attested; then
        no more entries (a late call's rejection is logged, not taped)."""
        with self.board.cond:
            self.closed = True
            tape, self.tape = self.tape, None
            if tape is not None:
                cp = tape.last_checkpoint
                if tape.next_seq and (cp is None or cp.size < tape.next_seq - 1):
                    tape.checkpoint()
                tape.close()

    def _rejected(self, code: str, reason: str, header: pb.TransferHeader | None) -> None:
        self.metrics.rejected.labels(*self.labels, code).inc()
        body: dict[str, Any] = {"code": code, "reason": reason}
        if header is not None:
            body.update(sender=header.sender, sync_step=header.sync_step, round=header.round)
        with self.board.cond:
            self.record("rejection", body)

    def push(
        self,
        chunks: Iterator[Any],
        decide: Callable[[Delta], tuple[Decision, list[Effect]]],
        on_effect: Callable[[Effect], None],
    ) -> pb.PushAck:
        try:
            rx = receive_delta(chunks, max_size=self.max_size, spool_dir=self.spool)
        except WireError as e:
            self._rejected(e.code.name.lower(), e.message, None)
            raise
        h = rx.header
        delta = Delta(
            h.run_id, h.round, h.sync_step, h.sender, rx.digest, h.codec, rx.data, h.signature
        )
        with self.board.cond:
            t0 = time.perf_counter()
            decision, effects = decide(delta)
            if not decision.accepted or decision.duplicate:
                discard(rx)
                if not decision.accepted:
                    self._rejected(decision.code, decision.reason, h)
                    raise WireError(STATUS[decision.code], decision.reason)
                return pb.PushAck(digest=rx.digest, duplicate=True)
            m, (role, region) = self.metrics, self.labels
            for effect in effects:
                if isinstance(effect, Publish):
                    publish(rx, self.published)
                    self.record("input", input_body(delta))
                    m.received_bytes.labels(role, self.level, region).inc(h.size)
                    m.delta_size.labels(role, self.level, region).observe(h.size)
                else:
                    if isinstance(effect, Committed):
                        m.aggregate_seconds.labels(role, region).observe(time.perf_counter() - t0)
                        m.rounds.labels(role, region, effect.level).inc()
                        m.members.labels(role, region).set(len(effect.commitment.members))
                        m.last_step.labels(role, region).set(effect.sync_step)
                        m.last_round.labels(role, region).set(effect.round)
                    on_effect(effect)
            self.board.cond.notify_all()
        return pb.PushAck(digest=rx.digest)
