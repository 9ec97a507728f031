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
   tape entries of that round.  Nodes run with ``--keep-rounds`` keep only their
   newest rounds' checkpoints and inputs: their runs are audited from one of those
   (a whole-run audit that finds them gone names the round to start from).
4. Receipts (common/trust/receipts.py): every signed tape head an island or a relay
   kept with a merge (``<state-dir>/receipts`` in the run folder, and any
   ``receipts`` file under the folders given) is its signer's, and is a head of that
   signer's tape as it is now: the tape's first ``size`` entries have the root it
   signed.  One that is not is a fork: the tape was rewritten (or cut) after the
   receipt was handed out, whoever signed the rewrite.

On CPU the replay is bit-exact: the daemons computed the same functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hypertrain.common.aggregate import Commitment
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import state_digest, zeros_digest
from hypertrain.common.errors import HypertrainError, TapeError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import run_fragments
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
from hypertrain.common.rounds.store import (
    FRAGMENT_DIR,
    LAWA_FILE,
    checkpoint_path,
    checkpoints_of,
)
from hypertrain.common.rounds.store import pruned_from as store_pruned_from
from hypertrain.common.shards import relay_members
from hypertrain.common.trust import merkle
from hypertrain.common.trust.certs import fingerprint
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.ledger import (
    AGGREGATOR_KEY,
    flat_digest,
    outer_state_digest,
    relay_key,
)
from hypertrain.common.trust.receipts import (
    KeptReceipt,
    find_receipts,
    open_receipt,
    read_receipts,
)
from hypertrain.common.trust.schema import (
    ForwardEntry,
    GenesisEntry,
    GlobalAppliedEntry,
    GlobalMergeEntry,
    parse,
    records,
)
from hypertrain.common.trust.tape import CHECKPOINT, Entry, verify_tape

FromRound = int | tuple[int | None, ...] | None
"""Where a segment audit starts: a global round (of every streaming fragment), one per
fragment (None: that fragment from its start), or None: the whole run."""


class AuditError(HypertrainError):
    """The audit found a problem; the message names the first bad entry and why."""


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Where a run's tapes, published inputs and checkpoints are."""

    config: RunConfig
    aggregator: Path
    relays: dict[str, Path]
    """Each relay's folder by its member id (a region, or ``region/i`` for a shard)."""
    run_toml_name: str = "the configuration given"
    """Where ``config`` came from, for messages."""
    receipts: tuple[Path, ...] = ()
    """Receipts files (the islands' and relays' state folders' ``receipts``)."""

    @classmethod
    def of(cls, run_dir: Path, receipts: tuple[Path, ...] = ()) -> RunLayout:
        """The run folder's layout; its daemons' receipts and those under ``receipts``
        (folders searched recursively, or files)."""
        cfg = RunConfig.from_toml(run_dir / "run.toml")
        members = relay_members(cfg.topology.regions, cfg.topology.relay_shards)
        relays = {m: run_dir / relay_key(m) for m in sorted(members)}
        own = sorted(
            p
            for pattern in ("*/receipts", f"*/{FRAGMENT_DIR}-*/receipts")
            for p in run_dir.glob(pattern)
            if p.is_file()
        )
        extra = [p for p in find_receipts(receipts) if p not in own]
        return cls(cfg, run_dir / "aggregator", relays, str(run_dir / "run.toml"), (*own, *extra))

    def fragment(self, index: int) -> RunLayout:
        """Where streaming fragment ``index``'s nodes keep their tapes, inputs and
        checkpoints: ``fragment-<index>`` in each node's folder (docs/design.md §3.5)."""
        sub = f"{FRAGMENT_DIR}-{index}"
        return dataclasses.replace(
            self,
            aggregator=self.aggregator / sub,
            relays={m: p / sub for m, p in self.relays.items()},
        )


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What an audit covered.  ``complete``: the replay reached the run's final global
    merge (the configuration's last step); a segment audit (``segment``: it started from
    the checkpoint of a global round) covers its rounds only, and is complete when it
    reaches the end."""

    first_round: int
    last_round: int
    first_step: int
    last_step: int
    entries: int
    bytes: int
    final_digest: str
    rounds: int = 0
    """Global rounds in the run, by its configuration."""
    steps: int = 0
    """Steps in the run, by its configuration."""
    segment: bool = False
    receipts: int = 0
    """Receipts found and checked against the tapes."""
    lawa_digest: str = ""
    """The LAWA average's state digest, recomputed (RunConfig.lawa; "" without LAWA)."""
    fragments: int = 1
    """Streaming fragments replayed (each its own tapes); rounds and steps are fragment
    0's, and the audit is complete when every fragment's replay reached the last step."""
    starts: tuple[int | None, ...] = ()
    """A segment whose fragments started from different rounds: each one's round, as
    ``--from-round`` names it (None: that fragment replayed from its start)."""

    @property
    def complete(self) -> bool:
        return self.last_step == self.steps

    def summary(self) -> str:
        """The verdict line: ``audit OK: complete, ...`` for a run replayed to its end;
        ``audit INCOMPLETE: tapes end at round r of R ...`` when the tapes stop before the
        configuration's last step (a failure, unless the caller accepts a partial run:
        ``verdict(partial=True)``)."""
        return self.verdict(partial=False)

    def verdict(self, partial: bool) -> str:
        what = "segment rounds" if self.segment else "rounds"
        covered = (
            f"{what} {self.first_round}..{self.last_round} of {self.rounds} (steps "
            f"{self.first_step}..{self.last_step} of {self.steps})"
            + (f" in {self.fragments} fragments" if self.fragments > 1 else "")
            + (f" (fragments from rounds {round_arg(self.starts)})" if self.starts else "")
            + f", {self.entries} entries and "
            f"{self.bytes} bytes checked, {self.receipts} receipts agree, final state digest "
            f"{self.final_digest}"
            + (f", LAWA average digest {self.lawa_digest}" if self.lawa_digest else "")
        )
        if self.complete:
            return f"audit OK: complete, {covered}"
        if partial:
            return f"audit OK (partial): {covered}"
        return (
            f"audit INCOMPLETE: tapes end at round {self.last_round} of {self.rounds} (the "
            f"run's configuration says {self.steps} steps); {covered}; --partial accepts a "
            "run that has not ended"
        )


