"""Sans-I/O round machines of the relay and the aggregator.

Each machine is fed events (a delta arrived; the aggregator's new global state arrived)
and returns a :class:`Decision` (accepted or not, and why, in words a daemon can put in
a gRPC status) plus effects, in the order their tape entries are written: every effect
carries its typed tape record (common/trust/schema.py).  There are no sockets, threads,
files or clocks in here.  ``replay.py`` rebuilds a machine from its tape by feeding the
same events again; the nodes (``node.py``) add durability; the daemons and the
in-process cluster only deliver events.

Round rules (the same at both levels; docs/design.md §4, §4.10):
- Membership is decided by step and by events, never by reading a clock: the members of
  a sync step are all configured senders (islands of the region; regions of the run), and
  the step commits when the last of them has delivered; or, after the driver's cutoff
  event for the step (``on_cutoff``, taped), as soon as the members that delivered meet
  the level's quorum (``MembershipConfig.quorum``).  The mean is then over the members
  present, in the same fixed order; the absent are named in the merge record.
- A delta for a step that closed without its sender is refused (PRECONDITION, marked
  ``stale``) and taped as a rejection with its digest; it is never aggregated.
- A region's members change by events too (``RelayMachine.on_member``, taped as
  ``member`` entries): an island of the region that is not a member (on standby, or it
  left) joins from the first regional sync step after the next global one, starting from
  that global merge (in a region with no members left: from the relay's newest merge);
  a member leaves from the open step, or from the next one when it already delivered
  the open step, and the open step commits at once if everyone left has delivered.
- Only the open sync step accepts deltas.  An identical resend of an accepted delta
  (same step, sender and digest) is answered as a duplicate and counted once; different
  bytes for an accepted (step, sender) are refused.
- Every delta is validated against the run's codec and parameter count (``Codec.open``)
  before it is accepted, and its signature against the pinned keys when keys are pinned.
- A relay forwards its region's delta at every global sync step and takes no delta for
  the next step until the aggregator's new state has arrived (``on_global``).

A decision either completes (state and effects) or leaves the machine exactly as it was.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from hypertrain.common import planted
from hypertrain.common.aggregate import Blob, Commitment, delta_norm
from hypertrain.common.codec import Codec, ErrorFeedback
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest, zeros_digest
from hypertrain.common.errors import HypertrainError, UnknownKeyError
from hypertrain.common.optim import LawaSum
from hypertrain.common.pages import drop_pages
from hypertrain.common.roles import GlobalCore, RegionCore
from hypertrain.common.schedule import Schedule, SyncKind
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.ledger import (
    flat_digest,
    island_key,
    member_message,
    outer_state_digest,
    relay_key,
    transfer_message,
)
from hypertrain.common.trust.schema import (
    AnnealEntry,
    CutoffEntry,
    ForwardEntry,
    GlobalAppliedEntry,
    GlobalMergeEntry,
    InputEntry,
    LawaEntry,
    MemberEntry,
    Record,
    RegionalMergeEntry,
    tape_safe,
)
from hypertrain.common.trust.tape_format import INT_LIMIT

# Decision codes: the driver maps them to transport status codes.
OK = "ok"
INVALID = "invalid_argument"  # malformed or not meant for this daemon: never retry
PRECONDITION = "failed_precondition"  # not now (step ahead, round pending): retry later
CONFLICT = "already_exists"  # different bytes for an accepted (step, sender)
CORRUPT = "data_loss"  # the bytes are not the ones the digest names: resending may fix it
TOO_LARGE = "resource_exhausted"  # larger than any encoding of the model: never retry


@dataclass(frozen=True, slots=True)
class Delta:
    """An encoded delta as the transport received it (its digest already verified)."""

    run_id: str
    round: int
    sync_step: int
    sender: str
    digest: str
    codec: str
    data: Blob
    signature: bytes = b""
    """Ed25519 over ``ledger.transfer_message`` of the fields above, by the sender's key."""
    digest_checked: bool = True
    """``digest`` is the ``blob_digest`` of ``data`` (the transport checked it, or it was computed);
    False for bytes read back from a published folder, which nothing checked yet."""
    shard: str = ""
    """"i/S": an island's part for relay shard i of S ("" when relays are not sharded;
    a relay shard's forward is told apart by its sender, ``eu/1``)."""
    fragment: int | None = None
    """The streaming fragment it is a delta of (None when the run is not split)."""

    @classmethod
    def of(
        cls,
        run_id: str,
        sync_step: int,
        sender: str,
        codec: str,
        data: Blob,
        schedule: Schedule,
        shard: str = "",
    ) -> Delta:
        """A new delta of ``sender`` for ``sync_step`` of ``schedule``'s fragment (digest
        computed, not signed)."""
        return cls(
            run_id,
            schedule.round_of(sync_step),
            sync_step,
            sender,
            blob_digest(data),
            codec,
            data,
            shard=shard,
            fragment=schedule.fragment,
        )

    @classmethod
    def from_record(cls, run_id: str, rec: InputEntry, data: Blob) -> Delta:
        """The delta a taped ``input`` entry recorded, with its bytes read back."""
        return cls(
            run_id,
            rec.round,
            rec.sync_step,
            rec.sender,
            rec.digest,
            rec.codec,
            data,
            bytes.fromhex(rec.signature),
            digest_checked=False,  # recomputed where it matters (the merge's commitment)
            shard=rec.shard or "",
            fragment=rec.fragment,
        )

    def signed(self, signature: bytes) -> Delta:
        return dataclasses.replace(self, signature=signature)

    def transfer_message(self) -> bytes:
        """The canonical bytes the sender signs."""
        return transfer_message(
            self.run_id,
            self.round,
            self.sync_step,
            self.sender,
            self.digest,
            len(self.data),
            self.codec,
            self.shard,
            self.fragment,
        )

    def record(self) -> InputEntry:
        """The tape record of this delta once accepted."""
        return InputEntry(
            round=self.round,
            sync_step=self.sync_step,
            sender=self.sender,
            digest=self.digest,
            size=len(self.data),
            codec=self.codec,
            signature=self.signature.hex(),
            shard=self.shard or None,
            fragment=self.fragment,
        )


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether a delta was taken, and why (one readable line)."""

    code: str
    reason: str
    duplicate: bool = False
    stale: bool = False
    """Refused because its step closed without this sender at a cutoff: resending cannot
    help; the sender takes the step's merge instead (transports say so to the sender)."""
    over: bool = False
    """Refused because the run is over for it (complete, or no round left to join)."""
    evidence: bool = False
    """Refused for what its signed bytes hold (values out of bounds): the refusal is taped
    with the delta's digest, as evidence against its sender."""
    start: int | None = None
    """A join taken (or a member asking again): the sync step whose merge the island
    starts from (0: the initial parameters); None for a member since the run began, which
    continues from its own state."""

    @property
    def accepted(self) -> bool:
        return self.code == OK


#: The largest magnitude a delta's decoded values may reach, per level (``_Level.check``
#: refuses more, with the figure, before anything is summed).  Training deltas are many
#: orders of magnitude smaller; these keep every sum a node forms finite in fp32 (about
#: 2^128): a region's mean of up to 2^30 islands stays under 2^94, a relay's forward
#: (the regional means of one global round, at most 2^32 of them) under 2^96, and the
#: aggregator's mean of up to 2^20 regions, with the outer step's momentum and learning
#: rate, far under 2^128.  Without it two islands with huge finite values made a region's
#: sum overflow to inf, and the relay could never forward again.
MAX_VALUE: dict[str, float] = {"regional": 2.0**64, "global": 2.0**96}


