"""What a server holds for each push waiting for a reading slot, with and without the go.

    .venv/bin/python bench/bench_waiting_push.py                  # 8 pushes in line
    .venv/bin/python bench/bench_waiting_push.py --pushes 16 --json experiments/results/bench_waiting_push.json

A server (``make_server`` + ``add_servicer`` under ``CallGuard(CallLimits(reading=1))``,
its own process) receives one push that takes the only reading slot and stalls there,
then ``--pushes`` more, each on a connection of its own as islands' are, which wait in line
after their headers.  Once all of them wait, the server's anonymous resident memory
(``RssAnon``) less what it was before they came, over their count, is what a push in
line costs it.  Two ways, alternated ``--repeat`` times, each with a fresh server:

- ``go`` (this build, wire format 3): the pushes run ``client.push_delta``, which sends a
  delta's header and then waits for the server's go (``wireformat.GO_KEY``, sent once a
  push is let in) before its data.
- ``at_once`` (the baseline, as before format 3): the same deltas through the stub with
  their data straight after the header; what gRPC's stream window lets in waits at the
  server.

Then the holder ends, every push lands, and their digests are checked.  ``go_over_at_once``:
the ratio of the two per-push figures (the smallest of each).  The server's stalled holder
keeps its slot however slowly it moves (``calls.FAST_BYTES_S`` set to 0 in the server
process only), so the line does not move while it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

MIB = 1 << 20

SERVER = r"""
import sys, tempfile, threading
from pathlib import Path
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.v1 import hypertrain_pb2_grpc as pb_grpc
from hypertrain.wire import calls
from hypertrain.wire.calls import CallGuard, CallLimits
from hypertrain.wire.chunks import discard, receive_delta
from hypertrain.wire.server import add_servicer, bind, make_server

calls.FAST_BYTES_S = 0  # the stalled holder keeps its slot: the line stays still
spool = Path(tempfile.mkdtemp(prefix="bench-waiting-"))
waiting = [0]
lock = threading.Condition()

def on_waiting(n):
    with lock:
        waiting[0] = n
        lock.notify_all()

class Relay(pb_grpc.RelayServicer):  # the other methods: UNIMPLEMENTED
    def PushDelta(self, parts, context):
        got = receive_delta(parts, max_size=1 << 34, spool_dir=spool, wait=False)
        discard(got)
        return pb.PushAck(digest=got.digest)

server = make_server(max_workers=64)
add_servicer(Relay(), server, "Relay", CallGuard(CallLimits(per_peer=64, idle_s=600.0, reading=1), on_waiting=on_waiting))
address = bind(server, "127.0.0.1:0")
server.start()

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

print(address, flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "rss":
        print(rss_anon(), flush=True)
    elif cmd[0] == "wait":
        with lock:
            lock.wait_for(lambda: waiting[0] >= int(cmd[1]), timeout=120)
            print(waiting[0], flush=True)
server.stop(None)
"""


def measure(way: str, pushes: int, size: int) -> dict[str, Any]:
    """One server, one stalled holder, ``pushes`` pushes in line sent ``way``."""
    from hypertrain.common.digest import blob_digest
    from hypertrain.v1 import hypertrain_pb2 as pb
    from hypertrain.wire.chunks import delta_chunks
    from hypertrain.wire.client import push_delta, relay_stub
    from hypertrain.wire.options import CHANNEL_OPTIONS, tune_allocator

    tune_allocator()  # as every daemon and client does

    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None

    def ask(cmd: str) -> int:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(cmd + "\n")
        proc.stdin.flush()
        return int(proc.stdout.readline())

    try:
        address = proc.stdout.readline().strip()
        data = os.urandom(size)
        digest = blob_digest(data)

        def header(i: int) -> pb.TransferHeader:
            return pb.TransferHeader(run_id="r", sender=f"eu-{i}", digest=digest, size=size)

        # A connection of its own for each push, as islands have (channels to one address
        # with the same arguments would share one connection, and one caller's cap).
        channels = []
        for _ in range(pushes + 1):
            channel = grpc.insecure_channel(
                address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            )
            grpc.channel_ready_future(channel).result(timeout=30)
            channels.append(channel)
        stubs = [relay_stub(c) for c in channels]
        time.sleep(0.5)
        before = ask("rss")
        resume = threading.Event()

        def holder() -> Iterator[Any]:
            parts = delta_chunks(header(0), data)
            yield next(parts)
            yield next(parts)  # it holds the slot from here
            resume.wait(120)
            yield from parts

        acks: list[str] = []
        lock = threading.Lock()

        def run(i: int) -> None:
            if i == 0:
                ack = stubs[0].PushDelta(holder(), timeout=300)
            elif way == "go":
                ack = push_delta(stubs[i].PushDelta, header(i), data, timeout=300)
            else:
                ack = stubs[i].PushDelta(delta_chunks(header(i), data), timeout=300)
            with lock:
                acks.append(ack.digest)

        threads = [threading.Thread(target=run, args=(0,))]
        threads[0].start()
        time.sleep(0.5)
        threads += [threading.Thread(target=run, args=(i,)) for i in range(1, pushes + 1)]
        for t in threads[1:]:
            t.start()
        assert ask(f"wait {pushes}") >= pushes, "the pushes never all waited"
        time.sleep(1.0)  # what gRPC lets in of each arrives
        held = ask("rss")
        resume.set()
        for t in threads:
            t.join(300)
        assert acks == [digest] * (pushes + 1), "a push did not land"
        for c in channels:
            c.close()
        return {
            "way": way,
            "pushes": pushes,
            "rss_anon_before": before,
            "rss_anon_waiting": held,
            "per_push_mib": (held - before) / pushes / MIB,
        }
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--pushes", type=int, default=8, help="pushes waiting in line")
    ap.add_argument("--size-mib", type=int, default=32, help="each delta's size")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = []
    for _ in range(args.repeat):
        for way in ("at_once", "go"):
            r = measure(way, args.pushes, args.size_mib * MIB)
            runs.append(r)
            print(f"{way:8s} {args.pushes} pushes in line: {r['per_push_mib']:6.2f} MiB each")
    best = {w: min(r["per_push_mib"] for r in runs if r["way"] == w) for w in ("at_once", "go")}
    ratio = best["go"] / best["at_once"] if best["at_once"] > 0 else float("nan")
    print(
        f"a push in line costs the server {best['go']:.2f} MiB with the go, "
        f"{best['at_once']:.2f} MiB sending at once: go_over_at_once {ratio:.3f}"
    )
    if args.json:
        out = {
            "config": {"pushes": args.pushes, "size_mib": args.size_mib, "repeat": args.repeat},
            "command": "python bench/bench_waiting_push.py " + " ".join(argv or sys.argv[1:]),
            "runs": runs,
            "go_per_push_mib": best["go"],
            "at_once_per_push_mib": best["at_once"],
            "go_over_at_once": ratio,
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
