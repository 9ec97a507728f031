"""``hypertrain up`` end to end: the default run, a killed island, daemon CLIs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hypertrain.procs import LISTEN_RE, child_env
from tests.conftest import proc_state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return proc_state(pid) not in (None, "Z")  # a zombie is gone for our purposes


def _pids(run_dir: Path) -> dict[str, int]:
    lines = (run_dir / "processes.txt").read_text().split("\n")
    return {name: int(pid) for name, pid in (ln.split() for ln in lines if ln)}


def test_up_with_its_defaults_runs_to_the_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "hypertrain", "up", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    m = re.search(r"held-out loss ([0-9.]+) -> ([0-9.]+)", text)
    assert m and float(m.group(2)) < float(m.group(1)) - 1.0, text
    assert "all islands and the aggregator agree" in text
    assert re.search(
        r"bytes per island per sync [0-9.]+ KiB \(int8; [0-9.]+x smaller than fp32", text
    )
    assert (run_dir / "aggregator" / "state.pt").is_file()
    assert not any(_alive(pid) for pid in _pids(run_dir).values())


def test_a_killed_island_stops_every_process_with_a_clear_message(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    up = subprocess.Popen(
        [sys.executable, "-m", "hypertrain", "up", "--run-dir", str(run_dir), "--steps", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        log = run_dir / "logs" / "island-eu-1.log"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            log.exists() and "event=sync" in log.read_text()
        ):
            time.sleep(0.2)
        assert log.exists() and "event=sync" in log.read_text(), "island never synced"
        pids = _pids(run_dir)
        os.kill(pids["island-eu-1"], signal.SIGKILL)
        _, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode not in (0, None)
    assert "island-eu-1 was killed by signal 9" in err, err
    assert "stopped every other process" in err
    survivors = [name for name, pid in pids.items() if _alive(pid)]
    assert not survivors, f"still running: {survivors}"


@pytest.mark.parametrize("role", ["island", "relay", "aggregator"])
def test_daemon_help_and_bad_flags(role: str) -> None:
    help_out = subprocess.run(
        [sys.executable, "-m", f"hypertrain.{role}", "--help"], capture_output=True, text=True
    )
    assert help_out.returncode == 0 and "--listen" in help_out.stdout
    region = [] if role == "aggregator" else ["--region", "eu"]
    bad = subprocess.run(
        [sys.executable, "-m", f"hypertrain.{role}", "--steps", "7", *region],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith(f"hypertrain-{role}: error:")
        and "steps" in lines[0]
    )


def test_sigterm_stops_a_daemon_cleanly(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hypertrain.aggregator",
            "--insecure",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(tmp_path / "agg"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    while line.startswith("event="):
        line = proc.stdout.readline().strip()
    assert LISTEN_RE.match(line), line
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("mode,words", [(0o644, "readable by group/others"), (0o000, "")])
def test_daemon_refuses_a_bad_signing_key(tmp_path: Path, mode: int, words: str) -> None:
    from hypertrain.common.trust.keys import init_keys

    init_keys(tmp_path / "keys", ["aggregator"])
    key = tmp_path / "keys" / "aggregator.key"
    key.chmod(mode)
    if mode == 0 and os.geteuid() == 0:
        key.unlink()  # root reads any mode: test the missing key instead
        words = "aggregator.key"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hypertrain.aggregator",
            "--insecure",
            "--signing-key",
            str(key),
            "--state-dir",
            str(tmp_path / "agg"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hypertrain-aggregator: error:"), out.stderr
    assert words in lines[0]


def test_island_ranks_that_do_not_split_the_batch_are_refused(tmp_path: Path) -> None:
    """`up --island-ranks K`: each rank takes batch_per_island / K rows, so K must
    divide it; otherwise one readable line and exit 2, before any process starts."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hypertrain", "up", "--island-ranks", "3"]
    done = subprocess.run(
        [*argv, "--run-dir", str(run_dir)], capture_output=True, text=True, env=child_env()
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (
        "hypertrain up: error: --island-ranks 3 must be >= 1 and divide batch_per_island 32"
    )
    assert not (run_dir / "processes.txt").exists()
