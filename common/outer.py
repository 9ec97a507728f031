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

    def step(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        """``params`` (flat fp32) <- outer update with the averaged ``pseudo_grad``."""
        self.begin(params.numel())
        self.step_range(0, params, pseudo_grad, params)
        self.end()

    def begin(self, numel: int) -> None:  # noqa: B027 (stateless optimizers need nothing)
        """Before the ranges of one step (allocates state on the first)."""

    def end(self) -> None:
        """After the ranges of one step: it counts as taken."""
        self.steps += 1

    @abstractmethod
    def step_range(
        self, start: int, params: torch.Tensor, pseudo_grad: torch.Tensor, out: torch.Tensor
    ) -> None:
        """One range of a step: ``out`` <- the updated ``params`` (the values ``[start,
        start + n)`` of the vector; ``out`` may be ``params`` itself).  Elementwise, so a
        step taken range by range between ``begin`` and ``end`` has the bits of ``step``: the
        aggregator folds each range of the streamed mean in while it is in cache."""

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

    def begin(self, numel: int) -> None:
        if self.momentum is None:
            self.momentum = torch.empty(numel, dtype=torch.float32)

    def step_range(
        self, start: int, params: torch.Tensor, pseudo_grad: torch.Tensor, out: torch.Tensor
    ) -> None:
        assert self.momentum is not None, "begin() first"
        eta, mu = self.config.eta, self.config.mu
        mom = self.momentum[start : start + pseudo_grad.numel()]
        # Same op sequence as torch's _single_tensor_sgd with dampening 0 (its first
        # step clones the gradient into the momentum buffer).
        if self.steps == 0:
            mom.copy_(pseudo_grad)
        else:
            mom.mul_(mu).add_(pseudo_grad, alpha=1)
        update = pseudo_grad.add(mom, alpha=mu)
        torch.add(params, update, alpha=-eta, out=out)

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

    def step_range(
        self, start: int, params: torch.Tensor, pseudo_grad: torch.Tensor, out: torch.Tensor
    ) -> None:
        torch.add(params, pseudo_grad, alpha=-self.eta, out=out)


def make_outer(config: OuterConfig) -> OuterOptimizer:
    if config.name == "nesterov":
        return NesterovOuter(config)
    return SGDOuter(config)
