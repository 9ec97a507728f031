"""The transport contract, run against both transports, and the relay's Status round.

One set of assertions about ``Upstream`` (common/rounds/transport.py), each run twice:

- ``in-process``: ``LocalUpstream`` on a ``RelayNode`` with a real ``NodeStore``;
- ``grpc``: ``GrpcUpstream`` to a ``RelayService`` served on loopback in this process,
  whose aggregator is an ``AggregatorService`` served here too.

Every refusal is compared with what a bare ``RelayMachine`` decides for the same input:
a transport carries the machine's decision (code and reason) unchanged.  One thing is
not carried: the reason of an acceptance (gRPC's PushAck has no reason field, so
``GrpcUpstream.push`` answers "accepted"), so acceptances are compared by code and
``duplicate`` only.  Transfers that are not what they say (bytes that are not their
digest, a size no encoding has) are refused with the same Decision on both: the gRPC
transport while the chunks arrive, the in-process one before the node sees the delta.
No timing asserts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hypertrain.aggregator.server import AggregatorService
from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest, tensor_digest
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.machines import (
    CONFLICT,
    CORRUPT,
    INVALID,
    OK,
    PRECONDITION,
    TOO_LARGE,
    Committed,
    Decision,
    Delta,
    RelayMachine,
)
from hypertrain.common.rounds.node import FORBIDDEN, RelayNode
from hypertrain.common.rounds.store import NodeStore
from hypertrain.common.rounds.transport import LocalUpstream, Upstream
from hypertrain.common.schedule import Schedule
from hypertrain.relay.server import RelayService
from hypertrain.wire import rounds
from hypertrain.wire.peers import Peer
from hypertrain.wire.server import Shutdown, add_servicer, bind, make_server
from hypertrain.wire.upstream import GrpcUpstream, Patient

CFG = RunConfig.from_dict(
    {
        "run_id": "contract",
        "steps": 20,
        "batch_per_island": 8,
        "holdout_windows": 1,  # the served aggregator evaluates theta0 on start
        "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)
SCHEDULE = Schedule.of(CFG)
CODEC = make_codec(CFG.regional_codec)
STEP = 5  # the relay's first open (regional) sync step
TRANSPORTS = ["in-process", "grpc"]


@functools.cache
def theta0() -> torch.Tensor:
    return initial_parameters(CFG)[1]


@functools.cache
def _blob(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(CODEC.encode(torch.randn(theta0().numel(), generator=g) * 1e-3))


def delta(island: str, step: int = STEP, seed: int | None = None, **changes: Any) -> Delta:
    """A valid delta of ``island`` for ``step`` (its bytes fixed by ``seed``), with
    ``changes`` to its fields applied (new ``data`` gets its digest unless one is given)."""
    data = _blob(int(island[-1]) if seed is None else seed)
    d = Delta.of(CFG.run_id, step, island, str(CODEC.spec), data, SCHEDULE)
    if "data" in changes and "digest" not in changes:
        changes["digest"] = blob_digest(changes["data"])
    return dataclasses.replace(d, **changes)


def machine_after(*deltas: Delta) -> RelayMachine:
    """A bare relay machine that was fed ``deltas`` (the reference for every decision)."""
    m = RelayMachine(CFG, "eu", theta0())
    for d in deltas:
        m.on_delta(d)
    return m


# -- the two transports -------------------------------------------------------------------
@dataclass
class Served:
    """A RelayService of region eu and its AggregatorService, each on its own server."""

    relay: RelayService
    aggregator: AggregatorService
    relay_address: str
    aggregator_address: str


def _serve(stack: contextlib.ExitStack, servicer: object, service: str) -> str:
    server = make_server(max_workers=8)
    add_servicer(servicer, server, service)
    address = bind(server, "127.0.0.1:0")
    server.start()
    stack.callback(lambda: server.stop(0).wait())
    return address


@contextlib.contextmanager
def served(cfg: RunConfig, folder: Path) -> Iterator[Served]:
    """Real daemons' servicers on loopback; stopped (and their threads ended) on exit."""
    with contextlib.ExitStack() as stack:
        agg_stop = Shutdown()
        aggregator = AggregatorService(cfg, folder / "aggregator", agg_stop)
        stack.callback(aggregator.close)
        stack.callback(agg_stop.request, "test over")
        agg_address = _serve(stack, aggregator, "Aggregator")
        agg_peer = Peer(agg_address, "Aggregator")
        stack.callback(agg_peer.close)
        relay_stop = Shutdown()
        relay = RelayService(cfg, "eu", folder / "relay", agg_peer, relay_stop)
        stack.callback(relay.close)
        stack.callback(relay_stop.request, "test over")  # ends a forwarder still waiting
        relay_address = _serve(stack, relay, "Relay")
        yield Served(relay, aggregator, relay_address, agg_address)


