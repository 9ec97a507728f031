"""hypertrain-aggregator (``python -m hypertrain.aggregator``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hypertrain.aggregator.server import AggregatorFragments, AggregatorService
from hypertrain.common.errors import HypertrainError
from hypertrain.common.settings import AggregatorSettings
from hypertrain.common.trust.ledger import AGGREGATOR_KEY
from hypertrain.wire.daemon import (
    add_store_flags,
    call_guard,
    daemon_parser,
    fail,
    freeze_heap,
    load_identity,
    load_run_config,
    load_security,
    load_settings,
    log_event,
    start_metrics,
)
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.options import tune_allocator
from hypertrain.wire.server import (
    Shutdown,
    add_servicer,
    announce,
    bind,
    make_server,
    run_until_signal,
)


def main(argv: Sequence[str] | None = None) -> int:
    tune_allocator()  # before any thread allocates (wire/options.py)
    p = daemon_parser("aggregator", "Hold the global state; apply the outer optimizer.")
    add_store_flags(p)
    args = p.parse_args(argv)
    try:
        cfg = load_run_config(args)
        settings = load_settings(args, AggregatorSettings)
        shutdown = Shutdown()
        metrics = Metrics("aggregator")
        security = load_security(settings, AGGREGATOR_KEY, metrics)
        key, trusted = load_identity(settings)
        start_metrics(settings, metrics)
        service: AggregatorService | AggregatorFragments
        if cfg.fragments == 1:
            service = AggregatorService(
                cfg, settings.state_path, shutdown, metrics, key, trusted, security,
                keep_rounds=settings.keep_rounds,
            )  # fmt: skip
        else:  # one node per streaming fragment, each in its own folder
            service = AggregatorFragments(
                cfg, settings.state_path, shutdown, metrics, key, trusted, security,
                keep_rounds=settings.keep_rounds,
            )  # fmt: skip
        guard = call_guard(settings, metrics, cfg.fragments)
        server = make_server(guard.limits.pool_size(len(service.callers.names)))
        add_servicer(service, server, "Aggregator", guard)
        address = bind(server, settings.listen, security)
    except (HypertrainError, ValueError) as e:
        return fail("aggregator", str(e))
    freeze_heap()
    server.start()
    code = run_until_signal(
        server,
        on_stop=service.close,
        shutdown=shutdown,
        ready=lambda: announce("aggregator", address),
    )
    log_event("stopped", role="aggregator", reason=shutdown.reason)
    return 1 if shutdown.failed else code


if __name__ == "__main__":
    sys.exit(main())
