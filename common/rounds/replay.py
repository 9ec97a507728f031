"""Rebuilding a round machine from its tape and published inputs.

A machine's tape is the list of what it did: the inputs it accepted (events), and the
records of what those inputs made it do (effects: regional merges, forwards, global
merges, global updates applied).  ``RelayReplay`` and ``AggregatorReplay`` feed the
taped events through a fresh (or restored) machine and check that every taped effect
record is exactly the one the machine produces now, field by field.  The daemons'
restart paths and the auditor (common/trust/audit.py) both call them; there is no
other replay.

- An ``input`` entry becomes the ``Delta`` it recorded, with its bytes read back from
  the published inputs (``BlobSource``); the machine must accept it as new.
- A ``regional_merge``, ``forward`` or ``global_merge`` entry must equal the next effect
  the machine produced.
- A relay's ``global_applied`` entry needs the aggregator's new parameters, which are
  not on the relay's tape: ``RelayReplay.advance`` stops there and returns the sync step;
  the caller supplies them (``apply_global``) from the aggregator's replay (the audit).
  A restart never needs them: a relay checkpoints each global update before taping it
  and resumes after its last checkpoint (node.py).  A relay whose region had no member
  (``RelayMachine.idle``) takes global updates without a forward: allowed only then.
- A ``cutoff`` entry is an event too: the machine takes the cutoff of that step (no
  clock is read) and must produce exactly that record, and then the merge it allowed.
  So a merge without some members replays only behind the cutoff that allowed it.
- A ``member`` entry (a relay's join or leave) is an event: the machine takes the
  request it records (signature checked) and must produce exactly that record, then any
  merge the change completed.
- ``rejection`` and ``checkpoint`` entries change nothing and are skipped.
- Effects produced but not on the tape (a crash came between an input and its merge
  record) are left in ``pending``: a restarted daemon tapes and carries them out.

Every mismatch raises ``ReplayError`` naming the entry and the first differing field.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from hypertrain.common.aggregate import Blob
from hypertrain.common.digest import blob_digest
from hypertrain.common.errors import HypertrainError
from hypertrain.common.rounds.machines import (
    OK,
    AggregatorMachine,
    Applied,
    ArmCutoff,
    Averaged,
    Committed,
    Decision,
    Delta,
    Effect,
    Forward,
    GlobalArrived,
    MemberRequest,
    Publish,
    RelayMachine,
    Switched,
    anneal_switch,
)
from hypertrain.common.trust.schema import (
    CutoffEntry,
    GenesisEntry,
    GlobalAppliedEntry,
    InputEntry,
    LawaEntry,
    MemberEntry,
    Record,
    parse,
)
from hypertrain.common.trust.tape_format import Entry


class ReplayError(HypertrainError):
    """The tape and the replay disagree; ``entry`` is the first entry that does not fit."""

    def __init__(self, entry: Entry | None, detail: str) -> None:
        super().__init__(detail)
        self.entry = entry
        self.detail = detail


class BlobSource(Protocol):
    """Where the published inputs of a tape are read back from."""

    def load(self, rec: InputEntry) -> Blob:
        """The bytes of the input ``rec`` recorded (KeyError-free: raise ReplayError)."""
        ...

    def where(self, rec: InputEntry) -> str:
        """Where that input is kept, for messages."""
        ...


class PublishedFolder:
    """A node's ``published/`` folder: accepted inputs under their blob digest, mapped not copied."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.bytes = 0  # bytes read back, for reports

    def where(self, rec: InputEntry) -> str:
        return str(self.folder / rec.digest)

    def load(self, rec: InputEntry) -> Blob:
        path = self.folder / rec.digest
        if not path.is_file():
            raise ReplayError(None, f"missing input {rec.digest} from {rec.sender} ({path})")
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.bytes += size
            if size == 0:
                return b""
            flags = getattr(mmap, "MAP_POPULATE", 0) | mmap.MAP_SHARED
            return memoryview(mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ))


