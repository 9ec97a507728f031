"""The auditor: verify the tapes and replay every merge from the published inputs.

    report = audit_run(RunLayout.of(run_dir), trusted, from_round=None)

Steps, each failure naming the first bad entry and why:
1. Every tape (the aggregator's and each relay's) verifies: framing, every
   signature against the pinned keys, sequence, hash chain, checkpoints
   (common/trust/tape_verify.py), and was signed by the daemon it belongs to.
2. Replay, global round by global round, with the core's own functions:
   - each relay's accepted inputs: the island's signature over the transfer,
     the published blob present and unchanged (sha256);
   - each regional merge: members = the accepted inputs, step pinned
     (merge_step = sync_step + tau), the fixed-order aggregate recomputed from
     the published inputs (output and commitment digests), the regional base
     before and after;
   - each forward: the relay's delta recomputed (theta - base through the global
     codec with the relay's error feedback) and equal to what the aggregator
     published and accepted under the relay's signature;
   - each global merge: the aggregate over regions recomputed, one outer step
     replayed, theta and the outer state digests before and after.
3. A segment audit starts from the checkpoints of a global round (the
   aggregator's parameters and outer state, each relay's error feedback), after
   checking them against the tape entry of that round.

On CPU the replay is bit-exact: the daemons computed the same functions.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hypertrain.common.aggregate import Blob, Commitment, aggregate
from hypertrain.common.codec import ErrorFeedback, make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import state_digest
from hypertrain.common.errors import HypertrainError, TapeError
from hypertrain.common.outer import make_outer
from hypertrain.common.roles import initial_parameters, round_of_step
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.ledger import (
    AGGREGATOR_KEY,
    flat_digest,
    island_key,
    outer_state_digest,
    relay_key,
    transfer_message,
)
from hypertrain.common.trust.tape import Entry, verify_tape


class AuditError(HypertrainError):
    """The audit found a problem; the message names the first bad entry and why."""


@dataclass(frozen=True, slots=True)
class _Input:
    """An accepted input of a merge: its tape entry, its published file, its bytes."""

    entry: Entry
    path: Path
    data: Blob


def map_file(path: Path) -> Blob:
    """A read-only view of a file's bytes: its page cache mapped, not copied (a replay
    reads hundreds of MB of published inputs; copying them costs as much as hashing)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""
        flags = getattr(mmap, "MAP_POPULATE", 0) | mmap.MAP_SHARED
        return memoryview(mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ))


@dataclass(frozen=True, slots=True)
class RunLayout:
    """Where a run's tapes, published inputs and checkpoints are."""

    config: RunConfig
    aggregator: Path
    relays: dict[str, Path]

    @classmethod
    def of(cls, run_dir: Path) -> RunLayout:
        cfg = RunConfig.from_toml(run_dir / "run.toml")
        relays = {r: run_dir / f"relay-{r}" for r in sorted(cfg.topology.regions)}
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


def _where(tape: Path, e: Entry) -> str:
    step = e.body.get("sync_step")
    return f"{tape} entry {e.seq} ({e.kind}{f', step {step}' if step is not None else ''})"


class _Stream:
    """One tape's merge-relevant entries after a position, consumed in order."""

    def __init__(self, path: Path, entries: list[Entry], start_seq: int) -> None:
        self.path = path
        self.items = [
            e for e in entries if e.seq >= start_seq and e.kind not in ("checkpoint", "rejection")
        ]
        self.pos = 0

    def next(self, kind: str) -> Entry:
        if self.pos >= len(self.items):
            raise AuditError(f"{self.path}: tape ends where a {kind} entry was expected")
        e = self.items[self.pos]
        if e.kind != kind:
            raise AuditError(f"{_where(self.path, e)}: expected a {kind} entry here")
        self.pos += 1
        return e

    def peek_kind(self) -> str | None:
        return self.items[self.pos].kind if self.pos < len(self.items) else None


