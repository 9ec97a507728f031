"""The digest format (version 2, common/digest.py's docstring) against an implementation
written from that docstring alone, and BLAKE3 against its published test vector."""

from __future__ import annotations

import struct

import pytest
import torch
from blake3 import blake3

from hypertrain.common.digest import (
    CHUNK_BYTES,
    DIGEST_FORMAT,
    blob_digest,
    content_hasher,
    state_digest,
    tensor_digest,
    zeros_digest,
)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensor_root(t: torch.Tensor) -> bytes:
    raw = _raw(t) if t.numel() else b""
    dtype = str(t.dtype).encode()
    head = b"ht-tensor-v2" + bytes([len(dtype)]) + dtype + bytes([t.dim()])
    head += b"".join(struct.pack("<Q", d) for d in t.shape) + struct.pack("<Q", len(raw))
    leaves = [blake3(raw[i : i + CHUNK_BYTES]).digest() for i in range(0, len(raw), CHUNK_BYTES)]
    return blake3(head + b"".join(leaves)).digest()


def _state(state: dict[str, torch.Tensor]) -> str:
    h = blake3(b"ht-state-v2")
    for name in sorted(state):
        key = name.encode()
        h.update(struct.pack("<I", len(key)) + key + _tensor_root(state[name]))
    return h.hexdigest()


def test_blob_digests_are_blake3() -> None:
    assert DIGEST_FORMAT == 2
    # BLAKE3's published test vector for "abc" (the reference implementation's README)
    want = "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
    assert blob_digest(b"abc") == blob_digest(memoryview(b"abc")) == want


@pytest.mark.parametrize("nbytes", [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, 3 * CHUNK_BYTES + 5])
def test_a_blob_hashed_whole_in_pieces_or_streamed_has_one_digest(nbytes: int) -> None:
    data = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    raw = data.numpy().tobytes()
    stream = content_hasher()
    for i in range(0, nbytes, 4099):  # pieces that end anywhere
        stream.update(raw[i : i + 4099])
    want = blake3(raw).hexdigest()
    assert blob_digest(raw) == blob_digest(memoryview(raw)) == stream.hexdigest() == want


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(10, dtype=torch.float32),
        torch.zeros(0),
        torch.tensor(3.5),
        torch.randn(3, CHUNK_BYTES // 12 + 7, generator=torch.Generator().manual_seed(2)),
        torch.randn(CHUNK_BYTES // 2, generator=torch.Generator().manual_seed(3)).to(
            torch.bfloat16
        ),
        torch.randn(2 * CHUNK_BYTES // 4, generator=torch.Generator().manual_seed(4)),
    ],
    ids=["small", "empty", "scalar", "2d-tail", "bf16", "two-chunks"],
)
def test_tensor_digests_follow_the_documented_format(tensor: torch.Tensor) -> None:
    want = _tensor_root(tensor).hex()
    assert tensor_digest(tensor) == tensor_digest(tensor, parallel=False) == want


def test_state_and_zeros_digests_follow_the_documented_format() -> None:
    g = torch.Generator().manual_seed(5)
    state = {"b.weight": torch.randn(300, 1000, generator=g), "a": torch.randn(7, generator=g)}
    assert state_digest(state) == state_digest(state, parallel=False) == _state(state)
    for n in (0, 5, CHUNK_BYTES // 4, CHUNK_BYTES // 4 * 3 + 1):
        assert zeros_digest(n) == _tensor_root(torch.zeros(n)).hex()
