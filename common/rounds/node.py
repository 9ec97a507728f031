"""Relay and aggregator nodes: a round machine made durable, whatever carries its messages.

A node is what a relay or the aggregator *is*, minus the transport: its machine, its
store (tape, published inputs, checkpoints) and the order in which a decision becomes
durable.  The gRPC daemons (services/relay, services/aggregator) and the in-process
cluster (``local.py``: ``hypertrain run --local`` and the fault simulation) drive the
same nodes; they only deliver calls and carry messages.

Durability order (a crash may come between any two steps; ``crash(point)`` marks them):

- an accepted input: its bytes are published, then its ``input`` entry is taped, then
  the effects it completed (``regional_merge``, ``forward`` / ``global_merge``) are
  taped, in the machine's order, then the tape is sealed (a signed ``checkpoint`` entry:
  the receipt its merge is served with, ``common/trust/receipts.py``); only then is the
  push answered.  An input whose entry is on the tape is accepted; one whose entry is
  not was never acknowledged.
- the aggregator's outer step: ``global_merge`` taped (the commit record), then
  ``checkpoints/round-N.pt`` and ``state.pt`` (a link to it), possibly written in the
  background (``NodeStore(defer=True)``) and settled before the next push.
- a relay's global update: ``checkpoints/round-N.pt`` first (it holds the new
  parameters, which are not on the relay's tape), then the ``global_applied`` entry;
  with ``on_global(defer=True)`` the update is fetchable before both, and every push,
  rejection, close or record of a member's final report (``record_final``) settles them
  first.

Restart (``recover``): load the latest checkpoint into a fresh machine, replay the tape
after it through ``replay.py`` (every redone merge checked bit for bit against its
record), then tape and carry out what the crash cut off (effects computed but not
taped; a relay's forward whose global update has not come back).  No network is needed.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Any

import torch

from hypertrain.common import planted
from hypertrain.common.aggregate import Commitment
from hypertrain.common.config import RunConfig
from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.fragments import run_fragments
from hypertrain.common.roles import RegionCore, initial_parameters
from hypertrain.common.rounds.machines import (
    INVALID,
    PRECONDITION,
    AggregatorMachine,
    AggregatorSnapshot,
    Applied,
    Averaged,
    Committed,
    Cut,
    Decision,
    Delta,
    Effect,
    Forward,
    GlobalArrived,
    MemberRequest,
    Membership,
    Publish,
    RelayMachine,
    RelaySnapshot,
    Switched,
    anneal_switch,
    out_of_range,
)
from hypertrain.common.rounds.replay import AggregatorReplay, RelayReplay, ReplayError
from hypertrain.common.rounds.store import NodeStore, checkpoint_path, load_state
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import AGGREGATOR_KEY, flat_digest, relay_key
from hypertrain.common.trust.receipts import Witness, raw_receipt
from hypertrain.common.trust.schema import (
    AnnealEntry,
    ForwardEntry,
    GenesisEntry,
    GlobalAppliedEntry,
    GlobalMergeEntry,
    LawaEntry,
    RegionalMergeEntry,
    RejectionEntry,
    parse,
    records,
)
from hypertrain.common.trust.tape import Entry

#: Entries that commit a merge (or a relay's forward of one): the tape is sealed after them.
SEALED_KINDS = frozenset(
    {
        RegionalMergeEntry.KIND,
        ForwardEntry.KIND,
        GlobalMergeEntry.KIND,
        LawaEntry.KIND,
        AnnealEntry.KIND,
    }
)

FORBIDDEN = "permission_denied"
"""Decision code of a fetch by someone who is not a member here."""
CHECKPOINT_FORMAT = 2
"""Relay checkpoints carry the aggregator's commitment and are written before the
``global_applied`` entry (format 1, before this, wrote neither)."""

Publisher = Callable[[Delta], None]
"""Keeps an accepted delta's bytes under its digest (the driver may move a spooled file)."""


#: Refusals taped per sender and round (evidence); a sender refused more often than that
#: is only counted and logged, so no sender, even with a valid key, can grow a tape
#: without bound.
MAX_TAPED_REFUSALS = 8
#: A taped refusal's reason is cut to this many characters: it quotes fields the sender
#: chose (a run id, a codec name), and an entry over the tape's record limit would fail
#: the store, which stops the node.
MAX_TAPED_REASON = 1000