def out_of_range(**fields: int) -> Decision | None:
    """INVALID naming the first of ``fields`` (a round, step or time a message carries)
    outside 0 .. 2^63 - 1, what a tape entry can hold; None if all are in range.  Checked
    before anything is decided, so no such value reaches a machine's state or a tape."""
    for name, value in fields.items():
        if not 0 <= value < INT_LIMIT:
            return Decision(INVALID, f"{name} {value} is out of range: at most 2^63 - 1")
    return None


# -- events -------------------------------------------------------------------------------
JOIN, LEAVE = "join", "leave"


@dataclass(frozen=True, slots=True)
class MemberRequest:
    """Event at a relay: an island of the region asks to join it, or to leave it."""

    run_id: str
    change: str
    """``JOIN`` or ``LEAVE``."""
    member: str
    step: int
    """The island's own step when it asked."""
    issued: int
    """When it asked (ns since the epoch in the daemons, virtual time in the simulation):
    later than its last taped change, or refused (a replayed old request)."""
    signature: bytes = b""
    """Ed25519 over ``ledger.member_message`` of the fields above, by the island's key."""

    def message(self) -> bytes:
        return member_message(self.run_id, self.change, self.member, self.step, self.issued)

    def signed(self, signature: bytes) -> MemberRequest:
        return dataclasses.replace(self, signature=signature)

    @classmethod
    def from_record(cls, run_id: str, rec: MemberEntry) -> MemberRequest:
        return cls(
            run_id, rec.change, rec.member, rec.step, rec.issued, bytes.fromhex(rec.signature)
        )


@dataclass(frozen=True, slots=True)
class GlobalArrived:
    """Event at a relay: the aggregator's theta_{g+1} for the global round of ``sync_step``,
    with the aggregator's commitment to it (what islands are told they receive).

    The relay keeps ``theta`` itself (it is the merge it serves): whoever sends the event
    must not write to that tensor afterwards."""

    sync_step: int
    theta: torch.Tensor
    commitment: Commitment
    digest: str = ""
    """``flat_digest(theta)`` when the transport already verified it ("": computed here)."""


# -- effects (each with the tape record that says it happened) ------------------------------
@dataclass(frozen=True, slots=True)
class Publish:
    """Effect: keep this accepted input's bytes under its digest, tape it as an input."""

    delta: Delta
    record: InputEntry


@dataclass(frozen=True, slots=True)
class Committed:
    """Effect: an aggregate was committed (a regional mean, or a global outer step).

    Also what members fetch: ``kind`` tells them what ``payload`` is."""

    level: SyncKind
    round: int
    sync_step: int
    merge_step: int
    commitment: Commitment
    payload: torch.Tensor
    """Regional: the relay's base after the merge, which islands take (empty at a global
    sync step, where they take the global merge instead); global: theta_{g+1}."""
    kind: SyncKind  # the merge kind islands apply
    record: RegionalMergeEntry | GlobalMergeEntry | None
    """The commit record (None: a relay's copy of the aggregator's global merge)."""
    input_bytes: int = 0
    payload_digest: str = ""
    """``flat_digest(payload)`` where already known (a global merge's post state), else ""."""
    receipts: tuple[bytes, ...] = ()
    """The signed tape heads it was served with (``common/trust/receipts.py``): set by the
    node that serves it, checked and kept by whoever applies it."""


@dataclass(frozen=True, slots=True)
class Forward:
    """Effect: send this region's delta for the global round to the aggregator."""

    round: int
    sync_step: int
    codec: str
    data: Blob
    record: ForwardEntry


@dataclass(frozen=True, slots=True)
class Applied:
    """Effect at a relay: the global merge arrived and was applied (its record is taped,
    then the relay checkpoints)."""

    merge: Committed
    record: GlobalAppliedEntry


@dataclass(frozen=True, slots=True)
class Cut:
    """Effect: the cutoff of the open sync step was reached (taped before any merge it
    allowed)."""

    record: CutoffEntry
    waiting: bool = False
    """Below the quorum: nothing committed; the step commits when the quorum is in."""


@dataclass(frozen=True, slots=True)
class ArmCutoff:
    """Effect: the first delta of an open sync step was taken and the level has a cutoff:
    the driver raises ``on_cutoff(sync_step)`` ``seconds`` from now (a wall-clock timer in
    the daemons, virtual time in the in-process cluster).  Nothing is taped for it: the
    ``cutoff`` entry is, when the event comes."""

    sync_step: int
    seconds: float
    record: None = None


@dataclass(frozen=True, slots=True)
class Membership:
    """Effect: an island joined or left the region (taped before any merge it allowed)."""

    record: MemberEntry


@dataclass(frozen=True, slots=True)
class Averaged:
    """Effect at the aggregator, right after the run's last global merge (RunConfig.lawa):
    the LAWA average of its last global states, published as the final model."""

    payload: torch.Tensor
    record: LawaEntry


@dataclass(frozen=True, slots=True)
class Switched:
    """Effect at a relay and at the aggregator, right after the merge of the anneal's
    first step (RunConfig.anneal): from the next step on the schedule is the anneal's."""

    record: AnnealEntry


def anneal_members(
    cfg: RunConfig,
    schedule: Schedule,
    roster: tuple[str, ...],
    region_of: Callable[[str], str],
) -> tuple[int, frozenset[str]] | None:
    """An ``islands:K`` anneal: (its first step on ``schedule``, a streaming fragment's own
    with fragments, the senders of ``roster`` that stay members after it).  A relay's
    senders are islands: those the anneal keeps; the aggregator's are relays
    (``region_of`` one of them is its region): those of the regions with a kept island.
    None for another anneal."""
    kept = cfg.anneal_kept()
    if kept is None:
        return None
    start = cfg.anneal_step_of(schedule.fragment)
    assert start is not None
    regions = {cfg.topology.region_of(i) for i in kept}
    stay = frozenset(m for m in roster if m in kept or region_of(m) in regions)
    return start, stay


def anneal_switch(schedule: Schedule, cfg: RunConfig, step: int) -> list[Effect]:
    """The anneal's switch, after the merge of ``step`` if the anneal starts there (on
    ``schedule``: a streaming fragment switches at its own start)."""
    if step != cfg.anneal_step_of(schedule.fragment) or cfg.anneal == "full_m":
        return []
    h_r = schedule.next_sync_step("regional", step) - step  # the interval from then on
    return [Switched(AnnealEntry(step=step, mode=cfg.anneal, h_r=h_r, fragment=schedule.fragment))]


Effect = (
    Publish | Committed | Forward | Applied | Cut | ArmCutoff | Membership | Averaged | Switched
)


