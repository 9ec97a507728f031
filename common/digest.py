"""Content digests: blobs, tensors and whole states.

A state digest covers name-sorted tensors with their dtype and shape, so two
states digest equal exactly when every tensor is bit-identical.  Tensors are
hashed as a two-level hash tree over fixed-size chunks: the chunk hashes are
independent, so they are computed on a thread pool (hashlib releases the GIL
for large buffers) and digesting uses every core; the result does not depend
on the number of threads.

Digest format (version 1), all sha256, hex in the API:
    leaf_i      = sha256(chunk_i)                       chunk = 1 MiB of raw bytes
    tensor_root = sha256("ht-tensor-v1" | dtype | shape | nbytes | leaf_0 | leaf_1 | ...)
    state       = sha256("ht-state-v1" | for each name sorted: len(name) | name | tensor_root)
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

CHUNK_BYTES = 1 << 20
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="digest")
    return _POOL


def blob_digest(data: bytes | bytearray | memoryview) -> str:
    """sha256 hex of raw bytes: the content address of an encoded blob."""
    return hashlib.sha256(data).hexdigest()


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _leaf(buf: memoryview) -> bytes:
    return hashlib.sha256(buf).digest()


def _roots(tensors: list[torch.Tensor], parallel: bool) -> list[bytes]:
    """Hash-tree roots of several tensors; all their chunks go to one pool map."""
    raws = [_raw(t) for t in tensors]
    spans: list[tuple[int, int]] = []
    chunks: list[memoryview] = []
    for raw in raws:
        first = len(chunks)
        chunks.extend(raw[i : i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES))
        spans.append((first, len(chunks)))
    if parallel and len(chunks) > 1:
        leaves = list(_pool().map(_leaf, chunks))
    else:
        leaves = [_leaf(c) for c in chunks]
    roots = []
    for t, raw, (lo, hi) in zip(tensors, raws, spans, strict=True):
        h = hashlib.sha256(b"ht-tensor-v1")
        dtype = str(t.dtype).encode()
        h.update(struct.pack("<B", len(dtype)) + dtype)
        h.update(struct.pack("<B", t.dim()) + b"".join(struct.pack("<Q", d) for d in t.shape))
        h.update(struct.pack("<Q", len(raw)))
        for leaf in leaves[lo:hi]:
            h.update(leaf)
        roots.append(h.digest())
    return roots


def tensor_digest(t: torch.Tensor, *, parallel: bool = True) -> str:
    """Hex digest of one tensor (hash tree, dtype and shape included)."""
    return _roots([t], parallel)[0].hex()


def state_digest(state: Mapping[str, torch.Tensor], *, parallel: bool = True) -> str:
    """Hex digest of a name -> tensor mapping, over name-sorted tensors."""
    names = sorted(state)
    h = hashlib.sha256(b"ht-state-v1")
    for name, root in zip(names, _roots([state[n] for n in names], parallel), strict=True):
        key = name.encode()
        h.update(struct.pack("<I", len(key)) + key)
        h.update(root)
    return h.hexdigest()
