"""hypertrain-island (``python -m hypertrain.island``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hypertrain.common.errors import HypertrainError
from hypertrain.island.daemon import Island
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
from hypertrain.wire.peers import relay_peer


def main(argv: Sequence[str] | None = None) -> int:
    p = daemon_parser("island", "Train one model replica; sync through the region's relay.")
    p.add_argument("--region", help="the island's region (e.g. eu)")
    p.add_argument("--index", type=int, help="the island's index in its region (default 0)")
    p.add_argument("--relay", help="HOST:PORT of the region's relay")
    args = p.parse_args(argv)
    island = None
    try:
        cfg = load_run_config(args)
        table = section(args, "island")
        region = setting(args, table, "region")
        index = setting(args, table, "index", 0)
        relay = setting(args, table, "relay")
        if not region or region not in cfg.topology.regions:
            return fail(
                "island",
                f"--region must be one of {', '.join(cfg.topology.regions)}, got {region!r}",
            )
        if not 0 <= index < cfg.topology.islands_per_region:
            return fail(
                "island", f"--index must be in [0, {cfg.topology.islands_per_region}), got {index}"
            )
        if not relay:
            return fail("island", "--relay HOST:PORT is required")
        key, _ = load_identity(args, table, "island")
        metrics = Metrics("island")
        start_metrics(args, table, metrics)
        island_id = f"{region}-{index}"
        state_dir = Path(setting(args, table, "state_dir") or f"island-{island_id}")
        island = Island(cfg, island_id, relay_peer(relay), metrics, key, state_dir)
        island.install_signals()
        island.run()
        return 0
    except KeyboardInterrupt:
        log_event("stopped", role="island", reason="signal")
        return 130
    except (HypertrainError, ValueError) as e:  # bad config or flags
        return fail("island", str(e))
    except WireError as e:  # the relay refused us or went away mid-run
        return fail("island", str(e), code=1)
    finally:
        if island is not None:
            island.close()


if __name__ == "__main__":
    sys.exit(main())
