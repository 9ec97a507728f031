"""Bounded-chunk streaming of large payloads: encoded deltas and fp32 merges.

A transfer is a stream of parts: one header message, then the payload in slices of at
most ``CHUNK_BYTES``.  Senders slice memoryviews of the payload (never a copy of the
whole thing, never one giant message); receivers fill one preallocated buffer (or,
when spooling, the spool file, then map it).

Use the stubs and servicer registration of ``hypertrain.wire.client`` /
``hypertrain.wire.server``: their codec (``frames.py``) sends data parts without
building protobuf messages.  The generators below yield the header as a message and
the data as memoryviews, which the generated stubs cannot serialize; the receivers
accept both forms, so peers on the generated stubs still interoperate with us.  Every
part must parse: one that did not (``frames.Malformed``) ends the transfer with
INVALID_ARGUMENT "malformed DeltaChunk (n bytes): <protobuf's reason>" (or MergeChunk).

Delta (island -> relay, relay -> aggregator), ``TransferHeader`` then bytes:
    receive_delta checks, in this order: first part is a header; ``header.digest`` is
    64 lowercase hex (it becomes a file name); ``header.size <= max_size``; no second
    header; exactly ``header.size`` bytes; ``blob_digest`` of the bytes == ``header.digest``.
    The digest is computed while the chunks arrive (``spool.Sink``), and with a
    ``spool_dir`` the bytes are written to a temp file as they arrive and fsync'd on
    success; ``publish`` then links it to ``dest_dir/<digest>`` (idempotent), or
    ``discard`` drops it.  A rejected transfer leaves no file behind.

Merge (relay -> islands, aggregator -> relays), ``MergeHeader`` then raw fp32:
    the payload is the tensor's little-endian fp32 bytes, ``header.numel`` elements;
    ``header.digest`` is ``tensor_digest`` of the 1-D tensor of those elements (the
    digest covers the shape, so senders digest ``t.reshape(-1)``).

Memory on the receiver: the payload buffer plus a few chunks in flight, whatever the
number of chunks.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
import torch

from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire import spool
from hypertrain.wire.errors import WireError
from hypertrain.wire.frames import Data, DeltaPart, Malformed, MergePart
from hypertrain.wire.tensorhash import TensorHasher

#: Data bytes per chunk message.  Between 256 KiB and 4 MiB the loopback figures of
#: bench/bench_transport.py --sweep differ by less than their run-to-run noise on the
#: 2-core box; 1 MiB equals the tensor digest's leaf, so each merge chunk completes one
#: leaf, and stays far below ``options.MAX_MESSAGE_BYTES``.
CHUNK_BYTES = 1 << 20

_HEX64 = re.compile(r"[0-9a-f]{64}")
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass(slots=True)
class ReceivedDelta:
    """A verified delta: its header, its bytes, their digest, and the spooled temp file."""

    header: pb.TransferHeader
    #: The payload: the receive buffer itself or, when spooled, a private (copy-on-write)
    #: memory map of the spooled file, i.e. its page cache, not a second copy.
    data: memoryview
    #: ``blob_digest`` (hex) of ``data``, equal to ``header.digest``.
    digest: str
    #: The temp file holding ``data`` until ``publish`` or ``discard``; None if the
    #: transfer was not spooled or was already published or discarded.
    spool_path: Path | None = None
    #: The spool's sink while its fsync may still run (``receive_delta(wait=False)``):
    #: ``publish`` waits for it, ``discard`` for it too before removing the file.
    sink: spool.Sink | None = None

    def durable(self) -> None:
        """Wait until the spooled bytes are on disk (at once if they are, or not spooled);
        raises ``WireError`` (INTERNAL) if the fsync failed, the temp file removed."""
        sink, self.sink = self.sink, None
        if sink is not None:
            try:
                sink.durable()
            except WireError:
                self.spool_path = None
                raise


def _byte_view(data: Data) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _slices(view: memoryview, chunk_bytes: int) -> Iterator[memoryview]:
    for start in range(0, view.nbytes, chunk_bytes):
        yield view[start : start + chunk_bytes]


def delta_chunks(
    header: pb.TransferHeader, data: Data, *, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[DeltaPart]:
    """The parts of one delta transfer: the header, then memoryview slices of ``data``."""
    view = _byte_view(data)
    if header.size != view.nbytes:
        raise ValueError(f"header.size {header.size} != {view.nbytes} bytes of data")
    yield pb.DeltaChunk(header=header)
    yield from _slices(view, chunk_bytes)


def _split(
    part: object, message: type[pb.DeltaChunk] | type[pb.MergeChunk]
) -> tuple[object, Data | None]:
    """(header or None, data or None) of one received part; a part that did not parse
    (``frames.Malformed``) is refused INVALID_ARGUMENT with protobuf's reason."""
    if isinstance(part, Malformed):
        raise part.error()
    if isinstance(part, message):
        kind = part.WhichOneof("part")
        if kind == "header":
            return part.header, None
        if kind == "data":
            return None, part.data
        raise WireError(_INVALID, f"empty {message.__name__}: neither header nor data")
    if isinstance(part, bytes | bytearray | memoryview):
        return None, part
    raise TypeError(f"not a {message.__name__} part: {type(part).__name__}")