@dataclass(frozen=True, slots=True)
class _CheckpointFile:
    """A node's checkpoint of one global round: the tape entry it follows, and its file
    (None when there is none on disk)."""

    round: int
    entry: Entry
    path: Path | None


def _first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """The first path (``outer.eta``) at which two JSON-like values differ, or None."""
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            where = f"{path}.{k}" if path else str(k)
            if k not in want or k not in got:
                return where
            found = _first_difference(want[k], got[k], where)
            if found is not None:
                return found
        return None
    return None if want == got else (path or "(the whole value)")


def _same(a: Any, b: Any) -> bool:
    """Are two states (tensors, or dicts and lists of them and plain values) equal bit for
    bit, with the same structure, dtypes and shapes?"""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def _same_residual(a: torch.Tensor | None, b: torch.Tensor | None, numel: int) -> bool:
    """Error-feedback residuals of ``numel`` values: None is all zeros, as in
    ``stored_residual_digest``."""
    if a is None or b is None:
        other = b if a is None else a
        return other is None or (
            other.dtype == torch.float32 and other.numel() == numel and not bool(other.any())
        )
    return _same(a, b)


def _advance(rr: RelayReplay) -> int | ReplayError | None:
    """A relay's replay to its next global update (``RelayReplay.advance``), its failure
    returned rather than raised (it runs on a pool thread)."""
    try:
        return rr.advance()
    except ReplayError as err:
        return err


def _where(e: Entry) -> str:
    step = e.body.get("sync_step")
    return f"entry {e.seq} ({e.kind}{f', step {step}' if step is not None else ''})"


