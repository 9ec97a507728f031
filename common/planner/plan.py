"""The planner (docs/design.md §5): what a proposed run costs in steps and in bandwidth.

    plan = make_plan(PlanInput(params=124_392_960, seq_len=1024, islands=12, regions=3,
                               h_r=10, h_g=100, batch_per_island=32, tokens=10**10,
                               step_seconds=0.5))
    plan.outer_steps, plan.levels[0].codecs[0].rate_gbps

Formulas (docs/design.md §5, derived, not measured):

- global batch ``B_glob = N * b`` sequences; total steps ``T = D / (B_glob * seq_len)``;
  global outer steps ``S_g = T / H_g`` (warning below :data:`MIN_OUTER_STEPS`).
- bytes per sender per sync ``= P * rho * b_v / 8``; required rate with full overlap
  ``= bytes / (H * t_step)`` (the transfer of one sync must fit in the ``H`` inner steps
  until the next one).  The sender is an island at the regional level (every ``H_r``)
  and a relay at the global level (every ``H_g``).
- ``rho`` and ``b_v`` per codec, from the codec's own layout (common/codec/layout.py):
  fp32: ``rho = 1, b_v = 32``; int8: ``rho = 1, b_v = 8 + 32 / block`` (an fp32 scale per
  block; 8.125 at block 256); SparseLoCo: ``rho = k / chunk`` with
  ``k = round(density * chunk)`` kept values per chunk (64 / 4096 = 1.5625% at the
  default density 0.0156) and ``b_v = value_bits + 16 + 64 / k`` (the value code, a
  16-bit in-chunk index gap, and the chunk's fp32 floor and range shared by its k values:
  19 at the defaults).  ``+zstd`` framing is not modelled: the unframed
  ``b_v`` is an upper bound unless a measurement replaces it.
- merges come back uncompressed: relays stream fp32 merges to islands every ``H_r`` and
  the aggregator streams fp32 parameters to relays every ``H_g`` (services/*/README.md),
  so the downlink is ``4 P`` bytes per receiver per sync whatever the codec.

Link classes (:data:`LINK_CLASSES`) are the slowest link that carries a required rate.

Invariants: pure arithmetic on validated inputs (``ConfigError`` naming the bad value,
never another exception); no I/O, no clock; a measured codec (from the codec benchmark's
JSON, parsed by the caller) replaces only ``b_v`` and adds throughput, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from hypertrain.common.codec.layout import kept_in_chunk
from hypertrain.common.codec.spec import CodecSpec, parse_codec_spec
from hypertrain.common.errors import ConfigError
from hypertrain.common.model import ModelConfig

#: Keep S_g at roughly 1-3 thousand or more (docs/design.md §5.1); below this the plan
#: carries a warning.
MIN_OUTER_STEPS = 1000

#: Bits of a SparseLoCo in-chunk index gap (two byte planes, layout.py) and of a
#: chunk's fp32 floor plus fp32 range.
SPARSE_INDEX_BITS = 16
SPARSE_CHUNK_BITS = 64

#: Codecs reported per level when none are named.
DEFAULT_CODECS = ("fp32", "int8", "sparseloco")

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


@dataclass(frozen=True, slots=True)
class LinkClass:
    """A class of inter-datacenter link: the rate it sustains and what it is."""

    name: str
    """Short name used in JSON (``internet``, ``interconnect``, ``metro``, ``none``)."""
    max_gbps: float
    """Highest sustained rate (Gbit/s) this class is planned for; ``inf`` for the last."""
    label: str
    """Human-readable label with the range."""


# Thresholds (sustained, per link, both ends in different datacenters):
# - 1 Gbit/s: what a routed internet path or site-to-site VPN between clouds holds
#   for hours without dedicated capacity;
# - 10 Gbit/s: a dedicated cloud interconnect / leased wavelength port;
# - 100 Gbit/s: a private metro fabric (dark fibre, DWDM) between nearby sites, the
#   "fast links" of a region (docs/design.md §2);
# - above that only links inside one datacenter keep up: raise H or compress more.
LINK_CLASSES: tuple[LinkClass, ...] = (
    LinkClass("internet", 1.0, "internet (<= 1 Gbit/s)"),
    LinkClass("interconnect", 10.0, "dedicated interconnect (1-10 Gbit/s)"),
    LinkClass("metro", 100.0, "private metro fabric (10-100 Gbit/s)"),
    LinkClass("none", math.inf, "no inter-datacenter link (> 100 Gbit/s): raise H or compress"),
)


def link_class(gbps: float) -> LinkClass:
    """The slowest link class that sustains ``gbps`` Gbit/s."""
    return next(c for c in LINK_CLASSES if gbps <= c.max_gbps)


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of common/model.py's GPT for ``cfg``, without building it.

    Tied embedding ``V d`` + positions ``S d`` + per block (two LayerNorms ``2 * 2d``,
    qkv ``3 d^2``, proj ``d^2``, MLP ``2 m d^2``, no biases on linears) + final LayerNorm ``2d``.
    """
    d, m = cfg.d_model, cfg.mlp_ratio
    block = 4 * d + (4 + 2 * m) * d * d
    return cfg.vocab_size * d + cfg.seq_len * d + cfg.n_layer * block + 2 * d


