"""Dropping the resident pages of spooled inputs (common/pages.py) and framing an fp32
forward where its values are (Codec.frame_in_place): same bytes, less memory."""

from __future__ import annotations

import itertools
import mmap
from pathlib import Path

import numpy as np
import pytest
import torch
from blake3 import blake3

from hypertrain.common import pages
from hypertrain.common.aggregate import aggregate, streamed_mean
from hypertrain.common.codec import ErrorFeedback, make_codec
from hypertrain.common.codec.header import CHECKSUM_SEGMENT
from hypertrain.common.digest import blob_digest
from hypertrain.common.errors import CodecError, ConfigError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.pages import drop_pages, register_file_map
from hypertrain.wire.daemon import memory_fields


def _mapped(path: Path) -> memoryview:
    t = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
    array = t.numpy()
    register_file_map(array)
    return array.data


def test_a_registered_file_map_leaves_the_resident_set_and_keeps_its_bytes(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 255, 128 << 20, dtype=np.uint8)
    path = tmp_path / "input"
    path.write_bytes(data.tobytes())
    view = _mapped(path)
    before = memory_fields()["rss_mib"]
    assert int(np.frombuffer(view, dtype=np.uint8).sum(dtype=np.int64)) == int(data.sum())
    touched = memory_fields()["rss_mib"]
    assert touched - before >= 120  # every page read is resident
    assert drop_pages(view[1000:])  # a slice advises the whole map
    assert touched - memory_fields()["rss_mib"] >= 120
    assert bytes(view[:4096]) == data[:4096].tobytes()  # read back from the page cache
    assert np.array_equal(np.frombuffer(view, dtype=np.uint8), data)


def test_anything_not_registered_is_left_alone() -> None:
    anon = bytearray(b"\x07" * (1 << 20))
    assert not drop_pages(memoryview(anon))  # advising anonymous memory would zero it
    assert anon == bytearray(b"\x07" * (1 << 20))
    assert not drop_pages(b"bytes") and not drop_pages(np.ones(10).data)


def test_a_streamed_mean_over_spooled_inputs_is_the_same_and_leaves_them_unresident(
    tmp_path: Path,
) -> None:
    codec = make_codec("int8")
    numel = 24 << 20  # 4 inputs of 24 MiB each
    blobs, mapped = {}, {}
    for i in range(4):
        blob = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(i)))
        (tmp_path / f"in{i}").write_bytes(blob)
        blobs[f"eu-{i}"] = blob
        mapped[f"eu-{i}"] = _mapped(tmp_path / f"in{i}")
    want, commitment = aggregate(blobs, codec, (numel,))
    del blobs
    before = memory_fields()["rss_mib"]
    got, again = aggregate(mapped, codec, (numel,))
    assert torch.equal(got, want) and again == commitment
    # The mean (96 MiB) stays; of the 4 x 24 MiB of inputs at most a range's worth does.
    assert memory_fields()["rss_mib"] - before < 96 + 40


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.parametrize("parallel", [False, True])
def test_a_mean_of_many_spooled_inputs_holds_one_input_range_not_one_of_each(
    tmp_path: Path, parallel: bool
) -> None:
    """Each input's range is dropped once it is added, so what the mean keeps of mapped
    inputs while it runs does not grow with their number (a relay's final commit adds
    every delta that came out of member order): 16 int8 inputs of 8 MiB (1 MiB of each
    per range), at each range handed to ``visit``, hold less than 8 MiB of them (about
    a range per worker; dropped after the ranges instead, about 96 MiB stayed mapped)."""
    codec = make_codec("int8")
    numel = 8 << 20
    mapped = {}
    for i in range(16):
        blob = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(i)))
        (tmp_path / f"in{i:02d}").write_bytes(blob)
        mapped[f"eu-{i:02d}"] = _mapped(tmp_path / f"in{i:02d}")
    for view in mapped.values():
        codec.open(view)  # the page cache is warm: what is measured is what stays mapped
        drop_pages(view)
    before = _rss_file_kib()
    most = [0]

    def visit(start: int, acc: torch.Tensor) -> None:
        most[0] = max(most[0], _rss_file_kib() - before)

    streamed_mean(mapped, codec, (numel,), visit=visit, parallel=parallel)
    assert most[0] < 8 << 10, f"{most[0]} KiB of inputs held"


