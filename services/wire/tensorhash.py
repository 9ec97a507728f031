"""``tensor_digest`` computed from a tensor's bytes as they arrive, front to back.

Why: a merge receiver would otherwise hash the whole tensor after the last chunk (about
0.1 s per 256 MiB on two cores, a third of the transfer time).  The digest is a hash
tree whose leaves are independent hashes of 1 MiB slices (common/digest.py), so each leaf
can be hashed as soon as its bytes have arrived.  The hasher takes
the received chunks themselves, not the tensor they are copied into, so hashing and
copying run on two threads side by side (bench/bench_transport.py, merge/reuse:
0.34 -> 0.38 of TCP).  Chunks need not line up with leaves: a partial leaf waits in
a small carry buffer.

Invariant: a ``TensorHasher(t)`` fed every byte of ``t`` in order gives exactly
``hypertrain.common.digest.tensor_digest(t)``; tests/integration/test_wire.py checks it
over sizes and chunkings around the leaf boundaries.  The leaf size, the leaf hash and
the root are common/digest.py's.
"""

from __future__ import annotations

import torch

from hypertrain.common.digest import CHUNK_BYTES as LEAF_BYTES
from hypertrain.common.digest import leaf_hash, tensor_root
from hypertrain.wire.frames import Data


class TensorHasher:
    """The tensor digest of ``tensor``'s bytes, fed in order with :meth:`feed`."""

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        """``tensor`` gives the dtype and shape; ``nbytes`` is the size of its data."""
        self._dtype, self._shape = tensor.dtype, tuple(tensor.shape)
        self._nbytes = nbytes
        self._leaves: list[bytes] = []
        self._fed = 0
        self._carry = bytearray()

    def feed(self, offset: int, data: Data) -> None:
        """Take the bytes at ``offset`` (the next ones, in order); hash every leaf they complete."""
        if offset != self._fed:
            raise ValueError(f"tensor hash fed bytes at {offset}, expected {self._fed}")
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if self._fed + view.nbytes > self._nbytes:
            raise ValueError(f"tensor hash fed more than {self._nbytes} bytes")
        self._fed += view.nbytes
        if self._carry:
            take = LEAF_BYTES - len(self._carry)
            self._carry += view[:take]
            view = view[take:]
            if len(self._carry) < LEAF_BYTES:
                return
            self._leaves.append(leaf_hash(self._carry))
            self._carry.clear()
        whole = view.nbytes - view.nbytes % LEAF_BYTES
        for start in range(0, whole, LEAF_BYTES):
            self._leaves.append(leaf_hash(view[start : start + LEAF_BYTES]))
        self._carry += view[whole:]

    def hexdigest(self) -> str:
        """The tensor digest, once every byte was fed (hashes the last, partial leaf)."""
        if self._fed != self._nbytes:
            raise ValueError(f"tensor hash fed {self._fed} of {self._nbytes} bytes")
        leaves = self._leaves + ([leaf_hash(self._carry)] if self._carry else [])
        return tensor_root(self._dtype, self._shape, self._nbytes, leaves).hex()
