"""An island's training step: its working memory and time, before and after the lean step.

    .venv/bin/python bench/bench_train_step.py --json experiments/results/bench_train_step.json
    .venv/bin/python bench/bench_train_step.py --preset tiny --batch 8 --steps 3   # a smoke run

Two ways of the same step, each in a fresh process, in the same run:

- ``plain``: what an island ran before: ``F.cross_entropy`` over the whole logits with
  every block's activations kept, and ``torch.optim.AdamW`` (single-tensor path);
- ``lean``: ``GPT.loss`` (blocks recomputed when their activations pass
  ``ACTIVATION_BUDGET_BYTES``, the head's cross-entropy kept to the logits, the tied
  embedding's gradient summed into the head's in place) and the island's
  ``InnerOptimizer`` (``PiecewiseAdamW``).

Each process builds the preset, trains ``--steps`` steps on fixed random windows with the
daemons' allocator settings (``tune_allocator``, ``trim_heap`` before each step), and
reports the largest resident memory of a step above its resident memory before the
first step's parameters, gradients and moments exist (the interpreter, the model and the
allocator's slack), less the gradients and moments (3m: what any AdamW step holds), that
is the step's working memory; and the median step time.  Both ways must end on the same
parameters to the bit (checked here on their digest): the lean step changes no value.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hypertrain.common.model import GPT, activation_bytes, build_model, preset, recomputes

WAYS = ("plain", "lean")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _plain_loss(model: GPT, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def worker(way: str, name: str, batch: int, steps: int) -> dict[str, Any]:
    from hypertrain.common.digest import state_digest
    from hypertrain.common.flat import ParamLayout
    from hypertrain.common.optim import InnerConfig, InnerOptimizer
    from hypertrain.wire.options import trim_heap, tune_allocator

    tune_allocator()
    cfg = preset(name)
    model = build_model(cfg, seed=0)
    inner = InnerConfig(warmup_steps=0)
    opt = InnerOptimizer(model, inner)
    if way == "plain":
        opt.optimizers[-1] = torch.optim.AdamW(opt.optimizers[-1].param_groups, foreach=False)
    loss_of = _plain_loss if way == "plain" else GPT.loss
    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    m_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    trim_heap()
    start = _status_mib("VmRSS")
    peaks, times = [], []
    for _ in range(steps):
        opt.zero_grad()
        trim_heap()
        _reset_peak()
        t0 = time.perf_counter()
        loss_of(model, windows).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        peaks.append(_status_mib("VmHWM") - start - 3 * m_mib)
    layout = ParamLayout.of(model)
    return {
        "m_mib": m_mib,
        "working_mib": max(peaks),
        "step_s": statistics.median(times),
        "digest": state_digest(layout.unflatten(layout.flatten(model))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--preset", default="gpt-125m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.preset, args.batch, args.steps)))
        return
    cfg = preset(args.preset)
    rows = {}
    for way in WAYS:
        out = subprocess.run(
            [sys.executable, __file__, "--worker", way, "--preset", args.preset,
             "--batch", str(args.batch), "--steps", str(args.steps)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        rows[way] = json.loads(out.strip().splitlines()[-1])
        r = rows[way]
        print(
            f"{way:6s} working memory {r['working_mib']:7.0f} MiB "
            f"({r['working_mib'] / r['m_mib']:.2f}m)  step {r['step_s']:.2f} s"
        )
    plain, lean = rows["plain"], rows["lean"]
    same = plain["digest"] == lean["digest"]
    result = {
        "config": {
            "preset": args.preset,
            "batch": args.batch,
            "steps": args.steps,
            "m_mib": plain["m_mib"],
            "recomputes": recomputes(cfg, args.batch),
            "activation_mib": activation_bytes(cfg, args.batch) / 2**20,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
        "ways": rows,
        "same_bits": same,
        "working_mib_saved": plain["working_mib"] - lean["working_mib"],
        "lean_working_over_plain": lean["working_mib"] / plain["working_mib"],
        "lean_time_over_plain": lean["step_s"] / plain["step_s"],
    }
    print(
        f"lean / plain: working memory {result['lean_working_over_plain']:.2f}x "
        f"({result['working_mib_saved']:.0f} MiB less), step time "
        f"{result['lean_time_over_plain']:.2f}x; same parameters to the bit: {same}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not same:
        sys.exit("the lean step changed the parameters")


if __name__ == "__main__":
    main()
