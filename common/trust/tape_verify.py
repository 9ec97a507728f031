"""Verifying an event tape: signatures, chain, sequence, checkpoints, forks.

The reader's half of ``hypertrain.common.trust.tape`` (which re-exports everything
public here); the byte format is in ``hypertrain.common.trust.tape_format``.

Order of checks for each record, so that the first failure names the first bad
entry precisely: framing -> pinned key known ("unknown key") -> Ed25519
signature over the stored bytes ("bad signature"), before any parsing ->
canonical form ("malformed entry") -> frame key id = signed ``signer``
("signer mismatch") -> one signer per tape ("wrong signer") -> one run
("wrong run id") -> seq = position ("duplicate entry", "reordered entries",
"sequence gap") -> ``prev`` = hash of the entry before ("broken chain") ->
for checkpoints, size and Merkle root ("checkpoint size mismatch",
"checkpoint root mismatch").  After the last record: a torn or corrupt tail
("truncated record", "corrupt record frame"), then the checkpoints seen
before ("truncated tape", "fork").  Every TapeError carries ``reason``, ``seq``
(the entry's position, which is its expected seq) and ``offset``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypertrain.common.errors import TapeError, UnknownKeyError
from hypertrain.common.trust import merkle
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.tape_format import (
    CHECKPOINT,
    MAGIC,
    ZERO_HASH,
    Checkpoint,
    Entry,
    Record,
    parse_entry,
    record_from_dict,
    scan,
)


class _Chain:
    """Checks records one by one against everything before them (shared by reader and writer)."""

    def __init__(
        self, trusted: TrustedKeys, run_id: str | None, signer: str | None, where: str
    ) -> None:
        self.trusted, self.run_id, self.where = trusted, run_id, where
        self.signer = trusted.lookup(signer).key_id if signer is not None else None
        self.entries: list[Entry] = []
        self.checkpoints: list[Checkpoint] = []
        self.log = merkle.MerkleLog()
        self.head = ZERO_HASH
        self._seen: dict[str, int] = {}  # entry hash -> seq, to name duplicates

    def fail(self, i: int, offset: int, reason: str, detail: str) -> TapeError:
        return TapeError(
            f"{self.where}: entry {i} at offset {offset}: {reason}: {detail}",
            reason=reason,
            seq=i,
            offset=offset,
        )

    def add(self, rec: Record, later: Iterable[Record] = ()) -> Entry:
        """Verify one record as the next entry; ``later``: the records after it (diagnosis)."""
        i, off = len(self.entries), rec.offset
        try:
            key = self.trusted.lookup(rec.key_id)
        except UnknownKeyError:
            detail = f"signed by key id {rec.key_id}, which is not pinned"
            raise self.fail(i, off, "unknown key", detail) from None
        if not key.verify(rec.data, rec.signature):
            raise self.fail(i, off, "bad signature", f"not a valid signature of key {key.name}")
        try:
            e = parse_entry(rec)
        except TapeError as err:
            raise self.fail(i, off, err.reason, str(err).split(": ", 1)[1]) from None
        if e.signer != rec.key_id:
            raise self.fail(i, off, "signer mismatch", f"entry says {e.signer}, frame {rec.key_id}")
        if self.signer is None:
            self.signer = e.signer
        elif e.signer != self.signer:
            who = self.trusted.lookup(self.signer).name
            raise self.fail(i, off, "wrong signer", f"signed by {key.name}, this tape by {who}")
        if self.run_id is None:
            self.run_id = e.run_id
        elif e.run_id != self.run_id:
            raise self.fail(i, off, "wrong run id", f"{e.run_id!r}, expected {self.run_id!r}")
        if e.seq != i:
            raise self._seq_error(e, i, off, later)
        if e.prev != self.head:
            raise self.fail(
                i,
                off,
                "broken chain",
                f"prev is {e.prev[:16]}..., entry {i - 1} hashes to {self.head[:16]}...",
            )
        if e.kind == CHECKPOINT:
            size, root = e.body["size"], e.body["root"]
            if size != i:
                raise self.fail(i, off, "checkpoint size mismatch", f"size {size}, expected {i}")
            if root != self.log.root().hex():
                raise self.fail(
                    i,
                    off,
                    "checkpoint root mismatch",
                    f"root {root[:16]}... is not the Merkle root of the {i} entries before it",
                )
            self.checkpoints.append(Checkpoint(e))
        self.entries.append(e)
        self.log.append(e.leaf)
        self._seen.setdefault(e.hash, i)
        self.head = e.hash
        return e

    def _seq_error(self, e: Entry, i: int, off: int, later: Iterable[Record]) -> TapeError:
        if e.seq < i:
            same = self._seen.get(e.hash)
            what = f"repeats entry {same}" if same is not None else "a second entry with that seq"
            return self.fail(i, off, "duplicate entry", f"seq {e.seq} {what}")
        if any(_peek_seq(r) == i for r in later):  # diagnosis only: later records are unverified
            return self.fail(i, off, "reordered entries", f"found seq {e.seq}, seq {i} comes later")
        return self.fail(i, off, "sequence gap", f"expected seq {i}, found {e.seq}")


def _peek_seq(rec: Record) -> int | None:
    try:
        return parse_entry(rec).seq
    except TapeError:
        return None


@dataclass(frozen=True)
class TapeReport:
    """What ``verify_tape`` checked: every entry, verified, in order."""

    path: Path
    run_id: str | None
    """The tape's run id (None for an empty tape)."""
    entries: list[Entry]
    n_bytes: int
    """Bytes checked: the header and every complete record."""
    checkpoints: list[Checkpoint]
    torn_tail_bytes: int = 0
    """Bytes of an incomplete final record skipped (only with ``allow_torn_tail``)."""
    head: str = field(default=ZERO_HASH)
    """Hash of the last entry (64 zeros for an empty tape)."""

    @property
    def n_entries(self) -> int:
        return len(self.entries)

    @property
    def last_checkpoint(self) -> Checkpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None

    def leaf_hashes(self) -> list[bytes]:
        """The Merkle leaf hashes of all entries, for proofs between checkpoints."""
        return [e.leaf for e in self.entries]

    def summary(self) -> str:
        cp = self.last_checkpoint
        last = f"checkpoint seq {cp.seq} (size {cp.size})" if cp else "no checkpoint"
        return (
            f"tape {self.path}: {self.n_entries} entries, {self.n_bytes} bytes verified, "
            f"last {last}, head {self.head[:16]}"
        )


