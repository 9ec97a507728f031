"""A prepared token dataset, memory-mapped: ``TokenDataset.open(folder)``.

The shards are mapped read-only (``numpy.memmap``), so opening costs a few
system calls whatever the size and reading a window copies only that window.

Invariants checked by ``open`` (cheap, every time): the folder and manifest
exist and parse, the dataset is not empty, shard counts add up, the stored
fingerprint matches the manifest's content fields, and every shard file exists
with exactly ``tokens * itemsize`` bytes.  ``verify`` (slow: reads every byte)
adds the shard and stream sha256 digests and checks every token id is below
``vocab_size`` (skipped when the dtype cannot hold a larger id, as for bytes).
Every failure is a ``DataError`` naming the file and the problem on one line.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from hypertrain.common.data.build import prepare
from hypertrain.common.data.manifest import DTYPES, MANIFEST_NAME, Manifest, read_manifest
from hypertrain.common.errors import DataError

DATA_DIR_ENV = "HYPERTRAIN_DATA_DIR"
_VERIFY_CHUNK = 16 * 2**20  # tokens per read when hashing a shard


class TokenDataset:
    """Token ids of a prepared dataset as one logical stream over its shards."""

    def __init__(self, path: Path, manifest: Manifest, shards: list[np.memmap[Any, Any]]) -> None:
        """Use ``TokenDataset.open``; this constructor trusts its arguments."""
        self.path = path
        self.manifest = manifest
        self._shards = shards
        # _starts[i] = index of shard i's first token in the stream.
        self._starts = [0]
        for s in manifest.shards[:-1]:
            self._starts.append(self._starts[-1] + s.tokens)
        self._starts_np = np.array(self._starts, dtype=np.int64)  # for vectorised lookup

    @classmethod
    def open(cls, path: Path | str) -> TokenDataset:
        """Map a dataset folder written by ``prepare`` (or by hand, same format)."""
        folder = Path(path)
        manifest = read_manifest(folder)
        dtype = np.dtype(DTYPES[manifest.dtype])
        shards: list[np.memmap[Any, Any]] = []
        for info in manifest.shards:
            file = folder / info.name
            try:
                size = os.stat(file).st_size
            except FileNotFoundError:
                raise DataError(f"{file}: shard listed in {MANIFEST_NAME} is missing") from None
            want = info.tokens * dtype.itemsize
            if size != want:
                raise DataError(
                    f"{file}: shard is {size} bytes, {MANIFEST_NAME} says {info.tokens} "
                    f"{manifest.dtype} tokens ({want} bytes)"
                )
            shards.append(np.memmap(file, dtype=dtype, mode="r", shape=(info.tokens,)))
        return cls(folder, manifest, shards)

    @property
    def fingerprint(self) -> str:
        """sha256 hex naming the token stream (see manifest.py)."""
        return self.manifest.fingerprint

    @property
    def n_tokens(self) -> int:
        return self.manifest.n_tokens

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(DTYPES[self.manifest.dtype])

    def __len__(self) -> int:
        return self.manifest.n_tokens

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.path)!r}, n_tokens={self.n_tokens}, "
            f"shards={len(self._shards)}, fingerprint={self.fingerprint[:12]})"
        )

    def read_into(self, out: np.ndarray[Any, Any], start: int) -> None:
        """Fill the 1-D array ``out`` with tokens ``[start, start + len(out))``.

        Copies only the window (across shard boundaries when needed), converting
        to ``out``'s dtype; this is the sampler's hot path.
        """
        n = out.shape[0]
        if start < 0 or n < 0 or start + n > self.manifest.n_tokens:
            raise IndexError(f"window [{start}, {start + n}) is outside [0, {self.n_tokens})")
        i = bisect.bisect_right(self._starts, start) - 1
        done = 0
        while done < n:
            shard = self._shards[i]
            lo = start + done - self._starts[i]
            take = min(n - done, shard.shape[0] - lo)
            out[done : done + take] = shard[lo : lo + take]
            done += take
            i += 1

    def windows(self, starts: np.ndarray[Any, Any], width: int) -> np.ndarray[Any, Any]:
        """int64 [len(starts), width]: row r holds tokens ``[starts[r], starts[r] + width)``.

        Vectorised per shard (one fancy-indexing gather, ~50 us for 32x257);
        only the rare windows that straddle a shard boundary go through
        ``read_into``.
        """
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((starts.shape[0], width), dtype=np.int64)
        if starts.size == 0:
            return out
        if int(starts.min()) < 0 or int(starts.max()) + width > self.n_tokens:
            raise IndexError(f"a window of width {width} falls outside [0, {self.n_tokens})")
        which = np.searchsorted(self._starts_np, starts, side="right") - 1
        offsets = np.arange(width, dtype=np.int64)
        for i in np.unique(which).tolist():
            rows = np.flatnonzero(which == i)
            local = starts[rows] - self._starts[i]
            inside = local + width <= self._shards[i].shape[0]
            out[rows[inside]] = self._shards[i][local[inside, None] + offsets]
            for r in rows[~inside].tolist():
                self.read_into(out[r], int(starts[r]))
        return out

    def tokens(self, start: int, n: int) -> np.ndarray[Any, Any]:
        """A copy of tokens ``[start, start + n)`` in the dataset's dtype."""
        out = np.empty(n, dtype=self.dtype)
        self.read_into(out, start)
        return out

    def verify(self) -> None:
        """Re-read every shard: sha256 per shard and of the stream, and token ids < vocab."""
        stream = hashlib.sha256()
        limit = self.manifest.vocab_size
        check_ids = limit <= int(np.iinfo(self.dtype).max)  # else every id fits already
        for info, shard in zip(self.manifest.shards, self._shards, strict=True):
            h = hashlib.sha256()
            for lo in range(0, shard.shape[0], _VERIFY_CHUNK):
                chunk = np.ascontiguousarray(shard[lo : lo + _VERIFY_CHUNK])
                h.update(chunk.data)
                stream.update(chunk.data)
                if check_ids and int(chunk.max()) >= limit:
                    raise DataError(
                        f"{self.path / info.name}: token id {int(chunk.max())} >= vocab_size {limit}"
                    )
            if h.hexdigest() != info.sha256:
                raise DataError(
                    f"{self.path / info.name}: sha256 mismatch (file {h.hexdigest()[:16]}..., "
                    f"{MANIFEST_NAME} {info.sha256[:16]}...): the shard was changed"
                )
        if stream.hexdigest() != self.manifest.stream_sha256:
            raise DataError(f"{self.path / MANIFEST_NAME}: stream_sha256 does not match the shards")


def default_data_dir() -> Path:
    """``$HYPERTRAIN_DATA_DIR`` if set, else ``~/.cache/hypertrain/data/stdlib``."""
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hypertrain" / "data" / "stdlib"


def ensure_default_dataset(*, verify: bool = True) -> TokenDataset:
    """The default dataset, prepared from the stdlib corpus on first use, then reused.

    A dataset already in ``default_data_dir()`` is opened (and with ``verify``,
    re-hashed: ~0.05 s for the stdlib corpus) and used whatever its source, so
    pointing HYPERTRAIN_DATA_DIR at one's own shards works.  A corrupt dataset
    raises DataError rather than being rebuilt: the folder may be the user's.
    Safe to call from many processes at once (the first to finish publishes).
    """
    folder = default_data_dir()
    if not (folder / MANIFEST_NAME).exists():
        prepare(None, folder, replace=False)
    ds = TokenDataset.open(folder)
    if verify:
        ds.verify()
    return ds