def _where(e: Entry) -> str:
    step = e.body.get("sync_step")
    return f"entry {e.seq} ({e.kind}{f', step {step}' if step is not None else ''})"


class _Replay:
    """Shared by both machines: walk entries, feed inputs, match effect records."""

    def __init__(self, entries: Sequence[Entry], blobs: BlobSource) -> None:
        self.entries = list(entries)
        self.blobs = blobs
        self.pos = 0
        self.pending: list[Effect] = []
        """Effects the machine produced that the tape does not (yet) record, in order."""
        self.inputs: dict[tuple[int, str], Entry] = {}  # (step, sender) -> its input entry

    def _parse(self, e: Entry) -> Record | None:
        """The entry's record; None for what the machines do not replay (tape checkpoints,
        and the genesis entry, which the node and the audit check against the config)."""
        try:
            rec = parse(e)
        except HypertrainError as err:
            raise ReplayError(e, str(err)) from None
        if isinstance(rec, GenesisEntry):
            if e.seq != 0:
                raise ReplayError(e, "a genesis entry belongs only at the start of a tape")
            return None
        return rec

    def _input(self, e: Entry, rec: InputEntry, run_id: str) -> Delta:
        try:
            data = self.blobs.load(rec)
        except ReplayError as err:
            raise ReplayError(e, err.detail) from None
        self.inputs[(rec.sync_step, rec.sender)] = e
        return Delta.from_record(run_id, rec, data)

    def _feed(
        self, e: Entry, delta: Delta, event: Callable[..., tuple[Decision, list[Effect]]]
    ) -> tuple[Decision, list[Effect]]:
        """Feed a taped input (its payload is not validated again: it was when accepted).
        If the step it completes cannot be aggregated, an input of that step was changed
        since (a blob that no longer decodes): name it."""
        try:
            return event(delta, replayed=True)
        except HypertrainError as err:
            self._name_changed_input(delta.sync_step)
            raise ReplayError(e, f"cannot replay this input: {err}") from None

    def _name_changed_input(self, step: int) -> None:
        """ReplayError naming an input of ``step`` whose bytes changed, if there is one."""
        for (s, _), src in self.inputs.items():
            rec = parse(src)
            if (
                s == step
                and isinstance(rec, InputEntry)
                and blob_digest(self.blobs.load(rec)) != rec.digest
            ):
                raise ReplayError(src, self._changed(Delta.from_record("", rec, b"")))

    def _accepted(self, e: Entry, delta: Delta, decision_code: str, reason: str, dup: bool) -> None:
        if decision_code == OK and not dup:
            return
        if blob_digest(delta.data) != delta.digest:
            raise ReplayError(e, self._changed(delta))
        # the step it completed could not be aggregated (the machine refused it for that,
        # changing nothing): an input of that step changed since
        self._name_changed_input(delta.sync_step)
        raise ReplayError(e, f"cannot replay this input: {reason}")

    def _cutoff(
        self, e: Entry, rec: CutoffEntry, event: Callable[[int], tuple[Decision, list[Effect]]]
    ) -> None:
        """A taped cutoff: the machine takes it, and its own record must be the taped one."""
        try:
            decision, effects = event(rec.sync_step)
        except HypertrainError as err:  # the merge it allowed cannot be recomputed
            raise ReplayError(e, f"cannot replay this cutoff: {err}") from None
        if not decision.accepted or decision.duplicate:
            raise ReplayError(e, f"cannot replay this cutoff: {decision.reason}")
        self.pending.extend(x for x in effects if not isinstance(x, ArmCutoff))
        self._match(e, rec)

    def _changed(self, d: Delta) -> str:
        rec = d.record()
        return f"changed input: {self.blobs.where(rec)} no longer has digest {d.digest}"

    def _match(self, e: Entry, rec: Record) -> Effect:
        """``e`` records an effect: it must be the next one the machine produced."""
        if not self.pending:
            raise ReplayError(e, f"the replay produced no {e.kind} here")
        effect = self.pending[0]
        want = effect.record
        if want is None or want.KIND != rec.KIND:
            kind = want.KIND if want is not None else type(effect).__name__
            raise ReplayError(e, f"expected a {kind} entry here")
        field = want.first_difference(rec)
        if field == "members" and isinstance(effect, Committed):
            self._check_members(e, effect)
        if field is not None:
            raise ReplayError(
                e,
                f"recomputed {field} differs: tape has {getattr(rec, field)}, "
                f"replay gives {getattr(want, field)}",
            )
        self.pending.pop(0)
        return effect

    def _check_members(self, e: Entry, c: Committed) -> None:
        """A recomputed input digest differs from the taped one: name the changed input."""
        for member, digest in zip(c.commitment.members, c.commitment.input_digests, strict=True):
            src = self.inputs.get((c.sync_step, member))
            rec = parse(src) if src is not None else None
            if isinstance(rec, InputEntry) and rec.digest != digest:
                raise ReplayError(
                    src,
                    f"changed input: {self.blobs.where(rec)} no longer has digest {rec.digest}",
                )


