"""The batched execution path: all N replicas trained as one stacked model.

Every parameter of the model is held once, stacked along a leading replica
dimension (``[N, *shape]``, leaf tensors).  One step computes the N
per-replica losses with ``StackedGPT`` (stacked.py: ``GPT.loss`` with
every linear layer as one batched matmul over N), and one backward of their
sum gives every replica exactly its own gradient.  So one step of N small
models is a few large kernels instead of N times every kernel.  Replica i
trains on rows ``[i*b, (i+1)*b)`` of ``stream.global_batch_at(step)``, which is
exactly ``stream.replica_batch(step, i, N)`` (sampling.py: replica batches
slice the global batch).

The inner optimizer is the core's, re-targeted (``StackedInnerOptimizer``):
an ``InnerOptimizer`` is built on a template model, which fixes the grouping
(which parameters are Muon's hidden matrices, which get weight decay) and every
hyper-parameter, and its torch optimizers are rebuilt with the same groups over
the stacked tensors:

- AdamW is elementwise, so ``torch.optim.AdamW`` (same single-tensor path,
  ``foreach=False``) on a ``[N, *shape]`` tensor is, element by element, the
  per-replica update (checked in tests/unit/test_sim_engine.py).
- Muon orthogonalizes each 2-D matrix: ``torch.optim.Muon`` itself is given the
  N per-replica views ``stack[i]`` of every hidden matrix (2-D views into the
  stacked storage, each with its own momentum buffer and its gradient slice), so
  torch's own Muon code (Newton-Schulz per matrix) runs per replica unchanged.
- Gradient clipping is per replica, with the formula of
  ``torch.nn.utils.clip_grad_norm_`` (norm of the per-tensor 2-norms, coefficient
  ``max_norm / (total + 1e-6)`` clamped at 1) computed along the replica dim.

Invariants: replicas never mix (the loss is a sum of per-replica losses, so each
replica's gradient is its own); ``write`` copies into the stacks in place, so the
Muon views stay valid; on CPU every gradient, clip and update is bit-identical to
the per-replica path's (tests/unit/test_sim_engine.py checks final parameters).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from hypertrain.common.data import SampleStream
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import Fragment
from hypertrain.common.model import GPT
from hypertrain.common.optim import InnerConfig, InnerOptimizer, wsd_factor
from hypertrain.sim.engine.replicas import split_row
from hypertrain.sim.engine.stacked import StackedGPT


@torch.no_grad()
def clip_per_replica_(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip stacked gradients ``[N, ...]`` to ``max_norm`` per replica; returns the N norms."""
    n = grads[0].shape[0]
    # Row-wise norms of contiguous rows give the bits of the whole-tensor norms (checked),
    # and [N, P] reduced along its contiguous dim gives the bits of norm(stack(norms)).
    norms = torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), 2, dim=1) for g in grads], 1)
    total = torch.linalg.vector_norm(norms, 2, dim=1)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.view(n, *([1] * (g.ndim - 1))))
    return total


class StackedInnerOptimizer(InnerOptimizer):
    """The core's InnerOptimizer with its torch optimizers rebuilt over stacked tensors."""

    def __init__(self, template: nn.Module, stacks: dict[str, torch.Tensor], cfg: InnerConfig):
        super().__init__(template, cfg)  # grouping and hyper-parameters, from the core
        name_of = {id(p): name for name, p in template.named_parameters()}
        self.n = next(iter(stacks.values())).shape[0]
        self.stacks = stacks
        self.stacked = [stacks[name] for name in sorted(stacks)]  # clip order = the core's
        self.views: list[tuple[torch.Tensor, str, int]] = []
        rebuilt: list[torch.optim.Optimizer] = []
        for opt in self.optimizers:
            per_replica = isinstance(opt, torch.optim.Muon)  # orthogonalizes each matrix
            groups: list[dict[str, Any]] = []
            for group in opt.param_groups:
                params: list[torch.Tensor] = []
                for p in group["params"]:
                    name = name_of[id(p)]
                    if not per_replica:
                        params.append(stacks[name])
                        continue
                    for i in range(self.n):
                        view = stacks[name].detach()[i]  # a leaf sharing the stack's storage
                        params.append(view)
                        self.views.append((view, name, i))
                settings = {k: v for k, v in group.items() if k != "params"}
                groups.append({**settings, "params": params})
            accepted = inspect.signature(type(opt)).parameters
            defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
            rebuilt.append(type(opt)(groups, **defaults))
        self.optimizers = rebuilt

    def step(self) -> None:
        """Clip per replica, hand Muon its per-replica gradient slices, step every optimizer."""
        if self.cfg.grad_clip > 0:
            grads = [p.grad for p in self.stacked if p.grad is not None]
            clip_per_replica_(grads, self.cfg.grad_clip)
        for view, name, i in self.views:
            grad = self.stacks[name].grad
            view.grad = None if grad is None else grad[i]
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for p in self.stacked:
            p.grad = None
        for view, _, _ in self.views:
            view.grad = None


