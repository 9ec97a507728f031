"""Codec specifications: the parsed, canonical form of a codec string.

A spec names one codec, all of its parameters and whether the payload is
zstd-framed, e.g. ``int8:block=256+zstd``.  It is what a run config holds, what
the event tape commits to and what every encoded blob's header repeats.

Invariants:
- ``str(spec)`` is canonical: every parameter spelled out (defaults too), in the
  codec's declared order, ints in decimal, floats in Python's shortest
  round-trip ``repr``; ``parse_codec_spec(str(spec)) == spec`` always, and two
  strings that parse to the same spec render to the same canonical string.
- Parameters are validated at parse time (``ConfigError`` naming the bad value),
  so a ``CodecSpec`` that exists is one the codecs accept.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from hypertrain.common.errors import ConfigError

ParamValue = int | float

#: Declared parameters per codec, in canonical order: name -> (type, default).
CODEC_PARAMS: dict[str, tuple[tuple[str, type, ParamValue], ...]] = {
    "fp32": (),
    "int8": (("block", int, 256),),
    "sparseloco": (
        ("density", float, 0.0156),
        ("value_bits", int, 2),
        ("chunk", int, 4096),
    ),
}

#: Framings that may follow the codec after a ``+``.
FRAMINGS = ("zstd",)

# Bounds keep every layout computable in fixed-width integers: int8 blocks and
# SparseLoCo chunks are indexed with 16-bit in-chunk gaps (chunk <= 65536).
_MAX_BLOCK = 1 << 20
_MAX_CHUNK = 1 << 16
_VALUE_BITS = (2, 4, 8)


def _validate(name: str, params: dict[str, ParamValue]) -> None:
    if name == "int8":
        block = int(params["block"])
        if not 1 <= block <= _MAX_BLOCK:
            raise ConfigError(f"int8 block must be in [1, {_MAX_BLOCK}], got {block}")
    elif name == "sparseloco":
        density = float(params["density"])
        if not (math.isfinite(density) and 0.0 < density <= 1.0):
            raise ConfigError(f"sparseloco density must be in (0, 1], got {density!r}")
        bits = int(params["value_bits"])
        if bits not in _VALUE_BITS:
            raise ConfigError(f"sparseloco value_bits must be one of {_VALUE_BITS}, got {bits}")
        chunk = int(params["chunk"])
        if not 1 <= chunk <= _MAX_CHUNK:
            raise ConfigError(f"sparseloco chunk must be in [1, {_MAX_CHUNK}], got {chunk}")


def _parse_value(codec: str, key: str, kind: type, text: str) -> ParamValue:
    try:
        if kind is int:
            # Decimal digits only: "0x10", "1_000" or "+3" are not canonical spellings.
            if not text.isdigit() or not text.isascii():
                raise ValueError(text)
            return int(text)
        value = float(text)
    except ValueError:
        raise ConfigError(
            f"codec {codec}: parameter {key}={text!r} is not a valid {kind.__name__}"
        ) from None
    if not math.isfinite(value):
        raise ConfigError(f"codec {codec}: parameter {key}={text!r} is not finite")
    return value


def _render_value(value: ParamValue) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """One codec with all its parameters, and its framing.

    Build it with :func:`parse_codec_spec` (or :meth:`from_dict`); the
    constructor validates too, so hand-built specs are checked the same way.
    """

    name: str
    """Codec name: ``fp32``, ``int8`` or ``sparseloco``."""
    params: tuple[tuple[str, ParamValue], ...] = ()
    """Every declared parameter as ``(key, value)`` in canonical order (filled by ``__post_init__``)."""
    zstd: bool = False
    """Whether the payload is one zstd frame."""

    def __post_init__(self) -> None:
        if self.name not in CODEC_PARAMS:
            raise ConfigError(f"unknown codec {self.name!r} (known: {', '.join(CODEC_PARAMS)})")
        declared = CODEC_PARAMS[self.name]
        given = dict(self.params)
        if len(given) != len(self.params):
            raise ConfigError(f"codec {self.name}: a parameter is given twice")
        unknown = sorted(set(given) - {key for key, _, _ in declared})
        if unknown:
            raise ConfigError(f"codec {self.name}: unknown parameter {unknown[0]!r}")
        canonical: list[tuple[str, ParamValue]] = []
        for key, kind, default in declared:
            value = given.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"codec {self.name}: parameter {key} must be a number")
            if kind is int and not float(value).is_integer():
                raise ConfigError(f"codec {self.name}: parameter {key} must be an integer")
            if not math.isfinite(value):
                raise ConfigError(f"codec {self.name}: parameter {key} must be finite")
            canonical.append((key, int(value) if kind is int else float(value)))
        _validate(self.name, dict(canonical))
        object.__setattr__(self, "params", tuple(canonical))

    def param(self, key: str) -> ParamValue:
        """The value of one parameter (``KeyError`` if the codec has no such parameter)."""
        for name, value in self.params:
            if name == key:
                return value
        raise KeyError(key)

    def params_string(self) -> str:
        """Canonical ``k=v,k=v`` form of the parameters ('' when there are none)."""
        return ",".join(f"{key}={_render_value(value)}" for key, value in self.params)

    def __str__(self) -> str:
        text = self.name
        if self.params:
            text += ":" + self.params_string()
        if self.zstd:
            text += "+zstd"
        return text

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able form, e.g. ``{"codec": "int8", "params": {"block": 256}, "framing": "zstd"}``."""
        return {
            "codec": self.name,
            "params": dict(self.params),
            "framing": "zstd" if self.zstd else "none",
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CodecSpec:
        """Inverse of :meth:`to_dict`."""
        try:
            framing = data.get("framing", "none")
            if framing not in ("none", *FRAMINGS):
                raise ConfigError(f"unknown codec framing {framing!r}")
            return cls(
                name=str(data["codec"]),
                params=tuple(dict(data.get("params", {})).items()),
                zstd=framing == "zstd",
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"malformed codec spec dict: {exc}") from None


def parse_codec_spec(text: str | CodecSpec) -> CodecSpec:
    """Parse ``name[:k=v,...][+zstd]`` into a :class:`CodecSpec` (``ConfigError`` if invalid).

    Examples: ``fp32``, ``int8+zstd``, ``int8:block=256``,
    ``sparseloco:density=0.0156,value_bits=2,chunk=4096+zstd``.
    """
    if isinstance(text, CodecSpec):
        return text
    return _parse(text)


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> CodecSpec:
    """parse_codec_spec of a string (a pure function of it, and specs are frozen: cached;
    every delta a node checks names its codec)."""
    body = text.strip()
    zstd = False
    # The framing suffix is split off the end (not on every "+") so that a
    # float such as "1e+2" inside the parameters cannot be mistaken for it.
    for framing in FRAMINGS:
        if body.endswith("+" + framing):
            body = body[: -len(framing) - 1]
            zstd = True
    name, sep, param_text = body.partition(":")
    name = name.strip()
    if name not in CODEC_PARAMS:
        raise ConfigError(f"unknown codec {name!r} in {text!r} (known: {', '.join(CODEC_PARAMS)})")
    kinds = {key: kind for key, kind, _ in CODEC_PARAMS[name]}
    params: list[tuple[str, ParamValue]] = []
    if sep:
        for item in param_text.split(","):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or not key:
                raise ConfigError(f"codec {name}: malformed parameter {item!r} in {text!r}")
            if key not in kinds:
                raise ConfigError(f"codec {name}: unknown parameter {key!r} in {text!r}")
            params.append((key, _parse_value(name, key, kinds[key], value)))
    return CodecSpec(name=name, params=tuple(params), zstd=zstd)
