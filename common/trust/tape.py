"""The signed, hash-chained, append-only event tape: writing and verifying.

Each daemon that merges (the aggregator, each relay) keeps one tape file and
appends one entry per event: "regional_merge", "global_merge", "membership",
"rejection", ..., plus a signed "checkpoint" entry every ``checkpoint_every``
entries.  The byte format is defined in ``hypertrain.common.trust.tape_format``,
verification in ``hypertrain.common.trust.tape_verify``; this module is the writer
and re-exports the public names of both.

Guarantees, and what each rests on:
- Nothing in an entry can change unseen: each entry is signed (Ed25519, the
  daemon's key) over its exact stored bytes, and the verifier checks the
  signature against pinned keys before it parses anything.
- Nothing can be dropped, inserted, reordered or duplicated inside the tape:
  ``seq`` is contiguous from 0 and ``prev`` chains every entry to the hash of
  the one before it.
- Truncation at a record boundary and forks are caught against a checkpoint
  seen earlier: a checkpoint signs (size, RFC 6962 root) of everything before
  it, so ``verify_tape(..., expect_checkpoint=cp)`` fails if the tape ends
  before ``cp`` or differs from it, and ``verify_checkpoints_consistent`` shows
  that two signed checkpoints cannot both be right (a fork).
- One tape has one signer: a daemon with a new key starts a new tape.

Durability and crash recovery (``TapeWriter``):
- An append writes the whole record (one ``write`` call, normally) and fsyncs
  the file before returning; the folder is fsynced when the file is created.  So an
  entry the caller saw returned survives a crash.
- ``TapeWriter.open`` resumes an existing tape: it verifies every record with the
  writer's own key (signature, chain, seq, checkpoints), then continues at the
  next seq with the last entry's hash as ``prev``.  If the file ends in a torn
  record (an append interrupted by a crash: an incomplete record whose frame is
  intact, an incomplete frame, or only zero bytes) the writer truncates it:
  such a record was never acknowledged.  It never truncates a complete record;
  anything else wrong (a bad signature, a corrupt frame, another run or key)
  makes ``open`` refuse with a TapeError for an operator to look at.
- One writer per tape: ``open`` takes an exclusive ``flock`` on the file.
- After a failed write or fsync the writer refuses further appends (the file's
  state is unknown); reopening verifies and resumes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from hypertrain.common.errors import TapeError
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, fsync_dir, write_all
from hypertrain.common.trust.tape_format import (
    CHECKPOINT,
    FORMAT_VERSION,
    MAGIC,
    Checkpoint,
    Entry,
    Record,
    canonical_json,
    check_body,
    check_kind,
    encode_record,
    entry_hash,
    read_tape,
    scan,
)
from hypertrain.common.trust.tape_verify import (
    TapeReport,
    _Chain,
    checkpoint_from_dict,
    verify_checkpoints_consistent,
    verify_tape,
)

__all__ = [
    "CHECKPOINT",
    "DEFAULT_CHECKPOINT_EVERY",
    "Checkpoint",
    "Entry",
    "Record",
    "TapeReport",
    "TapeWriter",
    "canonical_json",
    "checkpoint_from_dict",
    "read_tape",
    "verify_checkpoints_consistent",
    "verify_tape",
]

DEFAULT_CHECKPOINT_EVERY = 16


class TapeWriter:
    """Appends signed entries to one tape file; see the module docstring for recovery."""

    def __init__(
        self,
        path: Path,
        fd: int,
        run_id: str,
        key: SigningKey,
        chain: _Chain,
        end: int,
        checkpoint_every: int,
        sync: bool,
    ) -> None:
        self.path, self.run_id, self.key = path, run_id, key
        self.checkpoint_every, self.sync = checkpoint_every, sync
        self._fd: int | None = fd
        self._chain = chain
        self._end = end
        self._broken: str | None = None
        self.recovered_bytes = 0
        """Bytes of a torn final record truncated by ``open`` (0 if none)."""

    @classmethod
    def open(
        cls,
        path: str | Path,
        run_id: str,
        signing_key: SigningKey,
        *,
        checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
        sync: bool = True,
    ) -> TapeWriter:
        """Create the tape, or verify an existing one and resume after its last entry.

        ``checkpoint_every``: entries between automatic checkpoints (0: only
        explicit ``checkpoint()`` calls).  ``sync=False`` skips fsync: only for
        simulations and tests, never for a daemon's tape.
        """
        p = Path(path)
        if not run_id:
            raise TapeError("a tape needs a non-empty run id")
        if checkpoint_every < 0:
            raise TapeError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC
        try:
            fd = os.open(p, flags | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            fd, created = os.open(p, flags), False
        except OSError as e:
            raise TapeError(f"cannot create tape {p}: {e.strerror}", reason="unwritable") from None
        try:
            return cls._resume(p, fd, created, run_id, signing_key, checkpoint_every, sync)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _resume(
        cls, p: Path, fd: int, created: bool, run_id: str, key: SigningKey, every: int, sync: bool
    ) -> TapeWriter:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TapeError(f"tape {p} is open by another writer", reason="locked") from None
        buf = b"" if created else _read_all(fd)
        records, problem = scan(buf) if buf else ([], None)
        chain = _Chain(TrustedKeys.of([key]), run_id, key.key_id, f"cannot resume tape {p}")
        try:
            for rec in records:
                chain.add(rec)
        except TapeError as err:
            if err.reason == "unknown key":  # say what that means for a writer
                raise TapeError(
                    f"{err} (this daemon's key is {key.key_id}; a tape has one signer, so a "
                    "daemon with a new key starts a new tape)",
                    reason=err.reason,
                    seq=err.seq,
                    offset=err.offset,
                ) from None
            raise
        end, recovered = len(MAGIC) + sum(r.size for r in records), 0
        if problem is not None and not problem.torn:
            raise chain.fail(len(records), problem.offset, problem.reason, problem.detail)
        if not buf or len(buf) < len(MAGIC):  # new, or a crash inside the header
            os.ftruncate(fd, 0)
            write_all(fd, MAGIC)
            end, recovered = len(MAGIC), len(buf)
        elif problem is not None:
            os.ftruncate(fd, problem.offset)
            recovered = len(buf) - problem.offset
        if sync:
            os.fsync(fd)
            if created or recovered:
                fsync_dir(p.parent)
        w = cls(p, fd, run_id, key, chain, end, every, sync)
        w.recovered_bytes = recovered
        w._maybe_checkpoint()  # a crash may have come between an entry and its checkpoint
        return w

    # -- state ----------------------------------------------------------------------
    @property
    def next_seq(self) -> int:
        """The seq the next entry gets (= entries in the tape)."""
        return len(self._chain.entries)

    @property
    def head(self) -> str:
        """Hash of the last entry (the next entry's ``prev``); 64 zeros when empty."""
        return self._chain.head

    @property
    def last_entry(self) -> Entry | None:
        """The tape's last entry (None when empty)."""
        return self._chain.entries[-1] if self._chain.entries else None

    @property
    def last_checkpoint(self) -> Checkpoint | None:
        return self._chain.checkpoints[-1] if self._chain.checkpoints else None

    def root(self) -> bytes:
        """Merkle root over all entries so far (what a checkpoint now would sign)."""
        return self._chain.log.root()

    @property
    def entries(self) -> Sequence[Entry]:
        """Every entry of the tape, verified (after ``open``, what a restart resumes from)."""
        return tuple(self._chain.entries)

    def leaf_hashes(self) -> list[bytes]:
        """The Merkle leaf hashes of all entries (for consistency proofs)."""
        return [e.leaf for e in self._chain.entries]

    # -- appending ------------------------------------------------------------------
    def append(self, kind: str, body: dict[str, Any]) -> Entry:
        """Sign and durably append one entry; returns it (then checkpoints if due)."""
        if check_kind(kind) == CHECKPOINT:
            raise TapeError("checkpoint entries are written by checkpoint(), not append()")
        e = self._write(kind, body)
        self._maybe_checkpoint()
        return e

    def checkpoint(self) -> Entry:
        """Append a signed checkpoint of the current size and Merkle root."""
        body = {"size": self.next_seq, "root": self._chain.log.root().hex()}
        return self._write(CHECKPOINT, body)

    def _maybe_checkpoint(self) -> None:
        if not self.checkpoint_every:
            return
        last = self.last_checkpoint
        since = self.next_seq - (last.seq + 1 if last else 0)
        if since >= self.checkpoint_every:
            self.checkpoint()

    def next_hash(self, kind: str, body: dict[str, Any]) -> str:
        """The hash the next entry will have if it is ``(kind, body)`` (entries are
        canonical and signing does not change them, so a caller can record where the tape
        will be before it writes there, and check it after a crash)."""
        return entry_hash(self._entry_bytes(check_kind(kind), body))

    def _entry_bytes(self, kind: str, body: dict[str, Any]) -> bytes:
        if not isinstance(body, dict):
            raise TapeError(f"an entry body is a dict, got {type(body).__name__}")
        check_body(body)
        obj = {
            "body": body,
            "kind": kind,
            "prev": self.head,
            "run_id": self.run_id,
            "seq": self.next_seq,
            "signer": self.key.key_id,
            "v": FORMAT_VERSION,
        }
        return canonical_json(obj)

    def _write(self, kind: str, body: dict[str, Any]) -> Entry:
        if self._fd is None or self._broken:
            raise TapeError(
                f"tape {self.path}: the writer is {self._broken or 'closed'}; reopen to resume",
                reason="closed",
            )
        data = self._entry_bytes(kind, body)
        rec = Record(self._end, self.key.key_id, data, self.key.sign(data))
        raw = encode_record(rec.key_id, rec.data, rec.signature)
        try:
            write_all(self._fd, raw)
            if self.sync:
                os.fsync(self._fd)
        except OSError as err:
            self._broken = f"broken by a failed write ({err.strerror})"
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)  # best effort; reopening re-verifies anyway
            raise TapeError(
                f"tape {self.path}: append failed: {err.strerror}", reason="write failed"
            ) from None
        e = self._chain.add(rec)  # also checks what was just written
        self._end += len(raw)
        return e

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self) -> TapeWriter:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks, off = [], 0
    while off < size:
        chunk = os.pread(fd, min(size - off, 1 << 24), off)
        if not chunk:
            break
        chunks.append(chunk)
        off += len(chunk)
    return b"".join(chunks)
