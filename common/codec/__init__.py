"""hypertrain.common.codec: canonical tensor codecs for pseudo-gradients.

Codecs: ``fp32`` (reference, lossless), ``int8`` (blockwise scales) and
``sparseloco`` (chunked top-k, low-bit values; error feedback at the sender via
:class:`ErrorFeedback`), each optionally zstd-framed (``+zstd``).

    codec = make_codec("int8+zstd")
    blob = codec.encode(delta)                 # canonical bytes with a checked header
    codec.decode_accumulate(blob, fp32_sum)    # the relay's inner loop

Invariants (tested in tests/unit/test_codec*.py): encoding is deterministic
(same bytes on every thread count and machine with the pinned zstandard);
decoding is exact; every malformed, hostile or mismatched blob raises
``CodecError`` naming the problem, never another exception.
"""

from hypertrain.common.codec.base import Codec
from hypertrain.common.codec.feedback import ErrorFeedback
from hypertrain.common.codec.header import Header, read_header
from hypertrain.common.codec.registry import make_codec
from hypertrain.common.codec.spec import CodecSpec, parse_codec_spec

__all__ = [
    "Codec",
    "CodecSpec",
    "ErrorFeedback",
    "Header",
    "make_codec",
    "parse_codec_spec",
    "read_header",
]