@dataclass
class _Level:
    """Bookkeeping shared by both machines: the open step and who delivered what."""

    cfg: RunConfig
    schedule: Schedule
    level: SyncKind
    role: str
    roster: tuple[str, ...]
    """Every sender this level may ever have (the region's islands; the run's regions or
    relay shards), in the fixed order of aggregation."""
    codec: Codec
    numel: int
    open_step: int
    inputs: dict[str, Delta] = field(default_factory=dict)
    accepted: dict[tuple[int, str], str] = field(default_factory=dict)  # (step, sender) -> digest
    trusted: TrustedKeys | None = None  # None: signatures are not required
    signer_of: Callable[[str], str] = str  # sender id -> key name
    numel_of: Callable[[str], int] | None = None  # sender id -> values it sends (else numel)
    shard: str = ""  # the relay shard "i/S" island deltas must be for ("" : not sharded)
    deliveries: int = 0  # planted bug count_duplicate_twice only
    region: str = ""  # the region of a relay's level
    unit_of: Callable[[str], str] = str
    """Member -> the unit a quorum counts (a relay shard ``eu/1`` -> its region ``eu``)."""
    cut: bool = False
    """The open step's cutoff was reached: it commits once the quorum has delivered."""
    absent_at: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Closed sync step -> the members it went ahead without."""
    members_at: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Closed sync step with absences -> the members whose inputs it aggregated."""
    skipped: list[tuple[int, int]] = field(default_factory=list)
    """(first, last) sync steps this level never committed: a relay left behind by the
    global rounds rejoins at ``last`` (``skip_to``)."""
    initial: tuple[str, ...] | None = None
    """The members when the run starts (None: the whole roster)."""
    changes: list[MemberEntry] = field(default_factory=list)
    """Joins and leaves in the order they were taped; each applies from its sync step."""
    kept_after: tuple[int, frozenset[str]] | None = None
    """An ``islands:K`` anneal (RunConfig.anneal_kept): after this sync step only these
    senders are members (``anneal_members``)."""
    _cache: tuple[int, int, tuple[str, ...]] = (-1, -1, ())

    @property
    def members(self) -> tuple[str, ...]:
        """The members of the open step."""
        return self.members_for(self.open_step)

    def members_for(self, step: int) -> tuple[str, ...]:
        """The members of sync step ``step`` by the changes known now (roster order)."""
        at, n, cached = self._cache
        if at == step and n == len(self.changes):
            return cached
        current = set(self.starting)
        for c in self.changes:
            if c.change == LEAVE and planted.on("members_ignore_leaves"):
                continue
            if c.sync_step <= step:
                (current.add if c.change == JOIN else current.discard)(c.member)
        if self.kept_after is not None and step > self.kept_after[0]:
            current &= self.kept_after[1]
        members = tuple(m for m in self.roster if m in current)
        self._cache = (step, len(self.changes), members)
        return members

    @property
    def starting(self) -> tuple[str, ...]:
        """The members when the run starts."""
        return self.roster if self.initial is None else self.initial

    def last_change(self, member: str) -> MemberEntry | None:
        return next((c for c in reversed(self.changes) if c.member == member), None)

    def is_in(self, member: str) -> bool:
        """A member now, or from a step to come (its last change is a join; none: it was
        a member from the start)."""
        last = self.last_change(member)
        if last is None:
            return member in self.starting
        return last.change == JOIN

    @property
    def scope(self) -> str:
        """What this level is, in refusals: "region eu" or "the global round"."""
        return "the global round" if self.level == "global" else f"region {self.region}"

    def _units(self) -> dict[str, list[str]]:
        units: dict[str, list[str]] = {}
        for m in self.members:
            units.setdefault(self.unit_of(m), []).append(m)
        return units

    @property
    def quorum(self) -> int:
        """Units needed to commit the open step after its cutoff."""
        return self.cfg.membership.quorum(self.level, len(self._units()))

    def present(self) -> tuple[str, ...]:
        """Members of the open step whose whole unit delivered (in member order)."""
        return tuple(
            m for ms in self._units().values() if all(x in self.inputs for x in ms) for m in ms
        )

    def complete(self) -> bool:
        """May the open step commit now?"""
        if planted.on("count_duplicate_twice"):
            return self.deliveries >= len(self.members)
        members = self.members
        if self.inputs and all(m in self.inputs for m in members):
            return True
        present = {self.unit_of(m) for m in self.present()}
        return self.cut and bool(present) and len(present) >= self.quorum

    def armed(self) -> ArmCutoff | None:
        """The cutoff clock the open step needs (it has deliveries, and is neither complete
        nor cut off yet), when the level has a cutoff: after its first delivery, and after a
        restart that replayed some."""
        seconds = self.cfg.membership.cutoff_s(self.level)
        if seconds <= 0 or self.cut or not self.inputs or self.complete():
            return None
        return ArmCutoff(self.open_step, seconds)

    def first_armed(self) -> ArmCutoff | None:
        """``armed`` right after the open step's first delivery (None after any other)."""
        return self.armed() if len(self.inputs) == 1 else None

    def cutoff(self, step: int) -> tuple[Decision, CutoffEntry | None]:
        """The driver says the cutoff of ``step`` was reached: the record to tape, or a
        refusal (not the open step) or a duplicate (already cut) with None."""
        if step != self.open_step:
            return Decision(
                PRECONDITION, f"cutoff for step {step}, but the open step is {self.open_step}"
            ), None
        if self.cut:
            return Decision(OK, f"step {step} was already cut off", duplicate=True), None
        self.cut = True
        present = tuple(m for m in self.members if m in self.inputs)
        record = CutoffEntry(
            fragment=self.schedule.fragment,
            round=self.schedule.round_of(step),
            sync_step=step,
            present=present,
            absent=tuple(m for m in self.members if m not in self.inputs),
            quorum=self.quorum,
        )
        return Decision(OK, f"cutoff of step {step} with {len(present)} delivered"), record

    def check(self, d: Delta, replayed: bool = False) -> Decision | None:
        """None if ``d`` may be taken into the open step; otherwise the refusal.

        ``replayed``: ``d`` comes back from this machine's own tape (its bytes are checked
        against the taped digest by the aggregate's commitment), so its payload was
        validated when it was accepted and is not decoded twice; its signature is."""
        cfg, sched = self.cfg, self.schedule
        if (refusal := out_of_range(round=d.round, sync_step=d.sync_step)) is not None:
            return refusal
        if d.run_id != cfg.run_id:
            return Decision(
                INVALID, f"wrong run: {d.run_id!r}, this {self.role} serves {cfg.run_id!r}"
            )
        if d.sender not in self.roster:
            return Decision(
                INVALID, f"{d.sender!r} is not a member here (members: {', '.join(self.roster)})"
            )
        if d.shard != self.shard:
            return Decision(
                INVALID,
                f"delta for relay shard {d.shard or '(none)'} sent to "
                f"{'shard ' + self.shard if self.shard else 'an unsharded relay'}",
            )
        if d.fragment != sched.fragment:
            mine = (
                "a run without fragments"
                if sched.fragment is None
                else f"fragment {sched.fragment}"
            )
            theirs = "no fragment" if d.fragment is None else f"fragment {d.fragment}"
            return Decision(
                INVALID, f"delta of {theirs} sent to the {self.role}, which serves {mine}"
            )
        s = d.sync_step
        if not sched.is_sync_step(s, self.level):
            return Decision(
                INVALID,
                f"step {s} is not a sync step (every {sched.interval(self.level)} steps up to "
                f"{sched.steps})",
            )
        if d.round != sched.round_of(s):
            return Decision(
                INVALID, f"round {d.round} does not match sync step {s} (round {sched.round_of(s)})"
            )
        known = self.accepted.get((s, d.sender))
        if known is not None:
            if known == d.digest:
                if planted.on("count_duplicate_twice") and s == self.open_step:
                    return None
                return Decision(
                    OK,
                    f"duplicate of the accepted delta from {d.sender} for step {s}",
                    duplicate=True,
                )
            return Decision(CONFLICT, f"{d.sender} already delivered different bytes for step {s}")
        if s < self.open_step:
            if d.sender in self.absent_at.get(s, ()):
                return Decision(
                    PRECONDITION,
                    f"sync step {s} of {self.scope} closed without {d.sender} at its cutoff",
                    stale=True,
                )
            rejoined = next((b for a, b in self.skipped if a <= s <= b), None)
            if rejoined is not None:
                return Decision(
                    PRECONDITION,
                    f"sync step {s} of {self.scope} was skipped: it rejoined the run at "
                    f"step {rejoined}",
                    stale=True,
                )
            return Decision(PRECONDITION, f"step {s} is closed (open step is {self.open_step})")
        if d.sender not in self.members_for(s):
            last = self.last_change(d.sender)
            why = (
                "it has not joined"
                if last is None
                else f"it left at step {last.sync_step}"
                if last.change == LEAVE
                else f"it is a member from step {last.sync_step}"
            )
            return Decision(
                INVALID, f"{d.sender} is not a member of {self.scope} at step {s}: {why}"
            )
        if s > self.open_step:
            return Decision(PRECONDITION, f"step {s} is ahead of the open step {self.open_step}")
        if self.trusted is not None:
            refusal = self._check_signature(d)
            if refusal is not None:
                return refusal
        if d.codec != str(self.codec.spec):
            return Decision(INVALID, f"wrong codec {d.codec!r}, this run uses {self.codec.spec}")
        if replayed:
            return None
        numel = self.numel if self.numel_of is None else self.numel_of(d.sender)
        max_norm = cfg.robust.max_norm if self.level == "regional" else 0.0
        try:  # full validation (header, checksum, payload) without decoding to fp32
            header, prepared = self.codec.open(d.data, (numel,))
            reach = self.codec.magnitude(header, prepared)
            norm = delta_norm(self.codec, header, prepared, numel) if max_norm else 0.0
        except HypertrainError as e:
            return Decision(INVALID, f"rejected delta from {d.sender} for step {s}: {e}")
        except MemoryError:
            raise
        except Exception as e:  # a codec's bug met by crafted bytes: refused, the node goes on
            return Decision(
                INVALID,
                f"rejected delta from {d.sender} for step {s}: its bytes could not be "
                f"validated ({type(e).__name__}: {e})",
            )
        finally:
            drop_pages(d.data)  # read whole; not needed resident until the commit
        if norm > max_norm:
            return Decision(
                INVALID,
                f"rejected delta from {d.sender} for step {s}: its L2 norm {norm!r} is over "
                f"the run's bound of {max_norm!r} (robust.max_norm)",
                evidence=True,
            )
        limit = MAX_VALUE[self.level]
        if reach > limit:
            return Decision(
                INVALID,
                f"rejected delta from {d.sender} for step {s}: its values reach {reach:.4g}, "
                f"over the {limit:.4g} a {self.level} delta may carry (sums of such "
                "deltas could overflow fp32)",
                evidence=True,
            )
        return None

    def authentic(self, d: Delta) -> bool:
        """Is ``d`` signed by its claimed sender's pinned key?  (True where no keys are
        pinned: such a node authenticates nobody and takes every sender at its word.)"""
        return self.trusted is None or (
            d.sender in self.roster and self._check_signature(d) is None
        )

    def _check_signature(self, d: Delta) -> Decision | None:
        assert self.trusted is not None
        if not d.signature:
            return Decision(INVALID, f"unsigned delta from {d.sender} for step {d.sync_step}")
        key = self.signer_of(d.sender)
        try:
            good = self.trusted.verify(key, d.transfer_message(), d.signature)
        except UnknownKeyError:
            return Decision(INVALID, f"no trusted key {key!r} for {d.sender}")
        if not good:
            return Decision(
                INVALID, f"bad signature on the delta from {d.sender} for step {d.sync_step}"
            )
        return None

    def take(self, d: Delta) -> bool:
        """Record an accepted delta; True when the open step is complete."""
        self.inputs[d.sender] = d
        self.accepted[(d.sync_step, d.sender)] = d.digest
        if planted.on("count_duplicate_twice"):
            self.deliveries += 1
        return self.complete()

    def untake(self, d: Delta) -> None:
        """Undo ``take(d)``: the step's commit failed, and ``d`` is refused."""
        del self.inputs[d.sender]
        del self.accepted[(d.sync_step, d.sender)]

    def closing(self) -> tuple[dict[str, Blob], dict[str, str], tuple[str, ...]]:
        """What the open step aggregates, changing nothing: the bytes of the inputs (those
        of the members present: a relay shard's input counts only with its whole region),
        their (transport-verified) digests, and the members absent.  ``close`` then
        closes it, once the aggregate succeeded."""
        present = set(self.present())
        used = {m: d for m, d in self.inputs.items() if m in present}
        blobs = {m: d.data for m, d in used.items()}
        digests = {m: d.digest for m, d in used.items() if d.digest_checked}
        return blobs, digests, tuple(m for m in self.members if m not in present)

    def close(self, absent: tuple[str, ...]) -> None:
        """Close the open step (``closing`` said what it aggregated, and who was absent)."""
        present = set(self.present())
        if absent:
            self.absent_at[self.open_step] = absent
            self.members_at[self.open_step] = tuple(m for m in self.members if m in present)
        self.inputs = {}
        self.deliveries = 0
        self.cut = False
        self.open_step = self.schedule.next_sync_step(self.level, self.open_step)

    def remember(self, records: Iterable[Record]) -> None:
        """Every (step, sender) -> digest accepted in ``records`` (taped inputs), so a member
        re-sending what was already taken is answered as a duplicate after a restart."""
        for r in records:
            if isinstance(r, InputEntry):
                self.accepted[(r.sync_step, r.sender)] = r.digest
            elif isinstance(r, MemberEntry):
                self.changes.append(r)
            elif isinstance(r, RegionalMergeEntry | GlobalMergeEntry) and r.absent:
                self.absent_at[r.sync_step] = r.absent
                self.members_at[r.sync_step] = tuple(m for m, _ in r.members)
            elif isinstance(r, GlobalAppliedEntry) and r.rejoined_from is not None:
                first = self.schedule.next_sync_step(self.level, r.rejoined_from)
                self.skipped.append((first, r.sync_step))

    def skip_to(self, step: int) -> None:
        """The steps from the open one up to ``step`` will never commit here: deltas for
        them are stale; the open step is the first after ``step``."""
        if self.inputs:
            raise HypertrainError(f"{self.role}: cannot skip a step that has deliveries")
        if step >= self.open_step:
            self.skipped.append((self.open_step, step))
        self.cut = False
        self.open_step = self.schedule.next_sync_step(self.level, step)

    def members_of(self, step: int) -> tuple[str, ...]:
        """The members whose inputs the closed ``step`` aggregated."""
        return self.members_at.get(step, self.members_for(step))


