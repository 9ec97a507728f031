"""scripts/gpu_check.sh, the GPU checks in one command: on a machine without a GPU it says so
in one line and exits 2; its CPU dry run (GPU_CHECK_DEVICE=cpu) runs every part, shortened
(the device check, the simulator bench's M sweep, a two-rank island on gloo), and writes the
one JSON of results the GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=900,
        env={**os.environ, **env}, check=False,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    r = _run(tmp_path / "out")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        "gpu_check: no CUDA device is visible here (torch.cuda.is_available() is False): "
        "nothing to check; run it on a machine with an NVIDIA GPU"
    )
    assert not (tmp_path / "out").exists()
    bad = _run(tmp_path / "out", GPU_CHECK_DEVICE="tpu")
    assert bad.returncode == 2 and "GPU_CHECK_DEVICE must be cuda or cpu" in bad.stderr


def test_the_cpu_dry_run_runs_every_part_and_writes_one_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = _run(out, GPU_CHECK_DEVICE="cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["device"] == "cpu" and result["passed"] is True
    parts = result["parts"]
    check = parts["device_check"]
    assert check["passed"] and check["report"]["rows"], check
    bench = parts["bench_sim"]["result"]
    assert sorted(bench["per_m"]) == ["1", "2"] and set(bench["speedup_by_m"]) == {"1", "2"}
    assert result["targets"] == bench["targets"] and "speedup_m2_ge_3" in bench["targets"]
    two = parts["two_rank_island"]
    assert two["passed"] and not two["skipped"] and two["final_digest"]
    done = (out / "two-ranks" / "logs" / "island-eu-0.log").read_text()
    assert "event=done" in done and "ranks=2" in done
    assert f"final state digest {two['final_digest']}" in (out / "two_ranks.log").read_text()
