"""Codec construction from a spec (string, dict or ``CodecSpec``).

Invariant: one codec class per codec name; ``make_codec(str(c.spec))`` builds
an equivalent codec (same spec, same bytes) for every codec ``c``.
"""

from __future__ import annotations

from typing import Any

from hypertrain.common.codec.base import Codec
from hypertrain.common.codec.fp32 import Fp32Codec
from hypertrain.common.codec.int8 import Int8Codec
from hypertrain.common.codec.sparseloco import SparseLoCoCodec
from hypertrain.common.codec.spec import CodecSpec, parse_codec_spec

CODECS: dict[str, type[Codec]] = {
    "fp32": Fp32Codec,
    "int8": Int8Codec,
    "sparseloco": SparseLoCoCodec,
}


def make_codec(spec: str | CodecSpec | dict[str, Any]) -> Codec:
    """The codec for ``spec`` (``ConfigError`` if the spec is invalid)."""
    if isinstance(spec, dict):
        spec = CodecSpec.from_dict(spec)
    parsed = parse_codec_spec(spec)
    return CODECS[parsed.name](parsed)
