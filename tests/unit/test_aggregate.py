"""Fixed-order aggregation: same bytes for any arrival order; the commitment binds everything."""

import itertools
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hypertrain.common.aggregate as agg
from hypertrain.common.aggregate import aggregate, streamed_mean
from hypertrain.common.codec import make_codec
from hypertrain.common.config import ModelConfig, RunConfig
from hypertrain.common.digest import TensorHasher, blob_digest, tensor_digest, zeros_digest
from hypertrain.common.errors import CodecError, HypertrainError
from hypertrain.common.roles import GlobalCore, RegionCore, initial_parameters
from hypertrain.common.trust.ledger import flat_digest, outer_state_digest


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


# -- the streamed mean: one range at a time, the same bits as whole-tensor sums ----------
STREAM_CODECS = [
    "fp32",
    "int8",
    "int8:block=100",  # blocks that do not divide the digest chunk: ranges align to both
    "int8+zstd",
    "sparseloco",
    "sparseloco:chunk=1000,density=0.01,value_bits=4+zstd",
]


def _whole_tensor_mean(blobs: dict[str, bytes], codec_name: str, numel: int) -> torch.Tensor:
    """The definition: zeros, + decode(input) in sorted member order, / count."""
    codec = make_codec(codec_name)
    acc = torch.zeros(numel)
    for member in sorted(blobs):
        acc.add_(codec.decode(blobs[member]))
    return acc.div_(len(blobs))


@pytest.mark.parametrize("codec_name", STREAM_CODECS)
@pytest.mark.parametrize("numel", [1, 999, 5 * 262144 + 37])
def test_streamed_mean_has_the_bits_of_whole_tensor_sums(
    codec_name: str, numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agg, "MERGE_RANGE", 1 << 18)  # several ranges even at this size
    codec = make_codec(codec_name)
    blobs = _blobs(codec_name, 3, numel, seed=numel)
    blobs["eu-1"] = codec.encode(-0.0 * torch.ones(numel))  # -0.0 + +0.0 rules, sparse adds
    want = _whole_tensor_mean(blobs, codec_name, numel)
    mean, com = aggregate(blobs, codec, (numel,))
    assert torch.equal(mean.view(torch.int32), want.view(torch.int32))
    assert com.output_digest == tensor_digest(want)
    # Folded into a base range by range, without the whole mean: base - mean, bit for bit.
    base = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    folded = base.clone()
    seen: list[int] = []

    def fold(start: int, part: torch.Tensor) -> None:
        seen.append(start)
        folded[start : start + part.numel()].sub_(part)

    assert streamed_mean(blobs, codec, (numel,), fold) == com
    assert torch.equal(folded.view(torch.int32), (base - want).view(torch.int32))
    assert seen == sorted(seen) and seen[0] == 0


def test_streamed_mean_validates_every_input_before_it_visits_a_range() -> None:
    codec = make_codec("int8")
    blobs = _blobs("int8", 3, 4096, seed=3)
    bad = bytearray(blobs["eu-2"])
    bad[-1] ^= 0xFF  # last input, last byte: the checksum fails
    blobs["eu-2"] = bytes(bad)
    visits: list[int] = []
    with pytest.raises(CodecError, match="checksum"):
        streamed_mean(blobs, codec, (4096,), lambda start, part: visits.append(start))
    assert visits == []


def test_accumulate_range_refuses_a_range_that_does_not_fit() -> None:
    codec = make_codec("int8:block=100")
    blob = codec.encode(torch.randn(1000))
    header, prepared = codec.open(blob)
    with pytest.raises(CodecError, match="steps of 100"):
        codec.accumulate_range(header, prepared, torch.zeros(100), 50)  # inside a block
    with pytest.raises(CodecError, match="does not fit"):
        codec.accumulate_range(header, prepared, torch.zeros(200), 900)  # past the end
    with pytest.raises(CodecError, match="contiguous 1-D float32"):
        codec.accumulate_range(header, prepared, torch.zeros(100, dtype=torch.float64), 0)
    out = torch.zeros(100)
    codec.accumulate_range(header, prepared, out, 900)  # the tail block
    assert torch.equal(out, codec.decode(blob)[900:])


