"""The fp32 reference codec: the values themselves, lossless.

Payload: the ``n`` float32 values of the flattened tensor, little-endian.

Invariants: ``decode(encode(x))`` equals ``x`` bit for bit (signed zeros
included); NaN/inf are rejected on encode and on decode, so a decoded tensor
is always finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from hypertrain.common.codec import survey
from hypertrain.common.codec.base import SLICE, Buffer, Codec, Mode, all_finite, tensor_view
from hypertrain.common.errors import CodecError
from hypertrain.common.pages import PIECE_BYTES, pieces


class _Values(NamedTuple):
    """A validated payload: the values, and the largest of their magnitudes."""

    raw: Buffer
    top: float


class Fp32Codec(Codec):
    """Raw fp32 values (see the module docstring)."""

    lossless = True

    @property
    def values_in_place(self) -> bool:
        return not self.spec.zstd

    def _encode_raw(self, flat: torch.Tensor, raw: memoryview) -> None:
        dst = tensor_view(raw, torch.float32, 0, flat.numel())
        for start in range(0, flat.numel(), SLICE):
            part = flat[start : start + SLICE]
            # Checked per slice while it is in cache, before it is copied out.
            if not all_finite(part):
                raise CodecError("fp32 encode: input holds NaN or inf")
            dst[start : start + SLICE].copy_(part)

    def _prepare(self, raw: Buffer, numel: int) -> _Values:
        # One read-only pass: the least and largest value of each piece say both whether
        # every value is finite (aminmax propagates NaN) and how large they get.
        top = 0.0
        for at in pieces(raw, 0, 4 * numel):  # a mapped input is not kept resident
            n = min(PIECE_BYTES, 4 * numel - at) // 4
            piece = survey.finite_top(tensor_view(raw, torch.float32, at, n))
            if piece is None:
                raise CodecError("fp32 payload holds NaN or inf")
            top = max(top, piece)
        return _Values(raw, top)

    def _survey_values(self, numel: int) -> Callable[[memoryview, int], float | None] | None:
        return survey.fp32_values

    def _prepare_known(self, raw: Buffer, numel: int, top: float) -> _Values:
        return _Values(raw, top)  # the pass above, made by the receiver (survey.py)

    def _magnitude(self, prepared: _Values, numel: int) -> float:
        return prepared.top

    def _apply_range(self, prepared: _Values, numel: int, out: torch.Tensor, start: int) -> None:
        out.add_(tensor_view(prepared.raw, torch.float32, 4 * start, out.numel()))

    def _apply(self, prepared: _Values, out: torch.Tensor, mode: Mode) -> None:
        src = tensor_view(prepared.raw, torch.float32, 0, out.numel())
        if mode == "set":
            out.copy_(src)
        elif mode == "add":
            out.add_(src)
        else:
            out.sub_(src)
