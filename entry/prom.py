"""A local Prometheus for ``hypertrain up --prometheus``: scrapes the run's daemons.

``start_prometheus(run_dir)`` finds the ``prometheus`` binary (``$HYPERTRAIN_PROMETHEUS``,
else ``PATH``; Debian/Ubuntu: ``apt-get install prometheus``), writes
``<run_dir>/prometheus/prometheus.yml`` (file_sd on ``<run_dir>/scrape_targets.json``,
the targets ``hypertrain up`` writes, and the alert and recording rules of
``deploy/prometheus/rules/``, copied into ``<run_dir>/prometheus/rules/``), and starts
it on 127.0.0.1 with a free port and its storage in ``<run_dir>/prometheus/data``;
its log is ``<run_dir>/logs/prometheus.log``.  It dies with its parent, like the
daemons.  The storage outlives the run: ``restart_command`` reopens it afterwards.

The scrape configuration is the one of ``deploy/prometheus/prometheus.yml`` with
absolute paths (a test keeps the two equal): scrape and rule evaluation every
second (a local run lasts minutes; seven loopback targets cost nothing to
scrape), and ``honor_labels`` so the daemons' own ``region``/``island`` labels stay
as they are while the target labels fill them in where a series has none.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypertrain.procs import Child, child_env

#: deploy/prometheus of a source checkout (the editable install's layout).
DEPLOY_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULE_FILES = ("hypertrain.rules.yml",)
SCRAPE_INTERVAL = "1s"
READY_TIMEOUT_S = 60.0


def prometheus_config(targets: Path | str, rule_files: list[str]) -> dict[str, Any]:
    """The local-cluster configuration (``deploy/prometheus/prometheus.yml`` as data)."""
    return {
        "global": {
            "scrape_interval": SCRAPE_INTERVAL,
            "scrape_timeout": SCRAPE_INTERVAL,
            "evaluation_interval": SCRAPE_INTERVAL,
        },
        "rule_files": list(rule_files),
        "scrape_configs": [
            {
                "job_name": "hypertrain",
                "honor_labels": True,
                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "5s"}],
            }
        ],
    }


def find_prometheus() -> str | None:
    """The ``prometheus`` binary: ``$HYPERTRAIN_PROMETHEUS``, else the one on PATH."""
    env = os.environ.get("HYPERTRAIN_PROMETHEUS")
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("prometheus")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_config(run_dir: Path) -> Path:
    """``<run_dir>/prometheus/prometheus.yml`` and its rules; returns the config's path."""
    prom_dir = run_dir / "prometheus"
    rules_dir = prom_dir / "rules"
    rules_dir.mkdir(parents=True, exist_ok=True)
    rules = []
    for name in RULE_FILES:
        src = DEPLOY_DIR / "rules" / name
        if src.is_file():
            shutil.copyfile(src, rules_dir / name)
            rules.append(str(rules_dir / name))
    config = prom_dir / "prometheus.yml"
    # JSON is YAML: no YAML writer needed.
    cfg = prometheus_config(run_dir / "scrape_targets.json", rules)
    config.write_text(json.dumps(cfg, indent=2) + "\n")
    return config


@dataclass
class PromHandle:
    """A running local Prometheus (``url`` like ``http://127.0.0.1:PORT``)."""

    url: str
    config: Path
    data_dir: Path
    rules: list[Path]
    child: Child
    binary: str

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def restart_command(self) -> str:
        """A shell command that reopens this run's metrics after the run."""
        return shlex.join(
            [
                self.binary,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.data_dir}",
                "--web.listen-address=127.0.0.1:9090",
            ]
        )

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; idempotent."""
        self.child.stop(grace=grace)


def start_prometheus(
    run_dir: Path, *, quiet: bool = False, timeout_s: float = READY_TIMEOUT_S
) -> PromHandle | None:
    """Start a Prometheus on loopback scraping ``run_dir``'s daemons; None without a binary.

    Raises RuntimeError when the binary is there but Prometheus does not come up
    (its log's last lines say why)."""
    binary = find_prometheus()
    if binary is None:
        print(
            "hypertrain up: --prometheus: no `prometheus` binary found (Debian/Ubuntu: "
            "apt-get install prometheus; or set HYPERTRAIN_PROMETHEUS=/path/to/prometheus); "
            f"continuing without it. The daemons' metrics are listed in "
            f"{run_dir / 'scrape_targets.json'}",
            file=sys.stderr,
            flush=True,
        )
        return None
    config = write_config(run_dir)
    data_dir = run_dir / "prometheus" / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    rules = [Path(p) for p in json.loads(config.read_text())["rule_files"]]
    if not rules:
        print(
            f"hypertrain up: --prometheus: no alert rules at {DEPLOY_DIR / 'rules'}; "
            "scraping without them",
            file=sys.stderr,
            flush=True,
        )
    last_error = ""
    for _ in range(3):  # the free port may be taken before Prometheus binds it
        port = free_port()
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=30d",
        ]
        child = Child("prometheus", argv, run_dir / "logs" / "prometheus.log", env=child_env())
        handle = PromHandle(f"http://127.0.0.1:{port}", config, data_dir, rules, child, binary)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and child.proc.poll() is None:
            if handle.ready():
                if not quiet:
                    print(
                        f"  prometheus on {handle.url} (config {config}; log "
                        f"{child.log_path}); it stops with the run, its data stays in "
                        f"{data_dir}",
                        flush=True,
                    )
                return handle
            time.sleep(0.1)
        handle.stop(grace=5)
        last_error = child.failure_message()
        with contextlib.suppress(OSError):
            if "address already in use" not in child.log_path.read_text():
                break
    raise RuntimeError(f"prometheus did not start: {last_error}")
