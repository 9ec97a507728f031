"""Receipts: the signed tape heads that come with every merge, kept by whoever applies it.

A node seals its tape right after each merge it commits (a signed ``checkpoint`` entry:
the size and RFC 6962 root of everything before it), in the same step, so that a merge
is never fetchable before the seal that covers it.  With every merge it serves, a node
hands out its latest seal, the framed record exactly as on its tape (``raw``): the
aggregator with a global merge; a relay with a regional merge, and with a global merge
the aggregator's seal it received with that merge besides its own.

Whoever applies a merge keeps them (``Witness``): an island the seals of its relay (and,
for a global merge, of the aggregator); a relay the aggregator's.  Each receipt is
checked on arrival (a checkpoint entry of this run, signed by the pinned key of the node
it must come from) and appended to ``<state-dir>/receipts``, one JSON line each::

    {"holder":"island-eu-0","kind":"global","receipt":"<base64 record>","signer":"relay-eu","step":40}

In a run split into streaming fragments each fragment's nodes keep a tape of their own
under the same key, and a line also names the fragment whose tape the receipt is a head
of (``"fragment":1``).

The audit (``common/trust/audit.py``) requires each kept receipt to be a head of its
tape as it is now: the tape's first ``size`` entries have the signed root (what an
RFC 6962 consistency proof from the receipt to the tape shows).  So a node that rewrites
its history after handing out a receipt, even with its own key, disagrees with every
receipt it gave before the rewrite: transparency logs call it a split view; the audit
reports it as a fork.

Lines are appended without fsync: a crash loses at most the receipts of the merge being
applied (evidence, not state), and a torn last line is skipped by readers.  A holder that
pins no keys keeps none: it could not tell a receipt from noise.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hypertrain.common.errors import HypertrainError, TapeError, UnknownKeyError
from hypertrain.common.trust.keys import TrustedKeys, write_all
from hypertrain.common.trust.ledger import AGGREGATOR_KEY
from hypertrain.common.trust.tape_format import (
    CHECKPOINT,
    MAGIC,
    Checkpoint,
    Entry,
    canonical_json,
    encode_record,
    parse_entry,
    scan,
)

RECEIPTS_FILE = "receipts"
#: Steps whose receipts a witness holds in memory per signer, to pass on: the merges a
#: relay serves are its newest (older ones fall back to the newest receipt, also evidence).
HELD_STEPS = 2
#: A receipt is one framed checkpoint record: a few hundred bytes.
MAX_RECEIPT_BYTES = 4096


class ReceiptError(HypertrainError):
    """A merge came with a missing or invalid receipt (the message says which and why)."""


def raw_receipt(entry: Entry) -> bytes:
    """The receipt of a tape's checkpoint entry: its record, framed as on the tape."""
    return encode_record(entry.signer, entry.data, entry.signature)


def open_receipt(raw: bytes, trusted: TrustedKeys, run_id: str, signer: str) -> Checkpoint:
    """The checkpoint a receipt holds, after checking that it is one framed record, signed
    by ``signer``'s pinned key (a key name), a checkpoint entry, of run ``run_id``;
    TapeError naming the problem otherwise."""
    if not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_RECEIPT_BYTES:
        raise TapeError(f"a receipt is 1..{MAX_RECEIPT_BYTES} bytes", reason="malformed entry")
    records, problem = scan(MAGIC + raw)
    if problem is not None or len(records) != 1:
        why = problem.detail if problem is not None else f"{len(records)} records"
        raise TapeError(f"not one framed record ({why})", reason="malformed entry")
    rec = records[0]
    try:
        key = trusted.lookup(signer)
    except UnknownKeyError:
        raise TapeError(f"{signer} is not a pinned key", reason="unknown key") from None
    if rec.key_id != key.key_id:
        try:
            other = f"by {trusted.lookup(rec.key_id).name}"
        except UnknownKeyError:
            other = f"by key {rec.key_id}, which is not pinned"
        raise TapeError(f"signed {other}, not by {signer}", reason="wrong signer")
    if not key.verify(rec.data, rec.signature):  # before parsing, as everywhere
        raise TapeError(f"bad signature (not {signer}'s)", reason="bad signature")
    e = parse_entry(rec)
    if e.kind != CHECKPOINT or e.signer != rec.key_id:
        raise TapeError(f"a {e.kind} entry, not a checkpoint", reason="malformed entry")
    if e.run_id != run_id:
        raise TapeError(f"of run {e.run_id!r}, not {run_id!r}", reason="wrong run id")
    return Checkpoint(e)


def producers(kind: str, source: str) -> list[str]:
    """Whose receipts a merge of ``kind`` fetched from ``source`` (the node's key name:
    a relay's, or ``aggregator``) must carry: its source's, and a global merge the
    aggregator's too, in that order (aggregator first)."""
    if kind == "global" and source != AGGREGATOR_KEY:
        return [AGGREGATOR_KEY, source]
    return [source]


@dataclass(frozen=True, slots=True)
class KeptReceipt:
    """One line of a receipts file: ``holder`` received ``signer``'s head with the merge
    of ``step`` (``kind``); ``where``: the file and line, for messages."""

    holder: str
    signer: str
    step: int
    kind: str
    raw: bytes
    where: str
    fragment: int | None = None
    """The streaming fragment whose tape it is a head of (None: the run is not split)."""