@pytest.mark.parametrize("codec_name", ["int8", "fp32"])
def test_validating_a_mapped_input_drops_what_it_read(tmp_path: Path, codec_name: str) -> None:
    """The checksum and the payload checks read the whole input; they keep at most a piece
    of it resident (a relay summing as deltas arrive holds a model-sized sum meanwhile)."""
    codec = make_codec(codec_name)
    numel = (96 << 20) // (4 if codec_name == "fp32" else 1)  # 96 MiB of payload
    (tmp_path / "in").write_bytes(codec.encode(torch.randn(numel)))
    mapped = _mapped(tmp_path / "in")
    before = memory_fields()["rss_mib"]
    codec.open(mapped)
    assert memory_fields()["rss_mib"] - before < 40
    assert blob_digest(mapped) == blake3((tmp_path / "in").read_bytes()).hexdigest()
    assert memory_fields()["rss_mib"] - before < 40
    assert pages.drop_read(mapped[5000:9000]) and not pages.drop_read(memoryview(b"x" * 9000))


@pytest.mark.parametrize("values", [[1.5, -0.0, 3.0, 0.0], [0.0] * 7])
def test_an_fp32_forward_framed_in_place_is_the_bytes_of_encode(values: list[float]) -> None:
    codec = make_codec("fp32")
    delta = torch.tensor(values, dtype=torch.float32)
    n = delta.numel()
    head = codec.header_length((n,))
    frame = mmap.mmap(-1, head + 4 * n)
    torch.frombuffer(frame, dtype=torch.float32, offset=head, count=n).copy_(delta)
    blob = ErrorFeedback(codec, n).encode_framed(memoryview(frame), (n,))
    assert bytes(blob) == bytes(ErrorFeedback(codec, n).encode(delta.clone()))
    assert torch.equal(codec.decode(blob), delta + 0.0)  # -0.0 sent as +0.0, as encode does


