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
from collections.abc import Callable, Sequence

import torch

from hypertrain.common.codec import survey
from hypertrain.common.codec.base import SLICE, Buffer, Codec, flat_input, tensor_view
from hypertrain.common.codec.header import CHECKSUM_SEGMENT
from hypertrain.common.codec.registry import make_codec
from hypertrain.common.codec.spec import CodecSpec
from hypertrain.common.errors import CodecError, ConfigError


class ErrorFeedback:
    """Error-feedback state of one sender for one tensor (see the module docstring).

    A residual of all +0.0 is held as no tensor at all: a lossless codec never leaves
    anything else (``e - decode(encode(e))`` is +0.0 for every finite ``e``), so its
    sender keeps no model-sized buffer for it."""

    def __init__(
        self, codec: Codec | CodecSpec | str, numel_or_shape: int | Sequence[int], beta: float = 1.0
    ) -> None:
        self.codec = codec if isinstance(codec, Codec) else make_codec(codec)
        shape = (numel_or_shape,) if isinstance(numel_or_shape, int) else tuple(numel_or_shape)
        if any(int(d) < 0 for d in shape):
            raise ConfigError(f"error feedback shape {shape} has a negative dimension")
        self.shape: tuple[int, ...] = tuple(int(d) for d in shape)
        self.beta = self._check_beta(beta)
        self._residual: torch.Tensor | None = None  # None: all +0.0
        self.released: torch.Tensor | None = None
        """After ``encode(..., consume=True)``: the previous residual's buffer, which the
        caller may reuse (None if there was none)."""

    @staticmethod
    def _check_beta(beta: float) -> float:
        beta = float(beta)
        if not (math.isfinite(beta) and 0.0 <= beta <= 1.0):
            raise ConfigError(f"error feedback beta must be in [0, 1], got {beta!r}")
        return beta

    @property
    def residual(self) -> torch.Tensor:
        """The current residual ``e`` (the live tensor: read it, do not modify it; a fresh
        zero tensor while the residual is all zeros)."""
        if self._residual is None:
            return torch.zeros(self.shape, dtype=torch.float32)
        return self._residual

    @property
    def is_zero(self) -> bool:
        """Is the residual all +0.0 (held as no tensor)?"""
        return self._residual is None

    def encode(self, delta: torch.Tensor, consume: bool = False) -> Buffer:
        """Fold ``delta`` into the residual, encode it, keep what was not sent.

        ``consume``: ``delta``'s memory may be used as the work buffer (the new residual
        is then computed in it, and the old residual's buffer is left in ``released``):
        no model-sized allocation.  The bits are the same either way."""
        n = math.prod(self.shape)
        return self.encode_parts(delta, [(0, n)], consume, shape=self.shape)[0]

    def encode_parts(
        self,
        delta: torch.Tensor,
        parts: Sequence[tuple[int, int]],
        consume: bool = False,
        shape: tuple[int, ...] | None = None,
    ) -> list[Buffer]:
        """``encode``, with the accumulated values cut into ``parts`` (ranges ``[a, b)``
        tiling the tensor in order) and each range encoded as a 1-D blob of its own: what
        an island sends to each relay shard.  Every value goes through the same
        operations as in ``encode``; with codec-unit-aligned starts
        (``Codec.encode_unit``) the residual is the same bits too.  ``shape``: the shape
        the single part is reported as (``encode``)."""
        flat = flat_input(delta)
        self._check_numel(flat.numel())
        position = 0
        for a, b in parts:
            if a != position or b < a or a % self.codec.encode_unit:
                raise CodecError(f"error feedback: part [{a}, {b}) does not continue at {position}")
            position = b
        if position != flat.numel():
            raise CodecError(f"error feedback: parts cover {position} of {flat.numel()} values")
        own = consume and flat.data_ptr() == delta.data_ptr()  # flat_input may have copied
        # acc = fl(fl(beta * e) + delta), in a new tensor or in delta's memory (addition is
        # commutative, signed zeros included, so ``delta + x`` gives the bits of ``x + delta``).
        # The residual is swapped only after encoding succeeded (atomic update).
        e = self._residual
        if e is None:  # beta * (+0.0) = +0.0
            acc = flat.add_(0.0) if own else torch.add(flat, 0.0)
        elif self.beta == 1.0:  # 1.0 * e = e exactly
            acc = flat.add_(e.view(-1)) if own else torch.add(e.view(-1), flat)
        elif own:
            acc = flat
            ev = e.view(-1)
            for start in range(0, acc.numel(), SLICE):  # a cache-sized temporary per slice
                acc[start : start + SLICE].add_(torch.mul(ev[start : start + SLICE], self.beta))
        else:
            acc = torch.mul(e, self.beta).view(-1)
            acc.add_(flat)
        encoded = [
            self.codec.encode_flat(acc[a:b], shape if shape is not None else (b - a,))
            for a, b in parts
        ]
        self.released = e if own else None
        if self.codec.lossless:  # acc - decode(c) is +0.0 everywhere
            self._residual = None
        else:
            for (a, b), (_, raw) in zip(parts, encoded, strict=True):
                self.codec._apply(self.codec._prepare(raw, b - a), acc[a:b], "sub")
            self._residual = acc.view(self.shape)
        return [blob for blob, _ in encoded]

    def _check_numel(self, numel: int) -> None:
        if numel != math.prod(self.shape):
            raise CodecError(
                f"delta has {numel} values, error feedback holds {math.prod(self.shape)}"
            )

    @property
    def frames_in_place(self) -> bool:
        """Can a delta be encoded where it lies, behind header room (``encode_framed``)?"""
        return self.codec.lossless and self.codec.values_in_place and self._residual is None

    def encode_framed(
        self,
        frame: Buffer,
        shape: tuple[int, ...],
        fill: Callable[[int, int], None] | None = None,
    ) -> memoryview:
        """``encode`` of a delta held as fp32 values in ``frame`` behind the codec's header
        room (``Codec.header_length``), framed there without a copy (``Codec.frame_in_place``);
        for a lossless codec whose payload is the values (fp32), whose residual is always
        zero.  The same bytes as ``encode`` of those values; ``frame`` is consumed.
        ``fill(start, end)``: writes the delta's values ``[start, end)`` there first.

        One checksum segment at a time (``CHECKSUM_SEGMENT``): the segment is written
        (``fill``), normalized, checked and checksummed (``survey.Survey.of_payload``)
        while it is in cache, where the whole delta would be read from memory once for
        each of those."""
        if not self.frames_in_place:
            raise CodecError(f"{self.codec.spec}: in-place framing needs lossless fp32 values")
        numel = math.prod(shape)
        self._check_numel(numel)
        head = self.codec.header_length(shape)
        view = memoryview(frame).cast("B")
        values = tensor_view(view, torch.float32, head, numel)
        seen = survey.Survey.of_payload(len(view), head)
        step = CHECKSUM_SEGMENT // 4
        for start in range(0, numel, step):
            end = min(numel, start + step)
            if fill is not None:
                fill(start, end)
            # beta * (+0.0) + delta, as encode computes it (-0.0 becomes +0.0)
            values[start:end].add_(0.0)
            seen.feed(view[head + 4 * start : head + 4 * end])
        blob = self.codec.frame_in_place(view, shape, seen.facts())
        self.released = None
        return blob

    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor | float | None]:
        """The state: ``{"residual": tensor or None (all zeros), "beta": float}``; a copy
        unless ``copy=False`` (the live tensor, to be written out before the next encode)."""
        e = self._residual
        return {"residual": None if e is None else (e.clone() if copy else e), "beta": self.beta}

    def load_state_dict(self, state: dict[str, torch.Tensor | float | None]) -> None:
        """Restore a state saved by :meth:`state_dict` (``ConfigError`` if it does not fit)."""
        residual, beta = state.get("residual"), state.get("beta")
        if residual is not None and (
            not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32
        ):
            raise ConfigError("error feedback state needs a float32 'residual' tensor or None")
        if residual is not None and tuple(residual.shape) != self.shape:
            raise ConfigError(
                f"error feedback residual has shape {tuple(residual.shape)}, expected {self.shape}"
            )
        if not isinstance(beta, float | int) or isinstance(beta, bool):
            raise ConfigError("error feedback state needs a float 'beta'")
        self.beta = self._check_beta(beta)
        self._residual = (
            None if residual is None else residual.detach().to("cpu", copy=True).contiguous()
        )
