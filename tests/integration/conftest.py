"""Integration fixtures: real daemons as OS processes on loopback, always reaped."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from hypertrain.common.config import RunConfig
from hypertrain.common.trust.certs import cert_path
from hypertrain.procs import Child, child_env, python_module
from hypertrain.up import Progress, config_toml, start_cluster, supervise


def free_port() -> int:
    """A TCP port free on loopback now (for a daemon that must come back on the same one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def in_process_nodes(cfg: RunConfig, state: Path) -> Iterator[tuple[grpc.Channel, Any, Any]]:
    """A ``RelayService`` for region "eu" and an ``AggregatorService`` of ``cfg``, in this
    process, registered on one server on loopback as the daemons register them: (a plain
    channel to it, the relay's service, the aggregator's); stopped on the way out."""
    from hypertrain.aggregator.server import AggregatorService
    from hypertrain.relay.server import RelayService
    from hypertrain.wire.peers import aggregator_peer
    from hypertrain.wire.server import Shutdown, add_servicer, bind, make_server

    shutdown = Shutdown()
    server = make_server()
    agg = AggregatorService(cfg, state / "aggregator", shutdown)
    address = bind(server, "127.0.0.1:0")
    relay = RelayService(
        cfg, "eu", state / "relay", aggregator_peer(address, wait_ready=False), shutdown
    )
    add_servicer(relay, server, "Relay")
    add_servicer(agg, server, "Aggregator")
    server.start()
    channel = grpc.insecure_channel(address)
    try:
        yield channel, relay, agg
    finally:
        channel.close()
        shutdown.request("test done")
        relay.close()
        agg.close()
        server.stop(None).wait()


def raw_call(channel: grpc.Channel, path: str, messages: list[bytes]) -> grpc.RpcError | None:
    """Call ``path`` ("/hypertrain.v1.Relay/PushDelta") sending ``messages`` as they are
    (bytes, no serializer; a call with a unary request sends the first), stating this
    build's wire format; the error it ended with, or None.  Its kind (streamed request or
    reply) is read from the .proto."""
    from hypertrain.v1 import hypertrain_pb2 as pb
    from hypertrain.wire.wireformat import FORMAT_METADATA

    service, name = path.strip("/").rsplit("/", 1)
    method = pb.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]].methods_by_name[name]
    raw = {"request_serializer": None, "response_deserializer": None}
    try:
        if method.client_streaming:
            channel.stream_unary(path, **raw)(iter(messages), timeout=30, metadata=FORMAT_METADATA)
        elif method.server_streaming:
            list(
                channel.unary_stream(path, **raw)(messages[0], timeout=30, metadata=FORMAT_METADATA)
            )
        else:
            channel.unary_unary(path, **raw)(messages[0], timeout=30, metadata=FORMAT_METADATA)
    except grpc.RpcError as e:
        return e
    return None


class Cluster:
    """Starts daemons for one run config in a temp folder; stops them all at teardown."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run.toml").write_text(config_toml(cfg))
        self.progress = Progress(cfg, quiet=True)
        self.children: list[Child] = []

    def spawn(self, name: str, module: str, *args: str) -> Child:
        """Start a daemon; plaintext (``--insecure``) unless ``args`` give a certificate."""
        tls = () if "--tls-cert" in args else ("--insecure",)
        argv = python_module(module, "--config", str(self.run_dir / "run.toml"), *tls, *args)
        child = Child(
            name, argv, self.run_dir / "logs" / f"{name}.log", self.progress.on_event, child_env()
        )
        self.children.append(child)
        return child

    def again(self, child: Child, name: str) -> Child:
        """Start ``child``'s command again, as ``name`` (its log ``logs/<name>.log``)."""
        again = Child(
            name, child.argv, self.run_dir / "logs" / f"{name}.log", self.progress.on_event,
            child_env(),
        )  # fmt: skip
        self.children.append(again)
        return again

    def spawn_region(
        self, region: str = "eu", keys: Path | None = None, tls: bool = False, sign: bool = True
    ) -> Child:
        """The aggregator and ``region``'s relay, from the key folder ``keys`` (None:
        neither signing nor TLS): each with its signing key unless not ``sign`` (then
        unsigned, no tape, no keys pinned), and with ``tls`` its certificate (else
        plaintext); returns the relay, listening."""

        def signed(name: str) -> tuple[str, ...]:
            if keys is None:
                return ()
            key = ("--signing-key", str(keys / f"{name}.key")) if sign else ()
            return (*key, "--tls-cert", str(cert_path(keys, name))) if tls else key

        agg = self.spawn(
            "aggregator",
            "hypertrain.aggregator",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(self.run_dir / "aggregator"),
            *signed("aggregator"),
        )
        relay = self.spawn(
            f"relay-{region}",
            "hypertrain.relay",
            "--region",
            region,
            "--aggregator",
            agg.wait_listening(timeout=300),
            "--state-dir",
            str(self.run_dir / f"relay-{region}"),
            *signed(f"relay-{region}"),
        )
        relay.wait_listening(timeout=300)
        return relay

    def run_all(
        self, timeout_s: float = 300, island_ranks: dict[str, int] | None = None
    ) -> Child | None:
        """Start the whole cluster and wait for it; returns a failed child or None."""
        self.children.extend(
            start_cluster(self.cfg, self.run_dir, self.progress, island_ranks=island_ranks)
        )
        return supervise(self.children, deadline_s=timeout_s)

    def kill_island_and_restart(
        self, island: str, ready: Callable[[str], bool], timeout_s: float = 300
    ) -> Child:
        """Start the whole cluster, SIGKILL ``island`` ("eu-1") once its log text
        satisfies ``ready``, start it again with the same flags, and wait until every
        other process ended cleanly; returns the restarted island (AssertionError when a
        process fails or the run does not end in time)."""
        self.children.extend(start_cluster(self.cfg, self.run_dir, self.progress))
        victim = next(c for c in self.children if c.name == f"island-{island}")
        log = victim.log_path
        deadline = time.monotonic() + timeout_s
        while not ready(log.read_text()):
            assert time.monotonic() < deadline and victim.proc.poll() is None
            time.sleep(0.02)
        victim.proc.kill()
        # killed, not ended on its own first (else the trial would test no resume)
        assert victim.proc.wait() == -signal.SIGKILL, victim.failure_message()
        again = self.again(victim, f"island-{island}-again")
        while any(c.proc.poll() is None for c in self.children if c is not victim):
            assert time.monotonic() < deadline, "run did not finish"
            failed = [
                c for c in self.children if c is not victim and c.proc.poll() not in (None, 0)
            ]
            assert not failed, failed[0].failure_message()
            time.sleep(0.1)
        return again

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(grace=5)


def finished_cluster(cfg: RunConfig, run_dir: Path, timeout_s: float = 300) -> Cluster:
    """Run ``cfg``'s whole cluster in ``run_dir`` to its end (a module fixture's run)."""
    cluster = Cluster(cfg, run_dir)
    try:
        failed = cluster.run_all(timeout_s=timeout_s)
        assert failed is None, failed.failure_message()
    finally:
        cluster.stop()
    return cluster


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[object]:
    made: list[Cluster] = []

    def make(cfg: RunConfig, name: str = "run") -> Cluster:
        c = Cluster(cfg, tmp_path / name)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
