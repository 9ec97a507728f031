"""Codec throughput and size, as ratios to a memory-copy baseline measured in the same run.

    .venv/bin/python bench/bench_codecs.py --json experiments/results/bench_codecs.json
    .venv/bin/python bench/bench_codecs.py --quick          # 32 MiB, 3 repeats: a smoke run

Baseline: ``dst.copy_(src)`` of the same number of fp32 bytes (read + write, all
cores), best of several.  Every figure is reported in GB/s of *fp32 input*
(4 bytes per parameter processed) and as a ratio to the copy's GB/s, so a
ratio is ``t_copy / t_figure`` and does not depend on how fast this machine is.
Targets: int8 decode-and-accumulate >= 0.6, int8 encode >= 0.3 (raised from
the codec issue's 0.25 and 0.1), SparseLoCo encode >= 0.03, SparseLoCo+zstd
<= 0.2 bits per parameter on a Gaussian delta.  Timings are best-of-N wall clock; the machine
may be shared, so the JSON records the repeats and sizes used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hypertrain.common.codec import ErrorFeedback, make_codec


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def naive_int8_accumulate(
    q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int
) -> None:
    """Whole-tensor torch code, for comparison: every temporary is model-sized."""
    out.add_((q.view(-1, block).float() * scales[:, None]).view(-1))


def run(size_mib: int, repeats: int) -> dict[str, Any]:
    numel = size_mib * (1 << 20) // 4
    fp32_bytes = 4 * numel
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(numel, generator=gen)
    acc = torch.randn(numel, generator=gen)
    dst = torch.empty(numel)

    copy_s = best_of(lambda: dst.copy_(delta), repeats)
    copy_gbps = fp32_bytes / copy_s / 1e9
    figures: dict[str, dict[str, Any]] = {}

    def record(name: str, seconds: float, target: float | None = None) -> None:
        gbps = fp32_bytes / seconds / 1e9
        ratio = gbps / copy_gbps
        figures[name] = {
            "seconds": seconds,
            "gbps": gbps,
            "ratio_to_copy": ratio,
            "target_ratio": target,
            "pass": None if target is None else ratio >= target,
        }

    sizes: dict[str, dict[str, Any]] = {}
    targets = {
        ("int8", "decode_accumulate"): 0.6,
        ("int8", "encode"): 0.3,
        ("sparseloco", "encode"): 0.03,
    }
    for spec in ["int8", "int8+zstd", "sparseloco", "sparseloco+zstd", "fp32"]:
        codec = make_codec(spec)
        blob = codec.encode(delta)
        record(f"{spec} encode", best_of(lambda c=codec: c.encode(delta), repeats),
               targets.get((spec, "encode")))  # fmt: skip
        record(
            f"{spec} decode_accumulate",
            best_of(lambda c=codec, b=blob: c.decode_accumulate(b, acc), repeats),
            targets.get((spec, "decode_accumulate")),
        )
        bpp = codec.bits_per_param(blob)
        target_bpp = 0.2 if spec == "sparseloco+zstd" else None
        sizes[spec] = {
            "spec": str(codec.spec),
            "bytes": len(blob),
            "bits_per_param": bpp,
            "target_bits_per_param": target_bpp,
            "pass": None if target_bpp is None else bpp <= target_bpp,
        }

    ef = ErrorFeedback("sparseloco+zstd", numel)
    record("sparseloco+zstd error-feedback encode", best_of(lambda: ef.encode(delta), repeats))
    int8 = make_codec("int8")
    q = torch.randint(-127, 128, (numel,), dtype=torch.int8, generator=gen)
    scales = torch.rand(numel // 256, generator=gen)
    record(
        "int8 decode_accumulate, naive whole-tensor torch",
        best_of(
            lambda: naive_int8_accumulate(q, scales, acc, int(int8.spec.param("block"))), repeats
        ),
    )
    return {
        # The two targeted figures under plain keys (docs quote them through tags).
        "int8_encode_over_copy": figures["int8 encode"]["ratio_to_copy"],
        "int8_decode_accumulate_over_copy": figures["int8 decode_accumulate"]["ratio_to_copy"],
        "config": {
            "size_mib": size_mib,
            "numel": numel,
            "repeats": repeats,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "python": sys.version.split()[0],
        },
        "baseline": {"name": "fp32 copy_ (read + write)", "seconds": copy_s, "gbps": copy_gbps},
        "throughput": figures,
        "size": sizes,
    }


def render(results: dict[str, Any]) -> str:
    base = results["baseline"]
    lines = [
        f"baseline: {base['name']}, {results['config']['size_mib']} MiB: {base['gbps']:.2f} GB/s",
        f"{'figure':50s} {'GB/s':>7s} {'x copy':>7s} {'target':>7s}  result",
    ]
    for name, f in results["throughput"].items():
        target = "" if f["target_ratio"] is None else f">={f['target_ratio']:g}"
        verdict = "" if f["pass"] is None else ("PASS" if f["pass"] else "FAIL")
        lines.append(
            f"{name:50s} {f['gbps']:7.2f} {f['ratio_to_copy']:7.3f} {target:>7s}  {verdict}"
        )
    lines.append(f"{'size (Gaussian delta)':50s} {'bits/param':>15s} {'target':>7s}  result")
    for name, s in results["size"].items():
        target = "" if s["target_bits_per_param"] is None else f"<={s['target_bits_per_param']:g}"
        verdict = "" if s["pass"] is None else ("PASS" if s["pass"] else "FAIL")
        lines.append(f"{name:50s} {s['bits_per_param']:15.4f} {target:>7s}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--size-mib", type=int, default=None, help="fp32 tensor size (default 256)")
    parser.add_argument("--quick", action="store_true", help="32 MiB and 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="best of N (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    size = args.size_mib or (32 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 5)
    results = run(size, repeats)
    print(render(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    targets = [f["pass"] for f in results["throughput"].values() if f["pass"] is not None]
    targets += [s["pass"] for s in results["size"].values() if s["pass"] is not None]
    return 0 if all(targets) else 1


if __name__ == "__main__":
    raise SystemExit(main())
