"""Training batches and holdout windows drawn from a ``TokenDataset``.

    stream = SampleStream(ds, seq_len=256, global_batch=32, seed=0)
    batch = stream.global_batch_at(step)            # [32, 257] int64
    x, y = batch[:, :-1], batch[:, 1:]
    mine = stream.replica_batch(step, replica=r, n_replicas=M)   # rows r*B/M .. (r+1)*B/M
    held = holdout_windows(ds, seq_len=256)         # 512 fixed windows, .digest

Split: the last ``2 * n_holdout * (seq_len + 1)`` tokens of the stream are the
holdout region; training windows lie wholly before it, so no training token is
ever a holdout token.  The holdout windows are ``n_holdout`` of the region's
``2 * n_holdout`` non-overlapping slots, chosen by the holdout seed (a region
twice the size gives the seed something to choose while keeping the windows
disjoint).  Pass the same ``seq_len`` and ``n_holdout`` to both.

Determinism: the window starts of step t depend only on (seed, t) and the
dataset size: a PCG64 stream keyed by ``SeedSequence([tag, seed, t])``.  Only
raw PCG64 words are used (``random_raw``), whose streams numpy guarantees
across versions, mapped to a range by modulo (bias <= span / 2**64, ~1e-12
here, immaterial).  So any process computes step t alone, and the M replica
batches of a step concatenate to exactly the data-parallel global batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hypertrain.common.data.dataset import TokenDataset
from hypertrain.common.errors import ConfigError, DataError

HOLDOUT_WINDOWS = 512
# First SeedSequence word: keeps the training and holdout streams apart.
_TAG_TRAIN = 1
_TAG_HOLDOUT = 2


def holdout_region_tokens(seq_len: int, n_holdout: int) -> int:
    """Tokens reserved at the end of the stream for ``n_holdout`` windows."""
    return 2 * n_holdout * (seq_len + 1)


def train_end(dataset: TokenDataset, seq_len: int, n_holdout: int) -> int:
    """First token of the holdout region (= tokens usable for training).

    Raises DataError when the dataset cannot hold the holdout region plus one
    training window, saying how many tokens are needed.
    """
    if seq_len < 1 or n_holdout < 0:
        raise ConfigError(f"need seq_len >= 1 and n_holdout >= 0, got {seq_len}, {n_holdout}")
    region = holdout_region_tokens(seq_len, n_holdout)
    need = region + seq_len + 1
    if dataset.n_tokens < need:
        raise DataError(
            f"{dataset.path}: {dataset.n_tokens} tokens is too few for seq_len {seq_len} with "
            f"{n_holdout} holdout windows: needs at least {need} ({region} holdout + "
            f"{seq_len + 1} for one training window)"
        )
    return dataset.n_tokens - region


def _bitgen(*words: int) -> np.random.PCG64:
    if any(w < 0 for w in words):
        raise ConfigError(f"seeds and steps must be >= 0, got {words[1:]}")
    return np.random.PCG64(np.random.SeedSequence(list(words)))


def _gather(dataset: TokenDataset, starts: np.ndarray[Any, Any], width: int) -> torch.Tensor:
    return torch.from_numpy(dataset.windows(starts, width))


class SampleStream:
    """Seeded random training windows: step t -> [global_batch, seq_len + 1] int64."""

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        global_batch: int,
        seed: int,
        *,
        n_holdout: int = HOLDOUT_WINDOWS,
    ) -> None:
        if global_batch < 1 or seed < 0:
            raise ConfigError(f"need global_batch >= 1 and seed >= 0, got {global_batch}, {seed}")
        self.dataset = dataset
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.n_holdout = n_holdout
        self.train_tokens = train_end(dataset, seq_len, n_holdout)
        # Starts are drawn from [0, train_tokens - seq_len - 1]: window ends <= train_tokens.
        self._n_starts = self.train_tokens - seq_len

    def starts(self, step: int) -> np.ndarray[Any, Any]:
        """Window start offsets of ``step`` (int64 [global_batch]); a function of (seed, step)."""
        raw = _bitgen(_TAG_TRAIN, self.seed, step).random_raw(self.global_batch)
        return (raw % np.uint64(self._n_starts)).astype(np.int64)

    def global_batch_at(self, step: int) -> torch.Tensor:
        """The data-parallel batch of ``step``: LongTensor [global_batch, seq_len + 1]."""
        return _gather(self.dataset, self.starts(step), self.seq_len + 1)

    def replica_batch(self, step: int, replica: int, n_replicas: int) -> torch.Tensor:
        """Rows ``[replica*B/M, (replica+1)*B/M)`` of ``global_batch_at(step)``, read alone."""
        if n_replicas < 1 or self.global_batch % n_replicas:
            raise ConfigError(
                f"n_replicas {n_replicas} must divide global_batch {self.global_batch}"
            )
        if not 0 <= replica < n_replicas:
            raise ConfigError(f"replica {replica} is not in [0, {n_replicas})")
        per = self.global_batch // n_replicas
        rows = self.starts(step)[replica * per : (replica + 1) * per]
        return _gather(self.dataset, rows, self.seq_len + 1)


@dataclass(frozen=True, slots=True, eq=False)
class Holdout:
    """Fixed evaluation windows and the digest that records them."""

    windows: torch.Tensor
    """LongTensor [n, seq_len + 1]; inputs = [:, :-1], targets = [:, 1:]."""
    starts: tuple[int, ...]
    """Offset of each window in the token stream (ascending)."""
    digest: str
    """``windows_digest(windows)``: sha256 over shape and int64 little-endian bytes."""
    seed: int

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.windows.shape
        return int(n), int(width)


def windows_digest(windows: torch.Tensor) -> str:
    """sha256 hex of a header naming the shape, then the windows as int64 little-endian, C order."""
    n, width = windows.shape
    body = windows.detach().cpu().numpy().astype("<i8", copy=False)
    h = hashlib.sha256(f"hypertrain-holdout:int64:{n}x{width}\n".encode())
    h.update(np.ascontiguousarray(body).data)
    return h.hexdigest()


def holdout_windows(
    dataset: TokenDataset, seq_len: int, n: int = HOLDOUT_WINDOWS, seed: int = 0
) -> Holdout:
    """``n`` disjoint windows from the holdout region, chosen by ``seed`` (see module doc)."""
    if n < 1:
        raise ConfigError(f"need n >= 1 holdout windows, got {n}")
    base = train_end(dataset, seq_len, n)
    n_slots = 2 * n
    raw = _bitgen(_TAG_HOLDOUT, seed, 0).random_raw(n)
    # Partial Fisher-Yates: the first n entries become a uniform n-subset of the slots.
    slots = list(range(n_slots))
    for i in range(n):
        j = i + int(raw[i] % np.uint64(n_slots - i))
        slots[i], slots[j] = slots[j], slots[i]
    starts = np.array(sorted(slots[:n]), dtype=np.int64) * (seq_len + 1) + base
    windows = _gather(dataset, starts, seq_len + 1)
    return Holdout(windows, tuple(starts.tolist()), windows_digest(windows), seed)
