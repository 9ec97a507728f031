"""Mutual TLS against real daemons: who can connect, who may act as whom, and what a
daemon refuses to start with.  Every refused call leaves the relay's tape as it was."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.rounds.machines import Delta, MemberRequest
from hypertrain.common.trust.certs import TlsFiles, cert_path, init_ca, init_daemons, issue
from hypertrain.common.trust.keys import daemon_key_names, load_signing_key
from hypertrain.procs import child_env
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire import wireformat
from hypertrain.wire.client import aggregator_stub, push_delta, relay_stub, transfer_header
from hypertrain.wire.errors import WireError
from hypertrain.wire.peers import Peer
from hypertrain.wire.tls import Security
from hypertrain.wire.upstream import GrpcUpstream, Patient
from tests.integration.conftest import Cluster
from tests.integration.test_bad_input import CODEC, NUMEL

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "holdout_windows": 16,
        "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)
DATA = CODEC.encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)) * 1e-3)


class Run:
    def __init__(self, keys: Path, relay: str, aggregator: str, run_dir: Path) -> None:
        self.keys, self.relay, self.aggregator = keys, relay, aggregator
        self.tape = run_dir / "relay-eu" / "tape"
        self.log = run_dir / "logs" / "relay-eu.log"

    def channel(self, who: str, peer: str = "relay-eu", address: str | None = None) -> grpc.Channel:
        return Security.of(self.keys, who).channel(address or self.relay, peer)

    def signed(self, who: str, sender: str, step: int = 5) -> Delta:
        """A delta for ``sender`` signed with ``who``'s key."""
        d = Delta(CFG.run_id, 0, step, sender, blob_digest(DATA), str(CODEC.spec), DATA)
        return d.signed(load_signing_key(self.keys / f"{who}.key").sign(d.transfer_message()))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    cluster = Cluster(CFG, tmp_path_factory.mktemp("tls"))
    keys = cluster.run_dir / "keys"
    init_daemons(keys, daemon_key_names(CFG.topology))
    try:
        relay = cluster.spawn_region("eu", keys, tls=True).wait_listening()
        aggregator = cluster.children[0].wait_listening()
        yield Run(keys, relay, aggregator, cluster.run_dir)
    finally:
        cluster.stop()


def _code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details() or ""  # type: ignore[attr-defined]


def _push(channel: grpc.Channel, delta: Delta, to: str = "relay") -> tuple[grpc.StatusCode, str]:
    stub = relay_stub(channel) if to == "relay" else aggregator_stub(channel)
    push = stub.PushDelta if to == "relay" else stub.PushRegional
    return _code(lambda: push_delta(push, transfer_header(delta), DATA, timeout=20))


def _status(channel: grpc.Channel) -> pb.StatusReply:
    reply: pb.StatusReply = relay_stub(channel).Status(pb.StatusRequest(), timeout=20)
    return reply


def test_an_island_with_its_certificate_is_served(run: Run) -> None:
    assert _status(run.channel("island-eu-0")).run_id == CFG.run_id


def test_callers_without_a_run_certificate_never_reach_the_relay(run: Run, tmp_path: Path) -> None:
    size = run.tape.stat().st_size
    ca = (run.keys / "ca.crt").read_bytes()
    own = TlsFiles.load(cert_path(run.keys, "island-eu-0"))
    other = tmp_path / "other"  # a CA of another run, and an island certificate from it
    other.mkdir()
    init_ca(other)
    stranger = TlsFiles.load(issue(other, "island-eu-0"), ca=other / "ca.crt")
    issue(run.keys, "island-eu-1", now=dt.datetime.now(dt.UTC) - dt.timedelta(days=400),
          days=30, force=True)  # fmt: skip
    expired = run.keys / "island-eu-1"
    credentials = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        "another run's CA": grpc.ssl_channel_credentials(ca, stranger.key_pem, stranger.cert_pem),
        "an expired certificate": grpc.ssl_channel_credentials(
            ca,
            expired.with_suffix(".tls.key").read_bytes(),
            expired.with_suffix(".crt").read_bytes(),
        ),
    }
    for what, creds in credentials.items():
        options = [("grpc.ssl_target_name_override", "relay-eu")]
        channel = (
            grpc.insecure_channel(run.relay)
            if creds is None
            else grpc.secure_channel(run.relay, creds, options=options)
        )
        with channel:
            code, _ = _code(lambda c=channel: _status(c))  # type: ignore[misc]
            assert code == grpc.StatusCode.UNAVAILABLE, what
            code, _ = _push(channel, run.signed("island-eu-0", "eu-0"))
            assert code == grpc.StatusCode.UNAVAILABLE, what
    issue(run.keys, "island-eu-1", force=True)  # valid again for the other tests
    # and a client that trusts the run CA checks whom it reached: the aggregator is not
    # the relay it asked for
    with Security.tls(own).channel(run.aggregator, "relay-eu") as wrong:
        assert _code(lambda: _status(wrong))[0] == grpc.StatusCode.UNAVAILABLE
    assert run.tape.stat().st_size == size
    # gRPC's line per failed handshake is off by default: such a flood cannot flood the log
    assert "Handshake failed" not in run.log.read_text()


