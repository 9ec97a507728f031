"""hypertrain-aggregator (``python -m hypertrain.aggregator``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hypertrain.aggregator.server import AggregatorService
from hypertrain.common.errors import HypertrainError
from hypertrain.wire.daemon import (
    daemon_parser,
    fail,
    load_identity,
    load_run_config,
    log_event,
    section,
    setting,
    start_metrics,
)
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.server import (
    Shutdown,
    add_servicer,
    announce,
    bind,
    make_server,
    run_until_signal,
)


def main(argv: Sequence[str] | None = None) -> int:
    p = daemon_parser("aggregator", "Hold the global state; apply the outer optimizer.")
    args = p.parse_args(argv)
    try:
        cfg = load_run_config(args)
        table = section(args, "aggregator")
        state_dir = Path(setting(args, table, "state_dir") or "aggregator")
        shutdown = Shutdown()
        key, trusted = load_identity(args, table, "aggregator")
        metrics = Metrics("aggregator")
        start_metrics(args, table, metrics)
        service = AggregatorService(cfg, state_dir, shutdown, metrics, key, trusted)
        server = make_server()
        add_servicer(service, server, "Aggregator")
        address = bind(server, setting(args, table, "listen", "127.0.0.1:0"))
    except (HypertrainError, ValueError) as e:
        return fail("aggregator", str(e))
    server.start()
    code = run_until_signal(
        server,
        on_stop=service.close,
        shutdown=shutdown,
        ready=lambda: announce("aggregator", address),
    )
    log_event("stopped", role="aggregator", reason=shutdown.reason)
    return code


if __name__ == "__main__":
    sys.exit(main())
