"""What touching fresh memory costs on this machine, as ratios to memory already resident.

    .venv/bin/python bench/bench_fresh_memory.py                     # 256 MiB, table on stdout
    .venv/bin/python bench/bench_fresh_memory.py --json experiments/results/bench_fresh_memory.json

A node that frees a model-sized buffer after a round and allocates another at the next
pays, at the first write to each page of the new one, a page fault and the kernel's
zeroing of the page; writing a spool file pays the same for its page cache.  On a VM
whose balloon device reports freed memory to its host (virtio-balloon free page
reporting: ``/sys/bus/virtio/devices/*/features`` bit 5, on this project's test
machines) the host must also back each such page again, and that cost dominates.  The
daemons move it out of a sync's critical path where they can (``pages.populate``, warm
spool files: ``services/wire/spool.py``); this bench measures it, in process CPU time
(user + system, every thread), the least of ``--repeat`` runs each:

- ``anon/resident`` (the baseline): writing ``--size-mib`` of anonymous memory already
  faulted in (a memset through torch's ``fill_``);
- ``anon/fresh``: the same into memory just mapped, after the previous buffer was freed
  and ``--idle-s`` passed (long enough for the kernel to report freed memory: 2 s);
- ``anon/populate``: faulting fresh memory in with ``pages.populate`` (no byte written),
  then ``anon/after-populate``: writing it;
- ``file/fresh``: ``write()`` of that many bytes into a new file's page cache (no fsync),
  after the idle time; ``file/warm``: into a warm file (``spool.prepare``), and
  ``file/prepare``: making that warm file.

Each figure's ratio is its CPU time over the baseline's, measured in the same run.  The
JSON has every figure in seconds and as a ratio, and whether free page reporting is on.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hypertrain.common.pages import populate
from hypertrain.wire import spool

MIB = 1 << 20


def cpu_s() -> float:
    """This process's CPU time (user + system, every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[..., object], *args: object) -> float:
    """Process CPU seconds of ``fn(*args)``."""
    start = cpu_s()
    fn(*args)
    return cpu_s() - start


def free_page_reporting() -> bool | None:
    """Does a virtio balloon on this machine report freed pages to its host (feature bit
    5, VIRTIO_BALLOON_F_REPORTING)?  None where there is no balloon."""
    found = None
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        with_features = dev / "features"
        if (dev / "device").exists() and (dev / "device").read_text().strip() == "0x0005":
            bits = with_features.read_text().strip() if with_features.exists() else ""
            found = len(bits) > 5 and bits[5] == "1"
    return found


def one_run(size: int, idle_s: float, folder: Path) -> dict[str, float]:
    n = size // 4
    out: dict[str, float] = {}
    resident = torch.empty(n)
    resident.fill_(1.0)
    out["anon/resident"] = timed(resident.fill_, 2.0)
    del resident
    time.sleep(idle_s)
    fresh = torch.empty(n)
    out["anon/fresh"] = timed(fresh.fill_, 2.0)
    del fresh
    time.sleep(idle_s)
    fresh = torch.empty(n)
    done: list[bool] = []
    out["anon/populate"] = timed(lambda t: done.append(populate(t)), fresh)
    out["anon/after-populate"] = timed(fresh.fill_, 2.0)
    if not done[0]:
        out["anon/populate"] = float("nan")
    del fresh
    block = os.urandom(MIB)

    def write_into(fd: int) -> None:
        for _ in range(size // MIB):
            os.write(fd, block)

    time.sleep(idle_s)
    fd, name = tempfile.mkstemp(dir=folder, prefix=".incoming-", suffix=".part")
    try:
        out["file/fresh"] = timed(write_into, fd)
    finally:
        os.close(fd)
        os.unlink(name)
    time.sleep(idle_s)
    made: list[int] = []
    out["file/prepare"] = timed(lambda: made.append(spool.prepare(folder, [size])))
    warm = spool.take_warm(folder, size) if made[0] else None
    if warm is None:
        out["file/warm"] = out["file/prepare"] = float("nan")
    else:
        fd, name, _ = warm
        try:
            out["file/warm"] = timed(write_into, fd)
        finally:
            os.close(fd)
            os.unlink(name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=3.0, help="wait before each fresh figure")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.size_mib < 1 or args.repeat < 1 or args.idle_s < 0:
        print("bench_fresh_memory: --size-mib and --repeat must be >= 1, --idle-s >= 0")
        return 2
    size = args.size_mib * MIB
    with tempfile.TemporaryDirectory(prefix="bench-fresh-memory-") as tmp:
        runs = [one_run(size, args.idle_s, Path(tmp)) for _ in range(args.repeat)]
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    base = best["anon/resident"]
    reporting = free_page_reporting()
    print(
        f"# {args.size_mib} MiB, least CPU time of {args.repeat} runs; free page reporting: "
        f"{'on' if reporting else 'off' if reporting is False else 'no balloon'}"
    )
    print(f"{'figure':<22}{'cpu s':>9}{'ratio':>9}{'s / GiB':>10}")
    for key, value in best.items():
        print(f"{key:<22}{value:>9.3f}{value / base:>9.1f}{value / size * (1 << 30):>10.2f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "size_mib": args.size_mib,
            "repeat": args.repeat,
            "idle_s": args.idle_s,
            "free_page_reporting": reporting,
            "cpu_s": best,
            "over_resident": {k: v / base for k, v in best.items()},
            "s_per_gib": {k: v / size * (1 << 30) for k, v in best.items()},
            "runs": runs,
        }
        args.json.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
