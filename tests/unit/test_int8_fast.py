"""The int8 codec's bytes are pinned: a speed change must not move a single bit.

The hashes below were computed with the straightforward slice-by-slice
implementation (one clamp per slice, 256K-element slices) before the int8 loops
were tuned.  The inputs are built from integer bit patterns (NumPy's frozen
legacy ``RandomState``), so they are the same on every machine and version, and
they hit every branch: scales from 2**-100 to 2**100, subnormal scales whose
quotients pass 127 (the clamp), tiny subnormal values, all-zero blocks with
signed zeros, exact .5 ties (round half even), the largest accepted value
2**127, a short last slice and a short tail block; and the bytes must not
depend on the slice size or the thread count.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import hypertrain.common.codec.int8 as int8_module
from hypertrain.common.codec import make_codec
from hypertrain.common.errors import CodecError

# (spec, numel, seed, sha256 of the encoded blob, sha256 of the decoded fp32 bytes)
PINNED = [
    (
        "int8",
        3 * (1 << 19) + 300,
        0,
        "426ed9f4924539864511810d6a5ca9951726898db58584c4ed8a91e1ec4ba0d4",
        "3ff7101216b22a5847dc15d44ca7429c845492d3e16f6a2ef8ad45776ab7543d",
    ),
    (
        "int8:block=7",
        100_003,
        1,
        "d8eb6ddf50c04996184d8cc57b854694170523811e55e851d64b3574dd2216c2",
        "82c6ffe19edf7eaab139961849c8575cb4ac24baee12de120e19c8bba7630b94",
    ),
    (
        "int8:block=1000",
        1_200_001,
        2,
        "61c3eb540a6f021244f02ffeabe52fb50e7b69b5017d54412a64c9151731404e",
        "694c2c3f888bee44cc56396c8e39e9b51fffd3e70f6ecaf86b54a0c7071bb607",
    ),
]


def pinned_input(numel: int, block: int, seed: int) -> torch.Tensor:
    """A deterministic fp32 tensor assembled from random sign, exponent and mantissa bits."""
    rng = np.random.RandomState(seed)
    mant = rng.randint(0, 1 << 23, size=numel, dtype=np.uint32)
    sign = rng.randint(0, 2, size=numel, dtype=np.uint32) << np.uint32(31)
    nblocks = -(-numel // block)
    base = rng.randint(-100, 101, size=nblocks) + 127  # block exponents: 2**-100 .. 2**100
    kind = rng.randint(0, 16, size=nblocks)
    base[kind == 1] = 4  # tiny normals: the scale absmax/127 is subnormal
    base[kind == 2] = 0  # subnormal values
    base[kind == 3] = 253  # up to 2**127 (exclusive)
    jitter = rng.randint(-6, 1, size=numel)
    exp = np.repeat(base, block)[:numel] + jitter
    exp = np.clip(exp, 0, 253).astype(np.uint32)
    x = (sign | (exp << np.uint32(23)) | mant).view(np.float32).copy()
    blk = np.repeat(kind, block)[:numel]
    # tiny subnormals (a few units of 2**-149): the scale rounds coarsely, quotients pass 127
    shift = np.repeat(rng.randint(8, 23, size=nblocks), block)[:numel].astype(np.uint32)
    tiny = blk == 8
    x[tiny] = (sign[tiny] | (mant[tiny] >> shift[tiny])).view(np.float32)
    x[blk == 4] = 0.0  # all-zero blocks
    x[blk == 5] = np.where(sign[blk == 5] != 0, np.float32(-0.0), np.float32(0.0))  # signed zeros
    # exact ties: halves in a block whose absmax is 127 (scale 1), so round half even decides
    ties = blk == 6
    x[ties] = (rng.randint(-254, 255, size=int(ties.sum())) / 2).astype(np.float32)
    first = np.flatnonzero(kind == 6) * block
    x[first[first < numel]] = 127.0
    top = np.flatnonzero(kind == 7) * block
    x[top[top < numel]] = np.float32(2.0**127)  # the largest value the encoder accepts
    return torch.from_numpy(x)


def sha(data: bytes | bytearray | memoryview | torch.Tensor) -> str:
    raw = data if not isinstance(data, torch.Tensor) else data.contiguous().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def accumulator(numel: int, seed: int) -> torch.Tensor:
    out = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e3
    out[::97] = -0.0  # signed zeros must come out exactly as add_ makes them
    out[1::89] = 0.0
    return out


@pytest.mark.parametrize(("threads", "slice_elems"), [(1, None), (2, None), (2, 1 << 12)])
@pytest.mark.parametrize(("spec", "numel", "seed", "blob_sha", "decoded_sha"), PINNED)
def test_int8_output_is_pinned(
    spec: str,
    numel: int,
    seed: int,
    blob_sha: str,
    decoded_sha: str,
    threads: int,
    slice_elems: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if slice_elems is not None:  # many slices, the last one short
        monkeypatch.setattr(int8_module, "_SLICE", slice_elems)
    codec = make_codec(spec)
    x = pinned_input(numel, int(codec.spec.param("block")), seed)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        blob = codec.encode(x)
        decoded = codec.decode(blob)
        out = accumulator(numel, seed)
        expected = out.clone().add_(decoded)
        codec.decode_accumulate(blob, out)
        # error feedback subtracts in place through the same loop
        sub = accumulator(numel, seed + 1)
        expected_sub = sub.clone().sub_(decoded)
        codec._apply(codec.open(blob)[1], sub, "sub")
    finally:
        torch.set_num_threads(before)
    assert sha(blob) == blob_sha
    assert sha(decoded) == decoded_sha
    assert torch.equal(bits(out), bits(expected))
    assert torch.equal(bits(sub), bits(expected_sub))


@pytest.mark.parametrize(
    ("where", "bad", "message"),
    [
        (-1, float("nan"), "NaN or inf"),  # in the short tail block
        (1 << 20, float("-inf"), "NaN or inf"),  # first element of the second slice
        (5, 3e38, "magnitude > 2\\*\\*127"),
    ],
)
def test_int8_rejections_survive_the_fast_path(where: int, bad: float, message: str) -> None:
    codec = make_codec("int8")
    x = pinned_input(3 * (1 << 19) + 300, 256, 0)
    x[where] = bad
    with pytest.raises(CodecError, match=f"int8 encode: input holds .*{message}"):
        codec.encode(x)


def test_threads_coding_at_once_each_get_their_own_scratch_and_the_same_bits() -> None:
    """Scratch buffers are lent from one pool (``_work_buffer``): coders running at the
    same time must never share one, or each would add the other's slices."""
    import threading

    codec = make_codec("int8")
    gen = torch.Generator().manual_seed(7)
    numel = 3 * (1 << 20) + 5  # several slices each, so the threads' slices interleave
    deltas = [torch.randn(numel, generator=gen) for _ in range(4)]
    blobs = [bytes(codec.encode(d)) for d in deltas]

    def three_sums(blob: bytes) -> bytes:
        acc = torch.zeros(numel)
        for _ in range(3):
            codec.decode_accumulate(blob, acc)
        return acc.numpy().tobytes()

    alone = [three_sums(b) for b in blobs]
    start = threading.Barrier(len(blobs))
    sums: list[bytes] = [b""] * len(blobs)
    encoded: list[bytes] = [b""] * len(blobs)

    def work(i: int) -> None:
        start.wait()
        encoded[i] = bytes(codec.encode(deltas[i]))
        sums[i] = three_sums(blobs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(blobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sums == alone
    assert encoded == blobs


def test_the_scratch_pool_keeps_what_was_in_use_at_once_not_one_per_thread() -> None:
    """A relay's pushes run on many gRPC threads in turn; each used to keep a 4 MiB
    buffer of its own for good.  One at a time, on six threads, they now share one."""
    import threading

    codec = make_codec("int8")
    delta = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
    blob = codec.encode(delta)
    with int8_module._pool_lock:
        int8_module._free.clear()
    for _ in range(6):
        t = threading.Thread(target=lambda: codec.decode_accumulate(blob, torch.zeros(1 << 20)))
        t.start()
        t.join()
    assert len(int8_module._free) == 1


def test_the_scratch_pool_lends_a_buffer_large_enough_when_it_has_one() -> None:
    """A smaller buffer lent to a larger call would be thrown away for a fresh one."""
    small, large = torch.empty(10), torch.empty(1 << 20)
    with int8_module._pool_lock:
        int8_module._free[:] = [large, small]  # the small one on top
    with int8_module._work_buffer(1 << 20) as work:
        assert work is large
    assert {id(w) for w in int8_module._free} == {id(small), id(large)}
