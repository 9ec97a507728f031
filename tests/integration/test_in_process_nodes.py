"""In-process nodes: Status is cheap (its state digest is the node's record), and a relay
warms its spool for the next step's deltas.

A relay's and the aggregator's Status report a digest of the whole state they hold
(the regional base, theta), under the lock every round decision takes.  Hashed at every
call, a caller looping Status (its four calls in flight, ``calls.py``) would hold that
lock most of the time at a real model size, delaying every push and fetch.  Here the real
servicers, in process on loopback, answer Status many times and the digest code is
counted: the value is right, and only the first call after a change hashes anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

import hypertrain.common.digest as digest_module
from hypertrain.aggregator.server import AggregatorService
from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest, state_digest
from hypertrain.common.rounds.machines import Delta
from hypertrain.common.trust.ledger import flat_digest
from hypertrain.relay.server import RelayService
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import aggregator_stub, push_delta, relay_stub, transfer_header
from tests.integration.conftest import in_process_nodes

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "holdout_windows": 16,
        "topology": {"regions": ["eu"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)


@pytest.fixture()
def nodes(tmp_path: Path) -> Iterator[tuple[grpc.Channel, RelayService, AggregatorService]]:
    with in_process_nodes(CFG, tmp_path) as running:
        yield running


class _Counted:
    """``common/digest._roots`` (under every tensor and state digest), counting bytes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bytes = 0

    def __call__(self, tensors: list[torch.Tensor], parallel: bool) -> Any:
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return self.inner(tensors, parallel)


def test_status_reports_the_state_s_digest_and_hashes_it_once_per_change(
    nodes: tuple[grpc.Channel, RelayService, AggregatorService], monkeypatch: pytest.MonkeyPatch
) -> None:
    channel, relay, agg = nodes
    counted = _Counted(digest_module._roots)
    monkeypatch.setattr(digest_module, "_roots", counted)
    theta = agg.node.machine.core.theta
    model_bytes = 4 * theta.numel()
    expected = {
        "relay": flat_digest(relay.node.machine.core.base_view()),
        "aggregator": state_digest(agg.layout.unflatten(theta)),
    }
    stubs = {"relay": relay_stub(channel), "aggregator": aggregator_stub(channel)}
    for role, stub in stubs.items():
        first = counted.bytes
        replies = [stub.Status(pb.StatusRequest(), timeout=20) for _ in range(8)]
        assert {r.state_digest for r in replies} == {expected[role]}, role
        # the first call may hash the state once (nothing recorded it yet; the aggregator
        # twice: its digest of record, which its named one is kept under); none after it
        passes = 2 if role == "aggregator" else 1
        assert counted.bytes - first <= passes * model_bytes + 4096, role

    # The aggregator takes a new theta (as an outer step or a restore does, which also
    # let go of the digest the machine had recorded): the next Status reports its
    # digest, hashed once (the flat digest of record, then the named one).
    machine = agg.node.machine
    with agg.board.cond:
        machine.core.theta, machine._theta_digest = theta + 1e-3, None
    moved = state_digest(agg.layout.unflatten(theta + 1e-3))
    first = counted.bytes
    replies = [stubs["aggregator"].Status(pb.StatusRequest(), timeout=20) for _ in range(8)]
    assert {r.state_digest for r in replies} == {moved} != {expected["aggregator"]}
    assert counted.bytes - first <= 2 * model_bytes + 4096

    # An outer step may write its theta into the memory of an old one, the same tensor
    # (GlobalCore.recycle): Status reports the new values, not a digest kept for the
    # tensor.
    with agg.board.cond:
        machine.core.theta.add_(1e-3)
        machine._theta_digest = None
    again = state_digest(agg.layout.unflatten(machine.core.theta))
    replies = [stubs["aggregator"].Status(pb.StatusRequest(), timeout=20) for _ in range(2)]
    assert {r.state_digest for r in replies} == {again} != {moved}


def test_a_relay_warms_its_spool_for_the_next_step_s_deltas(
    nodes: tuple[grpc.Channel, RelayService, AggregatorService],
) -> None:
    """``Intake.warm`` (what a relay runs between rounds): one warm spool file per delta
    taken at the latest step, of its size; the next delta pushed lands in one, and is
    published with its own bytes."""
    _, relay, _ = nodes
    channel = nodes[0]
    codec = make_codec(CFG.regional_codec)
    numel = relay.node.machine.core.theta.numel()
    stub = relay_stub(channel)

    def push(sender: str, seed: int) -> bytes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3
        data = bytes(codec.encode(x))
        delta = Delta(CFG.run_id, 0, 5, sender, blob_digest(data), str(codec.spec), data)
        push_delta(stub.PushDelta, transfer_header(delta), data)
        return data

    first = push("eu-0", 0)
    spool_dir = relay.intake.spool
    assert spool_dir is not None
    made = relay.intake.warm()
    if made == 0:
        pytest.skip("no sparse page cache to populate here (an old kernel, or tmpfs)")
    (warm,) = spool_dir.glob(".incoming-*.part")
    assert made == 1 and warm.stat().st_size == len(first)
    second = push("eu-1", 1)  # completes step 5: the relay commits it
    assert not list(spool_dir.glob(".incoming-*.part"))  # taken
    published = relay.node.store.published  # type: ignore[union-attr]
    assert (published / blob_digest(second)).read_bytes() == second
    assert (published / blob_digest(first)).read_bytes() == first
