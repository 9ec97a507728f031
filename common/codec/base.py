"""The codec interface and the machinery every codec shares.

A codec turns an fp32 tensor into bytes (header + payload, see ``header.py``)
and back.  Subclasses implement three payload-level methods on flat fp32
tensors and raw (unframed) payload buffers; this class adds the header, the
checksum, zstd framing and all validation around them.

Invariants:
- ``encode`` is canonical: the bytes depend only on the spec, the shape and the
  values (not on strides, thread count or machine); NaN/inf input is a
  ``CodecError``.
- ``decode`` is exact and deterministic, and validates *everything* before it
  writes: on hostile input it raises ``CodecError`` and leaves ``out``
  untouched (``decode_accumulate``), never another exception.
- ``decode_accumulate(data, out)`` gives the same bits as
  ``out.add_(decode(data))``; it works on cache-sized slices with reused
  buffers because whole-tensor temporaries cost a page fault per 4 KiB.
"""

from __future__ import annotations

import math
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from hypertrain.common.codec import framing, survey
from hypertrain.common.codec.header import (
    MAX_NDIM,
    MAX_NUMEL,
    Header,
    pack_header,
    read_header,
    seal,
    verify_checksum,
)
from hypertrain.common.codec.layout import raw_length
from hypertrain.common.codec.spec import CodecSpec
from hypertrain.common.errors import CodecError

# Payload fields are written as the machine's native fp32/int; the wire format
# is little-endian, which every platform torch supports today is.
assert sys.byteorder == "little", "hypertrain codecs assume a little-endian host"

#: Elements per slice in the streaming loops: 256K fp32 = 1 MiB, so a slice and
#: its work buffer stay in L2/L3 while each op runs on both cores.
SLICE = 1 << 18

# torch.frombuffer warns on read-only buffers; tensor_view's callers never write to them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

Mode = Literal["set", "add", "sub"]
Buffer = bytes | bytearray | memoryview


