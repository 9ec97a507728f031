"""A blob surveyed as it arrives (codec/survey.py) is checked to the same outcome as one
read whole: ``Codec.open`` of a registered buffer returns the same header and magnitude,
or raises the same ``CodecError``, as ``open`` of the same bytes unregistered, for any
chunking and any bytes; the surveyed path does not read the payload again."""

from __future__ import annotations

import itertools
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypertrain.common.codec import header as header_mod
from hypertrain.common.codec import make_codec, read_header, survey
from hypertrain.common.codec.header import CHECKSUM_SEGMENT, seal
from hypertrain.common.digest import blob_digest
from hypertrain.common.errors import CodecError
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.chunks import delta_chunks, receive_delta

SPECS = ["fp32", "fp32+zstd", "int8:block=16", "sparseloco:density=0.1,value_bits=2,chunk=64"]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encoded(spec: str, n: int, seed: int = 0) -> bytes:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return bytes(make_codec(spec).encode(x))


def surveyed(blob: bytes, cuts: list[int]) -> memoryview:
    """``blob`` in an array of its own, surveyed in the chunks ``cuts`` split it into, and
    registered as a receiver registers its spooled map."""
    array = np.frombuffer(bytearray(blob), dtype=np.uint8)
    array.flags.writeable = False  # as the receiver hands it on
    s = survey.Survey(len(blob))
    edges = [0, *sorted({c % (len(blob) + 1) for c in cuts}), len(blob)]
    for a, b in itertools.pairwise(edges):
        s.feed(blob[a:b])
    survey.register(array, s.facts())
    return array.data


def outcome(spec: str, data: Any) -> tuple[Any, ...]:
    codec = make_codec(spec)
    try:
        header, prepared = codec.open(data)
    except CodecError as e:
        return ("refused", str(e))
    return ("ok", header, codec.magnitude(header, prepared))


def reseal(blob: bytearray) -> bytes:
    """The checksum written again after a forged change to the payload."""
    n = read_header(blob).header_len
    head = bytearray(blob[:n])
    head[12:16] = bytes(4)
    seal(head, blob[n:])
    return bytes(head) + bytes(blob[n:])


