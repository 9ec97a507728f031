"""Payload sizes: how many raw (unframed) payload bytes each codec writes.

Every codec's raw payload has a fixed size that is a pure function of the spec
and the element count, so a header's ``raw_len`` is checked exactly against
it before anything is decompressed or allocated: that is the bound that stops
a zstd bomb, and it makes truncated or padded payloads a plain length error.

Layouts (all little-endian; ``n`` elements of the flattened tensor):

- ``fp32``: ``n`` float32 values.
- ``int8``: ``ceil(n / block)`` float32 scales, then ``n`` int8 codes.
- ``sparseloco``: with ``C = ceil(n / chunk)`` chunks and ``K`` kept values in
  all (``kept_in_chunk`` each): ``C`` float32 floors, ``C`` float32 ranges,
  ``K`` low bytes of the in-chunk index gaps, ``K`` high bytes of the gaps,
  then the ``K`` value codes packed ``8 // value_bits`` to a byte (first code in
  the lowest bits, padding bits zero).
"""

from __future__ import annotations

from hypertrain.common.codec.spec import CodecSpec


def kept_in_chunk(density: float, length: int) -> int:
    """SparseLoCo's k for a chunk of ``length`` elements: ``min(length, max(1, round(density * length)))``.

    Python's ``round`` on the IEEE double product (ties to even) makes this the
    same on every machine; the default 0.0156 * 4096 = 63.8976 gives 64.
    """
    if length <= 0:
        return 0
    return min(length, max(1, round(density * length)))


def sparseloco_counts(spec: CodecSpec, numel: int) -> tuple[int, int, int, int]:
    """``(full_chunks, tail_length, k_full, k_tail)`` for a SparseLoCo payload of ``numel`` values."""
    chunk = int(spec.param("chunk"))
    density = float(spec.param("density"))
    full, tail = divmod(numel, chunk)
    return full, tail, kept_in_chunk(density, chunk), kept_in_chunk(density, tail)


def raw_length(spec: CodecSpec, numel: int) -> int:
    """Exact size in bytes of the unframed payload for ``numel`` values under ``spec``."""
    if spec.name == "fp32":
        return 4 * numel
    if spec.name == "int8":
        block = int(spec.param("block"))
        return 4 * (-(-numel // block)) + numel
    if spec.name == "sparseloco":
        full, tail, k_full, k_tail = sparseloco_counts(spec, numel)
        chunks = full + (1 if tail else 0)
        kept = full * k_full + k_tail
        per_byte = 8 // int(spec.param("value_bits"))
        return 8 * chunks + 2 * kept + -(-kept // per_byte)
    raise AssertionError(f"no layout for codec {spec.name!r}")  # CodecSpec rejects unknown names
