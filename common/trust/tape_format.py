"""The event tape's bytes: canonical entries, record framing, and reading without trust.

``hypertrain.common.trust.tape`` writes and verifies tapes; this module defines what
is on disk, so that an auditor in any language can read it from this docstring.

File layout (one file per daemon, append-only)::

    header   8 bytes    b"HTTAPE1\\n"
    record*  16 + n + 64 bytes each, back to back:
             u32 big-endian   n          length of the entry bytes (1 .. 16 MiB)
             u32 big-endian   crc        zlib.crc32 of the 12 bytes (n, key id)
             8 bytes          key id     the signer's key id (16 hex digits, raw)
             n bytes          entry      canonical JSON, see below
             64 bytes         signature  Ed25519 over exactly the n entry bytes

The frame (length, crc, key id) is not signed: the key id only says which
pinned key to verify with, and must equal the signed ``signer`` field.  The crc
tells a torn final record (the file ends inside a record whose frame is
intact: an interrupted append) from a corrupted length field, so a complete
signed record is never mistaken for a torn one.

Entry bytes: the canonical JSON (UTF-8, here all ASCII: ``ensure_ascii``;
keys sorted; separators ``,`` and ``:``; no whitespace; no NaN) of exactly::

    {"body": {...}, "kind": str, "prev": 64 hex, "run_id": str, "seq": int,
     "signer": 16 hex, "v": 2}

- ``v`` is 2: the blob, tensor and state digests that bodies name are digest format 2
  (BLAKE3, ``hypertrain.common.digest``); version 1 tapes named sha256 ones, and a
  reader refuses a version it does not know rather than report every digest changed.
- ``seq`` is contiguous from 0; ``prev`` is the hex sha256 of the previous
  entry's bytes (the *entry hash*), 64 zeros for seq 0.
- ``body`` holds only objects with string keys, lists, strings, booleans, null
  and integers with |x| < 2^63.  No floats (a float's text is not canonical across
  languages): store them as ``repr`` strings, tensors and states by digest.
- ``kind`` is ``[a-z][a-z0-9_]*``; ``checkpoint`` entries have the body
  ``{"root": 64 hex, "size": int}``: ``size`` = the number of entries before it
  (= its own seq) and ``root`` = the RFC 6962 root over the leaf hashes
  ``leaf_hash(entry bytes)`` of those entries (``hypertrain.common.trust.merkle``).

Readers verify the signature over the stored bytes before parsing them, never
re-serialize to verify, and reject entries that are not in canonical form
(duplicate keys, floats, other spacing) so every parser reads the same values.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypertrain.common.errors import TapeError
from hypertrain.common.trust import merkle

MAGIC = b"HTTAPE1\n"
FORMAT_VERSION = 2
FRAME_BYTES = 16
SIG_BYTES = 64
MAX_ENTRY_BYTES = 1 << 24
ZERO_HASH = "0" * 64
CHECKPOINT = "checkpoint"
ENTRY_FIELDS = frozenset({"body", "kind", "prev", "run_id", "seq", "signer", "v"})
#: Integers in entries are in (-INT_LIMIT, INT_LIMIT): a signed 64-bit integer in any language.
INT_LIMIT = 1 << 63
_KIND_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_HEX16_RE = re.compile(r"[0-9a-f]{16}")


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding of a JSON value used for entries (see the docstring)."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def entry_hash(data: bytes) -> str:
    """An entry's hash: hex sha256 of its stored bytes (what ``prev`` holds)."""
    return hashlib.sha256(data).hexdigest()