@pytest.mark.parametrize("numel", [0, 1, 262_144, 262_145, 3 * 262_144 + 11])
def test_piecewise_and_zeros_digests_equal_the_whole_tensor_digest(numel: int) -> None:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    hasher = TensorHasher(torch.float32, (numel,))
    for start in range(0, numel, 2 * 262_144):  # whole chunks, the last piece short
        hasher.update(t[start : start + 2 * 262_144])
    assert hasher.hexdigest() == tensor_digest(t)
    assert zeros_digest(numel) == tensor_digest(torch.zeros(numel))


@pytest.mark.parametrize(
    "cuts", [[1000, 1000], [262_143, 2, 100_000], [5, 600_000 - 10], [524_288 + 3]]
)
def test_pieces_may_end_inside_a_chunk(cuts: list[int]) -> None:
    """Relay shards end anywhere (a multiple of the codec's unit): the hasher carries a
    cut chunk over to the next piece and gets the whole tensor's digest."""
    t = torch.randn(600_000, generator=torch.Generator().manual_seed(3))
    hasher = TensorHasher(torch.float32, (600_000,))
    start = 0
    for n in [*cuts, 600_000 - sum(cuts)]:
        hasher.update(t[start : start + n])
        start += n
    assert hasher.hexdigest() == tensor_digest(t)
    short = TensorHasher(torch.float32, (600_000,))
    short.update(t[:1000])
    with pytest.raises(ValueError, match="of 2400000 bytes"):
        short.hexdigest()


# -- early sums: the first inputs added while the rest arrive ---------------------------
@pytest.mark.parametrize("codec_name", STREAM_CODECS)
def test_an_early_sum_of_any_prefix_gives_the_bits_of_one_sum(
    codec_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agg, "MERGE_RANGE", 1 << 18)
    numel = 3 * 262144 + 11
    codec = make_codec(codec_name)
    blobs = _blobs(codec_name, 4, numel, seed=11)
    blobs["eu-2"] = codec.encode(-0.0 * torch.ones(numel))
    want = _whole_tensor_mean(blobs, codec_name, numel)
    _, com = aggregate(blobs, codec, (numel,))
    for k in range(len(blobs) + 1):
        early = agg.EarlySum.zeros(torch.full((numel,), 7.0), (numel,))  # zeros() clears it
        for member in sorted(blobs)[:k]:
            early.add(member, blobs[member], codec)
        seen: list[torch.Tensor] = []

        def visit(start: int, part: torch.Tensor, seen: list[torch.Tensor] = seen) -> None:
            seen.append(part.clone())

        got = streamed_mean(blobs, codec, (numel,), visit, early=early)
        assert got == com
        assert torch.equal(torch.cat(seen).view(torch.int32), want.view(torch.int32))
        assert torch.equal(early.acc.view(torch.int32), want.view(torch.int32))


def test_an_early_sum_takes_members_only_in_order() -> None:
    codec = make_codec("int8")
    blobs = _blobs("int8", 4, 1000, seed=4)
    step = ["eu-0", "eu-1", "eu-2", "eu-3"]
    early = agg.EarlySum.zeros(torch.empty(1000), (1000,))
    assert agg.EarlySum.next_of(early.members, step, {"eu-2": blobs["eu-2"]}) == []
    got = {"eu-0": blobs["eu-0"], "eu-1": blobs["eu-1"]}
    assert agg.EarlySum.next_of(early.members, step, got) == ["eu-0", "eu-1"]
    # the first two commute: the second starts a sum while the first is on its way
    got = {"eu-1": blobs["eu-1"], "eu-2": blobs["eu-2"]}
    assert agg.EarlySum.next_of(early.members, step, got) == ["eu-1"]
    early.add("eu-1", blobs["eu-1"], codec)
    assert agg.EarlySum.next_of(early.members, step, got) == []  # eu-2 waits for eu-0
    got["eu-0"] = blobs["eu-0"]
    assert agg.EarlySum.next_of(early.members, step, got) == ["eu-0", "eu-2"]
    early.add("eu-0", blobs["eu-0"], codec)
    with pytest.raises(HypertrainError, match="in the sum already"):
        early.add("eu-1", blobs["eu-1"], codec)
    early.add("eu-3", blobs["eu-3"], codec)
    with pytest.raises(HypertrainError, match="comes before"):  # only the first two commute
        early.add("eu-2", blobs["eu-2"], codec)
    assert not early.begins(blobs)  # eu-2 is missing from it: the commit sums them all
    # eu-0 left before it delivered: eu-2 follows eu-1 at once
    early = agg.EarlySum.zeros(torch.empty(1000), (1000,))
    early.add("eu-1", blobs["eu-1"], codec)
    assert agg.EarlySum.next_of(early.members, step[1:], {"eu-2": blobs["eu-2"]}) == ["eu-2"]
    # a member before the sum's own joined the step: the sum no longer begins it
    assert agg.EarlySum.next_of(["eu-2"], step, {**got, "eu-3": blobs["eu-3"]}) == []


