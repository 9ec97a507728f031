"""The gRPC implementation of the transport interface, and the daemons' waiting policy.

- ``GrpcUpstream`` is ``hypertrain.common.rounds.transport.Upstream`` over gRPC: one call
  per method, the answer mapped back to the node's vocabulary (a ``Decision``, a
  ``Committed`` merge, None for "not committed yet", ``Unavailable`` for a peer that
  cannot be reached).  The servicers on the other side call the same nodes the
  in-process transport calls.
- ``Patient`` wraps any ``Upstream`` with the daemons' policy: wait out "not now",
  "not yet", "unavailable" and a transfer corrupted on the way (sent again), for as long as the run goes on, checking between tries
  whether the caller was asked to stop; any other refusal is raised as ``WireError``
  naming the peer.  The island daemon and the relay's forwarder use it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import torch

from hypertrain.common.aggregate import Commitment
from hypertrain.common.rounds.machines import (
    CORRUPT,
    OK,
    PRECONDITION,
    Committed,
    Decision,
    Delta,
    MemberRequest,
)
from hypertrain.common.rounds.transport import Unavailable, Upstream
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.chunks import MergeTap
from hypertrain.wire.client import fetch_merge, push_delta, transfer_header
from hypertrain.wire.errors import MISMATCH_KEY, OVER_KEY, STALE_KEY, StaleDelta, WireError
from hypertrain.wire.peers import FETCH_DEADLINE_S, Peer
from hypertrain.wire.protocol_codes import STATUS

T = TypeVar("T")
_CODES = {status: code for code, status in STATUS.items()}
_STOPPED_AFTER = "stopped while waiting"
NOTICE_S = 10.0
"""After this long waiting for an unreachable peer, a daemon says so in its log."""


def _code(e: grpc.RpcError | WireError) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, WireError):
        return e.code, e.message
    call: object = e
    return call.code(), call.details()  # type: ignore[attr-defined]


def _marked(e: grpc.RpcError | WireError, key: str) -> bool:
    """Did the peer mark this refusal with trailing metadata ``key`` (``errors.STALE_KEY``,
    ``errors.OVER_KEY``, ``errors.MISMATCH_KEY``)?"""
    if isinstance(e, WireError):
        return e.marked(key)
    trailing = getattr(e, "trailing_metadata", None)
    if not callable(trailing):
        return False
    return any(k == key for k, _ in trailing() or ())


def merge_of(header: pb.MergeHeader, payload: torch.Tensor) -> Committed:
    """The merge a header announces, with ``payload`` (HypertrainError if its commitment
    is not one)."""
    return Committed(
        header.kind,  # type: ignore[arg-type]
        header.round,
        header.sync_step,
        header.merge_step,
        Commitment.from_dict(json.loads(header.commitment)),
        payload,
        header.kind,  # type: ignore[arg-type]
        None,
        payload_digest=header.digest,  # checked against the payload by receive_merge
        receipts=tuple(header.receipts),  # checked by whoever applies the merge
    )


class GrpcUpstream:
    """``Upstream`` over a gRPC channel to a relay (islands) or the aggregator (relays)."""

    def __init__(
        self,
        peer: Peer,
        run_id: str,
        numel: int,
        reuse_buffer: bool = True,
        fragment: int | None = None,
    ) -> None:
        """``run_id``: the run every call names; ``numel``: the model's parameter count (every
        merge is checked against it; of the fragment, with one); ``reuse_buffer``: download
        every merge into one buffer (a caller that is done with each merge before the next
        fetch never touches fresh memory); ``fragment``: the streaming fragment whose
        merges it fetches and reports (None: the run is not split)."""
        self.fragment = fragment
        self.peer = peer
        self.run_id = run_id
        self.numel = numel
        self.buffer = torch.empty(numel, dtype=torch.float32) if reuse_buffer else None

    def _answer(self, what: str, e: grpc.RpcError | WireError) -> Decision:
        """A failed call as the node's answer: a refusal, or Unavailable / WireError."""
        code, detail = _code(e)
        if code == grpc.StatusCode.UNAVAILABLE:
            raise Unavailable(f"{what}: {self.peer.service} {self.peer.address}: {detail}")
        if code in _CODES:
            return Decision(
                _CODES[code], detail, stale=_marked(e, STALE_KEY), over=_marked(e, OVER_KEY)
            )
        raise WireError(
            code,
            f"{what}: {self.peer.service} {self.peer.address} said: {detail}",
            mismatch=_marked(e, MISMATCH_KEY),
        )

    def _call(self, what: str, fn: Callable[[], T]) -> T | Decision:
        try:
            return fn()
        except (grpc.RpcError, WireError) as e:
            return self._answer(what, e)

    def push(self, delta: Delta) -> Decision:
        header = transfer_header(delta)
        got = self._call(
            f"push of step {delta.sync_step} from {delta.sender}",
            lambda: push_delta(self.peer._push, header, delta.data),
        )
        if isinstance(got, Decision):
            return got
        return Decision(OK, "accepted", duplicate=got.duplicate)

    def fetch(
        self,
        requester: str,
        sync_step: int,
        kind: str,
        out: torch.Tensor | None = None,
        tap: MergeTap | None = None,
    ) -> Committed | Decision | None:
        """The merge of ``sync_step`` (``out``: receive it there, e.g. an island's slice of
        the whole merge for one relay shard; default: this upstream's buffer, if any;
        ``tap``: follows the download as it arrives, ``chunks.receive_merge``)."""
        request = pb.MergeRequest(
            run_id=self.run_id, requester=requester, sync_step=sync_step, kind=kind, **self._of
        )
        what = f"fetch of the {kind} merge of step {sync_step}" + (
            f" of fragment {self.fragment}" if self.fragment is not None else ""
        )
        try:
            header, payload = fetch_merge(
                self.peer._fetch,
                request,
                numel=self.numel,
                out=self.buffer if out is None else out,
                timeout=FETCH_DEADLINE_S,
                tap=tap,
            )
        except (grpc.RpcError, WireError) as e:
            if _code(e)[0] == grpc.StatusCode.DEADLINE_EXCEEDED:
                return None  # held while not committed, then "ask again"
            return self._answer(what, e)
        newer = header.kind == "global" and header.sync_step > sync_step  # left behind
        fragment = header.fragment if header.HasField("fragment") else None
        if fragment != self.fragment:
            raise WireError(
                grpc.StatusCode.INTERNAL,
                f"{what}: the peer sent a merge of fragment {fragment}",
            )
        if not newer and (header.sync_step != sync_step or header.kind != kind):
            raise WireError(
                grpc.StatusCode.INTERNAL,
                f"{what}: the peer sent the {header.kind} merge of step {header.sync_step}",
            )
        return merge_of(header, payload)

    def report_applied(self, requester: str, step: int) -> Decision | None:
        request = pb.StatusRequest(requester=requester, applied_step=step, **self._of)
        got = self._call(f"report of step {step} applied", lambda: self.peer.status(request))
        return got if isinstance(got, Decision) else None

    @property
    def _of(self) -> dict[str, int]:
        """The ``fragment`` field of a request, where the run is split."""
        return {} if self.fragment is None else {"fragment": self.fragment}

    def member(self, request: MemberRequest) -> Decision:
        call = self.peer._member
        if call is None:
            raise WireError(grpc.StatusCode.UNIMPLEMENTED, "joins and leaves go to a relay")
        message = pb.MemberChange(
            run_id=request.run_id,
            change=request.change,
            member=request.member,
            step=request.step,
            issued=request.issued,
            signature=request.signature,
        )
        what = f"{request.change} of {request.member}"
        try:
            got = call(message, timeout=30)
        except (grpc.RpcError, WireError) as e:
            if _code(e)[0] == grpc.StatusCode.DEADLINE_EXCEEDED:  # asking again is safe
                raise Unavailable(f"{what}: {self.peer.address}: no answer in 30 s") from None
            return self._answer(what, e)
        return Decision(
            OK, got.message, duplicate=got.duplicate, start=got.start if got.has_start else None
        )


