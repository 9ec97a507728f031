"""The tape's entry bodies, typed: one frozen record per entry kind.

Every producer (the relay and aggregator nodes) builds a record and writes
``record.to_body()``; every reader (recovery, replay, the audit) parses a verified
entry with ``parse(entry)``, which refuses a body that does not have exactly the
kind's fields with the right types, naming the entry, the kind and the field.  No
other module builds or indexes a body dict.

Bodies hold no floats (common/trust/tape_format.py): digests are hex strings, steps
are ints, codec and outer-optimizer parameters are dicts whose floats are ``repr``
strings (``tape_safe``).  The bytes on disk are the same as before the records
existed (tests/unit/test_schema.py pins a body of each kind).

Kinds (fields in the order replay compares them, so a mismatch names the first
differing field):

- ``input`` (relay, aggregator): an accepted delta: round, sync_step, sender, digest,
  size, codec, signature (hex, Ed25519 of ``ledger.transfer_message``).
- ``rejection``: code, reason, and the claimed sender, sync_step, round when the
  transfer header was readable.
- ``regional_merge`` (relay): round, sync_step, tau, merge_step, codec, members
  [[island, blob digest], ...], mean (output digest), commitment, pre_base, post_base.
- ``forward`` (relay, at a global sync step): round, sync_step, codec, digest, size,
  pre_residual, post_residual (the relay's global-codec error feedback).
- ``global_applied`` (relay): round, sync_step, merge_step, theta (digest), and
  ``rejoined_from`` when the region had been left behind and skips to this round.
- ``global_merge`` (aggregator): round, sync_step, tau, merge_step, codec, outer,
  members [[region, blob digest], ...], mean, commitment, pre_state, post_state, pre_outer,
  post_outer.
- ``cutoff`` (relay, aggregator): the cutoff of an open sync step was reached: round,
  sync_step, present (members that had delivered), absent (those that had not), quorum
  (units needed to commit without them).  A merge with absent members follows a cutoff.
- ``member`` (relay): an island joined or left the region: change ("join" | "leave"),
  member, round and sync_step (the first sync step the change applies to), start (a
  join: the sync step whose merge the joiner starts from; 0: the initial parameters),
  step (the island's own step when it asked), issued (when it asked, ns), signature (hex, Ed25519 of
  ``ledger.member_message``; "" when keys are not pinned).
- ``checkpoint``: written by ``TapeWriter.checkpoint`` itself (size, root).

With ``RunConfig.fragments`` > 1 every entry names its streaming ``fragment`` (each
fragment's nodes keep a tape of their own, whose genesis names it too); the field is
absent otherwise.

A ``regional_merge`` or ``global_merge`` that went ahead without some members names them
in ``absent`` (omitted when every member delivered, so such entries are byte for byte
those of a run without cutoffs); a ``rejection`` may carry the refused delta's ``digest``
(a stale delta, kept as evidence, never aggregated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

from hypertrain.common.errors import TapeError
from hypertrain.common.trust.tape_format import CHECKPOINT, Entry

if TYPE_CHECKING:
    from hypertrain.common.config import RunConfig
    from hypertrain.common.trust.keys import TrustedKeys

Members = tuple[tuple[str, str], ...]
"""Ordered (member, blob digest of its encoded input) pairs of an aggregate."""
Names = tuple[str, ...]
"""Ordered member ids."""


class SchemaError(TapeError):
    """A verified entry whose body is not what its kind says (a wrong or missing field)."""


def _check(kind: str, name: str, value: Any, typ: Any) -> Any:
    if typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is Members:
        ok = isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in value
        )
        value = tuple((p[0], p[1]) for p in value) if ok else value
    elif typ is Names:
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, typ)
    if not ok:
        raise SchemaError(f"{kind} entry: field {name!r} has the wrong type", reason="schema")
    return value


@dataclass(frozen=True, slots=True)
class _Record:
    """Shared by every record: strict parsing and the canonical body."""

    KIND: ClassVar[str]
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    fragment: int | None = dataclasses.field(default=None, kw_only=True)
    """The streaming fragment the entry is of (RunConfig.fragments > 1; absent otherwise,
    so the bodies of a run that is not split are those of before fragments)."""

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Any:
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        extra = sorted(set(body) - names)
        if extra:
            raise SchemaError(f"{cls.KIND} entry: unexpected field {extra[0]!r}", reason="schema")
        values: dict[str, Any] = {}
        for f in fields:
            if f.name not in body:
                if f.name in cls.OPTIONAL or f.name == "fragment":
                    continue
                raise SchemaError(f"{cls.KIND} entry: missing field {f.name!r}", reason="schema")
            values[f.name] = _check(cls.KIND, f.name, body[f.name], _TYPES[f.type])  # type: ignore[index]
        return cls(**values)

    def to_body(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and (f.name in self.OPTIONAL or f.name == "fragment"):
                continue
            if f.type == "Members":
                v = [list(p) for p in v]
            elif f.type in ("Names", "Names | None"):
                v = list(v)
            out[f.name] = v
        return out

    def first_difference(self, other: _Record) -> str | None:
        """The first field (in declaration order) whose value differs from ``other``'s."""
        for f in dataclasses.fields(self):
            if getattr(self, f.name) != getattr(other, f.name):
                return f.name
        return None


