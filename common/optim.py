"""Inner optimizers, the WSD learning-rate schedule and LAWA averaging.

- ``adamw``: torch AdamW on every parameter; weight decay only on 2-D matrices.
- ``muon``: ``torch.optim.Muon`` for the 2-D hidden matrices of the blocks
  (attention and MLP weights), AdamW for the rest (embeddings, LayerNorms).
  Muon uses ``adjust_lr_fn="match_rms_adamw"`` so one learning rate serves both.
- WSD: linear warmup, a stable plateau, then a linear decay over the final
  ``decay_fraction`` of the steps down to ``min_lr_ratio``.
- LAWA: the mean of the last k checkpoints (flat vectors), summed in a fixed
  order in fp32 (docs/design.md §3.7).

Invariants: the schedule is a pure function of the step; the optimizer's
state_dict round-trips through torch.save exactly; nothing reads a clock.
"""

from __future__ import annotations

import copy as _copy
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.optim.adam import adam

from hypertrain.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerConfig:
    """Inner optimizer and its schedule."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw, or muon (Muon for 2-D hidden matrices, AdamW for the rest)."""
    lr: float = 3e-3
    """Peak learning rate (both optimizers; Muon matches AdamW's RMS)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on 2-D matrices (0 on gains, biases, embeddings)."""
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 20
    """Linear warmup from 0 to lr."""
    decay_fraction: float = 0.2
    """Final fraction of the run with linear decay (WSD); 0 disables decay."""
    min_lr_ratio: float = 0.1
    """lr at the very end of the decay, as a fraction of the peak."""
    grad_clip: float = 1.0
    """Global gradient-norm clip per island step; 0 disables it."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "muon"):
            raise ConfigError(f"inner: unknown optimizer {self.name!r} (adamw|muon)")
        if not self.lr > 0:
            raise ConfigError(f"inner: lr must be > 0, got {self.lr}")
        if not 0 <= self.decay_fraction <= 1:
            raise ConfigError(f"inner: decay_fraction must be in [0, 1], got {self.decay_fraction}")
        if self.warmup_steps < 0:
            raise ConfigError("inner: warmup_steps must be >= 0")


def wsd_factor(step: int, total_steps: int, cfg: InnerConfig) -> float:
    """Learning-rate multiplier for the 0-based ``step`` of a ``total_steps`` run."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = round(cfg.decay_fraction * total_steps)
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return 1.0
    frac = (step - decay_start + 1) / decay_steps
    return 1.0 - (1.0 - cfg.min_lr_ratio) * min(frac, 1.0)


#: The most elements of one parameter that ``PiecewiseAdamW`` updates at a time (16 MiB of
#: fp32): its temporaries are two of these, not two of the largest parameter.
ADAM_PIECE = 1 << 22


class PiecewiseAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (single-tensor path) that updates a large parameter a piece of
    ``ADAM_PIECE`` elements at a time: the same values, bit for bit, in less memory.

    torch's single-tensor AdamW is elementwise, but it makes whole-parameter temporaries
    (the denominator ``sqrt(v) / bias_correction + eps`` and its intermediate): at gpt-125m
    the tied embedding's two are 295 MiB on top of the parameters, gradients and moments, at
    the moment of the training step that holds all of them.  Here each large parameter, its
    gradient and its two moments are passed to torch's own update function as pieces (views
    of the same memory); the per-step scalars (bias corrections, learning rate) depend only
    on the step, which every piece carries (a copy each, incremented as one).  State, the
    state dict and its round trip are AdamW's."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ConfigError("inner: PiecewiseAdamW.step takes no closure")
        self._accelerator_graph_capture_health_check()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            has_complex = self._init_group(
                group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
            )
            if group["amsgrad"] or has_complex or group["foreach"] or group["fused"]:
                raise ConfigError("inner: PiecewiseAdamW takes the plain single-tensor path")
            pieces: list[list[torch.Tensor]] = [[], [], [], [], []]
            shared: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
            for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
                whole = (p, g, m, v)
                if p.numel() <= ADAM_PIECE or not all(x.is_contiguous() for x in whole):
                    for out, x in zip(pieces, (*whole, t), strict=True):
                        out.append(x)
                    continue
                flat = [x.view(-1) for x in whole]
                copies: list[torch.Tensor] = []
                for a in range(0, p.numel(), ADAM_PIECE):
                    for out, x in zip(pieces, flat, strict=False):
                        out.append(x[a : a + ADAM_PIECE])
                    copies.append(t.clone())
                    pieces[4].append(copies[-1])
                shared.append((t, copies))
            beta1, beta2 = group["betas"]
            adam(
                pieces[0],
                pieces[1],
                pieces[2],
                pieces[3],
                [],
                pieces[4],
                amsgrad=False,
                has_complex=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=False,
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=None,
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
            for t, copies in shared:
                t.copy_(copies[0])
        return None


def _is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and name.startswith("blocks.")


class InnerOptimizer:
    """One or two torch optimizers behind one step / state_dict interface."""

    def __init__(self, model: nn.Module, cfg: InnerConfig) -> None:
        self.cfg = cfg
        named = sorted(model.named_parameters())
        self.params = [p for _, p in named]
        betas = (cfg.beta1, cfg.beta2)
        matrices = [p for n, p in named if _is_hidden_matrix(n, p)]
        others = [p for n, p in named if not _is_hidden_matrix(n, p)]
        self.optimizers: list[torch.optim.Optimizer] = []
        if cfg.name == "muon":
            self.optimizers.append(
                torch.optim.Muon(
                    matrices,
                    lr=cfg.lr,
                    weight_decay=cfg.weight_decay,
                    adjust_lr_fn="match_rms_adamw",
                )
            )
            groups: list[dict[str, Any]] = [{"params": others, "weight_decay": 0.0}]
        else:
            groups = [
                {"params": matrices, "weight_decay": cfg.weight_decay},
                {"params": others, "weight_decay": 0.0},
            ]
        # foreach=False: the single-tensor path has one fixed op order on every machine.
        self.optimizers.append(PiecewiseAdamW(groups, lr=cfg.lr, betas=betas, foreach=False))

    def set_lr_factor(self, factor: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = self.cfg.lr * factor

    def step(self) -> None:
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=False)
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self, copy: bool = True) -> list[dict[str, Any]]:
        """A deep copy: torch's state_dict aliases the live buffers, and a snapshot
        that keeps changing under its holder is no snapshot.  ``copy=False``: those
        aliases (the island's rejoin save, written before the next update changes them:
        a copy held two model-sized moments while the next step trains)."""
        states = [opt.state_dict() for opt in self.optimizers]
        return _copy.deepcopy(states) if copy else states

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.optimizers):
            raise ConfigError("inner: optimizer state does not match the optimizer kind")
        for opt, st in zip(self.optimizers, _copy.deepcopy(states), strict=True):
            opt.load_state_dict(st)


class LawaSum:
    """The fixed-order fp32 sum behind LAWA: states added oldest first into zeros, then
    divided by their count.  One rule for the simulator's ``LAWA`` and the aggregator's
    running sum (common/rounds/machines.py), so both give the same bits; elementwise, so
    a sum kept whole and one computed range by range agree too."""

    def __init__(self, total: torch.Tensor | None = None, count: int = 0) -> None:
        """``total``/``count``: a sum restored from a checkpoint (None, 0: empty)."""
        if (total is None) != (count == 0) or count < 0:
            raise ConfigError(
                f"lawa: a restored sum needs both its total and count >= 1, got {count}"
            )
        self.total = total
        self.count = count

    def add(self, flat: torch.Tensor) -> None:
        if self.total is None:
            self.total = torch.zeros_like(flat, dtype=torch.float32)
        self.total.add_(flat)
        self.count += 1

    def average(self) -> torch.Tensor:
        """The mean so far, in a new tensor (the sum is left as it is)."""
        if self.total is None:
            raise ConfigError("lawa: no checkpoints to average")
        return self.total.clone().div_(self.count)


class LAWA:
    """Latest-weight averaging over the last ``k`` checkpoints (flat fp32 vectors)."""

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ConfigError(f"lawa: k must be >= 1, got {k}")
        self.k = k
        self.snapshots: deque[torch.Tensor] = deque(maxlen=k)

    def add(self, flat: torch.Tensor) -> None:
        self.snapshots.append(flat.detach().clone())

    def average(self) -> torch.Tensor:
        """Fixed-order (oldest first) fp32 mean of the kept snapshots (``LawaSum``)."""
        acc = LawaSum()
        for snap in self.snapshots:
            acc.add(snap)
        return acc.average()
