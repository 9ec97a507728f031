"""The daemons' view of their upstream peer (island -> relay, relay -> aggregator).

Built on ``client.py``'s stubs.  The daemons' retry policy differs from
``client.retrying`` in one way: besides UNAVAILABLE (peer down) it waits out
FAILED_PRECONDITION ("not now": the round is not open yet) and DEADLINE_EXCEEDED
(a fetch whose merge is not ready yet: the peer holds it up to ``rounds.HOLD_S``,
then says so, and the fetch is asked again at once), for as long as the run goes
on, checking between tries whether it was asked to stop.  Every
other status is an answer and is raised as :class:`WireError` naming the peer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import torch

from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import (
    aggregator_stub,
    connect,
    fetch_merge,
    insecure_channel,
    push_delta,
    relay_stub,
)
from hypertrain.wire.errors import WireError

WAIT_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)
FETCH_DEADLINE_S = 120.0
T = TypeVar("T")


def _never() -> bool:
    return False


class Peer:
    """An upstream daemon: push deltas to it, fetch merges from it."""

    def __init__(self, address: str, service: str, wait_ready: bool = True) -> None:
        """``wait_ready``: fail now (UNAVAILABLE) if the peer is not reachable within
        ``connect``'s timeout; False: connect lazily, at the first call."""
        self.address = address
        self.service = service
        self.channel = connect(address) if wait_ready else insecure_channel(address)
        stub: Any = (
            relay_stub(self.channel) if service == "Relay" else aggregator_stub(self.channel)
        )
        self._push = stub.PushDelta if service == "Relay" else stub.PushRegional
        self._fetch = stub.FetchMerge if service == "Relay" else stub.FetchGlobal
        self._status = stub.Status

    def _wait_out(self, what: str, call: Callable[[], T], stop: Callable[[], bool]) -> T:
        delay = 0.005
        while True:
            try:
                return call()
            except (grpc.RpcError, WireError) as e:
                call_error: Any = e
                code, detail = (
                    (e.code, e.message)
                    if isinstance(e, WireError)
                    else (call_error.code(), call_error.details())
                )
                if code not in WAIT_CODES:
                    raise WireError(
                        code, f"{what}: {self.service} {self.address} said: {detail}"
                    ) from None
                if stop():
                    raise WireError(code, f"{what}: stopped while waiting ({detail})") from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the peer held the call while waiting: ask again at once
                time.sleep(delay)
                delay = min(delay * 2, 0.25)

    def push(
        self, header: pb.TransferHeader, data: bytes, stop: Callable[[], bool] = _never
    ) -> pb.PushAck:
        """Stream one encoded delta; waits while the peer is down or the step not open."""
        return self._wait_out(
            f"push of step {header.sync_step} from {header.sender}",
            lambda: push_delta(self._push, header, data),
            stop,
        )

    def fetch(
        self,
        request: pb.MergeRequest,
        numel: int,
        stop: Callable[[], bool] = _never,
        out: torch.Tensor | None = None,
    ) -> tuple[pb.MergeHeader, torch.Tensor]:
        """Block until the merge of ``request.sync_step`` exists, then download and verify it.

        ``out``: a buffer of ``numel`` fp32 to download into (and return) instead of a
        new tensor; a caller done with each merge before the next keeps one buffer and
        never touches fresh memory (bench/bench_transport.py: merge vs merge/reuse)."""
        return self._wait_out(
            f"fetch of the {request.kind} merge of step {request.sync_step}",
            lambda: fetch_merge(
                self._fetch, request, numel=numel, out=out, timeout=FETCH_DEADLINE_S
            ),
            stop,
        )

    def status(self, request: pb.StatusRequest | None = None) -> pb.StatusReply:
        reply: pb.StatusReply = self._status(request or pb.StatusRequest(), timeout=10)
        return reply

    def report_applied(
        self, requester: str, step: int, stop: Callable[[], bool] = _never
    ) -> pb.StatusReply:
        """Tell the peer that the merge of ``step`` is applied and durable here; waits
        while the peer is down."""
        request = pb.StatusRequest(requester=requester, applied_step=step)
        return self._wait_out(f"report of step {step} applied", lambda: self.status(request), stop)

    def close(self) -> None:
        self.channel.close()


def relay_peer(address: str) -> Peer:
    return Peer(address, "Relay")


def aggregator_peer(address: str, wait_ready: bool = True) -> Peer:
    return Peer(address, "Aggregator", wait_ready)