_TYPES: dict[str, Any] = {
    "int": int,
    "str": str,
    "Members": Members,
    "dict[str, Any]": dict,
    "dict[str, Any] | None": dict,
    "int | None": int,
    "str | None": str,
    "Names": Names,
    "Names | None": Names,
}


@dataclass(frozen=True, slots=True)
class GenesisEntry(_Record):
    """The first entry of every node's tape: the run it belongs to.

    The aggregator's carries the run's configuration itself (``config``: its canonical
    JSON, whose sha256 is ``config_digest``); a relay's refers to it by that digest and
    names the relay (``member``: a region, or ``region/i`` for a shard).  Both list the
    keys the node pinned (``keys``: name -> key id).  Everything a later entry records
    about the rules (tau, codecs, the outer optimizer, quorum, membership) follows from
    this configuration, so the audit replays with it and refuses a run folder whose
    ``run.toml`` says anything else.  ``ca``: the fingerprint of the run CA the node's TLS
    pins (sha256 of its DER; absent in plaintext): every daemon certificate of the run
    chains to it, so a daemon certificate may be reissued but the CA stays the run's."""

    KIND: ClassVar[str] = "genesis"
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"config", "member", "ca"})
    role: str
    config_digest: str
    keys: dict[str, Any]
    config: str | None = None
    member: str | None = None
    ca: str | None = None

    @classmethod
    def of(
        cls,
        cfg: RunConfig,
        role: str,
        member: str | None,
        trusted: TrustedKeys | None,
        ca: str | None = None,
        fragment: int | None = None,
    ) -> GenesisEntry:
        """The genesis of a node of ``role`` ("aggregator", or "relay" with its ``member``
        id) in the run of ``cfg`` that pinned ``trusted`` and the run CA ``ca``; of
        streaming ``fragment`` f when the run is split (one tape per fragment)."""
        keys = {} if trusted is None else {n: trusted.lookup(n).key_id for n in trusted.names}
        aggregator = role == "aggregator"
        return cls(
            role=role,
            config_digest=cfg.digest,
            keys=keys,
            config=cfg.canonical_json() if aggregator else None,
            member=None if aggregator else member,
            ca=ca,
            fragment=fragment,
        )


@dataclass(frozen=True, slots=True)
class InputEntry(_Record):
    """An accepted delta: its membership in the round of ``sync_step``."""

    KIND: ClassVar[str] = "input"
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"shard"})
    round: int
    sync_step: int
    sender: str
    digest: str
    size: int
    codec: str
    signature: str
    """hex of the sender's Ed25519 signature over the transfer (empty when unsigned)."""
    shard: str | None = None
    """"i/S": an island's part for relay shard i of S (absent when relays are not sharded)."""


@dataclass(frozen=True, slots=True)
class RejectionEntry(_Record):
    """A refused push: why, and who it claimed to be from (when that was readable)."""

    KIND: ClassVar[str] = "rejection"
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"sender", "sync_step", "round", "digest"})
    code: str
    reason: str
    sender: str | None = None
    sync_step: int | None = None
    round: int | None = None
    digest: str | None = None
    """Blob digest of a refused delta that was whole and signed (a stale one, or one whose values
    were out of bounds), as evidence."""


@dataclass(frozen=True, slots=True)
class CutoffEntry(_Record):
    """The cutoff of an open sync step: who had delivered, and the quorum to commit."""

    KIND: ClassVar[str] = "cutoff"
    round: int
    sync_step: int
    present: Names
    absent: Names
    quorum: int
    """Units (islands; regions at the aggregator) needed to commit without the absent."""


@dataclass(frozen=True, slots=True)
class MemberEntry(_Record):
    """A membership change of a region: an island joined or left (see the module text)."""

    KIND: ClassVar[str] = "member"
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"start"})
    change: str
    member: str
    round: int
    sync_step: int
    step: int
    issued: int
    signature: str
    start: int | None = None


