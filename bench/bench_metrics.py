"""What serving Prometheus metrics costs an island: scrape-on vs scrape-off in one run.

    .venv/bin/python bench/bench_metrics.py --pairs 16 --json experiments/results/bench_metrics.json
    .venv/bin/python bench/bench_metrics.py --quick          # a smoke run

Issue 6, "Speed": serving metrics costs under 1% of an island's step time.

The loop is an island's (services/island/daemon.py): ``IslandCore.train_step`` on the
run's preset (``tiny``; one torch thread, as the daemon sets), with the metric updates the
daemon makes each step (inner steps, tokens) and at each sync step (train loss, tokens/s,
encode time, bytes sent, delta size, compression ratio, pseudo-gradient norm, time
blocked, decode time, last merge round and step), in a ``Metrics("island")`` registry
served on 127.0.0.1 by prometheus_client's HTTP server thread, as the daemon serves it.

Scrape on: a separate process (as Prometheus is) GETs ``/metrics`` every second by
default: the fastest interval hypertrain ships (``deploy/prometheus/prometheus.yml``,
the local cluster; Kubernetes scrapes every 15 s).  ``--period 0.1`` is a stress run.
Scrape off: nothing scrapes.  Blocks of steps alternate on/off (in ABBA order so drift
cancels), and the figure is total step time on / total step time off - 1; the median and
spread of the per-pair ratios show the noise of a shared machine.

Two figures that do not depend on that noise are printed alongside: the CPU one scrape
costs the island process (its process CPU time over 200 back-to-back scrapes while it
does nothing else), which times 10 scrapes per second is an upper bound on the share
of one core serving takes; and what the per-step metric updates cost next to a step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.data import SampleStream
from hypertrain.common.model import preset
from hypertrain.common.reference import open_dataset
from hypertrain.common.roles import IslandCore, initial_parameters
from hypertrain.common.schedule import Schedule
from hypertrain.wire.metrics import Metrics

SCRAPE_PERIOD_S = 1.0
TARGET = 0.01
#: What Prometheus 2.x asks for: prometheus_client then answers in OpenMetrics.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)

# The scraper: a separate process, one GET every period on a fixed schedule; one line per
# scrape ("<seconds> <bytes>"), "ready" after the first.
SCRAPER = r"""
import sys, time, urllib.request
url, period, accept = sys.argv[1], float(sys.argv[2]), sys.argv[3]
t = time.monotonic()
first = True
while True:
    t0 = time.perf_counter()
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=5) as r:
        n = len(r.read())
    print(f"{time.perf_counter() - t0:.6f} {n}", flush=True)
    if first:
        print("ready", flush=True)
        first = False
    t += period
    time.sleep(max(0.0, t - time.monotonic()))
"""


class Island:
    """An island's training loop and metric updates, without the network."""

    def __init__(self, cfg: RunConfig, island_id: str = "eu-0") -> None:
        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        mcfg = preset(cfg.model)
        stream = SampleStream(open_dataset(cfg), mcfg.seq_len, cfg.global_batch, cfg.seed)
        _, theta0 = initial_parameters(cfg)
        self.core = IslandCore(cfg, island_id, stream, theta0)
        self.numel = theta0.numel()
        self.m = Metrics("island")
        self.labels = {"region": self.core.region, "island": island_id}
        self.tokens_per_step = cfg.batch_per_island * mcfg.seq_len
        self.step = 0
        self.losses: list[float] = []
        self.blob_size = max(1, self.numel)  # int8: ~1 byte per parameter

    def serve(self) -> str:
        return self.m.serve(0)

    def run(self, steps: int) -> tuple[float, float, float]:
        """``steps`` island steps; returns their wall time, the process's CPU time (every
        thread: the metrics server's too) and the wall time of the metric updates."""
        t_start, c_start = time.perf_counter(), time.process_time()
        update_s = 0.0
        for _ in range(steps):
            self.step += 1
            self.losses.append(self.core.train_step())
            t0 = time.perf_counter()
            self._per_step()
            if self.step % self.cfg.topology.h_r == 0:
                self._per_sync()
            update_s += time.perf_counter() - t0
        return time.perf_counter() - t_start, time.process_time() - c_start, update_s

    def _per_step(self) -> None:
        m, labels = self.m, self.labels
        m.inner_steps.labels(**labels).inc()
        m.tokens.labels(**labels).inc(self.tokens_per_step)

    def _per_sync(self) -> None:
        m, labels, region = self.m, self.labels, self.core.region
        m.train_loss.labels(**labels).set(sum(self.losses) / len(self.losses))
        m.tokens_per_second.labels(**labels).set(1000.0)
        m.encode_seconds.labels("island", region).observe(0.003)
        m.sent_bytes.labels("island", "regional", region).inc(self.blob_size)
        m.delta_size.labels("island", "regional", region).observe(self.blob_size)
        m.compression_ratio.labels("island", "regional", region).set(4.0)
        m.pseudo_grad_norm.labels(**labels).set(self.core.last_delta_norm)
        m.blocked_hist.labels(**labels).observe(0.01)
        m.decode_seconds.labels("island", region).observe(0.002)
        m.last_step.labels("island", region).set(self.step)
        m.last_round.labels("island", region).set(Schedule.of(self.cfg).round_of(self.step))
        self.losses.clear()