@FAST
@given(
    spec=st.sampled_from(SPECS),
    n=st.integers(0, 300),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=6),
    aligned=st.booleans(),
    flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=2),
    forged=st.sampled_from([None, 0.0, float("nan"), float("inf"), -3e38, -1.0, 1e38]),
    minus128=st.integers(0, 1 << 16) | st.none(),
)
def test_open_of_a_surveyed_blob_has_the_outcome_of_open_of_its_bytes(
    spec: str,
    n: int,
    cuts: list[int],
    aligned: bool,
    flips: list[tuple[int, int]],
    forged: float | None,
    minus128: int | None,
) -> None:
    """Any chunking (``aligned``: between values, where the values are surveyed too), a
    value forged under a good checksum (an fp32 value or an int8 scale, ``forged``; an
    int8 code of -128 at ``minus128``), bytes flipped anywhere."""
    blob = bytearray(encoded(spec, n, seed=len(cuts)))
    head = read_header(blob).header_len
    if aligned:
        cuts = [head + 4 * (c % (n + 1)) for c in cuts]
    int8 = spec.startswith("int8")
    floats = n if spec == "fp32" else -(-n // 16) if int8 else 0  # values / scales
    if forged is not None and floats:  # a value the checksum vouches for
        struct.pack_into("<f", blob, head + 4 * (cuts[0] % floats if cuts else 0), forged)
        blob = bytearray(reseal(blob))
    if minus128 is not None and int8 and n:
        blob[head + 4 * floats + minus128 % n] = 0x80
        blob = bytearray(reseal(blob))
    for at, x in flips:  # bytes the checksum does not vouch for (header or payload)
        blob[at % len(blob)] ^= x
    data = bytes(blob)
    assert outcome(spec, surveyed(data, cuts)) == outcome(spec, data)


@pytest.mark.parametrize("spec", ["fp32", "int8:block=16"])
def test_segments_and_values_are_surveyed_across_chunks_of_every_size(spec: str) -> None:
    """Several checksum segments, chunks that straddle them and the header; the facts are
    those ``open`` computes (the same checksum, fp32's largest magnitude, int8's largest
    scale), and a value split between two chunks leaves the values to ``open``."""
    blob = encoded(spec, (2 * CHECKSUM_SEGMENT + 12345 * 8) // (4 if spec == "fp32" else 1), seed=3)
    h = read_header(blob)
    for cuts in ([], [1 << 20, 2 << 20, 7 << 20], [5, 17, h.header_len + 8, 7 << 20], [6, 4099]):
        facts = survey.facts_of(surveyed(blob, cuts))
        assert facts is not None and facts.header_len == h.header_len
        zeroed = bytearray(blob[: h.header_len])
        zeroed[12:16] = bytes(4)
        whole = header_mod.checksum(zeroed, memoryview(blob)[h.header_len :])
        assert header_mod.checksum(zeroed, b"", facts.crcs) == whole == h.checksum
        assert len(facts.crcs) == -(-h.payload_len // CHECKSUM_SEGMENT)
        # fp32: every payload byte is a value's; int8: the scales' (the first 4 bytes a
        # block), where the codes that follow are single bytes
        end = h.payload_len if spec == "fp32" else 4 * -(-h.numel // 16)
        split = any((c - h.header_len) % 4 for c in cuts if h.header_len < c < h.header_len + end)
        values = torch.frombuffer(bytearray(blob[h.header_len :][:end]), dtype=torch.float32)
        assert facts.top == (None if split else float(values.abs().max()))


def test_only_a_whole_registered_buffer_has_facts() -> None:
    blob = encoded("fp32", 1000)
    view = surveyed(blob, [4096])
    assert survey.facts_of(view) is not None
    assert survey.facts_of(view[1:]) is None and survey.facts_of(view[:-1]) is None
    assert survey.facts_of(memoryview(bytes(view))) is None
    assert survey.facts_of(bytes(view)) is None
    array = np.frombuffer(bytearray(blob), dtype=np.uint8)
    s = survey.Survey(len(blob) + 1)  # fed less than the size it was made for
    s.feed(blob)
    assert s.facts() is None
    whole = survey.Survey(len(blob))
    whole.feed(blob)
    survey.register(array, whole.facts())  # writable: a later write would make them stale
    assert survey.facts_of(array.data) is None
    array.flags.writeable = False
    survey.register(array, s.facts())
    assert survey.facts_of(array.data) is None


def test_facts_go_with_their_buffer() -> None:
    view = surveyed(encoded("fp32", 100), [])
    key = id(view.obj)
    assert key in survey._SURVEYED
    del view
    assert key not in survey._SURVEYED


@pytest.mark.parametrize("spec", ["fp32", "int8:block=16"])
def test_a_spooled_delta_is_checked_without_reading_its_payload_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    """Received through the spool (``receive_delta``), an fp32 or int8 delta opens from its
    facts: neither the checksum's segments nor the values are read (both spied on), with
    the header, magnitude and decoded sum of the same bytes opened whole."""
    blob = encoded(spec, 3 * (1 << 20) // 4 + 77, seed=5)
    header = pb.TransferHeader(digest=blob_digest(blob), size=len(blob))
    got = receive_delta(delta_chunks(header, blob), max_size=len(blob), spool_dir=tmp_path)
    facts = survey.facts_of(got.data)
    assert facts is not None and facts.top is not None
    codec = make_codec(spec)
    expected = outcome(spec, blob)
    read: list[str] = []
    kind = type(codec)
    real_checksum, real_prepare = header_mod.checksum, kind._prepare

    def checksum(head: Any, payload: Any, crcs: Any = None) -> int:
        if crcs is None:
            read.append("checksum")
        return real_checksum(head, payload, crcs)

    def prepare(self: Any, raw: Any, numel: int) -> Any:
        read.append("values")
        return real_prepare(self, raw, numel)

    monkeypatch.setattr(header_mod, "checksum", checksum)
    monkeypatch.setattr(kind, "_prepare", prepare)
    assert outcome(spec, got.data) == expected and read == []
    out, ref = torch.zeros(read_header(blob).numel), torch.zeros(read_header(blob).numel)
    codec.decode_accumulate(got.data, out)
    assert read == []
    codec.decode_accumulate(blob, ref)
    assert read == ["checksum", "values"]
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_random_bytes_received_open_as_they_would_unsurveyed(tmp_path: Path) -> None:
    for size in (0, 5, 31, 32, 33, 4096):
        data = os.urandom(size)
        for good_magic in (False, True):
            if good_magic and size >= 4:
                data = b"HTCD" + data[4:]
            header = pb.TransferHeader(digest=blob_digest(data), size=len(data))
            got = receive_delta(
                delta_chunks(header, data), max_size=max(1, size), spool_dir=tmp_path
            )
            for spec in ("fp32", "int8:block=16"):
                assert outcome(spec, got.data) == outcome(spec, data)


@pytest.mark.parametrize("values", [[1.0, -5.0, 2.0], [-0.0, 0.0], [3e38, -3.4e38], []])
def test_the_largest_magnitude_is_the_one_open_finds(values: list[float]) -> None:
    blob = bytes(make_codec("fp32").encode(torch.tensor(values, dtype=torch.float32)))
    head = read_header(blob).header_len
    for cuts in ([], [head + 4], [head + 4, head + 8]):
        view = surveyed(blob, cuts)
        facts = survey.facts_of(view)
        assert facts is not None and facts.top is not None
        assert outcome("fp32", view) == outcome("fp32", blob)
        assert facts.top == max([0.0, *torch.tensor(values, dtype=torch.float32).abs().tolist()])


def test_registering_from_a_dying_buffers_callback_does_not_hang() -> None:
    """A registered array freed where ``register`` or ``facts_of`` runs (a garbage
    collection started there frees it, and its entry goes) on the same thread: the
    registry takes no lock, so neither waits for itself."""
    first = surveyed(encoded("fp32", 64), [])
    other = encoded("fp32", 32)
    seen: list[Any] = []

    def dying(_: Any) -> None:
        seen.append(survey.facts_of(surveyed(other, [])))

    owner = first.obj
    hook = __import__("weakref").ref(owner, dying)
    del first, owner
    assert hook() is None and len(seen) == 1 and seen[0] is not None


def test_a_received_delta_is_read_only(tmp_path: Path) -> None:
    blob = encoded("fp32", 1000)
    header = pb.TransferHeader(digest=blob_digest(blob), size=len(blob))
    got = receive_delta(delta_chunks(header, blob), max_size=len(blob), spool_dir=tmp_path)
    assert got.data.readonly and survey.facts_of(got.data) is not None
    with pytest.raises(TypeError):
        got.data[0] = 0


@pytest.mark.parametrize("extra", [0, 4, -4])
@pytest.mark.parametrize("where", ["first", "boundary", "last"])
def test_a_forged_value_at_a_segment_edge_is_refused_through_the_spool(
    tmp_path: Path, extra: int, where: str
) -> None:
    """A payload of one checksum segment and a value more or less, an inf under a good
    checksum at its first value, at the segment's edge or at its last, received in chunks
    of several sizes: refused as the same bytes are, unsurveyed."""
    n = (CHECKSUM_SEGMENT + extra) // 4
    blob = bytearray(encoded("fp32", n, seed=9))
    head = read_header(blob).header_len
    at = {"first": 0, "last": 4 * (n - 1), "boundary": min(CHECKSUM_SEGMENT, 4 * (n - 1))}[where]
    struct.pack_into("<f", blob, head + at, float("inf"))
    data = reseal(blob)
    for chunk in (1 << 20, head + CHECKSUM_SEGMENT, 4096 + 4):
        header = pb.TransferHeader(digest=blob_digest(data), size=len(data))
        parts = delta_chunks(header, data, chunk_bytes=chunk)
        got = receive_delta(parts, max_size=len(data), spool_dir=tmp_path)
        assert survey.facts_of(got.data) is not None
        assert outcome("fp32", got.data) == outcome("fp32", data)
        assert outcome("fp32", got.data)[0] == "refused"


@pytest.mark.parametrize(
    "forge", ["nan first scale", "negative last scale", "-128 first code", "-128 last code"]
)
def test_a_forged_int8_scale_or_code_is_refused_through_the_spool(
    tmp_path: Path, forge: str
) -> None:
    """An int8 payload whose scales end inside a chunk (the survey checks the chunk's
    scales and codes apart): a bad scale or code under a good checksum, at either side
    of where the scales meet the codes, in chunks cut there, just after, or anywhere,
    is refused as the same bytes are, unsurveyed; the good payload opens from its facts."""
    n = (1 << 20) + 5 * 16 + 3
    good = encoded("int8:block=16", n, seed=11)
    head = read_header(good).header_len
    codes = head + 4 * -(-n // 16)
    what, where = forge.rsplit(" ", 1)[0], forge.split(" ")[1]
    blob = bytearray(good)
    if what.endswith("scale"):
        value = float("nan") if what.startswith("nan") else -1.0
        struct.pack_into("<f", blob, head if where == "first" else codes - 4, value)
    else:
        blob[codes if where == "first" else len(blob) - 1] = 0x80
    data = reseal(blob)
    for chunk in (1 << 20, codes, codes + 2, 4096 + 1):
        for payload in (good, data):
            header = pb.TransferHeader(digest=blob_digest(payload), size=len(payload))
            parts = delta_chunks(header, payload, chunk_bytes=chunk)
            got = receive_delta(parts, max_size=len(payload), spool_dir=tmp_path)
            facts = survey.facts_of(got.data)
            assert facts is not None
            assert outcome("int8:block=16", got.data) == outcome("int8:block=16", payload)
            if payload is good and (chunk - head) % 4 == 0:  # no scale split: surveyed
                assert facts.top is not None
        assert facts.top is None  # the forged one's values: left to open
        assert outcome("int8:block=16", got.data)[0] == "refused"


def test_int8_scales_of_negative_zero_give_one_magnitude_surveyed_or_not() -> None:
    """Scales of -0.0 only (accepted: ``>= 0``): the magnitude is +0.0 either way, not
    -0.0 read whole and +0.0 from the survey's running maximum (``==`` cannot tell)."""
    n = 64
    blob = bytearray(encoded("int8:block=16", n))
    head = read_header(blob).header_len
    for i in range(n // 16):
        struct.pack_into("<f", blob, head + 4 * i, -0.0)
    data = reseal(blob)
    want = outcome("int8:block=16", data)
    assert want[0] == "ok" and struct.pack("<d", want[2]) == struct.pack("<d", 0.0)
    for cuts in ([], [head + 4], [head + 4 * (n // 16) + 1]):
        view = surveyed(data, cuts)
        facts = survey.facts_of(view)
        assert facts is not None and facts.top is not None
        got = outcome("int8:block=16", view)
        assert got == want and struct.pack("<d", got[2]) == struct.pack("<d", want[2])