@pytest.mark.parametrize("codec_name", STREAM_CODECS)
def test_the_first_two_inputs_of_an_early_sum_commute(
    codec_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second member alone, or the first two swapped: the mean of the sum in order,
    bit for bit, with huge values in both (and, for fp32, which keeps them, signed
    zeros and subnormals; the lossy codecs round those to +0)."""
    monkeypatch.setattr(agg, "MERGE_RANGE", 1 << 18)
    numel = 2 * 262144 + 11
    codec = make_codec(codec_name)
    blobs = _blobs(codec_name, 3, numel, seed=12)
    special = torch.tensor([0.0, -0.0, 1.6e38, -1.6e38, 1e-45, -1e-45, 1.0, -1.0])
    for k, member in enumerate(("eu-0", "eu-1")):
        x = codec.decode(blobs[member]).clone()
        x[: 64 * len(special)] = special.repeat_interleave(8).roll(k).repeat(8)
        x[::9] = -0.0 if k else 0.0
        blobs[member] = codec.encode(x)
    want = _whole_tensor_mean(blobs, codec_name, numel)
    _, com = aggregate(blobs, codec, (numel,))
    for added in (["eu-1"], ["eu-1", "eu-0"], ["eu-1", "eu-0", "eu-2"]):
        early = agg.EarlySum.zeros(torch.empty(numel), (numel,))
        for member in added:
            early.add(member, blobs[member], codec)
        assert early.begins(blobs)
        assert streamed_mean(blobs, codec, (numel,), early=early) == com
        assert torch.equal(early.acc.view(torch.int32), want.view(torch.int32)), added
    # the second alone also begins a step that closed without the first
    early = agg.EarlySum.zeros(torch.empty(numel), (numel,))
    early.add("eu-1", blobs["eu-1"], codec)
    rest = {m: b for m, b in blobs.items() if m != "eu-0"}
    assert early.begins(rest)
    _, com = aggregate(rest, codec, (numel,))
    assert streamed_mean(rest, codec, (numel,), early=early) == com


def test_zero_plus_two_fp32_values_is_the_same_bits_in_either_order() -> None:
    """The arithmetic the commuting pair rests on, over every pair of a set of values
    that covers signed zeros, subnormals, the largest finite values (sums that overflow)
    and ordinary ones: fl(fl(0 + a) + b) == fl(fl(0 + b) + a)."""
    base = [0.0, 1e-45, 1e-38, 1.0, 1.5, 3.0e38, 3.4028235e38, 1 / 3, 1e-7, 7.5e5]
    vals = torch.tensor(base + [-v for v in base], dtype=torch.float32)
    vals = torch.cat([vals, torch.randn(200, generator=torch.Generator().manual_seed(3))])
    a = vals.repeat_interleave(vals.numel())
    b = vals.repeat(vals.numel())
    one = (torch.zeros_like(a) + a) + b
    two = (torch.zeros_like(b) + b) + a
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))


def test_an_early_sum_that_does_not_begin_the_inputs_is_refused() -> None:
    codec = make_codec("int8")
    blobs = _blobs("int8", 3, 1000, seed=5)
    early = agg.EarlySum.zeros(torch.empty(1000), (1000,))
    early.add("eu-0", blobs["eu-0"], codec)
    assert early.begins(blobs)
    assert not early.begins({k: v for k, v in blobs.items() if k != "eu-0"})  # closed without it
    assert not early.begins({**blobs, "eu-0": bytes(blobs["eu-0"])})  # other bytes object
    with pytest.raises(HypertrainError, match="does not begin"):
        streamed_mean({"eu-1": blobs["eu-1"]}, codec, (1000,), early=early)


def test_an_early_sum_refuses_a_bad_input_before_writing() -> None:
    codec = make_codec("int8")
    blobs = _blobs("int8", 2, 4096, seed=6)
    early = agg.EarlySum.zeros(torch.empty(4096), (4096,))
    early.add("eu-0", blobs["eu-0"], codec)
    before = early.acc.clone()
    bad = bytearray(blobs["eu-1"])
    bad[-1] ^= 0xFF
    with pytest.raises(CodecError, match="checksum"):
        early.add("eu-1", bytes(bad), codec)
    with pytest.raises(CodecError, match="shape"):
        early.add("eu-1", codec.encode(torch.randn(4095)), codec)
    assert torch.equal(early.acc, before) and early.members == ["eu-0"]


# -- means over several ranges at once (segmented_mean(parallel=True)) -------------------
def _run_mean(
    blobs: dict[str, bytes], codec_name: str, numel: int, parallel: bool, early_k: int = 0
) -> tuple[agg.Commitment, torch.Tensor, set[int], set[int]]:
    """The commitment, a base folded by the mean, the ranges visited and the threads."""
    codec = make_codec(codec_name)
    base = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    starts: set[int] = set()
    threads: set[int] = set()

    def fold(start: int, part: torch.Tensor) -> None:
        starts.add(start)
        threads.add(threading.get_ident())
        base[start : start + part.numel()].sub_(part)

    early = None
    if early_k:
        early = agg.EarlySum.zeros(torch.empty(numel), (numel,))
        for member in sorted(blobs)[:early_k]:
            early.add(member, blobs[member], codec)
    com = streamed_mean(blobs, codec, (numel,), fold, early=early, parallel=parallel)
    return com, base, starts, threads


@pytest.mark.parametrize("codec_name", STREAM_CODECS)
@pytest.mark.parametrize("numel", [999, 5 * 262144 + 37])
@pytest.mark.parametrize("early_k", [0, 2])
def test_a_parallel_mean_has_the_bits_of_one_in_order(
    codec_name: str, numel: int, early_k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several ranges at once, each visited on some thread: the same commitment and the
    same values, bit for bit, as one range after another; with many ranges the visits
    really ran on more than one thread."""
    monkeypatch.setattr(agg, "MERGE_RANGE", 1 << 18)
    monkeypatch.setattr(agg, "_WORKERS", 3)  # waves of 3, on any machine
    blobs = _blobs(codec_name, 3, numel, seed=numel)
    one = _run_mean(blobs, codec_name, numel, parallel=False, early_k=early_k)
    many = _run_mean(blobs, codec_name, numel, parallel=True, early_k=early_k)
    assert many[0] == one[0]
    assert torch.equal(many[1].view(torch.int32), one[1].view(torch.int32))
    assert many[2] == one[2]
    assert len(one[3]) == 1
    assert (len(many[3]) > 1) == (len(one[2]) > 1)


def test_segments_that_start_inside_a_chunk_are_summed_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Relay shards of any size: a segment that starts inside a digest chunk makes the
    mean go range by range, in order, on the calling thread, with the same bits."""
    monkeypatch.setattr(agg, "MERGE_RANGE", 1 << 18)
    monkeypatch.setattr(agg, "_WORKERS", 3)
    codec = make_codec("fp32")
    cut, numel = 300_001, 900_000
    parts = {
        "a": _blobs("fp32", 2, cut, seed=1),
        "b": _blobs("fp32", 2, numel - cut, seed=2),
    }
    segments = [
        agg.Segment(0, cut, parts["a"]),
        agg.Segment(cut, numel - cut, parts["b"]),
    ]
    results = []
    for parallel in (False, True):
        seen: list[int] = []
        threads: set[int] = set()

        def visit(
            start: int, part: torch.Tensor, seen: list[int] = seen, threads: set[int] = threads
        ) -> None:
            seen.append(start)
            threads.add(threading.get_ident())

        com = agg.segmented_mean(segments, codec, (numel,), visit, parallel=parallel)
        assert seen == sorted(seen) and len(threads) == 1
        results.append((com, seen))
    assert results[0] == results[1]


def test_a_failing_range_ends_the_mean_after_its_wave(monkeypatch: pytest.MonkeyPatch) -> None:
    """A visit that raises: the error comes out once the other ranges of its wave have
    ended, and no range of a later wave is started."""
    monkeypatch.setattr(agg, "MERGE_RANGE", 1 << 18)
    monkeypatch.setattr(agg, "_WORKERS", 2)
    numel = 8 * 262144
    blobs = _blobs("fp32", 2, numel, seed=5)
    seen: set[int] = set()

    def visit(start: int, part: torch.Tensor) -> None:
        seen.add(start)
        if start == 2 * 262144:
            raise RuntimeError("visit failed")

    with pytest.raises(RuntimeError, match="visit failed"):
        streamed_mean(blobs, make_codec("fp32"), (numel,), visit, parallel=True)
    assert seen == {0, 262144, 2 * 262144, 3 * 262144}  # waves of 2: the second wave's


@pytest.mark.parametrize("numel", [1, 262_144, 5 * 262_144 + 11])
def test_pieces_hashed_out_of_order_give_the_whole_tensor_digest(numel: int) -> None:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    starts = list(range(0, numel, 2 * 262_144))
    hasher = TensorHasher(torch.float32, (numel,))
    for start in reversed(starts):
        hasher.update_at(4 * start, t[start : start + 2 * 262_144])
    assert hasher.hexdigest() == tensor_digest(t)
    # put: a piece on whole chunks is placed; one that ends inside a chunk goes on in
    # order from what was placed
    mixed = TensorHasher(torch.float32, (numel,))
    cut = min(numel, 262_144)
    mixed.put(0, t[:cut])
    if numel > cut:
        mixed.put(4 * cut, t[cut : cut + 1000])
        mixed.put(4 * (cut + 1000), t[cut + 1000 :])
    assert mixed.hexdigest() == tensor_digest(t)


def test_out_of_order_pieces_must_tile_the_tensor() -> None:
    t = torch.randn(3 * 262_144)
    gap = TensorHasher(torch.float32, (3 * 262_144,))
    gap.update_at(0, t[:262_144])
    gap.update_at(2 * 4 * 262_144, t[2 * 262_144 :])
    with pytest.raises(ValueError, match="of 3145728 bytes"):
        gap.hexdigest()
    twice = TensorHasher(torch.float32, (3 * 262_144,))
    twice.update_at(0, t[:262_144])
    with pytest.raises(ValueError, match="hashed twice"):
        twice.update_at(0, t[:262_144])
    with pytest.raises(ValueError, match="not whole chunks"):
        twice.update_at(4 * 262_144, t[262_144 : 262_144 + 10])
    with pytest.raises(ValueError, match="update after update_at"):
        twice.update(t[262_144:])
    late = TensorHasher(torch.float32, (3 * 262_144,))
    late.put(4 * 262_144, t[262_144 : 2 * 262_144])  # placed, but chunk 0 never comes
    with pytest.raises(ValueError, match="chunk 0 not hashed"):
        late.put(4 * 2 * 262_144 + 4, t[2 * 262_144 + 1 :])


@pytest.mark.parametrize("shards", [1, 2])
def test_the_cores_digests_taken_while_writing_are_those_of_what_they_wrote(
    shards: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay's base and the aggregator's theta and outer state are hashed range by
    range as a merge writes them (several ranges at once): the digests equal those of
    the finished tensors, round after round (the momentum's first step and later ones)."""
    monkeypatch.setattr(agg, "MERGE_RANGE", 1 << 18)
    monkeypatch.setattr(agg, "_WORKERS", 3)
    shape = ModelConfig(n_layer=3, d_model=192, n_head=4, seq_len=64)
    cfg = RunConfig(model="custom", model_shape=shape).with_overrides(
        **{"topology.relay_shards": shards}
    )
    _, theta0 = initial_parameters(cfg)
    numel = theta0.numel()
    assert numel > 4 * agg.MERGE_RANGE  # several waves of ranges
    region, glob = RegionCore(cfg, "eu", theta0), GlobalCore(cfg, theta0)
    regional, global_ = make_codec(cfg.regional_codec), make_codec(cfg.global_codec)
    g = torch.Generator().manual_seed(11)
    for _ in range(2):
        deltas = {
            f"eu-{i}": regional.encode(torch.randn(numel, generator=g) * 1e-3) for i in range(2)
        }
        region.merge(deltas, keep=False)
        assert region.merged_base == flat_digest(region.base_view())
        sent = {}
        for member in glob.members_of(("eu",)):
            a, b = glob.shards.bounds(glob.shards.split(member)[1])
            sent[member] = global_.encode(torch.randn(b - a, generator=g) * 1e-3)
        glob.step(sent)
        assert glob.stepped is not None
        assert glob.stepped.theta == flat_digest(glob.theta)
        assert outer_state_digest(glob.outer.state_view(), glob.stepped.outer) == (
            outer_state_digest(glob.outer.state_view())
        )
        assert set(glob.stepped.outer) == {"momentum"}


def test_a_wave_whose_submit_fails_waits_for_the_jobs_already_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper's job submitted before a later submit failed has ended when the error
    comes out: nothing of the mean is written after it is raised."""
    monkeypatch.setattr(agg, "_WORKERS", 3)
    real = agg._helper_pool()
    assert real is not None
    ended: list[int] = []

    class Failing:
        calls = 0

        def submit(self, fn: object, k: int, slot: int) -> object:
            Failing.calls += 1
            if Failing.calls == 2:
                raise RuntimeError("cannot schedule new futures")
            return real.submit(fn, k, slot)  # type: ignore[arg-type]

    def job(k: int, slot: int) -> None:
        time.sleep(0.2)
        ended.append(k)

    monkeypatch.setattr(agg, "_helper_pool", lambda: Failing())
    with pytest.raises(RuntimeError, match="cannot schedule"):
        agg._in_waves(6, job)
    assert ended == [1]  # the first helper's job ended; the caller's own never started


def test_scratch_is_taken_before_prepare_and_a_refused_step_keeps_its_digests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing that can fail comes after ``prepare`` (which may allocate state, as the
    outer step's first momentum); a step refused for a bad input leaves ``stepped`` as
    the last completed step left it."""
    monkeypatch.setattr(agg, "MERGE_RANGE", 1 << 18)
    monkeypatch.setattr(agg, "_WORKERS", 3)
    numel = 4 * 262_144
    blobs = _blobs("fp32", 2, numel, seed=9)
    prepared: list[bool] = []

    def no_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise MemoryError

    with monkeypatch.context() as patch:
        patch.setattr(agg.torch, "empty_like", no_memory)
        with pytest.raises(MemoryError):
            streamed_mean(
                blobs, make_codec("fp32"), (numel,), prepare=lambda: prepared.append(True),
                parallel=True,
            )  # fmt: skip
    assert prepared == []
    shape = ModelConfig(n_layer=3, d_model=192, n_head=4, seq_len=64)
    cfg = RunConfig(model="custom", model_shape=shape)
    _, theta0 = initial_parameters(cfg)
    core = GlobalCore(cfg, theta0)
    codec = make_codec(cfg.global_codec)
    core.step({"eu": codec.encode(torch.full((theta0.numel(),), 1e-3))})
    before, theta = core.stepped, core.theta
    bad = bytearray(codec.encode(torch.full((theta0.numel(),), 1e-3)))
    bad[-1] ^= 0xFF
    with pytest.raises(CodecError):
        core.step({"eu": bytes(bad)})
    assert core.stepped is before and core.theta is theta