@dataclass(frozen=True, slots=True)
class RegionalMergeEntry(_Record):
    """A relay's committed regional mean and how its base moved."""

    KIND: ClassVar[str] = "regional_merge"
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"absent", "robust"})
    round: int
    sync_step: int
    tau: int
    merge_step: int
    codec: dict[str, Any]
    members: Members
    mean: str
    commitment: str
    pre_base: str
    post_base: str
    absent: Names | None = None
    """Members that had not delivered when the step committed after its cutoff."""
    robust: dict[str, Any] | None = None
    """What the run's robust rule decided (``aggregate.Commitment.robust``: each input's
    norm, who was left out, the clip or the trim); absent for the plain mean."""


@dataclass(frozen=True, slots=True)
class ForwardEntry(_Record):
    """What a relay sent the aggregator for a global round, and its error feedback."""

    KIND: ClassVar[str] = "forward"
    round: int
    sync_step: int
    codec: str
    digest: str
    size: int
    pre_residual: str
    post_residual: str


@dataclass(frozen=True, slots=True)
class GlobalAppliedEntry(_Record):
    """A relay took the aggregator's new global parameters (their digest)."""

    KIND: ClassVar[str] = "global_applied"
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"rejoined_from"})
    round: int
    sync_step: int
    merge_step: int
    theta: str
    rejoined_from: int | None = None
    """The global sync step this relay forwarded, when the aggregator's rounds had gone
    on without its region past it: the relay (and its islands) skip to ``sync_step``."""


@dataclass(frozen=True, slots=True)
class GlobalMergeEntry(_Record):
    """The aggregator's commit record of one outer step."""

    KIND: ClassVar[str] = "global_merge"
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"absent"})
    round: int
    sync_step: int
    tau: int
    merge_step: int
    codec: dict[str, Any]
    outer: dict[str, Any]
    members: Members
    mean: str
    commitment: str
    pre_state: str
    post_state: str
    pre_outer: str
    post_outer: str
    absent: Names | None = None
    """Members (relays) that had not delivered when the round committed after its cutoff."""


@dataclass(frozen=True, slots=True)
class AnnealEntry(_Record):
    """The decay phase starts after sync step ``step`` (RunConfig.anneal): from the next
    step on, every step syncs regionally (``mode`` ``h_r1``)."""

    KIND: ClassVar[str] = "anneal"
    step: int
    mode: str
    h_r: int
    """The regional sync interval from then on."""


@dataclass(frozen=True, slots=True)
class LawaEntry(_Record):
    """The aggregator published the LAWA average as the run's final model (RunConfig.lawa):
    the fixed-order fp32 mean of its states after global rounds ``first_round`` to
    ``last_round``, whose digests (``post_state`` of their ``global_merge`` entries) are
    ``states``, oldest first."""

    KIND: ClassVar[str] = "lawa"
    first_round: int
    last_round: int
    states: Names
    average: str
    """``flat_digest`` of the mean."""


Record: TypeAlias = (
    GenesisEntry
    | InputEntry
    | RejectionEntry
    | RegionalMergeEntry
    | ForwardEntry
    | GlobalAppliedEntry
    | GlobalMergeEntry
    | CutoffEntry
    | MemberEntry
    | LawaEntry
    | AnnealEntry
)
KINDS: dict[str, type[_Record]] = {
    c.KIND: c
    for c in (
        GenesisEntry,
        InputEntry,
        RejectionEntry,
        RegionalMergeEntry,
        ForwardEntry,
        GlobalAppliedEntry,
        GlobalMergeEntry,
        CutoffEntry,
        MemberEntry,
        LawaEntry,
        AnnealEntry,
    )
}


def parse(entry: Entry) -> Record | None:
    """The typed record of a verified entry (None for a tape ``checkpoint``).

    Raises SchemaError naming the entry when its kind is unknown or its body is not
    exactly the kind's fields."""
    if entry.kind == CHECKPOINT:
        return None
    cls = KINDS.get(entry.kind)
    if cls is None:
        raise SchemaError(f"entry {entry.seq}: unknown entry kind {entry.kind!r}", reason="schema")
    try:
        record: Record = cls.from_body(entry.body)
    except SchemaError as e:
        raise SchemaError(f"entry {entry.seq}: {e}", reason="schema", seq=entry.seq) from None
    return record


def records(entries: Iterable[Entry]) -> list[Record]:
    """The typed records of ``entries`` in order (tape checkpoints left out)."""
    return [r for r in (parse(e) for e in entries) if r is not None]


def tape_safe(obj: Any) -> Any:
    """``obj`` with every float replaced by its repr string (tape entries hold no floats:
    a float's text could re-serialize differently; see common/trust/tape_format.py)."""
    if isinstance(obj, float):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: tape_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [tape_safe(v) for v in obj]
    return obj
