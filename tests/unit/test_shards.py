"""Relay shards (common/shards.py): the split rule, each shard's encoding, and a whole
in-process run with S = 1, 2, 3 relay shards per region ending on the same bits."""

from __future__ import annotations

import itertools

import pytest
import torch

from hypertrain.common.aggregate import Segment, segmented_mean, streamed_mean
from hypertrain.common.codec import ErrorFeedback, make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.errors import CodecError, ConfigError, HypertrainError
from hypertrain.common.reference import run_reference
from hypertrain.common.rounds.machines import INVALID, Delta, RelayMachine
from hypertrain.common.schedule import Schedule
from hypertrain.common.settings import IslandSettings, RelaySettings
from hypertrain.common.shards import Shards, parse_shard, relay_members, shard_unit
from hypertrain.common.trust.keys import daemon_key_names


@pytest.mark.parametrize(
    ("numel", "count", "unit"), [(1000, 1, 256), (119_424, 2, 256), (119_424, 3, 4096), (10, 10, 1)]
)
def test_shards_tile_the_parameters_in_order_on_unit_boundaries(
    numel: int, count: int, unit: int
) -> None:
    shards = Shards(count, numel, unit)
    bounds = shards.all_bounds()
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a < b for a, b in bounds)
    assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(bounds))
    assert all(a % unit == 0 for a, _ in bounds)
    units = [-(-(b - a) // unit) for a, b in bounds]
    assert max(units) - min(units) <= 1


def test_a_shard_count_with_an_empty_shard_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="at most 4 shards"):
        Shards(5, 1000, 256)
    with pytest.raises(ConfigError, match=">= 1"):
        Shards(0, 1000, 256)
    with pytest.raises(ConfigError, match="shard 2 of 2 does not exist"):
        Shards(2, 1000, 256).bounds(2)


def test_member_ids_keys_and_labels() -> None:
    one, two = Shards(1, 1000, 1), Shards(2, 1000, 1)
    assert one.members(("us", "eu")) == ("eu", "us") == relay_members(["us", "eu"], 1)
    assert two.members(("us", "eu")) == ("eu/0", "us/0", "eu/1", "us/1")
    assert two.split("us/1") == ("us", 1) and one.split("eu") == ("eu", 0)
    for bad in ("eu", "eu/2", "eu/x"):
        with pytest.raises(ConfigError, match="not a relay shard"):
            two.split(bad)
    with pytest.raises(ConfigError, match="not sharded"):
        one.split("eu/0")
    assert (one.label(0), two.label(1)) == ("", "1/2")
    topo = RunConfig().with_overrides(**{"topology.relay_shards": 2}).topology
    names = daemon_key_names(topo)
    assert {"relay-eu-0", "relay-eu-1", "relay-us-0", "relay-us-1"} <= set(names)
    assert "relay-eu" not in names
    assert shard_unit("int8:block=256", "sparseloco:chunk=4096") == 4096
    assert shard_unit("fp32", "int8:block=100") == 100


def test_shard_flags_name_what_is_wrong() -> None:
    assert parse_shard("1/3") == (1, 3)
    for bad in ("1", "a/2", "2/2", "0/0", "-1/2"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)
    topo = RunConfig().with_overrides(**{"topology.relay_shards": 2}).topology
    with pytest.raises(ConfigError, match="--shard i/S is required: this run's relays have 2"):
        RelaySettings(region="eu", aggregator="a:1").shard_index(topo)
    with pytest.raises(ConfigError, match="have 2 shard"):
        RelaySettings(region="eu", aggregator="a:1", shard="0/3").shard_index(topo)
    assert RelaySettings(region="eu", aggregator="a:1", shard="1/2").shard_index(topo) == 1
    assert RelaySettings(region="eu", shard="1/2")._default_state_dir() == "relay-eu-1"
    with pytest.raises(ConfigError, match="1 address"):
        IslandSettings(region="eu", relay="r:1").relays(topo)
    assert IslandSettings(region="eu", relay="r:1, r:2").relays(topo) == ["r:1", "r:2"]
    with pytest.raises(ConfigError, match="relay_shards must be >= 1"):
        RunConfig().with_overrides(**{"topology.relay_shards": 0})


def test_one_relay_keeps_the_config_digest_of_runs_before_shards() -> None:
    cfg = RunConfig()
    assert "relay_shards" not in cfg.to_dict()["topology"]
    sharded = cfg.with_overrides(**{"topology.relay_shards": 2})
    assert sharded.to_dict()["topology"]["relay_shards"] == 2
    assert sharded.digest != cfg.digest
    assert RunConfig.from_dict(sharded.to_dict()) == sharded


@pytest.mark.parametrize(
    "spec", ["fp32", "int8:block=256", "int8:block=100+zstd", "sparseloco:chunk=512"]
)
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_error_feedback_by_parts_is_the_whole_encoding_cut_at_unit_boundaries(
    spec: str, beta: float
) -> None:
    codec = make_codec(spec)
    numel = 10 * 1024 + 77
    shards = Shards(3, numel, codec.encode_unit)
    g = torch.Generator().manual_seed(7)
    whole, parts = ErrorFeedback(codec, numel, beta), ErrorFeedback(codec, numel, beta)
    for _ in range(3):  # the residual carries over rounds the same way
        delta = torch.randn(numel, generator=g)
        blob = whole.encode(delta.clone())
        blobs = parts.encode_parts(delta.clone(), shards.all_bounds(), consume=True)
        decoded = torch.cat([codec.decode(b).view(-1) for b in blobs])
        assert torch.equal(decoded, codec.decode(blob).view(-1))
        if spec.startswith("fp32"):
            assert whole.is_zero and parts.is_zero
        else:
            assert torch.equal(parts.residual, whole.residual)
    with pytest.raises(CodecError, match="does not continue"):
        parts.encode_parts(torch.zeros(numel), [(0, 10), (11, numel)])
    with pytest.raises(CodecError, match="cover"):
        parts.encode_parts(torch.zeros(numel), [(0, 1024)])


def test_segmented_mean_is_the_whole_mean_and_one_segment_is_streamed_mean() -> None:
    codec = make_codec("int8:block=256")
    numel = 9000
    g = torch.Generator().manual_seed(1)
    deltas = {r: torch.randn(numel, generator=g) for r in ("us", "eu", "ap")}
    whole = {r: codec.encode(d) for r, d in deltas.items()}
    mean = torch.empty(numel)
    reference = streamed_mean(whole, codec, (numel,), out=mean)
    single = segmented_mean([Segment(0, numel, whole)], codec, (numel,))
    assert single == reference
    shards = Shards(3, numel, 256)
    segments, seen = [], torch.empty(numel)
    for i, (a, b) in enumerate(shards.all_bounds()):
        names = {r: shards.member(r, i) for r in deltas}
        segments.append(
            Segment(a, b - a, {r: codec.encode(d[a:b]) for r, d in deltas.items()}, names)
        )
    split = segmented_mean(
        segments, codec, (numel,), lambda s, part: seen[s : s + part.numel()].copy_(part)
    )
    assert torch.equal(seen, mean)
    assert split.output_digest == reference.output_digest  # the whole mean's digest
    assert split.members == ("ap/0", "eu/0", "us/0", "ap/1", "eu/1", "us/1", "ap/2", "eu/2", "us/2")
    with pytest.raises(HypertrainError, match="does not continue"):
        segmented_mean(segments[1:], codec, (numel,))
    with pytest.raises(CodecError, match="accumulator has"):
        segmented_mean([Segment(0, numel, {"eu": segments[0].inputs["eu"]})], codec, (numel,))


def test_a_relay_shard_refuses_a_part_meant_for_another_shard() -> None:
    cfg = RunConfig(model="toy").with_overrides(
        **{
            "steps": 4,
            "topology.h_r": 2,
            "topology.h_g": 2,
            "topology.relay_shards": 2,
            "regional_codec": "fp32",
        }
    )
    numel = 4096
    shards = cfg.shards(numel)
    a, b = shards.bounds(1)
    relay = RelayMachine(cfg, "eu", torch.zeros(b - a), shard=1, model_numel=numel)
    assert relay.member == "eu/1"
    sched = Schedule.of(cfg)
    blob = make_codec("fp32").encode(torch.ones(b - a))
    for label, words in (
        ("0/2", "delta for relay shard 0/2 sent to shard 1/2"),
        ("", "delta for relay shard (none) sent to shard 1/2"),
    ):
        d = Delta.of(cfg.run_id, 2, "eu-0", "fp32", blob, sched, shard=label)
        decision, effects = relay.on_delta(d)
        assert (decision.code, effects) == (INVALID, []) and words in decision.reason
    ok, _ = relay.on_delta(Delta.of(cfg.run_id, 2, "eu-0", "fp32", blob, sched, shard="1/2"))
    assert ok.accepted
    wrong_size = make_codec("fp32").encode(torch.ones(b - a + 1))
    refused, _ = relay.on_delta(
        Delta.of(cfg.run_id, 2, "eu-1", "fp32", wrong_size, sched, shard="1/2")
    )
    assert refused.code == INVALID and "shape" in refused.reason
    with pytest.raises(HypertrainError, match="owns"):
        RelayMachine(cfg, "eu", torch.zeros(b - a + 1), shard=1, model_numel=numel)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"regional_codec": "sparseloco+zstd", "global_codec": "int8"},
        {"topology.tau": 1, "global_codec": "int8:block=1000", "regional_codec": "int8:block=500"},
    ],
    ids=["int8-fp32", "sparseloco-int8", "tau1-blocks"],
)
def test_in_process_runs_with_1_2_3_relay_shards_end_on_the_same_bits(changes: dict) -> None:
    base = RunConfig(steps=20, batch_per_island=4, holdout_windows=4).with_overrides(
        **{"steps": 8, "topology.h_r": 2, "topology.h_g": 4, **changes}
    )
    results = [
        run_reference(base.with_overrides(**{"topology.relay_shards": s})) for s in (1, 2, 3)
    ]
    assert len({r.final_digest for r in results}) == 1, [r.final_digest for r in results]
    assert len({r.final_loss for r in results}) == 1
    # Each island sent every shard its part: the same bytes plus one header per shard.
    assert results[0].bytes_per_sync < results[2].bytes_per_sync < results[0].bytes_per_sync + 512


