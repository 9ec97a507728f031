"""A real relay with keys, over mutual TLS, under a flood of refused pushes from a holder
of island eu-0's certificate: nothing unsigned or forged reaches its tape, and an
authenticated sender's refusals are taped only up to its allowance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from hypertrain.common.digest import blob_digest
from hypertrain.common.rounds.machines import Delta
from hypertrain.common.rounds.node import MAX_TAPED_REFUSALS
from hypertrain.common.trust.certs import init_daemons
from hypertrain.common.trust.keys import daemon_key_names, load_signing_key
from hypertrain.common.trust.tape_format import read_tape
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import connect, push_delta, relay_stub, transfer_header
from hypertrain.wire.tls import Security
from tests.integration.conftest import Cluster
from tests.integration.test_bad_input import CFG, CODEC, NUMEL

DATA = CODEC.encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)) * 1e-3)


def _delta(step: int = 5, sender: str = "eu-0") -> Delta:
    rnd = (step - 1) // CFG.topology.h_g
    return Delta(CFG.run_id, rnd, step, sender, blob_digest(DATA), str(CODEC.spec), DATA)


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path, Path]]:
    cluster = Cluster(CFG, tmp_path_factory.mktemp("tape-flood"))
    keys = cluster.run_dir / "keys"
    init_daemons(keys, daemon_key_names(CFG.topology))
    try:
        address = cluster.spawn_region("eu", keys, tls=True).wait_listening()
        security = Security.of(keys, "island-eu-0")
        stub = relay_stub(connect(address, security=security, peer="relay-eu"))
        yield stub, cluster.run_dir / "relay-eu" / "tape", keys
    finally:
        cluster.stop()


def _refused(push: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        push()  # type: ignore[operator]
    return err.value.code()  # type: ignore[no-any-return]


def test_a_flood_of_unauthenticated_pushes_leaves_the_tape_as_it_was(relay) -> None:  # type: ignore[no-untyped-def]
    stub, tape, keys = relay
    size = tape.stat().st_size
    unsigned = _delta()
    wrong_key = load_signing_key(keys / "island-eu-1.key")  # eu-1's key, claiming eu-0
    forged = unsigned.signed(wrong_key.sign(unsigned.transfer_message()))

    def truncated() -> Iterator[object]:
        yield pb.DeltaChunk(header=transfer_header(unsigned))
        yield memoryview(DATA)[:-100]

    for _ in range(40):
        assert _refused(lambda: push_delta(stub.PushDelta, transfer_header(unsigned), DATA)) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        assert _refused(lambda: push_delta(stub.PushDelta, transfer_header(forged), DATA)) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        assert _refused(lambda: stub.PushDelta(truncated())) == grpc.StatusCode.INVALID_ARGUMENT
    assert tape.stat().st_size == size  # 120 refusals, not one of them taped


def test_an_authenticated_senders_refusals_are_taped_up_to_its_allowance(relay) -> None:  # type: ignore[no-untyped-def]
    stub, tape, keys = relay
    key = load_signing_key(keys / "island-eu-0.key")
    ahead = _delta(step=10)  # signed by eu-0 itself, for a step not open yet
    ahead = ahead.signed(key.sign(ahead.transfer_message()))
    before = len(read_tape(tape))
    for _ in range(MAX_TAPED_REFUSALS + 4):
        code = _refused(lambda: push_delta(stub.PushDelta, transfer_header(ahead), DATA))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert len(read_tape(tape)) == before + MAX_TAPED_REFUSALS