@dataclass
class Transport:
    name: str
    upstream: Upstream
    folder: Path
    """The relay's state folder (published/, spool/)."""
    served: Served | None = None

    def published(self) -> list[str]:
        return sorted(p.name for p in (self.folder / "published").iterdir())

    def spooled(self) -> list[str]:
        return sorted(p.name for p in (self.folder / "spool").iterdir())


@contextlib.contextmanager
def open_transport(name: str, folder: Path) -> Iterator[Transport]:
    if name == "in-process":
        store = NodeStore(folder / "relay", CFG.run_id, None)
        node = RelayNode(CFG, "eu", theta0(), store, None)
        try:
            yield Transport(name, LocalUpstream(node), folder / "relay")
        finally:
            node.close()
        return
    with served(CFG, folder) as s:
        peer = Peer(s.relay_address, "Relay")
        try:
            upstream = GrpcUpstream(peer, CFG.run_id, theta0().numel())
            yield Transport(name, upstream, folder / "relay", s)
        finally:
            peer.close()


@pytest.fixture(autouse=True)
def short_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A served fetch of a merge not committed yet is held this long, then "not yet"."""
    monkeypatch.setattr(rounds, "HOLD_S", 0.2)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Transport]:
    with open_transport(request.param, tmp_path / request.param) as t:
        yield t


# -- pushes -------------------------------------------------------------------------------
def test_a_push_is_accepted_and_an_identical_resend_is_a_duplicate(transport: Transport) -> None:
    up, d = transport.upstream, delta("eu-0")
    first = up.push(d)
    assert (first.code, first.accepted, first.duplicate) == (OK, True, False), first
    again = up.push(d)
    assert (again.code, again.accepted, again.duplicate) == (OK, True, True), again
    assert transport.published() == [d.digest]  # kept once
    assert not up.push(delta("eu-1")).duplicate  # the step commits
    after = up.push(d)  # a resend after the commit is still a duplicate
    assert (after.code, after.duplicate) == (OK, True)
    assert transport.published() == sorted([d.digest, delta("eu-1").digest])
    assert transport.spooled() == []


def test_different_bytes_for_the_same_step_and_sender_conflict(transport: Transport) -> None:
    up, d = transport.upstream, delta("eu-0")
    assert up.push(d).accepted
    other = delta("eu-0", seed=7)
    got = up.push(other)
    assert got == machine_after(d).on_delta(other)[0]
    assert got == Decision(CONFLICT, f"eu-0 already delivered different bytes for step {STEP}")
    assert up.push(d).duplicate  # the conflicting push changed nothing
    assert transport.published() == [d.digest] and transport.spooled() == []


def test_a_push_for_a_step_ahead_is_not_now(transport: Transport) -> None:
    up, ahead = transport.upstream, delta("eu-0", step=2 * STEP)
    got = up.push(ahead)
    assert got == machine_after().on_delta(ahead)[0]
    assert got == Decision(PRECONDITION, f"step {2 * STEP} is ahead of the open step {STEP}")
    assert transport.published() == []
    assert up.push(delta("eu-0")).accepted  # nothing was taken: the open step still is


REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "wrong run": ({"run_id": "other-run"}, "wrong run: 'other-run', this relay of eu serves"),
    "non-member": ({"sender": "us-0"}, "'us-0' is not a member here (members: eu-0, eu-1)"),
    "wrong codec": ({"codec": "fp32"}, "wrong codec 'fp32', this run uses int8"),
    "corrupt blob": ({"data": b"HTCD" + bytes(60)}, f"rejected delta from eu-0 for step {STEP}"),
    "wrong shape": ({"data": bytes(CODEC.encode(torch.zeros(100)))}, "shape"),
    "not a sync step": ({"sync_step": 7}, "step 7 is not a sync step"),
    "wrong round": ({"round": 1}, f"round 1 does not match sync step {STEP}"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_delta_is_refused_invalid_naming_the_problem(transport: Transport, case: str) -> None:
    changes, words = REFUSALS[case]
    up, bad = transport.upstream, delta("eu-0", **changes)
    got = up.push(bad)
    assert got.code == INVALID and words in got.reason, got
    assert got == machine_after().on_delta(bad)[0]  # the machine's words, unchanged
    assert transport.published() == [] and transport.spooled() == []
    good = up.push(delta("eu-0"))  # nothing was taken
    assert good.accepted and not good.duplicate


# -- transfers that are not what they say -------------------------------------------------
#: A delta whose bytes are not the ones its digest names.  gRPC verifies the digest while
#: receiving (wire/chunks.py receive_delta); the in-process transport checks the same
#: before the node sees it (transport.transfer_refusal).  Both answer with a Decision.
MISMATCHED: dict[str, tuple[str, str, str]] = {
    # case: (digest, the answer's code, words of its reason)
    "wrong digest": (blob_digest(b"other bytes"), CORRUPT, "corrupt transfer: digest"),
    "digest not hex": ("../../escaped", INVALID, "is not 64 lowercase hex digits"),
}


@pytest.mark.parametrize("case", list(MISMATCHED))
def test_a_delta_whose_bytes_are_not_its_digest_is_never_taken(
    transport: Transport, case: str
) -> None:
    """Not accepted, nothing published (anywhere), and the sender's real delta is accepted
    afterwards; the same code and words on both transports."""
    digest, code, words = MISMATCHED[case]
    good = delta("eu-1")
    bad = dataclasses.replace(good, digest=digest)
    got = transport.upstream.push(bad)
    escaped = transport.folder.parent / "escaped"
    assert not got.accepted, got
    assert (got.code, words in got.reason) == (code, True), got
    assert transport.published() == [] and not escaped.exists()
    taken = transport.upstream.push(good)
    assert taken.accepted and not taken.duplicate, taken


def test_an_oversized_delta_is_refused(transport: Transport) -> None:
    """Larger than any encoding of the model: refused TOO_LARGE before the node decides
    anything (gRPC: before receiving it all), nothing taken, on both transports."""
    huge = bytes(4 * theta0().numel() + (1 << 16) + 1)
    got = transport.upstream.push(delta("eu-0", data=huge))
    assert got.code == TOO_LARGE and "over this receiver's limit" in got.reason, got
    assert transport.published() == [] and transport.spooled() == []
    assert transport.upstream.push(delta("eu-0")).accepted


# -- fetches ------------------------------------------------------------------------------
def _digest_of(merge: Committed) -> str:
    return tensor_digest(merge.payload.reshape(-1))


def test_a_merge_not_committed_yet_is_none(transport: Transport) -> None:
    up = transport.upstream
    assert up.fetch("eu-0", STEP, "regional") is None
    assert up.push(delta("eu-0")).accepted
    assert up.fetch("eu-0", STEP, "regional") is None  # one of two members delivered
    assert up.fetch("eu-1", STEP, "regional") is None
    assert up.fetch("eu-0", 2 * STEP, "global") is None


def test_after_both_islands_pushed_fetch_returns_the_committed_mean(
    transport: Transport,
) -> None:
    up, d0, d1 = transport.upstream, delta("eu-0"), delta("eu-1")
    assert up.push(d1).accepted and up.push(d0).accepted  # any order
    reference = machine_after(d0, d1).merge_for(STEP)
    assert reference is not None
    for island in ("eu-0", "eu-1"):
        got = up.fetch(island, STEP, "regional")
        assert isinstance(got, Committed), got
        assert (got.level, got.kind, got.round, got.sync_step, got.merge_step) == (
            "regional",
            "regional",
            0,
            STEP,
            STEP,
        )
        assert got.commitment == reference.commitment
        assert got.commitment.members == ("eu-0", "eu-1")
        assert got.commitment.input_digests == (d0.digest, d1.digest)
        # The payload is the relay's base after the merge (what islands take), not the mean.
        assert reference.record is not None and _digest_of(reference) == reference.record.post_base
        assert _digest_of(got) == _digest_of(reference)
        assert torch.equal(got.payload.view(torch.int32), reference.payload.view(torch.int32))


def test_a_fetch_by_a_non_member_is_forbidden(transport: Transport) -> None:
    up = transport.upstream
    refused = Decision(FORBIDDEN, "'us-0' is not a member of this relay")
    assert up.fetch("us-0", STEP, "regional") == refused  # before the commit: not held
    assert up.push(delta("eu-0")).accepted and up.push(delta("eu-1")).accepted
    assert up.fetch("us-0", STEP, "regional") == refused
    assert up.fetch("", STEP, "regional") == Decision(FORBIDDEN, "'' is not a member of this relay")


def test_a_fetch_of_the_wrong_kind_is_invalid(transport: Transport) -> None:
    up = transport.upstream
    assert up.push(delta("eu-0")).accepted and up.push(delta("eu-1")).accepted
    assert up.fetch("eu-0", STEP, "global") == Decision(
        INVALID, f"the merge of step {STEP} is regional, not global"
    )
    assert up.fetch("eu-0", STEP, "regionl") == Decision(
        INVALID, f"the merge of step {STEP} is regional, not regionl"
    )
    assert isinstance(up.fetch("eu-0", STEP, "regional"), Committed)


def test_a_relay_takes_an_applied_report(transport: Transport) -> None:
    """Only the aggregator keeps applied reports; a relay answers None (taken)."""
    assert transport.upstream.report_applied("eu-0", STEP) is None


# -- the same calls, the same answers ---------------------------------------------------------
def _transcript(up: Upstream) -> list[tuple[str, tuple[object, ...]]]:
    """One island session's answers, reduced to what the contract fixes: codes (and the
    machine's reasons) of refusals, code and duplicate of acceptances, digests of merges."""

    def push(d: Delta) -> tuple[object, ...]:
        got = up.push(d)
        return (got.code, got.duplicate) if got.accepted else (got.code, got.reason)

    def fetch(island: str, kind: str = "regional") -> tuple[object, ...]:
        got = up.fetch(island, STEP, kind)
        if isinstance(got, Committed):
            return (got.kind, got.round, got.merge_step, got.commitment.digest, _digest_of(got))
        return ("decision", got.code, got.reason) if isinstance(got, Decision) else ("none",)

    return [
        ("fetch before any push", fetch("eu-0")),
        ("push ahead", push(delta("eu-0", step=2 * STEP))),
        ("push by a non-member", push(delta("eu-0", sender="us-0"))),
        ("push in the wrong codec", push(delta("eu-0", codec="fp32"))),
        ("push of a corrupt blob", push(delta("eu-0", data=b"HTCD" + bytes(60)))),
        ("push", push(delta("eu-0"))),
        ("resend", push(delta("eu-0"))),
        ("push of other bytes", push(delta("eu-0", seed=7))),
        ("fetch before the commit", fetch("eu-1")),
        ("push completing the step", push(delta("eu-1"))),
        ("fetch by eu-0", fetch("eu-0")),
        ("fetch by eu-1", fetch("eu-1")),
        ("fetch by a non-member", fetch("us-0")),
        ("fetch of the wrong kind", fetch("eu-0", "global")),
        ("resend after the commit", push(delta("eu-1"))),
    ]


