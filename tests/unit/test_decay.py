"""The decay phase in the core: the anneal at H_r = 1 (RunConfig.anneal) and LAWA
(RunConfig.lawa).  The in-process run is the simulator's per-replica path bit for bit; the
switch is taped by every relay and the aggregator, the average is taped and published as
lawa.pt; a crash at any point around either resumes on the same digests; the audit replays
both and catches a forged entry or a changed lawa.pt (the toy model and the tiny preset in
process, real files; the daemons: tests/integration/test_decay_daemons.py)."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import ConfigError
from hypertrain.common.optim import LAWA, LawaSum
from hypertrain.common.reference import run_reference
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.local import Cluster, Crash
from hypertrain.common.rounds.machines import AggregatorMachine
from hypertrain.common.rounds.replay import AggregatorReplay, PublishedFolder, ReplayError
from hypertrain.common.rounds.store import LAWA_FILE
from hypertrain.common.runflags import add_run_config_flags, run_config_from_args
from hypertrain.common.trust.audit import AuditError, Auditor, RunLayout
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, daemon_key_names
from hypertrain.common.trust.ledger import AGGREGATOR_KEY, flat_digest, relay_key
from hypertrain.common.trust.tape import TapeWriter, verify_tape
from hypertrain.sim.engine.job import SimJob
from hypertrain.sim.engine.run import run_job
from tests.unit.toycluster import CrashHook, drive, toy_cluster

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CFG = RunConfig.from_dict(
    {
        "model": "toy",
        "steps": 12,  # 3 global rounds; LAWA over the last 2
        "lawa": 2,
        "topology": {"regions": ["a", "b"], "islands_per_region": 2, "h_r": 2, "h_g": 4, "tau": 1},
    }
)
KEYS = {n: SigningKey.generate(n) for n in daemon_key_names(CFG.topology)}
TRUSTED = TrustedKeys.of(KEYS.values())


# -- the arithmetic ------------------------------------------------------------------------


def test_the_running_sum_is_the_simulators_mean_whole_or_by_ranges() -> None:
    g = torch.Generator().manual_seed(0)
    states = [torch.randn(1000, generator=g) * 10 ** (i - 2) for i in range(5)]
    states[1][:7] = -0.0
    by_hand = torch.zeros(1000)
    for s in states:
        by_hand.add_(s)
    by_hand.div_(len(states))
    lawa = LAWA(k=5)
    running = LawaSum()
    for s in states:
        lawa.add(s)
        running.add(s)
    assert torch.equal(lawa.average(), by_hand) and torch.equal(running.average(), by_hand)
    assert torch.equal(running.average(), by_hand)  # averaging leaves the sum as it was
    pieces = []
    for a, b in ((0, 300), (300, 301), (301, 1000)):
        part = LawaSum()
        for s in states:
            part.add(s[a:b])
        pieces.append(part.average())
    assert torch.equal(torch.cat(pieces), by_hand)
    # a sum restored from a checkpoint goes on exactly
    half = LawaSum()
    for s in states[:2]:
        half.add(s)
    assert half.total is not None
    resumed = LawaSum(half.total.clone(), 2)
    for s in states[2:]:
        resumed.add(s)
    assert torch.equal(resumed.average(), by_hand)


def test_the_config_field_its_range_its_flag_and_old_digests() -> None:
    plain = RunConfig()
    assert "lawa" not in plain.to_dict()  # configs from before LAWA keep their digest
    assert RunConfig(lawa=0).digest == plain.digest
    assert RunConfig(lawa=3).to_dict()["lawa"] == 3
    rounds = plain.steps // plain.topology.h_g
    with pytest.raises(ConfigError, match=rf"lawa must be in \[0, {rounds}\].*got {rounds + 1}"):
        RunConfig(lawa=rounds + 1)
    with pytest.raises(ConfigError, match="lawa must be in"):
        RunConfig(lawa=-1)
    p = argparse.ArgumentParser()
    add_run_config_flags(p)
    assert run_config_from_args(p.parse_args(["--lawa", "2"])).lawa == 2
    with pytest.raises(ConfigError, match=r"sim job: run\.lawa stays 0"):
        SimJob(run=RunConfig(lawa=1))


# -- the in-process run is the simulator's per-replica path --------------------------------


@pytest.mark.parametrize(
    ("tau", "anneal"),
    [(0, "full_m"), (1, "full_m"), (0, "h_r1"), (0, "islands:1"), (0, "islands:3")],
    ids=["lawa", "lawa-tau1", "h_r1", "islands1", "islands3"],
)
def test_in_process_run_is_the_simulators_per_replica_path_bit_for_bit(
    tau: int, anneal: str
) -> None:
    cfg = RunConfig.from_dict(
        {
            "steps": 16,  # 4 rounds; the anneal from step 12, LAWA over the last 2
            "batch_per_island": 4,
            "holdout_windows": 16,
            "lawa": 2,
            "anneal": anneal,
            "topology": {
                "regions": ["r0", "r1"],
                "islands_per_region": 2,
                "h_r": 2,
                "h_g": 4,
                "tau": tau,
            },
        }
    )
    ref = run_reference(cfg)
    for path in ("per_replica", "batched"):
        job = SimJob.of_run(cfg, path=path, eval_points=1)
        sim = run_job(job)
        assert ref.lawa_params is not None and sim.lawa_params is not None
        assert torch.equal(ref.final_params, sim.final_params), path  # type: ignore[arg-type]
        assert torch.equal(ref.lawa_params, sim.lawa_params), path
        assert ref.lawa_loss == sim.final_loss  # the simulator's final loss is the average's
    assert not torch.equal(ref.lawa_params, ref.final_params)  # type: ignore[arg-type]
    if anneal != "full_m":
        plain = run_reference(cfg.with_overrides(anneal="full_m"))
        assert not torch.equal(plain.final_params, ref.final_params)  # type: ignore[arg-type]


# -- the toy cluster: tape, file, crashes, audit --------------------------------------------


ANNEAL = CFG.with_overrides(anneal="h_r1", **{"topology.tau": 0})
ISLANDS = ANNEAL.with_overrides(anneal="islands:1")
"""The decay on a-0 alone: a-1, b-0 and b-1 stop after step 8, relay-b follows."""
CONFIGS = {"lawa": CFG, "anneal": ANNEAL, "islands": ISLANDS}
"""The toy run with the anneal: 12 steps, h_g 4, decay 0.2: every step syncs after step 8."""


def _run(run_dir: Path | None, crash: CrashHook | None = None, cfg: RunConfig = CFG) -> Cluster:
    return drive(toy_cluster(cfg, run_dir, KEYS, TRUSTED, crash))


def _digests(cluster: Cluster) -> tuple[str, str]:
    averaged = cluster.aggregator.node.averaged
    assert averaged is not None
    return flat_digest(cluster.final_theta()), averaged.record.average


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[str, str]]:
    """Per config, the (final state, LAWA average) digests of its run in memory."""
    return {name: _digests(_run(None, cfg=cfg)) for name, cfg in CONFIGS.items()}


def _audit(run_dir: Path, cfg: RunConfig = CFG) -> str:
    relays = {r: run_dir / relay_key(r) for r in cfg.topology.regions}
    return Auditor(RunLayout(cfg, run_dir / "aggregator", relays), TRUSTED).run().summary()


def _close(cluster: Cluster) -> None:
    """Every process stops: the tapes close (a relay killed after the last round it was
    needed in, not restarted yet, was closed by its crash)."""
    for actor in [cluster.aggregator, *cluster.relays.values()]:
        if actor.alive:
            actor.node.close()


def test_the_average_is_taped_published_and_audited(
    tmp_path: Path, reference: dict[str, tuple[str, str]]
) -> None:
    cluster = _run(tmp_path)
    _close(cluster)
    averaged = cluster.aggregator.node.averaged
    assert averaged is not None and averaged.record.average == reference["lawa"][1]
    rec = averaged.record
    assert (rec.first_round, rec.last_round) == (1, 2)
    entries = verify_tape(tmp_path / "aggregator" / "tape", TRUSTED).entries
    merges = [e.body["post_state"] for e in entries if e.kind == "global_merge"]
    lawa = [e for e in entries if e.kind == "lawa"]
    assert len(lawa) == 1 and lawa[0].body["states"] == merges[1:]
    assert entries[lawa[0].seq + 1].kind == "checkpoint"  # sealed, like a merge
    saved = torch.load(tmp_path / "aggregator" / LAWA_FILE, weights_only=True)
    assert flat_digest(saved["theta"]) == rec.average == saved["digest"]
    assert (saved["first_round"], saved["last_round"]) == (1, 2)
    # the checkpoints of the window's rounds hold the running sum; the one before none
    ck = sorted((tmp_path / "aggregator" / "checkpoints").iterdir())
    assert [("lawa" in torch.load(p, weights_only=True)) for p in ck] == [False, True, True]
    summary = _audit(tmp_path)
    assert summary.startswith("audit OK: complete") and ", LAWA average digest " in summary


def test_a_changed_lawa_file_fails_the_audit(tmp_path: Path) -> None:
    _close(_run(tmp_path))
    path = tmp_path / "aggregator" / LAWA_FILE
    saved = torch.load(path, weights_only=True)
    saved["theta"][3] += 1e-3
    torch.save(saved, path)
    with pytest.raises(AuditError, match=r"lawa.pt: not the LAWA average of rounds 1..2"):
        _audit(tmp_path)
    path.unlink()
    with pytest.raises(AuditError, match=r"lawa.pt: missing"):
        _audit(tmp_path)


def _resign(tape: Path, change: Callable[[str, dict], dict | None]) -> None:  # type: ignore[type-arg]
    """Rebuild the aggregator's tape with its own key (valid signatures and chain), each
    body through ``change`` (None drops the entry)."""
    entries = verify_tape(tape, TRUSTED).entries
    tape.unlink()
    with TapeWriter.open(tape, CFG.run_id, KEYS[AGGREGATOR_KEY], checkpoint_every=0) as w:
        for e in entries:
            if e.kind == "checkpoint":
                w.checkpoint()
            elif (body := change(e.kind, dict(e.body))) is not None:
                w.append(e.kind, body)


def test_a_forged_average_signed_by_the_aggregator_is_recomputed_and_caught(
    tmp_path: Path,
) -> None:
    _close(_run(tmp_path))
    forged = "0" * 64

    def change(kind: str, body: dict) -> dict:  # type: ignore[type-arg]
        if kind == "lawa":
            body["average"] = forged
        return body

    _resign(tmp_path / "aggregator" / "tape", change)
    with pytest.raises(AuditError, match=f"recomputed average differs: tape has {forged}"):
        _audit(tmp_path)


def test_a_tape_without_its_lawa_entry_or_with_one_too_many_fails(tmp_path: Path) -> None:
    _close(_run(tmp_path))
    tape = tmp_path / "aggregator" / "tape"
    kept = verify_tape(tape, TRUSTED).entries
    _resign(tape, lambda kind, body: None if kind == "lawa" else body)
    with pytest.raises(AuditError, match="asks for LAWA over its last 2 global rounds, but"):
        _audit(tmp_path)
    # the same tape replayed under a configuration without LAWA: the entry has no place
    _, theta0 = initial_parameters(CFG)
    plain = CFG.with_overrides(lawa=0)
    replay = AggregatorReplay(
        AggregatorMachine(plain, theta0, TRUSTED),
        [e for e in kept if e.kind != "genesis"],
        PublishedFolder(tmp_path / "aggregator" / "published"),
    )
    with pytest.raises(ReplayError, match=r"a lawa entry but the run's configuration has no LAWA"):
        replay.advance()


def test_the_switch_is_taped_by_every_relay_and_the_aggregator(
    tmp_path: Path, reference: dict[str, tuple[str, str]]
) -> None:
    cluster = _run(tmp_path, cfg=ANNEAL)
    _close(cluster)
    assert _digests(cluster) == reference["anneal"] != reference["lawa"]
    for name in ("aggregator", "relay-a", "relay-b"):
        entries = verify_tape(tmp_path / name / "tape", TRUSTED).entries
        switches = [e for e in entries if e.kind == "anneal"]
        assert [e.body for e in switches] == [{"step": 8, "mode": "h_r1", "h_r": 1}], name
        before, after = entries[switches[0].seq - 1], entries[switches[0].seq + 1]
        assert before.kind == ("global_merge" if name == "aggregator" else "forward"), name
        assert before.body["sync_step"] == 8 and after.kind == "checkpoint", name
        if name != "aggregator":  # every step after the switch merges regionally
            merged = [e.body["sync_step"] for e in entries if e.kind == "regional_merge"]
            assert merged == [2, 4, 6, 8, 9, 10, 11, 12], name
    assert _audit(tmp_path, ANNEAL).startswith("audit OK: complete")


def test_the_decay_on_one_island_stops_the_others_and_its_relay_follows(
    tmp_path: Path, reference: dict[str, tuple[str, str]]
) -> None:
    cluster = _run(tmp_path, cfg=ISLANDS)
    _close(cluster)
    assert _digests(cluster) == reference["islands"]
    assert {n for n, i in cluster.islands.items() if i.core.step == 8} == {"a-1", "b-0", "b-1"}
    assert cluster.islands["a-0"].core.step == 12
    relay_b = verify_tape(tmp_path / "relay-b" / "tape", TRUSTED).entries
    assert [e.body["sync_step"] for e in relay_b if e.kind == "regional_merge"] == [2, 4, 6, 8]
    applied = [e.body for e in relay_b if e.kind == "global_applied"]
    assert [a["sync_step"] for a in applied] == [4, 8, 12] and "rejoined_from" in applied[-1]
    agg = verify_tape(tmp_path / "aggregator" / "tape", TRUSTED).entries
    members = [[m for m, _ in e.body["members"]] for e in agg if e.kind == "global_merge"]
    assert members == [["a", "b"], ["a", "b"], ["a"]]
    assert _audit(tmp_path, ISLANDS).startswith("audit OK: complete")


def test_the_anneal_modes_and_their_limits() -> None:
    assert RunConfig(anneal="islands:2").anneal_kept() == ("eu-0", "eu-1")
    assert RunConfig(anneal="h_r1").anneal_kept() is None
    assert RunConfig(anneal="islands:1").anneal_step == 160
    for bad, words in (
        ("islands:0", "K in islands:K must be an integer >= 1"),
        ("islands:x", "K in islands:K must be an integer >= 1"),
        ("islands:4", "K must be below the run's 4 islands"),
        ("few", "anneal must be one of full_m, h_r1, islands:K"),
    ):
        with pytest.raises(ConfigError, match=words):
            RunConfig(anneal=bad)
    with pytest.raises(ConfigError, match="does not work with standby islands or relay shards"):
        RunConfig.from_dict({"anneal": "islands:1", "topology": {"relay_shards": 2}})


def test_a_forged_switch_is_caught_by_the_replay(tmp_path: Path) -> None:
    _close(_run(tmp_path, cfg=ANNEAL))

    def change(kind: str, body: dict) -> dict:  # type: ignore[type-arg]
        if kind == "anneal":
            body["h_r"] = 2
        return body

    _resign(tmp_path / "aggregator" / "tape", change)
    # the checkpoints after it recorded the old tape head (a fork): a forger who also
    # controls the aggregator's disk drops them, and the replay still catches it
    with pytest.raises(AuditError, match="fork"):
        _audit(tmp_path, ANNEAL)
    shutil.rmtree(tmp_path / "aggregator" / "checkpoints")
    with pytest.raises(AuditError, match="recomputed h_r differs: tape has 2, replay gives 1"):
        _audit(tmp_path, ANNEAL)


CRASHES = [
    # (config, process, point, its n-th pass once the process's open step is >= from)
    ("lawa", "aggregator", "after_publish", 1, 12),  # completes the last round, untaped
    ("lawa", "aggregator", "after_publish", 2, 12),  # restarts from round 1's checkpoint,
    # which holds the sum so far
    ("lawa", "aggregator", "after_tape", 1, 12),  # the last merge taped, not checkpointed
    ("lawa", "aggregator", "between_checkpoints", 1, 12),
    ("lawa", "aggregator", "mid_write", 1, 12),  # the last checkpoint half written
    ("lawa", "aggregator", "mid_write", 2, 12),  # lawa.pt half written
    ("lawa", "aggregator", "before_rename", 1, 12),
    ("lawa", "aggregator", "before_rename", 2, 12),
    ("lawa", "aggregator", "before_lawa_entry", 1, 12),  # lawa.pt written, its entry not
    ("lawa", "aggregator", "before_seal", 1, 12),  # the lawa entry written, not sealed
    ("anneal", "aggregator", "before_anneal_entry", 1, 8),  # round 1 checkpointed, no switch
    ("anneal", "aggregator", "after_tape", 1, 8),  # the switch's round taped, not checkpointed
    ("anneal", "aggregator", "before_seal", 1, 12),  # the switch taped, not sealed
    ("anneal", "relay-a", "before_anneal_entry", 1, 8),  # forward taped, the switch not
    ("anneal", "relay-a", "before_seal", 2, 8),  # the switch taped, not sealed
    ("anneal", "relay-b", "relay_before_merge_entry", 2, 9),  # in the anneal
    ("islands", "aggregator", "before_anneal_entry", 1, 8),
    ("islands", "aggregator", "after_tape", 1, 12),  # the last round, of region a alone
    ("islands", "relay-a", "relay_before_merge_entry", 1, 10),  # a-0's first merge alone
    ("islands", "relay-b", "relay_after_checkpoint", 1, 9),  # the switch round: then it follows
]


@pytest.mark.parametrize(("which", "victim", "point", "nth", "from_step"), CRASHES)
def test_a_node_killed_around_the_switch_or_the_average_resumes_on_the_same_digests(
    tmp_path: Path,
    reference: dict[str, tuple[str, str]],
    which: str,
    victim: str,
    point: str,
    nth: int,
    from_step: int,
) -> None:
    """``victim`` dies the ``nth`` time it passes ``point`` once its open step is at least
    ``from_step``, is restarted from its folder, and the run ends on the fault-free final
    state and average, with tapes that audit clean."""
    cfg = CONFIGS[which]
    fired: list[str] = []
    holder: dict[str, Cluster] = {}
    seen = [0]  # across restarts: each start makes its store with a new hook

    def hook(name: str) -> Callable[[str], None]:
        def crash(p: str) -> None:
            cluster = holder.get("c")
            if name != victim or p != point or cluster is None:
                return
            if cluster.actors[name].node.machine.level.open_step < from_step:  # type: ignore[attr-defined]
                return
            seen[0] += 1
            if seen[0] == nth:
                fired.append(p)
                raise Crash(f"{name} at {p}")

        return crash

    cluster = holder["c"] = toy_cluster(cfg, tmp_path, KEYS, TRUSTED, hook)
    drive(cluster)
    assert fired == [point]
    assert _digests(cluster) == reference[which]
    _close(cluster)
    assert _audit(tmp_path, cfg).startswith("audit OK: complete")
