"""gRPC channel arguments shared by every server and client of hypertrain.

One list, used on both ends, so that message limits and keepalive agree.

- Message size: ``MAX_MESSAGE_BYTES`` (16 MiB) on send and receive, 16x ``CHUNK_BYTES``:
  room for any chunk size the benchmark tries plus a header, while a single hostile
  message still cannot make a receiver allocate more than that.
- Keepalive: clients ping every 30 s, also with no call in flight, and servers accept
  that (their default minimum is 5 minutes and they would answer GOAWAY
  "too_many_pings").  ``FetchMerge`` may block for minutes waiting for a round to
  commit; pings keep NATs and load balancers from dropping the idle connection and
  detect a dead peer within ``keepalive_time + keepalive_timeout``.
- Throughput: HTTP/2 frames up to 16 MiB and TCP reads of up to 4 MiB, instead of
  16 KiB frames and small reads.  Measured on loopback with 1 MiB chunks, bare
  streaming goes from ~0.8 to ~1.0 GB/s (bench/bench_transport.py).
- Flow control, servers only: each stream a server receives (a push) has a fixed
  window of ``STREAM_WINDOW_BYTES`` (two chunks), not one that gRPC's bandwidth
  estimator (BDP probing) grows.  On a busy host the estimator granted large windows
  and the senders filled them faster than the handlers took the chunks: with 4 islands
  pushing int8 deltas at once (bench/bench_sync_scale.py --part A, P = 1e8) the relay's
  malloc'd bytes in use rose 55 and 137 MiB in the first 0.2 s of two rounds, and its
  peak RSS less the interpreter floor was 2.28-2.60m in 5 runs, against 2.19m in 2 runs
  with the window fixed (bound 2m + 64 MiB = 2.17m there); at m = 1 GiB with 2 islands
  2.08m -> 2.05m (experiments/results/bench_sync_scale_window_ab.json).  What a handler
  has not taken yet waits in the sender's and the kernel's buffers instead.  Push and
  merge speeds stayed within their noise (bench/bench_transport.py, 3 pairs), and so
  did part B's sync.  Clients (downloads of merges) keep gRPC's estimator: fixing
  theirs too made the islands' download leg 0.1-0.2 s slower in 2 pairs of part B.
- ``grpc.so_reuseport`` off: two daemons configured with the same port must fail to
  start, not share the port and split the traffic.
- Allocator (``tune_allocator``, glibc only): every received chunk is a fresh 1 MiB
  ``bytes``.  By default glibc serves that from its own mmap (256 page faults to
  map it, an munmap to free it) or trims the heap right after; on this VM that kernel
  work was a quarter of a receive.  Chunk-sized blocks come from the heap instead
  (mmap only from 32 MiB up), and up to 16 MiB of freed heap is kept for the next
  chunks (64 MiB measured the same and costs a relay more resident memory).  Measured (bench/bench_transport.py, 256 MiB, 2 cores): the relay's
  receive path 0.275 -> 0.32 of TCP, a download into a kept buffer 0.32 -> 0.355.
  One malloc arena for all threads (``ARENAS``): by default glibc gives each thread that
  allocates an arena of its own (up to 8 per core), and each arena keeps freed chunks
  of its own; a relay's gRPC, hashing and copying threads held about 100 MiB more than
  its data that way, at every point of a round (bench/bench_sync_scale.py --part A,
  P = 1e8: the relay's largest anonymous memory 1046 -> 958-969 MiB, its resting memory
  between rounds 633-674 -> 572-596 MiB; sync and transport speeds within their noise).
  The limit holds only for arenas not created yet, so each daemon calls
  ``tune_allocator`` first thing in its ``main``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
from typing import Any

from hypertrain.wire.chunks import CHUNK_BYTES

MAX_MESSAGE_BYTES = 16 << 20
assert CHUNK_BYTES + (64 << 10) <= MAX_MESSAGE_BYTES

KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
#: Longest a server waits for a new connection's handshake (gRPC's default: 120 s); a
#: client that connects and says nothing holds a socket no longer than this.
HANDSHAKE_TIMEOUT_MS = 10_000

_COMMON: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
]

#: The window of each stream a server receives (``grpc.http2.lookahead_bytes``), fixed:
#: two chunk messages (see the module docstring).
STREAM_WINDOW_BYTES = 2 * CHUNK_BYTES

#: Arguments of every ``grpc.Server`` (see the module docstring).
SERVER_OPTIONS: list[tuple[str, int]] = [
    *_COMMON,
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
]

#: Arguments of every client channel.
CHANNEL_OPTIONS: list[tuple[str, int]] = list(_COMMON)

#: glibc ``mallopt`` parameters (malloc.h) and the values ``tune_allocator`` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 16 << 20
ARENAS = 1
_tuned: bool | None = None
_tune_lock = threading.Lock()


def tune_allocator() -> bool:
    """Tune glibc malloc for chunk traffic (module docstring); once per process.

    Called by ``make_server`` and ``connect``, so every process that moves chunks does
    it.  Returns whether it took effect (False off glibc)."""
    global _tuned
    with _tune_lock:
        if _tuned is None:
            _tuned = False
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c"))
                mallopt = libc.mallopt
            except (OSError, AttributeError, TypeError):
                return False
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            mallopt.restype = ctypes.c_int
            _tuned = bool(
                mallopt(_M_ARENA_MAX, ARENAS)
                and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
            )
        return _tuned


_trim: Any = None


#: The CPU priority (nice) of the threads that write a relay's or the aggregator's
#: checkpoints: below the islands' (``hypertrain up`` starts them at nice 5) and the
#: daemons' serving threads (0), above the held-out evaluation (19).  A checkpoint is
#: not on the round's path (the tape entry made the round durable); on a host shared
#: with islands it takes the cores they leave, and a push that must wait for it
#: (``NodeStore.settle``) comes while the islands wait, which leaves it the cores.
#: The threads that warm the next round's memory and spool files (the relay's and the
#: aggregator's ``_warm``) run at it too: they start once a merge is served, while the
#: islands still take it, and what they do only saves the next round work (a page not
#: faulted in by then is faulted in by whoever writes it first).
CHECKPOINT_NICE = 10


def lower_priority(nice: int) -> None:
    """Run the calling thread at CPU priority ``nice`` (per thread on Linux; nothing
    elsewhere, or where not allowed)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def trim_heap() -> None:
    """Give the heap's free pages back to the kernel (glibc ``malloc_trim``; nothing
    elsewhere).  The island calls it before each sync: the gradients freed after the
    optimizer step sit in the heap (below ``MMAP_THRESHOLD_BYTES`` tensors are not
    mappings of their own), and the sync's copies of the model would come on top."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
            _trim.argtypes = [ctypes.c_size_t]
            _trim.restype = ctypes.c_int
        except (OSError, AttributeError, TypeError):
            _trim = False
    if _trim:
        _trim(0)
