"""Cutoffs and quorums in the round machines: a step goes ahead without its absent members
only after a cutoff event, over the members present in the fixed order, with the absent
named on the tape; a late delta is refused as stale; the tape replays it bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypertrain.common.codec import make_codec
from hypertrain.common.config import MembershipConfig, RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.roles import GlobalCore, RegionCore, initial_parameters
from hypertrain.common.rounds.island import IslandRounds
from hypertrain.common.rounds.local import Cluster
from hypertrain.common.rounds.machines import (
    INVALID,
    PRECONDITION,
    AggregatorMachine,
    Committed,
    Cut,
    Delta,
    GlobalArrived,
    RelayMachine,
)
from hypertrain.common.rounds.node import RelayNode
from hypertrain.common.rounds.replay import (
    AggregatorReplay,
    PublishedFolder,
    RelayReplay,
    ReplayError,
)
from hypertrain.common.rounds.store import NodeStore
from hypertrain.common.toy import ToyIsland
from hypertrain.common.trust.audit import audit_run
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import flat_digest
from hypertrain.common.trust.schema import CutoffEntry, RegionalMergeEntry, RejectionEntry
from hypertrain.common.trust.tape import verify_tape
from hypertrain.up import config_toml

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "batch_per_island": 8,
        "regional_codec": "int8",
        "topology": {"regions": ["ap", "eu", "us"], "islands_per_region": 3, "h_r": 5, "h_g": 10},
        "membership": {"regional_cutoff_s": 5.0, "global_cutoff_s": 5.0},
    }
)


@pytest.fixture(scope="module")
def theta0() -> torch.Tensor:
    return initial_parameters(CFG)[1]


def _blob(numel: int, seed: int, spec: str) -> memoryview | bytes:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3
    return make_codec(spec).encode(x)


def _delta(
    cfg: RunConfig, numel: int, sender: str, step: int, seed: int, spec: str | None = None
) -> Delta:
    spec = spec or cfg.regional_codec
    data = _blob(numel, seed, spec)
    return Delta(
        cfg.run_id,
        (step - 1) // cfg.topology.h_g,
        step,
        sender,
        blob_digest(data),
        str(make_codec(spec).spec),
        data,
    )


def test_quorum_is_a_count_or_a_fraction_rounded_up() -> None:
    m = MembershipConfig(regional_quorum=0.5, global_quorum=2)
    assert [m.quorum("regional", n) for n in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert [m.quorum("global", n) for n in (1, 2, 3)] == [1, 2, 2]
    assert MembershipConfig(regional_quorum=1.0).quorum("regional", 3) == 3
    for bad in ({"regional_quorum": 0}, {"global_quorum": 1.5}, {"regional_cutoff_s": -1.0}):
        with pytest.raises(ConfigError, match="membership"):
            MembershipConfig(**bad)  # type: ignore[arg-type]
    # Without cutoffs the canonical config does not mention membership at all.
    assert "membership" not in RunConfig().to_dict()
    assert CFG.to_dict()["membership"]["regional_cutoff_s"] == 5.0
    assert RunConfig.from_dict(CFG.to_dict()) == CFG


def test_a_step_goes_ahead_without_the_absent_only_after_its_cutoff(
    theta0: torch.Tensor,
) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    n = theta0.numel()
    d0, d1, d2 = (_delta(CFG, n, f"eu-{k}", 5, seed=k) for k in range(3))
    assert relay.on_delta(d0)[0].accepted
    # One of three at the cutoff: below the quorum of 2, nothing is committed yet.
    decision, effects = relay.on_cutoff(5)
    assert decision.accepted and [type(e) for e in effects] == [Cut]
    cut = effects[0].record  # type: ignore[union-attr]
    assert cut == CutoffEntry(
        round=0, sync_step=5, present=("eu-0",), absent=("eu-1", "eu-2"), quorum=2
    )
    assert relay.merge_for(5) is None and relay.level.open_step == 5
    again = relay.on_cutoff(5)
    assert again[0].duplicate and again[1] == []
    assert relay.on_cutoff(10)[0].code == PRECONDITION
    # The quorum is back: the next delivery commits, over the two present, in order.
    decision, effects = relay.on_delta(d1)
    committed = [e for e in effects if isinstance(e, Committed)]
    assert decision.accepted and len(committed) == 1
    rec = committed[0].record
    assert isinstance(rec, RegionalMergeEntry) and rec.absent == ("eu-2",)
    assert [m for m, _ in rec.members] == ["eu-0", "eu-1"]
    # The same mean as a region of only those two islands, bit for bit.
    core = RegionCore(CFG, "eu", theta0)
    _, commitment = core.merge({"eu-1": d1.data, "eu-0": d0.data})
    assert commitment.digest == rec.commitment
    assert flat_digest(core.base_view()) == rec.post_base
    # The late island is told its step closed without it; nothing changes.
    stale = relay.on_delta(d2)[0]
    assert stale.code == PRECONDITION and stale.stale
    assert stale.reason == "sync step 5 of region eu closed without eu-2 at its cutoff"
    assert relay.level.open_step == 10 and not relay.level.inputs


def test_with_every_member_present_nothing_on_the_tape_changes(theta0: torch.Tensor) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    n = theta0.numel()
    for k in range(3):
        _, effects = relay.on_delta(_delta(CFG, n, f"eu-{k}", 5, seed=k))
    (merge,) = [e for e in effects if isinstance(e, Committed)]
    assert merge.record is not None and "absent" not in merge.record.to_body()
    # A cutoff that comes after the step committed is for a step no longer open.
    assert relay.on_cutoff(5)[0].code == PRECONDITION


def test_a_cutoff_with_the_quorum_in_commits_at_once(theta0: torch.Tensor) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    n = theta0.numel()
    for k in (2, 0):
        relay.on_delta(_delta(CFG, n, f"eu-{k}", 5, seed=k))
    _, effects = relay.on_cutoff(5)
    assert [type(e) for e in effects] == [Cut, Committed]
    assert effects[1].commitment.members == ("eu-0", "eu-2")  # type: ignore[union-attr]


def test_the_aggregator_counts_whole_regions_and_steps_over_those_present(
    theta0: torch.Tensor,
) -> None:
    n = theta0.numel()
    agg = AggregatorMachine(CFG, theta0)
    deltas = {
        r: _delta(CFG, n, r, 10, seed=i, spec=CFG.global_codec) for i, r in enumerate(("us", "ap"))
    }
    for d in deltas.values():
        assert agg.on_regional(d)[0].accepted
    decision, effects = agg.on_cutoff(10)
    assert decision.accepted and [type(e) for e in effects] == [Cut, Committed]
    merge = effects[1]
    assert isinstance(merge, Committed) and merge.commitment.members == ("ap", "us")
    assert merge.record is not None and merge.record.absent == ("eu",)  # type: ignore[union-attr]
    core = GlobalCore(CFG, theta0)
    core.step({r: d.data for r, d in deltas.items()})
    assert flat_digest(core.theta) == flat_digest(merge.payload)
    late = agg.on_regional(_delta(CFG, n, "eu", 10, seed=9, spec=CFG.global_codec))[0]
    assert late.stale and "sync step 10 of the global round closed without eu" in late.reason


def test_a_region_with_one_shard_missing_is_absent_as_a_whole() -> None:
    # The machine takes a cutoff event whatever the clock (the config refuses cutoff
    # seconds with relay shards, whose regions cannot yet rejoin evenly).
    cfg = CFG.with_overrides(**{"topology.relay_shards": 2, "membership": {"global_quorum": 1}})
    with pytest.raises(ConfigError, match="relay_shards"):
        cfg.with_overrides(**{"membership.global_cutoff_s": 5.0})
    _, theta0 = initial_parameters(cfg)
    agg = AggregatorMachine(cfg, theta0)
    shards = cfg.shards(theta0.numel())
    sent = {}
    for member in ("eu/0", "eu/1", "us/0"):
        a, b = shards.bounds(shards.split(member)[1])
        sent[member] = _delta(cfg, b - a, member, 10, seed=len(sent), spec=cfg.global_codec)
        assert agg.on_regional(sent[member])[0].accepted
    _, effects = agg.on_cutoff(10)
    merge = effects[-1]
    assert isinstance(merge, Committed)
    assert merge.commitment.members == ("eu/0", "eu/1")
    assert merge.record.absent == ("ap/0", "ap/1", "us/0", "us/1")  # type: ignore[union-attr]
    core = GlobalCore(cfg, theta0)
    core.step({m: sent[m].data for m in ("eu/0", "eu/1")})
    assert flat_digest(core.theta) == flat_digest(merge.payload)
    with pytest.raises(Exception, match="not every relay"):
        GlobalCore(cfg, theta0).step({"us/0": sent["us/0"].data})


def test_a_tape_with_cutoffs_replays_and_needs_them(tmp_path: Path, theta0: torch.Tensor) -> None:
    key = SigningKey.generate("relay-eu")
    trusted = TrustedKeys.of([key])
    store = NodeStore(tmp_path, CFG.run_id, key)
    node = RelayNode(CFG, "eu", theta0, store)
    n = theta0.numel()
    node.push(_delta(CFG, n, "eu-1", 5, seed=1))
    assert node.cutoff(5)[0].accepted
    node.push(_delta(CFG, n, "eu-0", 5, seed=0))  # the quorum: commits without eu-2
    late = node.push(_delta(CFG, n, "eu-2", 5, seed=2))[0]
    assert late.stale
    for k in range(3):
        node.push(_delta(CFG, n, f"eu-{k}", 10, seed=10 + k))  # everyone: a forward
    live = node.machine
    node.close()
    entries = verify_tape(tmp_path / "tape", trusted).entries
    kinds = [e.kind for e in entries]
    assert kinds.count("cutoff") == 1 and kinds.count("regional_merge") == 2
    (rejection,) = [e for e in entries if e.kind == "rejection"]
    assert RejectionEntry.from_body(rejection.body).digest == _delta(CFG, n, "eu-2", 5, 2).digest

    again = RelayMachine(CFG, "eu", theta0)
    RelayReplay(again, entries, PublishedFolder(tmp_path / "published")).advance()
    assert flat_digest(again.core.theta) == flat_digest(live.core.theta)
    assert again.level.absent_at == {5: ("eu-2",)} and again.global_pending == 10
    # Without its cutoff entry, the merge that went ahead without eu-2 cannot be replayed.
    cut = kinds.index("cutoff")
    fresh = RelayMachine(CFG, "eu", theta0)
    replay = RelayReplay(
        fresh, entries[:cut] + entries[cut + 1 :], PublishedFolder(tmp_path / "published")
    )
    with pytest.raises(ReplayError, match="produced no regional_merge"):
        replay.advance()


def test_an_unknown_member_still_gets_invalid_not_stale(theta0: torch.Tensor) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    refused = relay.on_delta(_delta(CFG, theta0.numel(), "us-0", 5, seed=0))[0]
    assert refused.code == INVALID and not refused.stale


TOY = RunConfig.from_dict(
    {
        "model": "toy",
        "steps": 16,
        "topology": {"regions": ["a", "b"], "islands_per_region": 2, "h_r": 2, "h_g": 4},
        "membership": {"regional_cutoff_s": 3.0, "global_cutoff_s": 3.0},
    }
)


def test_without_faults_a_cutoff_config_changes_no_bit(
    toy_cluster: Callable[..., Cluster],
) -> None:
    plain = toy_cluster(TOY.with_overrides(membership={}), None).run_lockstep()
    assert flat_digest(toy_cluster(TOY, None).run_lockstep()) == flat_digest(plain)


def test_an_island_gone_for_good_and_the_run_ends_without_it(
    tmp_path: Path, toy_cluster: Callable[..., Cluster]
) -> None:
    cluster = toy_cluster(TOY, tmp_path)
    for island in cluster.islands.values():
        cluster.start_training(island, 1.0)
    gone = cluster.islands["a-1"]
    cluster.gone.add("a-1")
    cluster.net.at(5.5, gone.crash)  # after its step 5, before its push of step 6
    cluster.drive(100_000)
    assert gone.core.step < 6 and not gone.done
    final = cluster.final_theta()
    for name, island in cluster.islands.items():
        if name != "a-1":
            assert island.done and flat_digest(island.core.params()) == flat_digest(final)
    folder = tmp_path / "relay-a"
    trusted = TrustedKeys.of(cluster.keys.values())
    entries = verify_tape(folder / "tape", trusted).entries
    merges = [RegionalMergeEntry.from_body(e.body) for e in entries if e.kind == "regional_merge"]
    assert [m.sync_step for m in merges] == list(range(2, 17, 2))
    without = [m.sync_step for m in merges if m.absent == ("a-1",)]
    assert without == list(range(without[0], 17, 2)) and without[0] <= 6  # to the end
    assert all(m.absent is None for m in merges if m.sync_step < without[0])
    assert sum(e.kind == "cutoff" for e in entries) == len(without)
    # The tapes rebuild what the relay and the aggregator did, cutoffs and all.
    _, theta0 = initial_parameters(TOY)
    again = RelayMachine(TOY, "a", theta0, trusted)
    replay = RelayReplay(again, entries, PublishedFolder(folder / "published"))
    agg_folder = tmp_path / "aggregator"
    agg_replay = AggregatorReplay(
        AggregatorMachine(TOY, theta0, trusted),
        verify_tape(agg_folder / "tape", trusted).entries,
        PublishedFolder(agg_folder / "published"),
    )
    while (step := replay.advance()) is not None:
        merge = agg_replay.advance(step)
        assert merge is not None
        replay.apply_global(GlobalArrived(step, merge.payload, merge.commitment))
    assert again.done and flat_digest(again.core.theta) == flat_digest(final)
    assert set(again.level.absent_at) == set(without)
    # The auditor, which replays every tape the same way, finds the run whole.
    (tmp_path / "run.toml").write_text(config_toml(TOY))
    assert audit_run(tmp_path, trusted).final_digest


def test_a_relay_left_behind_rejoins_at_the_later_round(theta0: torch.Tensor) -> None:
    from hypertrain.common.aggregate import Commitment

    cfg = CFG.with_overrides(steps=40)
    relay = RelayMachine(cfg, "eu", theta0)
    n = theta0.numel()
    for step in (5, 10):
        for k in range(3):
            relay.on_delta(_delta(cfg, n, f"eu-{k}", step, seed=step + k))
    assert relay.global_pending == 10
    # The aggregator's rounds went on without region eu: it answers with round 20's state.
    theta20 = theta0 + 1.0
    (applied,) = relay.on_global(GlobalArrived(20, theta20, Commitment({}, (), (), "")))
    assert applied.record.rejoined_from == 10 and applied.record.sync_step == 20  # type: ignore[union-attr]
    assert relay.level.open_step == 25 and relay.global_pending is None
    merge = relay.merge_for(20)
    assert merge is not None and merge.payload is theta20
    late = relay.on_delta(_delta(cfg, n, "eu-0", 15, seed=1))[0]
    assert late.stale and late.reason == (
        "sync step 15 of region eu was skipped: it rejoined the run at step 20"
    )
    assert relay.on_delta(_delta(cfg, n, "eu-0", 25, seed=1))[0].accepted
    with pytest.raises(HypertrainError, match="unexpected global update"):
        relay.on_global(GlobalArrived(30, theta20, Commitment({}, (), (), "")))


def test_an_island_heals_to_the_later_global_merge() -> None:
    _, theta0 = initial_parameters(TOY)
    island = ToyIsland(TOY, "a-0", theta0)
    rounds = IslandRounds(island, TOY.run_id)
    for _ in range(2):
        island.train_step()
    rounds.after_step()  # pushes step 2; its merge is pending
    later = theta0 + 0.5
    rounds.heal(8, later)
    assert island.step == 8 and not any(rounds.pendings)
    assert torch.equal(island.base, later) and torch.equal(island.params(), later)
    assert island.feedback.is_zero
    with pytest.raises(HypertrainError, match="cannot rejoin"):
        rounds.heal(6, later)  # not a global sync step, and behind


def test_an_island_an_anneal_stops_heals_past_its_last_step_and_is_finished() -> None:
    """An ``islands:1`` anneal stops b-0 at step 12.  Left behind at step 4 (its delta
    stale at the global cutoff), it is answered with the run's final merge of step 16:
    it takes it and is finished, with nothing left to push (before, "cannot rejoin at
    step 16 from step 4" stopped its driver; fault simulation, seed 2374)."""
    cfg = TOY.with_overrides(anneal="islands:1")
    _, theta0 = initial_parameters(cfg)
    island = ToyIsland(cfg, "b-0", theta0)
    rounds = IslandRounds(island, cfg.run_id)
    assert rounds.stops_early and rounds.last_step == 12
    for _ in range(4):
        island.train_step()
    rounds.after_step()  # pushes step 4; its merge is pending
    final = theta0 + 0.5
    rounds.heal(16, final)
    assert island.step == 16 and rounds.finished and not any(rounds.pendings)
    assert torch.equal(island.base, final) and rounds.final_due() is None
    rounds.stop()  # what an island the anneal stops does last
    kept = IslandRounds(ToyIsland(cfg, "a-0", theta0), cfg.run_id)
    with pytest.raises(HypertrainError, match="cannot rejoin"):
        kept.heal(15, final)  # a kept island: not a sync step
    with pytest.raises(HypertrainError, match="cannot rejoin"):
        rounds.heal(12, final)  # behind where it stands


def test_a_relay_that_rejoined_resumes_after_dying_before_its_entry(
    tmp_path: Path, theta0: torch.Tensor
) -> None:
    """Killed between the checkpoint of a rejoin and its global_applied entry: restarted,
    it tapes the same entry (rejoined_from included), so its tape stays whole, and it
    still refuses deltas for the steps it skipped as stale."""
    from hypertrain.common.aggregate import Commitment

    cfg = CFG.with_overrides(steps=40)
    key = SigningKey.generate("relay-eu")

    class Died(Exception):
        pass

    def crash(point: str) -> None:
        if point == "relay_after_checkpoint":
            raise Died(point)

    node = RelayNode(cfg, "eu", theta0, NodeStore(tmp_path, cfg.run_id, key, crash=crash))
    n = theta0.numel()
    for step in (5, 10):
        for k in range(3):
            node.push(_delta(cfg, n, f"eu-{k}", step, seed=step + k))
    assert node.outbox is not None and node.outbox.sync_step == 10
    with pytest.raises(Died):
        # as fetched from an aggregator that keeps no tape (the relay pins no keys here)
        node.on_global(
            Committed("global", 1, 20, 20, Commitment({}, (), (), ""), theta0 + 1.0, "global", None)
        )
    assert node.store is not None and node.store.tape is not None
    node.store.tape.close()

    again = RelayNode(cfg, "eu", theta0, NodeStore(tmp_path, cfg.run_id, key))
    again.recover()
    entries = verify_tape(tmp_path / "tape", TrustedKeys.of([key])).entries
    applied = [e for e in entries if e.kind == "global_applied"]
    assert [e.body.get("rejoined_from") for e in applied] == [10]
    late = again.push(_delta(cfg, n, "eu-1", 15, seed=1))[0]
    assert late.stale and "was skipped" in late.reason
    assert again.machine.level.open_step == 25