def _take_cutoff(
    level: _Level, step: int, commit: Callable[[int], list[Effect]]
) -> tuple[Decision, list[Effect]]:
    """A cutoff event at ``level``: the decision, and the effects (the ``Cut``, then what
    ``commit`` makes of the step when the quorum delivered); nothing when refused."""
    decision, record = level.cutoff(step)
    if record is None:
        return decision, []
    ready = level.complete()
    effects: list[Effect] = [Cut(record, waiting=not ready)]
    if ready:
        effects.extend(commit(step))
    return decision, effects


def _completed(
    level: _Level, d: Delta, commit: Callable[[int], list[Effect]]
) -> Decision | list[Effect]:
    """``d`` completed the open step: the commit's effects; or, where the aggregate fails
    (an input that no longer decodes: its bytes changed on disk after it was accepted),
    the refusal of ``d`` with the level as it was before it (a decision either completes
    or changes nothing).  An input already in an early sum (``RegionCore.offer``,
    ``GlobalCore.offer``) is not read again: the sum holds the bytes that were accepted,
    which are the ones its digest, in the commitment, names."""
    try:
        return commit(d.sync_step)
    except HypertrainError as e:
        level.untake(d)
        return Decision(
            INVALID,
            f"the delta from {d.sender} completed step {d.sync_step}, whose aggregate "
            f"failed: {e}; nothing changed",
        )


