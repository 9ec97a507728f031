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

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from hypertrain.common.codec.base import Buffer, Codec, Mode, tensor_view
from hypertrain.common.codec.spec import CodecSpec
from hypertrain.common.errors import CodecError
from hypertrain.common.pages import PIECE_BYTES, pieces

#: Largest scale the encoder may produce: fl(2**127 / 127); 127 * MAX_SCALE is finite.
MAX_SCALE = float(torch.tensor(2.0**127, dtype=torch.float32) / 127)
assert torch.isfinite(torch.tensor(MAX_SCALE, dtype=torch.float32) * 127)


#: Smallest normal fp32.  While every nonzero divisor of a slice is at least this,
#: ``|x / d| <= 127 * (1 + 2**-23)`` rounds to at most 127, so the clamp is a no-op
#: there and is skipped; only subnormal scales can push a quotient past 127.
_MIN_NORMAL = 2.0**-126

#: Elements per slice of the streaming loops: 1M fp32 = 4 MiB, four times the
#: shared ``SLICE``.  Each slice costs 3 (decode) or 5 (encode) parallel torch
#: ops plus a few tiny ones, and every parallel op is a thread wake-up and
#: barrier; on 2 cores (64M elements) 256K-element slices spent more in those
#: than the larger slices lose by working in L3 instead of L2 (slice + work
#: buffer + codes = 9 MiB of a 32 MiB L3), and a busy machine widens the gap.
_SLICE = 1 << 20


def scales_top(scales: torch.Tensor) -> float | None:
    """The largest of ``scales`` (0.0 for none), or None unless every one is in
    ``[0, MAX_SCALE]`` (NaN is not): the check of a payload's scales, made whole
    (``_prepare``) or piece by piece as they arrive (``_survey_values``)."""
    if scales.numel() == 0:
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(scales))
    # + 0.0: scales of -0.0 only (accepted: they are >= 0) give +0.0, as a maximum taken
    # piece by piece from 0.0 does (the survey's), so both paths give the same magnitude.
    return hi + 0.0 if lo >= 0.0 and hi <= MAX_SCALE else None


def codes_ok(codes: torch.Tensor) -> bool:
    """Is every one of ``codes`` one the encoder writes (``[-127, 127]``: not -128)?"""
    return codes.numel() == 0 or int(codes.min()) != -128


class _Codes(NamedTuple):
    """A validated payload: its bytes, and the largest of its scales."""

    raw: Buffer
    top: float


_pool_lock = threading.Lock()
_free: list[torch.Tensor] = []
"""Scratch tensors not in use, shared by every thread (``_work_buffer``)."""


@contextmanager
def _work_buffer(numel: int) -> Iterator[torch.Tensor]:
    """A 1-D fp32 scratch tensor of at least ``numel`` elements (one slice), lent from a
    pool that every thread shares, and given back on leaving the block.

    Allocating it per call let malloc hand back fresh pages now and then (a page fault
    per 4 KiB, ~1.8 us each here), which cost a 300K-element encode more than its
    arithmetic; reusing one keeps every call on warm memory.  The pool holds as many
    as were ever in use at once, not one per thread that ever coded: a relay's gRPC
    threads take turns adding its islands' deltas, and a buffer per thread kept 4 MiB
    more for every thread a push had ever run on, where its memory must not grow with
    the number of islands.  The values are scratch only: no result depends on which
    buffer a call gets.
    """
    with _pool_lock:
        # One large enough if there is one (a smaller one would be thrown away for a
        # fresh, page-faulting allocation); else any, to be replaced by a larger one.
        fit = next((i for i, w in enumerate(_free) if w.numel() >= numel), -1)
        work = _free.pop(fit) if _free else None
    if work is None or work.numel() < numel:
        work = torch.empty(numel)  # a smaller one taken from the pool is let go
    try:
        yield work
    finally:
        with _pool_lock:
            _free.append(work)


