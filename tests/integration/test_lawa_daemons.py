"""LAWA with the real daemons (RunConfig.lawa): the aggregator process publishes the same
average, bit for bit, as the in-process run and the simulator's per-replica path; ``up``
reports it; the audit recomputes it from the tapes and catches a changed lawa.pt."""

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
from hypertrain.sim.engine.job import SimJob
from hypertrain.sim.engine.run import run_job
from hypertrain.up import summary
from tests.integration.conftest import Cluster, finished_cluster

CFG = RunConfig.from_dict(
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


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Cluster]:
    cluster = finished_cluster(CFG, tmp_path_factory.mktemp("lawa") / "run")
    return cluster.run_dir, cluster


def _trusted(run_dir: Path) -> TrustedKeys:
    return TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")


def test_daemons_in_process_and_simulator_publish_the_same_average(run) -> None:  # type: ignore[no-untyped-def]
    run_dir, cluster = run
    saved = torch.load(run_dir / "aggregator" / "lawa.pt", weights_only=True)
    ref = run_reference(CFG)
    sim = run_job(SimJob(run=CFG.with_overrides(lawa=0), path="per_replica", lawa_k=2))
    assert ref.lawa_params is not None and sim.lawa_params is not None
    assert torch.equal(saved["theta"], ref.lawa_params)
    assert torch.equal(saved["theta"], sim.lawa_params)
    assert flat_digest(saved["theta"]) == saved["digest"]
    assert (saved["first_round"], saved["last_round"]) == (1, 2)
    layout, _ = initial_parameters(CFG)
    logged = cluster.progress.lawa
    assert logged is not None and logged["rounds"] == "1..2"
    assert logged["digest"] == ref.lawa_digest == state_digest(layout.unflatten(saved["theta"]))
    assert cluster.progress.final_digest == ref.final_digest  # the islands' final state
    text, ok = summary(CFG, cluster.progress, run_dir, 1.0)
    assert ok and f"LAWA average of global rounds 1..2: digest {ref.lawa_digest}" in text


def test_the_audit_recomputes_the_average_and_catches_a_changed_file(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    run_dir, cluster = run
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
