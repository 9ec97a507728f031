"""Flat parameter vectors: one fp32 tensor per model state.

Deltas, aggregates and outer steps all work on a single contiguous fp32
vector that concatenates a model's parameters in name-sorted order.  The
layout is a pure function of the model's parameter names and shapes, so two
processes that build the same preset agree on every offset.

Invariants: parameters are ordered by name (byte-wise); each occupies
``[offset, offset + numel)``; tied parameters appear once (under the name
``named_parameters`` reports first).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hypertrain.common.errors import ConfigError

RELEASE_BYTES = 64 << 20
"""How many bytes of consumed parameters ``flatten`` frees between ``release`` calls."""


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """Names, shapes and offsets of a model's parameters in the flat vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, model: nn.Module) -> ParamLayout:
        named = sorted(model.named_parameters())
        offsets, total = [], 0
        for _, p in named:
            offsets.append(total)
            total += p.numel()
        return cls(
            names=tuple(n for n, _ in named),
            shapes=tuple(tuple(p.shape) for _, p in named),
            offsets=tuple(offsets),
            numel=total,
        )

    def _params(self, model: nn.Module) -> list[torch.Tensor]:
        params = dict(model.named_parameters())
        if sorted(params) != list(self.names):
            raise ConfigError("flat layout: model parameters do not match the layout")
        return [params[n] for n in self.names]

    def flatten(
        self,
        model: nn.Module,
        out: torch.Tensor | None = None,
        consume: bool = False,
        release: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Copy the model's parameters into a flat fp32 vector (``out`` if given).

        ``consume``: free each parameter once copied (the model is left without them), so
        the model and the vector are never both whole in memory.  ``release``: called
        after every ``RELEASE_BYTES`` of parameters freed, to give their memory back to
        the system (a freed tensor below malloc's mmap threshold stays in the heap, so
        without it the vector and the freed parameters were both resident at the end)."""
        flat = torch.empty(self.numel, dtype=torch.float32) if out is None else out
        freed = 0
        for p, off in zip(self._params(model), self.offsets, strict=True):
            flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
            if consume:
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype)
                if release is not None and freed >= RELEASE_BYTES:
                    release()
                    freed = 0
        if release is not None and freed:
            release()
        return flat

    @torch.no_grad()
    def subtract_from(self, model: nn.Module, flat: torch.Tensor, start: int = 0) -> None:
        """``flat -= `` the model's parameters, range by range, without a flat copy of them:
        the bits of ``flat - flatten(model)``; ``start``: ``flat`` is the values ``[start,
        start + flat.numel())`` of the vector (the parameters over that range only)."""
        end = start + flat.numel()
        if start < 0 or end > self.numel:
            raise ConfigError(
                f"flat layout: values [{start}, {end}) are not within {self.numel} parameters"
            )
        params = self._params(model)
        first = max(0, bisect.bisect_right(self.offsets, start) - 1)
        for p, off in zip(params[first:], self.offsets[first:], strict=True):
            if off >= end:
                break
            lo, hi = max(off, start), min(off + p.numel(), end)
            if lo < hi:
                part = flat[lo - start : hi - start]
                part.sub_(p.detach().reshape(-1)[lo - off : hi - off].to(part.device))

    @torch.no_grad()
    def load(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Copy a flat vector into the model's parameters (in place)."""
        if flat.numel() != self.numel:
            raise ConfigError(f"flat layout: vector of {flat.numel()} != {self.numel} parameters")
        for p, off in zip(self._params(model), self.offsets, strict=True):
            p.copy_(flat[off : off + p.numel()].view(p.shape))

    @torch.no_grad()
    def bind(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Make the model's parameters views of ``flat`` (no copy; the model's own
        parameter memory is let go).  For a model that only reads them (an evaluation)
        of a vector nobody writes to while it runs.  The shapes are the layout's, so a
        model whose parameters were emptied (an evaluator letting a state go) binds
        again."""
        if flat.numel() != self.numel or flat.dtype != torch.float32:
            raise ConfigError(f"flat layout: vector of {flat.numel()} != {self.numel} parameters")
        for p, off, shape in zip(self._params(model), self.offsets, self.shapes, strict=True):
            p.data = flat[off : off + int(torch.Size(shape).numel())].view(shape)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` per parameter name (no copy)."""
        return {
            n: flat[off : off + int(torch.Size(s).numel())].view(s)
            for n, s, off in zip(self.names, self.shapes, self.offsets, strict=True)
        }