def test_an_island_joins_the_parts_of_one_merge_and_refuses_anything_else() -> None:
    from hypertrain.common.aggregate import Commitment
    from hypertrain.common.rounds.island import IslandRounds
    from hypertrain.common.rounds.machines import Committed
    from hypertrain.common.toy import ToyIsland, toy_parameters

    cfg = RunConfig(model="toy").with_overrides(
        **{"steps": 4, "topology.h_r": 2, "topology.h_g": 2, "topology.relay_shards": 3}
    )
    rounds = IslandRounds(ToyIsland(cfg, "eu-0", toy_parameters(cfg)), cfg.run_id)
    bounds = rounds.core.shards.all_bounds()
    commitment = Commitment({}, (), (), "")

    def part(step: int, payload: torch.Tensor) -> Committed:
        return Committed("global", 0, step, step, commitment, payload, "global", None)

    whole = torch.arange(4096, dtype=torch.float32)
    parts = [part(2, whole[a:b].clone()) for a, b in bounds]
    assert torch.equal(rounds.join(parts), whole)
    out = torch.empty(4096)
    in_place = [part(2, out[a:b]) for a, b in bounds]
    for (a, b), p in zip(bounds, in_place, strict=True):
        p.payload.copy_(whole[a:b])
    assert rounds.join(in_place, out=out) is out and torch.equal(out, whole)
    assert torch.equal(rounds.join(parts, out=torch.empty(4096)), whole)  # copied in
    with pytest.raises(HypertrainError, match="from 2 relay shards, expected 3"):
        rounds.join(parts[:2])
    with pytest.raises(HypertrainError, match="different steps"):
        rounds.join([*parts[:2], part(4, parts[2].payload)])
    with pytest.raises(HypertrainError, match="shard 1 has 5 values"):
        rounds.join([parts[0], part(2, torch.zeros(5)), parts[2]])