class Witness:
    """Checks and keeps the receipts that come with the merges one holder applies."""

    def __init__(
        self,
        folder: Path | None,
        holder: str,
        run_id: str,
        trusted: TrustedKeys | None,
        fragment: int | None = None,
    ) -> None:
        """``holder``: the key name of whoever keeps them (``island-eu-0``, ``relay-eu``);
        ``trusted``: its pinned keys (None: it checks and keeps nothing); ``folder``: its
        state folder (None: it checks, keeps nothing); ``fragment``: the streaming fragment
        of the merges it takes (a node of one fragment; an island says it per merge)."""
        self.holder = holder
        self.fragment = fragment
        self.run_id = run_id
        self.trusted = trusted
        self.path = folder / RECEIPTS_FILE if folder is not None and trusted else None
        self._lock = threading.Lock()
        self._held: dict[tuple[int, str], bytes] | None = None if self.path else {}
        """(step, signer) -> receipt, the newest ``HELD_STEPS`` steps of each signer: what a
        relay passes on to its islands.  Read from the file on first use (an island, which
        passes nothing on, never reads it)."""

    def take(
        self,
        step: int,
        kind: str,
        receipts: Sequence[bytes],
        source: str,
        fragment: int | None = None,
    ) -> None:
        """Check the receipts of the merge of ``step`` (``kind``; of ``fragment``, else
        the witness's own) fetched from ``source`` and keep them; ReceiptError unless
        they are exactly one valid receipt of each node that must give one
        (``producers``)."""
        if self.trusted is None:
            return
        if fragment is None:
            fragment = self.fragment
        want = producers(kind, source)
        if len(receipts) != len(want):
            raise ReceiptError(
                f"the {kind} merge of step {step} from {source} came with {len(receipts)} "
                f"receipts, not {len(want)} ({', '.join(want)}): a node that pins keys "
                "applies a merge only with the signed tape heads of the nodes that made it "
                "(their tapes need --signing-key and --state-dir)"
            )
        for signer, raw in zip(want, receipts, strict=True):
            try:
                open_receipt(raw, self.trusted, self.run_id, signer)
            except TapeError as e:
                raise ReceiptError(
                    f"the {kind} merge of step {step} from {source}: {signer}'s receipt is "
                    f"invalid: {e}"
                ) from None
        lines = b"".join(
            canonical_json(
                {
                    "holder": self.holder,
                    "kind": kind,
                    "receipt": base64.b64encode(raw).decode("ascii"),
                    "signer": signer,
                    "step": step,
                    **({} if fragment is None else {"fragment": fragment}),
                }
            )
            + b"\n"
            for signer, raw in zip(want, receipts, strict=True)
        )
        with self._lock:
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                _append_whole(self.path, lines)
            if self._held is not None:
                for signer, raw in zip(want, receipts, strict=True):
                    self._hold(self._held, step, signer, raw)

    @property
    def held(self) -> dict[tuple[int, str], bytes]:
        """The receipts held to pass on (read from the file the first time)."""
        with self._lock:
            if self._held is None:
                held: dict[tuple[int, str], bytes] = {}
                if self.path is not None and self.path.exists():
                    for kept in read_receipts(self.path):
                        self._hold(held, kept.step, kept.signer, kept.raw)
                self._held = held
            return self._held

    @staticmethod
    def _hold(held: dict[tuple[int, str], bytes], step: int, signer: str, raw: bytes) -> None:
        held[(step, signer)] = raw
        steps = sorted(s for s, who in held if who == signer)
        for old in steps[:-HELD_STEPS]:
            del held[(old, signer)]

    def passed_on(self, step: int, signer: str) -> bytes | None:
        """The receipt of ``signer`` to hand on with the merge of ``step``: the one kept
        with it, else the newest held (any signed head of that tape is evidence)."""
        held = self.held
        with self._lock:
            got = held.get((step, signer))
            if got is None:
                steps = [s for s, who in held if who == signer]
                got = held[(max(steps), signer)] if steps else None
            return got


def _append_whole(path: Path, lines: bytes) -> None:
    """Append ``lines`` to ``path`` whole, or leave the file as it was and raise the
    OSError: a write may take fewer bytes than asked (a disk nearly full), and a torn
    line that a later append continued would make the file unreadable (``read_receipts``
    skips only a torn *last* line)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        try:
            write_all(fd, lines)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)  # best effort: a torn last line is skipped anyway
            raise
    finally:
        os.close(fd)


def read_receipts(path: Path) -> list[KeptReceipt]:
    """Every receipt line of one file (a torn last line is skipped); HypertrainError
    naming the line for one that is not a receipt line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise HypertrainError(f"{path}: {e.strerror}") from None
    lines = data.split(b"\n")
    out = []
    for n, line in enumerate(lines[:-1], start=1):  # the part after the last newline is torn
        where = f"{path} line {n}"
        try:
            d = json.loads(line)
            kept = KeptReceipt(
                str(d["holder"]),
                str(d["signer"]),
                int(d["step"]),
                str(d["kind"]),
                base64.b64decode(d["receipt"], validate=True),
                where,
                None if d.get("fragment") is None else int(d["fragment"]),
            )
        except (ValueError, KeyError, TypeError, binascii.Error) as e:
            raise HypertrainError(f"{where}: not a receipt line ({e})") from None
        out.append(kept)
    return out


def find_receipts(roots: Sequence[Path]) -> Iterator[Path]:
    """The receipts files in these folders (searched recursively) or files."""
    for root in roots:
        if root.is_file():
            yield root
        elif root.is_dir():
            yield from sorted(p for p in root.rglob(RECEIPTS_FILE) if p.is_file())
        else:
            raise HypertrainError(f"{root}: no such receipts file or folder")
