"""Client side: connect to a daemon, stubs with the chunk codec, pushes, fetches, retries.

    channel = connect("127.0.0.1:41237")                 # waits until ready, or WireError(UNAVAILABLE)
    channel = connect(address, security=tls, peer="relay-eu")   # mutual TLS (wire/tls.py)
    relay = relay_stub(channel)
    ack = retrying(lambda: push_delta(relay.PushDelta, header, blob), attempts=5, backoff=0.5)
    header, theta = fetch_merge(relay.FetchMerge, request, numel=model_numel)

Invariants:

- Channels use ``options.CHANNEL_OPTIONS``, the same limits and keepalive as servers,
  and mutual TLS unless given ``tls.PLAINTEXT`` (the default of in-process tools).
- The stubs have the generated stubs' methods and wire format; only the streaming chunk
  messages use the zero-copy codec (``frames.py``), so ``delta_chunks`` and
  ``merge_chunks`` parts can be sent as they are.
- ``retrying`` retries UNAVAILABLE only: every other status is an answer (the push was
  rejected), not a transport failure.  The callable must rebuild its request
  iterator on each attempt (a stream is consumed by the first try).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import torch

from hypertrain.common.rounds.machines import Delta
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.v1 import hypertrain_pb2_grpc as pb_grpc
from hypertrain.wire import frames
from hypertrain.wire.chunks import MergeTap, delta_chunks, receive_merge
from hypertrain.wire.errors import WireError
from hypertrain.wire.tls import PLAINTEXT, Security
from hypertrain.wire.wireformat import GO_KEY, Stating

log = logging.getLogger("hypertrain.wire")
T = TypeVar("T")
_CHUNKS = (pb.DeltaChunk, pb.MergeChunk)


def connect(
    address: str, timeout: float = 30.0, security: Security = PLAINTEXT, peer: str = ""
) -> grpc.Channel:
    """A channel to "HOST:PORT" (daemon ``peer`` under TLS), once it is ready;
    WireError(UNAVAILABLE) if not."""
    channel = security.channel(address, peer)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise WireError(
            grpc.StatusCode.UNAVAILABLE, f"cannot reach {address}: not ready after {timeout:g} s"
        ) from None
    return channel


def _fast_stub(stub: Any, channel: grpc.Channel, service: str) -> Any:
    """Replace the generated multicallables of ``stub`` by ones with the chunk codec."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    for method in desc.methods:
        request = getattr(pb, method.input_type.name)
        response = getattr(pb, method.output_type.name)
        kind = {
            (False, False): channel.unary_unary,
            (True, False): channel.stream_unary,
            (False, True): channel.unary_stream,
            (True, True): channel.stream_stream,
        }[(method.client_streaming, method.server_streaming)]
        setattr(
            stub,
            method.name,
            Stating(  # every call states this build's wire format (wireformat.py)
                kind(
                    f"/{desc.full_name}/{method.name}",
                    request_serializer=frames.encode
                    if request in _CHUNKS
                    else request.SerializeToString,
                    response_deserializer=frames.decoder(response)
                    if response in _CHUNKS
                    else response.FromString,
                    _registered_method=True,
                )
            ),
        )
    return stub


def relay_stub(channel: grpc.Channel) -> pb_grpc.RelayStub:
    """A Relay stub whose PushDelta takes ``delta_chunks`` parts, FetchMerge yields parts."""
    return _fast_stub(pb_grpc.RelayStub(channel), channel, "Relay")


def aggregator_stub(channel: grpc.Channel) -> pb_grpc.AggregatorStub:
    """An Aggregator stub, PushRegional / FetchGlobal with the chunk codec."""
    return _fast_stub(pb_grpc.AggregatorStub(channel), channel, "Aggregator")


def transfer_header(delta: Delta) -> pb.TransferHeader:
    """The header a delta is pushed under: its transfer fields, size and signature."""
    return pb.TransferHeader(
        run_id=delta.run_id,
        round=delta.round,
        sync_step=delta.sync_step,
        sender=delta.sender,
        digest=delta.digest,
        size=len(delta.data),
        codec=delta.codec,
        signature=delta.signature,
        shard=delta.shard,
        **({} if delta.fragment is None else {"fragment": delta.fragment}),
    )


