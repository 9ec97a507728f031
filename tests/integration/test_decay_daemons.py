"""The decay phase with the real daemons: LAWA (RunConfig.lawa) and the anneal at H_r = 1 or
on the first islands (RunConfig.anneal), alone and together.  The daemons end on the same final state and
publish the same average, bit for bit, as the in-process run and the simulator's
per-replica path; ``up`` reports the average; the audit replays the switch and recomputes
the average from the tapes, and catches a changed lawa.pt.  (Restarts during the switch:
tests/integration/test_crash.py and test_relay_restart.py.)"""

from __future__ import annotations

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

LAWA = RunConfig.from_dict(
    {
        "steps": 12,  # 3 global rounds; the average of the last 2
        "batch_per_island": 4,
        "holdout_windows": 16,
        "lawa": 2,
        "topology": {
            "regions": ["r0", "r1"],
            "islands_per_region": 1,
            "h_r": 2,
            "h_g": 4,
            "tau": 1,
        },
    }
)
BOTH = LAWA.with_overrides(
    anneal="h_r1", **{"topology.tau": 0, "topology.islands_per_region": 2}
)  # 2 x 2 islands; every step syncs after step 8 (decay 0.2 of 12 steps)
ISLANDS = BOTH.with_overrides(anneal="islands:2")
"""The decay on the first two islands, r0-0 and r0-1: r1's stop after step 8 and its relay
follows the global rounds."""
CONFIGS = {"lawa": LAWA, "anneal+lawa": BOTH, "islands+lawa": ISLANDS}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("lawa", marks=pytest.mark.slow),  # both others run LAWA too
        "anneal+lawa",
        "islands+lawa",
    ],
)
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunConfig, Cluster]:
    cfg = CONFIGS[request.param]
    return cfg, finished_cluster(cfg, tmp_path_factory.mktemp("decay") / "run")


def _trusted(run_dir: Path) -> TrustedKeys:
    return TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")


def test_daemons_in_process_and_simulator_end_on_the_same_state_and_average(run) -> None:  # type: ignore[no-untyped-def]
    cfg, cluster = run
    run_dir = cluster.run_dir
    saved = torch.load(run_dir / "aggregator" / "lawa.pt", weights_only=True)
    ref = run_reference(cfg)
    job = SimJob.of_run(cfg, path="per_replica")
    sim = run_job(job)
    assert ref.lawa_params is not None and sim.lawa_params is not None
    assert torch.equal(saved["theta"], ref.lawa_params)
    assert torch.equal(saved["theta"], sim.lawa_params)
    assert torch.equal(ref.final_params, sim.final_params)  # type: ignore[arg-type]
    assert flat_digest(saved["theta"]) == saved["digest"]
    assert (saved["first_round"], saved["last_round"]) == (1, 2)
    layout, _ = initial_parameters(cfg)
    logged = cluster.progress.lawa
    assert logged is not None and logged["rounds"] == "1..2"
    assert logged["digest"] == ref.lawa_digest == state_digest(layout.unflatten(saved["theta"]))
    assert cluster.progress.final_digest == ref.final_digest  # the islands' final state
    kept = cfg.anneal_kept() or cfg.topology.island_ids()
    done = cluster.progress.done
    assert {e["digest"] for i, e in done.items() if i in kept} == {ref.final_digest}
    stopped = {i: e for i, e in done.items() if i not in kept}  # after their push of step 8
    assert sorted(stopped) == sorted(set(cfg.topology.island_ids()) - set(kept))
    assert all(e["step"] == "8" for e in stopped.values())
    text, ok = summary(cfg, cluster.progress, run_dir, 1.0)
    assert float(logged["heldout_loss"]) == round(ref.lawa_loss, 6)  # event=eval_lawa
    lawa_line = f"LAWA average of global rounds 1..2: held-out loss {ref.lawa_loss:.4f}, digest "
    assert ok and lawa_line + ref.lawa_digest in text
    if stopped:
        assert (
            "anneal islands:2: r0-0, r0-1 trained the decay; 2 islands stopped after step 8" in text
        )
    switches = [
        e.body
        for name in ("aggregator", "relay-r0", "relay-r1")
        for e in verify_tape(run_dir / name / "tape", _trusted(run_dir)).entries
        if e.kind == "anneal"
    ]
    h_r = 1 if cfg.anneal == "h_r1" else cfg.topology.h_r
    want = [{"step": 8, "mode": cfg.anneal, "h_r": h_r}] * 3 if cfg.anneal != "full_m" else []
    assert switches == want


def test_the_audit_replays_both_and_catches_a_changed_average(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, cluster = run
    run_dir = cluster.run_dir
    report = audit_run(run_dir, _trusted(run_dir))
    assert report.lawa_digest == cluster.progress.lawa["digest"]
    assert report.summary().startswith("audit OK: complete")
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    saved = torch.load(copy / "aggregator" / "lawa.pt", weights_only=True)
    saved["theta"] = saved["theta"].clone()
    saved["theta"][0] = 0.5
    torch.save(saved, copy / "aggregator" / "lawa.pt")
    with pytest.raises(AuditError, match=r"lawa\.pt: not the LAWA average of rounds 1\.\.2"):
        audit_run(copy, _trusted(copy))
