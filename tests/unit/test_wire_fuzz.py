"""Hostile bytes and hostile streams at the wire's readers (no network).

``frames.decoder`` / ``frames.parser`` on arbitrary bytes agree with protobuf itself (the
oracle) and never raise; ``receive_delta`` and ``receive_merge`` fed arbitrary sequences of
parts (headers with any field values, data, empty chunks, parts that did not parse) either
return exactly what the stream announced or raise ``WireError`` with a refusal's status.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hypertrain.common.digest import blob_digest, tensor_digest
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire import frames
from hypertrain.wire.chunks import receive_delta, receive_merge
from hypertrain.wire.errors import WireError
from hypertrain.wire.frames import Malformed

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REQUESTS = [pb.MergeRequest, pb.MemberChange, pb.StatusRequest, pb.TransferHeader]
#: The statuses a reader refuses a stream with (``errors.py``'s table).
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS,
}
MAX_SIZE = 256

u64 = st.one_of(
    st.integers(0, 300), st.integers(0, 2**64 - 1), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1])
)
text = st.text(max_size=12)


def _transfer_header(size: st.SearchStrategy[int], digest: st.SearchStrategy[str]) -> Any:
    return st.builds(
        pb.TransferHeader, run_id=text, round=u64, sync_step=u64, sender=text,
        digest=digest, size=size, codec=text, signature=st.binary(max_size=8), shard=text,
    )  # fmt: skip


def _merge_header(numel: st.SearchStrategy[int], digest: st.SearchStrategy[str]) -> Any:
    return st.builds(
        pb.MergeHeader, run_id=text, round=u64, sync_step=u64, merge_step=u64, kind=text,
        digest=digest, numel=numel, commitment=text, members=st.lists(text, max_size=3),
    )  # fmt: skip


messages = st.one_of(
    _transfer_header(u64, text).map(lambda h: pb.DeltaChunk(header=h)),
    _merge_header(u64, text).map(lambda h: pb.MergeChunk(header=h)),
    st.binary(max_size=40).map(lambda b: pb.DeltaChunk(data=b)),
    st.builds(pb.MemberChange, run_id=text, change=text, member=text, step=u64, issued=u64),
    st.builds(pb.MergeRequest, run_id=text, requester=text, sync_step=u64, kind=text),
)


@st.composite
def mangled(draw: st.DrawFn, raw: st.SearchStrategy[bytes]) -> bytes:
    """A draw of ``raw`` as it is, cut short, or with one byte changed."""
    got = draw(raw)
    how = draw(st.sampled_from(["as is", "as is", "cut", "flip"]))
    if how == "cut":
        return got[: draw(st.integers(0, len(got)))]
    if how == "flip" and got:
        i = draw(st.integers(0, len(got) - 1))
        return got[:i] + bytes([got[i] ^ draw(st.integers(1, 255))]) + got[i + 1 :]
    return got


#: Garbage, or a real message's bytes, cut short or with one byte changed.
hostile_bytes = mangled(
    st.one_of(st.binary(max_size=120), messages.map(lambda m: m.SerializeToString()))
)


def _oracle(message: type[Any], raw: bytes) -> Any:
    try:
        return message.FromString(raw)
    except DecodeError:
        return None


DESERIALIZERS = [
    (frames.decoder, pb.DeltaChunk),
    (frames.decoder, pb.MergeChunk),
    *((frames.parser, m) for m in REQUESTS),
]


@FUZZ
@given(raw=hostile_bytes, which=st.sampled_from(DESERIALIZERS))
def test_the_deserializers_agree_with_protobuf_and_never_raise(raw: bytes, which: Any) -> None:
    make, message = which
    got = make(message)(raw)
    want = _oracle(message, raw)
    if want is None:
        assert isinstance(got, Malformed), got
        err = got.error()
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.message.startswith(f"malformed {message.__name__} ({len(raw)} bytes): ")
        assert got.reason and "Error parsing message" not in got.reason, got.reason
    elif isinstance(got, memoryview):  # the chunks' zero-copy path: one data field
        assert make is frames.decoder and want.WhichOneof("part") == "data"
        assert bytes(got) == want.data
    else:
        assert got == want


def test_a_truncated_header_is_malformed_and_says_why() -> None:
    raw = pb.DeltaChunk(header=pb.TransferHeader(run_id="run", sender="eu-0")).SerializeToString()
    got = frames.decoder(pb.DeltaChunk)(raw[:-2])
    assert isinstance(got, Malformed)
    assert got.error().message == (
        f"malformed DeltaChunk ({len(raw) - 2} bytes): Wire format was corrupt"
    )
    bad_utf8 = b"\x0a\x03\x0a\x01\xff"  # a header whose run_id is not UTF-8
    assert frames.decoder(pb.DeltaChunk)(bad_utf8) == Malformed(
        "DeltaChunk", 5, "String field had bad UTF-8"
    )


# -- the streaming readers -----------------------------------------------------------------

malformed = st.builds(Malformed, st.sampled_from(["DeltaChunk", "MergeChunk"]), st.integers(0, 99),
                      st.sampled_from(["Wire format was corrupt", "String field had bad UTF-8"]))  # fmt: skip
data_part = st.binary(max_size=48).flatmap(
    lambda b: st.sampled_from([b, memoryview(b), bytearray(b)])
)


def _stream(
    draw: st.DrawFn, honest: list[Any], header: Any, empty: Any, wrap: Callable[[bytes], Any]
) -> list[Any]:
    """``honest`` (a correct transfer) with a few parts inserted, dropped or replaced."""
    parts = list(honest)
    stray = st.one_of(header, data_part, data_part.map(lambda b: wrap(bytes(b))), malformed,
                      st.just(empty))  # fmt: skip
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):
        i = draw(st.integers(0, len(parts)))
        how = draw(st.sampled_from(["insert", "drop", "replace"]))
        if how == "insert" or i == len(parts):
            parts.insert(i, draw(stray))
        elif how == "drop":
            del parts[i]
        else:
            parts[i] = draw(stray)
    return parts


def _slices(payload: bytes, cuts: list[int]) -> list[bytes]:
    edges = sorted({0, len(payload), *(c % (len(payload) + 1) for c in cuts)})
    return [payload[a:b] for a, b in itertools.pairwise(edges)]


def _mostly(right: int) -> st.SearchStrategy[int]:
    """Mostly the right size; else any."""
    return st.one_of(st.just(right), st.just(right), u64)


def _digests(right: str) -> st.SearchStrategy[str]:
    """Mostly the right digest; else another well-formed one, or any text."""
    other = st.binary(max_size=4).map(blob_digest)
    return st.one_of(st.just(right), st.just(right), other, text)


@st.composite
def delta_streams(draw: st.DrawFn) -> list[Any]:
    payload = draw(st.binary(max_size=MAX_SIZE + 16))  # a few over the receiver's limit
    digest = blob_digest(payload)
    header = draw(_transfer_header(_mostly(len(payload)), _digests(digest)))
    chunks = _slices(payload, draw(st.lists(st.integers(0, 2**16), max_size=4)))
    honest = [pb.DeltaChunk(header=header), *chunks]
    any_header = _transfer_header(u64, _digests(digest))
    return _stream(
        draw, honest, any_header.map(lambda h: pb.DeltaChunk(header=h)), pb.DeltaChunk(),
        lambda b: pb.DeltaChunk(data=b),
    )  # fmt: skip


def _data_of(parts: list[Any], message: type[Any]) -> Iterator[bytes]:
    for p in parts[1:]:
        yield bytes(p.data) if isinstance(p, message) else bytes(p)


@pytest.fixture(scope="module")
def spool_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@FUZZ
@given(parts=delta_streams(), spooled=st.booleans())
def test_receive_delta_returns_what_was_announced_or_refuses(
    parts: list[Any], spooled: bool, spool_dir: Path
) -> None:
    try:
        rx = receive_delta(iter(parts), max_size=MAX_SIZE, spool_dir=spool_dir if spooled else None)
    except WireError as e:
        event(e.code.name)
        assert e.code in REFUSALS, (e.code, e.message)
        assert e.message
        assert list(spool_dir.iterdir()) == []  # a refused transfer leaves no file behind
        return
    event("received")
    data = b"".join(_data_of(parts, pb.DeltaChunk))
    assert rx.header == parts[0].header and rx.header.size == len(data) <= MAX_SIZE
    assert bytes(rx.data) == data and rx.digest == rx.header.digest
    assert rx.digest == blob_digest(data)
    if rx.spool_path is not None:
        assert rx.spool_path.read_bytes() == data
        rx.spool_path.unlink()


@st.composite
def merge_streams(draw: st.DrawFn) -> tuple[int, list[Any]]:
    numel = draw(st.integers(0, 24))
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    payload = tensor.numpy().tobytes()
    digest = tensor_digest(tensor)
    header = draw(_merge_header(_mostly(numel), _digests(digest)))
    chunks = _slices(payload, draw(st.lists(st.integers(0, 2**16), max_size=4)))
    honest = [pb.MergeChunk(header=header), *chunks]
    any_header = _merge_header(st.one_of(st.just(numel), u64), _digests(digest))
    expected = draw(st.one_of(st.just(numel), st.integers(0, 24)))
    parts = _stream(
        draw, honest, any_header.map(lambda h: pb.MergeChunk(header=h)), pb.MergeChunk(),
        lambda b: pb.MergeChunk(data=b),
    )  # fmt: skip
    return expected, parts


@FUZZ
@given(stream=merge_streams(), into=st.booleans())
def test_receive_merge_returns_what_was_announced_or_refuses(
    stream: tuple[int, list[Any]], into: bool
) -> None:
    """As the relays and islands call it: with the numel they expect (or a buffer of it)."""
    numel, parts = stream
    out = torch.full((numel,), 7.0) if into else None
    try:
        header, tensor = receive_merge(iter(parts), numel=None if into else numel, out=out)
    except WireError as e:
        event(e.code.name)
        assert e.code in REFUSALS, (e.code, e.message)
        assert e.message
        return
    event("received")
    data = b"".join(_data_of(parts, pb.MergeChunk))
    assert header == parts[0].header and header.numel == numel == tensor.numel()
    assert tensor.numpy().tobytes() == data and tensor_digest(tensor) == header.digest
    if out is not None:
        assert tensor.data_ptr() == out.data_ptr()
