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
        # fp32: each island's delta is computed and sent in its base's memory, and the
        # merge, fetched ahead while it trains on, received there (IslandCore.frame_base)
        {"regional_codec": "fp32", "topology.tau": 1},
    ],
    ids=["int8", "int8-tau1", "sparseloco", "fp32-tau1"],
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


@pytest.mark.parametrize(
    "changes",
    [
        {"topology.relay_shards": 2},
        {"topology.relay_shards": 3, "regional_codec": "sparseloco+zstd", "global_codec": "int8"},
    ],
    ids=["int8-2shards", "sparseloco-int8-3shards"],
)
def test_sharded_relays_match_one_relay_per_region_bit_for_bit(
    cluster_factory, changes: dict
) -> None:  # type: ignore[no-untyped-def]
    """S relay processes per region (``--shard i/S``) end on the digest of one relay per
    region (the in-process run with S = 1), and the run audits clean whole and from a
    round's checkpoints: the tapes record each shard and the audit replays them."""
    from hypertrain.common.trust.audit import audit_run
    from hypertrain.common.trust.keys import TrustedKeys

    cfg = _cfg(**changes)
    shards = cfg.topology.relay_shards
    cluster = cluster_factory(cfg)
    failed = cluster.run_all(timeout_s=300)
    assert failed is None, failed.failure_message()
    progress = cluster.progress
    digests = {e["digest"] for e in progress.done.values()}
    assert len(progress.done) == cfg.topology.n_islands and len(digests) == 1, digests
    unsharded = run_reference(cfg.with_overrides(**{"topology.relay_shards": 1}))
    assert progress.final_digest == unsharded.final_digest, "sharded daemons != one relay"
    for i in range(shards):  # each shard kept its part of every island's delta
        published = list((cluster.run_dir / f"relay-eu-{i}" / "published").iterdir())
        assert len(published) == 2 * cfg.steps // cfg.topology.h_r
    log = (cluster.run_dir / "logs" / f"relay-eu-{shards - 1}.log").read_text()
    assert f"event=round role=relay region=eu shard={shards - 1}/{shards} " in log, log
    assert "rss_mib=" in log and "peak_mib=" in log  # each round's memory
    trusted = TrustedKeys.load(cluster.run_dir / "keys" / "trusted_keys.json")
    whole = audit_run(cluster.run_dir, trusted)
    segment = audit_run(cluster.run_dir, trusted, from_round=1)
    assert whole.final_digest == segment.final_digest == progress.final_digest
