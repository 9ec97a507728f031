"""Streaming fragments with the real daemons (RunConfig.fragments, issue 16): every relay
and the aggregator serve each fragment from a node and folder of its own, islands push
and fetch by fragment.  The daemons end on the same final state, bit for bit, as the
in-process run and the simulator's per-replica path, with tau = 0 and tau > 0 (and
with a merge pinned past the last step, taken before the final sync); the audit replays
every fragment and catches a changed input; a relay killed in a fragment round and an
island killed with merges of several fragments pending resume on the same state."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hypertrain.common.config import RunConfig
from hypertrain.common.digest import state_digest
from hypertrain.common.reference import run_reference
from hypertrain.common.roles import initial_parameters
from hypertrain.common.trust.audit import AuditError, audit_run
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.sim.engine.job import SimJob
from hypertrain.sim.engine.run import run_job
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
    job = SimJob(run=cfg.with_overrides(fragments=1), eval_points=1, fragments=cfg.fragments)
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


def test_a_killed_island_resumes_the_merges_it_waited_for(
    tmp_path: Path, restart_digest: str
) -> None:
    """SIGKILL island eu-1 right after fragment 0's global merge of step 4, while
    fragment 1's regional merge of step 4 (tau = 1) is pending; restarted, it resumes
    from its saved state with that merge pending, and the run ends on the reference."""
    cluster = Cluster(RESTART, tmp_path / "run")
    try:
        again = cluster.kill_island_and_restart(
            "eu-1", lambda log: "step=4 kind=global fragment=0" in log
        )
        assert "event=resumed" in again.log_path.read_text()
    finally:
        cluster.stop()
    digests = {e["digest"] for e in cluster.progress.done.values()}
    assert digests == {restart_digest}
    report = audit_run(cluster.run_dir, _trusted(cluster.run_dir))
    assert report.final_digest == restart_digest