class Auditor:
    """Replays a run (or a segment of it) and checks every recorded digest."""

    def __init__(self, layout: RunLayout, trusted: TrustedKeys) -> None:
        self.layout = layout
        self.cfg = layout.config
        self.trusted = trusted
        self.bytes = 0
        self.entries = 0
        # Digests of state the replay has not changed since it last digested it: one
        # entry's "post" is the next one's "pre", so each is computed once.
        self._theta_digest: str | None = None
        self._outer_digest: str | None = None
        self._residual_digests: dict[str, str] = {}
        self._base: torch.Tensor | None = None  # a region's base, reused round after round

    # -- helpers ------------------------------------------------------------------
    def _fail(self, tape: Path, e: Entry, why: str) -> AuditError:
        return AuditError(f"{_where(tape, e)}: {why}")

    def _expect(self, tape: Path, e: Entry, field: str, got: Any) -> None:
        want = e.body.get(field)
        if want != got:
            raise self._fail(
                tape, e, f"recomputed {field} differs: tape has {want}, replay gives {got}"
            )

    def _pinned(self, tape: Path, e: Entry, interval: int) -> None:
        b, tau = e.body, self.cfg.topology.tau
        s = b["sync_step"]
        if (
            s % interval
            or b.get("merge_step", s + tau) != s + tau
            or b["round"] != round_of_step(self.cfg, s)
        ):
            raise self._fail(
                tape,
                e,
                f"step not pinned: sync_step {s}, merge_step {b.get('merge_step')}, tau {tau}",
            )

    def _input(self, tape: Path, folder: Path, e: Entry, signer: str) -> _Input:
        """A recorded input: signed by the sender, its blob present (mapped, not read).

        Its sha256 is checked by :meth:`_aggregate`, which hashes each input once
        anyway (the commitment's input digests)."""
        b = e.body
        message = transfer_message(
            self.cfg.run_id,
            b["round"],
            b["sync_step"],
            b["sender"],
            b["digest"],
            b["size"],
            b["codec"],
        )
        try:
            good = self.trusted.verify(signer, message, bytes.fromhex(b["signature"]))
        except (HypertrainError, ValueError) as exc:
            raise self._fail(tape, e, f"input signature cannot be checked: {exc}") from None
        if not good:
            raise self._fail(tape, e, f"bad signature on the input from {b['sender']}")
        path = folder / "published" / b["digest"]
        if not path.is_file():
            raise self._fail(tape, e, f"missing input {b['digest']} from {b['sender']} ({path})")
        data = map_file(path)
        self.bytes += len(data)
        return _Input(e, path, data)

    def _aggregate(
        self, tape: Path, inputs: dict[str, _Input], codec: Any, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, Commitment]:
        """``aggregate`` of the inputs' bytes, each blob's sha256 checked against its entry.

        The commitment's input digests are the sha256 of the bytes aggregated, so a
        changed blob is named from them; one that no longer decodes is found by
        hashing the inputs after the error."""
        blobs = {sender: x.data for sender, x in inputs.items()}
        try:
            mean, commitment = aggregate(blobs, codec, shape)
        except HypertrainError:
            for x in inputs.values():
                self._check_unchanged(tape, x, hashlib.sha256(x.data).hexdigest())
            raise
        for x, digest in zip(
            (inputs[m] for m in commitment.members), commitment.input_digests, strict=True
        ):
            self._check_unchanged(tape, x, digest)
        return mean, commitment

    def _check_unchanged(self, tape: Path, x: _Input, digest: str) -> None:
        if digest != x.entry.body["digest"]:
            raise self._fail(
                tape,
                x.entry,
                f"changed input: {x.path} no longer has sha256 {x.entry.body['digest']}",
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
        self._theta_digest, self._outer_digest, self._residual_digests = None, None, {}
        self._base = None
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
            self._check_reaches_latest_checkpoint(path, tapes[signer][0], report.entries)
        layout, theta = initial_parameters(cfg)
        outer = make_outer(cfg.outer)
        gcodec = make_codec(cfg.global_codec)
        feedback = {r: ErrorFeedback(gcodec, theta.numel(), beta=cfg.ef_beta) for r in lay.relays}
        starts = {k: 0 for k in tapes}
        first = 0
        if from_round is not None:
            theta, starts = self._load_segment(from_round, outer, feedback, verified)
            first = from_round + 1
        agg_path = tapes[AGGREGATOR_KEY][1]
        agg = _Stream(agg_path, verified[AGGREGATOR_KEY], starts[AGGREGATOR_KEY])
        relays = {
            r: _Stream(tapes[relay_key(r)][1], verified[relay_key(r)], starts[relay_key(r)])
            for r in lay.relays
        }
        last = first - 1
        while agg.peek_kind() is not None:
            theta = self._global_round(theta, outer, feedback, agg, relays)
            last += 1
        if last < first:
            raise AuditError(f"{agg_path}: no global round after round {from_round}")
        return AuditReport(
            first,
            last,
            (first + 1) * cfg.topology.h_g,
            (last + 1) * cfg.topology.h_g,
            self.entries,
            self.bytes,
            state_digest(layout.unflatten(theta)),
        )

    def _global_round(
        self,
        theta: torch.Tensor,
        outer: Any,
        feedback: dict[str, ErrorFeedback],
        agg: _Stream,
        relays: dict[str, _Stream],
    ) -> torch.Tensor:
        cfg, topo = self.cfg, self.cfg.topology
        rcodec, gcodec = make_codec(cfg.regional_codec), make_codec(cfg.global_codec)
        forwarded: dict[str, str] = {}
        theta_digest = self._theta_digest or flat_digest(theta)
        if self._base is None:
            self._base = torch.empty_like(theta)
        base = self._base
        for region, stream in relays.items():
            base_digest = theta_digest  # the region's base starts as theta
            folder = self.layout.relays[region]
            merged = False
            while True:
                inputs: dict[str, _Input] = {}
                digests: dict[str, str] = {}  # recorded sha256 of each input
                while stream.peek_kind() == "input":
                    e = stream.next("input")
                    sender = e.body["sender"]
                    inputs[sender] = self._input(stream.path, folder, e, island_key(sender))
                    digests[sender] = e.body["digest"]
                m = stream.next("regional_merge")
                self._pinned(stream.path, m, topo.h_r)
                if [x[0] for x in m.body["members"]] != sorted(inputs) or digests != dict(
                    m.body["members"]
                ):
                    raise self._fail(stream.path, m, "members differ from the accepted inputs")
                self._expect(stream.path, m, "pre_base", base_digest)
                mean, commitment = self._aggregate(stream.path, inputs, rcodec, tuple(theta.shape))
                self._expect(stream.path, m, "mean", commitment.output_digest)
                self._expect(stream.path, m, "commitment", commitment.digest)
                if merged:
                    base.sub_(mean)
                else:  # base = theta - mean, without a copy of theta first
                    torch.sub(theta, mean, out=base)
                    merged = True
                base_digest = flat_digest(base)
                self._expect(stream.path, m, "post_base", base_digest)
                if m.body["sync_step"] % topo.h_g == 0:
                    break
            f = stream.next("forward")
            ef = feedback[region]
            pre_residual = self._residual_digests.get(region) or flat_digest(ef.residual)
            self._expect(stream.path, f, "pre_residual", pre_residual)
            blob = ef.encode(torch.sub(theta, base, out=base))  # theta - base; base is done
            self._expect(stream.path, f, "digest", hashlib.sha256(blob).hexdigest())
            self._residual_digests[region] = flat_digest(ef.residual)
            self._expect(stream.path, f, "post_residual", self._residual_digests[region])
            forwarded[region] = f.body["digest"]
        global_inputs: dict[str, _Input] = {}
        while agg.peek_kind() == "input":
            e = agg.next("input")
            region = e.body["sender"]
            global_inputs[region] = self._input(
                agg.path, self.layout.aggregator, e, relay_key(region)
            )
            if forwarded.get(region) != e.body["digest"]:
                raise self._fail(
                    agg.path, e, f"input from {region} is not what relay {region} forwarded"
                )
        g = agg.next("global_merge")
        self._pinned(agg.path, g, topo.h_g)
        if sorted(global_inputs) != sorted(topo.regions):
            raise self._fail(agg.path, g, f"members {sorted(global_inputs)} are not every region")
        self._expect(agg.path, g, "pre_state", theta_digest)
        pre_outer = self._outer_digest or outer_state_digest(outer.state_dict())
        self._expect(agg.path, g, "pre_outer", pre_outer)
        mean, commitment = self._aggregate(agg.path, global_inputs, gcodec, tuple(theta.shape))
        self._expect(agg.path, g, "mean", commitment.output_digest)
        self._expect(agg.path, g, "commitment", commitment.digest)
        outer.step(theta, mean)  # in place: theta is the replay's own (initial or loaded)
        self._theta_digest = flat_digest(theta)
        self._expect(agg.path, g, "post_state", self._theta_digest)
        self._outer_digest = outer_state_digest(outer.state_dict())
        self._expect(agg.path, g, "post_outer", self._outer_digest)
        for stream in relays.values():
            a = stream.next("global_applied")
            self._expect(stream.path, a, "theta", self._theta_digest)
        return theta

    def _load_segment(
        self,
        round_: int,
        outer: Any,
        feedback: dict[str, ErrorFeedback],
        verified: dict[str, list[Entry]],
    ) -> tuple[torch.Tensor, dict[str, int]]:
        """Start from the checkpoints of global round ``round_``, checked against the tapes."""
        name = f"round-{round_:06d}.pt"
        path = self.layout.aggregator / "checkpoints" / name
        if not path.is_file():
            raise AuditError(f"no aggregator checkpoint for round {round_} ({path})")
        ck = torch.load(path, weights_only=True)
        theta = ck["theta"]
        starts = {AGGREGATOR_KEY: int(ck["tape_seq"])}
        merges = [
            e
            for e in verified[AGGREGATOR_KEY]
            if e.kind == "global_merge" and e.body["round"] == round_
        ]
        if (
            not merges
            or merges[0].body["post_state"] != flat_digest(theta)
            or merges[0].seq >= starts[AGGREGATOR_KEY]
        ):
            raise AuditError(
                f"{path}: checkpoint does not match the tape's global merge of round {round_}"
            )
        if outer_state_digest(ck["outer"]) != merges[0].body["post_outer"]:
            raise AuditError(f"{path}: outer optimizer state does not match the tape")
        outer.load_state_dict(ck["outer"])
        for region, folder in self.layout.relays.items():
            rpath = folder / "checkpoints" / name
            if not rpath.is_file():
                raise AuditError(f"no relay checkpoint of {region} for round {round_} ({rpath})")
            rck = torch.load(rpath, weights_only=True)
            entries = verified[relay_key(region)]
            seq = int(rck["tape_seq"])
            applied = [
                e for e in entries if e.kind == "global_applied" and e.body["round"] == round_
            ]
            if not applied or applied[0].seq >= seq or not torch.equal(rck["theta"], theta):
                raise AuditError(f"{rpath}: relay checkpoint does not match round {round_}")
            forwards = [e for e in entries if e.kind == "forward" and e.body["round"] == round_]
            if not forwards or forwards[0].body["post_residual"] != flat_digest(rck["residual"]):
                raise AuditError(f"{rpath}: error-feedback state does not match the tape")
            feedback[region].load_state_dict(
                {"residual": rck["residual"], "beta": self.cfg.ef_beta}
            )
            starts[relay_key(region)] = seq
        return theta, starts


def audit_run(run_dir: Path, trusted: TrustedKeys, from_round: int | None = None) -> AuditReport:
    return Auditor(RunLayout.of(run_dir), trusted).run(from_round)


def iter_rounds(run_dir: Path) -> Iterator[int]:
    """Global rounds that have an aggregator checkpoint (segment starts)."""
    for p in sorted((run_dir / "aggregator" / "checkpoints").glob("round-*.pt")):
        yield int(p.stem.split("-")[1])
