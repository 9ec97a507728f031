"""A robust regional rule through the real daemons: the same bits as the in-process run,
recorded in every regional merge entry, replayed by the audit, which names a changed
record."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hypertrain.common.config import RunConfig
from hypertrain.common.reference import run_reference
from hypertrain.common.trust.audit import AuditError, audit_run
from hypertrain.common.trust.keys import TrustedKeys, load_signing_key
from hypertrain.common.trust.tape import TapeWriter, verify_tape
from tests.integration.conftest import Cluster

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "holdout_windows": 16,
        "regional_codec": "int8",
        "topology": {"regions": ["eu"], "islands_per_region": 3, "h_r": 5, "h_g": 10},
        "robust": {"rule": "trimmed_mean", "trim": 1, "norm_median": 4.0},
    }
)


def test_trimmed_mean_daemons_match_the_in_process_run_and_the_audit(tmp_path: Path) -> None:
    cluster = Cluster(CFG, tmp_path / "run")
    try:
        failed = cluster.run_all(timeout_s=300)
        assert failed is None, failed.failure_message()
    finally:
        cluster.stop()
    run_dir = cluster.run_dir
    assert cluster.progress.final_digest == run_reference(CFG).final_digest
    trusted = TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")
    assert audit_run(run_dir, trusted).final_digest == cluster.progress.final_digest
    tape = run_dir / "relay-eu" / "tape"
    merges = [e.body for e in verify_tape(tape, trusted).entries if e.kind == "regional_merge"]
    assert len(merges) == CFG.steps // CFG.topology.h_r
    for body in merges:
        robust = body["robust"]
        assert robust["rule"] == "trimmed_mean" and robust["trim"] == 1
        assert sorted(robust["norms"]) == ["eu-0", "eu-1", "eu-2"]
        assert robust["left_out"] == [] and float(robust["bound"]) > 0

    # a relay that rewrites what its rule decided, even with its own key, is caught
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    tape = copy / "relay-eu" / "tape"
    records = verify_tape(tape, trusted).entries
    tape.unlink()
    key = load_signing_key(copy / "keys" / "relay-eu.key")
    with TapeWriter.open(tape, CFG.run_id, key, checkpoint_every=0) as w:
        for e in records:
            if e.kind == "checkpoint":
                w.checkpoint()
                continue
            body = dict(e.body)
            if e.kind == "regional_merge" and body["sync_step"] == 5:
                body["robust"] = dict(body["robust"], trim=0)
            w.append(e.kind, body)
    with pytest.raises(AuditError, match="fork"):  # against the checkpoint's recorded head
        audit_run(copy, trusted)
    # ... and with the checkpoints gone (a forger who also holds the relay's disk), the
    # replay finds the record its rule would not have made
    shutil.rmtree(copy / "relay-eu" / "checkpoints")
    with pytest.raises(AuditError, match="recomputed robust differs"):
        audit_run(copy, trusted)