def _keep_newest(merges: dict[int, Committed], merge: Committed) -> None:
    """Keep only the newest merge of each kind: each is a copy of the model (a relay's
    global merge is its own ``theta``), and no member can need an older one.

    Relay: a live island fetches the merge of s (at s + tau < s + h_r) before it pushes
    s + h_r, which the next merge of its region needs; an island restarted from its
    rejoin state asks for older regional merges again, and the node recomputes them from
    the published inputs (``RelayNode._recomputed``).  Aggregator: a relay forwards round
    g+1 only after its checkpoint of round g is written, and round g+1 completes only with
    every relay's forward; so a relay, restarted or not, never needs a round older than
    the last completed one."""
    merges[merge.sync_step] = merge
    for old in [s for s, m in merges.items() if m.kind == merge.kind and s < merge.sync_step]:
        del merges[old]


def residual_digest(feedback: ErrorFeedback) -> str:
    """``flat_digest`` of a sender's error-feedback residual."""
    return stored_residual_digest(
        None if feedback.is_zero else feedback.residual, math.prod(feedback.shape)
    )


def stored_residual_digest(residual: torch.Tensor | None, numel: int) -> str:
    """``flat_digest`` of a residual as checkpoints hold it (None: ``numel`` zeros, whose
    digest needs no zeros in memory)."""
    return zeros_digest(numel) if residual is None else flat_digest(residual)


@dataclass(frozen=True, slots=True)
class RelaySnapshot:
    """A relay's durable state after the global round of ``sync_step`` was applied."""

    sync_step: int
    theta: torch.Tensor
    """theta_{g+1} (also the regional base)."""
    residual: torch.Tensor | None
    """The relay's global-codec error feedback (None: all zeros)."""
    commitment: Commitment
    """The aggregator's commitment to ``theta`` (served to islands with it)."""
    rejoined_from: int | None = None
    """The forwarded step, when this update was a later round the relay rejoined at."""