def push_delta(
    push: Any,
    header: pb.TransferHeader,
    data: frames.Data,
    *,
    timeout: float | None = None,
) -> pb.PushAck:
    """Stream one delta through ``push`` (``stub.PushDelta`` / ``stub.PushRegional``, a
    stream-unary multicallable):
    its header, then, once the server says go (``wireformat.GO_KEY``: it may be letting
    other pushes read first), its data.  A call that ends before the go (a refused header)
    sends no data, and raises as the call does."""
    return _GoPush(push, header, data).run(timeout)


class _GoPush:
    """One push that sends its data only after the server's go (``push_delta``)."""

    def __init__(self, push: Any, header: pb.TransferHeader, data: frames.Data) -> None:
        self.push = push
        self.header, self.data = header, data
        self.call: Any = None
        self.placed = threading.Event()  # ``call`` is set

    def parts(self) -> Iterator[Any]:
        """The request stream (read on gRPC's own thread)."""
        chunks = delta_chunks(self.header, self.data)
        yield next(chunks)  # the header
        self.placed.wait()
        call = self.call
        if call is None:  # the call could not start
            return
        # Until the server's go or the call's end, whichever comes first.
        if not any(key == GO_KEY for key, _ in call.initial_metadata() or ()):
            return
        yield from chunks

    def run(self, timeout: float | None) -> pb.PushAck:
        try:
            self.call = self.push.future(self.parts(), timeout=timeout)
        finally:
            self.placed.set()
        try:
            return self.call.result()
        except BaseException as exc:
            self.call.cancel()  # an interrupt here does not leave the push running
            # ``result()`` raises the call itself, whose traceback's frames hold it (and
            # this object, and the delta's bytes up the stack): a cycle that would keep
            # a refused push's delta until the garbage collector ran (as fetch_merge).
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            # The call refers to the stream's generator, which refers to this object: no
            # cycle may keep the delta's bytes for the garbage collector.
            self.call = None


def fetch_merge(
    fetch: Callable[..., Any],
    request: pb.MergeRequest,
    *,
    numel: int | None = None,
    out: torch.Tensor | None = None,
    timeout: float | None = None,
    tap: MergeTap | None = None,
) -> tuple[pb.MergeHeader, torch.Tensor]:
    """Call ``fetch`` (``stub.FetchMerge`` / ``stub.FetchGlobal``); ``receive_merge`` it."""
    call = fetch(request, timeout=timeout)
    try:
        return receive_merge(call, numel=numel, out=out, tap=tap)
    except BaseException as exc:
        call.cancel()  # stop the server's stream on a rejected or interrupted download
        # A streaming call's error is the call object itself, and the frames of its
        # traceback hold it (``call`` here, the chunk iterator in receive_merge): a
        # reference cycle.  Every frame up the stack would wait in it for the garbage
        # collector, each with the locals it has when it returns.  A daemon waiting for
        # a merge ("not committed yet; ask again") then held the merge it got after
        # such an answer, a model's worth, until a collection ran (issue 12: one fp32
        # model in an island at gpt-125m, into its next training step).
        del call
        traceback.clear_frames(exc.__traceback__)
        raise


def _unavailable(exc: BaseException) -> bool:
    if isinstance(exc, WireError):
        return exc.code == grpc.StatusCode.UNAVAILABLE
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


def retrying(
    call: Callable[[], T],
    *,
    attempts: int = 5,
    backoff: float = 0.5,
    max_backoff: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()``, retried on UNAVAILABLE up to ``attempts`` times in all.

    Waits ``backoff * 2**i`` seconds (at most ``max_backoff``) before retry ``i + 1``;
    the last UNAVAILABLE error and every other error propagate unchanged.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(attempts):
        try:
            return call()
        except (grpc.RpcError, WireError) as exc:
            if not _unavailable(exc) or attempt == attempts - 1:
                raise
            delay = min(max_backoff, backoff * 2**attempt)
            log.warning(
                "unavailable (attempt %d of %d), retrying in %.1f s", attempt + 1, attempts, delay
            )
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
