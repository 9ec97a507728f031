"""A toy island for the fault simulation: a small parameter vector, a fixed update.

``RunConfig(model="toy")`` runs every real part of the round (codecs with error
feedback, fixed-order aggregation, the outer optimizer, machines, nodes, tapes,
checkpoints, the audit) on a vector of ``TOY_NUMEL`` floats instead of a model, so that
thousands of fault schedules run in minutes.  "Training" pulls each island's vector a
fixed fraction of the way to a target drawn from a generator seeded by (run seed,
island, step): deterministic, different per island and step, and cheap.

Invariant: ``ToyIsland`` inherits every sync and merge rule from ``roles.IslandState``;
only ``train_step`` / ``params`` / ``load_params`` are its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import Fragment
from hypertrain.common.roles import IslandState

TOY_NUMEL = 4096
"""Parameters of the toy model (a few thousand: every codec block shape is exercised)."""
TOY_LR = 0.25
"""Fraction of the way to its target an island moves per step."""


def toy_layout() -> ParamLayout:
    return ParamLayout(names=("theta",), shapes=((TOY_NUMEL,),), offsets=(0,), numel=TOY_NUMEL)


def toy_parameters(cfg: RunConfig) -> torch.Tensor:
    """The toy run's starting parameters (a pure function of the seed)."""
    g = torch.Generator().manual_seed(cfg.seed)
    return torch.randn(TOY_NUMEL, generator=g) * 0.1


def _target(seed: int, index: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(((seed * 1_000_003 + index) * 1_000_003 + step) % (1 << 62))
    return torch.randn(TOY_NUMEL, generator=g)


class ToyIsland(IslandState):
    """An island whose model is a vector (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        island_id: str,
        theta0: torch.Tensor,
        fragments: Sequence[Fragment] | None = None,
    ) -> None:
        """``fragments``: the run's streaming fragments (``IslandState``)."""
        super().__init__(cfg, island_id, theta0, fragments)
        self.theta = theta0.clone()

    def train_step(self) -> float:
        target = _target(self.cfg.seed, self.data_index, self.step)
        diff = self.theta - target
        self.theta.sub_(diff * TOY_LR)
        self.step += 1
        return float(diff.square().mean())

    def params(self) -> torch.Tensor:
        return self.theta.clone()

    def load_params(self, flat: torch.Tensor) -> None:
        self.theta.copy_(flat)
