"""End-to-end sync with the real daemons on loopback, as ratios to raw TCP in the same run.

    .venv/bin/python bench/bench_sync_scale.py                      # P = 1e8, parts A and B
    .venv/bin/python bench/bench_sync_scale.py --quick              # P = 1e7: a smoke run
    .venv/bin/python bench/bench_sync_scale.py --part A --params 1e9 --json out.json
    .venv/bin/python bench/bench_sync_scale.py --part B --keep /tmp/runs -v

Baseline: the bytes on the sync's path sent over a loopback TCP socket (``sendall`` from
a thread, ``recv_into`` a preallocated buffer, as bench/bench_transport.py does), at the
rate measured in the same run on a 256 MiB buffer (best of 3): baseline time = bytes /
rate.  Every figure is a ratio to that; no absolute time is claimed.

Part A, ``relay_e2e`` (figure: ``relay_e2e_over_tcp``): one real aggregator and one real
relay process (``python -m hypertrain.aggregator`` / ``hypertrain.relay``, flags as
``hypertrain up`` gives them), and ``--islands`` n_r synthetic islands in one region, each
its own process.  No training: each island encodes random deltas (fixed seeds) of P
parameters with the regional codec (``--codec``; ``all``: int8 and sparseloco+zstd),
signs them as the island daemon does, connects, and waits at a start barrier.  Per global
round (h_r = h_g = 1, steps = 2; round 1 includes the warm-up, round 2 is the figure)
every island pushes its delta (``Patient(GrpcUpstream)``) and fetches the global merge;
timed from the first push's start to the last island holding the merge.  Bytes on the
path: n_r deltas island -> relay, the relay's fp32 forward (4P + header), the merge
aggregator -> relay (4P) and relay -> each island (n_r * 4P).

Part B, ``sync_wall`` (figure: ``sync_wall_over_tcp``, the worst case): real island
daemons training a P-parameter custom model (batch 1, sequence 64), one level
(h_r = h_g = 2, steps = 6, tau = 0), regional codec fp32 and int8 (``--codec`` is part
A's only), topologies 1 region x 2 islands and 2 regions x 1 island, started as
``hypertrain up`` starts them (entry/up.py ``start_cluster``).  Each island logs
``event=sync ... sync_s=`` per non-final sync (from the end of its training of the sync
step to the start of the next step; the table splits it into push_wait, fetch and the
rest: applying the merge and saving the rejoin state); the figure is the median over
islands of the syncs after the first.  Bytes on the critical path: one island's delta +
the relay's forward (4P + header) + the merge aggregator -> relay (4P) + relay -> island
(4P).  A second table splits those syncs by the daemons' log times (``ts=``,
``split_skew``): the wait for the round's last island to finish training the step (no sync
starts before every delta exists), then up to the relay's commit, then the rest, and that
rest again at the aggregator's log line of its round (after its commit): the forward and
the outer step, then the merge's way back to the island and applying it; the figure less
that wait is ``sync_wall_net_over_tcp``.

Peak RSS of every daemon (max of VmHWM and VmRSS from /proc/<pid>/status, polled every
0.1 s) is reported in bytes and as a multiple of m = 4P, the fp32 model size, beside the
largest RssAnon polled (anonymous memory only: VmHWM also counts the page cache of files
a daemon reads through a mapping, such as the spooled inputs it decodes).
Targets: relay_e2e_over_tcp <= 2.0 (int8), sync_wall_over_tcp <= 4.0, relay peak <=
2m + 64 MiB, aggregator peak <= 3m + 256 MiB, island peak (part B) <= 5m + 512 MiB.

Floors: how low a ratio can go on this machine, also measured in the same run (before
the runs and again after them, the better measurement of each piece kept).  The
durable writes on the path at the measured disk rate (``disk_rate``), and the work no sync
can skip at this machine's core costs (``CoreCosts``: moving the bytes through gRPC, both
ends, at gRPC's own cost per byte measured in the same run (``grpc_cost``: more than a bare
socket's), a content digest by each sender and each receiver, encoding, decoding and adding, the outer step, applying the
merge) spread over every core with none idle.  Part A's window holds all of its work;
part B's, for each sync, is what must be done before the first of its islands, all
syncing at the same step, can have the merge (``CoreCosts.sync``), less what could have
been done before that island's end of training, or the last island's own path after its
end, whichever is more (``sync_floors``).  A target below the larger
floor is out of reach here, whatever the code does; the tables mark it FLOOR.  Beside it,
``serial``: the same work and writes (in part B, every island's) done one after another on
one core; a ratio above that is spent on work the floor does not count, or on waiting.

Measured beside the floors (part B, ``sync_cpu``): in each sync's window, from /proc, the
CPU seconds every daemon used (the relays', the aggregator's, the islands') and the
machine's busy cores, and ``cpu_bound_over_tcp``: those seconds spread over every core,
over the TCP time, the lowest ratio the work the daemons actually did allows however it
overlapped (never above the ratio: how close it comes is the share of the cores the
daemons kept busy).  Where it is near the ratio, the sync is bound
by the work done (more than the floor counts: writing the spool and the checkpoints,
checking payloads, the kernel's socket and page-cache copies), and only doing less lowers it.
``--cases fp32-1x2,...`` runs only those part B cases.

The bench refuses (exit 2, one line) when MemAvailable is short of its estimate for the
requested P (at 1e8 it estimates ~5.5 GiB for part A, ~8.4 GiB for part B; at 1e9 ~40
and ~69 GiB), or when the run folders would not fit on the disk.  It stops every process it started (also on Ctrl-C, SIGTERM or an error) and
removes each run folder (several GB of spooled deltas and checkpoints at 1e8) after its
run unless ``--keep DIR``.  ``-v`` echoes the daemons' round / global / eval / sync log
lines as they come.  Exit status 1 when a target is missed that the floors do not
put out of reach.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
from bench_transport import Server, tcp_once  # this folder is on sys.path when run as a script

from hypertrain.common.config import RunConfig, TopologyConfig
from hypertrain.common.model import ModelConfig
from hypertrain.common.shards import relay_member
from hypertrain.common.trust.keys import daemon_key_names, init_keys
from hypertrain.common.trust.ledger import relay_key
from hypertrain.procs import Child, child_env, parse_logfmt, python_module

MIB = 1 << 20
TARGET_RELAY_E2E = 2.0
TARGET_SYNC_WALL = 4.0
#: Part B's cases (``--cases``): codec, then regions x islands per region.
PART_B_CASES = ("fp32-1x2", "fp32-2x1", "int8-1x2", "int8-2x1")
#: (multiple of m, constant bytes) of each daemon's peak-RSS target.
RSS_LIMITS: dict[str, tuple[float, int]] = {
    "relay": (2.0, 64 * MIB),
    "aggregator": (3.0, 256 * MIB),
    "island": (5.0, 512 * MIB),
}
#: Peak RSS per process, (multiple of m, constant), fitted with some room to the peaks this
#: bench measured at P = 1e8 and 2.7e8 on the 2-core box (experiments/results/
#: bench_sync_scale*.json; part A islands are the synthetic ones; the interpreter alone
#: holds ~250 MiB).  The refusal adds them up for every process of the larger run of a
#: part, times ``MEM_CONCURRENT``: the processes do not peak at the same moment (the
#: lowest MemAvailable seen was 0.7-0.77 of the sum of the peaks).
MEM_MODEL: dict[str, tuple[float, int]] = {
    "a_island": (1.7, 350 * MIB),
    "a_relay": (2.5, 400 * MIB),  # SparseLoCo inputs: ~200 MiB more at 1e8
    "a_aggregator": (3.3, 450 * MIB),
    "b_island": (7.0, 500 * MIB),
    "b_relay": (2.5, 400 * MIB),
    "b_aggregator": (3.3, 450 * MIB),
}
MEM_CONCURRENT = 0.8
#: Disk one run folder may take, in units of m (measured: up to 30m, part B 2x1 fp32).
DISK_PER_RUN_M = 32
RUN_ID = "bench-sync-scale"
DAEMON_TIMEOUT_S = 180.0


# -- model shape --------------------------------------------------------------------
def param_count(m: ModelConfig) -> int:
    """Parameters of common/model.py's GPT (tied embeddings, LayerNorms with bias)."""
    d = m.d_model
    per_layer = (3 + 1 + 2 * m.mlp_ratio) * d * d + 4 * d
    return m.vocab_size * d + m.seq_len * d + m.n_layer * per_layer + 2 * d


def shape_for(params: float) -> ModelConfig:
    """A decoder (vocab 256, sequence 64) with about ``params`` parameters."""
    if params < 3e7:
        d, heads = 256, 8
    elif params < 5e8:
        d, heads = 768, 12
    else:
        d, heads = 2048, 16
    one, two = (
        param_count(ModelConfig(n_layer=k, d_model=d, n_head=heads, seq_len=64)) for k in (1, 2)
    )
    per_layer = two - one
    fixed = one - per_layer
    layers = max(1, round((params - fixed) / per_layer))
    return ModelConfig(n_layer=layers, d_model=d, n_head=heads, seq_len=64)


def base_config(mcfg: ModelConfig, topo: TopologyConfig, steps: int, codec: str) -> RunConfig:
    return RunConfig(
        run_id=RUN_ID,
        model="custom",
        model_shape=mcfg,
        steps=steps,
        batch_per_island=1,
        topology=topo,
        regional_codec=codec,
        global_codec="fp32",
        holdout_windows=1,
    )