class RelayReplay(_Replay):
    """A relay's tape through its machine (see the module docstring)."""

    def __init__(self, machine: RelayMachine, entries: Sequence[Entry], blobs: BlobSource) -> None:
        super().__init__(entries, blobs)
        self.machine = machine
        self.forwards: dict[int, Forward] = {}
        """sync step -> the forward the replay produced and the tape recorded."""

    def advance(self) -> int | None:
        """Replay up to the next ``global_applied`` entry (returns its sync step: call
        ``apply_global``) or to the end of the tape (returns None)."""
        m = self.machine
        while self.pos < len(self.entries):
            e = self.entries[self.pos]
            rec = self._parse(e)
            if isinstance(rec, GlobalAppliedEntry):
                if self.pending:
                    raise ReplayError(e, f"expected a {self.pending[0].record.KIND} entry here")  # type: ignore[union-attr]
                if (m.global_pending is None and not m.idle) or (
                    m.global_pending is not None and rec.sync_step < m.global_pending
                ):
                    raise ReplayError(e, "a global update without the forward of its round")
                return rec.sync_step
            self.pos += 1
            if isinstance(rec, InputEntry):
                delta = self._input(e, rec, m.cfg.run_id)
                decision, effects = self._feed(e, delta, m.on_delta)
                self._accepted(e, delta, decision.code, decision.reason, decision.duplicate)
                self.pending.extend(x for x in effects if not isinstance(x, Publish | ArmCutoff))
            elif isinstance(rec, CutoffEntry):
                self._cutoff(e, rec, m.on_cutoff)
            elif isinstance(rec, MemberEntry):
                self._member(e, rec)
            elif rec is not None and rec.KIND in ("regional_merge", "forward", "anneal"):
                effect = self._match(e, rec)
                if isinstance(effect, Forward):
                    self.forwards[effect.sync_step] = effect
            elif rec is not None and rec.KIND != "rejection":
                raise ReplayError(e, f"a {rec.KIND} entry does not belong on a relay's tape")
        return None

    def _member(self, e: Entry, rec: MemberEntry) -> None:
        """A taped join or leave: the machine takes the request it records, and its own
        record (the steps it applies from) must be the taped one."""
        try:
            decision, effects = self.machine.on_member(
                MemberRequest.from_record(self.machine.cfg.run_id, rec)
            )
        except (HypertrainError, ValueError) as err:  # a merge it completed cannot be redone
            raise ReplayError(e, f"cannot replay this {rec.change}: {err}") from None
        if not decision.accepted or decision.duplicate:
            raise ReplayError(e, f"cannot replay this {rec.change}: {decision.reason}")
        self.pending.extend(effects)
        self._match(e, rec)

    def apply_global(self, event: GlobalArrived) -> Committed:
        """Consume the ``global_applied`` entry ``advance`` stopped at, with the aggregator's
        parameters for it; the recorded theta digest must be the one the replay applies."""
        e = self.entries[self.pos]
        rec = self._parse(e)
        if not isinstance(rec, GlobalAppliedEntry) or rec.sync_step != event.sync_step:
            raise ReplayError(e, f"expected the global update of step {event.sync_step} here")
        try:
            effects = self.machine.on_global(event)
        except HypertrainError as err:
            raise ReplayError(e, str(err)) from None
        self.pending.extend(effects)
        applied = self._match(e, rec)
        self.pos += 1
        assert isinstance(applied, Applied)
        return applied.merge