@pytest.mark.parametrize("extra", [-1, 0, 1, 12345])
def test_a_delta_framed_segment_by_segment_is_the_bytes_of_encode(extra: int) -> None:
    """``encode_framed`` with ``fill``: the delta written, normalized, checked and
    checksummed one checksum segment at a time (over several segments, the last short
    or whole), the bytes of ``encode``; a NaN or inf in any segment is refused as
    ``encode`` refuses it, with no header written."""
    codec = make_codec("fp32")
    n = 2 * (CHECKSUM_SEGMENT // 4) + extra
    g = torch.Generator().manual_seed(extra + 7)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    a[::97], b[::97] = -0.0, 0.0  # -0.0 before normalizing, +0.0 on the wire
    head = codec.header_length((n,))
    expected = bytes(ErrorFeedback(codec, n).encode(a - b))

    def framed(bad: int | None) -> tuple[mmap.mmap, list[tuple[int, int]], memoryview]:
        frame = mmap.mmap(-1, head + 4 * n)
        out = torch.frombuffer(frame, dtype=torch.float32, offset=head, count=n)
        filled: list[tuple[int, int]] = []

        def fill(start: int, end: int) -> None:
            filled.append((start, end))
            torch.sub(a[start:end], b[start:end], out=out[start:end])
            if bad is not None and start <= bad < end:
                out[bad] = float("inf")

        return frame, filled, ErrorFeedback(codec, n).encode_framed(memoryview(frame), (n,), fill)

    _, filled, blob = framed(None)
    assert bytes(blob) == expected
    assert filled[0][0] == 0 and filled[-1][1] == n and len(filled) == -(-4 * n // CHECKSUM_SEGMENT)
    for bad in (0, CHECKSUM_SEGMENT // 4, n - 1):
        with pytest.raises(CodecError, match="NaN or inf"):
            framed(bad)


def test_a_layout_subtracts_any_range_with_the_bits_of_the_whole() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    layout = ParamLayout.of(model)
    base = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    whole = base.clone()
    layout.subtract_from(model, whole)
    for cuts in ([], [1], [7, 35, 40], list(range(0, layout.numel, 4))):
        edges = [0, *cuts, layout.numel]
        got = base.clone()
        for lo, hi in itertools.pairwise(edges):
            layout.subtract_from(model, got[lo:hi], lo)
        assert torch.equal(got.view(torch.int32), whole.view(torch.int32))
    with pytest.raises(ConfigError, match="not within"):
        layout.subtract_from(model, base[:5], layout.numel - 4)


def test_in_place_framing_refuses_what_encode_refuses() -> None:
    codec = make_codec("fp32")
    head = codec.header_length((3,))
    frame = bytearray(head + 12)
    torch.frombuffer(frame, dtype=torch.float32, offset=head, count=3)[1] = float("nan")
    with pytest.raises(CodecError, match="NaN or inf"):
        codec.frame_in_place(frame, (3,))
    assert bytes(frame[:head]) == bytes(head)  # no header written
    with pytest.raises(CodecError, match="expected"):
        codec.frame_in_place(bytearray(head + 8), (3,))
    for spec in ("int8", "fp32+zstd"):
        with pytest.raises(CodecError, match="cannot frame"):
            make_codec(spec).frame_in_place(bytearray(64), (3,))
    lossy = ErrorFeedback(make_codec("int8"), 3)
    with pytest.raises(CodecError, match="in-place framing"):
        lossy.encode_framed(memoryview(bytearray(64)), (3,))


def _anon_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssAnon")))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_populate_makes_a_tensor_s_memory_resident_and_keeps_its_bytes() -> None:
    """``populate`` faults every page of a fresh tensor in (the resident set grows by its
    size) and writes no byte: what was written before is there after, and the memory
    torch did not write still reads as it did."""
    n = 16 << 20  # 64 MiB of fp32 in a mapping of its own, untouched
    # Not torch.empty: malloc may serve it from a free block of its heap that an earlier
    # test left resident (the suite once measured 0 KiB grown that way).
    private = mmap.mmap(-1, 4 * n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(private, dtype=torch.float32)  # nothing faulted yet
    t[:3] = torch.tensor([1.5, -2.0, 3.25])
    t[n // 8 : n // 8 + 2] = 7.0
    before = _anon_kib()
    if not pages.populate(t):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    grown = _anon_kib() - before
    assert grown >= (t.numel() * 4 >> 10) * 9 // 10, grown  # KiB
    assert t[:3].tolist() == [1.5, -2.0, 3.25] and t[n // 8 : n // 8 + 2].tolist() == [7.0, 7.0]
    assert not pages.populate(t[::2])  # not contiguous: left alone
    assert not pages.populate(torch.empty(0))


def test_unshared_sees_every_other_holder_of_a_tensor_s_memory() -> None:
    """``unshared`` says True only for a tensor nothing else holds: not while a view, a
    numpy array, a memoryview (``fp32_bytes``), its storage, a second name or a container
    holds it or its memory; True again once each is let go.  (On this interpreter the
    counts are the ones it expects: ``_calibrated``.)"""
    assert pages._COUNTS_HOLD
    from hypertrain.wire.chunks import fp32_bytes

    t = torch.arange(1024, dtype=torch.float32)
    assert pages.unshared(t, holders=1)
    assert not pages.unshared(t, holders=2)  # the caller counted a holder it has not
    other = t
    assert not pages.unshared(t, holders=1)
    del other
    held: list[object] = [t]
    assert not pages.unshared(t, holders=1)
    held.clear()
    for make in (
        lambda: t.view(-1),
        lambda: t[10:20],
        lambda: t.numpy(),
        lambda: fp32_bytes(t),
        lambda: t.detach(),
        lambda: t.untyped_storage(),  # (as a pickler writing a checkpoint holds it)
    ):
        holder = make()
        assert not pages.unshared(t, holders=1)
        del holder
        assert pages.unshared(t, holders=1)
    base = torch.zeros(8)
    part = base[2:6]
    del base
    assert not pages.unshared(part, holders=1)  # a view: the memory is not its alone
