"""SparseLoCo: chunked top-k with low-bit values (error feedback lives in ``feedback.py``).

The flattened tensor is cut into chunks of ``chunk`` elements (the last may be
shorter).  In each chunk of length ``L`` the ``k = kept_in_chunk(density, L)``
largest magnitudes are kept, and each kept value is sent as ``value_bits``
bits: one sign bit and ``b = value_bits - 1`` magnitude bits.

Selection (deterministic, independent of ``torch.topk``'s tie handling):
``t`` is the k-th largest ``|x|`` of the chunk (a value, which topk gets right
whatever its ties); every element with ``|x| > t`` is kept, and the remaining
places go to the lowest-index elements with ``|x| == t``.  So: largest
magnitude first, ties to the lowest index.

Values (one canonical scheme, all fp32 IEEE operations): per chunk the floor
``t`` and the range ``r = max|x| - t`` are stored; ``[t, t + r]`` is split into
``m = 2**b`` equal bins and a kept value is sent as its sign and its bin
``j = clamp(floor((|x| - t) / r' * m), 0, m - 1)`` (``r' = r``, or 1 when
``r == 0``).  It decodes to ``±(t + r * c_j)`` with ``c_j = (2j + 1) / (2m)``,
the bin's centre (exact dyadic constants; ``r * c_j`` then ``+ t``, two
roundings, no fused multiply-add).  Bin centres beat bin edges by ~2x in
squared error on Gaussian deltas; what is lost is carried by error feedback.

Payload (see ``layout.py``): floors, ranges, low and high bytes of the
in-chunk index gaps (``idx[0]``, then ``idx[i] - idx[i-1] - 1``), packed codes
(``sign << b | j``).  Splitting the gaps into byte planes lets zstd code the
near-uniform low bytes with Huffman and squeeze the near-zero high bytes, which
brings the default (64 of 4096, 2 bits) to about 0.16 bits per parameter.

Invariants: decode validates floors/ranges (finite, >= 0), the derived levels
(finite), index gaps (inside the chunk) and code padding (zero) before it
writes anything; decoded tensors are finite and zero off the kept indices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hypertrain.common.codec.base import SLICE, Buffer, Codec, Mode, tensor_view
from hypertrain.common.codec.layout import sparseloco_counts
from hypertrain.common.codec.spec import CodecSpec
from hypertrain.common.errors import CodecError


class _Layout(NamedTuple):
    full: int  # number of full chunks
    tail: int  # length of the short last chunk (0 if none)
    k: int  # kept per full chunk
    k_tail: int  # kept in the short chunk
    chunks: int
    kept: int
    packed: int  # bytes of packed codes


class _Prepared(NamedTuple):
    """A validated payload: decoded a range of chunks at a time (``_rows``)."""

    raw: Buffer
    layout: _Layout
    levels: torch.Tensor  # (chunks, bins) fp32: each chunk's bin-centre magnitudes


class SparseLoCoCodec(Codec):
    """Chunked top-k, sign + bin-centre magnitudes (see the module docstring)."""

    def __init__(self, spec: CodecSpec) -> None:
        super().__init__(spec)
        self.chunk = self.encode_unit = int(spec.param("chunk"))
        self.bits = int(spec.param("value_bits"))
        self.bins = 1 << (self.bits - 1)
        self.per_byte = 8 // self.bits
        m = self.bins
        self.centres = torch.tensor([(2 * j + 1) / (2 * m) for j in range(m)], dtype=torch.float32)
        self.rows_per_slice = max(1, SLICE // self.chunk)

    def _layout(self, numel: int) -> _Layout:
        full, tail, k, k_tail = sparseloco_counts(self.spec, numel)
        kept = full * k + k_tail
        return _Layout(full, tail, k, k_tail, full + (tail > 0), kept, -(-kept // self.per_byte))

    # -- encode ----------------------------------------------------------------

    def _encode_raw(self, flat: torch.Tensor, raw: memoryview) -> None:
        lay = self._layout(flat.numel())
        c, kk = lay.chunks, lay.kept
        floors = tensor_view(raw, torch.float32, 0, c)
        ranges = tensor_view(raw, torch.float32, 4 * c, c)
        gap_lo = tensor_view(raw, torch.uint8, 8 * c, kk)
        gap_hi = tensor_view(raw, torch.uint8, 8 * c + kk, kk)
        codes = torch.empty(kk, dtype=torch.uint8)
        work = torch.empty(min(self.rows_per_slice * self.chunk, flat.numel()))
        # (first chunk, chunk count, chunk length, k) for each slice of rows.
        parts = [
            (r0, min(self.rows_per_slice, lay.full - r0), self.chunk, lay.k)
            for r0 in range(0, lay.full, self.rows_per_slice)
        ]
        if lay.tail:
            parts.append((lay.full, 1, lay.tail, lay.k_tail))
        for r0, rows, length, k in parts:
            x = flat[r0 * self.chunk : r0 * self.chunk + rows * length].view(rows, length)
            kept = slice(r0 * lay.k, r0 * lay.k + rows * k)
            idx, floor, rng = self._select(x, k, work[: rows * length].view(rows, length))
            floors[r0 : r0 + rows] = floor
            ranges[r0 : r0 + rows] = rng
            codes[kept] = self._quantize(x.gather(1, idx), floor, rng).view(-1)
            first = torch.full((rows, 1), -1, dtype=torch.int64)
            gaps = (torch.diff(idx, dim=1, prepend=first) - 1).view(-1)
            gap_lo[kept] = gaps & 0xFF
            gap_hi[kept] = gaps >> 8
        tensor_view(raw, torch.uint8, 8 * c + 2 * kk, lay.packed).copy_(self._pack(codes))

    @staticmethod
    def _select(
        x: torch.Tensor, k: int, work: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kept indices (rows, k) ascending, per-row floor t and range r."""
        mag = torch.abs(x, out=work)
        peak = torch.amax(mag, dim=1)  # NaN-propagating, unlike some topk paths
        if not bool(torch.isfinite(peak).all()):
            raise CodecError("sparseloco encode: input holds NaN or inf")
        top, top_idx = torch.topk(mag, k, dim=1)
        floor = top[:, k - 1].contiguous()
        idx = top_idx.sort(dim=1).values
        if k == x.shape[1]:
            return idx, floor, peak - floor
        # The top-k set is unique unless an element outside it equals the floor:
        # blank the kept entries and compare the next largest with the floor
        # (one scatter and one max, ~7x cheaper than counting |x| >= t).
        mag.scatter_(1, top_idx, -1.0)
        ties = (torch.amax(mag, dim=1) == floor).nonzero().view(-1)
        if ties.numel():
            m, t = x[ties].abs(), floor[ties, None]
            above, equal = m > t, m == t
            need = k - above.sum(dim=1, keepdim=True)
            keep = above | (equal & (equal.cumsum(dim=1) <= need))
            idx[ties] = keep.nonzero()[:, 1].view(-1, k)
        return idx, floor, peak - floor

    def _quantize(self, vals: torch.Tensor, floor: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
        """Codes ``sign << b | bin`` (uint8) of the kept values of each row."""
        sign = torch.signbit(vals).to(torch.uint8) << (self.bits - 1)
        if self.bins == 1:
            return sign
        divisor = torch.where(rng > 0, rng, 1.0)[:, None]
        u = (vals.abs() - floor[:, None]) / divisor * self.bins  # x m: exact (power of 2)
        return sign | u.floor_().clamp_(0, self.bins - 1).to(torch.uint8)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.per_byte == 1:
            return codes
        pad = -codes.numel() % self.per_byte
        lanes = torch.cat([codes, codes.new_zeros(pad)]).view(-1, self.per_byte)
        packed = lanes[:, 0].clone()
        for i in range(1, self.per_byte):
            packed |= lanes[:, i] << (self.bits * i)
        return packed

    # -- decode ----------------------------------------------------------------

    def _positions(self, gaps: torch.Tensor, rows: int, k: int, length: int) -> torch.Tensor:
        """In-chunk positions (rows, k) from gaps; ``CodecError`` if one leaves the chunk."""
        pos = (gaps.view(rows, k) + 1).cumsum(dim=1) - 1
        if rows and k and int(pos[:, -1].max()) >= length:
            raise CodecError("sparseloco payload: an index lies outside its chunk")
        return pos

    def _prepare(self, raw: Buffer, numel: int) -> _Prepared:
        """Validate the whole payload one block of chunks at a time; decode nothing to
        keep (``_rows`` decodes a range's chunks when it is applied), so a validated
        input holds a few KiB, not its kept positions and values."""
        lay = self._layout(numel)
        c, kk = lay.chunks, lay.kept
        floors = tensor_view(raw, torch.float32, 0, c)
        ranges = tensor_view(raw, torch.float32, 4 * c, c)
        stats = torch.cat([floors, ranges])
        if c and not bool(((stats >= 0) & torch.isfinite(stats)).all()):
            raise CodecError("sparseloco payload: a floor or range is negative or not finite")
        levels = floors[:, None] + ranges[:, None] * self.centres[None, :]
        if c and not bool(torch.isfinite(levels).all()):
            raise CodecError("sparseloco payload: a decoded level overflows")
        prepared = _Prepared(raw, lay, levels)
        for r0 in range(0, c, self.rows_per_slice):
            self._rows(prepared, r0, min(c, r0 + self.rows_per_slice))  # positions checked
        if kk % self.per_byte:  # the padding lanes of the last packed byte are zero
            self._codes(prepared, kk, kk + (-kk % self.per_byte))
        return prepared

    def _codes(self, p: _Prepared, i0: int, i1: int) -> torch.Tensor:
        """The codes of kept entries ``[i0, i1)`` (``i1`` may run into the last byte's
        padding: ``CodecError`` unless those lanes are zero)."""
        lay, pb = p.layout, self.per_byte
        b0, b1 = i0 // pb, -(-i1 // pb)
        packed = tensor_view(p.raw, torch.uint8, 8 * lay.chunks + 2 * lay.kept + b0, b1 - b0)
        if pb == 1:
            return packed
        mask = (1 << self.bits) - 1
        lanes = torch.stack([(packed >> (self.bits * i)) & mask for i in range(pb)], dim=1)
        lanes = lanes.view(-1)[i0 - b0 * pb :]
        if i1 > lay.kept:
            if bool(lanes[lay.kept - i0 :].any()):
                raise CodecError("sparseloco payload: nonzero padding bits after the last code")
            i1 = lay.kept
        return lanes[: i1 - i0]

    def _rows(self, p: _Prepared, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat positions (ascending) and values of the kept entries of chunks
        ``[r0, r1)``; ``CodecError`` if a position leaves its chunk."""
        lay, raw, c, kk = p.layout, p.raw, p.layout.chunks, p.layout.kept
        full_end = min(r1, lay.full)
        i0 = r0 * lay.k
        i1 = full_end * lay.k if r0 < full_end else i0
        parts, owners = [], []
        if r0 < full_end:
            rows = full_end - r0
            gaps = tensor_view(raw, torch.uint8, 8 * c + i0, i1 - i0).to(torch.int64)
            gaps |= tensor_view(raw, torch.uint8, 8 * c + kk + i0, i1 - i0).to(torch.int64) << 8
            pos = self._positions(gaps, rows, lay.k, self.chunk)
            pos += torch.arange(r0, full_end, dtype=torch.int64)[:, None] * self.chunk
            parts.append(pos.view(-1))
            owners.append(torch.arange(r0, full_end).repeat_interleave(lay.k))
        if lay.tail and r1 > lay.full:  # the short last chunk
            t0 = lay.full * lay.k
            gaps = tensor_view(raw, torch.uint8, 8 * c + t0, lay.k_tail).to(torch.int64)
            gaps |= tensor_view(raw, torch.uint8, 8 * c + kk + t0, lay.k_tail).to(torch.int64) << 8
            tail = self._positions(gaps, 1, lay.k_tail, lay.tail) + lay.full * self.chunk
            parts.append(tail.view(-1))
            owners.append(torch.full((lay.k_tail,), lay.full, dtype=torch.int64))
            i1 = kk
        if not parts:
            return torch.empty(0, dtype=torch.int64), torch.empty(0)
        codes = self._codes(p, i0, i1)
        bins = (codes & (self.bins - 1)).to(torch.int64)
        mag = p.levels.view(-1)[torch.cat(owners) * self.bins + bins]
        negative = (codes >> (self.bits - 1)).bool()
        return torch.cat(parts), torch.where(negative, -mag, mag)

    def _magnitude(self, prepared: _Prepared, numel: int) -> float:
        # Every kept value is + or - one of its chunk's levels; the rest are zeros.
        levels = prepared.levels
        return float(levels.abs().max()) if levels.numel() else 0.0

    def positions(self, prepared: _Prepared) -> torch.Tensor:
        """The flat positions of every kept entry of a validated payload (``open``),
        ascending, read off its index stream."""
        return self._rows(prepared, 0, prepared.layout.chunks)[0]

    def _apply_range(self, prepared: _Prepared, numel: int, out: torch.Tensor, start: int) -> None:
        end = start + out.numel()
        idx, val = self._rows(
            prepared, start // self.chunk, min(prepared.layout.chunks, -(-end // self.chunk))
        )  # positions ascending: keep those in [start, end)
        lo, hi = (int(i) for i in torch.searchsorted(idx, torch.tensor([start, end])))
        self._add(idx[lo:hi] - start, val[lo:hi], out)

    @staticmethod
    def _add(idx: torch.Tensor, val: torch.Tensor, out: torch.Tensor) -> None:
        # out.add_(dense) adds +0.0 off the kept indices, which turns -0.0 into +0.0;
        # reproduce that with one in-place pass, then add the kept values to the
        # original entries (read before that pass).
        kept = out[idx]
        out.add_(0.0)
        out[idx] = kept + val

    def _apply(self, prepared: _Prepared, out: torch.Tensor, mode: Mode) -> None:
        idx, val = self._rows(prepared, 0, prepared.layout.chunks)
        if mode == "set":
            out.zero_()
            out[idx] = val
        elif mode == "add":
            self._add(idx, val, out)
        else:
            # x - (+0.0) == x for every x (-0.0 included): only kept entries change.
            out[idx] = out[idx] - val
