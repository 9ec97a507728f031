"""The crash-test hook ``daemon.fault_point``, in real child processes: the n-th pass
of the named point SIGKILLs the process, or SIGSTOPs it (``:stop``) until SIGCONT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import proc_state

PASSES = (
    "from hypertrain.wire.daemon import fault_point\n"
    "for i in range(3):\n"
    "    fault_point('other')\n"
    "    print('before', i, flush=True)\n"
    "    fault_point('here')\n"
    "print('end', flush=True)\n"
)


def _run(spec: str) -> subprocess.Popen[str]:
    env = dict(os.environ, HYPERTRAIN_FAULT=spec)
    return subprocess.Popen(
        [sys.executable, "-c", PASSES], env=env, stdout=subprocess.PIPE, text=True
    )


def test_the_nth_pass_kills_the_process() -> None:
    proc = _run("here:2")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert out.split("\n")[:2] == ["before 0", "before 1"] and "end" not in out


def test_stop_stops_it_at_the_nth_pass_until_it_is_continued() -> None:
    proc = _run("here:2:stop")
    assert proc.stdout is not None
    assert [proc.stdout.readline() for _ in range(2)] == ["before 0\n", "before 1\n"]
    deadline = time.monotonic() + 60
    while proc_state(proc.pid) != "T":
        assert time.monotonic() < deadline, "never stopped"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "before 2\nend\n"


def test_unset_or_another_point_is_a_no_op() -> None:
    for spec in ("", "elsewhere:1"):
        proc = _run(spec)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.endswith("end\n"), spec


def test_an_unknown_action_is_an_error_naming_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PASSES],
        env=dict(os.environ, HYPERTRAIN_FAULT="here:1:pause"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "HYPERTRAIN_FAULT 'here:1:pause': the action must be kill or stop" in proc.stderr