def check_body(value: Any, where: str = "body") -> None:
    """Raise TapeError unless ``value`` uses only the types entries allow."""
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not -INT_LIMIT < value < INT_LIMIT:
            raise TapeError(
                f"{where}: integer {value} does not fit in 64 bits; store it as a string"
            )
        return
    if isinstance(value, float):
        raise TapeError(
            f"{where}: floats are not allowed in tape entries; store repr({value!r}) as a string"
        )
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_body(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TapeError(f"{where}: key {k!r} is not a string")
            check_body(v, f"{where}.{k}")
        return
    raise TapeError(f"{where}: {type(value).__name__} is not allowed in tape entries")


def check_kind(kind: str) -> str:
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise TapeError(f"bad entry kind {kind!r}: use [a-z][a-z0-9_]* (at most 64 characters)")
    return kind


@dataclass(frozen=True, slots=True)
class Record:
    """One framed record as read from disk, not yet trusted."""

    offset: int
    """Byte offset of the record's frame in the file."""
    key_id: str
    """The frame's key id (hex): which pinned key should verify it."""
    data: bytes
    """The entry bytes, exactly as signed."""
    signature: bytes

    @property
    def size(self) -> int:
        """Bytes the record takes on disk."""
        return FRAME_BYTES + len(self.data) + SIG_BYTES


@dataclass(frozen=True, slots=True)
class Entry:
    """A tape entry whose signature was verified and whose bytes were parsed."""

    seq: int
    kind: str
    run_id: str
    prev: str
    signer: str
    body: dict[str, Any]
    data: bytes
    """The stored entry bytes (signed, hashed, never re-serialized)."""
    signature: bytes
    offset: int = -1
    """Byte offset of its record in the tape file (-1 when not known)."""
    hash: str = field(init=False)
    """hex sha256 of ``data``: the next entry's ``prev``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hash", entry_hash(self.data))

    @property
    def leaf(self) -> bytes:
        """The RFC 6962 leaf hash of this entry in the tape's Merkle tree."""
        return merkle.leaf_hash(self.data)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A signed checkpoint entry: the tape's size and Merkle root at a point."""

    entry: Entry

    @property
    def seq(self) -> int:
        return self.entry.seq

    @property
    def size(self) -> int:
        """Entries covered (all entries before the checkpoint; equals its seq)."""
        return int(self.entry.body["size"])

    @property
    def root(self) -> bytes:
        return bytes.fromhex(self.entry.body["root"])

    @property
    def run_id(self) -> str:
        return self.entry.run_id

    @property
    def signer(self) -> str:
        return self.entry.signer

    def to_dict(self) -> dict[str, Any]:
        """A JSON form to keep a seen checkpoint (``from_dict`` re-verifies it)."""
        e = self.entry
        return {
            "offset": e.offset,
            "key_id": e.signer,
            "entry": base64.b64encode(e.data).decode("ascii"),
            "signature": e.signature.hex(),
        }

    def record(self) -> Record:
        e = self.entry
        return Record(e.offset, e.signer, e.data, e.signature)


def parse_entry(record: Record) -> Entry:
    """Parse verified entry bytes; TapeError (reason "malformed entry") if not canonical."""

    def bad(why: str) -> TapeError:
        return TapeError(f"malformed entry: {why}", reason="malformed entry")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            raise ValueError("duplicate key")
        return d

    def no_float(text: str) -> Any:
        raise ValueError(f"float {text}")

    try:
        obj = json.loads(
            record.data.decode("ascii"),
            object_pairs_hook=no_duplicates,
            parse_float=no_float,
            parse_constant=no_float,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # nested past the stack
        raise bad(f"not canonical JSON ({e})") from None
    if not isinstance(obj, dict) or set(obj) != ENTRY_FIELDS:
        raise bad(f"fields must be exactly {sorted(ENTRY_FIELDS)}")
    if canonical_json(obj) != record.data:
        raise bad("bytes are not in canonical form (sorted keys, no spaces, ASCII)")
    seq, kind, prev, run_id, signer, body = (
        obj["seq"],
        obj["kind"],
        obj["prev"],
        obj["run_id"],
        obj["signer"],
        obj["body"],
    )
    if obj["v"] != FORMAT_VERSION:
        older = (
            " (sha256 digests, written by a build before digest format 2: audit it with"
            " that build; a run resumes only in a new --state-dir)"
            if type(obj["v"]) is int and obj["v"] == 1
            else ""
        )
        raise bad(f"format version {obj['v']!r}{older}, this reader knows {FORMAT_VERSION}")
    if type(seq) is not int or seq < 0:
        raise bad(f"seq {seq!r} is not a non-negative integer")
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise bad(f"kind {kind!r}")
    if not isinstance(prev, str) or not _HEX64_RE.fullmatch(prev):
        raise bad("prev is not 64 hex digits")
    if not isinstance(signer, str) or not _HEX16_RE.fullmatch(signer):
        raise bad("signer is not a 16-hex-digit key id")
    if not isinstance(run_id, str) or not run_id:
        raise bad("run_id is not a non-empty string")
    if not isinstance(body, dict):
        raise bad("body is not an object")
    if kind == CHECKPOINT and not _is_checkpoint_body(body):
        raise bad('a checkpoint body must be {"root": 64 hex, "size": integer}')
    return Entry(
        seq, kind, run_id, prev, signer, body, record.data, record.signature, record.offset
    )


def _is_checkpoint_body(body: dict[str, Any]) -> bool:
    return (
        set(body) == {"root", "size"}
        and type(body["size"]) is int
        and body["size"] >= 0
        and isinstance(body["root"], str)
        and _HEX64_RE.fullmatch(body["root"]) is not None
    )


def encode_record(key_id: str, data: bytes, signature: bytes) -> bytes:
    """The framed bytes of one record (see the module docstring)."""
    if not 0 < len(data) <= MAX_ENTRY_BYTES:
        raise TapeError(f"an entry is 1..{MAX_ENTRY_BYTES} bytes, this one {len(data)}")
    head = struct.pack(">I", len(data)) + bytes.fromhex(key_id)
    return head[:4] + struct.pack(">I", zlib.crc32(head)) + head[4:] + data + signature


@dataclass(frozen=True, slots=True)
class FramingProblem:
    """Why scanning stopped before the end of the file."""

    offset: int
    reason: str
    """"truncated record" or "corrupt record frame" or "not a tape"."""
    detail: str
    torn: bool
    """True when the rest of the file is an interrupted append: an incomplete
    record with an intact frame, an incomplete frame, or only zero bytes."""


def scan(buf: bytes | memoryview) -> tuple[list[Record], FramingProblem | None]:
    """Split a tape file's bytes into records; stop at the first framing problem."""
    mv = memoryview(buf)
    if len(mv) < len(MAGIC):
        torn = bytes(mv) == MAGIC[: len(mv)]
        why = "the header is incomplete" if torn else "no tape header"
        return [], FramingProblem(0, "not a tape" if not torn else "truncated record", why, torn)
    if bytes(mv[: len(MAGIC)]) != MAGIC:
        return [], FramingProblem(0, "not a tape", f"the file does not start with {MAGIC!r}", False)
    records: list[Record] = []
    off, end = len(MAGIC), len(mv)
    while off < end:
        rest = end - off
        if rest < FRAME_BYTES:
            torn = True
            detail = f"{rest} bytes left, a record frame is {FRAME_BYTES}"
            return records, FramingProblem(off, "truncated record", detail, torn)
        n, crc = struct.unpack_from(">II", mv, off)
        key = bytes(mv[off + 8 : off + 16])
        if zlib.crc32(bytes(mv[off : off + 4]) + key) != crc or not 0 < n <= MAX_ENTRY_BYTES:
            zeros = not any(mv[off:])
            detail = "zero bytes to the end of the file" if zeros else "frame checksum mismatch"
            reason = "truncated record" if zeros else "corrupt record frame"
            return records, FramingProblem(off, reason, detail, zeros)
        size = FRAME_BYTES + n + SIG_BYTES
        if rest < size:
            detail = f"the file ends {size - rest} bytes before the end of this record"
            return records, FramingProblem(off, "truncated record", detail, True)
        data = bytes(mv[off + FRAME_BYTES : off + FRAME_BYTES + n])
        sig = bytes(mv[off + FRAME_BYTES + n : off + size])
        records.append(Record(off, key.hex(), data, sig))
        off += size
    return records, None


def read_tape(path: str | Path) -> list[Record]:
    """All records of a tape file, unverified; TapeError on any framing problem."""
    p = Path(path)
    try:
        buf = p.read_bytes()
    except OSError as e:
        raise TapeError(f"tape {p}: {e.strerror}", reason="unreadable") from None
    records, problem = scan(buf)
    if problem is not None:
        raise TapeError(
            f"{p}: entry {len(records)} at offset {problem.offset}: {problem.reason}: "
            f"{problem.detail}",
            reason=problem.reason,
            seq=len(records),
            offset=problem.offset,
        )
    return records


def record_from_dict(d: dict[str, Any]) -> Record:
    """Inverse of ``Checkpoint.to_dict`` (the record is not yet verified)."""
    try:
        return Record(
            int(d["offset"]),
            str(d["key_id"]),
            base64.b64decode(d["entry"], validate=True),
            bytes.fromhex(d["signature"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise TapeError(f"malformed checkpoint record: {e}", reason="malformed entry") from None
