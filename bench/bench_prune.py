"""What a node's prune costs its driver's lock, as a ratio to deleting the same files there.

    .venv/bin/python bench/bench_prune.py          # writes experiments/results/bench_prune.json
    .venv/bin/python bench/bench_prune.py --quick  # 16M parameters, 2 trials, no JSON

A relay or the aggregator run with ``--keep-rounds K`` prunes after each global round,
under its driver's lock: the pushes of the next round wait for it.  At P parameters a
round leaves a checkpoint of 4P bytes and one published input of 4P bytes (fp32) per
member, and deleting a model-sized file is not free: the kernel frees its page-cache
pages and its extents.  ``NodeStore.prune`` moves the files into the store's trash (a
rename) and a thread of the store deletes them (common/rounds/store.py).

Measured here, in one run, on the disk that holds ``--dir`` (default: the repository's
``runs/``, where ``hypertrain up`` writes its state):

- **baseline**: the round's files (a checkpoint and ``--inputs`` inputs, ``4P`` bytes
  each, written and fsynced as a node writes them) deleted with ``unlink`` and their
  folder fsynced: the deletes a prune made under the lock before it had a trash (less
  the marker, the tape scan and one more folder fsync, which both make: the ratio
  flatters the baseline);
- **prune**: ``NodeStore.prune()`` of the same files after a real round (tape entries,
  checkpoint), its wall time (the time under the lock), then the time until its thread
  has deleted them (``wait_trash``: off the lock, on the cores).

Baseline and prune alternate, ``--trials`` each, medians reported; the figure is
``prune_over_unlink``, the lock time's ratio to the baseline's (lower is better).  The
files are in the page cache when they go, as a node's are (it wrote them a round or two
before).  Not measured here: how much the thread's deleting, on the cores and the disk's
journal, slows what runs beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hypertrain.common.aggregate import blob_digest
from hypertrain.common.rounds.store import NodeStore, atomic_save, atomic_write, checkpoint_path
from hypertrain.common.trust.keys import SigningKey, fsync_dir
from hypertrain.common.trust.schema import InputEntry

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "experiments" / "results" / "bench_prune.json"


def _inputs(params: int, count: int, salt: int) -> list[bytes]:
    """``count`` distinct blobs of 4 * ``params`` bytes (distinct digests)."""
    base = np.random.default_rng(salt).integers(0, 255, 4 * params, dtype=np.uint8)
    blobs = []
    for i in range(count):
        base[:8] = np.frombuffer(np.int64(salt * 1000 + i).tobytes(), dtype=np.uint8)
        blobs.append(base.tobytes())
    return blobs


def _round(store: NodeStore, r: int, blobs: list[bytes], params: int) -> None:
    """A round as a node leaves it: inputs published and taped, then its checkpoint."""
    for i, data in enumerate(blobs):
        digest = blob_digest(data)
        store.publish(digest, data)
        store.record(InputEntry(round=r, sync_step=r, sender=f"s{i}", digest=digest,
                                size=len(data), codec="fp32", signature=""))  # fmt: skip
    seq, head = store.tape_position
    state = {"tape_seq": seq, "tape_head": head, "theta": torch.zeros(params)}
    atomic_save(checkpoint_path(store.folder, r), state)


def baseline(folder: Path, blobs: list[bytes], params: int) -> float:
    """Write the files as a node does, then time deleting them where they lie."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"input-{i}" for i in range(len(blobs))]
    for path, data in zip(paths, blobs, strict=True):
        atomic_write(path, data)
    ckpt = folder / "round.pt"
    atomic_save(ckpt, {"theta": torch.zeros(params)})
    t0 = time.perf_counter()
    for path in [ckpt, *paths]:
        path.unlink()
    fsync_dir(folder)
    return time.perf_counter() - t0


def run(params: int, inputs: int, trials: int, where: Path) -> dict[str, float]:
    key = SigningKey.generate("aggregator")
    scratch = Path(tempfile.mkdtemp(prefix="bench-prune-", dir=where))
    try:
        store = NodeStore(scratch / "node", "bench", key, keep_rounds=2)
        unlink_s: list[float] = []
        prune_s: list[float] = []
        trash_s: list[float] = []
        freed: list[int] = []
        for r in range(3):  # the first prune takes two rounds' inputs: not timed
            _round(store, r, _inputs(params, inputs, r), params)
        store.prune()
        store.wait_trash()
        for t in range(trials):  # from here on each prune takes one round's files
            unlink_s.append(
                baseline(scratch / f"base-{t}", _inputs(params, inputs, 100 + t), params)
            )
            _round(store, 3 + t, _inputs(params, inputs, 3 + t), params)
            t0 = time.perf_counter()
            got = store.prune()
            t1 = time.perf_counter()
            store.wait_trash()
            t2 = time.perf_counter()
            if got is None or got.error or got.checkpoints != 1:
                raise SystemExit(f"bench_prune: the prune did not go as planned: {got}")
            prune_s.append(t1 - t0)
            trash_s.append(t2 - t1)
            freed.append(got.bytes)
            print(f"trial {t}: unlink {unlink_s[-1] * 1e3:.1f} ms, prune {prune_s[-1] * 1e3:.1f} ms "
                  f"under the lock, trash emptied {trash_s[-1] * 1e3:.1f} ms later "
                  f"({got.bytes / 2**20:.0f} MiB)")  # fmt: skip
        store.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med_unlink, med_prune = statistics.median(unlink_s), statistics.median(prune_s)
    return {
        "params": params,
        "inputs_per_round": inputs,
        "trials": trials,
        "bytes_per_prune": statistics.median(freed),
        "unlink_s": med_unlink,
        "prune_under_lock_s": med_prune,
        "trash_delete_s": statistics.median(trash_s),
        "prune_over_unlink": med_prune / med_unlink,
        "cores": os.cpu_count() or 1,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="16M parameters, 2 trials, no JSON")
    parser.add_argument("--params", type=float, default=1e8, help="P (default 1e8)")
    parser.add_argument("--inputs", type=int, default=2, help="inputs per round (default 2)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=ROOT / "runs", help="where the files go")
    parser.add_argument("--json", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    params, trials = (int(16e6), 2) if args.quick else (int(args.params), args.trials)
    args.dir.mkdir(parents=True, exist_ok=True)
    result = run(params, args.inputs, trials, args.dir)
    print(
        f"P = {params:.3g}, a checkpoint and {args.inputs} inputs a round "
        f"({result['bytes_per_prune'] / 2**20:.0f} MiB): prune under the lock "
        f"{result['prune_under_lock_s'] * 1e3:.1f} ms, deleting them there "
        f"{result['unlink_s'] * 1e3:.1f} ms: ratio {result['prune_over_unlink']:.3f} "
        f"(trash emptied {result['trash_delete_s'] * 1e3:.0f} ms later, off the lock)"
    )
    if not args.quick:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
