"""Child-process supervision for ``hypertrain up`` (and the integration tests).

A :class:`Child` is one daemon started as a separate OS process: its stdout
and stderr go to a log file; every line is also parsed as logfmt
(``event=round step=40 loss=3.21``) and handed to a callback.  Children die
with their parent (PR_SET_PDEATHSIG on Linux), so a killed ``up`` never leaves
daemons behind.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from hypertrain.wire.daemon import die_with_parent

LISTEN_RE = re.compile(r"^hypertrain-(?P<role>[a-z]+) listening on (?P<address>\S+:\d+)$")
METRICS_RE = re.compile(r"^hypertrain-(?P<role>[a-z]+) metrics on (?P<url>http://\S+/metrics)$")
_PAIR_RE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_logfmt(line: str) -> dict[str, str]:
    """``k=v k2="quoted value"`` -> dict; lines without ``event=`` give {}."""
    fields = {k: v[1:-1] if v.startswith('"') else v for k, v in _PAIR_RE.findall(line)}
    return fields if "event" in fields else {}


def _preexec(nice: int) -> Callable[[], None]:
    def setup() -> None:
        die_with_parent()
        if nice:
            os.nice(nice)

    return setup


class Child:
    """One daemon process with its log file and parsed events."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        on_event: Callable[[str, dict[str, str]], None] | None = None,
        env: dict[str, str] | None = None,
        nice: int = 0,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=20)
        self.address: str | None = None
        self.metrics_url: str | None = None
        self._listening: queue.Queue[str] = queue.Queue()
        self._on_event = on_event
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w", buffering=1)  # noqa: SIM115 - closed by the reader
        self._log.write(f"# {shlex.join(self.argv)}\n")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
            preexec_fn=_preexec(nice) if sys.platform.startswith("linux") else None,
        )
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self._log.write(line + "\n")
            self.tail.append(line)
            m = LISTEN_RE.match(line)
            if m:
                self._listening.put(m.group("address"))
            mm = METRICS_RE.match(line)
            if mm:
                self.metrics_url = mm.group("url")
            event = parse_logfmt(line)
            if event and self._on_event:
                try:
                    self._on_event(self.name, event)
                except Exception as e:  # a watcher's bug must not stop the log (or the pipe)
                    self._log.write(f"# event handler failed on this line: {e!r}\n")
        self._log.close()

    def wait_listening(self, timeout: float = 180.0) -> str:
        """The address the daemon announced; raises RuntimeError if it died first."""
        if self.address is not None:
            return self.address
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.address = self._listening.get(timeout=0.1)
                return self.address
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._reader.join(timeout=2)
                    raise RuntimeError(self.failure_message()) from None
        raise RuntimeError(f"{self.name} did not announce its address within {timeout:.0f}s")

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout``) for the exited process's last lines to be logged
        and handled: its reader thread ends at the pipe's end of file.  False when it
        did not (a process it started still holds the pipe open)."""
        self._reader.join(timeout=timeout)
        return not self._reader.is_alive()

    def failure_message(self) -> str:
        code = self.proc.returncode
        how = (
            f"was killed by signal {-code}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        last = "\n    ".join(list(self.tail)[-8:]) or "(no output)"
        return f"{self.name} {how}; last lines of {self.log_path}:\n    {last}"

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-u", "-m", module, *args]


def torchrun(ranks: int, module: str, *args: str) -> list[str]:
    """``python -m module args`` as ``ranks`` data-parallel processes on this host.

    torchrun (``torch.distributed.run``) with a standalone rendezvous on a free local
    port; it forwards SIGTERM to its ranks and stops them all when one fails.
    """
    launcher = ("torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks))
    return [sys.executable, "-u", "-m", *launcher, "--module", module, *args]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