def verify_tape(
    path: str | Path,
    trusted: TrustedKeys,
    *,
    run_id: str | None = None,
    signer: str | None = None,
    expect_checkpoint: Checkpoint | Iterable[Checkpoint] | None = None,
    allow_torn_tail: bool = False,
) -> TapeReport:
    """Verify a whole tape; TapeError naming the first bad entry, offset and reason.

    Checks the framing, every signature against ``trusted`` (before parsing),
    canonical form, one signer (``signer``: a key name or id to require), one
    run id (``run_id`` to require), seq contiguity, the prev-hash chain, and
    every checkpoint's size and Merkle root.  ``expect_checkpoint``: checkpoints
    seen before (of this tape); the tape must still hold each one exactly, so a
    tape cut back before it fails with "truncated tape" and a rewritten one with
    "fork".  ``allow_torn_tail`` accepts an incomplete final record (a tape
    being written, or one left by a crash) and reports its size instead.
    """
    p = Path(path)
    try:
        buf = p.read_bytes()
    except OSError as e:
        raise TapeError(f"tape {p}: {e.strerror}", reason="unreadable") from None
    records, problem = scan(buf)
    chain = _Chain(trusted, run_id, signer, str(p))
    for k, rec in enumerate(records):
        chain.add(rec, itertools.islice(records, k + 1, None))  # lazy: read only on error
    n_bytes = len(MAGIC) + sum(r.size for r in records)
    torn = 0
    if problem is not None:
        if not (allow_torn_tail and problem.torn):
            raise chain.fail(len(records), problem.offset, problem.reason, problem.detail)
        torn = len(buf) - problem.offset
    seen = [expect_checkpoint] if isinstance(expect_checkpoint, Checkpoint) else expect_checkpoint
    for cp in seen or ():
        _check_seen(chain, cp, trusted, n_bytes)
    return TapeReport(p, chain.run_id, chain.entries, n_bytes, chain.checkpoints, torn, chain.head)


