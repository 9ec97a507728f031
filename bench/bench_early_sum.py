"""A commit on the critical path, with and without early sums: a relay's regional commit, or
the aggregator's outer step.

    .venv/bin/python bench/bench_early_sum.py --json experiments/results/bench_early_sum.json
    .venv/bin/python bench/bench_early_sum.py --order second-first --islands 2 \
        --json experiments/results/bench_early_sum_second_first.json
    .venv/bin/python bench/bench_early_sum.py --level global --islands 2 \
        --json experiments/results/bench_early_sum_global.json
    .venv/bin/python bench/bench_early_sum.py --params 2e7 --repeats 1     # a smoke run

A relay adds each island's delta to the step's sum as it is accepted, as far as the fixed
member order allows (``RegionCore.offer``), and the aggregator each region's forward
(``GlobalCore.offer``, ``--level global``: ``--islands`` is then the number of regions);
the commit, which runs when the last input arrives, then adds only what is left.  This
measures the commit that follows the last arrival (what the islands and the aggregator
wait for), for n inputs arriving in member order, or (``--order second-first``) with the
second member first and the first last (the first two of the order commute, so the
second starts the sum), in two ways in the same run:

- ``at_commit``: the path without early sums: the whole fixed-order mean at the
  commit (``offer`` never called; what every order but the member order got before the
  first two commuted, and every aggregator step before it summed early);
- ``early``: the inputs but the last summed as they arrived, as far as the order allows
  (timed separately: work moved off the critical path), then the commit.

Inputs are spooled files mapped privately, as the daemons read them.  Each (codec, way)
runs in a fresh process, which also reports its peak resident memory above what it held
before the round (theta and the mapped inputs untouched; at the global level after an
outer step on the same inputs, so that the outer state exists, and with the next step's
new theta faulted in both ways as the daemon's warm-up does): the sum, or the commit's
buffers.  Both ways produce the same bits (checked here on the base's, or the
new theta's, digest).
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
from hypertrain.common.pages import populate, register_file_map
from hypertrain.common.roles import GlobalCore, RegionCore
from hypertrain.common.trust.ledger import flat_digest

CODECS = {"regional": ("int8", "sparseloco+zstd"), "global": ("fp32", "int8")}
"""The codecs measured at each level (the regional codec of a relay, the global one of the
aggregator)."""
WAYS = ("at_commit", "early")
ORDERS = ("member", "second-first")


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


def _cfg(codec: str, n: int, level: str) -> RunConfig:
    if level == "global":  # n regions of one island, the codec between relay and aggregator
        regions = [f"r{i}" for i in range(n)]
        return RunConfig.from_dict(
            {
                "steps": 2,
                "batch_per_island": 8,
                "regional_codec": "int8",
                "global_codec": codec,
                "topology": {"regions": regions, "islands_per_region": 1, "h_r": 1, "h_g": 1},
            }
        )
    return RunConfig.from_dict(
        {
            "steps": 2,
            "batch_per_island": 8,
            "regional_codec": codec,
            "global_codec": "fp32",
            "topology": {"regions": ["eu"], "islands_per_region": n, "h_r": 1, "h_g": 1},
        }
    )


def _members(n: int, level: str) -> tuple[str, ...]:
    return tuple(f"r{i}" if level == "global" else f"eu-{i}" for i in range(n))


def arrivals(members: tuple[str, ...], order: str) -> tuple[str, ...]:
    """The members in the order their inputs arrive."""
    if order == "second-first" and len(members) > 1:
        return (members[1], *members[2:], members[0])
    return members


def child(
    folder: Path, codec: str, way: str, n: int, numel: int, level: str, order: str
) -> dict[str, Any]:
    """One round at a fresh relay or aggregator core: the timings and memory of ``way``."""
    from hypertrain.wire.options import trim_heap, tune_allocator

    tune_allocator()  # as every daemon does first
    torch.set_num_threads(os.cpu_count() or 1)
    theta = torch.load(folder / "theta.pt")
    members = _members(n, level)
    inputs = {m: _mapped(folder / f"{level}-{codec}-{m}") for m in members}
    core: RegionCore | GlobalCore
    if level == "global":
        core = GlobalCore(_cfg(codec, n, level), theta, adopt=True)
        core.step(inputs)  # a round before: the outer state exists, as in a running daemon
        spare = core.warm()  # the step's new theta, faulted in between rounds
        assert spare is not None
        populate(spare)
        del spare
    else:
        core = RegionCore(_cfg(codec, n, level), "eu", theta, adopt=True)
    trim_heap()
    start_mib = _status_mib("VmRSS")
    fold_s: list[float] = []
    came = arrivals(members, order)
    if way == "early":
        for k in range(n - 1):
            t0 = time.perf_counter()
            core.offer({m: inputs[m] for m in came[: k + 1]}, members)
            fold_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if isinstance(core, GlobalCore):
        core.step(inputs)
        result = flat_digest(core.theta)
    else:
        core.merge(inputs, keep=False)
        result = flat_digest(core.base_view())
    commit_s = time.perf_counter() - t0
    return {
        "commit_s": commit_s,
        "fold_s": fold_s,
        "peak_above_start_mib": _status_mib("VmHWM") - start_mib,
        "base": result,
    }


def run(numel: int, n: int, repeats: int, level: str, order: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "params": numel,
        "islands": n,
        "level": level,
        "order": order,
        "arrivals": list(arrivals(_members(n, level), order)),
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
        for codec_name in CODECS[level]:
            codec = make_codec(codec_name)
            for m in _members(n, level):
                blob = codec.encode(torch.randn(numel, generator=g) * 1e-3)
                (folder / f"{level}-{codec_name}-{m}").write_bytes(blob)
                del blob
        for codec_name in CODECS[level]:
            runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
            for _ in range(repeats):
                for way in WAYS:  # interleaved, so drift hits both ways alike
                    got = subprocess.run(
                        [sys.executable, __file__, "--child", str(folder), codec_name, way,
                         str(n), str(numel), level, order],
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
        folder, codec, way, n, numel, level, order = sys.argv[2:9]
        print(json.dumps(child(Path(folder), codec, way, int(n), int(numel), level, order)))
        return
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--islands", type=int, default=4, help="inputs (regions at --level global)")
    ap.add_argument("--level", choices=("regional", "global"), default="regional")
    ap.add_argument("--order", choices=ORDERS, default="member")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.islands < 2:
        raise SystemExit("bench_early_sum: --islands must be at least 2 (one input has no sum)")
    res = run(int(args.params), args.islands, args.repeats, args.level, args.order)
    m = res["model_mib"]
    who = "relay, islands" if args.level == "regional" else "aggregator, regions"
    print(
        f"# P = {res['params']:,} (m = {m:.0f} MiB), {who} {res['islands']} arriving as "
        f"{' '.join(res['arrivals'])}, {res['cores']} cores, best of {res['repeats']}"
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
