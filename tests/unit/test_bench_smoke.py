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
    # values cut (fragment_cut = values, the default): F equal ranges, a quarter at F = 4
    assert "F = 4: island peak" in text and "(0.250 of F = 1)" in text, text


@pytest.mark.slow
def test_the_streaming_bench_runs_the_daemons_and_splits_their_blocked_time() -> None:
    text = _run(str(BENCH / "bench_streaming.py"), "--preset", "tiny", "--rounds", "2",
                "--daemons", "--topology", "1x1", "--repeats", "2", "--step-seconds", "0.05",
                timeout=1200)  # fmt: skip
    assert "2 runs per F" in text and "at its first merge" in text, text
    assert "islands paced to 0.05 s a step" in text, text


def test_the_streaming_bench_splits_an_island_s_blocked_time_from_its_log() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_streaming as bench
    finally:
        sys.path.remove(str(BENCH))
    log = (
        "event=sync role=island island=eu-0 step=30 kind=global bytes=8 blocked_s=0.25 x=1\n"
        "event=waiting role=island island=eu-0 message=m\n"
        "event=sync role=island island=eu-0 step=60 kind=global bytes=8 blocked_s=0.5 x=1\n"
        "event=done role=island island=eu-0 step=90 digest=d blocked_s=1.5 wall_s=9\n"
    )
    assert bench.blocked_parts(log) == (0.25, 0.25, 1.0)
    assert bench.blocked_parts(log.splitlines()[-1]) == (0.0, 0.0, 1.5)
    run = {"fragments": 4, "final_digest": "d", "push_peak_bytes": 8, "save_wait_s_max": None,
           "blocked_share_max": 0.04, "blocked_share_mean": 0.02, "blocked_start_s": 0.1,
           "blocked_rounds_s": 0.2, "blocked_end_s": 0.3, "seconds": 10.0,
           "start_skew_s_max": 0.5, "blocked_net_share_max": 0.01}  # fmt: skip
    two = bench.summarize_runs([run, run | {"blocked_share_max": 0.06, "seconds": 12.0}])
    assert two["blocked_share_max"] == pytest.approx(0.05) and two["seconds"] == 11.0
    assert two["blocked_share_max_runs"] == [0.04, 0.06] and two["runs"] == 2
    assert two["blocked_net_share_max_runs"] == [0.01, 0.01]
    with pytest.raises(SystemExit, match="final_digest differs"):
        bench.summarize_runs([run, run | {"final_digest": "e"}])
    # F = 4 against F = 1, repeat by repeat: mean difference and its standard error
    base = {"blocked_share_max_runs": [0.02, 0.03, 0.04]}
    four = {"blocked_share_max_runs": [0.03, 0.03, 0.05]}
    bench.paired(four, base)
    assert four["blocked_share_diff_runs"] == pytest.approx([0.01, 0.0, 0.01])
    assert four["blocked_share_diff_mean"] == pytest.approx(0.02 / 3)
    assert four["blocked_share_diff_se"] == pytest.approx((0.01**2 / 3 / 3) ** 0.5)
    # an island that started 2 s before the last waited those 2 s: not the sync's
    skew, net = bench.net_of_start_skew([2.5, 0.5], [102.0, 100.0])
    assert skew == pytest.approx(2.0) and net == pytest.approx(0.5 / 100.0)


@pytest.mark.slow
def test_the_cut_through_bench_runs_on_links_of_their_own(tmp_path: Path) -> None:
    """Network namespaces and rate-limited veth links (root, ip, tc): the sync with the
    relay's cut-through is faster than without it (by about one merge's link time)."""
    import json
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.fail("this bench needs root, ip and tc (network namespaces)")
    out = tmp_path / "out.json"
    _run(
        str(BENCH / "bench_cut_through.py"), "--params", "2e6", "--rate", "200mbit",
        "--repeats", "1", "--json", str(out), timeout=900,
    )  # fmt: skip
    got = json.loads(out.read_text())
    assert got["cut_through_over_whole"] < 0.95, got


def test_the_fresh_memory_bench_runs_and_writes_every_figure(tmp_path: Path) -> None:
    import json

    out = tmp_path / "fresh.json"
    text = _run(
        str(BENCH / "bench_fresh_memory.py"), "--size-mib", "8", "--repeat", "1",
        "--idle-s", "0", "--json", str(out), timeout=120,
    )  # fmt: skip
    doc = json.loads(out.read_text())
    assert "anon/resident" in text and doc["over_resident"]["anon/resident"] == 1.0
    assert set(doc["cpu_s"]) == {
        "anon/resident", "anon/fresh", "anon/populate", "anon/after-populate",
        "file/fresh", "file/prepare", "file/warm",
    }  # fmt: skip
