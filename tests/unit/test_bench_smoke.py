"""The benches still run: each one's smallest form, end to end, as a user would start it.

A bench is run by hand, so a refactor that renames what it calls breaks it silently
(``bench_tape.py``'s audit figure failed for sessions that way).  These run the small
forms: the training-step bench in the default suite, the audit bench (a real
``hypertrain up`` run and its audit) in the slow one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(*argv: str, timeout: float) -> str:
    out = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_the_training_step_bench_runs_and_checks_the_bits() -> None:
    text = _run(
        str(BENCH / "bench_train_step.py"), "--preset", "tiny", "--batch", "2", "--steps", "2",
        timeout=300,
    )  # fmt: skip
    assert "same parameters to the bit: True" in text, text


@pytest.mark.slow
def test_the_audit_bench_runs_with_its_breakdown(tmp_path: Path) -> None:
    text = _run(
        str(BENCH / "bench_tape.py"), "--quick", "--only", "audit",
        "--json", str(tmp_path / "out.json"), timeout=1200,
    )  # fmt: skip
    assert "baseline replay's final digest equals the audit's" in text, text
    assert "checkpoint files (positions)" in text, text


@pytest.mark.slow
def test_the_streaming_bench_runs_and_the_peak_falls_with_fragments() -> None:
    text = _run(str(BENCH / "bench_streaming.py"), "--preset", "tiny", "--rounds", "2",
                timeout=600)  # fmt: skip
    assert "F = 4: island peak" in text and "(0.277 of F = 1)" in text, text
