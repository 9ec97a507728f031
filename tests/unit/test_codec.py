"""Codec properties: spec round trip, canonical bytes, exact decode, accumulate.

Each lossy codec is checked against an independent NumPy reference of its
documented rule (int8 blockwise scales; SparseLoCo's top-k with ties to the
lowest index and bin-centre values), bit for bit.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypertrain.common.codec import CodecSpec, make_codec, parse_codec_spec, read_header
from hypertrain.common.errors import CodecError, ConfigError

SPECS = [
    "fp32",
    "fp32+zstd",
    "int8",
    "int8:block=16",
    "int8:block=7+zstd",
    "sparseloco",
    "sparseloco:density=0.1,value_bits=2,chunk=64",
    "sparseloco:density=0.03,value_bits=4,chunk=100+zstd",
    "sparseloco:density=0.5,value_bits=8,chunk=7",
    "sparseloco:density=0.0156,value_bits=2,chunk=4096+zstd",
]

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw: st.DrawFn, max_numel: int = 2000) -> torch.Tensor:
    """Small fp32 tensors: Gaussian at any scale, heavy ties and zeros, or arbitrary floats."""
    shape = tuple(draw(st.lists(st.integers(0, 50), max_size=3)))
    if math.prod(shape) > max_numel:
        shape = (draw(st.integers(0, max_numel)),)
    n = math.prod(shape)
    kind = draw(st.sampled_from(["gauss", "ties", "floats"] if n <= 300 else ["gauss", "ties"]))
    if kind == "floats":
        values = draw(
            st.lists(
                st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False),
                min_size=n,
                max_size=n,
            )
        )
        return torch.tensor(values, dtype=torch.float32).reshape(shape)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = 10.0 ** draw(st.integers(-20, 20))
    if kind == "gauss":
        return (torch.randn(shape, generator=gen) * scale).float()
    return torch.randint(-2, 3, shape, generator=gen).float() * scale


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so comparisons see -0.0 vs 0.0."""
    return t.contiguous().view(torch.int32)


# -- independent references ------------------------------------------------------


