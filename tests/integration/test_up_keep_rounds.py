"""``hypertrain up --keep-rounds K`` as a user runs it: the relays and the aggregator keep
only their newest K global rounds, the run ends on every daemon's agreed digest, the whole
audit names the round to start from, and the segment audit from there passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypertrain.common.rounds.store import PRUNED_FILE, checkpoints_of
from hypertrain.procs import child_env

# 4 global rounds of 2 regional steps, small enough for two cores.
FLAGS = ["--steps", "16", "--h-r", "2", "--h-g", "4", "--holdout-windows", "4", "--batch", "4"]


def _hypertrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hypertrain", *args],
        capture_output=True,
        text=True,
        timeout=400,
        env=child_env(),
    )


def test_up_keep_rounds_prunes_every_node_and_the_run_audits_from_the_oldest_kept(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    out = _hypertrain("up", "--keep-rounds", "2", "--quiet", *FLAGS, "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(all islands and the aggregator agree)" in out.stdout
    nodes = [run_dir / "aggregator", *sorted(run_dir.glob("relay-*"))]
    assert len(nodes) == 3  # the aggregator and the default's two regions' relays
    for node in nodes:
        assert list(checkpoints_of(node)) == [2, 3], node
        assert (node / PRUNED_FILE).is_file(), node
    whole = _hypertrain("audit", str(run_dir))
    assert whole.returncode == 1 and "--from-round 2`" in whole.stdout, whole.stdout
    segment = _hypertrain("audit", str(run_dir), "--from-round", "2")
    assert segment.returncode == 0, segment.stdout + segment.stderr
    assert segment.stdout.startswith("audit OK: complete, segment rounds 3..3 of 4 ")


def test_up_refuses_keep_rounds_below_the_minimum_before_it_writes_anything(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    out = _hypertrain("up", "--keep-rounds", "1", *FLAGS, "--run-dir", str(run_dir))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "hypertrain up: error: keep_rounds must be 0 (keep every round) or at least 2 (the "
        "newest round, and the one before, which the last completed round starts from), got 1"
    ]
    assert not run_dir.exists()
