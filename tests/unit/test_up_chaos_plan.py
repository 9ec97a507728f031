"""``hypertrain up --chaos SEED``: the plan drawn from the seed (entry/chaos_up.py), what
it refuses, the runner's triggers on log events, and the cutoff-timing lines.  The real
daemons under chaos: tests/integration/test_up_chaos.py."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from hypertrain.chaos_up import (
    JOIN,
    KILL,
    RESTART,
    STALL,
    ChaosAction,
    ChaosPlan,
    ChaosRunner,
    cutoff_lines,
    plan_chaos,
)
from hypertrain.common.config import RunConfig
from hypertrain.common.errors import HypertrainError
from hypertrain.procs import Child

DEFAULT = RunConfig()
SMALL = RunConfig.from_dict(
    {"steps": 100, "holdout_windows": 16, "topology": {"h_r": 5, "h_g": 10}}
)
THREE = RunConfig.from_dict(
    {"steps": 80, "topology": {"regions": ["eu", "us", "ap"], "h_r": 5, "h_g": 10}}
)


def _quorum_kept(plan: ChaosPlan) -> bool:
    """Each region keeps its quorum with the island killed for good absent and one of its
    temporary targets down, before and after its standby island joins (recomputed here)."""
    cfg = plan.cfg
    dead = plan.of(KILL).island
    temporary = {plan.of(RESTART).island, plan.of(STALL).island}
    for region in cfg.topology.regions:
        islands = cfg.topology.islands_of(region)
        initial = [i for i in islands if i not in cfg.membership.standby]
        down = (dead in islands) + bool(temporary & set(islands))
        for members in (len(initial), len(islands)):
            if members - down < cfg.membership.quorum("regional", members):
                return False
    return True


@pytest.mark.parametrize("base", [DEFAULT, SMALL, THREE], ids=["default", "small", "3-regions"])
def test_plans_are_seeded_distinct_and_keep_every_quorum(base: RunConfig) -> None:
    plans = [plan_chaos(base, seed) for seed in range(150)]
    assert plans == [plan_chaos(base, seed) for seed in range(150)]  # the seed alone
    assert len({p.actions for p in plans}) > 50  # ... and it matters
    for p in plans:
        cfg, steps, h_r = p.cfg, p.cfg.steps, p.cfg.topology.h_r
        assert cfg.topology.islands_per_region >= 3
        assert len(cfg.membership.standby) == 1 and p.standby in cfg.topology.island_ids()
        assert [a.kind for a in sorted(p.actions, key=lambda a: a.kind)] == sorted(
            (KILL, RESTART, STALL, JOIN)
        )
        assert [a.step for a in p.actions] == sorted(a.step for a in p.actions)
        targets = [p.of(k).island for k in (KILL, RESTART, STALL)]
        assert len(set(targets)) == 3 and p.standby not in targets
        assert p.of(JOIN).island == p.standby
        assert all(a.step % h_r == 0 and h_r <= a.step <= steps for a in p.actions)
        assert p.of(KILL).step < steps / 2  # the first half
        assert steps / 4 <= p.of(JOIN).step <= steps / 2  # the middle
        assert p.of(STALL).seconds > cfg.membership.regional_cutoff_s + 1
        assert 1 <= p.of(RESTART).seconds <= 3
        assert _quorum_kept(p), p.lines()
    # Every region has its turn at each role over the seeds.
    for kind in (KILL, RESTART, STALL, JOIN):
        regions = {p.of(kind).island.rpartition("-")[0] for p in plans}
        assert regions == set(base.topology.regions), kind


def test_cutoffs_and_islands_are_filled_in_only_when_not_given() -> None:
    plan = plan_chaos(DEFAULT, 1)
    mem = plan.cfg.membership
    assert (mem.regional_cutoff_s, mem.global_cutoff_s) == (3.0, 10.0)
    assert plan.cfg.topology.islands_per_region == 3
    text = "\n".join(plan.lines())
    assert "--regional-cutoff 3 (none given)" in text and "--global-cutoff 10" in text
    assert f"--standby {plan.standby} (none given)" in text
    given = DEFAULT.with_overrides(
        **{
            "membership.regional_cutoff_s": 5.0,
            "membership.global_cutoff_s": 20.0,
            "topology.islands_per_region": 4,
            "membership.standby": ["us-3"],
        }
    )
    plan = plan_chaos(given, 1)
    assert plan.cfg == given and plan.notes == ()
    assert plan.standby == "us-3" and plan.of(JOIN).island == "us-3"


@pytest.mark.parametrize(
    "cfg,ranks,words",
    [
        (DEFAULT.with_overrides(**{"topology.relay_shards": 2}), 1, "one relay per region"),
        (DEFAULT, 2, "one rank per island"),
        (
            DEFAULT.with_overrides(
                **{"topology.islands_per_region": 3, "membership.standby": ["eu-2", "us-2"]}
            ),
            1,
            "adds one island",
        ),
        (DEFAULT.with_overrides(steps=60), 1, "at least 4 global rounds"),
        (
            DEFAULT.with_overrides(**{"membership.regional_quorum": 3}),
            1,
            "keeps the regional quorum",
        ),
    ],
    ids=["shards", "ranks", "two-standby", "short", "quorum"],
)
def test_what_it_cannot_do_is_refused(cfg: RunConfig, ranks: int, words: str) -> None:
    with pytest.raises(HypertrainError, match=words):
        plan_chaos(cfg, 1, island_ranks=ranks)


def test_the_cli_refuses_in_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hypertrain.up as up
    from hypertrain.cli import main

    def started(*args: object, **kwargs: object) -> None:
        pytest.fail("hypertrain up --chaos started a cluster it should refuse")

    monkeypatch.setattr(up, "start_cluster", started)
    run_dir = tmp_path / "run"
    argv = ["up", "--chaos", "1", "--relay-shards", "2", "--run-dir", str(run_dir)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("hypertrain up: error: --chaos needs one relay per region")
    assert out == "" and not run_dir.exists()


# -- the runner, on stand-in processes -------------------------------------------------------
def _sleeper(name: str, tmp: Path) -> Child:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    return Child(name, argv, tmp / f"{name}.log")


def _sync(runner: ChaosRunner, island: str, step: int, source: str | None = None) -> None:
    e = {"event": "sync", "role": "island", "island": island, "step": str(step)}
    runner.watch(source or f"island-{island}", e)


def _until(check, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_the_runner_acts_on_syncs_one_region_disruption_at_a_time(tmp_path: Path) -> None:
    """Kill for good, restart (a new child, under a new name) and stall on the target's
    sync at or past its step; the stall in the restart's region waits until the restarted
    island synced; the join on any island's sync.  Killed children are expected exits."""
    cfg = SMALL.with_overrides(
        **{
            "topology.islands_per_region": 3,
            "membership.standby": ["eu-2"],
            "membership.regional_cutoff_s": 3.0,
        }
    )
    plan = ChaosPlan(
        seed=0,
        cfg=cfg,
        notes=(),
        actions=(
            ChaosAction(KILL, "eu-1", 10),
            ChaosAction(RESTART, "us-0", 15, 0.1),
            ChaosAction(STALL, "us-1", 15, 0.3),
            ChaosAction(JOIN, "eu-2", 40),
        ),
    )
    names = ["eu-0", "eu-1", "us-0", "us-1", "us-2"]
    children = [_sleeper(f"island-{i}", tmp_path) for i in names]
    started: list[tuple[str, str]] = []

    def start_island(island: str, label: str) -> Child:
        started.append((island, label))
        return _sleeper(label, tmp_path)

    runner = ChaosRunner(plan, children, start_island)
    by = {c.name: c for c in children}
    runner.start()
    try:
        _sync(runner, "eu-1", 5)
        _sync(runner, "us-0", 15)
        _sync(runner, "us-1", 20)  # ready, but region us waits for us-0
        _until(lambda: started == [("us-0", "island-us-0.restart1")])
        assert by["island-us-0"].proc.wait(5) == -signal.SIGKILL
        assert by["island-us-0"] in runner.expected
        assert by["island-eu-1"].proc.poll() is None  # its step is not reached
        _sync(runner, "eu-1", 10)
        assert by["island-eu-1"].proc.wait(5) == -signal.SIGKILL
        assert by["island-eu-1"] in runner.expected
        assert by["island-us-1"] not in runner.stopped
        _sync(runner, "us-0", 10, source="island-us-0.restart1")  # back (retrained)
        # stopped (a record that stays: the stop itself lasts only 0.3 s), then resumed
        _until(lambda: any(a.kind == STALL for a, _, _ in runner.did))
        _until(lambda: by["island-us-1"] not in runner.stopped)  # SIGCONT after 0.3 s
        assert by["island-us-1"].proc.poll() is None and by["island-us-1"] not in runner.expected
        assert not runner.busy()
        _sync(runner, "us-2", 40)
        _until(lambda: len(children) == 7)
        assert started[1] == ("eu-2", "island-eu-2")
        assert [c.name for c in children[-2:]] == ["island-us-0.restart1", "island-eu-2"]
        _until(lambda: not runner.pending)
        assert runner.survivors() == ["eu-0", "eu-2", "us-0", "us-1", "us-2"]
        report = "\n".join(runner.report_lines())
        assert "SIGKILL eu-1 for good (its last sync: step 10)" in report
        assert "its first sync after that: step 10" in report  # the restarted us-0
        assert "not done" not in report
    finally:
        runner.stop()
        for c in children:
            c.stop(grace=1)


def test_cutoff_lines_report_the_spread_per_level() -> None:
    cfg = SMALL.with_overrides(
        **{"membership.regional_cutoff_s": 3.0, "membership.global_cutoff_s": 10.0}
    )
    cut = {"event": "cutoff", "role": "relay", "waiting": "False"}
    lines = cutoff_lines(
        cfg,
        [
            cut | {"since_first_s": "3.004"},
            cut | {"since_first_s": "3.020"},
            cut | {"waiting": "True"},  # a clock started again by a restart
        ],
    )
    assert "regional (cutoff 3 s): 3 cutoffs, 3.004-3.020 s" in lines[1]
    assert "within the cutoff plus one second: at most +0.020 s" in lines[1]
    assert "1 below the quorum, waiting" in lines[1]
    assert lines[2] == "  global (cutoff 10 s): 0 cutoffs"
