"""Fixed-order aggregation: same bytes for any arrival order; the commitment binds everything."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypertrain.common.aggregate import aggregate
from hypertrain.common.codec import make_codec
from hypertrain.common.digest import blob_digest, tensor_digest
from hypertrain.common.errors import HypertrainError


def _blobs(codec_name: str, n: int, numel: int, seed: int) -> dict[str, bytes]:
    codec = make_codec(codec_name)
    g = torch.Generator().manual_seed(seed)
    return {f"eu-{k}": codec.encode(torch.randn(numel, generator=g) * 1e-3) for k in range(n)}


@pytest.mark.parametrize("codec_name", ["fp32", "int8", "int8+zstd", "sparseloco+zstd"])
def test_any_arrival_order_gives_the_same_bytes(codec_name: str) -> None:
    codec = make_codec(codec_name)
    blobs = _blobs(codec_name, 4, 5000, seed=1)
    results = set()
    for order in itertools.permutations(sorted(blobs)):
        mean, com = aggregate({k: blobs[k] for k in order}, codec, (5000,))
        results.add((tensor_digest(mean), com.digest))
    assert len(results) == 1


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_mean_is_sorted_order_fp32_sum_divided(n: int, seed: int) -> None:
    codec = make_codec("fp32")
    blobs = _blobs("fp32", n, 257, seed)
    mean, com = aggregate(blobs, codec, (257,))
    expected = torch.zeros(257)
    for k in sorted(blobs):
        expected.add_(codec.decode(blobs[k]))
    expected.div_(n)
    assert torch.equal(mean, expected)
    assert com.members == tuple(sorted(blobs))
    assert com.output_digest == tensor_digest(mean)


def test_commitment_changes_with_any_input_or_codec() -> None:
    blobs = _blobs("int8", 3, 1000, seed=2)
    _, base = aggregate(blobs, make_codec("int8"), (1000,))
    other = dict(blobs)
    other["eu-1"] = _blobs("int8", 3, 1000, seed=3)["eu-1"]
    _, changed = aggregate(other, make_codec("int8"), (1000,))
    assert changed.digest != base.digest
    assert changed.input_digests[0] == base.input_digests[0]
    assert changed.input_digests[1] != base.input_digests[1]


def test_wrong_codec_input_is_rejected() -> None:
    blobs = _blobs("int8", 2, 100, seed=0)
    with pytest.raises(HypertrainError):
        aggregate(blobs, make_codec("fp32"), (100,))
    with pytest.raises(HypertrainError):
        aggregate({}, make_codec("fp32"), (100,))


def test_known_digests_give_the_same_commitment_without_hashing_again() -> None:
    codec = make_codec("int8")
    g = torch.Generator().manual_seed(5)
    blobs = {f"eu-{i}": codec.encode(torch.randn(1000, generator=g)) for i in range(3)}
    digests = {m: blob_digest(b) for m, b in blobs.items()}
    mean, commitment = aggregate(blobs, codec, (1000,))
    mean2, commitment2 = aggregate(blobs, codec, (1000,), digests)
    assert torch.equal(mean, mean2) and commitment2 == commitment
    # a name it is not told about is hashed; a digest it is told is believed (the caller's
    # transport checked it): the commitment then names what the caller vouched for
    partial = {"eu-0": digests["eu-0"], "eu-2": "0" * 64}
    _, commitment3 = aggregate(blobs, codec, (1000,), partial)
    assert commitment3.input_digests == (digests["eu-0"], digests["eu-1"], "0" * 64)
