"""Outer optimizers: what the aggregator applies to the averaged pseudo-gradient.

The algorithm is docs/design.md §4.4.

All work on flat fp32 parameter vectors (common/flat.py), in place.

- ``nesterov``: momentum ``v <- mu*v + G``, ``theta <- theta - eta*(G + mu*v)``.
  The arithmetic is the exact op sequence of ``torch.optim.SGD(nesterov=True)``
  (single-tensor path, dampening 0), so both give bit-identical results when fed
  the same pseudo-gradients (tests/unit/test_outer.py).
- ``average``: plain averaging, ``theta <- theta - G`` (eta = 1, mu = 0).
- ``sparseloco``: ``theta <- theta - eta*G`` without momentum.  SparseLoCo's
  top-k with error feedback happens at the senders (the sparseloco codec with
  ``ErrorFeedback``); G is the mean of their sparse deltas.  The optimizer
  therefore requires a sparseloco codec at the level it sits above.

Invariants: ``state_dict`` / ``load_state_dict`` round-trip exactly (raw fp32
momentum, integer step), so a restarted aggregator or an auditor continues
bit for bit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from hypertrain.common.errors import ConfigError

OuterName = Literal["nesterov", "average", "sparseloco"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterConfig:
    """Outer optimizer of the global level."""

    name: OuterName = "nesterov"
    """nesterov | average | sparseloco."""
    eta: float = 0.7
    """Outer learning rate (ignored by ``average``, which is eta = 1)."""
    mu: float = 0.9
    """Nesterov momentum (nesterov only)."""

    def __post_init__(self) -> None:
        if self.name not in ("nesterov", "average", "sparseloco"):
            raise ConfigError(
                f"outer: unknown optimizer {self.name!r} (nesterov|average|sparseloco)"
            )
        if not self.eta > 0:
            raise ConfigError(f"outer: eta must be > 0, got {self.eta}")
        if not 0 <= self.mu < 1:
            raise ConfigError(f"outer: mu must be in [0, 1), got {self.mu}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.name == "average":
            d.update(eta=1.0, mu=0.0)
        elif self.name == "sparseloco":
            d["mu"] = 0.0
        return d


class OuterOptimizer(ABC):
    """Applies one outer step per global round to a flat parameter vector."""

    config: OuterConfig
    steps: int
    """Outer steps applied so far."""

    @abstractmethod
    def step(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        """``params`` (flat fp32) <- outer update with the averaged ``pseudo_grad``."""

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def state_view(self) -> dict[str, Any]:
        """The state as ``state_dict`` gives it, without copies: to read (digest) only."""
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


class NesterovOuter(OuterOptimizer):
    """Nesterov momentum with torch.optim.SGD(nesterov=True) semantics."""

    def __init__(self, config: OuterConfig) -> None:
        self.config = config
        self.steps = 0
        self.momentum: torch.Tensor | None = None

    def step(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        eta, mu = self.config.eta, self.config.mu
        # Same op sequence as torch's _single_tensor_sgd with dampening 0.
        if self.momentum is None:
            self.momentum = torch.clone(pseudo_grad).detach()
        else:
            self.momentum.mul_(mu).add_(pseudo_grad, alpha=1)
        update = pseudo_grad.add(self.momentum, alpha=mu)
        params.add_(update, alpha=-eta)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        mom = None if self.momentum is None else self.momentum.clone()
        return {"steps": self.steps, "momentum": mom}

    def state_view(self) -> dict[str, Any]:
        return {"steps": self.steps, "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        mom = state.get("momentum")
        self.momentum = None if mom is None else mom.detach().clone().to(torch.float32)


class SGDOuter(OuterOptimizer):
    """``theta <- theta - eta * G``: plain averaging (eta = 1) and SparseLoCo's outer step."""

    def __init__(self, config: OuterConfig) -> None:
        self.config = config
        self.steps = 0
        self.eta = 1.0 if config.name == "average" else config.eta

    def step(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        params.add_(pseudo_grad, alpha=-self.eta)
        self.steps += 1


def make_outer(config: OuterConfig) -> OuterOptimizer:
    if config.name == "nesterov":
        return NesterovOuter(config)
    return SGDOuter(config)