class Auditor:
    """Replays a run (or a segment of it) through the round machines and checks every
    recorded digest (see the module docstring)."""

    def __init__(
        self,
        layout: RunLayout,
        trusted: TrustedKeys,
        ca: str | None = None,
        threads: int | None = None,
    ) -> None:
        """``ca``: the fingerprint of the run CA every tape must pin (None: the aggregator's
        genesis names it, and every relay's must name the same); ``threads``: relays
        replayed side by side (default: one per relay, up to the number of cores)."""
        self.threads = threads
        self.layout = layout
        self.cfg = layout.config
        self.trusted = trusted
        self.ca = ca
        self.bytes = 0
        self.entries = 0
        self._files: dict[tuple[str, int], Path] = {}  # (signer, round) -> checkpoint file
        self._same_as_replay: set[tuple[str, int]] = set()
        self.fragment: int | None = None
        """The streaming fragment being replayed (None: the run is not split)."""

    def _fail(self, tape: Path, err: ReplayError) -> AuditError:
        return AuditError(
            f"{tape} {_where(err.entry)}: {err.detail}" if err.entry else f"{tape}: {err.detail}"
        )

    def _checkpoint_positions(
        self, signer: str, tape: Path, folder: Path, entries: list[Entry]
    ) -> list[_CheckpointFile]:
        """Every checkpoint file is one the tape accounts for, at the position it says.

        A node writes ``checkpoints/round-N.pt`` for each global round it commits (the
        aggregator, after its ``global_merge`` entry) or applies (a relay, before its
        ``global_applied`` entry), and deletes those of old rounds only when run with
        ``--keep-rounds`` (``NodeStore.prune``).  The files are not signed, so
        nothing in them is believed: each must record the tape position right after that
        entry (only tape checkpoints between) and the entry's hash.  A file of a round the
        tape does not have is a truncated tape; one that disagrees, a fork or a replaced
        file.  Returns each round's entry and file (None: none on disk), for
        ``_check_checkpoint_files`` after the replay."""
        relay = signer != AGGREGATOR_KEY
        commits: dict[int, Entry] = {}
        for e in entries:
            if e.kind == (GlobalAppliedEntry.KIND if relay else GlobalMergeEntry.KIND):
                commits[int(e.body["round"])] = e
        files = checkpoints_of(folder)
        for round_ in sorted(set(files) - set(commits)):
            raise AuditError(
                f"{tape}: truncated tape: {files[round_].name} was written for round {round_}, "
                "which the tape does not have"
            )
        out = []
        for round_, e in sorted(commits.items()):
            path = files.get(round_)
            if path is not None:
                ck = torch.load(path, weights_only=True, mmap=True)  # tensors left unread
                seq, head = int(ck.get("tape_seq", -1)), str(ck.get("tape_head", ""))
                after = e.seq + 1
                while after < len(entries) and after < seq and entries[after].kind == CHECKPOINT:
                    after += 1
                if seq != after or head != entries[seq - 1].hash:
                    raise AuditError(
                        f"{tape} {_where(e)}: fork: {path.name} recorded the tape's head as "
                        f"entry {seq - 1} {head[:16]}..., the tape has {_where(e)} "
                        f"{e.hash[:16]}... there (the tape was rewritten, or the file replaced)"
                    )
            out.append(_CheckpointFile(round_, e, path))
        return out

    def _compare_live(self, signer: str, round_: int, live: Any) -> None:
        """While the replay holds the state after ``signer``'s global round ``round_``: if
        its checkpoint file holds exactly that state (compared bit for bit, not hashed: the
        live state's digests were checked against the tape already), it need not be hashed
        again (``_check_checkpoint_files``)."""
        path = self._files.get((signer, round_))
        if path is None:
            return
        ck = torch.load(path, weights_only=True, mmap=True)
        if isinstance(live, AggregatorSnapshot):
            same = (
                _same(ck.get("theta"), live.theta)
                and _same(ck.get("outer"), live.outer)
                and _same(ck.get("lawa"), live.lawa)
            )
        else:
            same = _same(ck.get("theta"), live.theta) and _same_residual(
                ck.get("residual"), live.residual, live.theta.numel()
            )
        if same:
            self._same_as_replay.add((signer, round_))

    def _check_checkpoint_files(
        self,
        signer: str,
        tape: Path,
        entries: list[Entry],
        files: list[_CheckpointFile],
        from_round: int | None = None,
    ) -> None:
        """After the replay: every round's checkpoint is on disk (except the aggregator's
        last of a run that has not ended: written after its entry, possibly not yet; and,
        in a segment audit, the rounds before ``from_round``: a node run with
        ``--keep-rounds`` deletes them) and
        holds the state its entry digests: the aggregator's parameters and outer state, a
        relay's parameters and the error feedback its forward of the round left (a file
        found bit for bit equal to the replay's state of that round, ``_compare_live``, is
        not hashed again)."""
        relay = signer != AGGREGATOR_KEY
        for i, f in enumerate(files):
            if f.path is None:
                if from_round is not None and f.round < from_round:
                    continue
                if relay or i < len(files) - 1 or f.entry.body["sync_step"] == self.cfg.steps:
                    raise AuditError(
                        f"{tape} {_where(f.entry)}: the checkpoint of round {f.round} is "
                        f"missing ({checkpoint_path(tape.parent, f.round)})"
                    )
                continue
            ck = torch.load(f.path, weights_only=True, mmap=True)
            rec = parse(f.entry)
            problem = None
            same = (signer, f.round) in self._same_as_replay
            if ck.get("run_id") != self.cfg.run_id or ck.get("config_digest") != self.cfg.digest:
                problem = "it belongs to another run or configuration"
            elif isinstance(rec, GlobalAppliedEntry) and ck.get("format") != CHECKPOINT_FORMAT:
                problem = "it is of an older format"
            elif same:
                pass
            elif isinstance(rec, GlobalMergeEntry):
                if flat_digest(ck["theta"]) != rec.post_state:
                    problem = "its parameters are not the round's post_state"
                elif outer_state_digest(ck["outer"]) != rec.post_outer:
                    problem = "its outer optimizer state is not the round's post_outer"
            elif isinstance(rec, GlobalAppliedEntry):
                if flat_digest(ck["theta"]) != rec.theta:
                    problem = "its parameters are not the theta the relay applied"
                elif _residual_left(entries, f.entry.seq, ck["theta"].numel()) != (
                    stored_residual_digest(ck["residual"], ck["theta"].numel())
                ):
                    problem = "its error feedback is not what the relay's last forward left"
            if problem is not None:
                raise AuditError(
                    f"{f.path}: checkpoint of round {f.round}: {problem} ({_where(f.entry)})"
                )

    def run(self, from_round: FromRound = None) -> AuditReport:
        """Audit the run (from global round ``from_round``'s checkpoints: a segment).  A
        run split into streaming fragments is replayed fragment by fragment, each from its
        nodes' own tapes and folders (``RunLayout.fragment``), as the run it is: its own
        rounds, inputs, merges and checkpoints; the final state joins their last merges.
        A segment of such a run starts each fragment from its own round ``from_round``, or
        from the round named for it (a tuple, one per fragment, None: from its start):
        their rounds end at different steps, and each node prunes its fragment's own."""
        try:
            return self._run_fragments(from_round)
        except AuditError as e:
            # A file gone (a checkpoint, an input): say where the files left allow an
            # audit from, if nodes pruned.
            hint = "" if from_round is not None or "missing" not in str(e) else self._pruned_hint()
            if hint:
                raise AuditError(f"{e}; {hint}") from None
            raise

    def _run_fragments(self, from_round: FromRound) -> AuditReport:
        starts = self._starts(from_round)
        if self.cfg.fragments == 1:
            return self._run(starts[0])[0]
        whole = self.layout
        layout, theta0 = initial_parameters(self.cfg)
        reports, finals, averages = [], [], []
        try:
            for fr in run_fragments(self.cfg, layout):
                self.layout, self.fragment = whole.fragment(fr.index), fr.index
                self._files, self._same_as_replay = {}, set()
                part = theta0[fr.lo : fr.hi]
                report, final, average = self._run(starts[fr.index], part, layout)
                reports.append(report)
                finals.append(final)
                averages.append(average)
        finally:
            self.layout, self.fragment = whole, None
        lawa = ""
        if all(a is not None for a in averages):  # LAWA: each fragment's, joined
            lawa = state_digest(layout.unflatten(torch.cat([a for a in averages if a is not None])))
        first = reports[0]
        done = min(reports, key=lambda r: (r.last_step, r.fragments))
        return dataclasses.replace(
            first,
            last_step=done.last_step,
            last_round=first.last_round if done is first else done.last_round,
            entries=self.entries,
            bytes=self.bytes,
            final_digest=state_digest(layout.unflatten(torch.cat(finals))),
            receipts=sum(r.receipts for r in reports),
            fragments=len(reports),
            lawa_digest=lawa,
            segment=any(r.segment for r in reports),
            starts=tuple(starts) if len(set(starts)) > 1 else (),
        )

    def _starts(self, from_round: FromRound) -> list[int | None]:
        """Where each fragment's replay starts (one entry when the run is not split)."""
        n = self.cfg.fragments
        if not isinstance(from_round, tuple):
            return [from_round] * n
        if len(from_round) != n:
            run = (
                "is not split into streaming fragments: name one round"
                if n == 1
                else f"has {n} streaming fragments: name one round, or one per fragment"
            )
            raise AuditError(
                f"{len(from_round)} rounds to start from ({round_arg(from_round)}), and the "
                f"run {run}"
            )
        return list(from_round)

    def _layouts(self) -> list[RunLayout]:
        """The node folders of each fragment (the run's own when it is not split)."""
        if self.cfg.fragments == 1:
            return [self.layout]
        return [self.layout.fragment(i) for i in range(self.cfg.fragments)]

    def pruned_from(self) -> FromRound:
        """Where a segment audit of a run whose nodes pruned (``--keep-rounds``) starts:
        the oldest round, no older than any node's pruning marker says it keeps
        (``store.pruned_from``), of which the aggregator has its checkpoint and every
        relay its checkpoint or, if it took no merge of that round, a kept one before, or
        none if it took no merge yet and never pruned (``_load_segment``).  With streaming
        fragments, that round of each fragment whose nodes pruned (None for one whose
        nodes did not: replayed whole), as one round when they agree.  None when no node
        pruned, or no such round is left for some fragment."""
        starts: list[int | None] = []
        for lay in self._layouts():
            marks = _markers(lay)
            if not marks:
                starts.append(None)
                continue
            rounds = _segment_starts(lay, marks)
            if not rounds:
                return None
            starts.append(rounds[0])
        if all(r is None for r in starts):  # no node pruned
            return None
        return starts[0] if len(set(starts)) == 1 else tuple(starts)

    def _markers(self) -> dict[Path, int]:
        """Each node folder (of every fragment) that holds a pruning marker, and the oldest
        round it keeps."""
        return {f: m for lay in self._layouts() for f, m in _markers(lay).items()}

    def _pruned_hint(self) -> str:
        """After a whole-run audit failed: the round a segment audit can start from, when
        nodes pruned their oldest rounds ("" when none did)."""
        try:
            marks = self._markers()
            start = self.pruned_from() if marks else None
        except HypertrainError as e:  # a damaged marker: the error above stands, with this
            return str(e)
        if not marks:
            return ""
        split = self.cfg.fragments > 1  # (a fragment's folder is in its node's)
        names = sorted({f"{f.parent.name}/{f.name}" if split else f.name for f in marks})
        gone = f"{', '.join(names)} pruned their oldest rounds (--keep-rounds)"
        if start is None:
            return f"{gone}, and no round's checkpoints are left on every node"
        return (
            f"{gone}: every node keeps what round {start} starts from, so "
            f"`hypertrain audit --from-round {start}` audits the rounds after it"
            if not isinstance(start, tuple)
            else f"{gone}: every node keeps what rounds {round_arg(start)} (one per fragment, "
            f"-: from its start) start from, so `hypertrain audit --from-round "
            f"{round_arg(start)}` audits the rounds after them"
        )

    def _run(
        self,
        from_round: int | None,
        part: torch.Tensor | None = None,
        whole: ParamLayout | None = None,
    ) -> tuple[AuditReport, torch.Tensor, torch.Tensor | None]:
        """The audit of the run, or of ``self.fragment``'s nodes (``part``: its initial
        values, of the model laid out as ``whole``); the report, the last global state
        replayed and the LAWA average checked (None: the run has none, or has not ended)."""
        cfg, lay = self.cfg, self.layout
        tapes = {AGGREGATOR_KEY: (lay.aggregator, lay.aggregator / "tape")}
        tapes.update({relay_key(r): (d, d / "tape") for r, d in lay.relays.items()})
        verified: dict[str, list[Entry]] = {}
        for signer, (_, path) in tapes.items():
            try:
                report = verify_tape(path, self.trusted, run_id=cfg.run_id, signer=signer)
            except TapeError as exc:
                raise AuditError(str(exc)) from None
            verified[signer] = report.entries
            self.bytes += report.n_bytes
            self.entries += report.n_entries
        ca, ca_source = self.ca, "the CA given (--ca-cert)"
        if ca is None:
            genesis = parse(verified[AGGREGATOR_KEY][0]) if verified[AGGREGATOR_KEY] else None
            ca = genesis.ca if isinstance(genesis, GenesisEntry) else None
            ca_source = "the aggregator's"
        for signer, (_, path) in tapes.items():
            self._check_genesis(signer, path, verified[signer], ca, ca_source)
        checkpoints = {
            signer: self._checkpoint_positions(signer, path, folder, verified[signer])
            for signer, (folder, path) in tapes.items()
        }
        self._files = {
            (signer, f.round): f.path
            for signer, files in checkpoints.items()
            for f in files
            if f.path is not None
        }
        if part is None or whole is None:
            layout, theta0 = initial_parameters(cfg)
        else:
            layout, theta0 = whole, part
        agg = AggregatorMachine(cfg, theta0, self.trusted, self.fragment)
        shards = cfg.shards(theta0.numel())
        relays = {}
        for m in lay.relays:
            region, i = shards.split(m)
            a, b = shards.bounds(i)
            relays[m] = RelayMachine(
                cfg,
                region,
                theta0[a:b],
                self.trusted,
                shard=i,
                model_numel=theta0.numel(),
                fragment=self.fragment,
            )
        starts = {k: 0 for k in tapes}
        if from_round is not None:
            starts = self._load_segment(from_round, agg, relays, verified)
        agg_tape = tapes[AGGREGATOR_KEY][1]
        agg_blobs = PublishedFolder(lay.aggregator / "published")
        agg_replay = AggregatorReplay(
            agg, verified[AGGREGATOR_KEY][starts[AGGREGATOR_KEY] :], agg_blobs
        )
        agg_replay.on_merge = lambda merge: self._compare_live(
            AGGREGATOR_KEY, merge.round, agg.snapshot(copy=False)
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
        for signer, files in checkpoints.items():
            self._check_checkpoint_files(
                signer, tapes[signer][1], verified[signer], files, from_round
            )
        receipts = self._check_receipts({k: p for k, (_, p) in tapes.items()}, verified)
        self.bytes += agg_blobs.bytes + sum(b.bytes for _, _, b in replays.values())
        merges = agg_replay.merges
        if not merges:
            raise AuditError(f"{agg_tape}: no global round after round {from_round}")
        sched = agg.schedule
        first, last = merges[0].round, merges[-1].round
        average = self._check_lawa(agg_tape, agg_replay)
        final = merges[-1].payload
        audited = AuditReport(
            first,
            last,
            sched.global_step_of(first),
            sched.global_step_of(last),
            self.entries,
            self.bytes,
            state_digest(layout.unflatten(final)) if part is None else "",
            rounds=sched.rounds,
            steps=sched.steps,
            segment=from_round is not None,
            receipts=receipts,
            lawa_digest=""
            if average is None or part is not None
            else state_digest(layout.unflatten(average)),
        )
        return audited, final, average

    def _check_lawa(self, agg_tape: Path, replay: AggregatorReplay) -> torch.Tensor | None:
        """A run with LAWA that reached its end taped the average (the replay recomputed
        it and matched the entry), and ``lawa.pt`` holds exactly it; the average (None
        without LAWA or before the end)."""
        average = replay.average
        if not self.cfg.lawa or not replay.machine.done:
            return None
        if average is None:
            raise AuditError(
                f"{agg_tape}: the run's configuration asks for LAWA over its last "
                f"{self.cfg.lawa} global rounds, but the tape has no lawa entry after its last "
                "global merge"
            )
        path = self.layout.aggregator / LAWA_FILE
        if not path.is_file():
            raise AuditError(f"{path}: missing (the tape records the LAWA average it holds)")
        ck = torch.load(path, weights_only=True, mmap=True)
        theta = ck.get("theta") if isinstance(ck, dict) else None
        if not isinstance(theta, torch.Tensor) or not _same(theta, average.payload):
            found = flat_digest(theta) if isinstance(theta, torch.Tensor) else "no parameters"
            raise AuditError(
                f"{path}: not the LAWA average of rounds {average.record.first_round}.."
                f"{average.record.last_round} the tape records (digest {average.record.average}, "
                f"the file holds {found})"
            )
        return average.payload

    def _check_receipts(self, tapes: dict[str, Path], verified: dict[str, list[Entry]]) -> int:
        """Every kept receipt is its signer's, and a head of its signer's tape as it is now
        (module docstring, 4); returns how many were checked."""
        by_signer: dict[str, list[tuple[int, bytes, KeptReceipt]]] = {}
        for path in self.layout.receipts:
            try:
                kept = read_receipts(path)
            except HypertrainError as e:
                raise AuditError(str(e)) from None
            valid = range(self.cfg.fragments) if self.cfg.fragments > 1 else (None,)
            for r in kept:
                if r.fragment not in valid:
                    raise AuditError(
                        f"{r.where}: a receipt of fragment {r.fragment}, which this run "
                        f"({self.cfg.fragments} fragments) does not keep a tape of"
                    )
                if r.fragment != self.fragment:
                    continue  # another fragment's tape: checked with that fragment
                if r.signer not in tapes:
                    raise AuditError(
                        f"{r.where}: a receipt of {r.signer!r}, which keeps no tape in this run"
                    )
                try:
                    cp = open_receipt(r.raw, self.trusted, self.cfg.run_id, r.signer)
                except TapeError as e:
                    raise AuditError(
                        f"{r.where}: {r.holder}'s receipt of {r.signer} for step {r.step} is "
                        f"not valid evidence: {e}"
                    ) from None
                by_signer.setdefault(r.signer, []).append((cp.size, cp.root, r))
        n = 0
        for signer, heads in by_signer.items():
            entries = verified[signer]
            heads.sort(key=lambda h: h[0])
            log, at = merkle.MerkleLog(), 0
            for size, root, r in heads:
                problem = None
                if size > len(entries):
                    problem = f"the tape ends at {len(entries)} entries, the head covers {size}"
                else:
                    while at < size:
                        log.append(entries[at].leaf)
                        at += 1
                    if log.root() != root:
                        problem = (
                            f"its first {size} entries are not the ones {signer} signed then "
                            "(rewritten after the receipt was handed out)"
                        )
                if problem is not None:
                    raise AuditError(
                        f"fork: {signer}'s tape disagrees with the head {r.holder} received at "
                        f"step {r.step}: {problem} ({tapes[signer]}; receipt {r.where})"
                    )
                n += 1
        return n

    def _check_genesis(
        self, signer: str, tape: Path, entries: list[Entry], ca: str | None, ca_source: str
    ) -> None:
        """Each tape starts with its node's genesis entry: the aggregator's records the
        configuration the audit replays with (so ``run.toml`` must be it), a relay's refers
        to the same, and all pinned the keys the audit pins and the run CA ``ca``."""
        where = f"{tape} entry 0"
        first = parse(entries[0]) if entries else None
        if not isinstance(first, GenesisEntry):
            raise AuditError(
                f"{where}: a tape must start with its node's genesis entry (the run's "
                "configuration); this one does not (a tape from an older version, or cut)"
            )
        relay = signer != AGGREGATOR_KEY
        member = next((m for m in self.layout.relays if relay_key(m) == signer), None)
        role = "relay" if relay else "aggregator"
        want = GenesisEntry.of(self.cfg, role, member, self.trusted, ca, self.fragment)
        if not relay and first.config is not None and first.config != want.config:
            try:
                taped = json.loads(first.config)
            except ValueError:
                taped = None
            field = _first_difference(json.loads(str(want.config)), taped)
            raise AuditError(
                f"{where} (genesis): the configuration the run started with differs from "
                f"{self.layout.run_toml_name} at {field}: the audit checks every entry "
                "against the genesis, and this run folder's configuration is not it"
            )
        field = want.first_difference(first)
        if field == "ca":
            raise AuditError(
                f"{where} (genesis): the run CA this node pinned "
                f"({first.ca or 'none: plaintext'}) is not {ca_source} ({ca or 'none'})"
            )
        if field == "keys":
            raise AuditError(
                f"{where} (genesis): the keys this node pinned are not the ones the audit "
                f"pins (first difference: {_first_difference(want.keys, first.keys)})"
            )
        if field is not None:
            raise AuditError(
                f"{where} (genesis): recomputed {field} differs: the tape has "
                f"{getattr(first, field)}, the run's configuration gives {getattr(want, field)}"
            )

    def _interleave(
        self,
        agg_tape: Path,
        agg: AggregatorReplay,
        relays: dict[str, tuple[Path, RelayReplay, PublishedFolder]],
    ) -> None:
        """Each relay's tape up to its next global update, then the aggregator's up to that
        round's merge, whose parameters every relay then applies; until the tapes end.

        The relays' replays are independent until the global merge they wait for, so they
        run side by side, one thread each up to the number of cores (their arithmetic and
        hashing leave the interpreter lock); a failure is reported for the first relay in
        member order that failed, so the verdict does not depend on timing."""
        workers = self.threads or max(1, min(len(relays), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="audit") as pool:
            while self._interleave_round(agg_tape, agg, relays, pool):
                pass

    def _interleave_round(
        self,
        agg_tape: Path,
        agg: AggregatorReplay,
        relays: dict[str, tuple[Path, RelayReplay, PublishedFolder]],
        pool: ThreadPoolExecutor,
    ) -> bool:
        """One round of ``_interleave``; False once the relays' tapes are done."""
        wants: dict[str, int] = {}
        got = pool.map(_advance, [rr for _, rr, _ in relays.values()])
        for (member, (tape, _, _)), step in zip(relays.items(), got, strict=True):
            if isinstance(step, ReplayError):
                raise self._fail(tape, step) from None
            if step is not None:
                wants[member] = step
        if not wants:
            return False
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
                applied = rr.apply_global(
                    GlobalArrived(step, part.payload, part.commitment, part.payload_digest)
                )
            except ReplayError as err:
                raise self._fail(tape, err) from None
            with contextlib.suppress(HypertrainError):  # not between rounds: hashed later
                self._compare_live(relay_key(member), applied.round, rr.machine.snapshot())
        return True

    def _check_forwards(
        self,
        agg_tape: Path,
        agg: AggregatorReplay,
        relays: dict[str, tuple[Path, RelayReplay, PublishedFolder]],
    ) -> None:
        """Every regional delta the aggregator took is what that relay (or relay shard)
        forwarded (as the relay's replay recomputed it).  A relay tapes its forward before
        it pushes, so an input whose forward is not on the relay's tape (a relay tape cut
        shorter than the aggregator's) fails too."""
        for (step, region), rec in agg.received.items():
            if region not in relays:
                raise AuditError(f"{agg_tape}: input for step {step} from {region}, not a relay")
            forwarded = relays[region][1].forwards.get(step)
            if forwarded is None:
                raise AuditError(
                    f"{agg_tape}: input from {region} for step {step} has no forward on relay "
                    f"{region}'s tape ({relays[region][0]})"
                )
            if forwarded.record.digest != rec.digest:
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
        path = checkpoint_path(self.layout.aggregator, round_)
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
        snap = AggregatorSnapshot(merge.sync_step, theta, ck["outer"], ck.get("lawa"))
        try:
            agg.restore(snap, prior)
        except HypertrainError as e:
            raise AuditError(f"{path}: {e}") from None
        starts = {AGGREGATOR_KEY: start}
        shards = self.cfg.shards(theta.numel())
        for region, folder in self.layout.relays.items():  # each relay by its member id
            a, b = shards.bounds(shards.split(region)[1])
            part = theta.view(-1)[a:b] if shards.sharded else theta
            # Its checkpoint of the round; or, for a relay that applied no merge of it (its
            # region was left out at a cutoff, or followed: it rejoins later), its newest
            # before, if it applied nothing between (its state then is its state now).
            rentries = verified[relay_key(region)]
            kept = checkpoints_of(folder)
            older = [r for r in kept if r <= round_]
            rpath = kept[older[-1]] if older else None
            rck = torch.load(rpath, weights_only=True) if rpath is not None else {}
            seq = int(rck.get("tape_seq", 0))  # none: it took no merge yet, replayed whole
            since = [
                r
                for r in records(rentries[seq:])
                if isinstance(r, GlobalAppliedEntry) and r.round <= round_
            ]
            if since:
                raise AuditError(
                    f"no relay checkpoint of {region} for round {round_} "
                    f"({checkpoint_path(folder, round_)}), and it applied round {since[0].round} "
                    f"after {'its start' if rpath is None else rpath.name}"
                )
            if rpath is None:
                starts[relay_key(region)] = 0
                continue
            if rck.get("format") != CHECKPOINT_FORMAT:
                raise AuditError(
                    f"{rpath}: a relay checkpoint of an older format; cannot audit from it"
                )
            taped = records(rentries[:seq])
            residual = _residual_left(rentries, seq, part.numel())
            at: GlobalMergeEntry | None = merge
            if older[-1] != round_:  # the aggregator's merge of that round, from its tape
                at = next(
                    (r for r in prior if isinstance(r, GlobalMergeEntry) and r.round == older[-1]),
                    None,
                )
            if at is None:
                raise AuditError(f"{rpath}: the aggregator's tape has no round {older[-1]}")
            applied = [
                r
                for r in taped
                if isinstance(r, GlobalAppliedEntry) and r.sync_step == at.sync_step
            ]
            if older[-1] == round_:
                same = torch.equal(rck["theta"], part)
            else:  # its applied entry's, and (one relay per region) the aggregator's
                digest = flat_digest(rck["theta"])
                same = bool(applied) and applied[-1].theta == digest
                same = same and (shards.sharded or digest == at.post_state)
                part = rck["theta"]
            if not applied or not same or int(rck["sync_step"]) != at.sync_step:
                raise AuditError(f"{rpath}: relay checkpoint does not match round {older[-1]}")
            if residual != stored_residual_digest(rck["residual"], part.numel()):
                raise AuditError(f"{rpath}: error-feedback state does not match the tape")
            rsnap = RelaySnapshot(
                at.sync_step,
                part,
                rck["residual"],
                Commitment.from_dict(json.loads(rck["commitment"])),
            )
            relays[region].restore(rsnap, taped)
            starts[relay_key(region)] = seq
        return starts


def round_arg(rounds: FromRound) -> str:
    """``rounds`` as ``--from-round`` takes it: ``R``, or ``R0,R1,...`` per streaming
    fragment (``-``: that fragment from its start)."""
    if not isinstance(rounds, tuple):
        return "-" if rounds is None else str(rounds)
    return ",".join("-" if r is None else str(r) for r in rounds)


def parse_rounds(text: str) -> FromRound:
    """``--from-round``'s value (``round_arg``'s form); ValueError naming what is wrong."""
    parts = [p.strip() for p in text.split(",")]
    try:
        rounds = tuple(None if p == "-" else int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"{text!r}: a global round, or one per streaming fragment (R0,R1,...; - for a "
            "fragment from its start)"
        ) from None
    if any(r is not None and r < 0 for r in rounds):
        raise ValueError(f"{text!r}: a round is 0 or more")
    return rounds[0] if len(rounds) == 1 else rounds


def _markers(lay: RunLayout) -> dict[Path, int]:
    """Each node folder of ``lay`` that holds a pruning marker, and the oldest round it keeps."""
    folders = (lay.aggregator, *lay.relays.values())
    return {f: m for f in folders if (m := store_pruned_from(f)) is not None}


def _segment_starts(lay: RunLayout, marks: dict[Path, int]) -> list[int]:
    """The rounds, oldest first, from which a segment audit of ``lay``'s nodes can start
    (``Auditor.pruned_from``); ``marks``: their pruning markers (``_markers``)."""
    floor = max(marks.values(), default=0)
    relays = {folder: list(checkpoints_of(folder)) for folder in lay.relays.values()}
    return [
        r
        for r in checkpoints_of(lay.aggregator)
        if r >= floor
        and all(
            any(marks.get(folder, 0) <= x <= r for x in rounds)
            or (folder not in marks and not any(x <= r for x in rounds))
            for folder, rounds in relays.items()
        )
    ]


def _residual_left(entries: list[Entry], end: int, numel: int) -> str:
    """The digest of a relay's error feedback after its first ``end`` entries: what its last
    forward left (a relay that rejoined after a cutoff, or followed the rounds of an empty
    region, forwarded nothing in that round, and ``RelayMachine.on_global`` keeps the
    residual), or ``numel`` zeros if it never forwarded."""
    for i in range(min(end, len(entries)) - 1, -1, -1):
        if entries[i].kind == ForwardEntry.KIND:
            return str(entries[i].body["post_residual"])
    return zeros_digest(numel)


def audit_run(
    run_dir: Path,
    trusted: TrustedKeys,
    from_round: FromRound = None,
    receipts: tuple[Path, ...] = (),
    ca_cert: Path | None = None,
    threads: int | None = None,
) -> AuditReport:
    """Audit the run in ``run_dir`` (its daemons' receipts, and those under ``receipts``);
    ``ca_cert``: the run CA's certificate, which every tape's genesis must pin;
    ``threads``: relays replayed side by side (``Auditor``)."""
    ca = None
    if ca_cert is not None:
        try:
            ca = fingerprint(ca_cert.read_bytes())
        except (OSError, ValueError) as e:
            raise HypertrainError(f"{ca_cert}: not a readable PEM certificate ({e})") from None
    return Auditor(RunLayout.of(run_dir, receipts), trusted, ca, threads).run(from_round)


def iter_rounds(run_dir: Path) -> Iterator[int]:
    """Global rounds that have an aggregator checkpoint (segment starts)."""
    yield from checkpoints_of(run_dir / "aggregator")
