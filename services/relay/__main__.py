"""hypertrain-relay: one region's relay (``python -m hypertrain.relay``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hypertrain.common.errors import HypertrainError
from hypertrain.relay.server import FINAL_REPORTED, RelayService
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
from hypertrain.wire.errors import WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.peers import aggregator_peer
from hypertrain.wire.server import (
    Shutdown,
    add_servicer,
    announce,
    bind,
    make_server,
    run_until_signal,
)


def main(argv: Sequence[str] | None = None) -> int:
    p = daemon_parser("relay", "Serve the islands of one region; forward to the aggregator.")
    p.add_argument("--region", help="the region this relay serves (e.g. eu)")
    p.add_argument("--aggregator", help="HOST:PORT of the aggregator")
    args = p.parse_args(argv)
    try:
        cfg = load_run_config(args)
        table = section(args, "relay")
        region = setting(args, table, "region")
        aggregator = setting(args, table, "aggregator")
        if not region or region not in cfg.topology.regions:
            return fail(
                "relay",
                f"--region must be one of {', '.join(cfg.topology.regions)}, got {region!r}",
            )
        if not aggregator:
            return fail("relay", "--aggregator HOST:PORT is required")
        state_dir = setting(args, table, "state_dir") or f"relay-{region}"
        listen = setting(args, table, "listen", "127.0.0.1:0")
        shutdown = Shutdown()
        key, trusted = load_identity(args, table, "relay")
        metrics = Metrics("relay")
        start_metrics(args, table, metrics)
        service = RelayService(
            cfg,
            region,
            Path(state_dir),
            # A relay whose run is over (it reported the final state) may be restarted
            # to serve islands after the aggregator has gone: it need not reach it.
            aggregator_peer(aggregator, not (Path(state_dir) / FINAL_REPORTED).exists()),
            shutdown,
            metrics,
            key,
            trusted,
        )
        server = make_server()
        add_servicer(service, server, "Relay")
        address = bind(server, listen)
    except (HypertrainError, WireError, ValueError) as e:
        return fail("relay", str(e))
    server.start()
    code = run_until_signal(
        server,
        on_stop=service.close,
        shutdown=shutdown,
        ready=lambda: announce("relay", address),
    )
    log_event("stopped", role="relay", region=region, reason=shutdown.reason)
    return 1 if shutdown.reason and shutdown.reason.startswith("forwarding failed") else code


if __name__ == "__main__":
    sys.exit(main())