class _Node:
    """Shared by both nodes: the store, rejections, fetch answers, final bookkeeping."""

    role: str
    machine: RelayMachine | AggregatorMachine

    def __init__(self, cfg: RunConfig, store: NodeStore | None, numel: int) -> None:
        self.cfg = cfg
        self.store = store
        self.finals: set[str] = store.finals() if store is not None else set()
        self._refusals: dict[tuple[str, int], int] = {}  # (sender, round) -> taped
        self.refusal_taped = False
        """Whether the last refusal was taped (else only counted: ``tapes_refusal``)."""
        self.max_delta_bytes = 4 * numel + (1 << 16)
        """No encoding of a ``numel``-parameter delta is larger (fp32 plus a header): what
        a transport refuses before receiving it all."""

    def _swept(self) -> None:
        """After a recovery that found the tape and the folder agree: what a process that
        died mid-write left goes (not before: a refused start leaves the folder as it was)."""
        if self.store is not None:
            self.store.sweep()

    @property
    def fragment(self) -> int | None:
        """The streaming fragment this node serves (None: the run is not split)."""
        return self.machine.schedule.fragment

    def _open_tape(self, member: str | None, trusted: TrustedKeys | None, ca: str | None) -> None:
        """A new tape starts with the node's ``genesis`` entry; a tape being resumed must
        start with this node's (the same run, configuration, member, pinned keys and CA)."""
        store = self.store
        if store is None or store.tape is None:
            return
        want = GenesisEntry.of(self.cfg, self.role, member, trusted, ca, self.fragment)
        entries = store.tape.entries
        if not entries:
            store.record(want)
            return
        try:
            got = parse(entries[0])
        except HypertrainError as e:
            got, problem = None, str(e)
        else:
            problem = f"its entry 0 is a {entries[0].kind}, not this node's genesis"
        if isinstance(got, GenesisEntry):
            field = want.first_difference(got)
            if field is None:
                return
            problem = f"its genesis entry records another {field}"
        raise ConfigError(
            f"tape {store.folder / 'tape'} was not started by this {self.role} with this "
            f"configuration ({problem}); use a new --state-dir for a new run"
        )

    def _publish(self, delta: Delta, publisher: Publisher | None) -> None:
        if self.store is None:
            return
        if publisher is not None:
            publisher(delta)
        else:
            self.store.publish(delta.digest, delta.data)

    def _crash(self, point: str) -> None:
        if self.store is not None:
            self.store.crash(point)

    def _decided(
        self, decision: Decision, delta: Delta, effects: list[Effect], publisher: Publisher | None
    ) -> None:
        self.refusal_taped = False
        if not decision.accepted:
            # A stale or out-of-bounds delta was whole (and signed, where keys are
            # pinned): its digest is kept as evidence.
            evidence = decision.stale or decision.evidence
            self.reject(decision.code, decision.reason, delta, delta.digest if evidence else None)
        elif not decision.duplicate:
            self._accept(effects, publisher)

    def _before_event(self) -> None:
        """What must be durable before the machine takes another event."""

    def cutoff(self, step: int) -> tuple[Decision, list[Effect]]:
        """The driver's clock says the cutoff of sync step ``step`` was reached: the machine
        decides, and the ``cutoff`` entry and any merge it allowed are taped before this
        returns.  Refused (not the open step) or a duplicate: nothing changes."""
        self._before_event()
        decision, effects = self.machine.on_cutoff(step)
        if decision.accepted and not decision.duplicate:
            self._accept(effects, None)
        return decision, effects

    def _accept(self, effects: list[Effect], publisher: Publisher | None) -> None:
        """Make an accepted delta and what it completed durable, in order, and seal the
        tape after a merge (or forward) it completed."""
        for effect in effects:
            if isinstance(effect, Publish):
                if planted.on("publish_after_tape"):
                    self._record(effect)
                    self._crash("after_input_entry")
                    self._publish(effect.delta, publisher)
                    continue
                self._publish(effect.delta, publisher)
                self._crash("after_publish")
                self._record(effect)
            else:
                self._carry_out(effect)
        self._seal()

    def _seal(self) -> None:
        """Seal the tape after a merge: a signed checkpoint covering it (the receipt the
        merge is served with), unless the last entry is not a commit (nothing to seal, or
        sealed already).  A restart seals a tape a crash left unsealed (``recover``)."""
        tape = self.store.tape if self.store is not None else None
        last = tape.last_entry if tape is not None else None
        if tape is not None and last is not None and last.kind in SEALED_KINDS:
            self._crash("before_seal")
            tape.checkpoint()

    def receipt(self) -> bytes | None:
        """This node's latest seal as a receipt (None: it keeps no tape)."""
        tape = self.store.tape if self.store is not None else None
        cp = tape.last_checkpoint if tape is not None else None
        return None if cp is None else raw_receipt(cp.entry)

    def _receipts(self, merge: Committed) -> tuple[bytes, ...]:
        own = self.receipt()
        return () if own is None else (own,)

    def _record(self, effect: Effect) -> None:
        if self.store is not None and effect.record is not None:
            self.store.record(effect.record)

    def _carry_out(self, effect: Effect) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """Finish what was made fetchable before it was durable (nothing here)."""

    def _prune(self) -> None:
        """A global round is durable (its entry taped, its checkpoint written or queued):
        with ``keep_rounds`` the store deletes the older rounds' files (``NodeStore.prune``)."""
        if self.store is not None:
            self.store.prune()

    def reject(self, code: str, reason: str, delta: Delta, digest: str | None = None) -> bool:
        """Tape a refused delta as evidence against its sender (changes nothing), if it is
        authenticated and its sender's allowance is not spent (``tapes_refusal``);
        ``digest``: the refused bytes' blob digest, for one whose bytes are the evidence.  After
        ``close`` it is only refused (the daemon logs it), not taped.  True if taped
        (``refusal_taped`` says so too)."""
        self.settle()
        self.refusal_taped = False
        if self.store is None or self.store.closed or not self.tapes_refusal(delta):
            return False
        if len(reason) > MAX_TAPED_REASON:  # it quotes the sender's fields, of any length
            reason = f"{reason[:MAX_TAPED_REASON]}... ({len(reason)} characters)"
        rec = RejectionEntry(
            fragment=self.fragment,
            code=code,
            reason=reason,
            sender=delta.sender,
            sync_step=delta.sync_step,
            round=delta.round,
            digest=digest,
        )
        self.store.record(rec)
        self.refusal_taped = True
        return True

    def tapes_refusal(self, delta: Delta) -> bool:
        """Would a refusal of ``delta`` be taped?  Only one whose round and step an entry
        can hold (``out_of_range``), whose signature verifies against its claimed sender's
        pinned key (where keys are pinned: anyone can claim a name, and a flood of refusals
        must not grow the tape), and at most ``MAX_TAPED_REFUSALS`` per sender and round of
        this node (its open round, not the one the delta claims, which the sender chooses);
        the rest are only counted and logged by the daemon."""
        lv = self.machine.level
        if out_of_range(round=delta.round, sync_step=delta.sync_step) or not lv.authentic(delta):
            return False
        key = (delta.sender, lv.schedule.round_of(lv.open_step))
        taped = self._refusals.get(key, 0)
        if taped >= MAX_TAPED_REFUSALS:
            return False
        self._refusals[key] = taped + 1
        return True

    def fetch(
        self, run_id: str, requester: str, sync_step: int, kind: str | None = None
    ) -> Decision | Committed | None:
        """The merge of ``sync_step`` for ``requester``; a refusal; None: not yet; or, to a
        member left behind, a newer global merge (``newer``)."""
        got = self._lookup(run_id, requester, sync_step, kind)
        if got is None and (
            self.cfg.membership.has_cutoffs  # only cutoffs leave members behind
            or requester not in self.machine.level.members_for(sync_step)
        ):
            # ... and a relay an islands:K anneal left without a member follows the rounds
            # it is no longer a member of: those may have moved on meanwhile (a streaming
            # fragment's anneal starts before its last round: more than one round follows)
            got = self.newer(sync_step, requester)
        if isinstance(got, Committed):
            got = dataclasses.replace(got, receipts=self._receipts(got))
        return got

    def _lookup(
        self, run_id: str, requester: str, sync_step: int, kind: str | None
    ) -> Decision | Committed | None:
        """The merge of ``sync_step`` itself, a refusal, or None."""
        if (refusal := out_of_range(sync_step=sync_step)) is not None:
            return refusal
        if run_id != self.cfg.run_id:
            return Decision(INVALID, f"wrong run {run_id!r}")
        if requester not in self.machine.level.roster:
            return Decision(FORBIDDEN, f"{requester!r} is not a member of this {self.role}")
        merge = self.machine.merge_for(sync_step, requester)
        if merge is None:
            return None
        if kind is not None and merge.kind != kind:
            return Decision(INVALID, f"the merge of step {sync_step} is {merge.kind}, not {kind}")
        return merge

    def newer(self, sync_step: int, requester: str) -> Committed | None:
        """The newest global merge held, when it is newer than ``sync_step``: what a member
        left behind (its step went ahead without it, and the merge it asks for is no
        longer kept) takes instead, to rejoin from there (``IslandRounds.heal``,
        ``RelayMachine.on_global``).  None: nothing newer (the merge is not committed yet)."""
        merges = self.machine.merges
        newest = max((s for s, m in merges.items() if m.kind == "global"), default=None)
        if newest is None or newest <= sync_step:
            return None
        return self.machine.merge_for(newest, requester)

    def applied(self, requester: str, step: int) -> Decision | None:
        """A member reports the global merge of ``step`` applied and kept at its end (a
        relay its final checkpoint, an island its final state).

        A node's work ends when every member has reported the run's last step, not when
        each fetched it: the last byte handed to the transport says nothing of a member
        killed before it kept the merge, which fetches it again after its restart and
        must find its node still there.  Any other step is acknowledged and changes
        nothing."""
        if requester not in self.machine.level.roster:  # an anneal may leave it idle
            return Decision(FORBIDDEN, f"{requester!r} is not a member of this {self.role}")
        if step == self.cfg.steps:
            if self.machine.merge_for(step) is None:
                return Decision(PRECONDITION, f"the last step {step} is not applied here yet")
            self.record_final(requester)
        return None

    def record_final(self, requester: str) -> bool:
        """Record that ``requester`` holds the run's final merge (``applied``); True once
        every member does.

        The node's own final state is made durable first (``settle``).  Else a relay that
        serves the merge while it writes it down (``on_global(defer=True)``) could keep
        the mark of a member that its crash cut off; restarted, it redoes the round and
        ends the run counting that member, which asks again and finds no relay."""
        self.settle()
        if requester not in self.finals:
            if self.store is not None:
                self.store.mark_final(requester)
            self.finals.add(requester)
        return self.all_final()

    def all_final(self) -> bool:
        """Does every member the run ended with hold the final merge?  Members absent from
        the last sync step (gone, or left behind at its cutoff) are not waited for, nor
        those that left after delivering it."""
        level = self.machine.level
        left = {m for m in level.roster if not level.is_in(m)}
        return self.finals >= set(level.members_of(self.cfg.steps)) - left

    @property
    def done(self) -> bool:
        return self.machine.done

    def close(self) -> None:
        self.settle()
        if self.store is not None:
            self.store.close()