def _check_seen(chain: _Chain, cp: Checkpoint, trusted: TrustedKeys, end: int) -> None:
    _verify_checkpoint(cp, trusted)
    n = len(chain.entries)
    if cp.seq >= n:
        raise chain.fail(
            n,
            end,
            "truncated tape",
            f"a checkpoint seen before is entry {cp.seq} (size {cp.size}), "
            f"the tape ends after {n} entries",
        )
    have = chain.entries[cp.seq]
    if have.data != cp.entry.data:
        raise chain.fail(
            cp.seq, have.offset, "fork", f"differs from the checkpoint seen before at seq {cp.seq}"
        )


def _verify_checkpoint(cp: Checkpoint, trusted: TrustedKeys) -> None:
    e = cp.entry
    try:
        ok = trusted.verify(e.signer, e.data, e.signature)
    except UnknownKeyError as err:
        raise TapeError(
            f"checkpoint seq {e.seq}: unknown key: {err}", reason="unknown key"
        ) from None
    if not ok:
        raise TapeError(f"checkpoint seq {e.seq}: bad signature", reason="bad signature")


def checkpoint_from_dict(d: dict[str, Any], trusted: TrustedKeys) -> Checkpoint:
    """A checkpoint kept with ``Checkpoint.to_dict``, its signature verified again."""
    rec = record_from_dict(d)
    try:
        key = trusted.lookup(rec.key_id)
    except UnknownKeyError as err:
        raise TapeError(f"kept checkpoint: unknown key: {err}", reason="unknown key") from None
    if not key.verify(rec.data, rec.signature):  # before parsing, as everywhere
        raise TapeError("kept checkpoint: bad signature", reason="bad signature")
    e = parse_entry(rec)
    if e.kind != CHECKPOINT or e.signer != rec.key_id:
        raise TapeError("kept checkpoint: not a checkpoint entry", reason="malformed entry")
    return Checkpoint(e)


def verify_checkpoints_consistent(
    a: Checkpoint,
    b: Checkpoint,
    proof: Sequence[bytes] | None = None,
    *,
    leaf_hashes: Sequence[bytes] | None = None,
    trusted: TrustedKeys | None = None,
) -> None:
    """Raise TapeError (reason "fork") unless two signed checkpoints of one tape agree.

    Same size: the roots must be equal.  Different sizes: the older tree must
    be a prefix of the newer, shown by an RFC 6962 consistency ``proof`` from
    the smaller size to the larger, or computed from ``leaf_hashes`` (the
    entries' leaf hashes of a tape that holds both).  With ``trusted``, both
    signatures are verified again first.
    """
    if trusted is not None:
        _verify_checkpoint(a, trusted)
        _verify_checkpoint(b, trusted)
    if a.run_id != b.run_id or a.signer != b.signer:
        raise TapeError(
            "checkpoints of different tapes: run "
            f"{a.run_id!r}/{a.signer} vs {b.run_id!r}/{b.signer}",
            reason="different tapes",
        )
    old, new = (a, b) if a.size <= b.size else (b, a)
    if old.size == new.size:
        if old.root != new.root:
            raise TapeError(
                f"fork: two signed checkpoints of size {old.size} with different roots "
                f"{old.root.hex()[:16]}... and {new.root.hex()[:16]}...",
                reason="fork",
                seq=old.seq,
            )
        return
    if proof is None:
        if leaf_hashes is None or len(leaf_hashes) < new.size:
            raise TapeError(
                "a consistency proof or the leaf hashes up to the newer checkpoint are needed",
                reason="no proof",
            )
        proof = merkle.consistency_proof(old.size, leaf_hashes[: new.size])
    if not merkle.verify_consistency(old.size, new.size, old.root, new.root, proof):
        raise TapeError(
            f"fork: checkpoint size {old.size} (seq {old.seq}) is not a prefix of checkpoint "
            f"size {new.size} (seq {new.seq}): the consistency proof fails",
            reason="fork",
            seq=new.seq,
        )
