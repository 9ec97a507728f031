"""Content digests: blobs, tensors and whole states.

A state digest covers name-sorted tensors with their dtype and shape, so two
states digest equal exactly when every tensor is bit-identical.  Tensors are
hashed as a two-level hash tree over fixed-size chunks: the chunk hashes are
independent, so they are computed on a thread pool (the hash releases the GIL
for large buffers) and digesting uses every core; the result does not depend
on the number of threads.

Digest format (version 2), all BLAKE3 (32-byte output, its default mode), hex in the API:
    blob        = BLAKE3(bytes)                         an encoded blob's content address
    leaf_i      = BLAKE3(chunk_i)                       chunk = 1 MiB of raw bytes
    tensor_root = BLAKE3("ht-tensor-v2" | dtype | shape | nbytes | leaf_0 | leaf_1 | ...)
    state       = BLAKE3("ht-state-v2" | for each name sorted: len(name) | name | tensor_root)

    where dtype = u8 length | ASCII ``str(tensor.dtype)`` ("torch.float32"); shape =
    u8 number of dims | each dim as u64; nbytes = u64; len(name) = u32 | UTF-8 name;
    all integers little-endian; a tensor with no bytes has no leaves.

Version 1 was the same with sha256 and "-v1" tags.  Why BLAKE3: every byte of a round
is hashed on each hop (sender, receiver, the merge's new state, the outer state), and
on this project's 2-core test machine sha256 (with the CPU's SHA extensions) hashed
about 1.05 GB/s on one core against BLAKE3's 3.6 GB/s: at P = 1e8, sha256 was about
2.3 s of a 6 s int8 sync (issue 12, measured 2026-12-06).  Tapes record the format
they were written in (``tape_format.FORMAT_VERSION``): a build reads only its own.
The event tape's own hash chain and Merkle tree (``trust/merkle.py``, small inputs)
stay sha256.
"""

from __future__ import annotations

import math
import os
import struct
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from blake3 import blake3

from hypertrain.common.pages import PIECE_BYTES, pieces

CHUNK_BYTES = 1 << 20
TASK_BYTES = 4 * CHUNK_BYTES
"""Least bytes one pool task hashes (several chunks, or many small tensors' chunks):
scheduling a task costs more than hashing a small tensor's one chunk."""
_TASKS_PER_WORKER = 8
_WORKERS = os.cpu_count() or 1
_POOL: ThreadPoolExecutor | None = None

DIGEST_FORMAT = 2
"""The digest format this build computes (module docstring)."""
_TENSOR_TAG = b"ht-tensor-v2"
_STATE_TAG = b"ht-state-v2"


def content_hasher() -> blake3:
    """An incremental hash of a byte stream (``update`` it in order, then ``hexdigest``):
    the ``blob_digest`` of everything it was given (a receiver hashes a transfer as it
    arrives, ``services/wire/spool.py``)."""
    return blake3()


def leaf_hash(chunk: bytes | bytearray | memoryview) -> bytes:
    """One leaf of a tensor's hash tree: the hash of one chunk of its bytes (a byte
    buffer: BLAKE3 refuses a typed memoryview that hashlib took, so cast it first)."""
    return blake3(chunk).digest()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="digest")
    return _POOL