class Scraper:
    """The scraping process; ``stop()`` returns the per-scrape latencies and body size."""

    def __init__(self, url: str, period: float = SCRAPE_PERIOD_S) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRAPER, url, str(period), PROMETHEUS_ACCEPT],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        for line in self.proc.stdout:
            if line.strip() == "ready":
                break
            self.lines.append(line)
        else:
            raise RuntimeError("the scraper ended before its first scrape")

    def stop(self) -> tuple[list[float], int]:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        rows = [ln.split() for ln in self.lines + out.splitlines() if ln.strip()]
        return [float(r[0]) for r in rows], int(rows[-1][1]) if rows else 0


def cpu_per_scrape(url: str, n: int = 200) -> float:
    """Process CPU seconds one scrape costs the serving process (nothing else running)."""
    urllib.request.urlopen(url, timeout=5).read()
    c0 = time.process_time()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, urllib.request as u\n"
            "q = u.Request(sys.argv[1], headers={'Accept': sys.argv[3]})\n"
            "for _ in range(int(sys.argv[2])): u.urlopen(q).read()",
            url,
            str(n),
            PROMETHEUS_ACCEPT,
        ],
        check=True,
    )
    return (time.process_time() - c0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few short blocks")
    ap.add_argument("--pairs", type=int, default=8, help="on/off block pairs")
    ap.add_argument("--block-steps", type=int, default=25, help="steps per block")
    ap.add_argument("--period", type=float, default=SCRAPE_PERIOD_S, help="seconds between scrapes")
    args = ap.parse_args()
    period = args.period
    pairs, block = (2, 10) if args.quick else (args.pairs, args.block_steps)

    cfg = RunConfig()
    island = Island(cfg)
    address = island.serve()
    url = f"http://{address}/metrics"
    island.run(2 * cfg.topology.h_r)  # warm-up; every label the daemon uses exists now

    blocks: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
    latencies: list[float] = []
    body = 0
    order = ["off", "on", "on", "off"]  # ABBA
    for i in range(2 * pairs):
        mode = order[i % 4]
        scraper = Scraper(url, period) if mode == "on" else None
        blocks[mode].append(island.run(block))
        if scraper is not None:
            lat, body = scraper.stop()
            latencies += lat

    n = block * pairs  # steps per mode
    wall = {k: sum(b[0] for b in v) / n for k, v in blocks.items()}
    cpu = {k: sum(b[1] for b in v) / n for k, v in blocks.items()}
    per_pair = [on[0] / off[0] - 1 for off, on in zip(blocks["off"], blocks["on"], strict=True)]
    overhead = wall["on"] / wall["off"] - 1
    cpu_overhead = cpu["on"] / cpu["off"] - 1
    updates = sum(b[2] for b in blocks["off"]) / n
    per_scrape = cpu_per_scrape(url)
    bound = {f"{p:g}s": per_scrape / p for p in (SCRAPE_PERIOD_S, 1.0, 15.0)}
    latency = statistics.median(latencies) if latencies else float("nan")
    result: dict[str, Any] = {
        "preset": cfg.model,
        "batch_per_island": cfg.batch_per_island,
        "threads": cfg.threads,
        "scrape_period_s": period,
        "exposition": "OpenMetrics (Prometheus' Accept header)",
        "pairs": pairs,
        "block_steps": block,
        "step_s_scrape_off": wall["off"],
        "step_s_scrape_on": wall["on"],
        "overhead": overhead,
        "overhead_per_pair_median": statistics.median(per_pair),
        "overhead_per_pair_min": min(per_pair),
        "overhead_per_pair_max": max(per_pair),
        "step_cpu_s_scrape_off": cpu["off"],
        "step_cpu_s_scrape_on": cpu["on"],
        "cpu_overhead": cpu_overhead,
        "scrapes": len(latencies),
        "scrape_latency_s_median": latency,
        "scrape_body_bytes": body,
        "cpu_s_per_scrape": per_scrape,
        "cpu_share_of_a_core_by_scrape_period": bound,
        "metric_updates_s_per_step": updates,
        "metric_updates_share_of_step": updates / wall["off"],
        "target": TARGET,
        "meets_target": overhead < TARGET,
        "cpu_count": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    print(
        f"island step ({cfg.model}, batch {cfg.batch_per_island}, {cfg.threads} torch thread): "
        f"{1e3 * wall['off']:.2f} ms scrape off, {1e3 * wall['on']:.2f} ms scrape on "
        f"(every {1e3 * period:.0f} ms: {len(latencies)} scrapes of "
        f"{body / 1024:.1f} KiB, median latency {1e3 * latency:.2f} ms)"
    )
    print(
        f"  serving metrics: {100 * overhead:+.2f}% of the step time (target < "
        f"{100 * TARGET:.0f}%: {'met' if overhead < TARGET else 'NOT met'}); per pair of "
        f"blocks median {100 * statistics.median(per_pair):+.2f}%, range "
        f"{100 * min(per_pair):+.2f}% .. {100 * max(per_pair):+.2f}%; island CPU per step "
        f"{100 * cpu_overhead:+.2f}%"
    )
    print(
        f"  one scrape costs the island {1e3 * per_scrape:.2f} ms CPU: at most "
        + ", ".join(f"{100 * v:.3f}% of a core scraped every {k}" for k, v in bound.items())
        + f"; metric updates {1e6 * updates:.1f} us per step "
        f"({100 * updates / wall['off']:.3f}% of a step); load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