class RelayNode(_Node):
    """A relay: its machine, store, and the forward waiting for its global update."""

    role = "relay"

    def __init__(
        self,
        cfg: RunConfig,
        region: str,
        theta0: torch.Tensor,
        store: NodeStore | None,
        trusted: TrustedKeys | None = None,
        shard: int = 0,
        model_numel: int | None = None,
        ca: str | None = None,
        fragment: int | None = None,
    ) -> None:
        """``shard``/``model_numel``: a relay shard, ``theta0`` its range (``RelayMachine``);
        ``ca``: the fingerprint of the run CA its TLS pins (``certs.fingerprint``);
        ``fragment``: the streaming fragment it serves, ``theta0`` that fragment's range."""
        super().__init__(cfg, store, theta0.numel())
        self.region = region
        self.machine: RelayMachine = RelayMachine(
            cfg, region, theta0, trusted, shard=shard, model_numel=model_numel, fragment=fragment
        )
        self._open_tape(self.machine.member, trusted, ca)
        self.member = self.machine.member
        """The id this relay pushes, fetches and reports under at the aggregator."""
        taped = store is not None and store.taped
        self.witness = Witness(
            store.folder if taped and store is not None else None,
            relay_key(self.member),
            cfg.run_id,
            trusted if taped else None,
            fragment,
        )
        """The aggregator's receipts, kept with each global merge and passed on to islands
        (a relay that keeps no tape cannot be audited: it keeps none)."""
        self.outbox: Forward | None = None
        """The forward whose global update has not arrived yet (the driver sends it, then
        fetches the update and calls ``on_global``)."""
        self.recovered: dict[str, Any] = {}
        self._unsettled: Applied | None = None  # applied and fetchable, not yet taped
        self._checkpointed = False  # ... and its checkpoint already written
        self._settling = threading.RLock()

    # -- events ----------------------------------------------------------------------------
    def push(
        self, delta: Delta, publisher: Publisher | None = None
    ) -> tuple[Decision, list[Effect]]:
        """An island's delta arrived: decide, and make an acceptance durable before answering."""
        self.settle()  # the last global update's entry comes before anything after it
        decision, effects = self.machine.on_delta(delta)
        self._decided(decision, delta, effects, publisher)
        return decision, effects

    def on_member(self, req: MemberRequest) -> tuple[Decision, list[Effect]]:
        """An island asks to join or leave the region: the machine decides; a change and
        any merge it completed are taped before this returns (a refusal is not taped: it
        changes nothing and may come from anyone)."""
        self.settle()
        decision, effects = self.machine.on_member(req)
        if decision.accepted and not decision.duplicate:
            self._accept(effects, None)
        return decision, effects

    def _before_event(self) -> None:
        self.settle()

    def _carry_out(self, effect: Effect) -> None:
        if isinstance(effect, Switched):
            self._crash("before_anneal_entry")
            self._record(effect)
        elif isinstance(effect, Cut | Membership):
            self._record(effect)
        elif isinstance(effect, Committed):
            self._crash("relay_before_merge_entry")
            self._record(effect)
        elif isinstance(effect, Forward):
            self._record(effect)
            self._crash("relay_after_forward_entry")
            self.outbox = effect

    def forward_delta(self, fwd: Forward, key: SigningKey | None) -> Delta:
        """The delta a forward is sent as: from this relay (its region, or its shard's id),
        signed with the relay's key."""
        delta = Delta(
            self.cfg.run_id,
            fwd.round,
            fwd.sync_step,
            self.member,
            fwd.record.digest,
            fwd.codec,
            fwd.data,
            fragment=self.fragment,
        )
        return delta if key is None else delta.signed(key.sign(delta.transfer_message()))

    def forward_sent(self, sync_step: int) -> None:
        """The aggregator acknowledged the forward of ``sync_step``: it tapes an input
        before it answers, so the bytes are never sent again (a restarted relay derives
        its forward from its own tape) and the outbox lets them go while the relay waits
        for the global update (a model-sized fp32 delta, at the moment that update is
        downloaded: the driver downloads it into that delta's memory,
        ``RegionCore.forward_room``)."""
        if self.outbox is not None and self.outbox.sync_step == sync_step:
            self.outbox = dataclasses.replace(self.outbox, data=b"")

    def on_global(self, got: Committed, defer: bool = False) -> Committed:
        """The aggregator's new parameters for the forwarded round (or a later one: the
        rounds went on without this region, ``RelayMachine.on_global``) arrived: check and
        keep the aggregator's receipt (``ReceiptError``, nothing applied, if it is not
        valid), apply them, checkpoint, tape.

        ``defer``: only apply them (the merge is fetchable at once) and leave the checkpoint
        and the tape entry to ``write_checkpoint`` / ``settle``, which the driver calls
        next, outside its lock, so that islands fetch the merge before the relay writes it;
        any push, rejection or close settles first, so the tape order is the same.  A crash
        before the entry is taped loses nothing: the restarted relay sends its forward
        again and the aggregator, which keeps its last round, answers it the same."""
        if self.outbox is None and self.machine.idle:
            pass  # a region nobody is a member of follows the global rounds
        elif self.outbox is None or got.sync_step < self.outbox.sync_step:
            raise HypertrainError(
                f"relay {self.member}: a global update for step {got.sync_step} "
                "that this relay did not ask for"
            )
        self.witness.take(got.sync_step, "global", got.receipts, AGGREGATOR_KEY)
        event = GlobalArrived(got.sync_step, got.payload, got.commitment, got.payload_digest)
        (applied,) = self.machine.on_global(event)
        assert isinstance(applied, Applied)
        self.outbox = None
        self._unsettled, self._checkpointed = applied, False
        if not defer:
            self.settle()
        return applied.merge

    @property
    def settled(self) -> bool:
        """No global update applied with ``defer`` waits for its checkpoint or entry."""
        return self._unsettled is None

    def write_checkpoint(self) -> None:
        """Write the checkpoint of a global update applied with ``defer`` (not its entry).
        Safe outside the driver's lock: the state it reads does not change until
        ``settle``, which every push calls first."""
        with self._settling:
            if self._unsettled is not None and not self._checkpointed:
                self._checkpoint(self._unsettled)
                self._checkpointed = True

    def settle(self) -> None:
        """Make the last global update durable: its checkpoint (unless written), then its
        ``global_applied`` entry (call it where tape entries are written: under the
        driver's lock)."""
        with self._settling:
            applied = self._unsettled
            if applied is None:
                return
            self.write_checkpoint()
            self._crash("relay_after_checkpoint")
            self._record(applied)
            self._unsettled = None
            self._prune()

    def _checkpoint(self, applied: Applied) -> None:
        """The relay's state after a global update, written before the update's tape entry;
        it records the tape as it will be once that entry is written (entries are
        canonical, so their hash is known before), and a restart between the two writes
        the same entry again."""
        if self.store is None:
            return
        snap = self.machine.snapshot()
        seq, head = self.store.tape_position
        if self.store.tape is not None:
            rec = applied.record
            seq, head = seq + 1, self.store.tape.next_hash(rec.KIND, rec.to_body())
        self.store.write_checkpoint(
            applied.merge.round,
            {
                "format": CHECKPOINT_FORMAT,
                "run_id": self.cfg.run_id,
                "config_digest": self.cfg.digest,
                "region": self.member,
                "round": applied.merge.round,
                "sync_step": snap.sync_step,
                "theta": snap.theta,
                "residual": snap.residual,
                "commitment": json.dumps(snap.commitment.to_dict(), sort_keys=True),
                "tape_seq": seq,
                "tape_head": head,
                # what the global_applied entry says of a rejoin (a crash before that
                # entry is taped writes it again from here)
                **(
                    {}
                    if applied.record.rejoined_from is None
                    else {"rejoined_from": applied.record.rejoined_from}
                ),
            },
        )

    def _receipts(self, merge: Committed) -> tuple[bytes, ...]:
        """Its own latest seal; with a global merge, the aggregator's receipt first."""
        own = super()._receipts(merge)
        if merge.kind != "global":
            return own
        return self._with_aggregator(self.witness.passed_on(merge.sync_step, AGGREGATOR_KEY), own)

    @staticmethod
    def _with_aggregator(agg: bytes | None, own: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """A relay's receipts of a global merge: the aggregator's (where it passes one
        on) first, then its own."""
        return own if agg is None else (agg, *own)

    def preview_global(self, got: Committed) -> Committed | None:
        """The merge, with its receipts, that ``on_global(got)`` will serve, while ``got``'s
        payload is still arriving (``RelayMachine.preview_global``): only for the update
        of the forward in the outbox, and only where the aggregator's receipts are those
        ``on_global`` keeps and passes on (one, where this relay pins keys; else none is
        passed on).  None otherwise.  Changes nothing: whatever is served from it must
        not be complete before ``on_global`` applied the merge (a driver that serves it
        holds the last bytes back until then and checks that the two agree)."""
        if self.outbox is None or self.outbox.sync_step != got.sync_step:
            return None
        merge = self.machine.preview_global(
            got.sync_step, got.commitment, got.payload, got.payload_digest
        )
        if merge is None:
            return None
        if self.witness.trusted is None:
            agg = None  # it keeps nothing, so passes nothing on
        elif len(got.receipts) == 1:
            agg = got.receipts[0]  # what on_global keeps and ``_receipts`` passes on
        else:
            return None  # on_global refuses it
        return dataclasses.replace(
            merge, receipts=self._with_aggregator(agg, super()._receipts(merge))
        )

    def _lookup(
        self, run_id: str, requester: str, sync_step: int, kind: str | None
    ) -> Decision | Committed | None:
        got = super()._lookup(run_id, requester, sync_step, kind)
        if got is None and kind != "global":
            got = self._recomputed(sync_step)
        if got is None and kind != "regional" and self.cfg.fragments > 1:
            got = self._kept_global(sync_step)
        return got

    def _kept_global(self, sync_step: int) -> Committed | None:
        """A global merge older than the newest held, with streaming fragments: an island
        saves its rejoin state with another fragment's global merge still to take, and one
        that dies in the last step's sync (its last deltas pushed) asks for it again after
        the relay moved on to the final merge.  Served from this relay's checkpoint of its
        round, checked against its ``global_applied`` entry (None: no such checkpoint).
        Not in a run without fragments: there an island never waits for a global merge
        older than its rejoin state, and one that asks for one was left behind at a cutoff
        and takes the newest instead (``newer``); fragments do not combine with cutoffs."""
        m = self.machine
        s = m.schedule
        held = [t for t, c in m.merges.items() if c.kind == "global"]
        if (
            self.store is None
            or s.sync_kind(sync_step) != "global"
            or not held
            or sync_step >= max(held)
        ):
            return None
        path = checkpoint_path(self.store.folder, s.round_of(sync_step))
        if not path.is_file():
            return None
        snap, _, _ = self._read_checkpoint(path)
        if snap.sync_step != sync_step:
            return None
        digest = flat_digest(snap.theta)
        taped = [
            r.theta
            for r in records(self.store.entries())
            if isinstance(r, GlobalAppliedEntry) and r.sync_step == sync_step
        ]
        if not taped or any(t != digest for t in taped):
            raise HypertrainError(
                f"relay {self.member}: its checkpoint of the global merge of step {sync_step} "
                f"holds {digest[:16]}, its global_applied entries record {taped}"
            )
        return Committed(
            "global",
            s.round_of(sync_step),
            sync_step,
            s.merge_step(sync_step),
            snap.commitment,
            snap.theta,
            "global",
            None,
            payload_digest=digest,
        )

    def _recomputed(self, sync_step: int) -> Committed | None:
        """A regional merge no longer held in memory (an island restarted from its last
        global state retrains the round and asks for each of its merges again): the base
        after it, recomputed as the relay computed it, from the round's first global
        parameters and every regional merge of the round up to it, from the published
        inputs."""
        m = self.machine
        s = m.schedule
        if (
            self.store is None
            or s.sync_kind(sync_step) != "regional"
            or sync_step >= m.level.open_step
        ):
            return None
        g = s.round_of(sync_step)
        start = s.global_step_of(g - 1) if g else 0
        steps = s.sync_steps("regional", after=start, until=sync_step)
        digests = [{i: m.level.accepted.get((t, i)) for i in m.level.members_of(t)} for t in steps]
        if any(d is None for ds in digests for d in ds.values()):
            return None
        theta = self._round_start(g)
        if theta is None:
            return None
        folder = self.store.published
        if not all((folder / str(d)).is_file() for ds in digests for d in ds.values()):
            return None  # pruned (keep_rounds): the asker takes a newer merge instead
        core = RegionCore(self.cfg, self.region, theta, adopt=True)  # theta is not written
        commitment = None
        for ds in digests:
            blobs = {i: (folder / str(d)).read_bytes() for i, d in ds.items()}
            _, commitment = core.merge(blobs, keep=False)
        assert commitment is not None
        post = flat_digest(core.base_view())
        taped = m.bases.get(sync_step)
        if taped is not None and post != taped:
            raise HypertrainError(
                f"relay {self.member}: the recomputed base after step {sync_step} is {post[:16]}, "
                f"its regional_merge entry recorded {taped[:16]}"
            )
        return Committed(
            "regional",
            g,
            sync_step,
            s.merge_step(sync_step),
            commitment,
            core.base_view(),
            "regional",
            None,
            payload_digest=post,
        )

    def _round_start(self, g: int) -> torch.Tensor | None:
        """This relay's global parameters at the start of round ``g``: held while it is the
        current round; else from its checkpoint of round g-1, or the initial ones."""
        m = self.machine
        applied = [t for t, c in m.merges.items() if c.kind == "global"]
        current = m.schedule.round_of(max(applied)) + 1 if applied else 0
        if g == current:
            return m.core.theta
        if g == 0:  # the initial parameters of this relay's range: of its fragment's
            layout, theta0 = initial_parameters(self.cfg)
            if self.fragment is not None:
                part = run_fragments(self.cfg, layout)[self.fragment]
                theta0 = theta0[part.lo : part.hi]
            a, b = m.bounds
            return theta0[a:b]
        assert self.store is not None
        path = checkpoint_path(self.store.folder, g - 1)
        if not path.is_file():
            return None
        theta = load_state(path)["theta"]
        return theta if isinstance(theta, torch.Tensor) else None

    # -- restart ---------------------------------------------------------------------------
    def recover(self) -> None:
        """Resume from the latest checkpoint and the tape after it (module docstring),
        then sweep what a crash left (``NodeStore.sweep``)."""
        self._recover()
        self._swept()

    def _recover(self) -> None:
        store = self.store
        if store is None:
            return
        if store.tape is None:
            if store.has_state():
                raise ConfigError(
                    f"{store.folder} holds the state of an earlier start but this relay keeps "
                    "no tape (no --signing-key), so it cannot resume: start it with its key, "
                    "or with a new --state-dir for a new run"
                )
            return
        entries = store.entries()
        path = store.latest_checkpoint()
        start, snap = 0, None
        if path is not None:
            snap, start, head = self._read_checkpoint(path)
            if start and len(entries) == start - 1:  # died between checkpoint and entry
                self.machine.restore(snap, records(entries))
                merge = self.machine.merge_for(snap.sync_step)
                assert merge is not None
                applied = _applied_record(self.machine, snap)
                self._record(Applied(merge, applied))
                self.machine.level.remember([applied])  # a rejoin's skipped steps
                entries = store.entries()
            else:
                self.machine.restore(snap, records(entries[:start]))
            if len(entries) < start or (start and entries[start - 1].hash != head):
                raise ConfigError(
                    f"tape {store.folder / 'tape'} does not contain what {path} recorded "
                    f"({start} entries ending in {head[:16]})"
                )
        elif not entries:
            return
        replay = RelayReplay(self.machine, entries[start:], store.blobs)
        try:
            step = replay.advance()
        except ReplayError as e:
            where = f"entry {e.entry.seq}" if e.entry else "the tape"
            raise ConfigError(f"cannot resume {store.folder}: {where}: {e.detail}") from None
        if step is not None:
            raise ConfigError(
                f"cannot resume {store.folder}: the tape applies the global update of step "
                f"{step} after the last checkpoint"
            )
        taped_forward = replay.forwards.get(self.machine.global_pending or -1)
        for effect in replay.pending:  # the crash came before these were taped
            self._carry_out(effect)
        if self.machine.global_pending is not None and self.outbox is None:
            self.outbox = taped_forward
        self._seal()  # a crash between a merge's entry and its seal
        self.recovered = {
            "checkpoint_round": None
            if snap is None
            else self.machine.schedule.round_of(snap.sync_step),
            "entries_redone": len(entries) - start,
            "open_step": self.machine.level.open_step,
        }

    def _read_checkpoint(self, path: Any) -> tuple[RelaySnapshot, int, str]:
        ck = load_state(path)
        if ck.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(
                f"{path}: a relay checkpoint of an older format (written by an earlier "
                "hypertrain); this version cannot resume it: start a new run in a new "
                "--state-dir"
            )
        if (ck["run_id"], ck["region"], ck["config_digest"]) != (
            self.cfg.run_id,
            self.member,
            self.cfg.digest,
        ):
            raise ConfigError(
                f"{path} belongs to another run, region or config; use a new --state-dir"
            )
        snap = RelaySnapshot(
            int(ck["sync_step"]),
            ck["theta"],
            ck["residual"],
            Commitment.from_dict(json.loads(ck["commitment"])),
            ck.get("rejoined_from"),
        )
        return snap, int(ck["tape_seq"]), str(ck["tape_head"])


def _applied_record(machine: RelayMachine, snap: RelaySnapshot) -> GlobalAppliedEntry:
    """The ``global_applied`` record of the update a snapshot was taken after."""
    s = machine.schedule
    return GlobalAppliedEntry(
        fragment=s.fragment,
        round=s.round_of(snap.sync_step),
        sync_step=snap.sync_step,
        merge_step=s.merge_step(snap.sync_step),
        theta=flat_digest(snap.theta),
        rejoined_from=snap.rejoined_from,
    )


class AggregatorNode(_Node):
    """The aggregator: its machine and store."""

    role = "aggregator"

    def __init__(
        self,
        cfg: RunConfig,
        theta0: torch.Tensor,
        store: NodeStore | None,
        trusted: TrustedKeys | None = None,
        ca: str | None = None,
        fragment: int | None = None,
    ) -> None:
        """``ca``: the fingerprint of the run CA its TLS pins (``certs.fingerprint``);
        ``fragment``: the streaming fragment it serves, ``theta0`` that fragment's range."""
        super().__init__(cfg, store, theta0.numel())
        self.machine: AggregatorMachine = AggregatorMachine(cfg, theta0, trusted, fragment)
        self._open_tape(None, trusted, ca)
        self.committed: list[Committed] = []
        """Global merges made durable since the driver last looked (it evaluates them)."""
        self.averaged: Averaged | None = None
        """The LAWA average, once published (RunConfig.lawa; the driver logs it)."""
        self.recovered: dict[str, Any] = {}

    def push(
        self, delta: Delta, publisher: Publisher | None = None
    ) -> tuple[Decision, list[Effect]]:
        """A relay's regional delta arrived: decide; an outer step is taped before the push
        is answered, and checkpointed then or (a store opened with ``defer``) before the
        next push changes the state."""
        self._before_event()  # the outer step may change what a checkpoint refers to
        decision, effects = self.machine.on_regional(delta)
        self._decided(decision, delta, effects, publisher)
        return decision, effects

    def _before_event(self) -> None:
        """Before a push or a cutoff: the deferred checkpoint written, and (``keep_rounds``)
        the round it makes surplus pruned."""
        if self.store is not None:
            self.store.settle()
            self._prune()

    def _carry_out(self, effect: Effect) -> None:
        if isinstance(effect, Switched):
            self._crash("before_anneal_entry")
        if isinstance(effect, Cut | Switched):
            self._record(effect)
            return
        if isinstance(effect, Averaged):
            # The file first: a crash before the entry computes and writes it again.
            self._write_average(effect)
            self._crash("before_lawa_entry")
            self._record(effect)
            self.averaged = effect
            return
        if not isinstance(effect, Committed):
            return
        self._crash("before_tape")
        self._record(effect)
        self._crash("after_tape")
        self._checkpoint(effect)
        self.committed.append(effect)
        self._prune()

    def _checkpoint(
        self, c: Committed, position: tuple[int, str] | None = None, deferrable: bool = True
    ) -> None:
        """The state after ``c`` (just committed, or just redone); ``position``: the tape
        position it follows (default: the tape's end); ``deferrable``: the machine does not
        change before the next push (which settles the store first)."""
        if self.store is None:
            return
        snap = self.machine.snapshot(copy=False)  # unchanged until the next push settles
        seq, head = position or self.store.tape_position
        state = {
            "run_id": self.cfg.run_id,
            "config_digest": self.cfg.digest,
            "round": c.round,
            "sync_step": c.sync_step,
            "theta": snap.theta,
            "outer": snap.outer,
            "tape_seq": seq,
            "tape_head": head,
        }
        if snap.lawa is not None:  # the LAWA sum so far (its window's rounds)
            state["lawa"] = snap.lawa
        # After the round's tape entry, which with the published inputs determines it: a
        # restart that finds the entry without its checkpoint replays the round.
        self.store.write_checkpoint(c.round, state, copy_as="state.pt", deferrable=deferrable)

    def _write_average(self, a: Averaged) -> None:
        """``lawa.pt``: the LAWA average (flat, the checkpoints' layout) with what it is."""
        if self.store is None:
            return
        self.store.write_average(
            {
                "run_id": self.cfg.run_id,
                "config_digest": self.cfg.digest,
                "first_round": a.record.first_round,
                "last_round": a.record.last_round,
                "digest": a.record.average,
                "theta": a.payload,
            }
        )

    def _untaped_switch(self, entries: list[Entry]) -> Switched | None:
        """The anneal's switch when the machine's last round is the anneal's first and the
        tape has no ``anneal`` entry: the crash came after the round's checkpoint, before
        the entry (the replay redoes a switch taped or cut off after a redone round)."""
        m = self.machine
        last = max(m.merges, default=None)
        if last is None or last != self.cfg.anneal_step_of(m.schedule.fragment):
            return None
        if any(e.kind == AnnealEntry.KIND for e in entries):
            return None
        (switch,) = anneal_switch(m.schedule, self.cfg, last)
        assert isinstance(switch, Switched)
        return switch

    def recover(self) -> bool:
        """Resume from ``state.pt`` and the tape after it, then sweep what a crash left
        (``NodeStore.sweep``); False on a fresh start."""
        resumed = self._recover()
        self._swept()
        return resumed

    def _recover(self) -> bool:
        store = self.store
        if store is None:
            return False
        path = store.folder / "state.pt"
        if store.tape is None:
            if path.exists() or store.has_state():
                raise ConfigError(
                    f"{store.folder} holds the state of an earlier start but this aggregator "
                    "keeps no tape (no --signing-key), so it cannot resume: start it with its "
                    "key, or with a new --state-dir for a new run"
                )
            return False
        entries = store.entries()
        start = 0
        if path.exists():
            ck = load_state(path)
            if ck["run_id"] != self.cfg.run_id or ck["config_digest"] != self.cfg.digest:
                raise ConfigError(f"{path} belongs to another run or config; use a new --state-dir")
            start, head = int(ck["tape_seq"]), str(ck["tape_head"])
            if len(entries) < start or (start and entries[start - 1].hash != head):
                raise ConfigError(
                    f"tape {store.folder / 'tape'} does not contain what {path} recorded "
                    f"({start} entries ending in {head[:16]})"
                )
            snap = AggregatorSnapshot(
                int(ck["sync_step"]), ck["theta"], ck["outer"], ck.get("lawa")
            )
            try:
                self.machine.restore(snap, records(entries[:start]))
            except HypertrainError as e:
                raise ConfigError(f"cannot resume {store.folder}: {e}") from None
        elif len(entries) <= 1:  # nothing taped after the genesis: a fresh start
            return False
        replay = AggregatorReplay(self.machine, entries[start:], store.blobs)
        redone = 0
        try:
            while (found := replay.next_merge()) is not None:
                # taped, perhaps not checkpointed (the crash came between): write it again
                merge, entry = found
                self._checkpoint(merge, (entry.seq + 1, entry.hash), deferrable=False)
                self.committed.append(merge)  # the daemon logs and evaluates it
                redone += 1
        except ReplayError as e:
            where = f"entry {e.entry.seq}" if e.entry else "the tape"
            raise ConfigError(f"cannot resume {store.folder}: {where}: {e.detail}") from None
        for effect in replay.pending:  # completed by taped inputs, crashed before its entry
            self._carry_out(effect)
            redone += 1
        switched = any(isinstance(x, Switched) for x in replay.pending)
        if not switched and (switch := self._untaped_switch(entries)) is not None:
            self._carry_out(switch)  # the anneal's first round checkpointed, not its switch
            redone += 1
        if replay.average is not None:  # taped; the file is written before, unless removed
            self.averaged = replay.average
            if not store.has_average():
                self._write_average(replay.average)
        elif self.averaged is None and (late := self.machine.final_average()) is not None:
            self._carry_out(late)  # the last round checkpointed, the crash came before LAWA
            redone += 1
        self._seal()  # a crash between a merge's entry and its seal
        self.recovered = {"rounds_redone": redone}
        return True
