"""Dense int8 with one fp32 scale per block: the regional workhorse codec.

Per block of ``block`` consecutive elements of the flattened tensor (the last
block may be shorter), in IEEE fp32:

    scale = absmax(block) / 127                       (0 for an all-zero block)
    q     = clamp(round_half_even(x / d), -127, 127)  with d = scale, or 1 if scale == 0
    x'    = q * scale                                 (the decoded value)

Payload: ``ceil(n / block)`` float32 scales, then ``n`` int8 codes.

Invariants:
- Every step is a single correctly rounded IEEE operation (division, not a
  multiply by a reciprocal), so the bytes are the same on every machine and
  thread count; ``|x - x'| <= scale / 2`` up to fp32 rounding (see the tests)
  whenever the scale is a normal float.
- Inputs with ``|x| > 2**127`` are rejected: their scale times 127 would
  overflow to inf on decode.  Decoding accepts only scales in
  ``[0, MAX_SCALE]`` and codes in ``[-127, 127]``, so decoded values are finite.
"""

from __future__ import annotations

import torch

from hypertrain.common.codec.base import SLICE, Buffer, Codec, Mode, tensor_view
from hypertrain.common.codec.spec import CodecSpec
from hypertrain.common.errors import CodecError

#: Largest scale the encoder may produce: fl(2**127 / 127); 127 * MAX_SCALE is finite.
MAX_SCALE = float(torch.tensor(2.0**127, dtype=torch.float32) / 127)
assert torch.isfinite(torch.tensor(MAX_SCALE, dtype=torch.float32) * 127)


class Int8Codec(Codec):
    """Blockwise-scaled int8 (see the module docstring)."""

    def __init__(self, spec: CodecSpec) -> None:
        super().__init__(spec)
        self.block = int(self.spec.param("block"))
        # A slice is a whole number of blocks so scales never straddle slices.
        self.slice = self.block * max(1, SLICE // self.block)

    def _spans(self, numel: int) -> list[tuple[int, int]]:
        """``(start, stop)`` element ranges: whole-block slices, then the short tail block."""
        full = numel - numel % self.block
        spans = [(s, min(s + self.slice, full)) for s in range(0, full, self.slice)]
        if full < numel:
            spans.append((full, numel))
        return spans

    def _encode_raw(self, flat: torch.Tensor, raw: memoryview) -> None:
        numel = flat.numel()
        nblocks = -(-numel // self.block)
        scales = tensor_view(raw, torch.float32, 0, nblocks)
        codes = tensor_view(raw, torch.int8, 4 * nblocks, numel)
        work = torch.empty(min(self.slice, numel))
        for start, stop in self._spans(numel):
            width = min(self.block, stop - start)
            rows = (stop - start) // width
            b0 = start // self.block
            x = flat[start:stop].view(rows, width)
            w = work[: stop - start].view(rows, width)
            scale = scales[b0 : b0 + rows]
            torch.abs(x, out=w)
            torch.amax(w, dim=1, out=scale)
            scale.div_(127.0)
            # All-zero blocks divide by 1 (q = 0); NaN scales fall through to the check below.
            divisor = torch.where(scale > 0, scale, 1.0)
            torch.div(x, divisor[:, None], out=w)
            w.round_().clamp_(-127, 127)
            codes[start:stop].view(rows, width).copy_(w)
        self._check_scales(scales, "int8 encode: input")

    @staticmethod
    def _check_scales(scales: torch.Tensor, what: str) -> None:
        # One comparison catches NaN (compares false) as well as too-large values.
        if scales.numel() and not bool((scales <= MAX_SCALE).all()):
            if not bool(torch.isfinite(scales).all()):
                raise CodecError(f"{what} holds NaN or inf")
            raise CodecError(f"{what} holds a value of magnitude > 2**127 (would overflow)")

    def _prepare(self, raw: Buffer, numel: int) -> Buffer:
        nblocks = -(-numel // self.block)
        scales = tensor_view(raw, torch.float32, 0, nblocks)
        self._check_scales(scales, "int8 payload: scale")
        if nblocks and not bool((scales >= 0).all()):
            raise CodecError("int8 payload: negative scale")
        codes = tensor_view(raw, torch.int8, 4 * nblocks, numel)
        if numel and int(codes.min()) == -128:
            raise CodecError("int8 payload: code -128 (the encoder uses [-127, 127])")
        return raw

    def _apply(self, raw: Buffer, out: torch.Tensor, mode: Mode) -> None:
        numel = out.numel()
        nblocks = -(-numel // self.block)
        scales = tensor_view(raw, torch.float32, 0, nblocks)
        codes = tensor_view(raw, torch.int8, 4 * nblocks, numel)
        work = torch.empty(min(self.slice, numel)) if mode != "set" else None
        for start, stop in self._spans(numel):
            width = min(self.block, stop - start)
            rows = (stop - start) // width
            b0 = start // self.block
            dst = out[start:stop]
            # The decoded slice is fl(float(q) * scale), exactly what decode() holds;
            # adding it afterwards keeps the two roundings of out.add_(decode(data)).
            buf = dst if work is None else work[: stop - start]
            buf.copy_(codes[start:stop])
            buf.view(rows, width).mul_(scales[b0 : b0 + rows, None])
            if mode == "add":
                dst.add_(buf)
            elif mode == "sub":
                dst.sub_(buf)
