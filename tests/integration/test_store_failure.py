"""A relay whose store fails after it decided a push ends at once (exit code 1, one line
saying why) instead of taping or serving live state its disk does not hold; started again
on a working disk it recovers from its tape and takes the same delta as new.  A real,
signing relay process and a real failure: its folder of published inputs is replaced by a
plain file, so linking the delta into it fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from hypertrain.common.rounds.machines import Delta
from hypertrain.common.trust.certs import init_daemons
from hypertrain.common.trust.keys import daemon_key_names, load_signing_key
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import connect, push_delta, relay_stub
from tests.integration.conftest import Cluster
from tests.integration.test_bad_input import CFG, GOOD, _header


def _delta(keys: Path) -> tuple[pb.TransferHeader, bytes]:
    """eu-0's delta for step 5 (test_bad_input's), signed with its key."""
    h = _header(GOOD)
    delta = Delta(h.run_id, h.round, h.sync_step, h.sender, h.digest, h.codec, GOOD, b"")
    key = load_signing_key(keys / "island-eu-0.key")
    return _header(GOOD, signature=key.sign(delta.transfer_message())), GOOD


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
    keys = tmp_path / "keys"
    init_daemons(keys, daemon_key_names(CFG.topology))
    header, data = _delta(keys)
    try:
        relay = cluster.spawn_region("eu", keys)
        published = tmp_path / "relay-eu" / "published"
        shutil.rmtree(published, ignore_errors=True)
        published.write_bytes(b"not a folder")  # the delta cannot be linked into it

        with pytest.raises(grpc.RpcError) as err:
            _push(relay.wait_listening(), header, data)
        # The process ended under the call: the island sees the relay gone and retries.
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert relay.proc.wait(timeout=60) == 1, relay.failure_message()
        log = relay.log_path.read_text()
        stopped = [line for line in log.splitlines() if line.startswith("event=stopped")]
        assert len(stopped) == 1 and "failed=True" in stopped[0], log[-2000:]
        assert "push from eu-0 for step 5 could not be made durable" in stopped[0], stopped
        spool = tmp_path / "relay-eu" / "spool"
        assert list(spool.glob(".incoming-*"))  # left as a kill leaves it

        # Started again on a working disk, the relay replays its tape, where the delta was
        # never taped: the island's retry of the same push is accepted, not a duplicate.
        published.unlink()
        again = cluster.spawn(
            "relay-eu-again", "hypertrain.relay", *relay.argv[relay.argv.index("--region") :]
        )
        ack = _push(again.wait_listening(timeout=300), header, data)
        assert ack.digest == header.digest and not ack.duplicate
        assert (published / header.digest).read_bytes() == data
        assert not list(spool.glob(".incoming-*")), "the restart left the dead push's file"
    finally:
        cluster.stop()
