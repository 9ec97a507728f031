"""Hostile requests at the real servicers, in process on loopback: never UNKNOWN or INTERNAL.

A ``RelayService`` and an ``AggregatorService`` (registered with ``server.add_servicer``,
as the daemons do) are fed hypothesis-generated raw request bytes (garbage, real messages
cut short or with a byte changed) and well-formed requests with any field values, through
a channel that sends bytes as they are.  Every answer is a status a caller can act on,
with a message; a malformed push is counted as a refusal that was not taped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire import rounds
from tests.integration.conftest import in_process_nodes, raw_call
from tests.unit.test_wire_fuzz import mangled

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "holdout_windows": 16,
        "topology": {"regions": ["eu"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
#: What no request may get: a bug's status (UNKNOWN) or a failure of ours (INTERNAL).
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
METHODS = [
    f"/{service.full_name}/{method.name}"
    for service in pb.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]

u64 = st.one_of(st.integers(0, 30), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]))
VALID = st.sampled_from(["eu-0", "eu-1", "eu", CFG.run_id, "regional", "global"])
names = st.one_of(VALID, VALID, st.text(max_size=6))
requests = st.one_of(
    st.builds(pb.MergeRequest, run_id=names, requester=names, sync_step=u64, kind=names),
    st.builds(pb.MemberChange, run_id=names, change=st.sampled_from(["join", "leave", "x"]),
              member=names, step=u64, issued=u64, signature=st.binary(max_size=4)),
    st.builds(pb.StatusRequest, requester=names, applied_step=u64),
    st.builds(pb.DeltaChunk, header=st.builds(
        pb.TransferHeader, run_id=names, round=u64, sync_step=u64, sender=names,
        digest=st.just(blob_digest(b"x")), size=st.integers(0, 3), codec=names)),
    st.binary(max_size=3).map(lambda b: pb.DeltaChunk(data=b)),
).map(lambda m: m.SerializeToString())  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[grpc.Channel, Any]]:
    """(a raw channel to a relay and an aggregator on one port, the relay's service)."""
    hold = rounds.HOLD_S
    rounds.HOLD_S = 0.05  # a fetch not committed yet is answered at once, not in 2 s
    try:
        with in_process_nodes(CFG, tmp_path_factory.mktemp("fuzz")) as (channel, relay, _):
            yield channel, relay
    finally:
        rounds.HOLD_S = hold


@FUZZ
@given(path=st.sampled_from(METHODS), messages=st.lists(mangled(st.one_of(st.binary(max_size=60), requests)), min_size=1,
                                                                max_size=4))  # fmt: skip
def test_no_request_gets_unknown_or_internal(
    servers: tuple[grpc.Channel, Any], path: str, messages: list[bytes]
) -> None:
    channel, _ = servers
    err = raw_call(channel, path, messages)
    event("ok" if err is None else err.code().name)
    if err is not None:
        assert err.code() not in NEVER, (path, err.code(), err.details())
        assert err.details(), (path, err.code())


@pytest.mark.parametrize("path", METHODS)
def test_garbage_is_refused_invalid_argument_naming_the_message(
    servers: tuple[grpc.Channel, Any], path: str
) -> None:
    channel, _ = servers
    err = raw_call(channel, path, [b"\x0a\x05abc"])  # a field 1 of 5 bytes with 3 left
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith("malformed ") and "(5 bytes): Wire format was corrupt" in (
        err.details()
    )


def test_a_malformed_push_is_counted_as_an_untaped_refusal(
    servers: tuple[grpc.Channel, Any],
) -> None:
    channel, relay = servers

    def count(metric: Any, *labels: str) -> float:
        return float(metric.labels(*labels)._value.get())

    m = relay.metrics
    before = (count(m.rejected, "relay", "eu", "invalid_argument"), count(m.untaped, "relay", "eu"))
    header = pb.DeltaChunk(header=pb.TransferHeader(run_id=CFG.run_id, sender="eu-0"))
    truncated = header.SerializeToString()[:-1]
    err = raw_call(channel, "/hypertrain.v1.Relay/PushDelta", [truncated])
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("malformed DeltaChunk")
    after = (count(m.rejected, "relay", "eu", "invalid_argument"), count(m.untaped, "relay", "eu"))
    assert after == (before[0] + 1, before[1] + 1)
