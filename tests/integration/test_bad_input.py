"""Bad deltas sent by test clients to a real relay process over mutual TLS, each client
holding an island's certificate: each gets its status, none counts."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import zstandard

from hypertrain.common.aggregate import aggregate
from hypertrain.common.codec import make_codec
from hypertrain.common.codec.header import read_header
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.roles import initial_parameters
from hypertrain.common.trust.certs import init_daemons
from hypertrain.common.trust.keys import daemon_key_names
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import connect, fetch_merge, push_delta, relay_stub
from hypertrain.wire.tls import Security
from tests.integration.conftest import raw_call

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "holdout_windows": 16,
        "topology": {"regions": ["eu"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)
CODEC = make_codec(CFG.regional_codec)
NUMEL = initial_parameters(CFG)[0].numel


def _blob(seed: int, numel: int = NUMEL, codec: object = CODEC) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return codec.encode(torch.randn(numel, generator=g) * 1e-3)  # type: ignore[attr-defined]


def _header(data: bytes, **changes: object) -> pb.TransferHeader:
    fields: dict[str, object] = dict(
        run_id=CFG.run_id,
        round=0,
        sync_step=5,
        sender="eu-0",
        digest=blob_digest(data),
        size=len(data),
        codec=str(CODEC.spec),
    )
    fields.update(changes)
    return pb.TransferHeader(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def relay(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, Path, grpc.Channel, dict[str, Any]]]:
    """(eu-0's stub, the relay's published folder, eu-0's channel, a stub per island)."""
    from tests.integration.conftest import Cluster

    cluster = Cluster(CFG, tmp_path_factory.mktemp("bad-input"))
    keys = cluster.run_dir / "keys"
    init_daemons(keys, daemon_key_names(CFG.topology))
    try:
        # TLS, but nothing signed: the deltas here are refused for what they hold
        address = cluster.spawn_region("eu", keys, tls=True, sign=False).wait_listening()
        channels = {
            i: connect(
                address,
                security=Security.of(keys, f"island-{i}"),
                peer="relay-eu",
            )
            for i in CFG.topology.islands_of("eu")
        }
        stubs = {i: relay_stub(c) for i, c in channels.items()}
        published = cluster.run_dir / "relay-eu" / "published"
        yield stubs["eu-0"], published, channels["eu-0"], stubs
    finally:
        cluster.stop()


GOOD = _blob(0)
CASES = {
    "wrong run": (GOOD, {"run_id": "other-run"}, grpc.StatusCode.INVALID_ARGUMENT, "wrong run"),
    "wrong round": (GOOD, {"round": 1}, grpc.StatusCode.INVALID_ARGUMENT, "does not match"),
    "not a sync step": (
        GOOD,
        {"sync_step": 7},
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a sync step",
    ),
    "step ahead": (GOOD, {"sync_step": 10}, grpc.StatusCode.FAILED_PRECONDITION, "ahead"),
    "not in region": (
        GOOD,
        {"sender": "us-0"},
        grpc.StatusCode.PERMISSION_DENIED,
        "may not push as 'us-0': not a member this server serves",
    ),
    "another island": (
        GOOD,
        {"sender": "eu-1"},
        grpc.StatusCode.PERMISSION_DENIED,
        "names island-eu-0; only island-eu-1 may push as eu-1",
    ),
    "wrong shape": (_blob(1, numel=1000), {}, grpc.StatusCode.INVALID_ARGUMENT, "shape"),
    "wrong codec name": (GOOD, {"codec": "fp32"}, grpc.StatusCode.INVALID_ARGUMENT, "wrong codec"),
    "bytes of another codec": (
        _blob(2, codec=make_codec("fp32")),
        {},
        grpc.StatusCode.INVALID_ARGUMENT,
        "encoded with codec",
    ),
}


def _nan_scale() -> bytes:
    """GOOD with its first int8 scale NaN, checksum recomputed: only the payload's own
    validation can refuse it."""
    from tests.unit.test_codec_hostile import reseal

    forged = bytearray(GOOD)
    start = read_header(forged).header_len
    forged[start : start + 4] = struct.pack("<f", float("nan"))
    return reseal(forged)


CASES["NaN"] = (_nan_scale(), {}, grpc.StatusCode.INVALID_ARGUMENT, "scale holds NaN or inf")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_delta_gets_a_status_naming_the_problem(relay, case: str) -> None:  # type: ignore[no-untyped-def]
    stub, *_ = relay
    data, changes, code, words = CASES[case]
    with pytest.raises(grpc.RpcError) as err:
        push_delta(stub.PushDelta, _header(data, **changes), data)
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details(), err.value.details()


def test_finite_values_that_would_overflow_the_sum_are_refused(relay) -> None:  # type: ignore[no-untyped-def]
    """Two islands' int8 deltas of 2^127 each: finite, but their fp32 sum is inf.  Each is
    refused before it reaches the sum, with the figure (a relay with a key tapes it with
    its digest: tests/unit/test_machines.py); the next test completes the round with
    honest deltas and checks that the merge holds only theirs."""
    _, published, _, stubs = relay
    huge = CODEC.encode(torch.full((NUMEL,), 2.0**127))
    for sender in ("eu-0", "eu-1"):
        with pytest.raises(grpc.RpcError) as err:
            push_delta(stubs[sender].PushDelta, _header(huge, sender=sender), huge)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "its values reach 1.701e+38" in err.value.details()
        assert "overflow" in err.value.details()
    assert blob_digest(huge) not in {p.name for p in published.iterdir()}


@pytest.mark.parametrize(
    ("parts", "code", "words"),
    [
        (
            [_header(GOOD, size=2**62)],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "over this receiver's limit",
        ),
        ([_header(GOOD), GOOD, b"x"], grpc.StatusCode.INVALID_ARGUMENT, "too long"),
    ],
    ids=["declared size near 2^62", "more bytes than declared"],
)
def test_a_transfer_that_lies_about_its_size_is_refused(relay, parts, code, words) -> None:  # type: ignore[no-untyped-def]
    stub, *_ = relay
    stream = [pb.DeltaChunk(header=p) if isinstance(p, pb.TransferHeader) else p for p in parts]
    with pytest.raises(grpc.RpcError) as err:
        stub.PushDelta(iter(stream), timeout=30)
    assert err.value.code() == code and words in err.value.details(), err.value.details()


HEADER = pb.DeltaChunk(header=_header(GOOD)).SerializeToString()
LEAVE = dict(run_id=CFG.run_id, change="leave", member="eu-1")
MALFORMED = {
    "garbage": ("PushDelta", [b"\xff\xfe garbage"], "malformed DeltaChunk (10 bytes)"),
    "a header cut short": ("PushDelta", [HEADER[:-7]], f"malformed DeltaChunk ({len(HEADER) - 7}"),
    # a data record announcing 100 bytes that holds 10
    "data cut short": ("PushDelta", [HEADER, b"\x12\x64" + GOOD[:10]], "malformed DeltaChunk (12"),
    "bad UTF-8 in a string": ("PushDelta", [b"\x0a\x03\x0a\x01\xff"], "bad UTF-8"),
    "a member change cut short": (
        "Member",
        [pb.MemberChange(**LEAVE).SerializeToString()[:-3]],  # type: ignore[arg-type]
        "malformed MemberChange",
    ),
    "a merge request of garbage": ("FetchMerge", [b"\x0a\x09x"], "malformed MergeRequest"),
    "a status request of garbage": ("Status", [b"\x08"], "malformed StatusRequest"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_protobuf_and_truncated_framing_are_named_not_internal(relay, case: str) -> None:  # type: ignore[no-untyped-def]
    """Was INTERNAL "Exception deserializing request!"; the round is checked untouched by
    the last test of this file."""
    method, messages, words = MALFORMED[case]
    err = raw_call(relay[2], f"/hypertrain.v1.Relay/{method}", messages)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert words in err.details(), err.details()


MAX_U64 = 2**64 - 1
OUT_OF_RANGE = [
    ("round", "PushDelta", [pb.DeltaChunk(header=_header(GOOD, round=MAX_U64)), GOOD]),
    ("sync_step", "PushDelta", [pb.DeltaChunk(header=_header(GOOD, sync_step=2**63)), GOOD]),
    ("step", "Member", pb.MemberChange(**LEAVE, step=MAX_U64, issued=1)),  # type: ignore[arg-type]
    ("issued", "Member", pb.MemberChange(**LEAVE, step=3, issued=2**63)),  # type: ignore[arg-type]
    ("sync_step", "FetchMerge", pb.MergeRequest(run_id=CFG.run_id, requester="eu-0",
                                                sync_step=MAX_U64, kind="regional")),
]  # fmt: skip


@pytest.mark.parametrize(("field", "method", "request_"), OUT_OF_RANGE)
def test_a_round_or_step_beyond_64_bits_is_refused_naming_the_field(  # type: ignore[no-untyped-def]
    relay, field: str, method: str, request_: Any
) -> None:
    """Was the tape's "does not fit in 64 bits; store it as a string" (and a leave with such
    a step changed the members before failing to tape)."""
    stub = relay[3]["eu-1" if method == "Member" else "eu-0"]  # a leave of eu-1: by eu-1
    with pytest.raises(grpc.RpcError) as err:
        if method == "PushDelta":
            stub.PushDelta(iter(request_), timeout=30)
        elif method == "FetchMerge":
            list(stub.FetchMerge(request_, timeout=30))
        else:
            stub.Member(request_, timeout=30)
    details = err.value.details()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith(f"{field} ") and "is out of range: at most 2^63 - 1" in details


def test_corrupt_truncated_and_conflicting_then_the_round_is_unchanged(relay) -> None:  # type: ignore[no-untyped-def]
    stub, published, _, stubs = relay
    flipped = bytearray(GOOD)
    flipped[len(flipped) // 2] ^= 0xFF
    flipped_b = bytes(flipped)
    # corrupted after hashing (in transit): the transport's digest check
    with pytest.raises(grpc.RpcError) as err:
        push_delta(stub.PushDelta, _header(GOOD, digest=blob_digest(flipped_b)), GOOD)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "corrupt" in err.value.details()
    # corrupted before hashing: the codec's checksum
    with pytest.raises(grpc.RpcError) as err:
        push_delta(stub.PushDelta, _header(flipped_b), flipped_b)
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum" in err.value.details()
    )

    # truncated: fewer bytes than the header announced
    def truncated() -> Iterator[object]:
        yield pb.DeltaChunk(header=_header(GOOD))
        yield memoryview(GOOD)[:-100]

    with pytest.raises(grpc.RpcError) as err:
        stub.PushDelta(truncated())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "short" in err.value.details()

    ack = push_delta(stub.PushDelta, _header(GOOD), GOOD)
    assert not ack.duplicate
    again = push_delta(stub.PushDelta, _header(GOOD), GOOD)
    assert again.duplicate and again.digest == ack.digest  # idempotent, counted once
    other = _blob(3)
    with pytest.raises(grpc.RpcError) as err:
        push_delta(stub.PushDelta, _header(other), other)
    assert (
        err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        and "different bytes" in err.value.details()
    )

    second = _blob(4)
    push_delta(stubs["eu-1"].PushDelta, _header(second, sender="eu-1"), second)
    request = pb.MergeRequest(run_id=CFG.run_id, requester="eu-0", sync_step=5, kind="regional")
    header, merged = fetch_merge(stub.FetchMerge, request, numel=NUMEL, timeout=60)
    mean, commitment = aggregate({"eu-0": GOOD, "eu-1": second}, CODEC, (NUMEL,))
    # What islands take after a regional merge: the relay's base, theta0 - mean.
    expected = torch.sub(initial_parameters(CFG)[1], mean)
    assert torch.equal(merged, expected), "a rejected input leaked into the round"
    # an old round's push replayed: the same bytes are a duplicate, counted once; other
    # bytes for that step are refused
    assert push_delta(stub.PushDelta, _header(GOOD), GOOD).duplicate
    with pytest.raises(grpc.RpcError) as err:
        push_delta(stub.PushDelta, _header(other), other)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    again_header, again = fetch_merge(stub.FetchMerge, request, numel=NUMEL, timeout=60)
    assert torch.equal(again, merged) and again_header.digest == header.digest
    assert list(header.members) == ["eu-0", "eu-1"]
    assert sorted(p.name for p in published.iterdir()) == sorted(commitment.input_digests)


ZSTD_CFG = CFG.with_overrides(run_id="zstd", regional_codec="fp32+zstd")
ZSTD = make_codec(ZSTD_CFG.regional_codec)


def _zstd_cases() -> dict[str, tuple[bytes, str]]:
    """fp32+zstd deltas whose frames lie (headers sealed, so only the frame check refuses)."""
    from tests.unit.test_codec_hostile import forged_blob

    spec, shape, raw = ZSTD_CFG.regional_codec, (NUMEL,), 4 * NUMEL
    bomb = zstandard.ZstdCompressor().compress(bytes(raw * 64))  # declares 64x the model
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(raw))
    lying = bytearray(zstandard.ZstdCompressor().compress(bytes(raw * 2)))
    assert lying[4] >> 6 == 2  # a 4-byte content size at [5:9]: patched to say raw
    lying[5:9] = struct.pack("<I", raw)
    return {
        "declares more than the model": (
            forged_blob(spec, shape, bomb, raw),
            "header allows exactly",
        ),
        "omits its size": (
            forged_blob(spec, shape, unsized, raw),
            "does not record its content size",
        ),
        "holds more than it declares": (
            forged_blob(spec, shape, bytes(lying), raw),
            "zstd payload is corrupt",
        ),
    }


@pytest.fixture(scope="module")
def zstd_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.integration.conftest import Cluster

    cluster = Cluster(ZSTD_CFG, tmp_path_factory.mktemp("bad-zstd"))
    keys = cluster.run_dir / "keys"
    init_daemons(keys, daemon_key_names(ZSTD_CFG.topology))
    try:
        address = cluster.spawn_region("eu", keys, tls=True, sign=False).wait_listening()
        security = Security.of(keys, "island-eu-0")
        yield relay_stub(connect(address, security=security, peer="relay-eu"))
    finally:
        cluster.stop()


@pytest.mark.parametrize("case", list(_zstd_cases()))
def test_zstd_frames_that_lie_about_their_size_are_refused(zstd_relay, case: str) -> None:  # type: ignore[no-untyped-def]
    data, words = _zstd_cases()[case]
    header = _header(data, run_id=ZSTD_CFG.run_id, codec=str(ZSTD.spec))
    with pytest.raises(grpc.RpcError) as err:
        push_delta(zstd_relay.PushDelta, header, data, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert words in err.value.details(), err.value.details()