def parse_count(text: str, what: str) -> int:
    """A positive whole count from ``"124392960"``, ``"1.5e9"``, ``"125M"``, ``"10B"``.

    Suffixes are decimal (k, M, B or G, T).  Raises ConfigError naming ``what``.
    """
    raw = text.strip().replace("_", "")
    scale = 1
    if raw and raw[-1].lower() in _SUFFIXES:
        scale, raw = _SUFFIXES[raw[-1].lower()], raw[:-1]
    try:
        value = Decimal(raw) * scale
    except InvalidOperation:
        raise ConfigError(f"{what} must be a number like 125M or 1e10, got {text!r}") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise ConfigError(f"{what} must be a whole number, got {text!r}")
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return int(value)


def codec_rho_bits(spec: CodecSpec) -> tuple[float, float]:
    """``(rho, b_v)`` of the formula for ``spec`` (zstd framing not modelled)."""
    if spec.name == "fp32":
        return 1.0, 32.0
    if spec.name == "int8":
        return 1.0, 8.0 + 32.0 / int(spec.param("block"))
    chunk = int(spec.param("chunk"))
    k = kept_in_chunk(float(spec.param("density")), chunk)
    b_v = int(spec.param("value_bits")) + SPARSE_INDEX_BITS + SPARSE_CHUNK_BITS / k
    return k / chunk, b_v


@dataclass(frozen=True, kw_only=True, slots=True)
class CodecMeasurement:
    """One codec as measured by bench/bench_codecs.py."""

    bits_per_param: float
    """Encoded bits per parameter (``rho * b_v``), header and framing included."""
    encode_gbps: float | None = None
    """Encode throughput, GB/s of fp32 input (4 bytes per parameter)."""
    decode_gbps: float | None = None
    """Decode-and-accumulate throughput, GB/s of fp32 input."""