def tensor_view(buf: Buffer, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """A 1-D tensor over ``count`` items of ``buf`` starting at byte ``offset`` (no copy).

    Read-only buffers (``bytes``) are viewed too; callers never write to them, so
    torch's non-writable-buffer warning is filtered out (once, at import: entering
    ``warnings.catch_warnings`` on every call cost more than the view itself).
    """
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def all_finite(t: torch.Tensor) -> bool:
    """Does ``t`` (fp32) hold no NaN and no inf?  (``survey.finite_top``: one read-only
    pass.)"""
    return survey.finite_top(t) is not None


def alloc_raw(size: int) -> memoryview:
    """A writable, zero-filled buffer of ``size`` bytes, already faulted in: where a
    payload or a whole blob is written.

    numpy asks the kernel for huge pages on large arrays (``MADV_HUGEPAGE``), so a
    model-sized buffer takes one fault per 2 MiB, not one per 4 KiB.  Measured on
    65 MiB (2 cores): a ``bytearray`` of that size (malloc, then a memset through
    4 KiB faults) took 31 ms, this 5 ms; writing a fresh 4 KiB-paged buffer from
    torch's parallel kernels took ~90 ms.  The buffer lives as long as any view of it.
    """
    buf = np.empty(size, dtype=np.uint8)
    buf.fill(0)
    return buf.data


def flat_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous 1-D fp32 CPU tensor (a view when it already is one)."""
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"encode expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise CodecError(f"encode expects float32, got {x.dtype}")
    return x.detach().to("cpu").contiguous().view(-1)


class Codec(ABC):
    """An fp32 tensor codec: ``encode`` to bytes, ``decode`` back (see the module docstring)."""

    lossless: bool = False
    """True when ``decode(encode(x))`` reproduces ``x`` bit for bit."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.spec)!r})"

    # -- what a codec implements -------------------------------------------

    @abstractmethod
    def _encode_raw(self, flat: torch.Tensor, raw: memoryview) -> None:
        """Write the raw payload of ``flat`` (1-D fp32, contiguous) into ``raw``.

        ``raw`` has exactly ``layout.raw_length`` bytes.  Raise ``CodecError``
        on NaN/inf input.
        """

    @abstractmethod
    def _prepare(self, raw: Buffer, numel: int) -> Any:
        """Validate ``raw`` (``CodecError`` unless this codec could have written it) and
        return whatever ``_apply`` needs (the buffer with what the checks found: fp32's
        largest magnitude, int8's largest scale; or SparseLoCo's decoded indices)."""

    @abstractmethod
    def _apply(self, prepared: Any, out: torch.Tensor, mode: Mode) -> None:
        """``out`` (1-D fp32) ``=``, ``+=`` or ``-=`` the decoded payload, bit-exactly as
        the whole-tensor ops ``copy_``/``add_``/``sub_`` of ``decode`` would."""

    @abstractmethod
    def _magnitude(self, prepared: Any, numel: int) -> float:
        """An upper bound (exact where the payload says it) on ``|v|`` over every value
        ``v`` a validated ``numel``-value payload decodes to."""

    def _survey_values(self, numel: int) -> Callable[[memoryview, int], float | None] | None:
        """How a receiver checks this codec's unframed payload of ``numel`` values as it
        arrives (survey.py), or None where it does not: a function of the payload's next
        bytes in order and their payload offset that returns their part of ``top`` (a
        maximum: the summary ``_prepare_known`` takes), or None where they fail
        ``_prepare``'s checks or split a value (``open`` then reads the payload)."""
        return None

    def _prepare_known(self, raw: Buffer, numel: int, top: float) -> Any:
        """``_prepare`` of an unframed payload whose values passed ``_survey_values`` as
        they arrived, ``top`` their summary (``survey.Facts.top``): what ``_prepare``
        would return, without reading the values again where the codec can."""
        return self._prepare(raw, numel)

    range_align: int = 1
    """``accumulate_range`` starts must be a multiple of this (int8: its block)."""

    encode_unit: int = 1
    """Encoding works on independent pieces of this many consecutive values (int8: its
    block, SparseLoCo: its chunk): the encoding of ``x[a:b]`` with ``a`` a multiple of it
    decodes to exactly ``decode(encode(x))[a:b]`` (what relay shards rely on,
    ``common/shards.py``)."""

    def _apply_range(self, prepared: Any, numel: int, out: torch.Tensor, start: int) -> None:
        """``out += `` the decoded values ``[start, start + out.numel())`` of a ``numel``-value
        payload, the same bits as that slice of ``_apply(..., "add")`` on the whole tensor."""
        raise NotImplementedError(f"{type(self).__name__} has no range decode")

    @property
    def values_in_place(self) -> bool:
        """Is the raw payload the fp32 values themselves, unframed (fp32 without zstd)?
        Then an encoding can be framed around values already written behind its header
        (``frame_in_place``), with no copy of them."""
        return False

    # -- the public interface ------------------------------------------------

    def magnitude(self, header: Header, prepared: Any) -> float:
        """No value of the validated blob (``open``'s header and payload) decodes to more
        than this in magnitude (a bound: exact for fp32, within one part in 2^23 for int8,
        the largest level for SparseLoCo): what a node checks before a delta may join a
        sum."""
        return self._magnitude(prepared, header.numel)

    def header_length(self, shape: tuple[int, ...]) -> int:
        """Bytes of the header of an encoding of ``shape`` (the payload starts there)."""
        return len(pack_header(self.spec, shape, 0, 0))

    def frame_in_place(
        self, buf: Buffer, shape: tuple[int, ...], known: survey.Facts | None = None
    ) -> memoryview:
        """``encode`` of the fp32 values already written in ``buf`` behind
        ``header_length(shape)`` bytes, framed there: the values are checked (NaN/inf is a
        ``CodecError``, and nothing is written), the header is written in front of them,
        and ``buf`` is returned as the blob, byte for byte what ``encode`` returns for
        those values.  Only where ``values_in_place``.  ``known``: a survey of these
        values as they were written (``survey.Survey.of_payload``), whose checksum
        segments and finite verdict are taken instead of reading them again (where it
        found a value not finite, or does not fit, they are read and refused as before)."""
        if not self.values_in_place:
            raise CodecError(f"{self.spec}: its payload is not the values; it cannot frame them")
        numel = math.prod(shape)
        size = raw_length(self.spec, numel)
        head = self.header_length(shape)
        view = memoryview(buf).cast("B")
        if len(view) != head + size:
            raise CodecError(f"in-place frame of {len(view)} bytes, {head + size} expected")
        payload = view[head:]
        # the checksum segments of a survey of these values that found them all finite
        crcs = (
            known.crcs
            if known is not None and known.top is not None and known.fits(len(view), head)
            else None
        )
        if crcs is None:
            self._prepare(payload, numel)  # the checks encode makes of the values
        header = pack_header(self.spec, shape, size, size)
        seal(header, payload, crcs)
        view[:head] = header
        return view

    def encode(self, x: torch.Tensor) -> bytes | memoryview:
        """Encode an fp32 tensor of any shape and strides; canonical bytes.

        Without zstd the payload is written in place behind the header, in the buffer
        that is returned (a ``memoryview`` of an ``alloc_raw`` buffer, which nothing
        writes to afterwards): no second copy of a model-sized payload, at any moment.
        ``bytes(blob)`` where a copy that pickles is wanted."""
        flat = flat_input(x)
        if x.dim() > MAX_NDIM or flat.numel() > MAX_NUMEL:
            raise CodecError(
                f"cannot encode shape {tuple(x.shape)}: at most {MAX_NDIM} dims, {MAX_NUMEL} values"
            )
        return self.encode_flat(flat, tuple(x.shape))[0]

    def encode_flat(
        self, flat: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[bytes | memoryview, Buffer]:
        """``encode`` of a contiguous 1-D fp32 tensor (reported as ``shape``), and a view
        of the raw payload it wrote (error feedback decodes it again).  Without zstd the
        payload is written straight behind the header in the blob itself."""
        size = raw_length(self.spec, flat.numel())
        if self.spec.zstd:
            raw = alloc_raw(size)
            self._encode_raw(flat, raw)
            return self.frame(raw, shape), raw
        header = pack_header(self.spec, shape, size, size)
        blob = alloc_raw(len(header) + size)
        payload = blob[len(header) :]
        self._encode_raw(flat, payload)
        seal(header, payload)
        blob[: len(header)] = header
        return blob, payload

    def frame(self, raw: Buffer, shape: tuple[int, ...]) -> bytes:
        """Header + (zstd-framed) raw payload, checksummed: the encoded blob."""
        payload: Buffer = framing.compress(raw) if self.spec.zstd else raw
        header = pack_header(self.spec, shape, len(payload), len(raw))
        seal(header, payload)
        # The one copy of the payload: into the immutable bytes we return.
        return b"".join((header, payload))

    def open(self, data: Buffer, shape: tuple[int, ...] | None = None) -> tuple[Header, Any]:
        """Validate ``data`` fully; return its header and the prepared payload (``CodecError`` if bad)."""
        header = read_header(data)
        if header.spec != self.spec:
            raise CodecError(f"blob was encoded with codec {header.spec}, expected {self.spec}")
        if shape is not None and tuple(shape) != header.shape:
            raise CodecError(f"blob has shape {header.shape}, expected {tuple(shape)}")
        # What the receiver computed of these very bytes as they arrived, if it did
        # (survey.py): the payload's checksum segments, and its values where the codec
        # checks them piecewise (fp32, int8), are not read again.
        facts = survey.facts_of(data)
        view = memoryview(data).cast("B")
        if facts is not None and not facts.fits(len(view), header.header_len):
            facts = None
        verify_checksum(data, header, None if facts is None else facts.crcs)
        payload = view[header.header_len :]
        raw: Buffer = framing.decompress(payload, header.raw_len) if header.zstd else payload
        if facts is not None and facts.top is not None:
            return header, self._prepare_known(raw, header.numel, facts.top)
        return header, self._prepare(raw, header.numel)

    def decode(self, data: Buffer, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A new fp32 tensor holding the decoded values (``CodecError`` on any bad input).

        Pass ``shape`` when ``data`` is untrusted: it is checked before any
        checksum or decompression, so the header cannot ask for more memory
        than the caller expects.  (Without it the header's own shape is the
        bound; zstd frames are held to exactly that size either way.)
        """
        header, prepared = self.open(data, shape)
        try:
            out = torch.empty(header.shape, dtype=torch.float32)
        except (RuntimeError, MemoryError):
            raise CodecError(f"cannot allocate a tensor of shape {header.shape}") from None
        self._apply(prepared, out.view(-1), "set")
        return out

    def decode_accumulate(self, data: Buffer, out: torch.Tensor) -> None:
        """``out += decode(data)``, bit-identical to ``out.add_(self.decode(data))``.

        ``out`` must be a contiguous fp32 CPU tensor of the blob's shape (or a
        1-D tensor of its element count).  Nothing is written unless the whole
        blob is valid.
        """
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
            raise CodecError("decode_accumulate needs a contiguous float32 CPU tensor")
        # The accumulator's shape bounds the work before anything is checksummed
        # or decompressed (a hostile header cannot make us allocate more).
        header = read_header(data)
        if tuple(out.shape) != header.shape and tuple(out.shape) != (header.numel,):
            raise CodecError(f"blob has shape {header.shape}, accumulator has {tuple(out.shape)}")
        _, prepared = self.open(data)
        self._apply(prepared, out.view(-1), "add")

    def accumulate_range(
        self, header: Header, prepared: Any, out: torch.Tensor, start: int
    ) -> None:
        """``out += decode(data)[start : start + out.numel()]`` for a blob already validated
        by ``open`` (its ``header`` and ``prepared`` payload), bit-identical to that slice
        of ``decode_accumulate``: a streamed sum (``aggregate.streamed_mean``) works one
        range of every input at a time instead of holding a whole-model accumulator.
        ``out``: a contiguous 1-D fp32 CPU tensor; ``start``: a multiple of
        ``range_align`` (or the end of the range is the end of the tensor)."""
        if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
            raise CodecError("accumulate_range needs a contiguous 1-D float32 tensor")
        if start < 0 or start + out.numel() > header.numel or start % self.range_align:
            raise CodecError(
                f"range [{start}, {start + out.numel()}) does not fit a blob of "
                f"{header.numel} values in steps of {self.range_align}"
            )
        self._apply_range(prepared, header.numel, out, start)

    def bits_per_param(self, data: Buffer) -> float:
        """Encoded size in bits (header included) per encoded value; inf for an empty tensor."""
        numel = read_header(data).numel
        return 8 * len(memoryview(data).cast("B")) / numel if numel else math.inf
