"""A delta larger than 64 MiB streams in chunks to a real relay, arrives intact, memory bounded."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.model import build_model, count_parameters
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.chunks import CHUNK_BYTES
from hypertrain.wire.client import connect, push_delta, relay_stub
from tests.integration.conftest import Cluster

#: What a relay may hold besides one copy of the payload (see the assertion).  Under half
#: the payload, so a second copy of it (or a decoded fp32 one) still fails the test.
SLACK_BYTES = 96 << 20

CFG = RunConfig.from_dict(
    {
        "model": "gpt-125m",
        "steps": 20,
        "holdout_windows": 1,
        "regional_codec": "int8",
        "topology": {"regions": ["eu"], "islands_per_region": 2, "h_r": 10, "h_g": 20},
    }
)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_large_delta_streams_intact_with_bounded_relay_memory(tmp_path: Path) -> None:
    numel = count_parameters(build_model(CFG.model))
    g = torch.Generator().manual_seed(0)
    blob = make_codec("int8").encode(torch.randn(numel, generator=g) * 1e-3)
    assert len(blob) > 64 * 2**20 and len(blob) > 16 * CHUNK_BYTES
    cluster = Cluster(CFG, tmp_path / "run")
    try:
        relay = cluster.spawn_region("eu")
        stub = relay_stub(connect(relay.wait_listening(timeout=300)))
        pid = relay.proc.pid
        before = _rss(pid)
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss(pid))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        header = pb.TransferHeader(
            run_id=CFG.run_id,
            round=0,
            sync_step=10,
            sender="eu-0",
            digest=blob_digest(blob),
            size=len(blob),
            codec="int8:block=256",
        )
        ack = push_delta(stub.PushDelta, header, blob, timeout=300)
        done.set()
        sampler.join()
    finally:
        cluster.stop()
    assert ack.digest == blob_digest(blob) and not ack.duplicate
    stored = cluster.run_dir / "relay-eu" / "published" / ack.digest
    assert stored.read_bytes() == blob
    grown = peak[0] - before
    # One copy of the payload (receive buffer or page cache of the spool file), the
    # region's sum that the accepted delta is added to at once (RegionCore.offer: one
    # fp32 model, which the relay holds at its commit anyway) and a fixed slack (chunks
    # in flight, gRPC's buffers, the heap the allocator keeps:
    # options.TRIM_THRESHOLD_BYTES); never one copy per chunk in flight, never a second
    # decoded fp32 copy.  Measured before the early sum: 148-194 MiB for this 120 MiB
    # delta, over six runs: the old 64 MiB slack failed now and then (how many chunks
    # gRPC holds in flight varies from run to run).
    summed = 4 * numel
    assert grown < len(blob) + summed + SLACK_BYTES, (
        f"relay RSS grew {grown / 2**20:.0f} MiB for a {len(blob) / 2**20:.0f} MiB delta "
        f"and a {summed / 2**20:.0f} MiB sum"
    )
