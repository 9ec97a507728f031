"""Hostile bytes: every malformed blob is a CodecError, never another exception.

Covers random bytes, single-byte corruption, truncation, trailing garbage,
forged payloads with a recomputed checksum (so the payload validation itself
is exercised), wrong codec or shape, and zstd bombs.  A failed
``decode_accumulate`` must leave its accumulator untouched.
"""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypertrain.common.codec import make_codec, read_header
from hypertrain.common.codec.header import pack_header, seal
from hypertrain.common.codec.layout import raw_length
from hypertrain.common.errors import CodecError

SPECS = [
    "fp32",
    "fp32+zstd",
    "int8:block=16",
    "int8+zstd",
    "sparseloco:density=0.1,value_bits=2,chunk=64",
    "sparseloco:density=0.05,value_bits=4,chunk=100+zstd",
    "sparseloco:density=0.5,value_bits=8,chunk=7",
]
HOSTILE = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHAPE = (3, 70)


def blob_for(spec: str, seed: int = 0) -> bytes:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    return bytes(make_codec(spec).encode(x))


def reseal(blob: bytes | bytearray) -> bytes:
    """Recompute the checksum after a forged change (the header must still parse)."""
    header_len = read_header(blob).header_len
    head = bytearray(blob[:header_len])
    head[12:16] = bytes(4)
    seal(head, blob[header_len:])
    return bytes(head) + bytes(blob[header_len:])


def assert_rejected_cleanly(spec: str, data: bytes) -> None:
    """Decoding raises CodecError and leaves an accumulator bit-for-bit unchanged."""
    codec = make_codec(spec)
    with pytest.raises(CodecError):
        codec.decode(data)
    out = torch.randn(SHAPE)
    before = out.clone()
    with pytest.raises(CodecError):
        codec.decode_accumulate(data, out)
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))


def decode_or_codec_error(spec: str, data: bytes) -> None:
    """Forged-but-sealed payloads may be valid; if so they must decode to finite values."""
    codec = make_codec(spec)
    out = torch.randn(SHAPE)
    before = out.clone()
    try:
        y = codec.decode(data, SHAPE)
    except CodecError:
        with pytest.raises(CodecError):
            codec.decode_accumulate(data, out)
        assert torch.equal(out.view(torch.int32), before.view(torch.int32))
        return
    assert y.shape == SHAPE and bool(torch.isfinite(y).all())
    codec.decode_accumulate(data, out)
    assert torch.equal(out.view(torch.int32), before.add_(y).view(torch.int32))


@given(data=st.binary(max_size=400))
@HOSTILE
def test_random_bytes_are_rejected(data: bytes) -> None:
    for spec in SPECS:
        assert_rejected_cleanly(spec, data)
    with pytest.raises(CodecError):
        read_header(data)


@given(prefix=st.binary(max_size=64))
@HOSTILE
def test_random_bytes_after_a_valid_magic_are_rejected(prefix: bytes) -> None:
    assert_rejected_cleanly("int8:block=16", b"HTCD\x01\x02" + prefix)


@pytest.mark.parametrize("spec", SPECS)
@given(data=st.data())
@HOSTILE
def test_any_single_byte_corruption_is_detected(spec: str, data: st.DataObject) -> None:
    blob = bytearray(blob_for(spec))
    pos = data.draw(st.integers(0, len(blob) - 1))
    blob[pos] ^= data.draw(st.integers(1, 255))
    assert_rejected_cleanly(spec, bytes(blob))


@pytest.mark.parametrize("spec", SPECS)
@given(data=st.data())
@HOSTILE
def test_truncation_and_trailing_garbage_are_rejected(spec: str, data: st.DataObject) -> None:
    blob = bytes(blob_for(spec))
    assert_rejected_cleanly(spec, blob[: data.draw(st.integers(0, len(blob) - 1))])
    assert_rejected_cleanly(spec, blob + data.draw(st.binary(min_size=1, max_size=16)))


@pytest.mark.parametrize("spec", SPECS)
@given(data=st.data())
@HOSTILE
def test_forged_payloads_decode_or_raise_codec_error(spec: str, data: st.DataObject) -> None:
    # Forge the raw (unframed) payload, then frame and checksum it properly, so
    # the codec's own payload validation is what has to catch it.
    blob = blob_for(spec)
    header = read_header(blob)
    payload = blob[header.header_len :]
    raw = bytearray(zstandard.decompress(payload) if header.zstd else payload)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.sampled_from([0x00, 0x01, 0x80, 0xFF, 0x7F, 0xC0]))
    framed = zstandard.ZstdCompressor().compress(raw) if header.zstd else bytes(raw)
    decode_or_codec_error(spec, forged_blob(spec, SHAPE, framed, len(raw)))


