"""zstd framing of payloads, with a decompression bound taken from the header.

Invariants:
- A framed payload is exactly one zstd frame that records its content size;
  that size must equal the header's ``raw_len`` (itself checked against the
  layout size computed from the shape), so a frame can never make the decoder
  allocate or produce more than the header's shape implies (no zstd bombs).
  Frames without a content size, with trailing bytes, whose content
  disagrees with their declared size, or that claim more than zstd's maximum
  ratio allows are ``CodecError``.
- Compression uses one fixed level on one thread, so the framed bytes are a
  function of the raw payload and the zstandard version alone (pinned in
  requirements/constraints.txt).  Decoding never depends on the level.
"""

from __future__ import annotations

import zstandard

from hypertrain.common.errors import CodecError

#: zstd level for every framed payload.  Level 3 (zstd's default) is within
#: ~1% of level 19 on these payloads (mostly entropy-coded literals: int8 codes,
#: index gap bytes) at ~100x the speed.
ZSTD_LEVEL = 3

#: The zstd format's largest expansion: a block yields at most 128 KiB and
#: takes at least 4 bytes (an RLE block), so a frame of N bytes holds at most
#: 32768 * N (256 MiB of zeros compresses to 8211 bytes, a ratio of 32692).
#: A header that claims more than this cannot be honest, whatever its shape.
MAX_RATIO = 32768


def compress(raw: bytes | bytearray | memoryview) -> bytes:
    """One zstd frame holding ``raw``, with its content size recorded."""
    compressor = zstandard.ZstdCompressor(
        level=ZSTD_LEVEL, write_content_size=True, write_checksum=False, threads=0
    )
    return compressor.compress(raw)


def decompress(payload: bytes | bytearray | memoryview, raw_len: int) -> bytes:
    """Unframe ``payload``, which must decompress to exactly ``raw_len`` bytes."""
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame header is invalid: {exc}") from None
    size = params.content_size
    if size == zstandard.CONTENTSIZE_UNKNOWN or size == zstandard.CONTENTSIZE_ERROR:
        raise CodecError("zstd frame does not record its content size")
    if size != raw_len:
        raise CodecError(f"zstd frame declares {size} bytes, header allows exactly {raw_len}")
    if raw_len > MAX_RATIO * len(payload):
        raise CodecError(
            f"zstd frame of {len(payload)} bytes cannot hold {raw_len} bytes (max ratio {MAX_RATIO})"
        )
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            payload, max_output_size=raw_len, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd payload is corrupt: {exc}") from None
    except MemoryError:
        raise CodecError(f"zstd payload of {raw_len} bytes does not fit in memory") from None
    if len(raw) != raw_len:
        raise CodecError(f"zstd frame decompressed to {len(raw)} bytes, expected {raw_len}")
    return raw
