"""A relay's regional commit on the critical path, with and without early sums.

    .venv/bin/python bench/bench_early_sum.py --json experiments/results/bench_early_sum.json
    .venv/bin/python bench/bench_early_sum.py --params 2e7 --repeats 1     # a smoke run

A relay adds each island's delta to the step's sum as it is accepted, as far as the fixed
member order allows (``RegionCore.offer``); the commit, which runs when the last delta
arrives, then adds only what is left.  This measures the commit that follows the last
arrival (what the islands and the aggregator wait for), for n islands whose deltas
arrive in member order, in two ways in the same run:

- ``at_commit``: today's path before the early sum: the whole fixed-order mean at the
  commit (``offer`` never called);
- ``early``: the first n - 1 deltas summed as they arrived (timed separately: work moved
  off the critical path), then the commit.

Inputs are spooled files mapped privately, as the relay reads them.  Each (codec, way)
runs in a fresh process, which also reports its peak resident memory above what it held
before the round (theta and the mapped inputs untouched): the sum, or the commit's
buffers.  Both ways produce the same bits (checked here on the base's digest).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.pages import register_file_map
from hypertrain.common.roles import RegionCore
from hypertrain.common.trust.ledger import flat_digest

CODECS = ("int8", "sparseloco+zstd")
WAYS = ("at_commit", "early")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _mapped(path: Path) -> memoryview:
    t = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
    array = t.numpy()
    register_file_map(array)
    return array.data


def _cfg(codec: str, n: int) -> RunConfig:
    return RunConfig.from_dict(
        {
            "steps": 2,
            "batch_per_island": 8,
            "regional_codec": codec,
            "global_codec": "fp32",
            "topology": {"regions": ["eu"], "islands_per_region": n, "h_r": 1, "h_g": 1},
        }
    )


def child(folder: Path, codec: str, way: str, n: int, numel: int) -> dict[str, Any]:
    """One round at a fresh relay core: the timings and memory of ``way``."""
    from hypertrain.wire.options import trim_heap, tune_allocator

    tune_allocator()  # as every daemon does first
    torch.set_num_threads(os.cpu_count() or 1)
    theta = torch.load(folder / "theta.pt")
    members = tuple(f"eu-{i}" for i in range(n))
    inputs = {m: _mapped(folder / f"{codec}-{m}") for m in members}
    core = RegionCore(_cfg(codec, n), "eu", theta, adopt=True)
    trim_heap()
    start_mib = _status_mib("VmRSS")
    fold_s: list[float] = []
    if way == "early":
        for k in range(n - 1):
            t0 = time.perf_counter()
            core.offer({m: inputs[m] for m in members[: k + 1]}, members)
            fold_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    core.merge(inputs, keep=False)
    commit_s = time.perf_counter() - t0
    return {
        "commit_s": commit_s,
        "fold_s": fold_s,
        "peak_above_start_mib": _status_mib("VmHWM") - start_mib,
        "base": flat_digest(core.base_view()),
    }


def run(numel: int, n: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "params": numel,
        "islands": n,
        "repeats": repeats,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "model_mib": 4 * numel / 2**20,
        "codecs": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-early-sum-") as tmp:
        folder = Path(tmp)
        g = torch.Generator().manual_seed(0)
        torch.save(torch.randn(numel, generator=g), folder / "theta.pt")
        for codec_name in CODECS:
            codec = make_codec(codec_name)
            for i in range(n):
                blob = codec.encode(torch.randn(numel, generator=g) * 1e-3)
                (folder / f"{codec_name}-eu-{i}").write_bytes(blob)
                del blob
        for codec_name in CODECS:
            runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
            for _ in range(repeats):
                for way in WAYS:  # interleaved, so drift hits both ways alike
                    got = subprocess.run(
                        [sys.executable, __file__, "--child", str(folder), codec_name, way,
                         str(n), str(numel)],
                        check=True, capture_output=True, text=True,
                    )  # fmt: skip
                    runs[way].append(json.loads(got.stdout.strip().splitlines()[-1]))
            bases = {r["base"] for w in WAYS for r in runs[w]}
            if len(bases) != 1:
                raise SystemExit(f"{codec_name}: the two ways gave different bases: {bases}")
            best = {w: min(runs[w], key=lambda r: r["commit_s"]) for w in WAYS}
            peak = {w: max(r["peak_above_start_mib"] for r in runs[w]) for w in WAYS}
            out["codecs"][codec_name] = {
                "commit_at_commit_s": best["at_commit"]["commit_s"],
                "commit_early_s": best["early"]["commit_s"],
                "early_over_at_commit": best["early"]["commit_s"] / best["at_commit"]["commit_s"],
                "fold_s": best["early"]["fold_s"],
                "peak_at_commit_mib": peak["at_commit"],
                "peak_early_mib": peak["early"],
                "same_bits": True,
            }
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        folder, codec, way, n, numel = sys.argv[2:7]
        print(json.dumps(child(Path(folder), codec, way, int(n), int(numel))))
        return
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--islands", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    res = run(int(args.params), args.islands, args.repeats)
    m = res["model_mib"]
    print(
        f"# P = {res['params']:,} (m = {m:.0f} MiB), {res['islands']} islands arriving in "
        f"member order, {res['cores']} cores, best of {res['repeats']}"
    )
    print("codec            commit s (at commit)  commit s (early)  ratio  folds s (off path)"
          "           peak MiB at commit / early")  # fmt: skip
    for name, r in res["codecs"].items():
        folds = " ".join(f"{s:.3f}" for s in r["fold_s"])
        print(
            f"{name:<16} {r['commit_at_commit_s']:>20.3f}  {r['commit_early_s']:>16.3f}  "
            f"{r['early_over_at_commit']:>5.2f}  {folds:<28}  "
            f"{r['peak_at_commit_mib']:>6.0f} ({r['peak_at_commit_mib'] / m:.2f}m) / "
            f"{r['peak_early_mib']:.0f} ({r['peak_early_mib'] / m:.2f}m)"
        )
    print("(ratio: the commit after the last arrival with early sums over the same commit "
          "without them, same run, same bits; peak: resident memory above the core's "
          "start, theta excluded)")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