def test_both_transports_answer_alike_and_commit_the_same_bits(tmp_path: Path) -> None:
    transcripts = {}
    for name in TRANSPORTS:
        with open_transport(name, tmp_path / name) as t:
            transcripts[name] = _transcript(t.upstream)
    local, remote = dict(transcripts["in-process"]), dict(transcripts["grpc"])
    for label, answer in local.items():
        assert remote[label] == answer, label
    reference = machine_after(delta("eu-0"), delta("eu-1")).merge_for(STEP)
    assert reference is not None
    for label in ("fetch by eu-0", "fetch by eu-1"):
        assert local[label][-1] == remote[label][-1] == _digest_of(reference)
    assert local["resend after the commit"] == (OK, True)


# -- the relay's Status round -----------------------------------------------------------------
STATUS_CFG = RunConfig.from_dict(
    {
        "run_id": "status",
        "steps": 40,
        "batch_per_island": 8,
        "holdout_windows": 1,
        "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 10, "h_g": 20},
    }
)


def _status_delta(sender: str, step: int, cfg: RunConfig = STATUS_CFG) -> Delta:
    """A valid delta: an island's for the regional codec, a region's for the global one."""
    codec = make_codec(cfg.regional_codec if "-" in sender else cfg.global_codec)
    g = torch.Generator().manual_seed(step * 1000 + sum(map(ord, sender)))
    data = bytes(codec.encode(torch.randn(theta0().numel(), generator=g) * 1e-3))
    return Delta.of(cfg.run_id, step, sender, str(codec.spec), data, Schedule.of(cfg))