def _first_header(
    parts: Iterator[object], message: type[pb.DeltaChunk] | type[pb.MergeChunk]
) -> object:
    first = next(parts, None)
    if first is None:
        raise WireError(_INVALID, f"empty stream: expected a {message.__name__} header first")
    header, _ = _split(first, message)
    if header is None:
        raise WireError(_INVALID, f"first {message.__name__} must carry the header, got data")
    return header


def _check_delta_header(header: pb.TransferHeader, max_size: int) -> None:
    if not _HEX64.fullmatch(header.digest):
        raise WireError(_INVALID, f"header digest {header.digest!r} is not 64 lowercase hex digits")
    if header.size > max_size:
        raise WireError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"delta of {header.size} bytes is over this receiver's limit of {max_size} bytes",
        )


def receive_delta(
    chunks: Iterable[DeltaPart],
    *,
    max_size: int,
    spool_dir: Path | None = None,
    admit: Callable[[pb.TransferHeader], None] = lambda header: None,
    wait: bool = True,
) -> ReceivedDelta:
    """Read, verify and (optionally) spool one delta transfer; see the module docstring.
    ``admit`` sees the header before any data is read, and refuses the transfer by
    raising (e.g. the caller's certificate is not the sender's).  ``wait=False``: return
    before the spooled file's fsync ends (``spool.Sink.commit``); the caller must
    ``publish`` or ``discard`` it, and they wait for it."""
    parts = iter(chunks)
    header = _first_header(parts, pb.DeltaChunk)
    assert isinstance(header, pb.TransferHeader)
    _check_delta_header(header, max_size)
    admit(header)
    size = header.size
    # The sink (its worker threads, a warm spool file) is made once the first data part
    # is in, not at the header: a push waiting for a reading slot (wire/calls.py) holds
    # none of it.
    sink: spool.Sink | None = None
    try:
        offset = 0
        for part in parts:
            _, data = _split(part, pb.DeltaChunk)
            if data is None:
                raise WireError(_INVALID, f"second header after {offset} bytes of data")
            n = len(data)
            if offset + n > size:
                raise WireError(
                    _INVALID, f"too long: more than the {size} bytes the header announced"
                )
            if sink is None:
                sink = spool.Sink(size, spool_dir)
            sink.put(offset, data)
            offset += n
        if offset != size:
            raise WireError(
                _INVALID, f"short stream: {offset} of the {size} bytes the header announced"
            )
        if sink is None:  # an empty delta
            sink = spool.Sink(size, spool_dir)
        digest = sink.finish()
        if digest != header.digest:
            raise WireError(
                grpc.StatusCode.DATA_LOSS,
                f"corrupt transfer: digest {digest} != header digest {header.digest}",
            )
        sink.commit(wait=wait)
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    return ReceivedDelta(
        header=header,
        data=sink.buffer,
        digest=digest,
        spool_path=sink.path,
        sink=None if wait else sink,
    )


def publish(received: ReceivedDelta, dest_dir: Path) -> Path:
    """Store the delta durably as ``dest_dir/<digest>``; idempotent (an existing file stays).

    With a spooled transfer the temp file is linked into place (same filesystem);
    without one the bytes are written and fsync'd now.
    """
    received.durable()
    if received.spool_path is not None:
        path = spool.publish_file(received.spool_path, received.digest, dest_dir)
        received.spool_path = None
        return path
    return spool.write_file(received.data, received.digest, dest_dir)


def discard(received: ReceivedDelta) -> None:
    """Drop the spooled temp file of a transfer that will not be published."""
    sink, received.sink = received.sink, None
    if sink is not None:
        sink.abort()  # waits for its fsync, closes and removes the file
    if received.spool_path is not None:
        received.spool_path.unlink(missing_ok=True)
        received.spool_path = None