def measurements_from_bench(doc: Any) -> dict[str, CodecMeasurement]:
    """Measured codecs from the parsed JSON of ``bench/bench_codecs.py --json``, keyed by
    canonical codec spec.

    Structure read: ``size.<name>.{spec, bits_per_param}`` and
    ``throughput["<name> encode" | "<name> decode_accumulate"].gbps``.
    """
    try:
        sizes = doc["size"]
        throughput = doc.get("throughput", {})
        out: dict[str, CodecMeasurement] = {}
        for name, entry in sizes.items():
            spec = str(parse_codec_spec(str(entry["spec"])))
            bpp = float(entry["bits_per_param"])
            if not (math.isfinite(bpp) and bpp > 0):
                raise ConfigError(f"size.{name}.bits_per_param must be positive, got {bpp}")
            rates = [
                throughput.get(f"{name} {op}", {}).get("gbps")
                for op in ("encode", "decode_accumulate")
            ]
            enc, dec = (float(r) if r is not None and float(r) > 0 else None for r in rates)
            out[spec] = CodecMeasurement(bits_per_param=bpp, encode_gbps=enc, decode_gbps=dec)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"not a codec benchmark result ({type(e).__name__}: {e})") from None
    if not out:
        raise ConfigError("the codec benchmark result lists no codec under 'size'")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInput:
    """A proposed run, as the planner needs it."""

    params: int
    """P: model parameters."""
    seq_len: int
    """Tokens per sequence."""
    islands: int
    """N: islands (model replicas)."""
    regions: int
    """R: regions; N / R islands each."""
    h_r: int
    """Regional sync interval in inner steps."""
    h_g: int
    """Global sync interval in inner steps; a multiple of h_r."""
    batch_per_island: int
    """b: sequences per island per inner step."""
    tokens: int
    """D: training tokens of the whole run."""
    step_seconds: float
    """t_step: seconds per inner step."""
    regional_codecs: tuple[str, ...] = DEFAULT_CODECS
    """Codecs to cost at the regional level (island -> relay)."""
    global_codecs: tuple[str, ...] = DEFAULT_CODECS
    """Codecs to cost at the global level (relay -> aggregator)."""
    model: str = ""
    """What the parameter count came from (a preset name), for display only."""

    def __post_init__(self) -> None:
        for name in (
            "params",
            "seq_len",
            "islands",
            "regions",
            "h_r",
            "h_g",
            "batch_per_island",
            "tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.islands % self.regions:
            raise ConfigError(
                f"islands ({self.islands}) must split evenly into regions ({self.regions}): "
                "n_r = N / R must be a whole number"
            )
        if self.h_g % self.h_r:
            raise ConfigError(f"h_g ({self.h_g}) must be a multiple of h_r ({self.h_r})")
        if not (math.isfinite(self.step_seconds) and self.step_seconds > 0):
            raise ConfigError(f"step time must be positive seconds, got {self.step_seconds!r}")
        for level in ("regional_codecs", "global_codecs"):
            if not getattr(self, level):
                raise ConfigError(f"{level}: name at least one codec")

    @property
    def islands_per_region(self) -> int:
        return self.islands // self.regions


@dataclass(frozen=True, kw_only=True, slots=True)
class CodecCost:
    """What one codec costs at one level."""

    codec: str
    """Canonical codec spec."""
    rho: float
    """Density: fraction of parameters sent."""
    b_v: float
    """Bits per sent value (measured: bits_per_param / rho)."""
    bits_per_param: float
    """rho * b_v."""
    bytes_per_sync: float
    """P * rho * b_v / 8 per sender per sync."""
    rate_bytes_per_s: float
    """bytes_per_sync / (H * t_step)."""
    rate_gbps: float
    """The same in Gbit/s (8 bits, 10^9)."""
    link: str
    """Label of the link class the sender needs."""
    link_class: str
    """Name of that class."""
    receiver_ingress_gbps: float
    """fan_in * rate: what the receiver (relay or aggregator) takes in."""
    total_bytes: float
    """bytes_per_sync * syncs: what one sender sends over the run."""
    source: str
    """``formula``, ``formula, upper bound (zstd not modelled)`` or ``measured``."""
    encode_seconds: float | None = None
    """Measured: the sender's encode time per sync (4P / encode rate)."""
    decode_seconds: float | None = None
    """Measured: the receiver's decode time per sync for all fan_in inputs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LevelPlan:
    """One sync level: regional (islands -> relay) or global (relays -> aggregator)."""

    level: str
    h: int
    """Sync interval in inner steps."""
    interval_seconds: float
    """H * t_step: the time one sync's transfer has with full overlap."""
    syncs: float
    """T / H over the run."""
    sender: str
    """``island`` or ``relay``."""
    receiver: str
    """``relay`` or ``aggregator``."""
    fan_in: int
    """Senders per receiver: n_r or R."""
    codecs: tuple[CodecCost, ...]
    fetch_bytes_per_sync: float
    """Merge streamed back to each sender per sync, fp32: 4 P."""
    fetch_rate_gbps: float
    fetch_link: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The planner's answer for one PlanInput."""

    inputs: PlanInput
    global_batch: int
    """B_glob = N * b sequences."""
    tokens_per_step: int
    """B_glob * seq_len."""
    total_steps: float
    """T = D / (B_glob * seq_len)."""
    outer_steps: float
    """S_g = T / H_g."""
    levels: tuple[LevelPlan, LevelPlan]
    warnings: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"]["islands_per_region"] = self.inputs.islands_per_region
        d["link_classes"] = [
            {
                "name": c.name,
                "max_gbps": None if math.isinf(c.max_gbps) else c.max_gbps,
                "label": c.label,
            }
            for c in LINK_CLASSES
        ]
        return d


def _codec_cost(
    codec: str,
    inp: PlanInput,
    h: int,
    fan_in: int,
    syncs: float,
    measured: Mapping[str, CodecMeasurement],
) -> CodecCost:
    spec = parse_codec_spec(codec)
    rho, b_v = codec_rho_bits(spec)
    source = "formula, upper bound (zstd not modelled)" if spec.zstd else "formula"
    bits, nbytes = rho * b_v, inp.params * rho * b_v / 8
    m = measured.get(str(spec))
    enc = dec = None
    if m is not None:
        # Measured bits per parameter are rho * b_v; b_v is derived from them, not the reverse.
        bits, source = m.bits_per_param, "measured"
        b_v, nbytes = bits / rho, inp.params * bits / 8
        fp32_bytes = 4.0 * inp.params
        enc = fp32_bytes / (m.encode_gbps * 1e9) if m.encode_gbps else None
        dec = fan_in * fp32_bytes / (m.decode_gbps * 1e9) if m.decode_gbps else None
    rate = nbytes / (h * inp.step_seconds)
    gbps = rate * 8 / 1e9
    cls = link_class(gbps)
    return CodecCost(
        codec=str(spec),
        rho=rho,
        b_v=b_v,
        bits_per_param=bits,
        bytes_per_sync=nbytes,
        rate_bytes_per_s=rate,
        rate_gbps=gbps,
        link=cls.label,
        link_class=cls.name,
        receiver_ingress_gbps=fan_in * gbps,
        total_bytes=nbytes * syncs,
        source=source,
        encode_seconds=enc,
        decode_seconds=dec,
    )


def _level(
    level: str,
    inp: PlanInput,
    h: int,
    total_steps: float,
    codecs: Sequence[str],
    measured: Mapping[str, CodecMeasurement],
) -> LevelPlan:
    regional = level == "regional"
    fan_in = inp.islands_per_region if regional else inp.regions
    syncs = total_steps / h
    fetch = 4.0 * inp.params
    fetch_gbps = fetch / (h * inp.step_seconds) * 8 / 1e9
    return LevelPlan(
        level=level,
        h=h,
        interval_seconds=h * inp.step_seconds,
        syncs=syncs,
        sender="island" if regional else "relay",
        receiver="relay" if regional else "aggregator",
        fan_in=fan_in,
        codecs=tuple(_codec_cost(c, inp, h, fan_in, syncs, measured) for c in codecs),
        fetch_bytes_per_sync=fetch,
        fetch_rate_gbps=fetch_gbps,
        fetch_link=link_class(fetch_gbps).label,
    )


def make_plan(inp: PlanInput, measured: Mapping[str, CodecMeasurement] | None = None) -> Plan:
    """Apply the formulas of docs/design.md §5 to ``inp``; ``measured`` codecs (canonical
    spec -> measurement) replace the formula's b_v for those codecs."""
    measured = measured or {}
    global_batch = inp.islands * inp.batch_per_island
    tokens_per_step = global_batch * inp.seq_len
    total_steps = inp.tokens / tokens_per_step
    outer_steps = total_steps / inp.h_g
    warnings: list[str] = []
    if outer_steps < MIN_OUTER_STEPS:
        warnings.append(
            f"too few outer steps: S_g = T / H_g = {outer_steps:,.1f} < {MIN_OUTER_STEPS} "
            "starves the outer optimizer (docs/design.md §5.1: keep S_g at 1-3 thousand or more); "
            "add tokens rather than islands, or lower H_g"
        )
    levels = (
        _level("regional", inp, inp.h_r, total_steps, inp.regional_codecs, measured),
        _level("global", inp, inp.h_g, total_steps, inp.global_codecs, measured),
    )
    for lv in levels:
        for c in lv.codecs:
            for who, secs in ((lv.sender, c.encode_seconds), (lv.receiver, c.decode_seconds)):
                if secs is not None and secs > lv.interval_seconds:
                    verb = "encode" if who == lv.sender else f"decode of {lv.fan_in} inputs"
                    warnings.append(
                        f"{lv.level} {c.codec}: the {who}'s {verb} ({secs:.3g} s per sync at the "
                        f"measured throughput) exceeds the sync interval ({lv.interval_seconds:g} s)"
                    )
    return Plan(
        inputs=inp,
        global_batch=global_batch,
        tokens_per_step=tokens_per_step,
        total_steps=total_steps,
        outer_steps=outer_steps,
        levels=levels,
        warnings=tuple(warnings),
    )