class AggregatorReplay(_Replay):
    """The aggregator's tape through its machine."""

    def __init__(
        self, machine: AggregatorMachine, entries: Sequence[Entry], blobs: BlobSource
    ) -> None:
        super().__init__(entries, blobs)
        self.machine = machine
        self.merges: list[Committed] = []
        """Global merges the replay produced and the tape recorded, in order."""
        self.received: dict[tuple[int, str], InputEntry] = {}
        """(sync step, relay member: a region or a shard ``eu/1``) -> the taped input (what
        each relay's forward must be)."""
        self.on_merge: Callable[[Committed], None] | None = None
        """Called with each global merge matched, while the machine holds its state."""
        self.average: Averaged | None = None
        """The LAWA average the tape's ``lawa`` entry records, recomputed (RunConfig.lawa)."""

    def next_merge(self) -> tuple[Committed, Entry] | None:
        """Replay up to the next global merge the tape records; returns it with its entry,
        or None at the end of the tape."""
        m = self.machine
        while self.pos < len(self.entries):
            e = self.entries[self.pos]
            rec = self._parse(e)
            self.pos += 1
            if isinstance(rec, InputEntry):
                delta = self._input(e, rec, m.cfg.run_id)
                decision, effects = self._feed(e, delta, m.on_regional)
                self._accepted(e, delta, decision.code, decision.reason, decision.duplicate)
                self.received[(rec.sync_step, rec.sender)] = rec
                self.pending.extend(x for x in effects if not isinstance(x, Publish | ArmCutoff))
            elif isinstance(rec, CutoffEntry):
                self._cutoff(e, rec, m.on_cutoff)  # its global_merge entry comes next
            elif rec is not None and rec.KIND == "anneal":
                if not any(isinstance(x, Switched) for x in self.pending):
                    # a machine restored from the checkpoint of the anneal's first round,
                    # which is written before the switch's entry
                    last = max(m.merges, default=0)
                    switch = anneal_switch(m.schedule, m.cfg, last)
                    if not switch:
                        raise ReplayError(e, f"an anneal entry after step {last}, where the "
                                          "run's schedule has no switch")  # fmt: skip
                    self.pending.extend(switch)
                self._match(e, rec)
            elif isinstance(rec, LawaEntry):
                if not any(isinstance(x, Averaged) for x in self.pending):
                    # a machine restored after the last round: its sum is the checkpoint's
                    final = m.final_average()
                    if final is None:
                        why = (
                            "before the run's last global merge"
                            if m.cfg.lawa
                            else ("but the run's configuration has no LAWA (lawa = 0)")
                        )
                        raise ReplayError(e, f"a lawa entry {why}")
                    self.pending.append(final)
                average = self._match(e, rec)
                assert isinstance(average, Averaged)
                self.average = average
            elif rec is not None and rec.KIND == "global_merge":
                merge = self._match(e, rec)
                assert isinstance(merge, Committed)
                self.merges.append(merge)
                if self.on_merge is not None:
                    self.on_merge(merge)
                return merge, e
            elif rec is not None and rec.KIND != "rejection":
                raise ReplayError(e, f"a {rec.KIND} entry does not belong on the aggregator's tape")
        return None

    def advance(self, until_step: int | None = None) -> Committed | None:
        """Replay until the global merge of ``until_step`` was matched (returned) or, with
        None, to the end of the tape (returns the last merge matched, if any)."""
        last = None
        while (found := self.next_merge()) is not None:
            last = found[0]
            if last.sync_step == until_step:
                return last
        if until_step is not None:
            raise ReplayError(None, f"the tape ends before the global merge of step {until_step}")
        return last
