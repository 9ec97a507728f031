"""Prometheus metrics of the daemons (``--metrics-port``; port 0 picks a free one).

Names follow Prometheus conventions: ``hypertrain_`` prefix, base units in
the name (``_seconds``, ``_bytes``), ``_total`` for counters, histograms for
durations and sizes.  Labels: ``role`` on everything, ``region`` and
``island`` where they apply, ``level`` (regional | global) for traffic,
``reason`` (a decision code: invalid_argument, failed_precondition,
already_exists, data_loss, ...) for rejections.  Label values are bounded by
the topology, never by data.

The metrics server runs on its own thread (prometheus_client's HTTP server);
a scrape reads the registry and never touches training state, so serving
costs the training loop nothing but the scrape's CPU.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from hypertrain.common import VERSION
from hypertrain.wire.lines import write_line

DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
SIZE_BUCKETS = tuple(float(4**k) for k in range(5, 16))  # 1 KiB .. 1 GiB


class Metrics:
    """Every metric a daemon may export, in one registry (unused ones stay absent)."""

    def __init__(self, role: str) -> None:
        self.role = role
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Info("hypertrain_build", "hypertrain version and daemon role", registry=r).info(
            {"version": VERSION, "role": role}
        )
        isl = ["region", "island"]
        self.up = Gauge("hypertrain_up", "1 while the daemon serves its run", ["role"], registry=r)
        self.cert_expiry = Gauge(
            "hypertrain_tls_cert_expiry_timestamp_seconds",
            "When this daemon's TLS certificate expires (Unix time; absent in plaintext)",
            ["role"],
            registry=r,
        )
        self.inner_steps = Counter(
            "hypertrain_inner_steps_total", "Inner optimizer steps", isl, registry=r
        )
        self.tokens = Counter(
            "hypertrain_tokens_total", "Training tokens consumed", isl, registry=r
        )
        self.tokens_per_second = Gauge(
            "hypertrain_tokens_per_second",
            "Training tokens per second over the last sync interval",
            isl,
            registry=r,
        )
        self.train_loss = Gauge(
            "hypertrain_train_loss",
            "Mean training loss over the last sync interval",
            isl,
            registry=r,
        )
        # Labelled by role so that only the daemon that evaluates (the aggregator)
        # exports it: a label-less gauge would read 0 on every other daemon.
        self.heldout_loss = Gauge(
            "hypertrain_heldout_loss",
            "Held-out loss of the latest global state",
            ["role"],
            registry=r,
        )
        self.pseudo_grad_norm = Gauge(
            "hypertrain_pseudo_gradient_norm",
            "L2 norm of the last pseudo-gradient sent",
            isl,
            registry=r,
        )
        lvl = ["role", "level", "region"]
        self.sent_bytes = Counter(
            "hypertrain_sent_bytes_total", "Encoded delta bytes sent", lvl, registry=r
        )
        self.received_bytes = Counter(
            "hypertrain_received_bytes_total",
            "Encoded delta bytes received and accepted",
            lvl,
            registry=r,
        )
        self.delta_size = Histogram(
            "hypertrain_delta_size_bytes",
            "Size of one encoded delta",
            lvl,
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.compression_ratio = Gauge(
            "hypertrain_compression_ratio",
            "fp32 size over encoded size of the last delta",
            lvl,
            registry=r,
        )
        dur = ["role", "region"]
        self.encode_seconds = Histogram(
            "hypertrain_encode_seconds",
            "Delta encoding (with error feedback)",
            dur,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "hypertrain_decode_seconds",
            "Merge download and application",
            dur,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.aggregate_seconds = Histogram(
            "hypertrain_aggregation_seconds",
            "Fixed-order aggregation and commit of one round",
            dur,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.blocked_hist = Histogram(
            "hypertrain_sync_blocked_seconds",
            "Time an island waited for one merge (_sum: total time blocked)",
            isl,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.last_round = Gauge(
            "hypertrain_last_merge_round", "Global round of the last merge", dur, registry=r
        )
        self.last_step = Gauge(
            "hypertrain_last_merge_step", "Sync step of the last merge", dur, registry=r
        )
        self.members = Gauge(
            "hypertrain_round_members", "Members of the last committed round", dur, registry=r
        )
        self.rounds = Counter(
            "hypertrain_rounds_total", "Committed rounds", ["role", "region", "level"], registry=r
        )
        self.rejected = Counter(
            "hypertrain_rejected_inputs_total",
            "Deltas refused, by reason",
            ["role", "region", "reason"],
            registry=r,
        )
        self.untaped = Counter(
            "hypertrain_refusals_untaped_total",
            "Refusals not taped: transfers that were no delta, deltas not signed by their "
            "claimed sender's pinned key, and a sender's refusals past the per-round "
            "allowance of evidence",
            ["role", "region"],
            registry=r,
        )
        self.calls_refused = Counter(
            "hypertrain_calls_refused_total",
            "Calls refused past a caller's cap (per_peer) or ended by a bound on streaming "
            "calls (idle, slow)",
            ["role", "reason"],
            registry=r,
        )
        self.pushes_waiting = Gauge(
            "hypertrain_pushes_waiting",
            "Pushes waiting after their header for a reading slot (pushes_reading)",
            ["role"],
            registry=r,
        )
        self.stale_deltas = Counter(
            "hypertrain_stale_deltas_total",
            "Deltas this island sent after their sync step closed without it (not aggregated)",
            isl,
            registry=r,
        )
        self.member_changes = Counter(
            "hypertrain_member_changes_total",
            "Islands that joined or left this relay's region at run time",
            ["role", "region", "change"],
            registry=r,
        )
        self.region_members = Gauge(
            "hypertrain_region_members",
            "Members of this relay's region after its last join or leave",
            ["role", "region"],
            registry=r,
        )
        self.heals = Counter(
            "hypertrain_heals_total",
            "Times this island, left behind, rejoined from a later global merge",
            isl,
            registry=r,
        )
        self.cutoffs = Counter(
            "hypertrain_cutoffs_total", "Sync steps whose cutoff was reached", dur, registry=r
        )
        self.cutoff_to_commit = Histogram(
            "hypertrain_cutoff_to_commit_seconds",
            "From a step's cutoff to its commit (0 when the quorum was in at the cutoff)",
            dur,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.absent_streak = Gauge(
            "hypertrain_member_absent_rounds",
            "Sync steps in a row this member was absent from (0 once it delivers again)",
            ["role", "region", "member"],
            registry=r,
        )
        self.absent = Gauge(
            "hypertrain_round_absent_members",
            "Members absent from the last committed round (it went ahead at its cutoff)",
            dur,
            registry=r,
        )
        self.quorum_waiting = Gauge(
            "hypertrain_quorum_waiting",
            "1 while a sync step is past its cutoff without its quorum (nothing commits)",
            dur,
            registry=r,
        )
        self.tape_entries = Counter(
            "hypertrain_tape_entries_total", "Entries appended to the tape", dur, registry=r
        )
        self.tape_checkpoint = Gauge(
            "hypertrain_tape_last_checkpoint_size",
            "Tape size at the last signed checkpoint",
            dur,
            registry=r,
        )
        self.up.labels(role).set(1)

    def serve(self, port: int, host: str = "127.0.0.1") -> str:
        """Start the HTTP endpoint; returns "HOST:PORT" (the real port when ``port`` is 0)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return f"{host}:{server.server_port}"


def announce_metrics(role: str, address: str) -> None:
    """``hypertrain-<role> metrics on http://HOST:PORT/metrics`` (one line, flushed)."""
    write_line(f"hypertrain-{role} metrics on http://{address}/metrics")