def test_an_island_may_push_only_as_itself_and_only_to_its_regions_relay(run: Run) -> None:
    size = run.tape.stat().st_size
    cases = [  # (certificate, sender it claims, the name the refusal gives)
        ("island-eu-1", "eu-0", "only island-eu-0 may push as eu-0"),
        ("island-us-0", "us-0", "not a member this server serves"),
        ("relay-us", "eu-0", "only island-eu-0 may push as eu-0"),
    ]
    for who, sender, words in cases:
        with run.channel(who) as channel:
            # signed with the claimed sender's key: the certificate alone refuses it
            code, message = _push(channel, run.signed(f"island-{sender}", sender))
        assert code == grpc.StatusCode.PERMISSION_DENIED, (who, message)
        assert words in message and who in message, message
    with run.channel("island-eu-1") as channel:
        request = pb.MergeRequest(run_id=CFG.run_id, requester="eu-0", sync_step=5, kind="regional")
        stream = relay_stub(channel).FetchMerge(request, timeout=20)
        code, message = _code(lambda: next(iter(stream)))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may fetch" in message, message
        leave = pb.MemberChange(run_id=CFG.run_id, change="leave", member="eu-0", step=5)
        code, message = _code(lambda: relay_stub(channel).Member(leave, timeout=20))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may leave" in message, message
    assert run.tape.stat().st_size == size


def test_only_relays_may_push_to_the_aggregator(run: Run) -> None:
    with run.channel("island-eu-0", "aggregator", run.aggregator) as channel:
        code, message = _push(channel, run.signed("relay-eu", "eu", step=10), to="aggregator")
    assert code == grpc.StatusCode.PERMISSION_DENIED and "only relay-eu may push" in message


def _start(keys: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "hypertrain.aggregator", "--state-dir", str(keys / "s"), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=child_env())


def test_a_daemon_will_not_start_without_an_identity_it_can_use(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    init_daemons(keys, ["aggregator", "relay-eu"])
    issue(keys, "old", now=dt.datetime.now(dt.UTC) - dt.timedelta(days=40), days=30)
    cases = [
        ((), "no TLS certificate: give --tls-cert"),
        (("--insecure", "--listen", "0.0.0.0:0"), "only on a loopback address"),
        (("--tls-cert", str(keys / "relay-eu.crt")), "names relay-eu, not aggregator"),
        (("--tls-cert", str(keys / "old.crt")), "not now; issue a new one"),
        (("--tls-cert", str(keys / "aggregator.crt"), "--tls-key", str(keys / "relay-eu.tls.key")),
         "does not belong to certificate"),
    ]  # fmt: skip
    for flags, words in cases:
        out = _start(keys, *flags)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert lines[0].startswith("hypertrain-aggregator: error:") and words in lines[0], lines


@pytest.mark.parametrize("stated", [None, "2", "4"])
def test_an_island_of_another_wire_format_is_refused_naming_both_and_gives_up(
    run: Run, stated: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An island whose build states another wire format (``wireformat.py``; None: a build
    from before the formats were stated) goes through its own client path (``Peer``,
    ``GrpcUpstream``, ``Patient``) to the real relay: every call is refused UNIMPLEMENTED
    naming both formats, before any byte counts (the tape is as it was), and the island
    gives up at once instead of resending as if the bytes had been corrupted.  The same
    delta from this build is then taken."""
    size = run.tape.stat().st_size
    monkeypatch.setattr(
        wireformat, "FORMAT_METADATA", () if stated is None else ((wireformat.FORMAT_KEY, stated),)
    )
    words = "states no wire format" if stated is None else f"speaks wire format {stated};"
    peer = Peer(run.relay, "Relay", security=Security.of(run.keys, "island-eu-0"), name="relay-eu")
    deadline = time.monotonic() + 20  # a retrying client ends CANCELLED here instead
    island = Patient(
        GrpcUpstream(peer, CFG.run_id, NUMEL), "relay-eu", lambda: time.monotonic() > deadline
    )
    delta = run.signed("island-eu-0", "eu-0")
    try:
        calls = {
            "push": lambda: island.push(delta),
            "fetch": lambda: island.fetch("eu-0", 5, "regional"),
            "join": lambda: island.member(MemberRequest(CFG.run_id, "join", "eu-0", 5, 1)),
        }
        for what, call in calls.items():
            with pytest.raises(WireError) as err:
                call()
            assert err.value.code == grpc.StatusCode.UNIMPLEMENTED, (what, err.value.message)
            assert err.value.mismatch, what  # marked: the island exits 2, not restarted
            assert words in err.value.message, err.value.message
            assert f"this server speaks wire format {wireformat.WIRE_FORMAT}" in err.value.message
        code, message = _code(lambda: peer.status())
        assert code == grpc.StatusCode.UNIMPLEMENTED and words in message, message
    finally:
        peer.close()
    assert time.monotonic() < deadline
    assert run.tape.stat().st_size == size
    assert "rejected: UNIMPLEMENTED" in run.log.read_text()
    monkeypatch.undo()
    with run.channel("island-eu-0") as channel:  # this build: the same delta is taken
        stub = relay_stub(channel)
        ack = push_delta(stub.PushDelta, transfer_header(delta), DATA, timeout=20)
    assert ack.digest == delta.digest
