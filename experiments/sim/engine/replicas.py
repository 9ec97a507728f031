"""The replicas of a job, behind one interface, and the per-replica execution path.

A ``ReplicaSet`` holds N model replicas with their inner optimizers and their
data, and offers what the sync engine (run.py) needs and nothing more:

- ``train_step(step)``: every replica takes one inner step (0-based ``step``)
  on its slice of the global batch, with the WSD factor of that step;
- ``read(frag)``: the replicas' parameters of one fragment as CPU fp32 rows
  ``[N, frag.numel]`` (a fresh tensor: the caller may keep it);
- ``write(frag, start, stop, rows)``: set replicas ``start..stop-1`` of one
  fragment (rows ``[stop-start, numel]``, or one row ``[numel]`` for all).

``PerReplica`` is the per-replica path: N separate ``GPT`` models, each with
its own ``InnerOptimizer`` (common/optim.py), stepped one after the other with
exactly the op sequence of ``IslandCore.train_step`` (common/roles.py), on
``stream.replica_batch(step, i, N)`` (or ``global_batch_at`` for the
data-parallel control, which is the same rows for N = 1).

Invariants: the data of replica i at step t is rows ``[i*b, (i+1)*b)`` of the
DP control's batch at t; replicas never share tensors; nothing reads a clock.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from hypertrain.common.data import SampleStream
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import Fragment
from hypertrain.common.model import GPT
from hypertrain.common.optim import InnerConfig, InnerOptimizer, wsd_factor


class ReplicaSet(Protocol):
    """N replicas with inner optimizers and data (see the module docstring)."""

    n: int
    stream: SampleStream

    def train_step(self, step: int) -> torch.Tensor:
        """One inner step of every replica; returns the N training losses (CPU)."""
        ...

    def read(self, frag: Fragment) -> torch.Tensor:
        """CPU fp32 ``[N, frag.numel]``: the replicas' parameters of ``frag``."""
        ...

    def write(self, frag: Fragment, start: int, stop: int, rows: torch.Tensor) -> None:
        """Set replicas ``start..stop-1`` of ``frag`` to ``rows`` (2-D, or 1-D for all)."""
        ...


def split_row(frag: Fragment, row: torch.Tensor) -> list[torch.Tensor]:
    """Views of a ``[..., frag.numel]`` tensor per piece of ``frag`` (``[..., piece.numel]``)."""
    out, off = [], 0
    for piece in frag.pieces:
        out.append(row[..., off : off + piece.numel])
        off += piece.numel
    return out


class PerReplica:
    """The per-replica path: N ``GPT`` + ``InnerOptimizer`` pairs, stepped in turn."""

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
        self.models: list[GPT] = []
        self.optimizers: list[InnerOptimizer] = []
        for _ in range(n):
            model = copy.deepcopy(template)
            layout.load(model, theta0)
            model.to(device)
            self.models.append(model)
            self.optimizers.append(InnerOptimizer(model, inner))
        self._params = [dict(m.named_parameters()) for m in self.models]

    def train_step(self, step: int) -> torch.Tensor:
        factor = wsd_factor(step, self.total_steps, self.inner)
        losses = []
        for i, (model, opt) in enumerate(zip(self.models, self.optimizers, strict=True)):
            windows = self.stream.replica_batch(step, i, self.n).to(self.device)
            # The op sequence of IslandCore.train_step (common/roles.py).
            opt.set_lr_factor(factor)
            opt.zero_grad()
            loss = model.loss(windows)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses).to("cpu", torch.float32)

    @torch.no_grad()
    def read(self, frag: Fragment) -> torch.Tensor:
        rows = [
            torch.cat([params[p.name].view(-1)[p.start : p.stop] for p in frag.pieces])
            for params in self._params
        ]
        return torch.stack(rows).to("cpu", torch.float32)

    @torch.no_grad()
    def write(self, frag: Fragment, start: int, stop: int, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        for i in range(start, stop):
            row = rows if rows.ndim == 1 else rows[i - start]
            for p, value in zip(frag.pieces, split_row(frag, row), strict=True):
                self._params[i][p.name].view(-1)[p.start : p.stop].copy_(value)
