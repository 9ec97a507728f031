"""The auditor: verify the tapes and replay every merge from the published inputs.

    report = audit_run(RunLayout.of(run_dir), trusted, from_round=None)

Steps, each failure naming the first bad entry and why:
1. Every tape (the aggregator's and each relay's) verifies: framing, every
   signature against the pinned keys, sequence, hash chain, checkpoints
   (common/trust/tape_verify.py), and was signed by the daemon it belongs to.
2. Replay through the round machines themselves (common/rounds/replay.py: the
   same replay a restarted daemon runs), every relay's tape whole and the
   aggregator's, interleaved round by round: each relay's inputs are fed to a
   ``RelayMachine`` (signatures checked against the pinned keys, published
   blobs read back), and every record it taped (regional merges with their
   members, aggregate, commitment and base digests; forwards with the relay's
   error feedback; global updates applied) must be exactly the record the
   machine produces now; the aggregator's ``global_merge`` records likewise
   (aggregate over regions, one outer step, theta and outer-state digests), and
   the parameters it commits are what the relays' replays apply.  Every
   regional delta the aggregator took must be what that relay forwarded.
3. A segment audit starts from the checkpoints of a global round (the
   aggregator's parameters and outer state, each relay's parameters, error
   feedback and the aggregator's commitment), after checking them against the
   tape entries of that round.

On CPU the replay is bit-exact: the daemons computed the same functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hypertrain.common.aggregate import Commitment
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import state_digest
from hypertrain.common.errors import HypertrainError, TapeError
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.machines import (
    AggregatorMachine,
    AggregatorSnapshot,
    GlobalArrived,
    RelayMachine,
    RelaySnapshot,
    stored_residual_digest,
)
from hypertrain.common.rounds.node import CHECKPOINT_FORMAT
from hypertrain.common.rounds.replay import (
    AggregatorReplay,
    PublishedFolder,
    RelayReplay,
    ReplayError,
)
from hypertrain.common.shards import relay_members
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.ledger import (
    AGGREGATOR_KEY,
    flat_digest,
    outer_state_digest,
    relay_key,
)
from hypertrain.common.trust.schema import (
    ForwardEntry,
    GlobalAppliedEntry,
    GlobalMergeEntry,
    records,
)
from hypertrain.common.trust.tape import Entry, verify_tape


class AuditError(HypertrainError):
    """The audit found a problem; the message names the first bad entry and why."""


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Where a run's tapes, published inputs and checkpoints are."""

    config: RunConfig
    aggregator: Path
    relays: dict[str, Path]
    """Each relay's folder by its member id (a region, or ``region/i`` for a shard)."""

    @classmethod
    def of(cls, run_dir: Path) -> RunLayout:
        cfg = RunConfig.from_toml(run_dir / "run.toml")
        members = relay_members(cfg.topology.regions, cfg.topology.relay_shards)
        relays = {m: run_dir / relay_key(m) for m in sorted(members)}
        return cls(cfg, run_dir / "aggregator", relays)


@dataclass(frozen=True, slots=True)
class AuditReport:
    first_round: int
    last_round: int
    first_step: int
    last_step: int
    entries: int
    bytes: int
    final_digest: str

    def summary(self) -> str:
        return (
            f"audit OK: rounds {self.first_round}..{self.last_round} (steps {self.first_step}.."
            f"{self.last_step}), {self.entries} entries and {self.bytes} bytes checked, "
            f"final state digest {self.final_digest}"
        )


def _where(e: Entry) -> str:
    step = e.body.get("sync_step")
    return f"entry {e.seq} ({e.kind}{f', step {step}' if step is not None else ''})"


