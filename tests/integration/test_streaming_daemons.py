"""Streaming fragments with the real daemons (RunConfig.fragments, issue 16), alone and with
the anneal and LAWA (the README's recipe, ALL3; restarts at a fragment's switch): every relay
and the aggregator serve each fragment from a node and folder of its own, islands push
and fetch by fragment.  The daemons end on the same final state, bit for bit, as the
in-process run and the simulator's per-replica path, with tau = 0 and tau > 0 (and
with a merge pinned past the last step, taken before the final sync); the audit replays
every fragment and catches a changed input; a relay killed in a fragment round and an
island killed with merges of several fragments pending resume on the same state."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import state_digest
from hypertrain.common.reference import run_reference
from hypertrain.common.roles import initial_parameters
from hypertrain.common.trust.audit import AuditError, audit_run
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.ledger import flat_digest
from hypertrain.common.trust.tape import verify_tape
from hypertrain.sim.engine.job import SimJob
from hypertrain.sim.engine.run import run_job
from hypertrain.up import summary
from tests.integration.conftest import Cluster, finished_cluster
from tests.integration.test_crash import _trial as aggregator_trial
from tests.integration.test_relay_restart import _trial as relay_trial


def _cfg(fragments: int, tau: int, h_r: int, h_g: int, steps: int, regions: list[str]) -> RunConfig:
    return RunConfig.from_dict(
        {
            "steps": steps,
            "batch_per_island": 4,
            "holdout_windows": 16,
            "fragments": fragments,
            "topology": {
                "regions": regions,
                "islands_per_region": 2,
                "h_r": h_r,
                "h_g": h_g,
                "tau": tau,
            },
        }
    )


CONFIGS = {
    "f2-tau1": _cfg(2, 1, 2, 4, 8, ["r0", "r1"]),
    "f4-tau3-flush": _cfg(4, 3, 4, 8, 16, ["r0", "r1"]),
    "f3-tau0": _cfg(3, 0, 2, 6, 12, ["r0", "r1"]),
}
"""f4-tau3-flush: fragment 1 syncs at step 14 with its merge pinned to step 17, past the
last step 16: the islands take it before their final sync."""


@pytest.fixture(
    scope="module",
    params=["f2-tau1", "f4-tau3-flush", pytest.param("f3-tau0", marks=pytest.mark.slow)],
)
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunConfig, Cluster]:
    cfg = CONFIGS[request.param]
    return cfg, finished_cluster(cfg, tmp_path_factory.mktemp("streaming") / "run")


def _trusted(run_dir: Path) -> TrustedKeys:
    return TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")


def test_daemons_in_process_and_simulator_end_on_the_same_state(
    run: tuple[RunConfig, Cluster],
) -> None:
    cfg, cluster = run
    layout, _ = initial_parameters(cfg)
    ref = run_reference(cfg)
    job = SimJob.of_run(cfg, eval_points=1)
    sim = run_job(job.replace(path="per_replica"))
    assert sim.final_params is not None
    assert state_digest(layout.unflatten(sim.final_params)) == ref.final_digest
    digests = {e["digest"] for e in cluster.progress.done.values()}
    assert digests == {ref.final_digest} and cluster.progress.final_digest == ref.final_digest
    for node in ("aggregator", "relay-r0", "relay-r1"):
        got = sorted(p.name for p in (cluster.run_dir / node).iterdir() if p.is_dir())
        assert got == [f"fragment-{f}" for f in range(cfg.fragments)], node


def test_the_audit_replays_every_fragment_and_catches_a_changed_input(
    run: tuple[RunConfig, Cluster], tmp_path: Path
) -> None:
    cfg, cluster = run
    report = audit_run(cluster.run_dir, _trusted(cluster.run_dir))
    assert report.complete and report.fragments == cfg.fragments
    assert report.final_digest == cluster.progress.final_digest
    assert report.receipts > 0
    copy = tmp_path / "run"
    shutil.copytree(cluster.run_dir, copy)
    last = cfg.fragments - 1
    published = sorted((copy / "aggregator" / f"fragment-{last}" / "published").iterdir())
    data = bytearray(published[0].read_bytes())
    data[len(data) // 2] ^= 1
    published[0].write_bytes(bytes(data))
    with pytest.raises(AuditError, match=rf"aggregator/fragment-{last}/tape entry \d+ .*changed"):
        audit_run(copy, _trusted(copy))


RESTART = _cfg(2, 1, 2, 4, 12, ["eu", "us"])
"""3 global rounds of fragment 0 (the relay trial checks it reached round 2)."""


@pytest.fixture(scope="module")
def restart_digest() -> str:
    return run_reference(RESTART).final_digest


@pytest.mark.parametrize("fault", ["relay_before_merge_entry:3", "relay_after_checkpoint:2"])
def test_a_relay_killed_in_a_fragment_round_resumes_from_its_tapes(
    tmp_path: Path, restart_digest: str, fault: str
) -> None:
    """The relay of eu (both fragments' nodes in one process) dies at ``fault`` (counted
    over its fragments' nodes), restarts on the same port and folder, resumes each
    fragment from its own tape, and the run ends on the in-process state, auditing
    clean."""
    relay_trial(tmp_path, restart_digest, fault, RESTART)


@pytest.mark.parametrize("n", [3, 6])
def test_the_aggregator_killed_in_a_fragment_round_resumes_from_its_tapes(
    tmp_path: Path, restart_digest: str, n: int
) -> None:
    """The aggregator (every fragment's node in one process) dies the ``n``-th time it
    tapes a round, counted over its fragments' nodes (the 6th: the first of the two final
    rounds, the other fragment's still to come), restarts on the same port and folder,
    and the run ends on the in-process state, auditing clean."""
    aggregator_trial(tmp_path, "after_tape", n, restart_digest, RESTART)


def _killed_and_restarted(cfg: RunConfig, tmp_path: Path, island: str, marker: str) -> Cluster:
    """``cfg``'s cluster run to its end with ``island`` SIGKILLed once its log shows
    ``marker`` and started again, which resumes from its saved state."""
    cluster = Cluster(cfg, tmp_path / "run")
    try:
        again = cluster.kill_island_and_restart(island, lambda log: marker in log)
        assert "event=resumed" in again.log_path.read_text()
    finally:
        cluster.stop()
    return cluster


def test_a_killed_island_resumes_the_merges_it_waited_for(
    tmp_path: Path, restart_digest: str
) -> None:
    """SIGKILL island eu-1 right after fragment 0's global merge of step 4, while
    fragment 1's regional merge of step 4 (tau = 1) is pending; restarted, it resumes
    from its saved state with that merge pending, and the run ends on the reference."""
    cluster = _killed_and_restarted(RESTART, tmp_path, "eu-1", "step=4 kind=global fragment=0")
    digests = {e["digest"] for e in cluster.progress.done.values()}
    assert digests == {restart_digest}
    report = audit_run(cluster.run_dir, _trusted(cluster.run_dir))
    assert report.final_digest == restart_digest


# -- fragments with the anneal and LAWA: the whole recipe ---------------------------------------

ALL3 = _cfg(3, 1, 2, 4, 16, ["r0", "r1"]).with_overrides(anneal="islands:1", lawa=2)
"""Streaming in 3 fragments with one step of overlap, the decay on island r0-0 alone (each
fragment switches after its own last global sync at or before the decay's start: steps 12,
13 and 10; the other islands stop after step 13) and LAWA over each fragment's last 2
global rounds."""


@pytest.fixture(scope="module")
def all3(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    return finished_cluster(ALL3, tmp_path_factory.mktemp("all3") / "run")


def _lawa(run_dir: Path, cfg: RunConfig) -> torch.Tensor:
    """The LAWA average the aggregator published, its fragments' lawa.pt joined."""
    parts = [
        torch.load(run_dir / "aggregator" / f"fragment-{f}" / "lawa.pt", weights_only=True)
        for f in range(cfg.fragments)
    ]
    for part in parts:
        assert flat_digest(part["theta"]) == part["digest"]
    return torch.cat([p["theta"] for p in parts])


def test_fragments_the_anneal_and_lawa_together_match_in_process_and_simulator(
    all3: Cluster,
) -> None:
    cfg, run_dir = ALL3, all3.run_dir
    ref = run_reference(cfg)
    job = SimJob.of_run(cfg, path="per_replica", eval_points=1)
    sim = run_job(job)
    assert torch.equal(ref.final_params, sim.final_params)  # type: ignore[arg-type]
    assert ref.lawa_params is not None and sim.lawa_params is not None
    published = _lawa(run_dir, cfg)
    assert torch.equal(published, ref.lawa_params) and torch.equal(published, sim.lawa_params)
    done = all3.progress.done
    assert done["r0-0"]["digest"] == ref.final_digest == all3.progress.final_digest
    assert cfg.anneal_stop_step == 13
    assert {i: e["step"] for i, e in done.items() if i != "r0-0"} == dict.fromkeys(
        ("r0-1", "r1-0", "r1-1"), "13"
    )
    logged = all3.progress.lawa
    assert logged is not None and logged["digest"] == ref.lawa_digest
    assert logged["rounds"] == "f0 2..3, f1 3..4, f2 3..4"  # fragments 1, 2: one more round
    assert float(logged["heldout_loss"]) == round(ref.lawa_loss, 6)
    text, ok = summary(cfg, all3.progress, run_dir, 1.0)
    assert ok, text
    assert "anneal islands:1: r0-0 trained the decay; 3 islands stopped after step 13" in text
    assert f"held-out loss {ref.lawa_loss:.4f}, digest {ref.lawa_digest}" in text
    for f, start in enumerate((12, 13, 10)):
        for node in ("aggregator", "relay-r0", "relay-r1"):
            tape = run_dir / node / f"fragment-{f}" / "tape"
            switches = [e.body for e in verify_tape(tape, _trusted(run_dir)).entries
                        if e.kind == "anneal"]  # fmt: skip
            assert switches == [{"step": start, "mode": "islands:1", "h_r": 2, "fragment": f}]


def test_the_audit_recomputes_each_fragment_s_average_and_catches_a_changed_one(
    all3: Cluster, tmp_path: Path
) -> None:
    run_dir = all3.run_dir
    report = audit_run(run_dir, _trusted(run_dir))
    assert report.complete and report.fragments == 3
    assert report.final_digest == all3.progress.final_digest
    assert report.lawa_digest == all3.progress.lawa["digest"]  # type: ignore[index]
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    path = copy / "aggregator" / "fragment-2" / "lawa.pt"
    saved = torch.load(path, weights_only=True)
    saved["theta"] = saved["theta"].clone()
    saved["theta"][0] = 0.5
    torch.save(saved, path)
    with pytest.raises(
        AuditError, match=r"fragment-2/lawa\.pt: not the LAWA average of rounds 3\.\.4"
    ):
        audit_run(copy, _trusted(copy))


SWITCH = _cfg(2, 0, 2, 4, 12, ["eu", "us"]).with_overrides(anneal="h_r1", lawa=2)
"""Fragment 0 switches to H_r = 1 after step 8, fragment 1 after step 10."""


@pytest.fixture(scope="module")
def switch_digest() -> str:
    return run_reference(SWITCH).final_digest


def test_the_aggregator_killed_at_a_fragment_s_anneal_switch_resumes(
    tmp_path: Path, switch_digest: str
) -> None:
    """Killed after the checkpoint of fragment 1's anneal round (step 10), before the
    switch's tape entry (the 2nd switch over its fragments' nodes): the restarted
    aggregator tapes it, and the run ends on the in-process digest, auditing clean (its
    LAWA averages included)."""
    aggregator_trial(tmp_path, "before_anneal_entry", 2, switch_digest, SWITCH)


def test_the_aggregator_killed_after_taping_every_fragment_s_last_round_joins_them_again(
    tmp_path: Path, switch_digest: str
) -> None:
    """Killed right after it tapes the 7th and last of its fragments' rounds (fragment 0's
    3 and fragment 1's 4: both last rounds at step 12, their checkpoints deferred), the
    restarted aggregator redoes the last rounds from its tapes while it builds its
    fragments' nodes, and joins the final state and the LAWA averages only once every
    fragment's node exists (it crashed joining them before), then ends on the in-process
    digest."""
    aggregator_trial(tmp_path, "after_tape", 7, switch_digest, SWITCH)
    log = (tmp_path / "run" / "logs" / "aggregator-1.log").read_text()
    assert re.search(rf"event=final .*digest={switch_digest}", log), log[-3000:]
    ref = run_reference(SWITCH)
    assert re.search(rf"event=lawa .*digest={ref.lawa_digest}", log), log[-3000:]


def test_a_relay_killed_at_a_fragment_s_anneal_switch_resumes(
    tmp_path: Path, switch_digest: str
) -> None:
    relay_trial(tmp_path, switch_digest, "before_anneal_entry:1", SWITCH)


def test_an_island_killed_at_a_fragment_s_anneal_switch_resumes(
    tmp_path: Path, switch_digest: str
) -> None:
    """SIGKILL island us-0 right after fragment 0's global merge of step 8, the merge its
    switch to H_r = 1 follows (fragment 1's comes at step 10); restarted, it resumes from
    its saved state and the run ends on the in-process digest, auditing clean."""
    cluster = _killed_and_restarted(SWITCH, tmp_path, "us-0", "step=8 kind=global fragment=0")
    assert {e["digest"] for e in cluster.progress.done.values()} == {switch_digest}
    report = audit_run(cluster.run_dir, _trusted(cluster.run_dir))
    assert report.final_digest == switch_digest and report.lawa_digest


def test_an_island_the_anneal_stops_killed_between_two_fragments_starts_resumes(
    tmp_path: Path,
) -> None:
    """SIGKILL island r1-1 (the anneal stops it) right after fragment 2's global merge of
    step 10, where it left fragment 2, while it still trains fragments 0 and 1 to their
    starts (12 and 13); restarted, it pushes its last deltas from the same state: r0-0
    and the aggregator end on the in-process digest and LAWA average."""
    ref = run_reference(ALL3)
    cluster = _killed_and_restarted(ALL3, tmp_path, "r1-1", "step=10 kind=global fragment=2")
    done = cluster.progress.done
    assert done["r0-0"]["digest"] == ref.final_digest == cluster.progress.final_digest
    assert done["r1-1"]["step"] == "13"
    assert cluster.progress.lawa is not None
    assert cluster.progress.lawa["digest"] == ref.lawa_digest
    report = audit_run(cluster.run_dir, _trusted(cluster.run_dir))
    assert report.final_digest == ref.final_digest and report.lawa_digest == ref.lawa_digest
