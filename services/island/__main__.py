"""hypertrain-island (``python -m hypertrain.island``)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence

import torch

from hypertrain.common.errors import HypertrainError
from hypertrain.common.settings import IslandSettings
from hypertrain.common.shards import relay_member
from hypertrain.common.trust.ledger import island_key, relay_key
from hypertrain.common.trust.receipts import ReceiptError
from hypertrain.island import ranks as island_ranks
from hypertrain.island.daemon import Island
from hypertrain.wire.daemon import (
    daemon_parser,
    die_with_parent,
    fail,
    freeze_heap,
    load_identity,
    load_run_config,
    load_security,
    load_settings,
    log_event,
    start_metrics,
)
from hypertrain.wire.errors import WireError
from hypertrain.wire.metrics import Metrics
from hypertrain.wire.options import tune_allocator
from hypertrain.wire.peers import relay_peer


def _stopped(island: Island | None) -> int:
    """Stopped by a signal: 0 after a leave its relay took (SIGTERM: a clean end that
    nothing should restart), else 130."""
    left = island is not None and island.left
    log_event("stopped", role="island", reason="left" if left else "signal")
    return 0 if left else 130


def main(argv: Sequence[str] | None = None) -> int:
    tune_allocator()  # before any thread allocates (wire/options.py)
    p = daemon_parser("island", "Train one model replica; sync through the region's relay.")
    p.add_argument("--region", help="the island's region (e.g. eu)")
    p.add_argument("--index", type=int, help="the island's index in its region (default 0)")
    p.add_argument(
        "--relay",
        help="HOST:PORT of the region's relay (relay shards: each shard's, in shard order, "
        "comma-separated)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="where to train (default cpu); under torchrun, cuda means cuda:LOCAL_RANK",
    )
    args = p.parse_args(argv)
    island = None
    ranks = None
    try:
        cfg = load_run_config(args)
        settings = load_settings(args, IslandSettings)
        settings.check_topology(cfg.topology)
        relays = settings.relays(cfg.topology)
        device = torch.device(settings.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return fail("island", "--device cuda: no CUDA device is visible to this process")
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        metrics = Metrics("island")
        security = load_security(settings, island_key(settings.island_id), metrics)
        key, trusted = load_identity(settings)
        stop = threading.Event()
        if island_ranks.world_size() > 1:
            die_with_parent(signal.SIGKILL)  # never outlive torchrun
        ranks = island_ranks.from_environment(stop, device)
        lead = ranks is None or ranks.rank == 0
        if lead:  # one island, one metrics endpoint
            start_metrics(settings, metrics)
        # Connected lazily: an island started before its relay waits for it (and says so).
        names = [
            relay_key(relay_member(settings.region or "", i, len(relays)))
            for i in range(len(relays))
        ]
        peers = (
            [
                relay_peer(r, wait_ready=False, security=security, name=n)
                for r, n in zip(relays, names, strict=True)
            ]
            if lead
            else None
        )
        island = Island(
            cfg,
            settings.island_id,
            peers,
            metrics,
            key,
            settings.state_path,
            ranks,
            stop,
            device,
            trusted,
        )
        island.install_signals()
        freeze_heap()
        island.run()
        island.close()
        island = None
        if ranks is not None:
            ranks.close()  # after a clean run only: the others wait for us here
        return 0
    except KeyboardInterrupt:
        return _stopped(island)
    except ReceiptError as e:  # the relay's merge came without its signed tape head
        return fail("island", str(e), code=1)
    except (HypertrainError, ValueError) as e:  # bad config or flags
        return fail("island", str(e))
    except WireError as e:  # the relay refused us or went away mid-run
        if island is not None and island.stop.is_set():  # a signal ended the wait
            return _stopped(island)
        if e.over:  # e.g. a join too late: no round left for it; nothing went wrong
            log_event("stopped", role="island", reason="run over", message=e.message)
            return 0
        if e.mismatch:  # another build's relay: a restart cannot help (wireformat.py)
            return fail("island", str(e))
        return fail("island", str(e), code=1)
    except RuntimeError as e:  # torch.distributed: another rank of this island is gone
        if ranks is None:
            raise
        if island is not None and island.stop.is_set():
            log_event("stopped", role="island", reason="signal")
            return 130
        return fail("island", f"rank {ranks.rank} of {ranks.size}: {e}", code=1)
    finally:
        if island is not None:
            island.close()


def exit_rank(code: int) -> None:
    """End a rank of a multi-rank island without interpreter teardown.

    torch's teardown of a gloo process group races with its own threads and can
    abort the process (SIGABRT, "terminate called without an active exception")
    after a run that succeeded; everything that must last is written and flushed
    by now, so skip it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    status = main()
    if island_ranks.world_size() > 1:
        exit_rank(status)
    sys.exit(status)
