"""``tensor_digest`` computed from a tensor's bytes as they arrive, front to back.

Why: a merge receiver would otherwise hash the whole tensor after the last chunk (about
0.1 s per 256 MiB on two cores, a third of the transfer time).  The digest is a hash
tree whose leaves are independent hashes of 1 MiB slices (common/digest.py), so each leaf
can be hashed as soon as its bytes have arrived.  The hasher takes
the received chunks themselves, not the tensor they are copied into, so hashing and
copying run on two threads side by side (bench/bench_transport.py, merge/reuse:
0.34 -> 0.38 of TCP).  Chunks need not line up with leaves: common/digest.py's
``TensorHasher``, which this one feeds, keeps a partial leaf until the next chunk
completes it; this one checks that the bytes come in order and no more than announced.

Invariant: a ``TensorHasher(t)`` fed every byte of ``t`` in order gives exactly
``hypertrain.common.digest.tensor_digest(t)``; tests/integration/test_wire.py checks it
over sizes and chunkings around the leaf boundaries.  The leaf size, the leaf hash, the
carry and the root are common/digest.py's.
"""

from __future__ import annotations

import torch

from hypertrain.common import digest
from hypertrain.wire.frames import Data


class TensorHasher:
    """The tensor digest of ``tensor``'s bytes, fed in order with :meth:`feed`."""

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        """``tensor`` gives the dtype and shape; ``nbytes`` is the size of its data."""
        self._hasher = digest.TensorHasher(tensor.dtype, tuple(tensor.shape))
        if nbytes != self._hasher.nbytes:
            raise ValueError(f"tensor hash of {nbytes} bytes for {self._hasher.nbytes}")
        self._nbytes = nbytes
        self._fed = 0

    def feed(self, offset: int, data: Data) -> None:
        """Take the bytes at ``offset`` (the next ones, in order); hash every leaf they complete."""
        if offset != self._fed:
            raise ValueError(f"tensor hash fed bytes at {offset}, expected {self._fed}")
        n = memoryview(data).nbytes
        if self._fed + n > self._nbytes:
            raise ValueError(f"tensor hash fed more than {self._nbytes} bytes")
        self._fed += n
        self._hasher.update(data)

    def hexdigest(self) -> str:
        """The tensor digest, once every byte was fed (hashes the last, partial leaf)."""
        if self._fed != self._nbytes:
            raise ValueError(f"tensor hash fed {self._fed} of {self._nbytes} bytes")
        return self._hasher.hexdigest()
