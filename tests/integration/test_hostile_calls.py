"""Stalling a real cluster over TLS while its islands train: a holder of a run
certificate that is no member holds silent pushes at the relay and the aggregator up to
its cap for the whole run (each one the server ends, it opens again), and a compromised
island trickles a push.  The run still ends on the reference digest; the stalled calls
are ended DEADLINE_EXCEEDED naming the bound, and a call past the caller's cap is
refused RESOURCE_EXHAUSTED at once.

The servers must outlive the first stalls' bound, or a fast machine finishes the run
before any stall was ended and the clients see the servers' shutdown instead: so island
us-0 starts only once every first stall has ended (no cutoff is set, so no round commits
without it), while eu-0 trains from the start."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

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
    """One slot of a caller's calls, held by calls that say nothing (or one byte a
    second): each call the server ends is opened again (``again``) until ``stop``."""

    def __init__(self, stub: object, kind: str, stop: threading.Event, again: bool) -> None:
        self.kind = kind
        self.stub = stub
        self.stop = stop
        self.again = again
        self.ended: list[grpc.RpcError] = []  # how each of its calls ended, in order
        self.first = threading.Event()  # its first call has ended
        self.thread = threading.Thread(target=self._hold, daemon=True)

    def _parts(self) -> Iterator[object]:
        if self.kind == "trickle":  # eu-0's certificate passes the header's check
            header = pb.TransferHeader(
                run_id=CFG.run_id, sync_step=5, sender="eu-0", digest="0" * 64, size=50_000
            )
            yield pb.DeltaChunk(header=header)
            while not self.stop.wait(1.0):
                yield b"x"
        self.stop.wait()

    def _call(self) -> grpc.Future:
        push = getattr(self.stub, "PushDelta", None) or self.stub.PushRegional  # type: ignore[attr-defined]
        return push.future(self._parts(), timeout=120)

    def start(self) -> None:
        """Hold the slot (on its own thread) until ``stop``."""
        self.thread.start()

    def _hold(self) -> None:
        while not self.stop.is_set():
            exc = self._call().exception(timeout=150)
            if not isinstance(exc, grpc.RpcError):  # the test reports it
                self.ended.append(exc)
                self.first.set()
                return
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # the cap was full for a moment: the server had not yet let go of a call
                # it ended, or the test's own Status call held a slot; open it again
                time.sleep(0.2)
                continue
            self.ended.append(exc)
            self.first.set()
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or not self.again:
                return  # the server is gone (the run ended), or a one-off


def assert_refused(stub: object, within_s: float = 0.0) -> None:
    """A Status call from the intruder is refused RESOURCE_EXHAUSTED (its cap is held),
    (polling for ``within_s`` while its stalls are being admitted or opened again)."""
    until = time.monotonic() + within_s
    while True:
        try:
            stub.Status(pb.StatusRequest(), timeout=20)  # type: ignore[attr-defined]
            code, details = grpc.StatusCode.OK, "answered"
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > until:
            break
        time.sleep(0.2)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert f"intruder has {CAP} calls in flight here" in details, details


def test_stalled_and_excess_calls_are_bounded_while_the_run_completes(tmp_path: Path) -> None:
    cluster = Cluster(CFG, tmp_path / "run")
    keys = cluster.run_dir / "keys"
    init_daemons(keys, daemon_key_names(CFG.topology))
    issue(keys, "intruder")  # a certificate of the run CA, for no member
    intruder = Security.of(keys, "intruder")
    island = Security.of(keys, "island-eu-0")
    with (cluster.run_dir / "run.toml").open("a") as f:
        f.write(f"\n[relay]\n{BOUNDS}\n[aggregator]\n{BOUNDS}")
    stop = threading.Event()
    stalls: list[Stall] = []
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
            stalls += [Stall(stub, "silent", stop, again=True) for _ in range(CAP)]
        trickle = relay_stub(island.channel(relay_addr, "relay-eu"))
        stalls.append(Stall(trickle, "trickle", stop, again=False))
        for s in stalls:
            s.start()
        for stub in (relay, agg):  # one more call once the cap is held: refused at once
            assert_refused(stub, within_s=10)
        # eu-0 starts now, while every call the intruder may hold is held ...
        addrs = relay_addresses(children)
        cluster.children.append(
            start_island(cluster.run_dir, cluster.progress, "eu-0", addrs["eu"])
        )
        # ... and us-0 once every first stall has ended and the intruder holds its cap again
        for s in stalls:
            assert s.first.wait(60), f"a {s.kind} call was never ended"
        for stub in (relay, agg):
            assert_refused(stub, within_s=10)
        cluster.children.append(
            start_island(cluster.run_dir, cluster.progress, "us-0", addrs["us"])
        )
        failed = supervise(cluster.children, deadline_s=300)
        assert failed is None, failed.failure_message()
    finally:
        stop.set()
        cluster.stop()
        for s in stalls:
            s.thread.join(timeout=60)
    assert cluster.progress.final_digest == run_reference(CFG).final_digest
    for s in stalls:
        assert all(isinstance(e, grpc.RpcError) for e in s.ended), (s.kind, s.ended)
        first = s.ended[0]  # ended by the bound while the servers ran: named
        assert first.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (s.kind, first)
        # every later one the server ended too, but the last, which the run's end may end
        for exc in s.ended[:-1]:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (s.kind, exc)
        for exc in s.ended:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                words = "no data moved" if s.kind == "silent" else "slower than the least rate"
                assert words in (exc.details() or ""), (s.kind, exc.details())
    log = (cluster.run_dir / "logs" / "relay-eu.log").read_text()
    assert "ended a call from intruder" in log
