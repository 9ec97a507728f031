"""The one schedule: sync kinds, merge steps, rounds, the pending-merge queue, the overlap rule,
the anneal at H_r = 1."""

from __future__ import annotations

import itertools

import pytest
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.schedule import PendingMerges, Schedule, anneal_start, overlap_merge


def test_sync_kinds_merge_steps_and_rounds_follow_the_documented_formulas() -> None:
    s = Schedule(h_r=5, h_g=20, tau=2, steps=60)
    for t in range(1, 61):
        want = "global" if t % 20 == 0 else ("regional" if t % 5 == 0 else None)
        assert s.sync_kind(t) == want, t
    assert [s.merge_step(x) for x in (5, 20)] == [7, 22]
    assert [s.round_of(x) for x in (5, 20, 21, 40, 60)] == [0, 0, 1, 1, 2]
    assert s.global_step_of(2) == 60 and s.rounds == 3 and s.syncs_per_round == 4
    assert list(s.sync_steps("global")) == [20, 40, 60]
    assert s.next_sync_step("regional", 20) == 25 and s.next_sync_step("global", 20) == 40
    assert s.applies_in_run(55) and not s.applies_in_run(60) and s.is_final(60)
    assert s.is_sync_step(15, "regional") and not s.is_sync_step(15, "global")
    assert not s.is_sync_step(65, "regional") and not s.is_sync_step(0, "regional")


def test_a_fragment_offset_staggers_the_schedule_and_the_last_step_syncs_globally() -> None:
    s = Schedule(h_r=30, h_g=30, tau=0, steps=90, offset=10)
    assert s.sync_kind(10) == "global"  # (t - offset) % H == 0
    assert s.sync_kind(30) is None
    assert s.sync_kind(40) == "global"
    assert s.sync_kind(90) == "global"  # the final flush


def test_the_relay_status_round_of_open_step_20_is_round_0() -> None:
    """The relay's Status used to report open_step // h_g (round 1 at open step 20 with
    h_r = 10, h_g = 20); sync step 20 closes round 0."""
    s = Schedule.of(RunConfig())  # h_r = 10, h_g = 20
    assert (s.h_r, s.h_g) == (10, 20)
    assert s.round_of(20) == 0 and s.round_of(30) == 1


def test_schedule_refuses_inconsistent_intervals() -> None:
    with pytest.raises(HypertrainError, match="multiple"):
        Schedule(h_r=3, h_g=10, tau=0, steps=30)
    with pytest.raises(HypertrainError, match="tau"):
        Schedule(h_r=3, h_g=6, tau=3, steps=30)
    with pytest.raises(HypertrainError, match="offset"):
        Schedule(h_r=3, h_g=6, tau=0, steps=30, offset=6)


def test_pending_merges_hand_out_each_merge_once_at_its_pinned_step() -> None:
    q: PendingMerges[str] = PendingMerges(Schedule(h_r=5, h_g=10, tau=3, steps=20))
    q.add(5, "regional", "a")
    assert q.due(6) == [] and q.due(7) == []
    got = q.due(8)
    assert [(p.sync_step, p.merge_step, p.kind, p.item) for p in got] == [(5, 8, "regional", "a")]
    assert q.due(8) == [] and len(q) == 0
    q.add(10, "global", "b")
    with pytest.raises(HypertrainError, match="pinned to step 13 and not applied"):
        q.due(14)  # a merge is never applied late, silently
    with pytest.raises(HypertrainError, match="after"):
        q.add(5, "regional", "c")  # sync steps only move forward
    assert [p.item for p in q.flush()] == ["b"] and len(q) == 0


def test_overlap_merge_keeps_the_progress_made_during_the_overlap() -> None:
    merged = torch.tensor([1.0, 2.0])
    snapshot = torch.tensor([0.5, 0.5])
    now = torch.tensor([0.75, 0.0])
    assert torch.equal(overlap_merge(merged, now, snapshot), torch.tensor([1.25, 1.5]))


def test_the_anneal_at_h_r1_syncs_every_step_after_its_start() -> None:
    """From the last global sync step at or before the decay's start, every step syncs
    regionally; global syncs, rounds and merge steps are those of the stable phase."""
    assert anneal_start(100, 20, 0.2) == 80  # decay 20 steps: starts exactly at a global step
    assert anneal_start(100, 20, 0.3) == 60  # decay from step 70: the global step before it
    assert anneal_start(100, 20, 0.0) is None  # no decay, nothing to anneal
    assert anneal_start(100, 20, 1.0) == 0  # the whole run
    s = Schedule(h_r=5, h_g=20, tau=0, steps=100, anneal_at=60)
    plain = Schedule(h_r=5, h_g=20, tau=0, steps=100)
    for t in range(1, 101):
        want = plain.sync_kind(t) if t <= 60 or t % 20 == 0 else "regional"
        assert s.sync_kind(t) == want, t
        assert s.is_sync_step(t, "regional") == (want is not None), t
        assert s.is_sync_step(t, "global") == plain.is_sync_step(t, "global"), t
    regional = s.sync_steps("regional")
    assert regional == [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, *range(61, 101)]
    assert s.sync_steps("regional", after=58, until=63) == [60, 61, 62, 63]
    assert s.sync_steps("global") == plain.sync_steps("global") == [20, 40, 60, 80, 100]
    for a, b in itertools.pairwise(regional):  # next and prev walk the same list
        assert s.next_sync_step("regional", a) == b and s.prev_sync_step("regional", b) == a
    assert s.first_sync_step("regional") == 5 and s.prev_sync_step("regional", 5) == 0
    assert s.next_sync_step("global", 60) == 80 and s.round_of(61) == 3 and s.rounds == 5
    whole = Schedule(h_r=5, h_g=20, tau=0, steps=40, anneal_at=0)
    assert whole.first_sync_step("regional") == 1 and whole.sync_steps("regional")[:3] == [1, 2, 3]
    for bad in (
        dict(anneal_at=50),  # not a global sync step
        dict(anneal_at=100),  # the last step
        dict(anneal_at=60, tau=1),  # a merge would apply after the next sync
    ):
        with pytest.raises(HypertrainError, match="the anneal starts at a global sync step"):
            Schedule(**{"h_r": 5, "h_g": 20, "tau": 0, "steps": 100, **bad})  # type: ignore[arg-type]


def test_the_run_config_names_its_anneal_and_old_configs_keep_their_digest() -> None:
    plain = RunConfig()
    assert "anneal" not in plain.to_dict() and RunConfig(anneal="full_m").digest == plain.digest
    cfg = RunConfig(anneal="h_r1")  # 200 steps, h_g 20, decay 0.2: from step 160
    assert cfg.to_dict()["anneal"] == "h_r1" and Schedule.of(cfg).anneal_at == 160
    assert Schedule.of(plain).anneal_at is None
    with pytest.raises(
        ConfigError, match="anneal must be one of full_m, h_r1, islands:K, got 'm1'"
    ):
        RunConfig(anneal="m1")
    with pytest.raises(ConfigError, match="anneal h_r1 needs tau = 0"):
        RunConfig.from_dict({"anneal": "h_r1", "topology": {"tau": 1}})
    with pytest.raises(ConfigError, match="anneal h_r1: no global sync step before the last"):
        RunConfig.from_dict({"anneal": "h_r1", "inner": {"decay_fraction": 0.0}})  # no decay