def test_relay_status_reports_the_round_of_its_open_step(tmp_path: Path) -> None:
    """Status().round is the schedule's round of the open step (h_r=10, h_g=20): round 0
    at open step 20 (the old ``open_step // h_g`` said 1), round 1 at open step 30 once
    step 20 committed and its global round came back from the aggregator."""
    cfg = STATUS_CFG
    with served(cfg, tmp_path) as s:
        relay = Peer(s.relay_address, "Relay")
        aggregator = Peer(s.aggregator_address, "Aggregator")
        try:
            up = GrpcUpstream(relay, cfg.run_id, s.relay.numel)
            first = relay.status()
            assert (first.round, first.last_step, first.done) == (0, 0, False)
            assert first.role == "relay/eu" and first.config_digest == cfg.digest
            for island in ("eu-0", "eu-1"):
                assert up.push(_status_delta(island, 10)).accepted
            at_20 = relay.status()
            assert (at_20.round, at_20.last_step) == (0, 10)
            for island in ("eu-0", "eu-1"):
                assert up.push(_status_delta(island, 20)).accepted
            # The relay forwards eu's delta on its own thread; the test is region us.
            us = GrpcUpstream(aggregator, cfg.run_id, s.aggregator.numel)
            assert us.push(_status_delta("us", 20)).accepted
            deadline = time.monotonic() + 60

            def gave_up() -> bool:
                return time.monotonic() > deadline

            merge = Patient(up, "relay", gave_up).fetch("eu-0", 20, "global")
            assert (merge.kind, merge.round, merge.sync_step) == ("global", 0, 20)
            at_30 = relay.status()
            assert (at_30.round, at_30.last_step, at_30.done) == (1, 20, False)
            assert s.relay.node.machine.level.open_step == 30
            assert up.push(_status_delta("eu-0", 30)).accepted  # the global round is applied
            agg = aggregator.status()
            assert (agg.round, agg.last_step) == (1, 20)
        finally:
            relay.close()
            aggregator.close()