# -- the TCP baseline ----------------------------------------------------------------
def tcp_rate(size: int, repeats: int) -> tuple[float, float]:
    """Loopback TCP: (bytes per second, best of ``repeats`` after a warm-up; core-seconds
    per byte, the least of the same runs).  Sender and receiver are threads of this
    process, so its CPU time is both ends' work, the kernel's included."""
    data = os.urandom(size)
    buf = bytearray(size)
    best = cpu = float("inf")
    for i in range(repeats + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        tcp_once(data, buf)
        if i:
            best = min(best, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
    return size / best, cpu / size


def grpc_cost(size: int, repeats: int) -> tuple[float, float]:
    """Core-seconds per byte that gRPC itself spends moving bytes between two processes
    on loopback, both ends and the kernel's work for them included, through this build's
    stubs and chunk codec (``CHUNK_BYTES`` parts) and nothing else: (a push the server
    only counts, as bench_transport's push/bare; a merge download the client only
    counts), each the least of ``repeats`` after a warm-up.  Deltas and merges travel
    over gRPC (S1), so no sync here moves a byte for less; ``tcp_rate`` is what the same
    bytes cost a bare socket."""
    from hypertrain.common.digest import blob_digest
    from hypertrain.v1 import hypertrain_pb2 as pb
    from hypertrain.wire.chunks import CHUNK_BYTES, delta_chunks
    from hypertrain.wire.client import connect, relay_stub

    data = os.urandom(size)
    header = pb.TransferHeader(size=size, digest=blob_digest(data), codec="bare")
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(size, CHUNK_BYTES, tmp)
        channel = connect(server.address)
        stub = relay_stub(channel)

        def push() -> None:
            ack = stub.PushDelta(delta_chunks(header, data, chunk_bytes=CHUNK_BYTES))
            assert ack.digest == str(size), ack

        def fetch() -> None:
            parts = stub.FetchMerge(pb.MergeRequest(kind="global"))
            got = sum(len(p) for p in parts if not isinstance(p, pb.MergeChunk))
            assert got == size // 4 * 4, got

        best = {"push": float("inf"), "fetch": float("inf")}
        try:
            for i in range(repeats + 1):
                for name, fn in (("push", push), ("fetch", fetch)):
                    c0, s0 = time.process_time(), server.cpu_s()
                    fn()
                    spent = time.process_time() - c0 + server.cpu_s() - s0
                    if i:
                        best[name] = min(best[name], spent)
        finally:
            channel.close()
            server.close()
    return best["push"] / size, best["fetch"] / (size // 4 * 4)


def disk_rate(size: int, repeats: int, where: Path) -> float:
    """Durable write bytes per second where the run folders go: ``spool.write_file`` (write,
    fsync, link into place, fsync of the folder), what a relay and the aggregator do
    before they acknowledge an input; best of ``repeats``."""
    from hypertrain.wire.spool import write_file

    data = os.urandom(size)
    best = float("inf")
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        for i in range(repeats):
            t0 = time.perf_counter()
            write_file(data, f"floor-{i}", Path(tmp))
            best = min(best, time.perf_counter() - t0)
    return size / best


# -- the work every sync must do: a CPU floor -----------------------------------------
@dataclass(frozen=True)
class CoreCosts:
    """Core-seconds this machine spends on each piece of work a sync cannot skip, per byte
    or per parameter, measured in this run (process CPU time, every thread counted, the
    least of ``FLOOR_REPEATS``; measured before the runs and again after them, and each
    piece's lesser cost taken, ``least``).  The pieces, and who does them:

    - ``tcp``: moving a byte over loopback TCP, both ends (``tcp_rate``), and
      ``grpc_push`` / ``grpc_fetch``: moving it through gRPC itself, pushed or fetched
      (``grpc_cost``).  Deltas and merges travel over gRPC (S1), so a byte moved costs
      the larger of the two (``moving``);
    - ``digest``: hashing a byte (BLAKE3, ``common/digest.py``).  Every payload is
      digested once by its sender (an island signs its delta's digest, a relay its
      forward's, the aggregator commits to its merge's) and every transfer again by its
      receiver, which checks it against that digest (docs/design.md; the peer may be hostile);
    - ``encode``: an island's regional codec with error feedback, per parameter;
    - ``decode_acc``: adding one encoded input into a sum, per parameter (a relay per
      island delta, the aggregator per region's fp32 forward);
    - ``outer``: the aggregator's outer step (the run's optimizer), per parameter;
    - ``copy``: an island applying the merge (a copy into its parameters), per byte.

    The floor of a sync is the sum of its pieces over the machine's cores: every core
    busy all the time with only that work, no stage waiting for another.  No run can go
    below it here; the durable writes (``disk_rate``) are a second floor, beside it."""

    tcp: float
    grpc_push: float
    grpc_fetch: float
    digest: float
    copy: float
    outer: float
    encode: dict[str, float]
    decode_acc: dict[str, float]
    cores: int

    def describe(self) -> str:
        """One line of the costs, in core-ns."""
        return (
            f"per byte: TCP (both ends) {self.tcp * 1e9:.2f}, gRPC itself (both ends) pushed "
            f"{self.grpc_push * 1e9:.2f} / fetched {self.grpc_fetch * 1e9:.2f}, digest "
            f"{self.digest * 1e9:.2f}, copy {self.copy * 1e9:.2f}; per parameter: outer step "
            f"{self.outer * 1e9:.2f}, "
            + ", ".join(
                f"{c} encode {self.encode[c] * 1e9:.2f} / decode+add {self.decode_acc[c] * 1e9:.2f}"
                for c in self.encode
            )
        )

    def least(self, other: CoreCosts) -> CoreCosts:
        """Each piece at the lesser of its two measurements (the same pieces in both)."""
        return CoreCosts(
            tcp=min(self.tcp, other.tcp),
            grpc_push=min(self.grpc_push, other.grpc_push),
            grpc_fetch=min(self.grpc_fetch, other.grpc_fetch),
            digest=min(self.digest, other.digest),
            copy=min(self.copy, other.copy),
            outer=min(self.outer, other.outer),
            encode={c: min(v, other.encode[c]) for c, v in self.encode.items()},
            decode_acc={c: min(v, other.decode_acc[c]) for c, v in self.decode_acc.items()},
            cores=self.cores,
        )

    def moving(self, pushed: int, fetched: int) -> float:
        """Core-seconds to move ``pushed`` bytes of deltas and forwards and ``fetched``
        bytes of merges: at the larger of the bare socket's and gRPC's own cost."""
        return max(self.tcp, self.grpc_push) * pushed + max(self.tcp, self.grpc_fetch) * fetched

    def relay_e2e(self, codec: str, n_r: int, P: int, path_bytes: int, fwd_bytes: int) -> float:
        """Part A's window (deltas already encoded and signed): the relay checks n_r
        deltas and adds them, digests its forward; the aggregator checks and adds it,
        steps and digests the merge; the relay and then each island check the merge."""
        hashed = path_bytes + fwd_bytes + 4 * P  # every receiver, plus two senders
        fetched = (n_r + 1) * 4 * P  # the merge to the relay, then to each island
        work = (
            self.moving(path_bytes - fetched, fetched)
            + self.digest * hashed
            + self.decode_acc[codec] * n_r * P
            + self.decode_acc["fp32"] * P
            + self.outer * P
        )
        return work / self.cores

    def sync(self, codec: str, regions: int, n_r: int, P: int, delta: int, fwd: int) -> float:
        """The work before the first island of a part B case can have the merge, over the
        cores: its islands sync at the same step (tau 0), and no merge exists before every
        island's delta is encoded, signed, pushed, checked and added at its relay and every
        region's forward is digested, pushed, checked, added and stepped, and the merge
        digested.  Only the other regions' relays' copies of the merge, and the other
        islands' copies and their applying it, may come after that island's window; its own
        relay's copy and its own may not.  None of it can start before the first island of
        the case ends its training; ``sync_floors`` makes a floor of each sync from it.
        With ``regions = n_r = 1``: one island's own path."""
        return self._sync_work(codec, regions, n_r, P, delta, fwd, 1, 1)

    def sync_all(self, codec: str, regions: int, n_r: int, P: int, delta: int, fwd: int) -> float:
        """Everything every island of the case does when all sync at once (as they do
        here, in step): ``sync`` with every relay's and every island's copy of the merge,
        the work the cores carry until the last island has it."""
        return self._sync_work(codec, regions, n_r, P, delta, fwd, regions, regions * n_r)

    def _sync_work(
        self,
        codec: str,
        regions: int,
        n_r: int,
        P: int,
        delta: int,
        fwd: int,
        relay_copies: int,
        island_copies: int,
    ) -> float:
        """A part B sync of ``regions`` x ``n_r`` islands, every delta and forward made,
        sent and summed, the outer step taken, and the merge fetched by ``relay_copies``
        relays and ``island_copies`` islands (each checks it; each island applies it)."""
        n = regions * n_r
        pushed = n * delta + regions * fwd
        fetched = (relay_copies + island_copies) * 4 * P
        senders = pushed + 4 * P  # each payload digested by its sender, the merge too
        work = (
            self.encode[codec] * n * P
            + self.moving(pushed, fetched)
            + self.digest * (pushed + fetched + senders)
            + self.decode_acc[codec] * n * P
            + self.decode_acc["fp32"] * regions * P
            + self.outer * P
            + self.copy * island_copies * 4 * P
        )
        return work / self.cores


def sync_floors(
    syncs: list[dict[str, Any]],
    used_steps: Sequence[int],
    window_s: float,
    path_s: float,
    chain_s: float,
) -> tuple[float, float]:
    """Part B's floors of the median sync, in seconds: (work, durable writes).

    Each sync (``split_skew`` gave it ``trained``, its end of training, and ``skew_s``)
    lasts at least (a) its wait for the step's last island to end training plus that
    island's own path (``path_s``: its delta, its region's forward, the merge back; the
    others' deltas may have gone before), and (b) ``window_s`` (``CoreCosts.sync``, none of
    which can start before the step's first island ends training) less the time from that
    first end to its own.  Its disk floor is (a) with ``chain_s`` for ``path_s``: the last
    island's delta made durable at its relay, then its region's forward at the aggregator,
    one after the other (other islands' writes may overlap them on the disk).  The floor
    of the median of the syncs is the median of theirs (each sync's time is at least its
    floor, and a median only grows with its elements)."""
    first: dict[int, float] = {}
    for s in syncs:
        first[s["step"]] = min(first.get(s["step"], s["trained"]), s["trained"])
    used = [s for s in syncs if s["step"] in used_steps]
    work = [max(s["skew_s"] + path_s, window_s - (s["trained"] - first[s["step"]])) for s in used]
    disk = [s["skew_s"] + chain_s for s in used]
    return statistics.median(work), statistics.median(disk)


def put_floors(row: dict[str, Any], disk_s: float, cpu_s: float, serial_s: float) -> None:
    """Store a part A round's or a part B case's floors in ``row``, in seconds and over its
    ``tcp_s``: the durable writes, the counted work over every core, the larger of the two
    (the floor), and the same work and writes one after another on one core."""
    tcp = row["tcp_s"]
    row.update(
        disk_s=disk_s,
        cpu_floor_s=cpu_s,
        serial_s=serial_s,
        disk_floor_over_tcp=disk_s / tcp,
        cpu_floor_over_tcp=cpu_s / tcp,
        floor_over_tcp=max(disk_s, cpu_s) / tcp,
        serial_over_tcp=serial_s / tcp,
    )


FLOOR_REPEATS = 3
#: Parameters of the sample each per-parameter cost is measured on (64 MiB of fp32).
FLOOR_SAMPLE = 1 << 24


def core_seconds(fn: Callable[[], object]) -> float:
    """The least process CPU time of ``FLOOR_REPEATS`` calls of ``fn``, after a warm-up."""
    fn()
    best = float("inf")
    for _ in range(FLOOR_REPEATS):
        c0 = time.process_time()
        fn()
        best = min(best, time.process_time() - c0)
    return best


def core_costs(tcp_per_byte: float, grpc: tuple[float, float], codecs: Sequence[str]) -> CoreCosts:
    """Measure ``CoreCosts`` for the regional ``codecs`` (fp32 always) on this machine, each
    the way the daemons run it at its cheapest: into buffers already in memory (no page
    faults of fresh tensors), the outer step a range at a time as the aggregator folds it
    in, an island's lossy encode in its delta's own memory (``consume``), an fp32 delta
    framed where it lies (one pass, ``ErrorFeedback.encode_framed``); on one torch thread,
    which spends the least CPU per unit (two threads add their wake-ups and barriers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the least CPU per unit: no thread wake-ups or barriers
    try:
        return _core_costs(tcp_per_byte, grpc, codecs)
    finally:
        torch.set_num_threads(threads)


def _core_costs(tcp_per_byte: float, grpc: tuple[float, float], codecs: Sequence[str]) -> CoreCosts:
    from hypertrain.common.codec import ErrorFeedback, make_codec
    from hypertrain.common.digest import content_hasher
    from hypertrain.common.outer import OuterConfig, make_outer

    n = FLOOR_SAMPLE
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(n, generator=gen) * 1e-3
    acc = torch.zeros(n)
    work = torch.empty(n)
    raw = delta.numpy().tobytes()
    digest = core_seconds(lambda: content_hasher().update(raw)) / len(raw)
    copy = core_seconds(lambda: work.copy_(delta)) / (4 * n)
    params, out = torch.randn(n, generator=gen), torch.empty(n)
    outer = make_outer(OuterConfig())
    piece = 1 << 20

    def outer_step() -> None:
        outer.begin(n)
        for a in range(0, n, piece):
            outer.step_range(a, params[a : a + piece], delta[a : a + piece], out[a : a + piece])
        outer.end()

    outer_step()  # the momentum's first step is a copy; later ones are not
    per_outer = core_seconds(outer_step) / n
    encode: dict[str, float] = {}
    decode: dict[str, float] = {}
    for spec in dict.fromkeys(["fp32", *codecs]):
        codec = make_codec(spec)
        if codec.lossless:  # framed in place: the one pass encode_framed makes
            encode[spec] = core_seconds(lambda: work.add_(0.0)) / n
        else:
            ef = ErrorFeedback(codec, n)

            def refill_and_encode(ef: ErrorFeedback = ef) -> None:
                # The residual lives on in ``work`` (consume): the refill makes it the
                # delta again, so each call encodes 2x the delta; timing is unaffected.
                work.copy_(delta)
                ef.encode(work, consume=True)

            # less the refill (a copy of 4 bytes per parameter)
            encode[spec] = max(0.0, core_seconds(refill_and_encode) / n - 4 * copy)
        blob = codec.encode(delta)
        decode[spec] = core_seconds(lambda c=codec, b=blob: c.decode_accumulate(b, acc)) / n
    return CoreCosts(
        tcp=tcp_per_byte,
        grpc_push=grpc[0],
        grpc_fetch=grpc[1],
        digest=digest,
        copy=copy,
        outer=per_outer,
        encode=encode,
        decode_acc=decode,
        cores=os.cpu_count() or 1,
    )


# -- observing the daemons ------------------------------------------------------------
def read_rss(pid: int) -> tuple[int, int]:
    """(max(VmHWM, VmRSS), RssAnon) of ``pid`` in bytes ((0, 0) when gone or unreadable).
    RssAnon leaves out mapped file pages (spooled inputs read through a mapping: page
    cache the kernel may drop), which VmHWM counts."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    best = anon = 0
    for line in text.splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            best = max(best, int(line.split()[1]) * 1024)
        elif line.startswith("RssAnon:"):
            anon = int(line.split()[1]) * 1024
    return best, anon


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of ``pid`` so far, in clock ticks (None when gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def read_busy_ticks() -> int:
    """Clock ticks every core of the machine spent busy so far (``/proc/stat``: all but
    idle and iowait), whoever ran: the daemons, the kernel's threads, anything else."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except OSError:
        return 0
    return sum(ticks) - ticks[3] - ticks[4]


@dataclass(frozen=True)
class CpuSample:
    t: float
    """Unix time of the sample."""
    daemons: dict[str, int]
    """CPU clock ticks used so far, per watched process."""
    busy: int
    """``read_busy_ticks``."""


class RssPoller:
    """Polls the peak RSS of named processes every ``period`` seconds on a thread, and
    their CPU time and the machine's (``cpu_in``)."""

    def __init__(self, period: float = 0.1) -> None:
        self.period = period
        self.pids: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self.anon: dict[str, int] = {}
        """Largest RssAnon seen per process (polled: a spike between polls is missed)."""
        self.cpu: list[CpuSample] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self.thread.start()

    def watch(self, name: str, pid: int) -> None:
        with self.lock:
            self.pids[name] = pid
            self.peaks.setdefault(name, 0)
            self.anon.setdefault(name, 0)

    def poll(self) -> None:
        with self.lock:
            for name, pid in self.pids.items():
                peak, anon = read_rss(pid)
                self.peaks[name] = max(self.peaks[name], peak)
                self.anon[name] = max(self.anon[name], anon)
            ticks = {name: read_cpu_ticks(pid) for name, pid in self.pids.items()}
            self.cpu.append(
                CpuSample(
                    time.time(),
                    {name: v for name, v in ticks.items() if v is not None},
                    read_busy_ticks(),
                )
            )

    def cpu_in(self, start: float, end: float) -> dict[str, Any] | None:
        """CPU used between the Unix times ``start`` and ``end`` (from the first samples
        at or after each; None when the samples do not span it): ``seconds`` between
        those samples, ``daemons`` (CPU seconds per watched process that lived through
        it) and ``busy_cores`` (the machine's busy clock ticks over the seconds, in
        cores: what the daemons used and anything else that ran)."""
        with self.lock:
            times = [c.t for c in self.cpu]
            i, j = bisect.bisect_left(times, start), bisect.bisect_left(times, end)
            if j >= len(times) or j <= i:
                return None
            a, b = self.cpu[i], self.cpu[j]
        seconds = b.t - a.t
        return {
            "seconds": seconds,
            "daemons": {
                name: (b.daemons[name] - v) / CLOCK_TICKS
                for name, v in a.daemons.items()
                if name in b.daemons
            },
            "busy_cores": (b.busy - a.busy) / CLOCK_TICKS / seconds,
        }

    def _run(self) -> None:
        while not self.stopped.wait(self.period):
            self.poll()

    def stop(self) -> dict[str, int]:
        self.stopped.set()
        self.thread.join()
        self.poll()
        return dict(self.peaks)


class Events:
    """Parsed log events of the daemons, with the wall-clock time they were read."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.cond = threading.Condition()
        self.items: list[tuple[float, str, dict[str, str]]] = []

    def on_event(self, source: str, e: dict[str, str]) -> None:
        t = time.time()
        with self.cond:
            self.items.append((t, source, e))
            self.cond.notify_all()
        if self.verbose and e.get("event") in ("round", "global", "eval", "sync", "error"):
            fields = " ".join(f"{k}={v}" for k, v in e.items())
            print(f"    [{source}] {fields}", flush=True)

    def find(self, source: str, event: str, **match: object) -> tuple[float, dict[str, str]] | None:
        with self.cond:
            for t, s, e in self.items:
                if (
                    s == source
                    and e.get("event") == event
                    and all(e.get(k) == str(v) for k, v in match.items())
                ):
                    return t, e
        return None

    def wait_for(
        self, source: str, event: str, timeout: float, alive: Callable[[], bool], **match: object
    ) -> tuple[float, dict[str, str]] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive():
            got = self.find(source, event, **match)
            if got is not None:
                return got
            with self.cond:
                self.cond.wait(0.2)
        return self.find(source, event, **match)


class Cluster:
    """The daemons of one run, started as ``hypertrain up`` starts them (entry/up.py
    ``start_cluster``: same modules, flags and island priority), each recorded the moment
    it starts, so that ``stop`` ends every one even when starting the others failed."""

    def __init__(self, cfg: RunConfig, run_dir: Path, events: Events, poller: RssPoller) -> None:
        from hypertrain.up import config_toml

        self.cfg = cfg
        self.run_dir = run_dir
        self.events = events
        self.poller = poller
        self.children: list[Child] = []
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run.toml").write_text(config_toml(cfg))
        init_keys(run_dir / "keys", daemon_key_names(cfg.topology))

    def identity(self, name: str) -> tuple[str, ...]:
        """Daemon ``name``'s key and transport flags.  Plaintext, as the results this
        bench keeps were measured (its islands are in-process clients);
        bench_transport.py --tls measures what TLS costs."""
        return ("--signing-key", str(self.run_dir / "keys" / f"{name}.key"), "--insecure")

    def place(self, name: str) -> list[str]:
        """The command daemon ``name`` runs under (none: this host, as it is)."""
        return []

    def spawn(self, name: str, module: str, *args: str, nice: int = 0) -> Child:
        d = self.run_dir
        flags = ("--config", str(d / "run.toml"), "--metrics-port", "0", *self.identity(name))
        argv = [*self.place(name), *python_module(module, *flags, *args)]
        log = d / "logs" / f"{name}.log"
        child = Child(name, argv, log, self.events.on_event, child_env(), nice=nice)
        self.children.append(child)
        self.poller.watch(name, child.proc.pid)
        return child

    def start(self, islands: bool) -> dict[str, str]:
        """Aggregator, one relay per region (or its ``relay_shards`` shards) and
        (``islands``) every island; returns the relays' addresses by region (a shard's
        in shard order, comma-separated, as islands take them)."""
        from hypertrain.up import ISLAND_NICE

        d, listen = self.run_dir, ("--listen", "127.0.0.1:0")
        agg = self.spawn(
            "aggregator", "hypertrain.aggregator", *listen, "--state-dir", str(d / "aggregator")
        )
        agg_addr = agg.wait_listening(DAEMON_TIMEOUT_S)
        count = self.cfg.topology.relay_shards
        relays: dict[str, list[Child]] = {}
        for r in sorted(self.cfg.topology.regions):
            for i in range(count):
                name = relay_key(relay_member(r, i, count))
                relays.setdefault(r, []).append(
                    self.spawn(
                        name,
                        "hypertrain.relay",
                        *("--region", r, "--aggregator", agg_addr, *listen),
                        *(("--shard", f"{i}/{count}") if count > 1 else ()),
                        *("--state-dir", str(d / name)),
                    )
                )
        addrs = {
            r: ",".join(c.wait_listening(DAEMON_TIMEOUT_S) for c in cs) for r, cs in relays.items()
        }
        for island in self.cfg.topology.island_ids() if islands else ():
            region, _, index = island.rpartition("-")
            self.spawn(
                f"island-{island}",
                "hypertrain.island",
                *("--region", region, "--index", index, "--relay", addrs[region]),
                *("--state-dir", str(d / f"island-{island}")),
                nice=ISLAND_NICE,
            )
        return addrs

    def stop(self) -> None:
        for c in reversed(self.children):
            c.stop()


def wait_exit(children: Sequence[Child], timeout: float) -> None:
    """Wait up to ``timeout`` for the children to end by themselves (a finished run)."""
    deadline = time.monotonic() + timeout
    for c in children:
        with contextlib.suppress(subprocess.TimeoutExpired):  # the caller stops it
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))


# -- part A: the synthetic islands -----------------------------------------------------
def island_worker(
    conn: Connection, cfg: RunConfig, island_id: str, seed: int, relay: str, key_path: str
) -> None:
    """Child process: encode and sign every round's delta (one part per relay shard),
    connect, then per "go" push it and fetch the round's global merge (every shard's part
    at once, joined as the island daemon joins them), answering with wall-clock times."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    try:
        from hypertrain.common.codec import make_codec
        from hypertrain.common.rounds.machines import Delta
        from hypertrain.common.schedule import Schedule
        from hypertrain.common.trust.keys import load_signing_key
        from hypertrain.wire.daemon import die_with_parent
        from hypertrain.wire.peers import relay_peer
        from hypertrain.wire.upstream import GrpcUpstream, Patient

        die_with_parent()
        torch.set_num_threads(1)
        numel = param_count(cfg.model_config())
        shards = cfg.shards(numel)
        bounds = shards.all_bounds()
        codec = make_codec(cfg.regional_codec)
        schedule = Schedule.of(cfg)
        key = load_signing_key(key_path)
        t0 = time.perf_counter()
        deltas = []
        for step in range(1, cfg.steps + 1):
            gen = torch.Generator().manual_seed(1000 * seed + step)
            x = torch.randn(numel, generator=gen).mul_(1e-3)
            # Shard boundaries are codec units: each part is the matching part of the
            # whole's encoding (what an island's encode_parts sends).
            blobs = (
                [codec.encode(x[a:b]) for a, b in bounds] if shards.sharded else [codec.encode(x)]
            )
            del x
            parts = []
            for i, blob in enumerate(blobs):
                d = Delta.of(
                    cfg.run_id, step, island_id, str(codec.spec), blob, schedule, shards.label(i)
                )
                parts.append(d.signed(key.sign(d.transfer_message())))
            deltas.append(parts)
        encode_s = time.perf_counter() - t0
        peers = [relay_peer(r) for r in relay.split(",")]
        upstreams = [
            Patient(GrpcUpstream(peer, cfg.run_id, b - a), f"Relay {peer.address}", lambda: False)
            for peer, (a, b) in zip(peers, bounds, strict=True)
        ]
        pool = ThreadPoolExecutor(max_workers=len(upstreams))
        conn.send(("ready", encode_s, [sum(len(d.data) for d in ds) for ds in deltas]))
        for ds in deltas:
            if conn.recv() != "go":
                break
            t_push = time.time()
            list(pool.map(lambda u, d: u.push(d), upstreams, ds))
            t_pushed = time.time()
            step = ds[0].sync_step
            got = list(
                pool.map(lambda u, s: u.fetch(island_id, s, "global"), upstreams, [step] * len(ds))
            )
            merge = got[0].payload if len(got) == 1 else torch.cat([g.payload for g in got])
            t_have = time.time()
            if merge.numel() != numel:
                raise RuntimeError(f"merge of {merge.numel()} values, expected {numel}")
            del got, merge
            conn.send(("done", t_push, t_pushed, t_have))
        pool.shutdown()
        for peer in peers:
            peer.close()
        conn.send(("bye", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class Islands:
    """The synthetic islands (spawned processes) and their pipes."""

    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []

    def start(self, cfg: RunConfig, relay: str, keys: Path) -> None:
        ctx = mp.get_context("spawn")
        for k, island in enumerate(cfg.topology.island_ids()):
            parent, child = ctx.Pipe()
            key = str(keys / f"island-{island}.key")
            proc = ctx.Process(
                target=island_worker, args=(child, cfg, island, k, relay, key), daemon=True
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def gather(self, tag: str, timeout: float, daemons: Sequence[Child]) -> list[tuple[Any, ...]]:
        """One message ``(tag, ...)`` from every island; RuntimeError naming what failed."""
        got: dict[int, tuple[Any, ...]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(self.conns):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"synthetic islands: no {tag!r} within {timeout:.0f}s")
            pending = [c for i, c in enumerate(self.conns) if i not in got]
            for ready in wait(pending, timeout=min(left, 0.5)):
                i = next(k for k, c in enumerate(self.conns) if c is ready)
                try:
                    msg: tuple[Any, ...] = self.conns[i].recv()
                except EOFError:
                    raise RuntimeError(f"synthetic island {i} died") from None
                if msg[0] != tag:
                    detail = msg[1] if msg[0] == "error" else repr(msg)
                    raise RuntimeError(f"synthetic island {i}: expected {tag!r}, got:\n{detail}")
                got[i] = msg
            for d in daemons:
                if d.proc.poll() is not None and d.proc.returncode != 0:
                    raise RuntimeError(d.failure_message())
        return [got[i] for i in range(len(self.conns))]

    def send(self, msg: str) -> None:
        """Send ``msg`` to every island; one that has ended is skipped (a worker that ran
        all its rounds says "bye" and exits without waiting for "stop"; what it sent
        before is still read by ``gather``)."""
        for c in self.conns:
            with contextlib.suppress(ConnectionError):  # BrokenPipe, ConnectionReset
                c.send(msg)

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()


def run_relay_e2e(
    mcfg: ModelConfig,
    n_r: int,
    codec: str,
    run_dir: Path,
    rate: float,
    verbose: bool,
    shards: int = 1,
) -> dict[str, Any]:
    """Part A for one codec: per-round times, ratios, the daemons' peak RSS and phases;
    ``shards``: the region's relay runs as that many processes (``--shard i/S``)."""
    topo = TopologyConfig(
        regions=("eu",), islands_per_region=n_r, h_r=1, h_g=1, tau=0, relay_shards=shards
    )
    cfg = base_config(mcfg, topo, 2, codec)
    P = param_count(mcfg)
    names = [relay_key(m) for m in cfg.shards(P).members(("eu",))]
    events = Events(verbose)
    poller = RssPoller()
    cluster = Cluster(cfg, run_dir, events, poller)
    daemons = cluster.children
    islands = Islands()
    rounds: list[dict[str, Any]] = []
    try:
        relay_addr = cluster.start(islands=False)["eu"]
        agg, relays = daemons[0], daemons[1:]
        islands.start(cfg, relay_addr, run_dir / "keys")
        for k, p in enumerate(islands.procs):
            assert p.pid is not None
            poller.watch(f"island-{k}", p.pid)
        ready = islands.gather("ready", 1800, daemons)
        delta_bytes = [list(m[2]) for m in ready]
        # The aggregator evaluates the initial state at start: let it finish first.
        events.wait_for("aggregator", "eval", 600, lambda: agg.proc.poll() is None, step=0)
        for step in range(1, cfg.steps + 1):
            islands.send("go")
            done = islands.gather("done", 1800, daemons)
            t_start = min(m[1] for m in done)
            t_pushed = max(m[2] for m in done)
            t_end = max(m[3] for m in done)
            fwds = [
                events.wait_for(name, "global", 30, lambda r=r: r.proc.poll() is None, step=step)
                for name, r in zip(names, relays, strict=True)
            ]
            fwd_bytes = sum(int(f[1]["bytes"]) if f else 4 * P // shards + 64 for f in fwds)
            fwd = fwds[-1]
            pushed = sum(b[step - 1] for b in delta_bytes)
            path_bytes = pushed + fwd_bytes + 4 * P + n_r * 4 * P
            tcp_s = path_bytes / rate
            # Acknowledged only once on disk: the islands' deltas at the relay, then the
            # forward at the aggregator, one after the other.
            durable_bytes = pushed + fwd_bytes
            seconds = t_end - t_start
            phases: dict[str, float] = {"islands_pushed": t_pushed - t_start}
            for name, source, event in (
                ("relay_committed", names[-1], "round"),
                ("aggregator_committed", "aggregator", "round"),
                ("relay_has_global", names[-1], "global"),
            ):
                hit = events.find(source, event, step=step)
                if hit is not None:
                    phases[name] = hit[0] - t_start
            phases["islands_have_global"] = seconds
            if fwd:
                phases["relay_forward_s"] = float(fwd[1]["seconds"])
            agg_round = events.find("aggregator", "round", step=step)
            if agg_round:
                phases["aggregator_round_s"] = float(agg_round[1]["seconds"])
            rounds.append(
                {
                    "step": step,
                    "seconds": seconds,
                    "path_bytes": path_bytes,
                    "delta_bytes": pushed // n_r,
                    "forward_bytes": fwd_bytes,
                    "tcp_s": tcp_s,
                    "ratio": seconds / tcp_s,
                    "durable_bytes": durable_bytes,
                    "phases": {k: round(v, 4) for k, v in phases.items()},
                }
            )
        islands.send("stop")
        bye = islands.gather("bye", 60, daemons)
        wait_exit(daemons, 120)  # a finished run ends both daemons
    finally:
        islands.stop()
        cluster.stop()
        peaks = poller.stop()
    codes = {d.name: d.proc.returncode for d in daemons}
    island_peak = max(max(peaks.get(f"island-{k}", 0) for k in range(n_r)), *(m[1] for m in bye))
    return {
        "codec": codec,
        "islands": n_r,
        "shards": shards,
        "rounds": rounds,
        "ratio": rounds[-1]["ratio"],
        "exit_codes": codes,
        "peak_rss": {
            "relay": max(peaks[n] for n in names),  # per process (each shard's own)
            "relay_all_shards": sum(peaks[n] for n in names),
            "aggregator": peaks["aggregator"],
            "synthetic_island": island_peak,
        },
        "peak_anon": {
            "relay": max(poller.anon[n] for n in names),
            "aggregator": poller.anon["aggregator"],
        },
        "encode_s_per_island": [round(m[1], 3) for m in ready],
        "log_lines": daemon_lines(run_dir, (*names, "aggregator")),
    }


def daemon_lines(run_dir: Path, names: Sequence[str]) -> dict[str, list[str]]:
    """The round / global / eval / warning / error lines of the daemons' logs."""
    out: dict[str, list[str]] = {}
    for name in names:
        path = run_dir / "logs" / f"{name}.log"
        lines = path.read_text().splitlines() if path.exists() else []
        keep = ("round", "global", "eval", "final", "warning", "error", "stopped", "waiting")
        out[name] = [ln for ln in lines if parse_logfmt(ln).get("event") in keep]
    return out


# -- part B: real islands ---------------------------------------------------------------
def log_seconds(e: dict[str, str]) -> float:
    """A log line's ``ts`` (services/wire/daemon.py ``log_time``) as a Unix time."""
    return dt.datetime.fromisoformat(e["ts"]).timestamp()


def split_skew(
    syncs: list[dict[str, Any]], commits: dict[int, float], steps: dict[int, float] | None = None
) -> None:
    """Add to each sync of part B (each with ``step``, ``sync_s`` and ``end``, the Unix
    time of its log line) what of it was waiting for the round's other islands to finish
    training the step (``skew_s``: the last island's end of training less its own; no
    sync can start before every delta exists), the rest (``net_s``), and of that the part
    up to the relay's commit of the step (``to_commit_s``; ``commits``: step -> time of
    the relay's ``event=round`` line, the latest relay's with several regions) and after
    it (``after_commit_s``); and that again at the aggregator's log line of its round
    (``steps``: step -> time of its ``event=round`` line): the forward and the outer step
    (``forward_step_s``), then the merge's way back to the island and its applying it
    (``back_s``)."""
    trained: dict[int, float] = {}
    for s in syncs:
        s["trained"] = s["end"] - s["sync_s"]
        trained[s["step"]] = max(trained.get(s["step"], s["trained"]), s["trained"])
    for s in syncs:
        last = trained[s["step"]]
        s["skew_s"] = last - s["trained"]
        s["net_s"] = s["sync_s"] - s["skew_s"]
        if s["step"] in commits:
            s["to_commit_s"] = commits[s["step"]] - last
            s["after_commit_s"] = s["net_s"] - s["to_commit_s"]
            if steps and s["step"] in steps:
                s["forward_step_s"] = steps[s["step"]] - commits[s["step"]]
                s["back_s"] = s["after_commit_s"] - s["forward_step_s"]


def run_sync_wall(
    mcfg: ModelConfig,
    regions: tuple[str, ...],
    n_r: int,
    codec: str,
    run_dir: Path,
    rate: float,
    verbose: bool,
    timeout: float,
    *,
    make_cluster: Callable[[RunConfig, Path, Events, RssPoller], Cluster] = Cluster,
) -> dict[str, Any]:
    """Part B for one case: the islands' sync_s, ratios and every daemon's peak RSS.
    ``make_cluster``: starts the daemons some other way (default: ``Cluster``, on
    loopback); ``rate`` is then the rate of the bytes' path that the ratio is against."""
    from hypertrain.up import supervise

    topo = TopologyConfig(regions=regions, islands_per_region=n_r, h_r=2, h_g=2, tau=0)
    cfg = base_config(mcfg, topo, 6, codec)
    P = param_count(mcfg)
    events = Events(verbose)
    poller = RssPoller()
    cluster = make_cluster(cfg, run_dir, events, poller)
    t0 = time.perf_counter()
    try:
        cluster.start(islands=True)
        failed = supervise(cluster.children, deadline_s=timeout)
        if failed is not None:
            raise RuntimeError(failed.failure_message())
    finally:
        cluster.stop()
        peaks = poller.stop()
    wall = time.perf_counter() - t0
    syncs: list[dict[str, Any]] = []
    for log in sorted((run_dir / "logs").glob("island-*.log")):
        for line in log.read_text().splitlines():
            e = parse_logfmt(line)
            if e.get("event") == "sync":
                syncs.append(
                    {
                        "island": e["island"],
                        "step": int(e["step"]),
                        "sync_s": float(e["sync_s"]),
                        "push_wait_s": float(e["push_wait_s"]),
                        "fetch_s": float(e["fetch_s"]),
                        # applying the merge and saving the rejoin state
                        "rest_s": float(e["sync_s"])
                        - float(e["push_wait_s"])
                        - float(e["fetch_s"]),
                        "bytes": int(e["bytes"]),
                        "end": log_seconds(e),
                    }
                )
    if not syncs:
        raise RuntimeError(f"no event=sync lines in {run_dir / 'logs'}")
    commits: dict[int, float] = {}
    steps: dict[int, float] = {}
    for _, src, e in events.items:
        if src.startswith("relay-") and e.get("event") == "round":
            step = int(e["step"])
            commits[step] = max(commits.get(step, 0.0), log_seconds(e))
        elif src == "aggregator" and e.get("event") == "round":
            steps[int(e["step"])] = log_seconds(e)
    split_skew(syncs, commits, steps)
    first = min(s["step"] for s in syncs)
    used = [s for s in syncs if s["step"] != first] or syncs
    sync_s = statistics.median(s["sync_s"] for s in used)
    delta_bytes = int(statistics.median(s["bytes"] for s in used))
    fwd = [
        int(e["bytes"])
        for _, src, e in events.items
        if src.startswith("relay-") and e.get("event") == "global"
    ]
    fwd_bytes = max(fwd) if fwd else 4 * P + 64
    tcp_s = (delta_bytes + fwd_bytes + 8 * P) / rate
    relays = [v for k, v in peaks.items() if k.startswith("relay-")]
    islands = [v for k, v in peaks.items() if k.startswith("island-")]
    names = [c.name for c in cluster.children]
    cpu = sync_cpu(used, poller, tcp_s)
    return {
        "case": f"{codec} {len(regions)}x{n_r}",
        "codec": codec,
        "regions": len(regions),
        "islands_per_region": n_r,
        "syncs": syncs,
        "used_steps": sorted({s["step"] for s in used}),
        "median_sync_s": sync_s,
        "median_push_wait_s": statistics.median(s["push_wait_s"] for s in used),
        "median_fetch_s": statistics.median(s["fetch_s"] for s in used),
        "median_rest_s": statistics.median(s["rest_s"] for s in used),
        # the same syncs less the wait for the round's last island to finish training
        "median_skew_s": statistics.median(s["skew_s"] for s in used),
        "median_net_s": statistics.median(s["net_s"] for s in used),
        "net_ratio": statistics.median(s["net_s"] for s in used) / tcp_s,
        "median_to_commit_s": statistics.median(s.get("to_commit_s", 0.0) for s in used),
        "median_after_commit_s": statistics.median(s.get("after_commit_s", 0.0) for s in used),
        "median_forward_step_s": statistics.median(s.get("forward_step_s", 0.0) for s in used),
        "median_back_s": statistics.median(s.get("back_s", 0.0) for s in used),
        "delta_bytes": delta_bytes,
        "forward_bytes": fwd_bytes,
        "tcp_s": tcp_s,
        "ratio": sync_s / tcp_s,
        "run_wall_s": wall,
        "peak_rss": {
            "relay": max(relays),
            "aggregator": peaks["aggregator"],
            "island": max(islands),
            "each": peaks,
        },
        "peak_anon": {
            role: max(v for k, v in poller.anon.items() if k.startswith(prefix))
            for role, prefix in (
                ("relay", "relay-"),
                ("aggregator", "aggregator"),
                ("island", "island-"),
            )
        },
        "log_lines": daemon_lines(run_dir, [n for n in names if not n.startswith("island-")]),
        **cpu,
    }


def sync_cpu(used: list[dict[str, Any]], poller: RssPoller, tcp_s: float) -> dict[str, Any]:
    """What the syncs ``used`` cost in CPU, measured from /proc (``RssPoller.cpu_in``),
    each sync's window from its island's end of training to its next step: its ``cpu``
    (adds it to each sync), and medians over them: ``cpu_s`` (every daemon's CPU seconds
    in the window), ``cpu_by_role`` (the relays', the aggregator's, the islands'),
    ``busy_cores`` (the machine's, whoever ran) and ``cpu_bound_over_tcp``: ``cpu_s``
    spread over every core with none idle, over the TCP time: the lowest ratio the work
    the daemons did in a sync allows, however it overlapped.  It can never be above the
    ratio (a window holds at most cores x its seconds of CPU): how close it comes is the
    share of the cores the daemons kept busy, the same fact as ``busy_cores`` less what
    else ran.  Near the ratio, the sync is bound by that work: overlapping it more
    cannot lower it, only doing less.  (Part B uses one sync step per case, and its
    islands' windows overlap: these are one step's figures, which vary from run to run
    with the VM's speed.)"""
    roles = {"relay": "relay-", "aggregator": "aggregator", "islands": "island-"}
    windows = []
    for s in used:
        got = poller.cpu_in(s["trained"], s["end"])
        if got is None:
            continue
        s["cpu"] = got
        windows.append(got)
    if not windows:
        return {}
    cores = os.cpu_count() or 1
    cpu_s = statistics.median(sum(w["daemons"].values()) for w in windows)
    return {
        "cpu_s": cpu_s,
        "cpu_by_role": {
            role: statistics.median(
                sum(v for k, v in w["daemons"].items() if k.startswith(prefix)) for w in windows
            )
            for role, prefix in roles.items()
        },
        "busy_cores": statistics.median(w["busy_cores"] for w in windows),
        "cpu_bound_over_tcp": cpu_s / cores / tcp_s,
    }


# -- memory --------------------------------------------------------------------------
def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def mem_needed(part: str, P: int, n_r: int) -> int:
    """Estimated peak memory of all processes of one run of ``part`` at P parameters."""

    def est(kind: str) -> float:
        k, c = MEM_MODEL[kind]
        return k * 4 * P + c

    if part == "A":
        total = n_r * est("a_island") + est("a_relay") + est("a_aggregator")
    else:  # the larger part B case: 2 regions x 1 island (two relays)
        total = 2 * est("b_island") + 2 * est("b_relay") + est("b_aggregator")
    return int(MEM_CONCURRENT * total)


# -- reporting ---------------------------------------------------------------------------
def interpreter_floor() -> int:
    """Peak RSS of a process that only imports what a daemon imports (torch, grpc, the
    daemons' modules) and runs one torch op: what no daemon can go below, whatever P."""
    code = (
        "import re, torch, grpc, hypertrain.relay.server, hypertrain.aggregator.server, "
        "hypertrain.island.daemon; torch.ones(1000).add_(1); "
        "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=child_env()
    )
    return int(out.stdout.split()[-1]) * 1024


def rss_row(
    role: str, where: str, peak: int, m: int, anon: int, floor: int = 0, feedback: bool = False
) -> dict[str, Any]:
    """One daemon's peak against its limit.  ``pass``: the whole peak; ``pass_above_floor``:
    the peak less the interpreter floor (Python, torch and gRPC as imported by any daemon,
    measured in the same run), which no daemon can go below whatever the model, with one
    m more for an island whose regional codec is lossy (its error-feedback residual, which
    the issue asks to state separately)."""
    k, c = RSS_LIMITS[role]
    limit = int(k * m + c)
    ef = role == "island" and feedback
    limit_above_floor = limit + (m if ef else 0)
    return {
        "daemon": role,
        "where": where,
        "peak_bytes": peak,
        "peak_over_m": peak / m,
        "anon_peak_bytes": anon,
        "anon_peak_over_m": anon / m,
        "limit_bytes": limit,
        "limit": f"{k:g}m + {c // MIB} MiB",
        "pass": peak <= limit,
        # Above the interpreter's own floor (measured in the same run), in m: what the
        # daemon's data takes, to set against the limit's multiple of m.
        "above_floor_over_m": (peak - floor) / m,
        "limit_above_floor": f"{k + ef:g}m + {c // MIB} MiB" + (" (EF: +1m)" if ef else ""),
        "limit_above_floor_bytes": limit_above_floor,
        "pass_above_floor": peak - floor <= limit_above_floor,
    }


def verdict(ok: bool | None, floor: float | None = None, target: float | None = None) -> str:
    """PASS / FAIL, or FLOOR: missed, and this machine's floor is above the target."""
    if ok is None:
        return ""
    if ok:
        return "PASS"
    return "FLOOR" if floor is not None and target is not None and floor > target else "FAIL"


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: unwind, so every ``finally`` stops its processes and folders."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--part", choices=("A", "B", "all"), default="all")
    ap.add_argument("--params", type=float, default=1e8, help="model parameters P (about)")
    ap.add_argument("--islands", type=int, default=4, help="part A: synthetic islands n_r")
    ap.add_argument(
        "--codec",
        default="all",
        help="part A regional codec: int8, sparseloco+zstd, ... or all (int8 and "
        "sparseloco+zstd); part B always runs fp32 and int8",
    )
    ap.add_argument(
        "--shards",
        type=int,
        default=1,
        help="part A: also run each codec with the region's relay as this many shards "
        "(--shard i/S processes) and compare with one relay",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="keep the run folders under DIR")
    ap.add_argument(
        "--quick", action="store_true", help="P = 1e7 and a 64 MiB baseline: a smoke run"
    )
    ap.add_argument("--timeout", type=float, default=3600, help="part B: seconds per cluster run")
    ap.add_argument(
        "--cases",
        default="all",
        help="part B (part A ignores it): the cases to run, comma-separated (fp32-1x2, "
        "fp32-2x1, int8-1x2, int8-2x1), or all",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="echo the daemons' log events")
    args = ap.parse_args(argv)
    wanted = (
        PART_B_CASES
        if args.cases == "all"
        else tuple(dict.fromkeys(c.strip() for c in args.cases.split(",") if c.strip()))
    )
    unknown = sorted(set(wanted) - set(PART_B_CASES))
    if unknown:
        print(
            f"bench_sync_scale: unknown part B case {unknown[0]!r}: one of "
            f"{', '.join(PART_B_CASES)}",
            file=sys.stderr,
        )
        return 2

    params = 1e7 if args.quick else args.params
    mcfg = shape_for(params)
    P = param_count(mcfg)
    m = 4 * P
    n_r = args.islands
    parts = ["A", "B"] if args.part == "all" else [args.part]
    codecs = ["int8", "sparseloco+zstd"] if args.codec == "all" else [args.codec]
    avail = mem_available()
    for part in parts:
        need = mem_needed(part, P, n_r)
        if avail and need > avail:
            print(
                f"bench_sync_scale: refusing part {part} at P = {P:,}: it needs about "
                f"{need / 2**30:.1f} GiB, MemAvailable is {avail / 2**30:.1f} GiB",
                file=sys.stderr,
            )
            return 2
    # Disk: a run's folder (spool, published deltas, checkpoints, tape, rejoin states)
    # took up to 30m (part B, 2 regions x 1 island, fp32); each is removed after its run
    # unless --keep, which keeps them all.
    keep = args.keep.resolve() if args.keep else None
    runs = len(codecs) * (1 + (args.shards > 1)) * ("A" in parts) + len(wanted) * ("B" in parts)
    disk_need = int(DISK_PER_RUN_M * m) * (runs if keep else 1)
    where = keep or Path(tempfile.gettempdir())
    where.mkdir(parents=True, exist_ok=True)
    disk_free = shutil.disk_usage(where).free
    if disk_need > disk_free:
        print(
            f"bench_sync_scale: refusing at P = {P:,}: the run folders need about "
            f"{disk_need / 2**30:.1f} GiB, {where} has {disk_free / 2**30:.1f} GiB free",
            file=sys.stderr,
        )
        return 2

    tcp_size = (64 if args.quick else 256) * MIB
    rate, tcp_cpu = tcp_rate(tcp_size, 3)
    floor = interpreter_floor()
    disk_dir = where
    disk = disk_first = disk_rate(tcp_size, 2, disk_dir)
    cost_codecs = [*codecs, "int8"] if "B" in parts else codecs
    costs = first_costs = core_costs(tcp_cpu, grpc_cost(tcp_size, 3), cost_codecs)
    print(
        f"# P = {P:,} (m = 4P = {m / 2**20:.0f} MiB; {mcfg.n_layer} x {mcfg.d_model}, "
        f"{mcfg.n_head} heads, vocab {mcfg.vocab_size}, seq {mcfg.seq_len}), "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}",
        flush=True,
    )
    print(
        f"# raw loopback TCP: {rate / 1e6:.0f} MB/s ({tcp_size // MIB} MiB, best of 3); "
        f"a daemon's interpreter floor (imports + one torch op): {floor / MIB:.0f} MiB peak RSS",
        flush=True,
    )
    print(f"# durable disk writes (write + fsync): {disk / 1e6:.0f} MB/s", flush=True)
    print(f"# core-ns {costs.describe()}", flush=True)

    signal.signal(signal.SIGTERM, interrupt)
    root = Path(tempfile.mkdtemp(prefix="bench-sync-scale-", dir=keep))
    part_a: dict[str, dict[str, Any]] = {}
    sharded: dict[str, dict[str, Any]] = {}
    cases: list[dict[str, Any]] = []
    try:
        if "A" in parts:
            for codec in codecs:
                for shards in (1, args.shards) if args.shards > 1 else (1,):
                    where = f"S = {shards} relay shards" if shards > 1 else "one relay"
                    print(
                        f"# part A: {codec}, 1 region x {n_r} synthetic islands, {where} ...",
                        flush=True,
                    )
                    name = "A-" + codec.replace("+", "-") + (f"-S{shards}" if shards > 1 else "")
                    got = run_relay_e2e(mcfg, n_r, codec, root / name, rate, args.verbose, shards)
                    (sharded if shards > 1 else part_a)[codec] = got
                    if keep is None:  # several GB of spooled deltas and checkpoints per run
                        shutil.rmtree(root / name, ignore_errors=True)
        if "B" in parts:
            for codec in ("fp32", "int8"):
                for regions, per in ((("eu",), 2), (("eu", "us"), 1)):
                    label = f"{codec} {len(regions)}x{per}"
                    name = f"B-{codec}-{len(regions)}x{per}"
                    if name[2:] not in wanted:
                        continue
                    print(f"# part B: {label} ...", flush=True)
                    cases.append(
                        run_sync_wall(
                            mcfg, regions, per, codec, root / name, rate, args.verbose, args.timeout
                        )
                    )
                    if keep is None:
                        shutil.rmtree(root / name, ignore_errors=True)
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"# run folders kept in {root}")
    # Measured again once the runs are over, each piece's lesser cost kept: a floor is
    # a lower bound, and a measurement that something else on the machine slowed (the
    # writeback of the runs' files, another tenant of the VM) would only raise it.
    again = core_costs(tcp_cpu, grpc_cost(tcp_size, 3), cost_codecs)
    costs = first_costs.least(again)
    disk_again = disk_rate(tcp_size, 2, disk_dir)
    disk = max(disk, disk_again)
    print(f"# measured again after the runs: durable disk writes {disk_again / 1e6:.0f} MB/s")
    print(f"# core-ns {again.describe()}")
    print("# the floors below take the better of the two for each piece", flush=True)

    failed = False
    rss_rows: list[dict[str, Any]] = []
    if part_a:
        print(f"\n## relay_e2e (part A): 1 region x {n_r} islands, h_r = h_g = 1, 2 global rounds")
        print(
            f"{'codec':<18}{'round':>6}{'delta MB':>10}{'e2e s':>9}{'tcp s':>8}{'ratio':>8}"
            f"{'disk s':>8}{'cpu s':>8}{'floor':>7}{'serial':>8}{'target':>8}  result"
        )
        for codec, r in part_a.items():
            for rd in r["rounds"]:
                last = rd is r["rounds"][-1]
                target = TARGET_RELAY_E2E if codec == "int8" and last else None
                # The durable writes alone, on the critical path; the work no sync can
                # skip, over every core (CoreCosts); both one after another on one core.
                disk_s = rd["durable_bytes"] / disk
                cpu_s = costs.relay_e2e(codec, n_r, P, rd["path_bytes"], rd["forward_bytes"])
                put_floors(rd, disk_s, cpu_s, cpu_s * costs.cores + disk_s)
                ok = None if target is None else rd["ratio"] <= target
                failed |= ok is False and rd["floor_over_tcp"] <= target
                print(
                    f"{codec:<18}{rd['step']:>6}{rd['delta_bytes'] / 1e6:>10.1f}"
                    f"{rd['seconds']:>9.2f}{rd['tcp_s']:>8.3f}{rd['ratio']:>8.1f}"
                    f"{rd['disk_s']:>8.2f}{rd['cpu_floor_s']:>8.2f}{rd['floor_over_tcp']:>7.1f}"
                    f"{rd['serial_over_tcp']:>8.1f}{(f'{target:.1f}' if target else '-'):>8}  "
                    f"{verdict(ok, rd['floor_over_tcp'], target)}"
                )
            for role in ("relay", "aggregator"):
                rss_rows.append(
                    rss_row(role, f"A {codec}", r["peak_rss"][role], m, r["peak_anon"][role], floor)
                )
        print(
            "(disk s: the bytes acknowledged only once on disk on this path, the deltas at "
            "the relay then the forward at the aggregator, at the durable write rate measured "
            "above; cpu s: the work no sync can skip (moving the bytes through gRPC, a digest "
            "by each sender and each receiver, decoding and adding, the outer step) at the "
            "core costs above, over "
            f"{costs.cores} cores; floor: the larger of the two over the TCP time, below which "
            "no ratio can go here; FLOOR: the target is below it; serial: that work and those "
            "writes done one after another on one core, over the TCP time: a ratio above it "
            "is spent on work the floor does not count, or waiting)"
        )
        print("phases of each round (seconds after the first push):")
        for codec, r in [
            *part_a.items(),
            *((f"{c} S={args.shards}", r) for c, r in sharded.items()),
        ]:
            for rd in r["rounds"]:
                ph = " ".join(f"{k}={v:.2f}" for k, v in rd["phases"].items())
                print(f"  {codec} round {rd['step']}: {ph}")
    shard_rows: dict[str, dict[str, Any]] = {}
    if sharded:
        S = args.shards
        print(
            f"\n## relay shards (part A): one relay vs S = {S} shard processes, {os.cpu_count()} cores"
        )
        print(
            f"{'codec':<18}{'S=1 s':>8}{f'S={S} s':>8}{'S=1 ratio':>11}{f'S={S} ratio':>11}"
            f"{'speedup':>9}{'relay MiB':>11}{'per shard':>11}"
        )
        for codec, r in sharded.items():
            one = part_a[codec]
            t1, tS = one["rounds"][-1]["seconds"], r["rounds"][-1]["seconds"]
            shard_rows[codec] = {
                "shards": S,
                "seconds_one_relay": t1,
                "seconds_sharded": tS,
                "ratio_one_relay": one["ratio"],
                "ratio_sharded": r["ratio"],
                "speedup": t1 / tS,
                "relay_peak_one_relay": one["peak_rss"]["relay"],
                "relay_peak_per_shard": r["peak_rss"]["relay"],
                "relay_peak_all_shards": r["peak_rss"]["relay_all_shards"],
            }
            print(
                f"{codec:<18}{t1:>8.2f}{tS:>8.2f}{one['ratio']:>11.1f}{r['ratio']:>11.1f}"
                f"{t1 / tS:>9.2f}{one['peak_rss']['relay'] / MIB:>11.0f}"
                f"{r['peak_rss']['relay'] / MIB:>11.0f}"
            )
        print(
            f"(the last round of each run; speedup = one relay's time / the shards'. With "
            f"{os.cpu_count()} cores shared by the aggregator, {n_r} islands and S relay "
            "processes, shards add processes, not cores: each shard does 1/S of the work "
            "but the machine's cores are the limit; on separate hosts each shard brings its "
            "own cores and NIC.)"
        )
    if cases:
        print("\n## sync_wall (part B): M = 2, h_r = h_g = 2, 6 steps, tau 0, real islands")
        print(
            f"{'case':<14}{'syncs':>6}{'sync_s':>9}{'push_w':>8}{'fetch':>8}{'rest':>8}{'tcp s':>8}"
            f"{'ratio':>8}{'disk s':>8}{'cpu s':>8}{'floor':>7}{'serial':>8}{'target':>8}  result"
        )
        for c in cases:
            regions, per = c["regions"], c["islands_per_region"]
            delta, fwd = c["delta_bytes"], c["forward_bytes"]
            # The floors of each sync, their median (sync_floors): the work before the
            # first island can have the merge (CoreCosts.sync), and the last island's
            # delta then its forward made durable. Serial: every island's work and
            # writes, one after another on one core.
            all_disk = (regions * per * delta + regions * fwd) / disk
            c["cpu_all_s"] = costs.sync_all(c["codec"], regions, per, P, delta, fwd)
            cpu_s, disk_s = sync_floors(
                c["syncs"],
                c["used_steps"],
                costs.sync(c["codec"], regions, per, P, delta, fwd),
                costs.sync(c["codec"], 1, 1, P, delta, fwd),
                (delta + fwd) / disk,
            )
            put_floors(c, disk_s, cpu_s, c["cpu_all_s"] * costs.cores + all_disk)
            ok = c["ratio"] <= TARGET_SYNC_WALL
            failed |= not ok and c["floor_over_tcp"] <= TARGET_SYNC_WALL
            n_used = sum(1 for s in c["syncs"] if s["step"] in c["used_steps"])
            print(
                f"{c['case']:<14}{n_used:>6}{c['median_sync_s']:>9.2f}"
                f"{c['median_push_wait_s']:>8.2f}{c['median_fetch_s']:>8.2f}"
                f"{c['median_rest_s']:>8.2f}{c['tcp_s']:>8.3f}"
                f"{c['ratio']:>8.1f}{c['disk_s']:>8.2f}{c['cpu_floor_s']:>8.2f}"
                f"{c['floor_over_tcp']:>7.1f}{c['serial_over_tcp']:>8.1f}{TARGET_SYNC_WALL:>8.1f}  "
                f"{verdict(ok, c['floor_over_tcp'], TARGET_SYNC_WALL)}"
            )
            for role in ("relay", "aggregator", "island"):
                rss_rows.append(
                    rss_row(
                        role,
                        f"B {c['case']}",
                        c["peak_rss"][role],
                        m,
                        c["peak_anon"][role],
                        floor,
                        feedback=c["codec"] != "fp32",
                    )
                )
        print(
            "(tcp s: one island's critical path, its delta, the relay's forward and the merge "
            "twice; cpu s: what must be computed (encode and sign, TCP, a digest by each "
            "sender and receiver, decoding and adding, the outer step) before any island of "
            "the case, all syncing at the same step, can have the merge, and its relay's "
            "and its own copy and applying it, less what fits between the step's first end "
            "of training and the island's own, or the last island's own path after its end "
            "(sync_floors); disk s: the last island's delta, then its forward, made "
            "durable one after the other after that end; medians over the same syncs; "
            "serial: what every island of the case, syncing at once, writes and computes, "
            "done one after another on one core)"
        )
        print(
            f"\n{'case':<14}{'skew':>8}{'net_s':>8}{'commit':>8}{'after':>8}{'fwd+step':>10}"
            f"{'back':>8}{'net ratio':>11}"
        )
        for c in cases:
            print(
                f"{c['case']:<14}{c['median_skew_s']:>8.2f}{c['median_net_s']:>8.2f}"
                f"{c['median_to_commit_s']:>8.2f}{c['median_after_commit_s']:>8.2f}"
                f"{c['median_forward_step_s']:>10.2f}{c['median_back_s']:>8.2f}"
                f"{c['net_ratio']:>11.1f}"
            )
        print(
            "(skew: of sync_s, the wait for the round's last island to finish training the "
            "step, before which no sync can start (islands sharing these cores drift apart); "
            "net_s: the rest, from the last island's end of training to the island's next "
            "step; commit: of that, until its relay committed the step (the deltas pushed, "
            "summed and the forward made); after: the forward, the aggregator's round and "
            "the merge's way back, split at the aggregator's log line of its round into "
            "fwd+step (the forward pushed, checked, added and the outer step taken) and "
            "back (the merge to the relay and on to the island, which applies it); medians "
            "of the same syncs)"
        )
        measured = [c for c in cases if "cpu_s" in c]
        if measured:
            print(
                f"\n{'case':<14}{'ratio':>8}{'busy':>7}{'cpu s':>8}{'relay':>8}{'agg':>8}"
                f"{'islands':>9}{'floor cpu':>11}{'cpu bound':>11}"
            )
            for c in measured:
                by = c["cpu_by_role"]
                print(
                    f"{c['case']:<14}{c['ratio']:>8.1f}{c['busy_cores']:>7.2f}{c['cpu_s']:>8.2f}"
                    f"{by['relay']:>8.2f}{by['aggregator']:>8.2f}{by['islands']:>9.2f}"
                    f"{c['cpu_all_s'] * (os.cpu_count() or 1):>11.2f}"
                    f"{c['cpu_bound_over_tcp']:>11.1f}"
                )
            print(
                "(measured from /proc in each sync's window, medians of the same syncs: busy: "
                "the machine's busy cores, whoever ran; cpu s: CPU seconds the daemons used, "
                "split into the relays', the aggregator's and the islands'; floor cpu: the "
                "CPU seconds the floors' costs count for every island's sync of the case "
                "(serial's work, without its writes); cpu bound: cpu s spread over every core, "
                "over tcp s: the lowest ratio the work done allows, however it overlapped, at "
                "most the ratio. A ratio near it, with busy near the core count, is bound by "
                "work: only doing less lowers it)"
            )
    if rss_rows:
        print(f"\n## peak RSS (m = {m / 2**20:.0f} MiB)")
        print(
            f"{'daemon':<12}{'run':<18}{'peak MiB':>10}{'/ m':>7}{'anon / m':>10}"
            f"{'-floor / m':>12}  {'limit':<14}{'whole':<7}{'-floor limit':<28}-floor"
        )
        for row in rss_rows:
            failed |= not row["pass"]
            print(
                f"{row['daemon']:<12}{row['where']:<18}{row['peak_bytes'] / 2**20:>10.0f}"
                f"{row['peak_over_m']:>7.2f}{row['anon_peak_over_m']:>10.2f}"
                f"{row['above_floor_over_m']:>12.2f}  {row['limit']:<14}"
                f"{verdict(row['pass']):<7}{row['limit_above_floor']:<28}"
                f"{verdict(row['pass_above_floor'])}"
            )
        print(
            "(peak: max of VmHWM and VmRSS; anon: the largest RssAnon polled, without mapped "
            f"file pages; -floor: the peak less the {floor / MIB:.0f} MiB a process importing "
            "the daemons' modules holds (measured in this run), in m.  whole: the peak against "
            "the limit; -floor: the peak less that floor against the limit, plus 1m of "
            "error-feedback residual for an island with a lossy regional codec)"
        )
    if args.json:

        def peak_of(role: str) -> int | None:
            vals = [r["peak_bytes"] for r in rss_rows if r["daemon"] == role]
            return max(vals) if vals else None

        peaks = {role: peak_of(role) for role in ("relay", "aggregator", "island")}
        int8 = part_a.get("int8")
        result = {
            "relay_e2e_over_tcp": int8["ratio"] if int8 else None,
            "sync_wall_over_tcp": max(c["ratio"] for c in cases) if cases else None,
            # the same, less the wait for the round's last island's training (split_skew)
            "sync_wall_net_over_tcp": max(c["net_ratio"] for c in cases) if cases else None,
            "config": {
                "P": P,
                "m_bytes": m,
                "model_shape": {
                    "n_layer": mcfg.n_layer,
                    "d_model": mcfg.d_model,
                    "n_head": mcfg.n_head,
                    "seq_len": mcfg.seq_len,
                    "vocab_size": mcfg.vocab_size,
                },
                "n_r": n_r,
                "codecs_part_a": codecs,
                "cores": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "mem_available_bytes": avail,
                "quick": args.quick,
            },
            "tcp_bytes_per_s": rate,
            "disk_bytes_per_s": disk,
            # before the runs and after them (disk_bytes_per_s: the faster)
            "disk_bytes_per_s_measured": [disk_first, disk_again],
            "relay_e2e_disk_floor_over_tcp": (
                int8["rounds"][-1]["disk_floor_over_tcp"] if int8 else None
            ),
            "relay_e2e_cpu_floor_over_tcp": (
                int8["rounds"][-1]["cpu_floor_over_tcp"] if int8 else None
            ),
            "relay_e2e_floor_over_tcp": int8["rounds"][-1]["floor_over_tcp"] if int8 else None,
            # The lowest floor of part B's cases: the target is out of reach in every case
            # when it is below even this one.
            "sync_wall_floor_over_tcp_min": (
                min(c["floor_over_tcp"] for c in cases) if cases else None
            ),
            "sync_wall_cpu_floor_over_tcp_min": (
                min(c["cpu_floor_over_tcp"] for c in cases) if cases else None
            ),
            "sync_wall_floor_over_tcp_max": (
                max(c["floor_over_tcp"] for c in cases) if cases else None
            ),
            "relay_e2e_serial_over_tcp": int8["rounds"][-1]["serial_over_tcp"] if int8 else None,
            "sync_wall_serial_over_tcp_max": (
                max(c["serial_over_tcp"] for c in cases) if cases else None
            ),
            # measured, not modelled: the daemons' CPU in the syncs (sync_cpu)
            "sync_wall_cpu_bound_over_tcp_min": min(
                (c["cpu_bound_over_tcp"] for c in cases if "cpu_bound_over_tcp" in c),
                default=None,
            ),
            "sync_busy_cores_min": min(
                (c["busy_cores"] for c in cases if "busy_cores" in c), default=None
            ),
            "core_costs": asdict(costs),
            # before the runs and after them (core_costs: the lesser of each piece)
            "core_costs_measured": [asdict(first_costs), asdict(again)],
            "interpreter_floor_bytes": floor,
            "interpreter_floor_mib": floor / MIB,
            "relay_above_floor_over_m": max(
                (r["above_floor_over_m"] for r in rss_rows if r["daemon"] == "relay"), default=None
            ),
            "aggregator_above_floor_over_m": max(
                (r["above_floor_over_m"] for r in rss_rows if r["daemon"] == "aggregator"),
                default=None,
            ),
            "island_above_floor_over_m": max(
                (r["above_floor_over_m"] for r in rss_rows if r["daemon"] == "island"), default=None
            ),
            # Per daemon: did every run's peak, less the interpreter floor, keep within its
            # limit (rss_row)?  1 / 0 (as a number, for the docs' checked tags); None: not run.
            "above_floor_pass": {
                role: (
                    int(all(r["pass_above_floor"] for r in rows))
                    if (rows := [r for r in rss_rows if r["daemon"] == role])
                    else None
                )
                for role in ("relay", "aggregator", "island")
            },
            "tcp_buffer_bytes": tcp_size,
            "peak_rss_bytes": peaks,
            "relay_peak_over_m": peaks["relay"] / m if peaks["relay"] else None,
            "aggregator_peak_over_m": peaks["aggregator"] / m if peaks["aggregator"] else None,
            "island_peak_over_m": peaks["island"] / m if peaks["island"] else None,
            "peak_rss": rss_rows,
            "targets": {
                "relay_e2e_over_tcp": TARGET_RELAY_E2E,
                "sync_wall_over_tcp": TARGET_SYNC_WALL,
                **{k: f"{a:g}m + {c // MIB} MiB" for k, (a, c) in RSS_LIMITS.items()},
            },
            "relay_e2e": part_a,
            "relay_e2e_sharded": sharded,
            "relay_shards": shard_rows,
            "relay_e2e_shards_over_tcp": sharded["int8"]["ratio"] if "int8" in sharded else None,
            "shard_speedup": shard_rows["int8"]["speedup"] if "int8" in shard_rows else None,
            "cases": cases,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
