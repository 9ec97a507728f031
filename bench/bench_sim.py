"""Speed of the parity simulator's two execution paths; every ratio is measured in the same run.

    .venv/bin/python bench/bench_sim.py --quick            # < 3 minutes on 2 cores
    .venv/bin/python bench/bench_sim.py --json out.json    # the full run (more repeats)
    .venv/bin/python bench/bench_sim.py --threads 2        # both cores per job, wall clock
    .venv/bin/python bench/bench_sim.py --sweep-only --device cuda   # the GPU's M sweep alone

Timing: by default one intra-op thread and process CPU time, so the numbers are
the work each path does even when other processes share the cores (this
machine's are shared); the grid projection then runs ``cpus / threads`` jobs at
a time.  ``--threads N`` (N > 1) switches to wall-clock time.

What it measures, on the ``proxy`` preset (4 x 128, seq 256) with global batch
32 at every M (so M = 32 is one sequence per replica):

- steps/s of the per-replica and the batched path at M in {1, 2, 4, 8, 16, 32}:
  training steps interleaved (per-replica, batched, per-replica, ...) so both
  paths see the same machine load, median step time; and with the amortized
  cost of one global sync every 30 steps (codecs, aggregation, outer step,
  merges), measured per path;
- the batched / per-replica speedup at each M (targets: >= 1 everywhere,
  >= 1.5 at M = 32);
- the achieved model FLOP rate of the batched path at M = 32, model FLOPs per
  token as MFU counts them (PaLM, appendix B: ``6 N + 12 L d T``, N the matmul
  parameters) x 32 x 256 tokens / step time, against the fp32 rate of a
  1024 x 1024 ``torch.mm`` measured here (target >= 0.5); the same with ``6 P``
  only (all parameters, no attention term) is printed beside it;
- the ceiling of the M = 32 speedup: per-replica M = 32 / dense M = 1 step time
  (batched M = 32 does the dense model's FLOPs in smaller kernels);
- the projected wall time of the full registered grid (the `full` scale,
  docs/design.md §7.3: 3000 steps, proxy, global batch 32, 3 seeds, the cells and eta
  sweeps of ``hypertrain.sim.study.prereg.registered_design()``), on this machine (jobs one
  after another, each using every core) and on one modern GPU (assumptions
  printed: an achieved fp32 rate and a per-op dispatch cost, the step time
  being whichever bound is larger; op counts are counted here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hypertrain.common.data import ensure_default_dataset, holdout_windows
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import partition
from hypertrain.common.model import GPT, build_model, evaluate
from hypertrain.common.optim import InnerConfig
from hypertrain.sim.engine.batched import Batched
from hypertrain.sim.engine.job import SimJob, flat_job
from hypertrain.sim.engine.replicas import ReplicaSet
from hypertrain.sim.engine.run import FragmentSync, make_replicas

MS = (1, 2, 4, 8, 16, 32)
GLOBAL_BATCH = 32
H = 30
STEPS_FULL = 3000
GPU_FP32_TFLOPS = 25.0
"""Assumed achieved fp32 rate of one modern GPU on these small matmuls (an H100 has
~67 TFLOP/s fp32 peak without tensor cores; 25 is ~40% of it)."""
GPU_US_PER_OP = 8.0
"""Assumed eager-mode cost per dispatched op on a GPU (Python + launch), in microseconds."""


def mm_gflops(reps: int) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        torch.mm(a, b)
    best = min(_timed(lambda: [torch.mm(a, b) for _ in range(10)]) / 10 for _ in range(reps))
    return 2 * 1024**3 / best / 1e9


CLOCK: Callable[[], float] = time.process_time
"""The clock of every timing: process CPU time by default (with one thread it is the work
done, whatever else shares the cores), wall time with ``--clock wall``."""


DEVICE = torch.device("cpu")
"""Where the replicas train (``--device``); on CUDA every timing is wall time between two
synchronizations."""


def _timed(fn: Callable[[], object]) -> float:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    t0 = CLOCK()
    fn()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return CLOCK() - t0


def _step_time(reps: ReplicaSet, step: int) -> float:
    return _timed(lambda: reps.train_step(step))


def _sync_time(sync: FragmentSync, reps: ReplicaSet, step: int) -> float:
    return _timed(lambda: sync.sync(reps, step, "global"))


def _setup(m: int, path: str, inner: InnerConfig) -> tuple[SimJob, ReplicaSet, FragmentSync]:
    job = flat_job(m, H, model="proxy", steps=STEPS_FULL, global_batch=GLOBAL_BATCH)
    job = job.replace(path=path, inner=inner)
    template = build_model("proxy", seed=0)
    layout = ParamLayout.of(template)
    theta0 = layout.flatten(template)
    reps = make_replicas(job, template, layout, theta0, DEVICE)
    sync = FragmentSync(job, partition(layout, 1, H, job.fragment_cut)[0], theta0)
    return job, reps, sync


def measure_m(m: int, steps: int, inner: InnerConfig) -> dict[str, Any]:
    """Interleaved training steps of both paths at M = m, and one sync per path.

    A second, identical per-replica set runs interleaved too (an A/A control): the ratio
    of the two identical sets is this run's noise floor for the speedups."""
    paths = ("per_replica", "batched", "per_replica_again")
    sets = {p: _setup(m, p.removesuffix("_again"), inner) for p in paths}
    times: dict[str, list[float]] = {p: [] for p in sets}
    for _, reps, _ in sets.values():
        reps.train_step(0)  # warm-up (allocator, first-call costs)
    for step in range(1, steps + 1):
        for p, (_, reps, _) in sets.items():
            times[p].append(_step_time(reps, step))
    out: dict[str, Any] = {"m": m, "per_replica_batch": GLOBAL_BATCH // m}
    again = times.pop("per_replica_again")
    out["aa_ratio"] = statistics.median(times["per_replica"]) / statistics.median(again)
    for p in ("per_replica", "batched"):
        _, reps, sync = sets[p]
        t_sync = min(_sync_time(sync, reps, s) for s in (H, 2 * H))
        t_step = statistics.median(times[p])
        out[p] = {
            "step_s_median": t_step,
            "step_s_min": min(times[p]),
            "train_steps_per_s": 1 / t_step,
            "sync_s": t_sync,
            "steps_per_s_with_sync_H30": 1 / (t_step + t_sync / H),
        }
    per, bat = out["per_replica"], out["batched"]
    out["speedup_train"] = per["step_s_median"] / bat["step_s_median"]
    out["speedup_train_min"] = per["step_s_min"] / bat["step_s_min"]
    out["speedup_with_sync"] = bat["steps_per_s_with_sync_H30"] / per["steps_per_s_with_sync_H30"]
    return out


class _OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops (forward, backward and optimizer): a GPU launch proxy."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(m: int, inner: InnerConfig, path: str = "batched") -> int:
    """Dispatched ops of one step, the batched path unchunked (as it runs on a GPU)."""
    chunk_rows = Batched.CHUNK_ROWS
    Batched.CHUNK_ROWS = 1 << 62
    try:
        reps = _setup(m, path, inner)[1]
    finally:
        Batched.CHUNK_ROWS = chunk_rows
    reps.train_step(0)
    with _OpCounter() as counter:
        reps.train_step(1)
    return counter.n


def model_flops_per_token(model: GPT) -> int:
    """Training FLOPs per token as model FLOPs utilization counts them (PaLM, appendix B):
    6 per matmul parameter (forward 2, backward 4) plus the attention scores and their
    weighted sum, 12 * n_layer * d_model * seq_len (counted in full although half the causal
    scores are masked).  Matmul parameters: all but the position table, a lookup (the token
    table is counted: it is also the output layer)."""
    cfg = model.cfg
    n = sum(p.numel() for name, p in model.named_parameters() if name != "wpe.weight")
    return 6 * n + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def eval_seconds(windows: int) -> float:
    """Seconds to evaluate the registered 512 holdout windows (measured on ``windows``)."""
    model = build_model("proxy", seed=0)
    held = holdout_windows(ensure_default_dataset(), model.cfg.seq_len).windows[:windows]
    evaluate(model, held[:8])
    return _timed(lambda: evaluate(model, held)) * 512 / windows


def project_grid(
    rows: dict[int, dict[str, Any]], extra: dict[str, Any], workers: int
) -> dict[str, Any]:
    """Wall time of the full registered grid from the measured per-M costs (``workers``
    jobs at a time on this machine, one at a time on the GPU)."""
    try:
        from hypertrain.sim.study.prereg import registered_design

        design = registered_design()
        cells = design.cells_of("full")
        seeds = len(design.seeds)
        source = "hypertrain.sim.study.prereg.registered_design() scale 'full'"
    except ImportError:  # pragma: no cover - prereg.py is part of the tree
        return {"error": "hypertrain.sim.study.prereg not importable"}
    flops_step = extra["model_flops_per_token"] * GLOBAL_BATCH * 256
    cpu_s = gpu_s = 0.0
    jobs = 0
    for c in cells:
        m = c.m
        n_jobs = seeds * max(1, len(design.sweep(c, "full")))
        row = rows[m]  # every M of the grid is measured
        t_step = row["batched"]["step_s_median"]
        ops = extra["ops_per_step"][m]
        if c.inner == "muon":
            t_step += extra["muon_extra_s_per_replica"] * m
            ops += extra["muon_ops_per_replica"] * m
        syncs = 0 if c.kind == "control" else STEPS_FULL // (c.h_r or STEPS_FULL)
        t_sync = row["batched"]["sync_s"] * syncs
        t_eval = extra["eval_s_512"] * 10  # initial + 8 eval points + LAWA
        cpu_s += n_jobs * (STEPS_FULL * t_step + t_sync + t_eval)
        gpu_step = max(flops_step / (GPU_FP32_TFLOPS * 1e12), ops * GPU_US_PER_OP * 1e-6)
        gpu_eval = 10 * 2 * extra["n_params"] * 512 * 256 / (GPU_FP32_TFLOPS * 1e12)
        gpu_s += n_jobs * (STEPS_FULL * gpu_step + t_sync + gpu_eval)  # syncs stay on CPU
        jobs += n_jobs
    return {
        "source": source,
        "cells": len(cells),
        "jobs": jobs,
        "cpu_hours_this_machine": cpu_s / 3600 / workers,
        "cpu_assumption": f"{workers} jobs at a time, each at the measured per-step cost",
        "gpu_hours_one_gpu": gpu_s / 3600,
        "gpu_assumption": (
            f"step = max(model FLOPs / {GPU_FP32_TFLOPS:g} TFLOP/s achieved fp32, "
            f"ops per step x {GPU_US_PER_OP:g} us per eager op); ops counted here per M; "
            "codecs and syncs stay on the CPU at the measured cost; one job at a time"
        ),
    }


def _str_keys(v: Any) -> Any:
    return {str(a): b for a, b in v.items()} if isinstance(v, dict) else v


def sweep_only(args: argparse.Namespace, ms: tuple[int, ...], steps: int, clock: str) -> int:
    """The M sweep on ``DEVICE`` alone: steps/s of both paths and the batched speedup at each
    M (the GPU target: >= 3x at M = 32, where one stacked model replaces 32 small ones)."""
    t_start = time.perf_counter()
    name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else platform.machine()
    print(f"bench_sim --sweep-only on {DEVICE} ({name}), torch {torch.__version__}, {clock} clock")
    rows = {}
    for m in ms:
        r = measure_m(m, steps, InnerConfig())
        rows[m] = r
        print(f"M={m:2d}: per-replica {r['per_replica']['train_steps_per_s']:.3f} steps/s, "
              f"batched {r['batched']['train_steps_per_s']:.3f}: {r['speedup_train']:.2f}x "
              f"(A/A {r['aa_ratio']:.3f})")  # fmt: skip
    top = max(ms)
    targets = {f"speedup_m{top}_ge_3": rows[top]["speedup_train"] >= 3.0}
    out = {
        "device": str(DEVICE), "device_name": name, "torch": torch.__version__, "clock": clock,
        "steps": steps, "per_m": {str(m): r for m, r in rows.items()},
        "speedup_by_m": {str(m): r["speedup_train"] for m, r in rows.items()},
        "targets": targets, "seconds": time.perf_counter() - t_start,
    }  # fmt: skip
    print("targets:", ", ".join(f"{k} {'MET' if v else 'NOT MET'}" for k, v in targets.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (< 3 minutes)")
    ap.add_argument("--json", metavar="PATH", help="write all numbers here")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default=None,
        help="cpu: process time (default with 1 thread); wall: elapsed time (default otherwise)",
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (cuda: --sweep-only)")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the M sweep of both paths and its speedups (the device check's "
                         "part; target on a GPU: batched >= 3x per-replica at M = 32)")  # fmt: skip
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="the Ms of the sweep (1,2,...)")
    ap.add_argument(
        "--steps", type=int, default=None, help="timed steps per M (default 10; 2 quick)"
    )
    args = ap.parse_args(argv)
    global CLOCK, DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device is visible")
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if args.threads == 1 and DEVICE.type == "cpu" else "wall")
    CLOCK = time.process_time if clock == "cpu" else time.perf_counter
    ms = tuple(int(m) for m in args.ms.split(","))
    if any(GLOBAL_BATCH % m for m in ms):
        ap.error(f"--ms: each M must divide the global batch {GLOBAL_BATCH}")
    if DEVICE.type != "cpu" or args.sweep_only:
        return sweep_only(args, ms, args.steps or (2 if args.quick else 10), clock)
    workers = max(1, (os.cpu_count() or 1) // args.threads)
    steps = 2 if args.quick else 10
    adamw, muon = InnerConfig(), InnerConfig(name="muon")
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    print(f"bench_sim: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cpus, {platform.machine()}, load average {load0[0]:.1f}, "
          f"{clock} clock")  # fmt: skip
    rate = mm_gflops(3 if args.quick else 6)
    print(f"fp32 torch.mm 1024x1024: {rate:.1f} GFLOP/s")
    rows: dict[int, dict[str, Any]] = {}
    print(" M  b | per-replica steps/s | batched steps/s | speedup (train / with sync @H30)"
          " | min-based | A/A noise")  # fmt: skip
    for m in MS:
        r = measure_m(m, steps, adamw)
        rows[m] = r
        per, bat = r["per_replica"], r["batched"]
        print(
            f"{m:2d} {r['per_replica_batch']:2d} | {per['train_steps_per_s']:8.3f}"
            f" ({per['steps_per_s_with_sync_H30']:.3f}) | {bat['train_steps_per_s']:8.3f}"
            f" ({bat['steps_per_s_with_sync_H30']:.3f}) | {r['speedup_train']:.2f}x / "
            f"{r['speedup_with_sync']:.2f}x | {r['speedup_train_min']:.3f}x | {r['aa_ratio']:.3f}"
        )
    model = build_model("proxy")
    n_params = sum(p.numel() for p in model.parameters())
    per_token = model_flops_per_token(model)
    tokens = GLOBAL_BATCH * model.cfg.seq_len
    t32 = rows[32]["batched"]["step_s_median"]
    achieved = per_token * tokens / t32 / 1e9
    achieved_6p = 6 * n_params * tokens / t32 / 1e9
    print(
        f"batched M=32 model FLOP rate: {per_token} FLOP/token (6N + 12*L*d*T) x {tokens} tokens"
        f" / {t32:.3f} s = {achieved:.1f} GFLOP/s = {achieved / rate:.2f} x the mm rate "
        f"(counting 6 * all {n_params} parameters only: {achieved_6p / rate:.2f} x)"
    )
    # Batched M = 32 computes the FLOPs of the dense M = 1 model, in 32x smaller kernels: its
    # speedup over per-replica M = 32 is bounded by per-replica M = 32 / dense M = 1.
    ceiling = rows[32]["per_replica"]["step_s_median"] / rows[1]["per_replica"]["step_s_median"]
    print(
        f"ceiling of the M=32 speedup: per-replica M=32 step / dense (M=1) step = {ceiling:.2f}x "
        "(the batched step does the dense model's FLOPs; it cannot beat the dense model's kernels)"
    )
    # Muon's per-replica Newton-Schulz (torch's own code) costs extra per replica.
    m_mu = 8 if 8 in rows else MS[-1]
    mu = _setup(m_mu, "batched", muon)[1]
    mu.train_step(0)
    t_mu = statistics.median(_step_time(mu, s) for s in range(1, steps + 1))
    muon_extra = max(0.0, t_mu - rows[m_mu]["batched"]["step_s_median"]) / m_mu
    ops = {m: ops_per_step(m, adamw) for m in MS}
    muon_ops = (ops_per_step(m_mu, muon) - ops[m_mu]) / m_mu
    ops_per_replica_path = ops_per_step(32, adamw, "per_replica")
    t_eval = eval_seconds(64 if args.quick else 512)
    extra = {
        "n_params": n_params,
        "model_flops_per_token": per_token,
        "ops_per_step": ops,
        "muon_extra_s_per_replica": muon_extra,
        "muon_ops_per_replica": muon_ops,
        "eval_s_512": t_eval,
        "ops_per_step_per_replica_path_m32": ops_per_replica_path,
    }
    print(f"dispatched ops per step, batched: {ops}; per-replica at M=32: "
          f"{ops_per_replica_path}")  # fmt: skip
    print(f"muon (torch's bf16 Newton-Schulz, per replica in both paths): +{muon_extra:.2f} s "
          f"per replica-step; eval of the 512 holdout windows {t_eval:.1f} s")  # fmt: skip
    grid = project_grid(rows, extra, workers)
    print(
        f"full grid ({grid.get('cells')} cells, {grid.get('jobs')} jobs): "
        f"{grid.get('cpu_hours_this_machine', 0):.0f} h on this machine ({workers} jobs at a time), "
        f"{grid.get('gpu_hours_one_gpu', 0):.1f} h on one GPU ({grid.get('gpu_assumption')})"
    )
    speedups = [rows[m]["speedup_train"] for m in MS]
    noise = max(abs(1 - rows[m]["aa_ratio"]) for m in MS)
    print(f"noise floor (largest A/A deviation over M): {noise:.3f}; slowest batched speedup "
          f"{min(speedups):.3f}x at M={MS[speedups.index(min(speedups))]}")  # fmt: skip
    targets = {
        "batched_never_slower": min(speedups) >= 1.0,
        "batched_never_slower_beyond_aa_noise": min(speedups) >= 1.0 - noise,
        "speedup_m32_ge_1_5": rows[32]["speedup_train"] >= 1.5,
        "flop_ratio_ge_0_5": achieved / rate >= 0.5,
    }
    print("targets:", ", ".join(f"{k} {'MET' if v else 'NOT MET'}" for k, v in targets.items()))
    out = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": clock,
        "quick": args.quick,
        "mm_gflops": rate,
        "per_m": {str(m): r for m, r in rows.items()},
        "flop_formula": (
            "model FLOPs per token 6 * N + 12 * n_layer * d_model * seq_len (N: parameters "
            "in matmuls, i.e. all but the position table; PaLM appendix B) x global_batch * "
            "seq_len tokens / batched median step time"
        ),
        "model_flops_per_token": per_token,
        "batched_m32_gflops": achieved,
        "flop_ratio_vs_mm": achieved / rate,
        "flop_ratio_vs_mm_6p_only": achieved_6p / rate,
        "m32_speedup_ceiling": ceiling,
        "extra": {k: _str_keys(v) for k, v in extra.items()},
        "grid_projection": grid,
        "aa_noise_floor": noise,
        "targets": targets,
        "seconds": time.perf_counter() - t_start,
    }
    out["load_average_start_end"] = [load0[0], os.getloadavg()[0]]
    print(f"bench_sim: {out['seconds']:.0f} s, load average {load0[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f} (other processes share these cores)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