def blob_digest(data: bytes | bytearray | memoryview) -> str:
    """The content address of an encoded blob: BLAKE3 hex of its bytes (a mapped spool
    file is read a piece at a time and its pages dropped, ``common/pages.py``).  On one
    thread: BLAKE3's own threads (``max_threads``) were slower than one thread on the
    2-core machine while another process hashed beside it, as daemons do, and its
    shared pool does not survive a fork."""
    if not isinstance(data, memoryview):
        return blake3(data).hexdigest()
    h = blake3()
    view = memoryview(data).cast("B")
    for at in pieces(view, 0, len(view)):
        h.update(view[at : at + PIECE_BYTES])
    return h.hexdigest()


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (no copy when it is contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    array: Any
    try:  # fast path for the dtypes numpy has
        array = t.numpy()
        return memoryview(array).cast("B")
    except (TypeError, ValueError, RuntimeError):  # bfloat16, empty tensors, ...
        array = t.reshape(-1).view(torch.uint8).numpy()
        return memoryview(array).cast("B")


def _leaves(chunks: list[memoryview]) -> list[bytes]:
    return [leaf_hash(c) for c in chunks]


def tensor_root(dt: torch.dtype, shape: tuple[int, ...], nbytes: int, leaves: list[bytes]) -> bytes:
    """A tensor root: the header, then its chunks' leaves."""
    return blake3(b"".join([_header_of(dt, shape, nbytes), *leaves])).digest()


def _header_of(dt: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    """What a tensor root hashes before its leaves: tag, dtype, shape, byte count."""
    dtype = str(dt).encode()
    dim = len(shape)
    return b"".join(
        (
            _TENSOR_TAG,
            struct.pack("<B", len(dtype)),
            dtype,
            struct.pack("<B", dim),
            struct.pack(f"<{dim}Q", *shape),
            struct.pack("<Q", nbytes),
        )
    )


def _roots(tensors: list[torch.Tensor], parallel: bool) -> list[bytes]:
    """Hash-tree roots of several tensors.

    The chunks of all the tensors, in order, are cut into tasks of at least
    ``TASK_BYTES`` (and about ``_TASKS_PER_WORKER`` tasks per worker for a big
    state, so one slow thread does not hold up the end); each task goes to the
    pool as soon as it is full, while the next tensors are still being cut.  The
    leaves, hence the roots, do not depend on this grouping."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    pool = _pool() if parallel and _WORKERS > 1 and total > TASK_BYTES else None
    target = max(TASK_BYTES, total // (_WORKERS * _TASKS_PER_WORKER))
    tasks: list[Future[list[bytes]] | list[bytes]] = []
    group: list[memoryview] = []
    size = 0
    sizes: list[int] = []
    for t in tensors:
        raw = _raw(t)
        n = len(raw)
        sizes.append(n)
        for i in range(0, n, CHUNK_BYTES):
            chunk = raw[i : i + CHUNK_BYTES]
            group.append(chunk)
            size += len(chunk)
            if pool is not None and size >= target:
                tasks.append(pool.submit(_leaves, group))
                group, size = [], 0
    if group:
        tasks.append(_leaves(group))  # the last, short task: this thread has nothing else to do
    leaves: list[bytes] = []
    for task in tasks:
        leaves.extend(task if isinstance(task, list) else task.result())
    roots = []
    first = 0
    for t, n in zip(tensors, sizes, strict=True):
        last = first + -(-n // CHUNK_BYTES)
        roots.append(tensor_root(t.dtype, tuple(t.shape), n, leaves[first:last]))
        first = last
    return roots


class TensorHasher:
    """``tensor_digest`` of a tensor that is produced piece by piece (a streamed merge):
    ``update`` each piece in order, then ``hexdigest``.  Pieces may end anywhere: the
    bytes of a chunk cut by a piece's end are kept (less than ``CHUNK_BYTES``) until the
    next piece completes it, so the leaves are the ones ``tensor_digest`` cuts; whole
    chunks are hashed in place, on the pool when there are many."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape
        self.nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        self._leaves: list[bytes] = []
        self._seen = 0
        self._tail = bytearray()  # the start of a chunk the last piece ended inside
        self._placed: dict[int, list[bytes]] = {}  # update_at: first chunk -> its leaves
        self._lock = threading.Lock()

    def update(self, piece: torch.Tensor) -> None:
        if self._placed:
            raise ValueError("TensorHasher: update after update_at")
        raw = _raw(piece)
        self._seen += len(raw)
        if self._tail:
            need = CHUNK_BYTES - len(self._tail)
            self._tail += raw[:need]
            raw = raw[need:]
            if len(self._tail) < CHUNK_BYTES:
                return
            self._leaves.append(leaf_hash(self._tail))
            self._tail = bytearray()
        whole = len(raw) - len(raw) % CHUNK_BYTES
        chunks = [raw[i : i + CHUNK_BYTES] for i in range(0, whole, CHUNK_BYTES)]
        self._tail += raw[whole:]
        pool = _pool() if _WORKERS > 1 and whole > TASK_BYTES else None
        if pool is None:
            self._leaves.extend(_leaves(chunks))
        else:
            per = -(-len(chunks) // _WORKERS)
            tasks = [pool.submit(_leaves, chunks[i : i + per]) for i in range(0, len(chunks), per)]
            for task in tasks:
                self._leaves.extend(task.result())

    def update_at(self, offset: int, piece: torch.Tensor) -> None:
        """Hash ``piece``, the tensor's bytes from byte ``offset`` on, where pieces come
        in any order, from several threads (``aggregate.segmented_mean`` in parallel):
        ``offset`` and the piece's length are whole chunks, but for a piece that ends
        the tensor.  Its leaves are computed on the calling thread.  Not to be mixed
        with ``update``; ``hexdigest`` checks that the pieces tile the tensor."""
        raw = _raw(piece)
        end = offset + len(raw)
        if end > self.nbytes or not self._whole(offset, len(raw)):
            raise ValueError(
                f"TensorHasher: bytes [{offset}, {end}) of {self.nbytes} are not whole chunks"
            )
        leaves = _leaves([raw[i : i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES)])
        with self._lock:
            if self._leaves or self._tail or offset // CHUNK_BYTES in self._placed:
                raise ValueError(f"TensorHasher: bytes from {offset} hashed twice")
            self._placed[offset // CHUNK_BYTES] = leaves
            self._seen += len(raw)

    def put(self, offset: int, piece: torch.Tensor) -> None:
        """Hash ``piece``, the tensor's bytes from byte ``offset`` on, as it comes: pieces
        on whole chunks in any order (``update_at``), others in order (``update``).
        What ``aggregate.segmented_mean`` hands a visit: ranges on whole chunks, from
        several threads, or any ranges in order from one."""
        whole = self._whole(offset, piece.numel() * piece.element_size())
        with self._lock:
            ordered = bool(self._leaves or self._tail)
            if not (whole and not ordered):  # in order from here: the pieces placed first
                self._leaves = self._in_order(self._leaves)
                self._placed.clear()
                if self._seen != offset:
                    raise ValueError(f"TensorHasher: bytes from {offset} after {self._seen}")
        if whole and not ordered:
            self.update_at(offset, piece)
        else:
            self.update(piece)

    def hexdigest(self) -> str:
        if self._seen != self.nbytes:
            raise ValueError(f"TensorHasher: {self._seen} of {self.nbytes} bytes hashed")
        leaves = self._leaves + ([leaf_hash(self._tail)] if self._tail else [])
        return tensor_root(self.dtype, self.shape, self.nbytes, self._in_order(leaves)).hex()

    def _whole(self, offset: int, n: int) -> bool:
        """Do ``n`` bytes from ``offset`` start on a chunk and end on one (or the tensor)?"""
        return offset % CHUNK_BYTES == 0 and (n % CHUNK_BYTES == 0 or offset + n == self.nbytes)

    def _in_order(self, leaves: list[bytes]) -> list[bytes]:
        """``leaves`` followed by the placed pieces' (``update_at``), which must continue
        them with no gap and no overlap."""
        out = list(leaves)
        for first in sorted(self._placed):
            if first != len(out):
                raise ValueError(f"TensorHasher: chunk {len(out)} not hashed")
            out += self._placed[first]
        return out


def zeros_digest(numel: int, dtype: torch.dtype = torch.float32) -> str:
    """``tensor_digest(torch.zeros(numel, dtype=dtype))`` without the zeros: every full
    chunk has the same leaf (a lossless codec's error feedback is all zeros, and relays
    digest it every round)."""
    size = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * size
    full, tail = divmod(nbytes, CHUNK_BYTES)
    leaves = [leaf_hash(bytes(CHUNK_BYTES))] * full
    if tail:
        leaves.append(leaf_hash(bytes(tail)))
    return tensor_root(dtype, (numel,), nbytes, leaves).hex()


def tensor_digest(t: torch.Tensor, *, parallel: bool = True) -> str:
    """Hex digest of one tensor (hash tree, dtype and shape included)."""
    return _roots([t], parallel)[0].hex()


def state_digest(state: Mapping[str, torch.Tensor], *, parallel: bool = True) -> str:
    """Hex digest of a name -> tensor mapping, over name-sorted tensors."""
    names = sorted(state)
    h = blake3(_STATE_TAG)
    for name, root in zip(names, _roots([state[n] for n in names], parallel), strict=True):
        key = name.encode()
        h.update(struct.pack("<I", len(key)) + key)
        h.update(root)
    return h.hexdigest()
