"""A multi-rank island: K data-parallel ranks under ``torchrun`` acting as one island.

    torchrun --standalone --nproc-per-node 2 -m hypertrain.island --region eu --relay ...

torchrun sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` for each rank;
:func:`from_environment` joins the process group (gloo on the CPU, NCCL when the
island trains on CUDA devices).  Division of labour:

- every rank trains on its share of the island's batch; :meth:`TorchRanks.average_gradients`
  averages the gradients (one all-reduce per step) so every rank takes the same
  inner step;
- rank 0 alone talks to the relay (pushes, fetches), signs, writes the rejoin state
  and serves metrics; :meth:`TorchRanks.broadcast` hands each merge it fetched to the
  other ranks, which apply it at the same pinned step;
- stopping is agreed on: the step's all-reduce also carries "a rank was asked to
  stop" (SIGTERM reaches every rank from torchrun, but not necessarily between the
  same two steps), so all ranks stop after the same step, never inside a merge.

The all-reduce sums in an order fixed by the group size, so two runs of the same
config are bit-identical; against one rank the sums are ordered differently, so
the results agree to rounding only.
"""

from __future__ import annotations

import datetime
import os
import threading

import torch
import torch.distributed as dist

#: How long a rank waits in a collective.  Ranks other than 0 wait in the merge
#: broadcast while rank 0 waits for its relay (tau = 0), which lasts as long as the
#: slowest island of the region needs; an hour covers any sane H_r.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=1)


def world_size() -> int:
    """The number of ranks torchrun started (1 when not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class TorchRanks:
    """The island's process group (implements ``hypertrain.common.roles.RankGroup``)."""

    def __init__(self, stop: threading.Event, device: torch.device) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.device = device
        self.stop = stop
        #: Set by the last all-reduce: some rank was asked to stop before that step.
        self.stopping = False
        self._buffer: torch.Tensor | None = None

    def average_gradients(self, model: torch.nn.Module, loss: float) -> float:
        """Mean of every rank's gradients, in place; returns the mean loss over ranks.

        One all-reduce of a flat buffer: the gradients, then this rank's loss, then a
        1 if this rank was asked to stop.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        if self._buffer is None or self._buffer.numel() != numel + 2:
            self._buffer = torch.empty(numel + 2, dtype=torch.float32, device=self.device)
        buf, offset = self._buffer, 0
        for p in params:
            part = buf[offset : offset + p.numel()]
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad.reshape(-1))
            offset += p.numel()
        buf[numel] = loss
        buf[numel + 1] = 1.0 if self.stop.is_set() else 0.0
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        self.stopping = bool(buf[numel + 1] > 0)
        buf.div_(self.size)
        offset = 0
        for p in params:
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(buf[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return float(buf[numel])

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (in place; returned for convenience)."""
        if tensor.device != self.device:
            moved = tensor.to(self.device)
            dist.broadcast(moved, src=0)
            tensor.copy_(moved)
        else:
            dist.broadcast(tensor, src=0)
        return tensor

    def check_equal(self, digest: str) -> None:
        """Raise unless every rank ended on the same state digest."""
        digests: list[str | None] = [None] * self.size
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise RuntimeError(f"ranks of one island diverged: state digests {digests}")

    def close(self) -> None:
        """Leave the group once every rank is done with it (a rank that tears down its
        gloo pairs while a peer still uses them can abort the peer's process)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def from_environment(stop: threading.Event, device: torch.device) -> TorchRanks | None:
    """Join torchrun's process group; None when this is a single-process island."""
    if world_size() <= 1:
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # NCCL's own collectives (barrier, objects) use this device
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    return TorchRanks(stop, device)
