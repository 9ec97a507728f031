"""Error feedback: conservation, exactness for fp32, atomic updates, state round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hypertrain.common.codec import ErrorFeedback, make_codec
from hypertrain.common.errors import CodecError, ConfigError

SPECS = [
    "fp32",
    "int8:block=16",
    "int8+zstd",
    "sparseloco:density=0.1,value_bits=2,chunk=64",
    "sparseloco:density=0.05,value_bits=4,chunk=100+zstd",
    "sparseloco",
]
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U = 2.0**-24  # unit roundoff of fp32


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("spec", SPECS)
@given(
    seed=st.integers(0, 2**31),
    n=st.integers(1, 3000),
    beta=st.sampled_from([1.0, 0.9, 0.5, 0.0]),
    rounds=st.integers(1, 4),
    scale=st.sampled_from([1e-6, 1.0, 1e6]),
)
@example(seed=10311, n=920, beta=0.9, rounds=2, scale=1e-6)  # beta's fp32 rounding mattered
@FAST
def test_conservation(spec: str, seed: int, n: int, beta: float, rounds: int, scale: float) -> None:
    codec = make_codec(spec)
    ef = ErrorFeedback(codec, n, beta=beta)
    gen = torch.Generator().manual_seed(seed)
    # The residual is scaled in fp32, by beta as fp32 holds it (0.9 is not exact there):
    # the target uses that beta, or its representation error (up to 2^-25 |e|) would come
    # on top of the bound (hypothesis found seed 10311, n 920, beta 0.9, scale 1e-6).
    beta32 = float(torch.tensor(beta, dtype=torch.float32))
    for _ in range(rounds):
        delta = torch.randn(n, generator=gen) * scale
        old = ef.residual.clone()
        sent = codec.decode(ef.encode(delta), (n,))
        new = ef.residual
        target = old.double() * beta32 + delta.double()
        # Three fp32 roundings: fl(beta*e) (absent for beta = 1), fl(. + delta) and
        # fl(acc - sent); each is at most U times the magnitude it rounds, so
        # |sent + e_new - (beta*e + delta)| <= 2U(|beta*e| + |delta| + |e_new|) generously.
        bound = 2 * U * (old.double().abs() * beta32 + delta.double().abs() + new.double().abs())
        assert bool(((sent.double() + new.double() - target).abs() <= bound).all())
        if codec.lossless:
            # fp32: everything is sent, the residual is exactly zero.
            assert torch.equal(bits(sent), bits(old * beta + delta))
            assert bool((new == 0).all())


def test_residual_is_what_decode_leaves() -> None:
    codec = make_codec("sparseloco:density=0.1,value_bits=2,chunk=64+zstd")
    ef = ErrorFeedback(codec, (5, 40), beta=0.5)
    gen = torch.Generator().manual_seed(3)
    expected = torch.zeros(5, 40)
    for _ in range(3):
        delta = torch.randn(5, 40, generator=gen)
        acc = expected * 0.5 + delta
        blob = ef.encode(delta)
        assert blob == codec.encode(acc)  # the blob is the encoding of the accumulated state
        expected = acc - codec.decode(blob)
        assert torch.equal(bits(ef.residual), bits(expected))


def test_sparseloco_error_feedback_eventually_sends_everything() -> None:
    # A constant delta sent at 1/16 density: with error feedback the decoded sum
    # tracks the true sum, and the residual stays bounded.
    codec = make_codec("sparseloco:density=0.0625,value_bits=2,chunk=64")
    ef = ErrorFeedback(codec, 640)
    delta = torch.randn(640, generator=torch.Generator().manual_seed(0))
    total = torch.zeros(640)
    for _ in range(64):
        total += codec.decode(ef.encode(delta))
    assert torch.allclose(total + ef.residual, 64 * delta, rtol=1e-4, atol=1e-3)
    assert float(ef.residual.abs().max()) < 0.2 * float((64 * delta).abs().max())


def test_state_dict_round_trip_is_exact() -> None:
    codec = make_codec("int8:block=16")
    ef = ErrorFeedback(codec, (4, 50), beta=0.9)
    gen = torch.Generator().manual_seed(1)
    ef.encode(torch.randn(4, 50, generator=gen))
    state = ef.state_dict()
    twin = ErrorFeedback(codec, (4, 50), beta=0.9)
    twin.load_state_dict(state)
    delta = torch.randn(4, 50, generator=gen)
    assert twin.encode(delta) == ef.encode(delta)
    assert torch.equal(bits(twin.residual), bits(ef.residual))
    state["residual"].fill_(7.0)  # type: ignore[union-attr]  # a copy, not the live state
    assert not bool((ef.residual == 7.0).all())


def test_failed_encode_leaves_the_state_unchanged() -> None:
    ef = ErrorFeedback("int8", 100)
    ef.encode(torch.randn(100))
    before = ef.residual.clone()
    bad = torch.randn(100)
    bad[5] = float("nan")
    with pytest.raises(CodecError, match="NaN or inf"):
        ef.encode(bad)
    assert torch.equal(bits(ef.residual), bits(before))
    with pytest.raises(CodecError, match="values"):
        ef.encode(torch.randn(101))


def test_bad_configuration_and_state_are_rejected() -> None:
    with pytest.raises(ConfigError):
        ErrorFeedback("int8", 10, beta=1.5)
    ef = ErrorFeedback("int8", 10)
    with pytest.raises(ConfigError):
        ef.load_state_dict({"residual": torch.zeros(11), "beta": 1.0})
    with pytest.raises(ConfigError):
        ef.load_state_dict({"residual": torch.zeros(10, dtype=torch.float64), "beta": 1.0})
    with pytest.raises(ConfigError):
        ef.load_state_dict({"residual": torch.zeros(10)})


@pytest.mark.parametrize("spec", ["fp32", "int8", "sparseloco+zstd"])
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_consuming_encode_gives_the_same_bytes_and_residual(spec: str, beta: float) -> None:
    """``consume=True`` works in the delta's memory (no model-sized allocation) and must
    not change a bit: same blobs, same residual, round after round."""
    n = 70_001
    copy_ef, own_ef = ErrorFeedback(spec, n, beta=beta), ErrorFeedback(spec, n, beta=beta)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        delta = torch.randn(n, generator=g) * 0.01
        delta[:7] = -0.0  # signed zeros take the same path
        work = delta.clone()
        assert own_ef.encode(work, consume=True) == copy_ef.encode(delta)
        assert torch.equal(own_ef.residual, copy_ef.residual)
        assert own_ef.residual.view(-1).data_ptr() == work.data_ptr() or own_ef.is_zero
    assert own_ef.is_zero == (spec == "fp32")  # a lossless codec holds no residual buffer


def test_a_lossless_residual_is_zero_and_round_trips_as_none() -> None:
    ef = ErrorFeedback("fp32", 100)
    ef.encode(torch.randn(100))
    state = ef.state_dict()
    assert state["residual"] is None and ef.is_zero
    assert torch.equal(ef.residual, torch.zeros(100))  # what the old format stored
    other = ErrorFeedback("fp32", 100)
    other.load_state_dict({"residual": torch.zeros(100), "beta": 1.0})  # an older file
    assert not other.is_zero and torch.equal(other.residual, ef.residual)
    other.load_state_dict(state)
    assert other.is_zero