class Batched:
    """The batched path: N replicas as one stacked model (see the module docstring).

    On CPU the stack is held in chunks of whole replicas, at most ``CHUNK_ROWS`` token rows
    of a step each (one replica per chunk when a replica alone has more): every chunk is a
    stacked model of its own (leaf tensors ``[n_chunk, *shape]`` and a
    ``StackedInnerOptimizer``), stepped in turn.  A replica's gradient and update depend
    only on its own rows and kernels, so chunking changes no bit, while a chunk's
    activations stay in cache (bench/bench_sim.py measures it).  On other devices the whole
    stack is one chunk (one set of large kernels).
    """

    CHUNK_ROWS = 2048
    """Token rows per chunk on CPU (whole replicas; >= 1 replica)."""

    def __init__(
        self,
        template: GPT,
        layout: ParamLayout,
        theta0: torch.Tensor,
        n: int,
        inner: InnerConfig,
        total_steps: int,
        stream: SampleStream,
        device: torch.device,
    ) -> None:
        self.n = n
        self.inner = inner
        self.total_steps = total_steps
        self.stream = stream
        self.device = device
        if stream.global_batch % n:
            raise ValueError(f"{n} replicas do not divide the global batch {stream.global_batch}")
        self.per_replica_batch = stream.global_batch // n
        model = copy.deepcopy(template).to(device)
        self.forward = StackedGPT(model)
        self.forward.check_against(model, stream.global_batch_at(0)[:1].to(device))
        rows = self.per_replica_batch * template.cfg.seq_len
        self.chunk = n if device.type != "cpu" else max(1, min(n, self.CHUNK_ROWS // rows))
        self.bounds = [(a, min(n, a + self.chunk)) for a in range(0, n, self.chunk)]
        views = layout.unflatten(theta0)
        self.chunks: list[dict[str, torch.Tensor]] = []
        for a, b in self.bounds:
            stacks = {
                name: views[name].to(device).unsqueeze(0).repeat(b - a, *([1] * views[name].ndim))
                for name in layout.names
            }
            for p in stacks.values():
                p.requires_grad_(True)
            self.chunks.append(stacks)
        self.optimizers = [StackedInnerOptimizer(model, c, inner) for c in self.chunks]

    def train_step(self, step: int) -> torch.Tensor:
        batch = self.stream.global_batch_at(step)
        windows = batch.view(self.n, self.per_replica_batch, batch.shape[1]).to(self.device)
        factor = wsd_factor(step, self.total_steps, self.inner)
        out = []
        for (a, b), stacks, opt in zip(self.bounds, self.chunks, self.optimizers, strict=True):
            opt.set_lr_factor(factor)
            opt.zero_grad()
            losses = self.forward.losses(stacks, windows[a:b])
            # The sum's gradient w.r.t. each loss is exactly 1: replica i's gradient is its own.
            losses.sum().backward()
            opt.step()
            out.append(losses.detach())
        return torch.cat(out).to("cpu", torch.float32)

    @torch.no_grad()
    def read(self, frag: Fragment) -> torch.Tensor:
        rows = torch.cat(
            [torch.cat([c[p.name].view(b - a, -1)[:, p.start : p.stop] for p in frag.pieces], dim=1)
             for (a, b), c in zip(self.bounds, self.chunks, strict=True)]
        )  # fmt: skip
        return rows.to("cpu", torch.float32, copy=True)

    @torch.no_grad()
    def write(self, frag: Fragment, start: int, stop: int, rows: torch.Tensor) -> None:
        """Replicas [start, stop) take ``rows`` ([stop - start, numel], or one row for all)."""
        rows = rows.to(self.device)
        one = rows.dim() == 1
        for (a, b), stacks in zip(self.bounds, self.chunks, strict=True):
            lo, hi = max(a, start), min(b, stop)
            if lo >= hi:
                continue
            part = rows if one else rows[lo - start : hi - start]
            for p, value in zip(frag.pieces, split_row(frag, part), strict=True):
                # broadcasts a single row
                stacks[p.name][lo - a : hi - a].view(hi - lo, -1)[:, p.start : p.stop].copy_(value)