class Patient:
    """Blocking calls on an ``Upstream`` with the daemons' waiting policy (module docstring)."""

    def __init__(
        self,
        upstream: Upstream,
        name: str,
        stop: Callable[[], bool],
        notice: Callable[[str], None] = lambda message: None,
    ) -> None:
        """``notice``: told (once per call) when a call has waited ``NOTICE_S`` for a peer
        that is unavailable, so that a daemon waiting on a peer says so in its log."""
        self.upstream = upstream
        self.name = name
        self.stop = stop
        self.notice = notice

    def _wait(self, what: str, attempt: Callable[[], T | Decision | None]) -> T | None:
        delay = 0.005
        since, told = time.monotonic(), False
        while True:
            try:
                got = attempt()
            except Unavailable as e:
                got, why = None, str(e)
                if not told and time.monotonic() - since > NOTICE_S:
                    self.notice(f"{what}: still waiting for {self.name}: {e}")
                    told = True
            else:
                why = "not committed yet" if got is None else ""
                if isinstance(got, Decision):
                    if got.accepted:
                        return None
                    if got.stale:  # asking again cannot help
                        raise StaleDelta(f"{what}: {self.name} said: {got.reason}")
                    if got.code not in (PRECONDITION, CORRUPT):  # CORRUPT: a resend may fix it
                        raise WireError(
                            STATUS.get(got.code, grpc.StatusCode.PERMISSION_DENIED),
                            f"{what}: {self.name} said: {got.reason}",
                            over=got.over,
                        )
                    why = got.reason
                elif got is not None:
                    return got
            if self.stop():
                raise WireError(grpc.StatusCode.CANCELLED, f"{what}: {_STOPPED_AFTER} ({why})")
            if why == "not committed yet":
                continue  # the peer held the call while waiting: ask again at once
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def push(self, delta: Delta) -> None:
        """Push until accepted (or a duplicate of an accepted delta)."""
        self._wait(
            f"push of step {delta.sync_step} from {delta.sender}",
            lambda: self.upstream.push(delta),
        )

    def fetch(
        self,
        requester: str,
        sync_step: int,
        kind: str,
        out: torch.Tensor | None = None,
        tap: MergeTap | None = None,
    ) -> Committed:
        got = self._wait(
            f"fetch of the {kind} merge of step {sync_step}",
            lambda: self.upstream.fetch(requester, sync_step, kind, out, tap),
        )
        assert isinstance(got, Committed)
        return got

    def member(self, request: MemberRequest) -> Decision:
        """Join or leave until answered (the answer, a duplicate included)."""
        answer: list[Decision] = []

        def attempt() -> Decision:
            got = self.upstream.member(request)
            if got.accepted:
                answer.append(got)
            return got

        self._wait(f"{request.change} of {request.member}", attempt)
        return answer[-1]

    def report_applied(self, requester: str, step: int, stop: Callable[[], bool]) -> None:
        """Report ``step`` applied, waiting while the peer is down, until ``stop()``."""

        def attempt() -> Decision:
            got = self.upstream.report_applied(requester, step)
            return Decision(OK, "reported") if got is None else got

        own, self.stop = self.stop, stop
        try:
            self._wait(f"report of step {step} applied", attempt)
        finally:
            self.stop = own
