"""Stalling a real cluster over TLS while its islands train: a holder of a run
certificate that is no member opens silent pushes at the relay and the aggregator up to
its cap, and a compromised island trickles a push.  The run still ends on the reference
digest; the stalled calls are ended DEADLINE_EXCEEDED naming the bound, and a call past
the caller's cap is refused RESOURCE_EXHAUSTED at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hypertrain.common.config import RunConfig
from hypertrain.common.reference import run_reference
from hypertrain.common.trust.certs import init_daemons, issue
from hypertrain.common.trust.keys import daemon_key_names
from hypertrain.up import relay_addresses, start_cluster, start_island, supervise
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import aggregator_stub, relay_stub
from hypertrain.wire.tls import Security
from tests.integration.conftest import Cluster

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "holdout_windows": 16,
        "regional_codec": "int8",
        "topology": {"regions": ["eu", "us"], "islands_per_region": 1, "h_r": 5, "h_g": 10},
    }
)
IDLE_S = 4
#: The daemons' bounds for this run: short, so that stalled calls end within the run.
CAP = 4
BOUNDS = f"call_idle_s = {IDLE_S}\ncalls_per_peer = {CAP}\n"


class Stall:
    """Calls from one certificate that say nothing (or one byte a second) until ended."""

    def __init__(self, stub: object, kind: str) -> None:
        self.release = threading.Event()
        self.kind = kind
        self.stub = stub

    def _parts(self) -> Iterator[object]:
        if self.kind == "trickle":  # eu-0's certificate passes the header's check
            header = pb.TransferHeader(
                run_id=CFG.run_id, sync_step=5, sender="eu-0", digest="0" * 64, size=50_000
            )
            yield pb.DeltaChunk(header=header)
            while not self.release.wait(1.0):
                yield b"x"
        self.release.wait()

    def start(self) -> grpc.Future:
        push = getattr(self.stub, "PushDelta", None) or self.stub.PushRegional  # type: ignore[attr-defined]
        return push.future(self._parts(), timeout=120)  # type: ignore[no-any-return]


def test_stalled_and_excess_calls_are_bounded_while_the_run_completes(tmp_path: Path) -> None:
    cluster = Cluster(CFG, tmp_path / "run")
    keys = cluster.run_dir / "keys"
    init_daemons(keys, daemon_key_names(CFG.topology))
    issue(keys, "intruder")  # a certificate of the run CA, for no member
    intruder = Security.of(keys, "intruder")
    island = Security.of(keys, "island-eu-0")
    with (cluster.run_dir / "run.toml").open("a") as f:
        f.write(f"\n[relay]\n{BOUNDS}\n[aggregator]\n{BOUNDS}")
    stalls: list[Stall] = []
    futures: list[tuple[str, grpc.Future]] = []
    try:
        children = start_cluster(
            CFG, cluster.run_dir, cluster.progress, hold=CFG.topology.island_ids()
        )
        cluster.children.extend(children)
        relay_addr = relay_addresses(children)["eu"]
        agg_addr = children[0].wait_listening()
        relay = relay_stub(intruder.channel(relay_addr, "relay-eu"))
        agg = aggregator_stub(intruder.channel(agg_addr, "aggregator"))
        for stub in (relay, agg):
            for _ in range(CAP):
                stalls.append(Stall(stub, "silent"))
                futures.append(("silent", stalls[-1].start()))
        stalls.append(Stall(relay_stub(island.channel(relay_addr, "relay-eu")), "trickle"))
        futures.append(("trickle", stalls[-1].start()))
        time.sleep(1.0)
        for stub in (relay, agg):  # one more call while the cap is held: refused at once
            with pytest.raises(grpc.RpcError) as err:
                stub.Status(pb.StatusRequest(), timeout=20)  # type: ignore[attr-defined]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"intruder has {CAP} calls in flight here" in (err.value.details() or "")
        # the honest islands start now, while every call the intruder may hold is held
        addrs = relay_addresses(children)
        for i in CFG.topology.island_ids():
            cluster.children.append(
                start_island(cluster.run_dir, cluster.progress, i, addrs[CFG.topology.region_of(i)])
            )
        failed = supervise(cluster.children, deadline_s=300)
        assert failed is None, failed.failure_message()
    finally:
        for s in stalls:
            s.release.set()
        cluster.stop()
    assert cluster.progress.final_digest == run_reference(CFG).final_digest
    for kind, fut in futures:
        exc = fut.exception(timeout=60)
        assert isinstance(exc, grpc.RpcError), (kind, exc)
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (kind, exc)
        words = "no data moved" if kind == "silent" else "slower than the least rate"
        assert words in (exc.details() or ""), (kind, exc.details())
    log = (cluster.run_dir / "logs" / "relay-eu.log").read_text()
    assert "ended a call from intruder" in log
