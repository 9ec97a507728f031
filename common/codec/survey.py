"""What a receiver learns of an encoded blob while its bytes arrive, kept for its checks.

A relay or the aggregator validates each received delta in full (``Codec.open``: the
header, the checksum over the whole payload, and the values: for fp32 every one finite,
and the largest magnitude; for int8 the scales and codes), once when the delta is
accepted and again when it is summed.
Each of those passes reads the whole input from memory; the spooled input is a map of
its file's page cache, long out of the CPU's caches by then.  The receiver already holds
every chunk in cache once, as it arrives (it hashes each, ``spool.Sink``): a ``Survey``
fed there computes, in the same pass, the two things ``open`` reads the payload for:

- the CRC-32 of each ``CHECKSUM_SEGMENT`` of the payload, which ``checksum`` combines
  with the header's (the segments are fixed, so chunking changes nothing);
- for an unframed payload of a codec that checks its values piece by piece
  (``Codec._survey_values``), whether they pass ``_prepare``'s checks and the summary
  it keeps of them (``top``: a maximum, the same value in any order): for fp32 whether
  every value is finite and the largest magnitude; for int8 whether every scale is in
  range and every code is one the encoder writes, and the largest scale.  The int8
  check matters for memory as much as for time: a relay opening four deltas that
  arrived together read a 4 MiB piece of each, and its scales, into its resident set
  at the very moment its pushes' buffers peaked (bench/bench_sync_scale.py --part A).

``register`` ties the result (``Facts``) to the buffer the receiver hands on, a private
map of the spooled file made read-only; ``facts_of`` finds it again for that whole buffer
only.  ``Codec.open`` then checks the header as always and takes the payload's
checksum and values from the facts instead of reading them: the same decisions, the same
numbers, without the passes.  Where the survey could not follow (a value split across
chunks, a header ``open`` refuses, a codec with no piecewise check, any other buffer, a
restarted node reading its spool), there
are no facts, or none for the values, and ``open`` reads the payload as before.

The facts are about the bytes this process received and hashed; the content digest that
names them was computed in the same pass and is trusted the same way afterwards.  So a
spool file changed on disk after its receipt (by another process, or read back wrong
after the kernel dropped its cache) is no longer caught at the sum by a second checksum
pass; the audit, which replays every tape entry from the stored files by their digests,
still refuses it.
"""

from __future__ import annotations

import math
import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from zlib_ng.zlib_ng import crc32

from hypertrain.common.codec.header import (
    CHECKSUM_SEGMENT,
    FIXED_HEADER_LEN,
    MAGIC,
    MAX_NDIM,
    MAX_PARAMS_LEN,
    read_header,
)
from hypertrain.common.errors import CodecError, ConfigError

_FIXED = struct.Struct("<4sBBBBBBH")  # magic .. params_len: what the header's length needs


def finite_top(t: torch.Tensor) -> float | None:
    """The largest magnitude of the fp32 values ``t`` (0.0 for none), or None if any is
    NaN or inf: one read-only pass, the least and the largest value (``aminmax``
    propagates NaN).  The one check of fp32 values: ``encode``'s (``all_finite``),
    ``open``'s (``Fp32Codec._prepare``) and the survey's.  Measured at 1e8 values on 2
    cores: 33 GB/s, where ``isfinite(t).all()`` (a bool tensor written, then reduced) ran
    at 1.3-3 GB/s."""
    if t.numel() == 0:
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(t))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    return max(-lo, hi)


def fp32_values(piece: memoryview, at: int) -> float | None:
    """The survey's check of a piece of unframed fp32 values at payload offset ``at``:
    its largest magnitude, or None if a value is not finite or the piece splits one."""
    if at % 4 or len(piece) % 4:
        return None
    return finite_top(torch.frombuffer(piece, dtype=torch.float32)) if len(piece) else 0.0


@dataclass(frozen=True, slots=True)
class Facts:
    """A surveyed blob: ``size`` bytes, a header of ``header_len`` bytes, the CRC-32s of
    its payload's segments (``checksum``'s), and ``top``: for an unframed payload whose
    values passed its codec's checks (``Codec._survey_values``), the summary the codec
    keeps of them (fp32: the largest magnitude; int8: the largest scale), else None."""

    size: int
    header_len: int
    crcs: tuple[int, ...]
    top: float | None

    def fits(self, size: int, header_len: int) -> bool:
        """Are these the facts of a blob of ``size`` bytes with a ``header_len``-byte header?"""
        return self.size == size and self.header_len == header_len