def fp32_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous fp32 CPU tensor, as a view (no copy)."""
    if sys.byteorder != "little":
        raise ValueError(
            "merge payloads are little-endian fp32; big-endian hosts are not supported"
        )
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"merge tensor must be contiguous fp32 on the CPU, got {tensor.dtype} on "
            f"{tensor.device} (contiguous: {tensor.is_contiguous()})"
        )
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def merge_chunks(
    header: pb.MergeHeader, tensor: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[MergePart]:
    """The parts of one merge transfer: the header, then views of the tensor's fp32 bytes.

    Slices are views of the tensor: one that changes while the stream is read (a relay's
    live base, moved by its next merge) arrives with bytes that fail the header's digest,
    and the receiver asks again.
    """
    if header.numel != tensor.numel():
        raise ValueError(f"header.numel {header.numel} != tensor numel {tensor.numel()}")
    view = fp32_bytes(tensor)
    yield pb.MergeChunk(header=header)
    yield from _slices(view, chunk_bytes)


class MergeTap(Protocol):
    """Follows one merge download as it arrives (``receive_merge``): a relay serves the
    bytes on while they come (``cutthrough.CutThrough``)."""

    def begin(self, header: pb.MergeHeader, tensor: torch.Tensor) -> None:
        """The header arrived; ``tensor`` (1-D) is what will be filled."""

    def advance(self, end: int) -> None:
        """The first ``end`` bytes of the tensor are filled."""

    def fail(self) -> None:
        """The download failed: what was filled is worth nothing."""


def receive_merge(
    chunks: Iterable[MergePart],
    *,
    numel: int | None = None,
    out: torch.Tensor | None = None,
    tap: MergeTap | None = None,
) -> tuple[pb.MergeHeader, torch.Tensor]:
    """Read one merge into a 1-D fp32 tensor; check byte count and tensor digest.

    ``numel``, when given (the receiver knows its model), is checked against the header
    before anything is allocated.  ``out``, a contiguous fp32 CPU tensor of
    ``header.numel`` elements, is filled and returned (flattened) instead of a new
    tensor: a receiver that keeps one buffer across rounds never touches fresh
    memory.  On error its contents are undefined.  The copy into the tensor and the
    digest's leaf hashes run on two worker threads, overlapped with the transfer and
    with each other.  ``tap`` is told the header, each chunk copied in and a failure
    (not the digest's verdict: whoever serves the bytes on must wait for this to return).
    """
    parts = iter(chunks)
    header = _first_header(parts, pb.MergeChunk)
    assert isinstance(header, pb.MergeHeader)
    if numel is not None and header.numel != numel:
        raise WireError(_INVALID, f"merge of {header.numel} fp32, expected {numel}")
    if out is not None and out.numel() != header.numel:
        raise WireError(_INVALID, f"merge of {header.numel} fp32 does not fit out ({out.numel()})")
    tensor = torch.empty(header.numel, dtype=torch.float32) if out is None else out
    buf = fp32_bytes(tensor)  # checks that out is contiguous fp32: filled in place
    tensor = tensor.view(-1)
    hasher = TensorHasher(tensor, buf.nbytes)

    def fill(offset: int, data: Data) -> None:
        spool.copy_into(buf, offset, data)
        if tap is not None:
            tap.advance(offset + len(data))

    # Two workers, each fed every chunk: one copies it into the tensor, one hashes it.
    workers = [
        spool.Worker("wire-fill", fill, spool.DEPTH),
        spool.Worker("wire-hash", hasher.feed, spool.DEPTH),
    ]
    if tap is not None:
        tap.begin(header, tensor)
    try:
        try:
            _fill(parts, workers, buf.nbytes, header.numel)
        finally:
            for worker in workers:
                worker.stop()
        for worker in workers:
            if worker.error is not None:
                raise spool.failure(worker.error)
        digest = hasher.hexdigest()
        if digest != header.digest:
            raise WireError(
                grpc.StatusCode.DATA_LOSS,
                f"corrupt merge: tensor digest {digest} != header digest {header.digest}",
            )
    except BaseException:
        if tap is not None:
            tap.fail()
        raise
    return header, tensor


def _fill(parts: Iterator[object], workers: list[spool.Worker], size: int, numel: int) -> None:
    offset = 0
    for part in parts:
        _, data = _split(part, pb.MergeChunk)
        if data is None:
            raise WireError(_INVALID, f"second merge header after {offset} bytes of data")
        n = len(data)
        if offset + n > size:
            raise WireError(_INVALID, f"too long: more than the {size} bytes of {numel} fp32")
        for worker in workers:
            worker.put(offset, data)
        offset += n
    if offset != size:
        raise WireError(_INVALID, f"short stream: {offset} of the {size} bytes of {numel} fp32")