def test_forged_int8_fields_are_named() -> None:
    spec = "int8:block=16"
    blob = bytearray(blob_for(spec))
    start = read_header(blob).header_len
    nblocks = -(-210 // 16)
    for offset, value, message in [
        (start, struct.pack("<f", float("nan")), "NaN or inf"),
        (start, struct.pack("<f", -1.0), "negative scale"),
        (start, struct.pack("<f", 1e38), "2\\*\\*127"),
        (start + 4 * nblocks + 5, b"\x80", "-128"),
    ]:
        forged = bytearray(blob)
        forged[offset : offset + len(value)] = value
        with pytest.raises(CodecError, match=message):
            make_codec(spec).decode(reseal(forged))


def test_forged_sparseloco_fields_are_named() -> None:
    spec = "sparseloco:density=0.1,value_bits=2,chunk=64"
    blob = bytearray(make_codec(spec).encode(torch.randn(200)))
    start = read_header(blob).header_len
    chunks = 4
    kept = 3 * 6 + 1  # 3 chunks of 64 keep 6, the tail of 8 keeps 1: 19 codes, 1 padding code
    gap_hi = start + 8 * chunks + kept
    for offset, value, message in [
        (start, struct.pack("<f", float("inf")), "not finite"),
        (start + 4 * chunks, struct.pack("<f", -2.0), "negative"),
        (gap_hi, b"\x01", "outside its chunk"),
        (len(blob) - 1, b"\xff", "padding"),
    ]:
        forged = bytearray(blob)
        forged[offset : offset + len(value)] = value
        with pytest.raises(CodecError, match=message):
            make_codec(spec).decode(reseal(forged))


def test_fp32_payload_with_nan_is_rejected() -> None:
    blob = bytearray(blob_for("fp32"))
    start = read_header(blob).header_len
    blob[start + 8 : start + 12] = struct.pack("<f", float("nan"))
    assert_rejected_cleanly("fp32", reseal(blob))


def test_wrong_codec_or_params_are_rejected() -> None:
    blob = blob_for("int8:block=16")
    for other in ["int8", "int8:block=16+zstd", "fp32", "sparseloco"]:
        with pytest.raises(CodecError, match="encoded with codec int8:block=16"):
            make_codec(other).decode(blob)


def test_wrong_shape_is_rejected() -> None:
    for spec in SPECS:
        codec = make_codec(spec)
        blob = blob_for(spec)
        with pytest.raises(CodecError, match="shape"):
            codec.decode(blob, (70, 3))
        for shape in [(210, 1), (211,), (3, 71)]:
            out = torch.zeros(shape)
            with pytest.raises(CodecError, match="shape"):
                codec.decode_accumulate(blob, out)
        flat = torch.zeros(210)  # a flat accumulator of the same size is accepted
        codec.decode_accumulate(blob, flat)
        assert torch.equal(flat, codec.decode(blob).view(-1))


def test_bad_accumulators_are_rejected() -> None:
    codec = make_codec("int8")
    blob = blob_for("int8")
    for out in [torch.zeros(SHAPE, dtype=torch.float64), torch.zeros(70, 3).t()]:
        with pytest.raises(CodecError):
            codec.decode_accumulate(blob, out)


def forged_blob(spec: str, shape: tuple[int, ...], payload: bytes, raw_len: int) -> bytes:
    """A well-formed, correctly checksummed header around an arbitrary payload."""
    codec = make_codec(spec)
    header = pack_header(codec.spec, shape, len(payload), raw_len)
    seal(header, payload)
    return bytes(header) + payload


def test_zstd_bombs_are_rejected_before_decompressing() -> None:
    spec, shape = "fp32+zstd", (10,)
    # A frame that declares far more than the header's shape allows.
    big = zstandard.ZstdCompressor().compress(bytes(1 << 24))
    assert len(big) < 1024
    with pytest.raises(CodecError, match="declares 16777216 bytes"):
        make_codec(spec).decode(forged_blob(spec, shape, big, 40))
    # A frame that does not record its content size.
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(40))
    with pytest.raises(CodecError, match="content size"):
        make_codec(spec).decode(forged_blob(spec, shape, unsized, 40))
    # A frame that lies: declares 40 bytes, holds 100000 (content-size field patched).
    frame = bytearray(zstandard.ZstdCompressor().compress(bytes(100_000)))
    descriptor = frame[4]
    assert descriptor >> 6 == 2 and descriptor & 0x20  # 4-byte size, single segment
    frame[5:9] = struct.pack("<I", 40)
    assert_rejected_cleanly(spec, forged_blob(spec, shape, bytes(frame), 40))
    # Two frames back to back, and a frame followed by garbage.
    small = zstandard.ZstdCompressor().compress(bytes(40))
    assert_rejected_cleanly(spec, forged_blob(spec, shape, small + small, 40))
    assert_rejected_cleanly(spec, forged_blob(spec, shape, small + b"junk", 40))
    # The header itself may not claim a raw length other than the layout's.
    with pytest.raises(CodecError, match="raw length"):
        read_header(forged_blob(spec, shape, big, 1 << 24))


def test_expected_shape_bounds_work_before_the_payload_is_touched() -> None:
    # A header claiming 2**40 values, with a zstd frame header that claims the
    # matching raw size, is refused on the caller's shape, and without one on
    # zstd's maximum ratio: nothing of that size is allocated either way.
    spec = "sparseloco+zstd"
    raw_len = raw_length(make_codec(spec).spec, 1 << 40)
    frame = b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", raw_len) + b"\x03\x00\x00\x00"
    blob = forged_blob(spec, (1 << 40,), frame, raw_len)
    with pytest.raises(CodecError, match="shape"):
        make_codec(spec).decode(blob, (100,))
    with pytest.raises(CodecError, match="max ratio"):
        make_codec(spec).decode(blob)
    with pytest.raises(CodecError, match="shape"):
        make_codec(spec).decode_accumulate(blob, torch.zeros(100))