class Auditor:
    """Replays a run (or a segment of it) through the round machines and checks every
    recorded digest (see the module docstring)."""

    def __init__(self, layout: RunLayout, trusted: TrustedKeys) -> None:
        self.layout = layout
        self.cfg = layout.config
        self.trusted = trusted
        self.bytes = 0
        self.entries = 0

    def _fail(self, tape: Path, err: ReplayError) -> AuditError:
        return AuditError(
            f"{tape} {_where(err.entry)}: {err.detail}" if err.entry else f"{tape}: {err.detail}"
        )

    def _check_reaches_latest_checkpoint(
        self, tape: Path, folder: Path, entries: list[Entry]
    ) -> None:
        """A tape cut at a record boundary still verifies on its own; the daemon's
        latest durable checkpoint recorded the tape's length and head, so it cannot
        be shorter than that (truncation) or differ there (fork)."""
        latest = sorted((folder / "checkpoints").glob("round-*.pt"))
        if not latest:
            return
        ck = torch.load(latest[-1], weights_only=True, mmap=True)  # tensors left unread
        seq, head = int(ck["tape_seq"]), ck["tape_head"]
        if len(entries) < seq:
            raise AuditError(
                f"{tape}: truncated tape: {len(entries)} entries, but {latest[-1].name} "
                f"recorded {seq}"
            )
        if seq and entries[seq - 1].hash != head:
            raise AuditError(f"{tape} entry {seq - 1}: fork: differs from {latest[-1].name}'s head")

    # -- the replay -----------------------------------------------------------------
    def run(self, from_round: int | None = None) -> AuditReport:
        cfg, lay = self.cfg, self.layout
        tapes = {AGGREGATOR_KEY: (lay.aggregator, lay.aggregator / "tape")}
        tapes.update({relay_key(r): (d, d / "tape") for r, d in lay.relays.items()})
        verified: dict[str, list[Entry]] = {}
        for signer, (folder, path) in tapes.items():
            try:
                report = verify_tape(path, self.trusted, run_id=cfg.run_id, signer=signer)
            except TapeError as exc:
                raise AuditError(str(exc)) from None
            verified[signer] = report.entries
            self.bytes += report.n_bytes
            self.entries += report.n_entries
            self._check_reaches_latest_checkpoint(path, folder, report.entries)
        layout, theta0 = initial_parameters(cfg)
        agg = AggregatorMachine(cfg, theta0, self.trusted)
        shards = cfg.shards(theta0.numel())
        relays = {}
        for m in lay.relays:
            region, i = shards.split(m)
            a, b = shards.bounds(i)
            relays[m] = RelayMachine(
                cfg, region, theta0[a:b], self.trusted, shard=i, model_numel=theta0.numel()
            )
        starts = {k: 0 for k in tapes}
        if from_round is not None:
            starts = self._load_segment(from_round, agg, relays, verified)
        agg_tape = tapes[AGGREGATOR_KEY][1]
        agg_blobs = PublishedFolder(lay.aggregator / "published")
        agg_replay = AggregatorReplay(
            agg, verified[AGGREGATOR_KEY][starts[AGGREGATOR_KEY] :], agg_blobs
        )
        replays: dict[str, tuple[Path, RelayReplay, PublishedFolder]] = {}
        for r, folder in lay.relays.items():
            key = relay_key(r)
            blobs = PublishedFolder(folder / "published")
            rr = RelayReplay(relays[r], verified[key][starts[key] :], blobs)
            replays[r] = (tapes[key][1], rr, blobs)
        try:
            self._interleave(agg_tape, agg_replay, replays)
            agg_replay.advance()
        except ReplayError as err:
            raise self._fail(agg_tape, err) from None
        self._check_forwards(agg_tape, agg_replay, replays)
        self.bytes += agg_blobs.bytes + sum(b.bytes for _, _, b in replays.values())
        merges = agg_replay.merges
        if not merges:
            raise AuditError(f"{agg_tape}: no global round after round {from_round}")
        sched = agg.schedule
        first, last = merges[0].round, merges[-1].round
        return AuditReport(
            first,
            last,
            sched.global_step_of(first),
            sched.global_step_of(last),
            self.entries,
            self.bytes,
            state_digest(layout.unflatten(merges[-1].payload)),
        )

    def _interleave(
        self,
        agg_tape: Path,
        agg: AggregatorReplay,
        relays: dict[str, tuple[Path, RelayReplay, PublishedFolder]],
    ) -> None:
        """Each relay's tape up to its next global update, then the aggregator's up to that
        round's merge, whose parameters every relay then applies; until the tapes end."""
        while True:
            wants: dict[str, int] = {}
            for member, (tape, rr, _) in relays.items():
                try:
                    step = rr.advance()
                except ReplayError as err:
                    raise self._fail(tape, err) from None
                if step is not None:
                    wants[member] = step
            if not wants:
                return
            step = min(wants.values())
            if agg.advance(until_step=step) is None:
                raise AuditError(f"{agg_tape}: no global merge of step {step}")
            for member, want in wants.items():
                if want != step:
                    continue
                tape, rr, _ = relays[member]
                part = agg.machine.merge_for(step, member)  # a shard's range, as it fetches
                assert part is not None
                try:
                    rr.apply_global(
                        GlobalArrived(step, part.payload, part.commitment, part.payload_digest)
                    )
                except ReplayError as err:
                    raise self._fail(tape, err) from None

    def _check_forwards(
        self,
        agg_tape: Path,
        agg: AggregatorReplay,
        relays: dict[str, tuple[Path, RelayReplay, PublishedFolder]],
    ) -> None:
        """Every regional delta the aggregator took is what that relay (or relay shard)
        forwarded (as the relay's replay recomputed it)."""
        for (step, region), rec in agg.received.items():
            forwarded = relays[region][1].forwards.get(step) if region in relays else None
            if forwarded is not None and forwarded.record.digest != rec.digest:
                raise AuditError(
                    f"{agg_tape}: input from {region} for step {step} is not what relay "
                    f"{region} forwarded"
                )

    def _load_segment(
        self,
        round_: int,
        agg: AggregatorMachine,
        relays: dict[str, RelayMachine],
        verified: dict[str, list[Entry]],
    ) -> dict[str, int]:
        """Start from the checkpoints of global round ``round_``, checked against the tapes."""
        name = f"round-{round_:06d}.pt"
        path = self.layout.aggregator / "checkpoints" / name
        if not path.is_file():
            raise AuditError(f"no aggregator checkpoint for round {round_} ({path})")
        ck = torch.load(path, weights_only=True)
        theta = ck["theta"]
        start = int(ck["tape_seq"])
        prior = records(verified[AGGREGATOR_KEY][:start])
        merge = next(
            (r for r in prior if isinstance(r, GlobalMergeEntry) and r.round == round_), None
        )
        if merge is None or merge.post_state != flat_digest(theta):
            raise AuditError(
                f"{path}: checkpoint does not match the tape's global merge of round {round_}"
            )
        if outer_state_digest(ck["outer"]) != merge.post_outer:
            raise AuditError(f"{path}: outer optimizer state does not match the tape")
        snap = AggregatorSnapshot(merge.sync_step, theta, ck["outer"])
        agg.restore(snap, prior)
        starts = {AGGREGATOR_KEY: start}
        shards = self.cfg.shards(theta.numel())
        for region, folder in self.layout.relays.items():  # each relay by its member id
            a, b = shards.bounds(shards.split(region)[1])
            part = theta.view(-1)[a:b] if shards.sharded else theta
            rpath = folder / "checkpoints" / name
            if not rpath.is_file():
                raise AuditError(f"no relay checkpoint of {region} for round {round_} ({rpath})")
            rck = torch.load(rpath, weights_only=True)
            if rck.get("format") != CHECKPOINT_FORMAT:
                raise AuditError(
                    f"{rpath}: a relay checkpoint of an older format; cannot audit from it"
                )
            rentries = verified[relay_key(region)]
            seq = int(rck["tape_seq"])
            taped = records(rentries[:seq])
            forward = next(
                (r for r in taped if isinstance(r, ForwardEntry) and r.round == round_), None
            )
            applied = [
                r
                for r in taped
                if isinstance(r, GlobalAppliedEntry) and r.sync_step == merge.sync_step
            ]
            if (
                not applied
                or not torch.equal(rck["theta"], part)
                or int(rck["sync_step"]) != merge.sync_step
            ):
                raise AuditError(f"{rpath}: relay checkpoint does not match round {round_}")
            if forward is None or forward.post_residual != stored_residual_digest(
                rck["residual"], part.numel()
            ):
                raise AuditError(f"{rpath}: error-feedback state does not match the tape")
            rsnap = RelaySnapshot(
                merge.sync_step,
                part,
                rck["residual"],
                Commitment.from_dict(json.loads(rck["commitment"])),
            )
            relays[region].restore(rsnap, taped)
            starts[relay_key(region)] = seq
        return starts


def audit_run(run_dir: Path, trusted: TrustedKeys, from_round: int | None = None) -> AuditReport:
    return Auditor(RunLayout.of(run_dir), trusted).run(from_round)


def iter_rounds(run_dir: Path) -> Iterator[int]:
    """Global rounds that have an aggregator checkpoint (segment starts)."""
    for p in sorted((run_dir / "aggregator" / "checkpoints").glob("round-*.pt")):
        yield int(p.stem.split("-")[1])