class Survey:
    """Fed a blob's bytes in order (``feed``), from any chunking; ``facts`` at the end."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._pos = 0
        self._head = bytearray()  # the header's bytes, until it is whole
        self._header_len = -1
        self._parsed = False
        # The payload's value check (Codec._survey_values), while it holds.
        self._values: Callable[[memoryview, int], float | None] | None = None
        self._crcs: list[int] = []
        self._crc = 0
        self._in_segment = 0
        self._top = 0.0
        self._lost = False  # not a blob this survey can follow: no facts

    @classmethod
    def of_payload(cls, size: int, header_len: int) -> Survey:
        """A survey of an unframed fp32 blob of ``size`` bytes fed its payload only (from
        byte ``header_len`` on, in order), its header not written yet: a sender framing
        values in place (``ErrorFeedback.encode_framed``)."""
        s = cls(size)
        s._header_len, s._parsed, s._pos = header_len, True, header_len
        s._values = fp32_values
        return s

    def feed(self, data: Any) -> None:
        """The next ``len(data)`` bytes of the blob."""
        if self._lost:
            return
        view = memoryview(data).cast("B")
        pos, n = self._pos, len(view)
        self._pos += n
        if not self._parsed:  # view is the blob's [pos, pos + n); _head its [0, pos)
            if self._header_len < 0:
                self._head += view[: FIXED_HEADER_LEN - pos]
                if len(self._head) < FIXED_HEADER_LEN:
                    return
                self._read_fixed()
                if self._lost:
                    return
            self._head += view[len(self._head) - pos : self._header_len - pos]
            if len(self._head) < self._header_len:
                return
            self._read_header()
            if self._lost:
                return
        skip = max(0, self._header_len - pos)
        if skip < n:
            self._payload(view[skip:], pos + skip - self._header_len)

    def _read_fixed(self) -> None:
        magic, _, _, _, _, ndim, _, params_len = _FIXED.unpack_from(self._head)
        if magic != MAGIC or ndim > MAX_NDIM or params_len > MAX_PARAMS_LEN:
            self._lost = True  # open refuses it anyway: nothing to save
            return
        head = FIXED_HEADER_LEN + 8 * ndim + params_len
        self._header_len = head + (-head % 8)

    def _read_header(self) -> None:
        """The whole header is in: parse it as ``open`` will, and pick the value check."""
        # Here, not at the top: the codecs' module imports this one.
        from hypertrain.common.codec.registry import make_codec

        try:
            header = read_header(self._head, self.size)
            codec = None if header.zstd else make_codec(header.spec)
        except (CodecError, ConfigError):
            self._lost = True  # open refuses it, naming the problem
            return
        self._parsed, self._head = True, bytearray()
        if codec is not None:
            self._values = codec._survey_values(header.numel)

    def _payload(self, part: memoryview, at: int) -> None:
        """``part``: payload bytes from payload offset ``at`` on."""
        while part:
            take = min(len(part), CHECKSUM_SEGMENT - self._in_segment)
            piece = part[:take]
            self._crc = crc32(piece, self._crc)
            if self._values is not None:
                top = self._values(piece, at)
                # None: a value split across chunks, or one open refuses: open reads them
                if top is None:
                    self._values = None
                else:
                    self._top = max(self._top, top)
            self._in_segment += take
            at += take
            if self._in_segment == CHECKSUM_SEGMENT:
                self._crcs.append(self._crc)
                self._crc = self._in_segment = 0
            part = part[take:]

    def facts(self) -> Facts | None:
        """What the survey found, once every byte was fed; None if it could not follow."""
        if self._lost or not 0 <= self._header_len <= self.size or self._pos != self.size:
            return None
        crcs = list(self._crcs)
        if self._in_segment or not crcs:  # the last, short segment (or the empty payload's)
            crcs.append(self._crc)
        top = self._top if self._values is not None else None
        return Facts(self.size, self._header_len, tuple(crcs), top)


#: id(array) -> (a weak reference to it, its facts).  No lock: one dict operation each,
#: atomic under the GIL; a lock here deadlocked a thread whose garbage collection, started
#: inside ``register``, freed another registered array (its ``forget`` ran on that thread).
_SURVEYED: dict[int, tuple[weakref.ref[np.ndarray], Facts]] = {}


def register(array: np.ndarray, facts: Facts | None) -> None:
    """Tie ``facts`` to ``array``: the map of a received blob's spool file, whole, made
    read-only first (``facts_of`` answers for no writable buffer: a write after the survey
    would leave the facts about other bytes); forgotten when the array is."""
    if facts is None or facts.size != array.nbytes or array.flags.writeable:
        return
    key = id(array)

    def forget(ref: weakref.ref[np.ndarray]) -> None:
        # An id is not reused before its object's callbacks ran: the entry is this one's
        # unless a later register of the same array replaced it.
        if (entry := _SURVEYED.get(key)) is not None and entry[0] is ref:
            _SURVEYED.pop(key, None)

    entry = (weakref.ref(array, forget), facts)
    _SURVEYED[key] = entry


def facts_of(data: Any) -> Facts | None:
    """The facts registered for ``data`` if it is a read-only view of a whole registered
    array."""
    if not _SURVEYED or not isinstance(data, memoryview) or not data.readonly:
        return None
    owner = data.obj
    entry = _SURVEYED.get(id(owner))
    if entry is None or entry[0]() is not owner or not isinstance(owner, np.ndarray):
        return None
    facts = entry[1]
    if data.nbytes != owner.nbytes or not data.c_contiguous or owner.flags.writeable:
        return None
    start = np.frombuffer(data.cast("B") if data.format != "B" else data, dtype=np.uint8)
    if start.ctypes.data != owner.ctypes.data:
        return None
    return facts