class Int8Codec(Codec):
    """Blockwise-scaled int8 (see the module docstring)."""

    def __init__(self, spec: CodecSpec) -> None:
        super().__init__(spec)
        self.block = int(self.spec.param("block"))
        self.range_align = self.encode_unit = self.block
        # A slice is a whole number of blocks so scales never straddle slices.
        self.rows = max(1, _SLICE // self.block)
        self.slice = self.block * self.rows

    def _pieces(
        self, scales: torch.Tensor, work: torch.Tensor | None, *flats: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Per slice: a ``(rows, width)`` view of ``work`` (1-D, at least a slice long;
        left out when ``work`` is None), the same rows of each of ``flats`` (1-D, one
        element per value) and the ``(rows, 1)`` view of the matching ``scales``.
        Whole-block slices first, then the short tail block if there is one."""
        full_rows, tail = divmod(flats[0].numel(), self.block)
        full = full_rows * self.block
        if full_rows:
            rows = min(full_rows, self.rows)
            views = [f[:full].view(full_rows, self.block) for f in flats]
            views.append(scales[:full_rows, None])
            w = None if work is None else work[: rows * self.block].view(rows, self.block)
            for r in range(0, full_rows, rows):
                piece = tuple(views) if rows == full_rows else tuple(v[r : r + rows] for v in views)
                if w is None:
                    yield piece
                else:
                    n = piece[-1].shape[0]
                    yield (w if n == rows else w[:n], *piece)
        if tail:
            head = () if work is None else (work[:tail].view(1, tail),)
            yield (*head, *(f[full:].view(1, tail) for f in flats), scales[full_rows:, None])

    def _encode_raw(self, flat: torch.Tensor, raw: memoryview) -> None:
        numel = flat.numel()
        nblocks = -(-numel // self.block)
        scales = tensor_view(raw, torch.float32, 0, nblocks)
        codes = tensor_view(raw, torch.int8, 4 * nblocks, numel)
        with _work_buffer(min(self.slice, numel)) as work:
            for w, x, q, scale in self._pieces(scales, work, flat, codes):
                torch.abs(x, out=w)
                torch.amax(w, dim=1, keepdim=True, out=scale)
                scale.div_(127.0)
                # All-zero blocks divide by 1 (q = 0); NaN scales fall through to the
                # check below.
                divisor = torch.where(scale > 0, scale, 1.0)
                torch.div(x, divisor, out=w)
                w.round_()
                # NaN compares false here, so a NaN slice skips the clamp; it is rejected
                # below.
                if float(divisor.min()) < _MIN_NORMAL:
                    w.clamp_(-127, 127)
                q.copy_(w)
        self._check_scales(scales, "int8 encode: input")

    @staticmethod
    def _check_scales(scales: torch.Tensor, what: str) -> None:
        # One comparison catches NaN (compares false) as well as too-large values.
        if scales.numel() and not bool((scales <= MAX_SCALE).all()):
            if not bool(torch.isfinite(scales).all()):
                raise CodecError(f"{what} holds NaN or inf")
            raise CodecError(f"{what} holds a value of magnitude > 2**127 (would overflow)")

    def _prepare(self, raw: Buffer, numel: int) -> _Codes:
        nblocks = -(-numel // self.block)
        scales = tensor_view(raw, torch.float32, 0, nblocks)
        top = scales_top(scales)
        if top is None:
            self._check_scales(scales, "int8 payload: scale")  # NaN, inf or too large
            raise CodecError("int8 payload: negative scale")
        first = 4 * nblocks
        for at in pieces(raw, first, numel):  # a mapped input is not kept resident
            if not codes_ok(tensor_view(raw, torch.int8, at, min(PIECE_BYTES, first + numel - at))):
                raise CodecError("int8 payload: code -128 (the encoder uses [-127, 127])")
        return _Codes(raw, top)

    def _survey_values(self, numel: int) -> Callable[[memoryview, int], float | None] | None:
        end = 4 * -(-numel // self.block)  # the scales, then the codes

        def check(part: memoryview, at: int) -> float | None:
            top: float | None = 0.0
            if at < end:  # scales
                n = min(len(part), end - at)
                if at % 4 or n % 4:  # a scale split across chunks
                    return None
                top = scales_top(torch.frombuffer(part[:n], dtype=torch.float32))
                part = part[n:]
            if len(part) and not codes_ok(torch.frombuffer(part, dtype=torch.int8)):
                return None
            return top

        return check

    def _prepare_known(self, raw: Buffer, numel: int, top: float) -> _Codes:
        return _Codes(raw, top)  # the passes above, made by the receiver (survey.py)

    def _magnitude(self, prepared: _Codes, numel: int) -> float:
        # Every value is fl(q * scale) with |q| <= 127: at most 127 * scale, rounded up by
        # less than one part in 2^23.
        if not numel:
            return 0.0
        return 127.0 * prepared.top * (1.0 + 2.0**-23)

    def _apply_range(self, prepared: _Codes, numel: int, out: torch.Tensor, start: int) -> None:
        # Blocks never straddle the range (start is a block boundary), so the slice's
        # blocks and their scales are exactly the whole tensor's.
        raw = prepared.raw
        nblocks = -(-numel // self.block)
        n = out.numel()
        first = start // self.block
        scales = tensor_view(raw, torch.float32, 4 * first, -(-n // self.block))
        codes = tensor_view(raw, torch.int8, 4 * nblocks + start, n)
        self._accumulate(scales, codes, out)

    def _accumulate(
        self, scales: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, mode: Mode = "add"
    ) -> None:
        """``out`` += (or -=, ``mode`` "sub") the decoded values of ``codes``."""
        with _work_buffer(min(self.slice, out.numel())) as work:
            for w, q, dst, scale in self._pieces(scales, work, codes, out):
                # The decoded slice is fl(float(q) * scale), exactly what decode() holds;
                # adding it afterwards keeps the two roundings of out.add_(decode(data)).
                w.copy_(q)
                w.mul_(scale)
                if mode == "add":
                    dst.add_(w)
                else:
                    dst.sub_(w)

    def _apply(self, prepared: _Codes, out: torch.Tensor, mode: Mode) -> None:
        raw, numel = prepared.raw, out.numel()
        nblocks = -(-numel // self.block)
        scales = tensor_view(raw, torch.float32, 0, nblocks)
        codes = tensor_view(raw, torch.int8, 4 * nblocks, numel)
        if mode == "set":  # straight into out
            for q, dst, scale in self._pieces(scales, None, codes, out):
                dst.copy_(q)
                dst.mul_(scale)
            return
        self._accumulate(scales, codes, out, mode)
