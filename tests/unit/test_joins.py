"""Joins and leaves at run time: an island of a region that is not a member (on standby,
or it left) joins from the first regional step after the next global round, starting
from that round's merge; a member leaves from the open step (the next one when it has
delivered the open step), and the rest commit without waiting for it.  Every change is a
taped ``member`` entry that replays bit for bit and that the audit checks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.digest import blob_digest
from hypertrain.common.errors import ConfigError
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.island import IslandRounds
from hypertrain.common.rounds.local import Cluster
from hypertrain.common.rounds.machines import (
    INVALID,
    JOIN,
    LEAVE,
    Committed,
    Delta,
    GlobalArrived,
    MemberRequest,
    Membership,
    RelayMachine,
)
from hypertrain.common.rounds.node import RelayNode
from hypertrain.common.rounds.replay import PublishedFolder, RelayReplay, ReplayError
from hypertrain.common.rounds.store import NodeStore
from hypertrain.common.toy import ToyIsland
from hypertrain.common.trust.audit import audit_run
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.ledger import flat_digest
from hypertrain.common.trust.schema import GlobalAppliedEntry, MemberEntry, RegionalMergeEntry
from hypertrain.common.trust.tape import verify_tape
from hypertrain.up import config_toml

CFG = RunConfig.from_dict(
    {
        "steps": 40,
        "batch_per_island": 8,
        "regional_codec": "int8",
        "topology": {"regions": ["eu", "us"], "islands_per_region": 3, "h_r": 5, "h_g": 10},
        "membership": {"standby": ["eu-2"]},
    }
)


@pytest.fixture(scope="module")
def theta0() -> torch.Tensor:
    return initial_parameters(CFG)[1]


def _delta(numel: int, sender: str, step: int) -> Delta:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(step * 10 + int(sender[-1])))
    data = make_codec(CFG.regional_codec).encode(x * 1e-3)
    spec = str(make_codec(CFG.regional_codec).spec)
    return Delta(CFG.run_id, (step - 1) // 10, step, sender, blob_digest(data), spec, data)


def _req(change: str, member: str, step: int = 0, issued: int = 0) -> MemberRequest:
    return MemberRequest(CFG.run_id, change, member, step, issued)


def _global(relay: RelayMachine, step: int) -> None:
    from hypertrain.common.aggregate import Commitment

    relay.on_global(GlobalArrived(step, relay.core.theta + 0.5, Commitment({}, (), (), "")))


def test_standby_is_checked_and_kept_out_of_old_digests() -> None:
    assert "membership" not in CFG.with_overrides(membership={}).to_dict()
    cut = CFG.with_overrides(membership={"regional_cutoff_s": 2.0})
    assert "standby" not in cut.to_dict()["membership"]
    assert CFG.to_dict()["membership"]["standby"] == ["eu-2"]
    with pytest.raises(ConfigError, match="standby island 'eu-7' is not an island"):
        CFG.with_overrides(membership={"standby": ["eu-7"]})


def test_a_standby_island_joins_at_the_next_round_and_counts_from_then(
    theta0: torch.Tensor,
) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    n = theta0.numel()
    assert relay.members == ("eu-0", "eu-1")
    for k in (0, 1):  # the members of step 5 are all in: no wait for eu-2
        decision, effects = relay.on_delta(_delta(n, f"eu-{k}", 5))
    assert any(isinstance(e, Committed) for e in effects)
    decision, effects = relay.on_member(_req(JOIN, "eu-2"))
    assert decision.accepted and decision.start == 10
    (change,) = effects
    assert isinstance(change, Membership) and change.record.sync_step == 15
    again = relay.on_member(_req(JOIN, "eu-2"))[0]
    assert again.duplicate and again.start == 10
    assert relay.on_member(_req(JOIN, "eu-0"))[0].start is None  # a member from the start
    early = relay.on_delta(_delta(n, "eu-2", 10))[0]
    assert early.code == INVALID and "it is a member from step 15" in early.reason
    for k in (0, 1):
        relay.on_delta(_delta(n, f"eu-{k}", 10))
    assert relay.global_pending == 10
    _global(relay, 10)
    assert relay.members == ("eu-0", "eu-1", "eu-2")
    relay.on_delta(_delta(n, "eu-0", 15))
    relay.on_delta(_delta(n, "eu-1", 15))
    assert relay.level.open_step == 15  # waits for the new member
    effects = relay.on_delta(_delta(n, "eu-2", 15))[1]
    (merge,) = [e for e in effects if isinstance(e, Committed)]
    assert merge.commitment.members == ("eu-0", "eu-1", "eu-2")


def test_a_leave_commits_at_once_when_the_rest_delivered(theta0: torch.Tensor) -> None:
    relay = RelayMachine(CFG.with_overrides(membership={}), "eu", theta0)
    n = theta0.numel()
    relay.on_delta(_delta(n, "eu-0", 5))
    relay.on_delta(_delta(n, "eu-2", 5))
    decision, effects = relay.on_member(_req(LEAVE, "eu-1", 4))
    assert decision.accepted
    record = effects[0].record
    assert isinstance(record, MemberEntry) and record.sync_step == 5
    (merge,) = [e for e in effects if isinstance(e, Committed)]
    assert merge.commitment.members == ("eu-0", "eu-2") and merge.record is not None
    assert isinstance(merge.record, RegionalMergeEntry) and merge.record.absent is None
    assert relay.on_member(_req(LEAVE, "eu-1", 4))[0].duplicate  # gone already
    refused = relay.on_delta(_delta(n, "eu-1", 10))[0]
    assert refused.code == INVALID and "it left at step 5" in refused.reason
    # A member that delivered the open step leaves from the next one: its delta counts.
    relay.on_delta(_delta(n, "eu-0", 10))
    effects = relay.on_member(_req(LEAVE, "eu-0", 10))[1]
    assert effects[0].record.sync_step == 15 and len(effects) == 1  # type: ignore[union-attr]
    effects = relay.on_delta(_delta(n, "eu-2", 10))[1]
    (merge,) = [e for e in effects if isinstance(e, Committed)]
    assert merge.commitment.members == ("eu-0", "eu-2")


def test_a_region_that_everyone_left_is_joined_from_its_newest_merge(
    theta0: torch.Tensor,
) -> None:
    relay = RelayMachine(CFG, "eu", theta0)
    n = theta0.numel()
    for k in (0, 1):
        relay.on_delta(_delta(n, f"eu-{k}", 5))
    for k in (0, 1):
        relay.on_member(_req(LEAVE, f"eu-{k}", 5))
    assert relay.members == () and relay.level.open_step == 10
    stale = relay.on_member(_req(JOIN, "eu-1", 0))[0]  # issued before its leave: replayed
    assert stale.code == INVALID and "an old request" in stale.reason
    decision, effects = relay.on_member(_req(JOIN, "eu-1", 5, issued=7))
    assert decision.start == 5 and effects[0].record.sync_step == 10  # type: ignore[union-attr]
    assert relay.members == ("eu-1",)
    # ... which the island fetches as it fetches any merge, and heals to.
    merge = relay.merge_for(5)
    assert merge is not None and merge.kind == "regional"
    island = ToyIsland(TOY, "a-0", torch.zeros(4))
    rounds = IslandRounds(island, TOY.run_id)
    assert rounds.join_from(4) == (4, "global") and rounds.join_from(0) is None
    assert rounds.join_from(None) is None


def test_refusals_change_nothing_and_a_stale_leave_is_refused(theta0: torch.Tensor) -> None:
    key = SigningKey.generate("island-eu-2")
    relay = RelayMachine(CFG, "eu", theta0, TrustedKeys.of([key]))
    unsigned = relay.on_member(_req(JOIN, "eu-2"))[0]
    assert unsigned.code == INVALID and "unsigned join" in unsigned.reason
    forged = _req(JOIN, "eu-2").signed(SigningKey.generate("island-eu-2").sign(b"x"))
    assert "bad signature" in relay.on_member(forged)[0].reason
    other = relay.on_member(_req(JOIN, "us-0").signed(key.sign(b"x")))[0]
    assert other.code == INVALID and "not an island of region eu" in other.reason
    assert relay.level.changes == []
    join = _req(JOIN, "eu-2", issued=5)
    assert relay.on_member(join.signed(key.sign(join.message())))[0].start == 10
    old = _req(LEAVE, "eu-2", 3, issued=4)  # signed before its join: a replayed leave
    refused = relay.on_member(old.signed(key.sign(old.message())))[0]
    assert refused.code == INVALID and "issued before its last change" in refused.reason
    assert len(relay.level.changes) == 1
    late = RelayMachine(CFG.with_overrides(steps=10), "eu", theta0)
    assert "the run ends at step 10" in late.on_member(_req(JOIN, "eu-2"))[0].reason


def test_member_entries_replay_and_cannot_be_dropped(tmp_path: Path, theta0: torch.Tensor) -> None:
    key = SigningKey.generate("relay-eu")
    node = RelayNode(CFG, "eu", theta0, NodeStore(tmp_path, CFG.run_id, key))
    n = theta0.numel()
    node.push(_delta(n, "eu-0", 5))
    node.on_member(_req(JOIN, "eu-2"))
    node.push(_delta(n, "eu-1", 5))
    node.on_member(_req(LEAVE, "eu-1", 5))  # delivered step 5: leaves from step 10
    node.push(_delta(n, "eu-0", 10))  # the only member of step 10: the forward
    live = node.machine
    node.close()
    entries = verify_tape(tmp_path / "tape", TrustedKeys.of([key])).entries
    assert [e.kind for e in entries].count("member") == 2
    again = RelayMachine(CFG, "eu", theta0)
    RelayReplay(again, entries, PublishedFolder(tmp_path / "published")).advance()
    assert again.global_pending == 10 == live.global_pending
    assert flat_digest(again.core.base_view()) == flat_digest(live.core.base_view())
    assert again.level.members_for(15) == ("eu-0", "eu-2")
    i = [e.kind for e in entries].index("member", 3)  # the leave
    fresh = RelayMachine(CFG, "eu", theta0)
    with pytest.raises(ReplayError, match=r"not a member|produced no"):
        RelayReplay(fresh, entries[:i] + entries[i + 1 :], PublishedFolder(tmp_path / "published")).advance()  # fmt: skip


TOY = RunConfig.from_dict(
    {
        "model": "toy",
        "steps": 24,
        "topology": {"regions": ["a", "b"], "islands_per_region": 3, "h_r": 2, "h_g": 4},
        "membership": {"standby": ["a-2"]},
    }
)


def _audited(cluster: Cluster, cfg: RunConfig, run_dir: Path) -> list[MemberEntry]:
    final = flat_digest(cluster.final_theta())
    for island in cluster.islands.values():
        if island.name not in cluster.gone:
            assert island.done and flat_digest(island.core.params()) == final, island.name
    (run_dir / "run.toml").write_text(config_toml(cfg))
    assert audit_run(run_dir, TrustedKeys.of(cluster.keys.values())).final_digest
    tape = verify_tape(run_dir / "relay-a" / "tape", TrustedKeys.of(cluster.keys.values()))
    return [MemberEntry.from_body(e.body) for e in tape.entries if e.kind == "member"]


def test_an_island_joins_mid_run_and_ends_on_the_same_digest(
    tmp_path: Path, toy_cluster: Callable[..., Cluster]
) -> None:
    cluster = toy_cluster(TOY, tmp_path)
    for name, island in cluster.islands.items():
        if name != "a-2":
            cluster.start_training(island, 1.0)
    cluster.net.at(7.5, lambda: cluster.start_training(cluster.islands["a-2"], 1.0))
    cluster.drive(200_000)
    (join,) = _audited(cluster, TOY, tmp_path)
    assert join.change == JOIN and join.member == "a-2" and join.start == 8
    assert join.sync_step == 10


def test_an_island_that_leaves_is_not_waited_for_and_may_come_back(
    tmp_path: Path, toy_cluster: Callable[..., Cluster]
) -> None:
    cfg = TOY.with_overrides(membership={})  # no cutoffs: only the leave lets a-1 go
    cluster = toy_cluster(cfg, tmp_path)
    for island in cluster.islands.values():
        cluster.start_training(island, 1.0)
    a1 = cluster.islands["a-1"]
    cluster.net.at(5.5, a1.leave)
    cluster.net.at(12.5, a1.restart)
    cluster.net.at(12.5, lambda: cluster.start_training(a1, 1.0))
    cluster.drive(200_000)
    leave, join = _audited(cluster, cfg, tmp_path)
    assert (leave.change, leave.member, join.change, join.member) == (LEAVE, "a-1", JOIN, "a-1")
    assert leave.sync_step <= 8 < join.sync_step


def test_a_region_everyone_left_is_absent_until_one_joins_again(
    tmp_path: Path, toy_cluster: Callable[..., Cluster]
) -> None:
    """Both islands of region a leave; with a global cutoff the rounds go on without a;
    one of them joins again (from its relay's newest merge: the region has no member) and
    region a is back in the global rounds to the end, every island on one digest."""
    cfg = TOY.with_overrides(
        steps=40,
        membership={"standby": [], "regional_cutoff_s": 3.0, "global_cutoff_s": 3.0},
    )
    cluster = toy_cluster(cfg, tmp_path)
    for name, island in cluster.islands.items():
        if name != "a-2":
            cluster.start_training(island, 1.0)
    a2 = cluster.islands["a-2"]
    cluster.net.at(0.5, a2.leave)  # never trains: the region's third island is not used
    for name in ("a-0", "a-1"):
        cluster.net.at(9.5, cluster.islands[name].leave)
    a1 = cluster.islands["a-1"]
    cluster.net.at(24.5, a1.restart)
    cluster.net.at(24.5, lambda: cluster.start_training(a1, 1.0))
    cluster.drive(400_000)
    changes = _audited(cluster, cfg, tmp_path)
    assert [(c.change, c.member) for c in changes][-1] == (JOIN, "a-1")
    rejoin = changes[-1]
    trusted = TrustedKeys.of(cluster.keys.values())
    agg = verify_tape(tmp_path / "aggregator" / "tape", trusted).entries
    from hypertrain.common.trust.schema import GlobalMergeEntry

    merges = [GlobalMergeEntry.from_body(e.body) for e in agg if e.kind == "global_merge"]
    without_a = [m.sync_step for m in merges if m.absent == ("a",)]
    # Absent from a run of rounds after everyone left, then back to the end.
    assert without_a == list(range(without_a[0], without_a[-1] + 1, 4)), without_a
    assert without_a[-1] < merges[-1].sync_step and merges[-1].absent is None
    # Meanwhile its relay followed the global rounds (no forward), so the joiner started
    # from a recent merge, and the relay ended with the run.
    relay = verify_tape(tmp_path / "relay-a" / "tape", trusted).entries
    followed = [
        GlobalAppliedEntry.from_body(e.body)
        for e in relay
        if e.kind == "global_applied" and e.body.get("rejoined_from") is not None
    ]
    assert [f.sync_step for f in followed] == without_a[: len(followed)] and followed
    assert rejoin.start == rejoin.sync_step - 2 == followed[-1].sync_step
    assert cluster.relays["relay-a"].node.done


def test_a_pending_join_goes_through_when_the_rest_of_its_region_leaves(
    tmp_path: Path, toy_cluster: Callable[..., Cluster]
) -> None:
    """a-2 joins (pending until the next global round); then a-0 and a-1 leave before that
    round: region a has nobody to carry it there, so its relay follows the global rounds,
    and a-2 starts from the merge it was promised (or a newer one) and ends with the run."""
    cfg = TOY.with_overrides(
        steps=40, membership={"standby": ["a-2"], "regional_cutoff_s": 3.0, "global_cutoff_s": 3.0}
    )
    cluster = toy_cluster(cfg, tmp_path)
    for island in cluster.islands.values():
        if island.name != "a-2":
            cluster.start_training(island, 1.0)
    a2 = cluster.islands["a-2"]
    cluster.net.at(9.5, lambda: cluster.start_training(a2, 1.0))
    for name in ("a-0", "a-1"):
        cluster.net.at(10.2, cluster.islands[name].leave)
    cluster.drive(400_000)
    changes = _audited(cluster, cfg, tmp_path)
    assert [(c.change, c.member) for c in changes] == [
        (JOIN, "a-2"),
        (LEAVE, "a-0"),
        (LEAVE, "a-1"),
    ]
    assert a2.done and cluster.relays["relay-a"].node.done


def test_a_relay_ends_when_each_member_reported_the_final_state(theta0: torch.Tensor) -> None:
    """A relay counts an island as holding the final state when it reports it
    (``RelayNode.applied``), not when the merge went out: an island killed in between
    joins again after its restart, is told it is a member (not that the run is over),
    fetches the merge once more and reports.  An island that is not a member at the
    end is still told the run is over."""
    from hypertrain.common.rounds.machines import PRECONDITION
    from hypertrain.common.rounds.node import FORBIDDEN

    node = RelayNode(CFG, "eu", theta0, None)
    relay, n = node.machine, theta0.numel()
    assert node.applied("us-0", 40).code == FORBIDDEN  # type: ignore[union-attr]
    assert node.applied("eu-0", 40).code == PRECONDITION  # type: ignore[union-attr]
    for step in range(5, 41, 5):
        for k in (0, 1):
            relay.on_delta(_delta(n, f"eu-{k}", step))
        if step % 10 == 0:
            _global(relay, step)
    assert relay.done and not node.all_final()
    assert node.applied("eu-0", 30) is None and not node.finals  # another step: nothing
    again = relay.on_member(_req(JOIN, "eu-1", issued=1))[0]
    assert again.accepted and again.duplicate and not again.over
    late = relay.on_member(_req(JOIN, "eu-2", issued=1))[0]
    assert not late.accepted and late.over and "the run is complete" in late.reason
    assert node.applied("eu-0", 40) is None and not node.all_final()
    assert node.applied("eu-0", 40) is None and node.finals == {"eu-0"}  # again: the same
    assert node.applied("eu-1", 40) is None and node.all_final()