def int8_reference(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(decoded values, per-element scale) by the documented int8 rule, in NumPy fp32."""
    out = np.empty_like(x)
    scales = np.empty_like(x)
    for s in range(0, x.size, block):
        b = x[s : s + block]
        scale = np.float32(np.abs(b).max()) / np.float32(127)
        d = scale if scale > 0 else np.float32(1)
        q = np.clip(np.round(b / d), -127, 127).astype(np.int8).astype(np.float32)
        out[s : s + block] = q * scale
        scales[s : s + block] = scale
    return out, scales


def sparseloco_reference(x: np.ndarray, spec: CodecSpec) -> np.ndarray:
    """Decoded values by the documented rule: ties to the lowest index, bin centres."""
    chunk, density, vbits = spec.param("chunk"), spec.param("density"), spec.param("value_bits")
    m = 1 << (int(vbits) - 1)
    out = np.zeros_like(x)
    for s in range(0, x.size, int(chunk)):
        c = x[s : s + int(chunk)]
        k = min(c.size, max(1, round(float(density) * c.size)))
        a = np.abs(c)
        order = np.lexsort((np.arange(c.size), -a))  # |x| descending, then index ascending
        kept = order[:k]
        t, peak = a[kept[-1]], a.max()
        r = np.float32(peak - t)
        d = r if r > 0 else np.float32(1)
        j = np.clip(np.floor((a[kept] - t) / d * np.float32(m)), 0, m - 1).astype(np.int64)
        centres = np.array([(2 * i + 1) / (2 * m) for i in range(m)], dtype=np.float32)
        level = (t + r * centres[j]).astype(np.float32)
        out[s + kept] = np.where(np.signbit(c[kept]), -level, level)
    return out


# -- spec --------------------------------------------------------------------------


@given(
    name=st.sampled_from(["fp32", "int8", "sparseloco"]),
    block=st.integers(1, 4096),
    density=st.floats(1e-6, 1.0, exclude_min=False),
    value_bits=st.sampled_from([2, 4, 8]),
    chunk=st.integers(1, 65536),
    zstd=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_spec_string_round_trip(
    name: str, block: int, density: float, value_bits: int, chunk: int, zstd: bool
) -> None:
    params = {
        "fp32": {},
        "int8": {"block": block},
        "sparseloco": {"density": density, "value_bits": value_bits, "chunk": chunk},
    }[name]
    text = name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")
    spec = parse_codec_spec(text + ("+zstd" if zstd else ""))
    assert parse_codec_spec(str(spec)) == spec
    assert str(parse_codec_spec(str(spec))) == str(spec)
    assert CodecSpec.from_dict(spec.to_dict()) == spec
    assert make_codec(str(spec)).spec == spec


def test_spec_canonical_forms() -> None:
    assert str(parse_codec_spec("int8+zstd")) == "int8:block=256+zstd"
    assert (
        str(parse_codec_spec("sparseloco")) == "sparseloco:density=0.0156,value_bits=2,chunk=4096"
    )
    assert str(parse_codec_spec("sparseloco:chunk=4096, density=0.015600")) == str(
        parse_codec_spec("sparseloco")
    )
    assert parse_codec_spec("int8+zstd").to_dict() == {
        "codec": "int8",
        "params": {"block": 256},
        "framing": "zstd",
    }
    assert make_codec("fp32").lossless and not make_codec("int8").lossless


@pytest.mark.parametrize(
    "bad",
    ["", "int9", "int8:block=0", "int8:block=1.5", "int8:blok=4", "int8:block", "fp32:x=1",
     "sparseloco:density=0", "sparseloco:density=nan", "sparseloco:value_bits=3",
     "sparseloco:chunk=70000", "int8+gzip", "int8:block=4,block=8"],
)  # fmt: skip
def test_spec_rejects_bad_strings(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_codec_spec(bad)


# -- encode/decode properties -------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@given(x=tensors())
@FAST
def test_exact_decode_and_determinism(spec: str, x: torch.Tensor) -> None:
    codec = make_codec(spec)
    blob = codec.encode(x)
    assert codec.encode(x.clone()) == blob
    header = read_header(blob)
    assert (
        header.shape == tuple(x.shape) and header.spec == codec.spec and header.dtype == "float32"
    )
    y = codec.decode(blob, tuple(x.shape))
    assert y.dtype == torch.float32 and y.shape == x.shape
    flat = x.reshape(-1).numpy()
    if codec.spec.name == "fp32":
        expected = flat
    elif codec.spec.name == "int8":
        expected = int8_reference(flat, int(codec.spec.param("block")))[0]
    else:
        expected = sparseloco_reference(flat, codec.spec)
    assert torch.equal(bits(y.reshape(-1)), bits(torch.from_numpy(expected)))
    assert codec.bits_per_param(blob) == (8 * len(blob) / x.numel() if x.numel() else math.inf)


@pytest.mark.parametrize("spec", SPECS)
@given(x=tensors(), base=tensors())
@FAST
def test_decode_accumulate_is_add_of_decode(spec: str, x: torch.Tensor, base: torch.Tensor) -> None:
    codec = make_codec(spec)
    blob = codec.encode(x)
    out = torch.zeros(x.shape)
    n = min(base.numel(), x.numel())
    out.view(-1)[:n] = base.reshape(-1)[:n]
    out.view(-1)[n // 2 : n // 2 + 3] = -0.0  # signed zeros must come out as add_ makes them
    expected = out.clone().add_(codec.decode(blob))
    codec.decode_accumulate(blob, out)
    assert torch.equal(bits(out), bits(expected))


def test_non_contiguous_input_encodes_like_contiguous() -> None:
    x = torch.randn(64, 96)
    for spec in SPECS:
        codec = make_codec(spec)
        assert codec.encode(x.t()) == codec.encode(x.t().contiguous())
        assert codec.encode(x[:, ::3]) == codec.encode(x[:, ::3].contiguous())


@pytest.mark.parametrize("spec", ["fp32", "int8+zstd", "sparseloco", "sparseloco:chunk=1000+zstd"])
def test_bytes_do_not_depend_on_thread_count(spec: str) -> None:
    codec = make_codec(spec)
    x = torch.randn(700_003, generator=torch.Generator().manual_seed(0))
    x[:700_000:7] = x[3::7]  # plenty of exact ties
    x[:5000] = 0.0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.encode(x)
        decoded_one = codec.decode(one)
        torch.set_num_threads(2)
        two = codec.encode(x)
        decoded_two = codec.decode(two)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    assert torch.equal(bits(decoded_one), bits(decoded_two))


@pytest.mark.parametrize("block", [1, 7, 256])
@given(x=tensors())
@FAST
def test_int8_error_within_half_a_scale(block: int, x: torch.Tensor) -> None:
    codec = make_codec(f"int8:block={block}")
    flat = x.reshape(-1).double()
    y = codec.decode(codec.encode(x)).reshape(-1).double()
    scale = torch.from_numpy(int8_reference(x.reshape(-1).numpy(), block)[1]).double()
    # s = fl(absmax/127); y = fl(x/s) is within 2^-24 * 127.0001 of x/s, rounding to q
    # adds <= 1/2, and fl(q*s) adds <= 127 * 2^-24 * s: in all, |x - x'| <= s/2 + 255 * 2^-24 * s,
    # so a slack of 2^-15 * s covers it.  Only for normal scales: below 2^-126 the
    # division loses precision (subnormals) and the bound is not claimed.
    normal = scale >= 2.0**-126
    err = (flat - y).abs()
    assert bool((err[normal] <= scale[normal] * (0.5 + 2.0**-15)).all())


@given(x=tensors(), spec=st.sampled_from(SPECS[5:]))
@FAST
def test_sparseloco_keeps_the_largest_magnitudes(x: torch.Tensor, spec: str) -> None:
    codec = make_codec(spec)
    chunk, density = int(codec.spec.param("chunk")), float(codec.spec.param("density"))
    flat, y = x.reshape(-1), codec.decode(codec.encode(x)).reshape(-1)
    # Kept positions, read off the payload's own index stream (decoded values may be 0).
    kept_index = codec.positions(codec.open(codec.encode(x))[1])  # type: ignore[attr-defined]
    kept = torch.zeros(flat.numel(), dtype=torch.bool)
    kept[kept_index] = True
    assert bool((y[~kept] == 0).all())
    for s in range(0, flat.numel(), chunk):
        a, m = flat[s : s + chunk].abs(), kept[s : s + chunk]
        assert int(m.sum()) == min(a.numel(), max(1, round(density * a.numel())))
        if bool((~m).any()):
            assert float(a[m].min()) >= float(a[~m].max())  # every kept |x| >= every dropped |x|
            # ties at the threshold go to the lowest indices
            t = float(a[m].min())
            tied = (a == t).nonzero().view(-1)
            assert bool(m[tied[: int(m[tied].sum())]].all())


def test_sparseloco_all_ties_keep_lowest_indices() -> None:
    codec = make_codec("sparseloco:density=0.25,value_bits=2,chunk=8")
    x = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, 0.0, -1.0, 1.0, 0, 0, 0, 0, 0, 0, 0, 0])
    y = codec.decode(codec.encode(x))
    assert y.tolist() == [1.0, -1.0] + [0.0] * 14


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(spec: str, bad: float) -> None:
    x = torch.randn(1000)
    x[123] = bad
    with pytest.raises(CodecError, match="NaN or inf"):
        make_codec(spec).encode(x)


def test_int8_rejects_values_that_would_overflow_on_decode() -> None:
    with pytest.raises(CodecError, match="2\\*\\*127"):
        make_codec("int8").encode(torch.tensor([3e38, 1.0]))
    y = make_codec("int8").decode(make_codec("int8").encode(torch.tensor([1.7e38, -1.0])))
    assert bool(torch.isfinite(y).all())


def test_encode_rejects_other_dtypes_and_too_many_dims() -> None:
    with pytest.raises(CodecError, match="float32"):
        make_codec("int8").encode(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(CodecError, match="dims"):
        make_codec("int8").encode(torch.zeros((1,) * 9))


def test_sparseloco_default_is_64_of_4096_and_compact() -> None:
    codec = make_codec("sparseloco+zstd")
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    blob = codec.encode(x)
    assert int((codec.decode(blob) != 0).sum()) == 64 * 256
    assert codec.bits_per_param(blob) < 0.2


def test_large_checksums_work_in_a_forked_child() -> None:
    # The checksum thread pool must not be inherited half-dead across fork().
    # Seeded input and exact bytes (a digest), not a float sum: a sum's rounding
    # depends on torch's thread count, which differs between parent and child.
    import hashlib
    import multiprocessing

    codec = make_codec("fp32")
    x = torch.randn(3 << 20, generator=torch.Generator().manual_seed(306))
    blob = codec.encode(x)  # 12 MiB: several checksum segments
    want = hashlib.sha256(x.numpy().tobytes()).hexdigest()  # fp32 is lossless
    assert hashlib.sha256(codec.decode(blob).numpy().tobytes()).hexdigest() == want
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        # bytes(): a blob is a view of the encoder's buffer, which does not pickle.
        assert pool.apply_async(_decode_digest, (bytes(blob),)).get(timeout=60) == want
        # A corrupt payload is still caught in the child: the checksums really run there.
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 0xFF
        assert pool.apply_async(_decode_error, (bytes(bad),)).get(timeout=60) == "CodecError"


def _decode_digest(blob: bytes) -> str:
    # torch's own OpenMP pool is not fork-safe once the parent has used it, so
    # the child runs torch single-threaded; the codec's checksum pool is the
    # thing under test.
    import hashlib

    torch.set_num_threads(1)
    return hashlib.sha256(make_codec("fp32").decode(blob).numpy().tobytes()).hexdigest()


def _decode_error(blob: bytes) -> str:
    torch.set_num_threads(1)
    try:
        make_codec("fp32").decode(blob)
    except CodecError as e:
        return type(e).__name__
    return "decoded"


@pytest.mark.parametrize("n", [1, 7, 8, 33, 257, 1000])
def test_all_finite_finds_one_bad_value_at_every_position(n: int) -> None:
    """The one-pass check behind fp32 encode and decode (aminmax) sees a single NaN (of
    either sign, quiet or signalling payload), +inf or -inf wherever it sits: vector
    lanes, tails, first and last; the largest finite magnitudes pass."""
    from hypertrain.common.codec.base import all_finite

    base = torch.randn(n)
    base[0] = 3.4028234663852886e38  # the largest finite fp32, and its negative
    base[-1] = -3.4028234663852886e38
    assert all_finite(base)
    assert all_finite(torch.empty(0))
    nans = [
        torch.tensor([b], dtype=torch.int32).view(torch.float32).item()
        for b in (0x7FC00000, -0x00400000, 0x7F800001, 0x7FBFFFFF)  # quiet, -quiet, signalling
    ]
    for bad in [*nans, float("inf"), float("-inf")]:
        for i in range(n):
            x = base.clone()
            x[i] = bad
            assert not all_finite(x), (bad, i)
            for spec in ("fp32", "fp32+zstd"):
                with pytest.raises(CodecError, match="NaN or inf"):
                    make_codec(spec).encode(x)


@pytest.mark.parametrize(
    ("spec", "decoded", "accumulated"),
    [
        (
            "sparseloco+zstd",
            "4027911375f58008fb6d844d87dba0afb2eb5cf26ea051110e0e4edc4cca1d99",
            "cb78aa8861420a53de8b6205d4ce148428de81032f8f66588cbcfe06b8c0eb61",
        ),
        (
            "sparseloco:chunk=64,density=0.25,value_bits=2",
            "d350f5187c0e9d7877d6c29ef0cae0a50982a80fb360bb1334ef19dff7d601d2",
            "c0efde62b986a460e8bec13b7ab885a2f526c409d2a626265ecbfe5e85b4edc4",
        ),
    ],
)
def test_sparseloco_decodes_to_pinned_bits(spec: str, decoded: str, accumulated: str) -> None:
    """Pinned from the decoder that kept every position and value of a payload, before
    payloads were decoded a range of chunks at a time: the same bits (a short last chunk,
    padding lanes in the last packed byte, -0.0 in the input and the accumulator)."""
    codec = make_codec(spec)
    x = torch.randn(262144 * 3 + 37, generator=torch.Generator().manual_seed(12))
    x[::11] = -0.0
    blob = codec.encode(x)
    acc = torch.randn(x.numel(), generator=torch.Generator().manual_seed(13))
    acc[::3] = -0.0
    codec.decode_accumulate(blob, acc)
    assert hashlib.sha256(codec.decode(blob).numpy().tobytes()).hexdigest() == decoded
    assert hashlib.sha256(acc.numpy().tobytes()).hexdigest() == accumulated


@pytest.mark.parametrize(
    "spec", ["fp32", "int8", "int8:block=100+zstd", "sparseloco+zstd", "sparseloco:chunk=64"]
)
@pytest.mark.parametrize("scale", [0.0, 1e-3, 1e20, 2.0**124])
def test_magnitude_bounds_every_decoded_value_closely(spec: str, scale: float) -> None:
    codec = make_codec(spec)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * scale
    blob = codec.encode(x)
    top = float(codec.decode(blob).abs().max())
    reach = codec.magnitude(*codec.open(blob))
    assert top <= reach, (top, reach)
    if not spec.startswith("sparseloco"):  # SparseLoCo: its largest level, maybe unused
        assert reach <= top * (1 + 2.0**-22), (top, reach)