class RelayMachine:
    """One region's round logic: collect island deltas, commit, forward, hand out merges."""

    def __init__(
        self,
        cfg: RunConfig,
        region: str,
        theta0: torch.Tensor,
        trusted: TrustedKeys | None = None,
        shard: int = 0,
        model_numel: int | None = None,
        fragment: int | None = None,
    ) -> None:
        """``shard``: which of the region's ``relay_shards`` this relay is; ``theta0`` is
        then that shard's range of the parameters, of a model of ``model_numel`` values
        (common/shards.py).  ``fragment``: the streaming fragment it serves (None: the
        run is not split); ``theta0`` is then that fragment's range, on its own schedule."""
        self.cfg = cfg
        self.region = region
        self.schedule = Schedule.of(cfg, fragment)
        shards = cfg.shards(theta0.numel() if model_numel is None else model_numel)
        start, end = shards.bounds(shard)
        if theta0.numel() != end - start:
            raise HypertrainError(
                f"relay {region}: shard {shard} of {shards.count} owns {end - start} values, "
                f"was given {theta0.numel()}"
            )
        self.shard, self.bounds = shard, (start, end)
        self.member = shards.member(region, shard)
        """This relay's id at the aggregator: its region, or ``region/i`` for a shard."""
        self.core = RegionCore(cfg, region, theta0, adopt=True)  # never written in place
        self.level = _Level(
            cfg,
            self.schedule,
            "regional",
            f"relay of {self.member}",
            cfg.topology.islands_of(region),
            self.core.codec,
            theta0.numel(),
            open_step=self.schedule.first_sync_step("regional"),
            trusted=trusted,
            signer_of=island_key,
            shard=shards.label(shard),
            region=region,
            initial=cfg.membership.initial(cfg.topology.islands_of(region)),
            kept_after=anneal_members(cfg, self.schedule, cfg.topology.islands_of(region), str),
        )
        self.global_pending: int | None = None  # sync step forwarded, theta not yet back
        self.merges: dict[int, Committed] = {}  # sync_step -> what islands apply
        self.bases: dict[int, str] = {}
        """Regional sync step -> the digest of the base after its merge (``post_base``, as
        taped): what a merge recomputed for a restarted island must hash to."""
        self.done = False
        self._base_digest: str | None = None  # digest of core.base while it is unchanged
        self._global_digest: str | None = None  # digest of core.theta while it is unchanged
        self._residual_digest: str | None = None  # digest of the residual while unchanged

    @property
    def members(self) -> tuple[str, ...]:
        return self.level.members

    def on_delta(self, d: Delta, replayed: bool = False) -> tuple[Decision, list[Effect]]:
        """An island's delta arrived (``replayed``: read back from this relay's tape)."""
        refusal = self.level.check(d, replayed)
        if refusal is not None:
            return refusal, []
        if self.global_pending is not None:
            return Decision(
                PRECONDITION, f"global round of step {self.global_pending} is pending"
            ), []
        effects: list[Effect] = [Publish(d, d.record())]
        if self.level.take(d):
            done = _completed(self.level, d, self._commit)
            if isinstance(done, Decision):
                return done, []
            effects.extend(done)
        else:
            self._sum_early()
            if (arm := self.level.first_armed()) is not None:
                effects.append(arm)
        return Decision(OK, f"accepted delta from {d.sender} for step {d.sync_step}"), effects

    def on_cutoff(self, step: int) -> tuple[Decision, list[Effect]]:
        """The cutoff of sync step ``step`` was reached (the driver's clock, or a taped
        ``cutoff`` entry replayed): tape it, and commit now if the quorum delivered."""
        return _take_cutoff(self.level, step, self._commit)

    def on_member(self, req: MemberRequest) -> tuple[Decision, list[Effect]]:
        """An island of the region asks to join it or to leave it (module docstring).

        A join answers ``Decision.start``: the sync step whose merge the island starts
        from (it fetches that merge and rejoins there, ``IslandRounds.heal``; 0: the
        initial parameters), and it is a member from the next regional sync step.  Asking
        again is a duplicate with the same answer; a member since the start gets
        ``start=None``.  A leave of a non-member is a duplicate.  Nothing changes on a
        refusal or a duplicate."""
        lv, sched = self.level, self.schedule
        refusal = self._member_refusal(req)
        if refusal is not None:
            return refusal, []
        last = lv.last_change(req.member)
        if req.change == JOIN:
            if lv.is_in(req.member):
                start = None if last is None else last.start
                return Decision(
                    OK, f"{req.member} is already a member of region {self.region}",
                    duplicate=True, start=start,
                ), []  # fmt: skip
            start, first = self._join_terms()
            if first > sched.steps:
                return Decision(
                    INVALID,
                    f"{req.member} cannot join: the run ends at step {sched.steps}, "
                    "after the last global round it could start from",
                    over=True,
                ), []
        else:
            if not lv.is_in(req.member):
                return Decision(
                    OK, f"{req.member} is not a member of region {self.region}", duplicate=True
                ), []
        if last is not None and req.issued <= last.issued:
            return Decision(
                INVALID,
                f"a {req.change} of {req.member} issued before its last change (a "
                f"{last.change} from step {last.sync_step}): an old request, not taken",
            ), []
        if req.change == LEAVE:
            start = None
            delivered = req.member in lv.inputs
            first = sched.next_sync_step("regional", lv.open_step) if delivered else lv.open_step
        record = MemberEntry(
            fragment=sched.fragment,
            change=req.change,
            member=req.member,
            round=sched.round_of(first),
            sync_step=first,
            step=req.step,
            issued=req.issued,
            signature=req.signature.hex(),
            start=start,
        )
        lv.changes.append(record)
        effects: list[Effect] = [Membership(record)]
        if req.change == LEAVE and self.global_pending is None and lv.complete():
            try:
                effects.extend(self._commit(lv.open_step))  # the rest had all delivered
            except HypertrainError:
                lv.changes.pop()  # nothing happened (but see _commit's own atomicity)
                raise
        elif req.change == LEAVE and self.global_pending is None:
            self._sum_early()  # the sum no longer waits for the one who left
        what = (
            f"{req.member} joins region {self.region} from step {first}, starting from the "
            f"merge of step {start}"
            if req.change == JOIN
            else f"{req.member} leaves region {self.region} from step {first}"
        )
        return Decision(OK, what, start=start), effects

    def _member_refusal(self, req: MemberRequest) -> Decision | None:
        lv = self.level
        if (refusal := out_of_range(step=req.step, issued=req.issued)) is not None:
            return refusal
        if req.run_id != self.cfg.run_id:
            return Decision(
                INVALID, f"wrong run: {req.run_id!r}, this relay serves {self.cfg.run_id!r}"
            )
        if req.change not in (JOIN, LEAVE):
            return Decision(INVALID, f"unknown membership change {req.change!r}")
        if req.member not in lv.roster:
            return Decision(
                INVALID,
                f"{req.member!r} is not an island of region {self.region} "
                f"(islands: {', '.join(lv.roster)})",
            )
        if lv.trusted is not None:
            if not req.signature:
                return Decision(INVALID, f"unsigned {req.change} request from {req.member}")
            key = island_key(req.member)
            try:
                good = lv.trusted.verify(key, req.message(), req.signature)
            except UnknownKeyError:
                return Decision(INVALID, f"no trusted key {key!r} for {req.member}")
            if not good:
                return Decision(INVALID, f"bad signature on the {req.change} of {req.member}")
        # A member of the run's end that asks again (restarted before it had the final
        # merge) is still a member: it goes on to fetch that merge, and its relay waits
        # for its report (``RelayNode.applied``).
        if self.done and not (req.change == JOIN and lv.is_in(req.member)):
            return Decision(INVALID, f"the run is complete: nothing to {req.change}", over=True)
        return None

    def _join_terms(self) -> tuple[int, int]:
        """(start, first) of a join now: the merge the joiner starts from and the first
        regional sync step it is a member of (always the one after ``start``)."""
        lv, sched = self.level, self.schedule
        if self.global_pending is not None:  # the round's last step is in: take its merge
            start = self.global_pending
        elif self.idle:
            # No member left to carry the region to its next global round: start from the
            # newest merge (the relay's base is that merge; nothing moved it since).
            start = sched.prev_sync_step("regional", lv.open_step)
        else:
            start = sched.global_step_of(sched.round_of(lv.open_step))
        return start, sched.next_sync_step("regional", start)

    def _sum_early(self) -> None:
        """Sum the open step's deltas now as far as the fixed order allows, while the
        others are still on the way (``RegionCore.offer``): the commit adds the rest, and
        the bits are the same either way."""
        lv = self.level
        self.core.offer({m: x.data for m, x in lv.inputs.items()}, lv.members)

    def _commit(self, step: int) -> list[Effect]:
        sched = self.schedule
        blobs, digests, absent = self.level.closing()
        pre = self._base_digest or flat_digest(self.core.base_view())
        # The mean is only folded into the base, never held whole: islands take the new
        # base after a regional sync, and the global merge after a global one.  The base
        # moves only once every input decoded (``RegionCore.merge``); the step closes after.
        _, commitment = self.core.merge(blobs, digests, keep=False)
        self.level.close(absent)
        post = self.core.merged_base  # the new base's digest, taken as it was written
        assert post is not None
        self._base_digest = post
        global_sync = sched.sync_kind(step) == "global"
        self.bases[step] = post
        g = sched.round_of(step)
        record = RegionalMergeEntry(
            fragment=sched.fragment,
            round=g,
            sync_step=step,
            tau=sched.tau,
            merge_step=sched.merge_step(step),
            codec=tape_safe(commitment.codec),
            members=tuple(zip(commitment.members, commitment.input_digests, strict=True)),
            mean=commitment.output_digest,
            commitment=commitment.digest,
            pre_base=pre,
            post_base=post,
            absent=absent or None,
            robust=tape_safe(commitment.robust) if commitment.robust is not None else None,
        )
        regional = Committed(
            "regional",
            g,
            step,
            sched.merge_step(step),
            commitment,
            # The live base: it moves again only at the next regional merge, which needs
            # every island's next delta, pushed after it fetched this one.
            torch.empty(0) if global_sync else self.core.base_view(),
            "regional",
            record,
            sum(len(b) for b in blobs.values()),
            "" if global_sync else post,
        )
        if not global_sync:
            _keep_newest(self.merges, regional)
            return [regional]
        # The base, which the last regional merge served, moved and is spent on the
        # forward below: that merge is no longer held (recomputed if ever asked for).
        for old in [t for t, c in self.merges.items() if c.kind == "regional"]:
            del self.merges[old]
        self.global_pending = step
        pre_res = self._residual_digest or residual_digest(self.core.feedback)
        blob = self.core.encode_global_delta()  # spends the base (reset by on_global)
        self._base_digest = None
        post_res = self._residual_digest = residual_digest(self.core.feedback)
        codec = str(self.core.global_codec.spec)
        forward = Forward(
            g,
            step,
            codec,
            blob,
            ForwardEntry(
                fragment=sched.fragment,
                round=g,
                sync_step=step,
                codec=codec,
                digest=blob_digest(blob),
                size=len(blob),
                pre_residual=pre_res,
                post_residual=post_res,
            ),
        )
        return [regional, forward, *anneal_switch(sched, self.cfg, step)]

    @property
    def idle(self) -> bool:
        """No member of the open step and nothing delivered or forwarded, before the run's
        end: everyone left, so nothing carries the region to its next global round.  The
        driver then follows the aggregator's rounds: it fetches the global merge of
        ``follow_step`` (or a newer one) and hands it to ``on_global`` without a forward."""
        lv = self.level
        return not self.done and self.global_pending is None and not lv.inputs and not lv.members

    @property
    def follow_step(self) -> int:
        """The global sync step an idle relay waits for: the one closing its open round."""
        sched = self.schedule
        return sched.global_step_of(sched.round_of(self.level.open_step))

    def on_global(self, event: GlobalArrived) -> list[Effect]:
        """The aggregator's theta_{g+1} for the global round of ``event.sync_step`` arrived:
        the round this relay forwarded, a later one (the rounds went on without it), or,
        while ``idle``, any round from its open one on."""
        s = event.sync_step
        pending = self.global_pending
        follow = pending is None and self.idle and s >= self.follow_step
        if not follow and (pending is None or s < pending):
            raise HypertrainError(f"relay {self.member}: unexpected global update for step {s}")
        if event.theta.shape != self.core.theta.shape:
            owner = "the model has" if self.member == self.region else "this shard owns"
            raise HypertrainError(
                f"relay {self.member}: global update of {event.theta.numel()} values, "
                f"{owner} {self.core.theta.numel()}"
            )
        # Following, the last step this relay committed (its newest merge) stands for the
        # forward: the steps after it, which nobody delivered, are skipped, as for a
        # region left behind.
        last = (
            self.schedule.prev_sync_step("regional", self.level.open_step)
            if pending is None
            else pending
        )
        self.core.adopt_global(event.theta)
        self.global_pending = None
        if s > last:
            # The global rounds went on without this region (its forward of ``pending``
            # came after their cutoff): it rejoins at round ``s``, skipping the steps in
            # between; its islands, whose deltas for them are stale, take this merge too.
            # The error feedback keeps what the unused forward did not carry.
            self.level.skip_to(s)
        # The transport verified the digest of what arrived (the gRPC download checks the
        # header's tensor digest; in one process it is the aggregator's own record).
        self._base_digest = self._global_digest = event.digest or flat_digest(self.core.theta)
        merge = self._global_merge(s, event.commitment)
        self.done = self.schedule.is_final(s)
        record = GlobalAppliedEntry(
            fragment=self.schedule.fragment,
            round=merge.round,
            sync_step=s,
            merge_step=merge.merge_step,
            theta=self._base_digest,
            rejoined_from=last if s > last else None,
        )
        return [Applied(merge, record)]

    def preview_global(
        self, sync_step: int, commitment: Commitment, theta: torch.Tensor, digest: str
    ) -> Committed | None:
        """The merge ``on_global`` will serve for the global update of ``sync_step`` while
        that update is still arriving (``theta``, being filled; ``digest``, what it is to
        hash to), where the update is the one this relay forwarded and waits for: its
        islands may download it as it arrives (the relay daemon's cut-through).  None in
        every other case (a rejoin after a cutoff, a followed round, a wrong size): those
        wait for ``on_global``.  Changes nothing."""
        if self.global_pending != sync_step or theta.shape != self.core.theta.shape:
            return None
        return self._global_committed(sync_step, commitment, theta, digest)

    def _global_committed(
        self, sync_step: int, commitment: Commitment, theta: torch.Tensor, digest: str
    ) -> Committed:
        sched = self.schedule
        return Committed(
            "global",
            sched.round_of(sync_step),
            sync_step,
            sched.merge_step(sync_step),
            commitment,
            theta,
            "global",
            None,
            payload_digest=digest,
        )

    def _global_merge(self, sync_step: int, commitment: Commitment) -> Committed:
        # the payload is never written in place (RegionCore.adopt_global)
        merge = self._global_committed(
            sync_step, commitment, self.core.theta, self._base_digest or ""
        )
        _keep_newest(self.merges, merge)
        return merge

    def merge_for(self, sync_step: int, requester: str | None = None) -> Committed | None:
        """The merge islands apply for ``sync_step`` (this shard's part), once it exists."""
        return self.merges.get(sync_step)

    def state_digest(self) -> str:
        """``flat_digest`` of the state this relay holds: the regional base, or while a
        global round is pending (the base is spent on the forward) the last global
        parameters.  Taken from the digests the round logic records as it writes them (a
        commit's new base, the global update's verified digest), and otherwise hashed once
        and kept until either changes: asking for it (a daemon's Status, any caller) never
        costs a pass over the model per call."""
        if self.global_pending is not None:
            if self._global_digest is None:
                self._global_digest = flat_digest(self.core.theta)
            return self._global_digest
        if self._base_digest is None:
            self._base_digest = flat_digest(self.core.base_view())
        return self._base_digest

    @property
    def open_round(self) -> int:
        """The global round of the open sync step."""
        return self.schedule.round_of(self.level.open_step)

    # -- durable state ------------------------------------------------------------------
    def snapshot(self) -> RelaySnapshot:
        """The state to checkpoint right after a global round was applied."""
        last = max((s for s, m in self.merges.items() if m.kind == "global"), default=None)
        if self.global_pending is not None or self.level.inputs or last is None:
            raise HypertrainError(f"relay {self.member}: a snapshot only between global rounds")
        # Neither is written in place: theta is adopted (RegionCore.adopt_global) and the
        # residual is replaced by each encode.
        return RelaySnapshot(
            last,
            self.core.theta,
            self.core.feedback.state_dict(copy=False)["residual"],  # type: ignore[arg-type]
            self.merges[last].commitment,
        )

    def restore(self, snap: RelaySnapshot, prior: Iterable[Record]) -> None:
        """Resume from ``snap`` (a fresh machine only); ``prior``: the records taped before
        it, so that islands re-sending what was already accepted get duplicates."""
        if self.level.accepted or self.merges:
            raise HypertrainError(f"relay {self.member}: restore needs a fresh machine")
        self.core.adopt_global(snap.theta.clone())
        self.core.feedback.load_state_dict({"residual": snap.residual, "beta": self.cfg.ef_beta})
        self._base_digest = self._global_digest = self._residual_digest = None
        self._global_merge(snap.sync_step, snap.commitment)
        self.level.open_step = self.schedule.next_sync_step("regional", snap.sync_step)
        prior = list(prior)
        self.level.remember(prior)
        self.bases.update(
            {r.sync_step: r.post_base for r in prior if isinstance(r, RegionalMergeEntry)}
        )
        self.done = self.schedule.is_final(snap.sync_step)


