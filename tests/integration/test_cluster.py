"""The whole system as separate processes: daemons == in-process reference, bit for bit."""

from __future__ import annotations

import pytest

from hypertrain.common.config import RunConfig
from hypertrain.common.reference import run_reference

BASE = {
    "steps": 30,  # 3 global rounds
    "holdout_windows": 128,
    "regional_codec": "int8",
    "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    "outer": {"name": "nesterov", "eta": 0.7, "mu": 0.9},
}


def _cfg(**changes: object) -> RunConfig:
    return (
        RunConfig.from_dict(BASE).with_overrides(**changes)
        if changes
        else RunConfig.from_dict(BASE)
    )


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"topology.tau": 1},
        {"regional_codec": "sparseloco+zstd"},
    ],
    ids=["int8", "int8-tau1", "sparseloco"],
)
def test_daemons_match_the_reference_bit_for_bit(cluster_factory, changes: dict) -> None:  # type: ignore[no-untyped-def]
    cfg = _cfg(**changes)
    cluster = cluster_factory(cfg)
    failed = cluster.run_all(timeout_s=300)
    assert failed is None, failed.failure_message()
    progress = cluster.progress
    islands = progress.done
    assert sorted(islands) == list(cfg.topology.island_ids())
    digests = {e["digest"] for e in islands.values()}
    assert len(digests) == 1, f"islands disagree: {digests}"
    assert progress.final_digest in digests
    reference = run_reference(cfg)
    assert reference.final_digest == progress.final_digest, "daemons != in-process reference"
    assert progress.evals[cfg.steps] < progress.evals[0] - 0.5  # held-out loss drops
    assert progress.evals[cfg.steps] == pytest.approx(reference.final_loss, abs=1e-5)
    published = list((cluster.run_dir / "relay-eu" / "published").iterdir())
    assert len(published) == 2 * cfg.steps // cfg.topology.h_r  # every input kept under its digest
