"""hypertrain-relay: one region's relay (``python -m hypertrain.relay``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hypertrain.common.errors import HypertrainError
from hypertrain.common.fragments import run_fragments
from hypertrain.common.settings import RelaySettings
from hypertrain.common.shards import relay_member
from hypertrain.common.trust.ledger import relay_key
from hypertrain.relay.server import RELAY_DONE, RelayFragments, RelayService
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
    starting_parameters,
)
from hypertrain.wire.errors import WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.options import tune_allocator
from hypertrain.wire.peers import aggregator_peer
from hypertrain.wire.server import (
    PartShutdown,
    Shutdown,
    add_servicer,
    announce,
    bind,
    make_server,
    run_until_signal,
)


def main(argv: Sequence[str] | None = None) -> int:
    tune_allocator()  # before any thread allocates (wire/options.py)
    p = daemon_parser("relay", "Serve the islands of one region; forward to the aggregator.")
    p.add_argument("--region", help="the region this relay serves (e.g. eu)")
    p.add_argument("--aggregator", help="HOST:PORT of the aggregator")
    p.add_argument(
        "--shard",
        help="i/S: run as shard i of the region's S relay processes, each owning a range "
        "of the parameters (S must equal the run's --relay-shards)",
    )
    p.add_argument(
        "--no-cut-through",
        dest="cut_through",
        action="store_const",
        const=False,
        help="serve each global merge to the islands only once it arrived whole from the "
        "aggregator (default: while it arrives)",
    )
    add_store_flags(p)
    args = p.parse_args(argv)
    try:
        cfg = load_run_config(args)
        settings = load_settings(args, RelaySettings)
        region, aggregator = settings.check_topology(cfg.topology)
        settings.check_fragments(cfg.fragments)
        shard = settings.shard_index(cfg.topology)
        state_dir = settings.state_path
        shutdown = Shutdown()
        name = relay_key(relay_member(region, shard, cfg.topology.relay_shards))
        metrics = Metrics("relay")
        security = load_security(settings, name, metrics)
        key, trusted = load_identity(settings)
        start_metrics(settings, metrics)
        # Connected lazily: a relay resumes and serves its islands whether or not the
        # aggregator is reachable yet (it recovers without the network, and its
        # forwarder waits while the aggregator is down), and one restarted after the run
        # may never need it.
        peer = aggregator_peer(aggregator, wait_ready=False, security=security)
        service: RelayService | RelayFragments
        if cfg.fragments == 1:
            service = RelayService(
                cfg,
                region,
                state_dir,
                peer,
                shutdown,
                metrics,
                key,
                trusted,
                shard,
                security,
                cut_through=settings.cut_through,
                keep_rounds=settings.keep_rounds,
            )
        else:  # one node per streaming fragment, each in its own folder
            layout, theta0 = starting_parameters(cfg)
            parts: list[PartShutdown] = []
            service = RelayFragments(
                [
                    RelayService(
                        cfg,
                        region,
                        state_dir,
                        peer,
                        PartShutdown(shutdown, parts, RELAY_DONE, cfg.fragments),
                        metrics,
                        key,
                        trusted,
                        shard,
                        security,
                        (f.index, theta0[f.lo : f.hi].clone()),
                        cut_through=settings.cut_through,
                        keep_rounds=settings.keep_rounds,
                    )
                    for f in run_fragments(cfg, layout)
                ]
            )
            del theta0
        guard = call_guard(settings, metrics)
        server = make_server(guard.limits.pool_size(len(cfg.topology.islands_of(region))))
        add_servicer(service, server, "Relay", guard)
        address = bind(server, settings.listen, security)
    except (HypertrainError, WireError, ValueError) as e:
        return fail("relay", str(e))
    freeze_heap()
    server.start()
    code = run_until_signal(
        server,
        on_stop=service.close,
        shutdown=shutdown,
        ready=lambda: announce("relay", address),
    )
    log_event("stopped", role="relay", region=region, **service.where, reason=shutdown.reason)
    return shutdown.code if shutdown.failed else code


if __name__ == "__main__":
    sys.exit(main())