@dataclass(frozen=True, slots=True)
class AggregatorSnapshot:
    """The aggregator's durable state after the global round of ``sync_step``."""

    sync_step: int
    theta: torch.Tensor
    outer: dict[str, Any]
    lawa: torch.Tensor | None = None
    """The LAWA running sum of the states so far in its window (None outside it)."""


class AggregatorMachine:
    """The global round logic: one delta per region per round, then the outer step."""

    def __init__(
        self,
        cfg: RunConfig,
        theta0: torch.Tensor,
        trusted: TrustedKeys | None = None,
        fragment: int | None = None,
    ) -> None:
        """``fragment``: the streaming fragment it serves (None: the run is not split);
        ``theta0`` is then that fragment's range, with its own rounds and outer state."""
        self.cfg = cfg
        self.schedule = Schedule.of(cfg, fragment)
        self.core = GlobalCore(cfg, theta0, adopt=True)  # never written while held
        self.shards = self.core.shards
        self.level = _Level(
            cfg,
            self.schedule,
            "global",
            "aggregator",
            tuple(sorted(self.core.members)),
            self.core.codec,
            theta0.numel(),
            open_step=self.schedule.first_sync_step("global"),
            trusted=trusted,
            signer_of=relay_key,
            numel_of=self._numel_of,
            unit_of=lambda member: self.shards.split(member)[0],
            kept_after=anneal_members(
                cfg,
                self.schedule,
                tuple(self.core.members),
                lambda member: self.shards.split(member)[0],
            ),
        )
        self.merges: dict[int, Committed] = {}
        self._parts: dict[tuple[int, int], Committed] = {}  # (sync_step, shard) -> its part
        self.done = False
        self._theta_digest: str | None = None
        self._outer_digest: str | None = None
        self.lawa_first = self.schedule.rounds - cfg.lawa
        """LAWA: the first global round whose state is averaged (rounds past the end: off)."""
        self._lawa = LawaSum()
        self._lawa_states: list[str] = []  # the digests of the states summed, oldest first

    @property
    def members(self) -> tuple[str, ...]:
        return self.level.members

    @property
    def round(self) -> int:
        """The open global round."""
        return self.schedule.round_of(self.level.open_step)

    def on_regional(self, d: Delta, replayed: bool = False) -> tuple[Decision, list[Effect]]:
        """A relay's regional delta arrived (``replayed``: read back from this tape)."""
        refusal = self.level.check(d, replayed)
        if refusal is not None:
            return refusal, []
        effects: list[Effect] = [Publish(d, d.record())]
        if self.level.take(d):
            done = _completed(self.level, d, self._commit_effects)
            if isinstance(done, Decision):
                return done, []
            effects.extend(done)
        else:
            # Sum the forwards so far, as far as the region order allows, while the others
            # are on the way (``GlobalCore.offer``): the step adds the rest, same bits.
            lv = self.level
            self.core.offer({m: x.data for m, x in lv.inputs.items()}, lv.members)
            if (arm := lv.first_armed()) is not None:
                effects.append(arm)
        return Decision(
            OK, f"accepted regional delta from {d.sender} for step {d.sync_step}"
        ), effects

    def on_cutoff(self, step: int) -> tuple[Decision, list[Effect]]:
        """The cutoff of global sync step ``step`` was reached (see ``RelayMachine``)."""
        return _take_cutoff(self.level, step, self._commit_effects)

    def _commit_effects(self, step: int) -> list[Effect]:
        """The outer step of ``step``; after the run's last one, the LAWA average too."""
        merge = self._commit(step)
        if merge.round >= self.lawa_first:
            self._lawa.add(merge.payload)
            self._lawa_states.append(merge.payload_digest)
        averaged = self.final_average()
        switched = anneal_switch(self.schedule, self.cfg, step)
        return [merge, *switched] if averaged is None else [merge, *switched, averaged]

    def final_average(self) -> Averaged | None:
        """The LAWA average, once the run's last global round is committed (None before
        it, or without LAWA)."""
        if not self.done or not self.cfg.lawa:
            return None
        average = self._lawa.average()
        record = LawaEntry(
            first_round=self.lawa_first,
            last_round=self.schedule.rounds - 1,
            states=tuple(self._lawa_states),
            average=flat_digest(average),
            fragment=self.schedule.fragment,
        )
        return Averaged(average, record)

    def _commit(self, step: int) -> Committed:
        sched, core = self.schedule, self.core
        blobs, digests, absent = self.level.closing()
        pre = self._theta_digest or flat_digest(core.theta)
        pre_outer = self._outer_digest or outer_state_digest(core.outer.state_view())
        commitment = core.step(blobs, digests)  # theta moves once every input decoded
        self.level.close(absent)
        stepped = core.stepped  # theta's and the outer state's digests, taken as written
        assert stepped is not None
        post = self._theta_digest = stepped.theta
        post_outer = self._outer_digest = outer_state_digest(core.outer.state_view(), stepped.outer)
        record = GlobalMergeEntry(
            fragment=sched.fragment,
            round=sched.round_of(step),
            sync_step=step,
            tau=sched.tau,
            merge_step=sched.merge_step(step),
            codec=tape_safe(commitment.codec),
            outer=tape_safe(self.cfg.outer.to_dict()),
            members=tuple(zip(commitment.members, commitment.input_digests, strict=True)),
            mean=commitment.output_digest,
            commitment=commitment.digest,
            pre_state=pre,
            post_state=post,
            pre_outer=pre_outer,
            post_outer=post_outer,
            absent=absent or None,
        )
        merge = Committed(
            "global",
            sched.round_of(step),
            step,
            sched.merge_step(step),
            commitment,
            core.theta,  # never written while held (GlobalCore.step, recycle)
            "global",
            record,
            sum(len(b) for b in blobs.values()),
            post,
        )
        _keep_newest(self.merges, merge)
        self.done = sched.is_final(step)
        if self.done:  # before the LAWA average is made: no step reuses the old theta now
            core.let_go_retired()
        return merge

    def state_digest(self) -> str:
        """``flat_digest`` of theta: the digest the last outer step recorded as it wrote
        it, otherwise hashed once and kept until theta changes (a daemon's Status asks
        for it at every call)."""
        if self._theta_digest is None:
            self._theta_digest = flat_digest(self.core.theta)
        return self._theta_digest

    def _numel_of(self, member: str) -> int:
        start, end = self.shards.bounds(self.shards.split(member)[1])
        return end - start

    def merge_for(self, sync_step: int, requester: str | None = None) -> Committed | None:
        """The global merge of ``sync_step``; for a relay shard (``requester`` ``eu/1``) its
        range of theta_{g+1}, a view (the same object for shard i of every region, so a
        transport computes its digest once: ``payload_digest`` is left to it)."""
        merge = self.merges.get(sync_step)
        if merge is None or requester is None or not self.shards.sharded:
            return merge
        shard = self.shards.split(requester)[1]
        part = self._parts.get((sync_step, shard))
        if part is None:
            start, end = self.shards.bounds(shard)
            payload = merge.payload.view(-1)[start:end]
            part = dataclasses.replace(merge, payload=payload, payload_digest="")
            for key in [k for k in self._parts if k[0] != sync_step]:
                del self._parts[key]  # only the newest round's parts are asked for
            self._parts[(sync_step, shard)] = part
        return part

    # -- durable state ------------------------------------------------------------------
    def snapshot(self, copy: bool = True) -> AggregatorSnapshot:
        """The state after the last global round; ``copy=False``: the live tensors (the
        caller must be done with them before the next round changes them)."""
        last = max(self.merges, default=None)
        if last is None or self.level.open_step != self.schedule.next_sync_step("global", last):
            raise HypertrainError("aggregator: a snapshot only right after a global round")
        lawa = self._lawa.total
        if not copy:
            return AggregatorSnapshot(last, self.core.theta, self.core.outer.state_view(), lawa)
        return AggregatorSnapshot(
            last,
            self.core.theta.clone(),
            self.core.outer.state_dict(),
            None if lawa is None else lawa.clone(),
        )

    def restore(self, snap: AggregatorSnapshot, prior: Iterable[Record]) -> None:
        """Resume from ``snap`` (a fresh machine only).  ``prior``: the records taped before
        it: the inputs already accepted (duplicates after a restart) and the global merge of
        ``snap.sync_step`` (relays that had not fetched it yet still can)."""
        if self.level.accepted or self.merges:
            raise HypertrainError("aggregator: restore needs a fresh machine")
        prior = list(prior)
        last = next(
            (
                r
                for r in reversed(prior)
                if isinstance(r, GlobalMergeEntry) and r.sync_step == snap.sync_step
            ),
            None,
        )
        if last is None:
            raise HypertrainError(
                f"aggregator: no global merge of step {snap.sync_step} before the checkpoint"
            )
        self.core.theta = snap.theta.detach().clone().to(torch.float32)
        self.core.outer.load_state_dict(snap.outer)
        self._theta_digest = self._outer_digest = None
        commitment = Commitment(
            self.core.codec.spec.to_dict(),
            tuple(m for m, _ in last.members),
            tuple(d for _, d in last.members),
            last.mean,
        )
        _keep_newest(
            self.merges,
            Committed(
                "global",
                last.round,
                last.sync_step,
                last.merge_step,
                commitment,
                self.core.theta,
                "global",
                last,
            ),
        )
        self.level.open_step = self.schedule.next_sync_step("global", snap.sync_step)
        self.level.remember(prior)
        self.done = self.schedule.is_final(snap.sync_step)
        self._restore_lawa(snap.lawa, last.round, prior)

    def _restore_lawa(self, total: torch.Tensor | None, last: int, prior: list[Record]) -> None:
        """The LAWA sum of a snapshot taken after round ``last``, and the digests of the
        states in it (from their ``global_merge`` records)."""
        states = [
            r.post_state
            for r in prior
            if isinstance(r, GlobalMergeEntry) and self.lawa_first <= r.round <= last
        ]
        if (total is None) != (not states) or (
            total is not None and total.numel() != self.core.theta.numel()
        ):
            raise HypertrainError(
                f"aggregator: the checkpoint of round {last} does not hold the LAWA sum of "
                f"rounds {self.lawa_first}..{last} (it holds "
                f"{'none' if total is None else f'{total.numel()} values'})"
            )
        self._lawa = LawaSum(None if total is None else total.detach().clone(), len(states))
        self._lawa_states = states
