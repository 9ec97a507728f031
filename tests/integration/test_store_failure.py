"""A relay whose store fails after it decided a push stops (exit code 1, one line saying
why) instead of serving live state its disk does not hold; started again on a working
disk it takes the same delta.  A real relay process and a real failure: its folder of
published inputs is replaced by a plain file, so linking the delta into it fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
import torch

from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.roles import initial_parameters
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import connect, push_delta, relay_stub
from tests.integration.conftest import Cluster

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "holdout_windows": 16,
        "topology": {"regions": ["eu"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)


def _delta() -> tuple[pb.TransferHeader, bytes]:
    codec = make_codec(CFG.regional_codec)
    numel = initial_parameters(CFG)[0].numel
    data = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3)
    header = pb.TransferHeader(
        run_id=CFG.run_id,
        round=0,
        sync_step=5,
        sender="eu-0",
        digest=blob_digest(data),
        size=len(data),
        codec=str(codec.spec),
    )
    return header, data


def _push(address: str, header: pb.TransferHeader, data: bytes) -> pb.PushAck:
    channel = connect(address, timeout=30)
    try:
        return push_delta(relay_stub(channel).PushDelta, header, data, timeout=60)
    finally:
        channel.close()


def test_a_store_failure_after_the_decision_stops_the_relay_and_loses_nothing(
    tmp_path: Path,
) -> None:
    cluster = Cluster(CFG, tmp_path)
    header, data = _delta()
    try:
        relay = cluster.spawn_region("eu")
        published = tmp_path / "relay-eu" / "published"
        shutil.rmtree(published, ignore_errors=True)
        published.write_bytes(b"not a folder")  # the delta cannot be linked into it

        with pytest.raises(grpc.RpcError) as err:
            _push(relay.wait_listening(), header, data)
        assert err.value.code() == grpc.StatusCode.INTERNAL, err.value.details()
        assert "could not be made durable" in err.value.details(), err.value.details()
        assert "this relay stops" in err.value.details(), err.value.details()
        assert relay.proc.wait(timeout=60) == 1, relay.failure_message()
        log = relay.log_path.read_text()
        assert "event=stopped" in log and "could not be made durable" in log, log[-2000:]
        spool = tmp_path / "relay-eu" / "spool"
        assert not list(spool.glob(".incoming-*")), "the refused delta's temp file stayed"

        # Started again on a working disk, the relay has not counted the delta: the
        # island's retry of the same push is accepted, not a duplicate.
        published.unlink()
        again = cluster.spawn(
            "relay-eu-again", "hypertrain.relay", *relay.argv[relay.argv.index("--region") :]
        )
        ack = _push(again.wait_listening(timeout=300), header, data)
        assert ack.digest == header.digest and not ack.duplicate
        assert (published / header.digest).read_bytes() == data
    finally:
        cluster.stop()
