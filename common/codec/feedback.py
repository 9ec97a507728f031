"""Sender-side error feedback: what a lossy codec drops is sent later, not lost.

Per call, with residual ``e`` (zeros at start) and decay ``beta``::

    e <- fl(fl(beta * e) + delta)      # two fp32 roundings, never a fused multiply-add
    c <- encode(e)
    e <- fl(e - decode(c))
    return c

Invariants:
- Conservation: ``decode(c) + e_new == beta * e_old + delta`` up to the fp32
  roundings above (exact for the lossless fp32 codec, where ``e_new`` is 0).
- The residual is updated atomically: if encoding fails (NaN/inf), the state is
  unchanged.
- ``decode(c)`` is taken from the raw payload just encoded (no re-parse, no
  decompression); it is bit-identical to ``codec.decode(c)``.
- ``state_dict``/``load_state_dict`` round-trip the state exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hypertrain.common.codec.base import Codec, alloc_raw, flat_input
from hypertrain.common.codec.layout import raw_length
from hypertrain.common.codec.registry import make_codec
from hypertrain.common.codec.spec import CodecSpec
from hypertrain.common.errors import CodecError, ConfigError


class ErrorFeedback:
    """Error-feedback state of one sender for one tensor (see the module docstring)."""

    def __init__(
        self, codec: Codec | CodecSpec | str, numel_or_shape: int | Sequence[int], beta: float = 1.0
    ) -> None:
        self.codec = codec if isinstance(codec, Codec) else make_codec(codec)
        shape = (numel_or_shape,) if isinstance(numel_or_shape, int) else tuple(numel_or_shape)
        if any(int(d) < 0 for d in shape):
            raise ConfigError(f"error feedback shape {shape} has a negative dimension")
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)
        self.beta = self._check_beta(beta)
        self._residual = torch.zeros(self.shape, dtype=torch.float32)

    @staticmethod
    def _check_beta(beta: float) -> float:
        beta = float(beta)
        if not (math.isfinite(beta) and 0.0 <= beta <= 1.0):
            raise ConfigError(f"error feedback beta must be in [0, 1], got {beta!r}")
        return beta

    @property
    def residual(self) -> torch.Tensor:
        """The current residual ``e`` (the live tensor: read it, do not modify it)."""
        return self._residual

    def encode(self, delta: torch.Tensor) -> bytes:
        """Fold ``delta`` into the residual, encode it, keep what was not sent."""
        flat = flat_input(delta)
        if flat.numel() != self._residual.numel():
            raise CodecError(
                f"delta has {flat.numel()} values, error feedback holds {self._residual.numel()}"
            )
        # A new tensor, swapped in only after encoding succeeded (atomic update).
        acc = torch.mul(self._residual, self.beta).view(-1)
        acc.add_(flat)
        raw = alloc_raw(raw_length(self.codec.spec, acc.numel()))
        self.codec._encode_raw(acc, raw)
        blob = self.codec.frame(raw, self.shape)
        self.codec._apply(self.codec._prepare(raw, acc.numel()), acc, "sub")
        self._residual = acc.view(self.shape)
        return blob

    def state_dict(self) -> dict[str, torch.Tensor | float]:
        """A copy of the state: ``{"residual": tensor, "beta": float}``."""
        return {"residual": self._residual.clone(), "beta": self.beta}

    def load_state_dict(self, state: dict[str, torch.Tensor | float]) -> None:
        """Restore a state saved by :meth:`state_dict` (``ConfigError`` if it does not fit)."""
        residual, beta = state.get("residual"), state.get("beta")
        if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32:
            raise ConfigError("error feedback state needs a float32 'residual' tensor")
        if tuple(residual.shape) != self.shape:
            raise ConfigError(
                f"error feedback residual has shape {tuple(residual.shape)}, expected {self.shape}"
            )
        if not isinstance(beta, float | int) or isinstance(beta, bool):
            raise ConfigError("error feedback state needs a float 'beta'")
        self.beta = self._check_beta(beta)
        self._residual = residual.detach().to("cpu", copy=True).contiguous()
