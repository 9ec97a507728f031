"""The ``hypertrain`` command line.

    hypertrain run --local                 # in-process reference run on the built-in default
    hypertrain run --local --preset proxy --regions eu,us,ap --h-r 5 --h-g 30
    hypertrain data prepare [PATH ...]     # text files/folders -> token shards

Exit codes: 0 success, 2 bad input (one line on stderr naming the problem),
1 an unexpected failure (traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypertrain import audit_cmd, data_cmd, keys_cmd, plan_cmd, sim_cmd
from hypertrain.common.errors import HypertrainError
from hypertrain.common.runflags import add_run_config_flags, run_config_from_args


def cmd_run(args: argparse.Namespace) -> int:
    if not args.local:
        print(
            "hypertrain run: error: only --local is available (daemons: hypertrain up)",
            file=sys.stderr,
        )
        return 2
    from hypertrain.common.reference import run_reference

    cfg = run_config_from_args(args)
    topo = cfg.topology
    print(
        f"reference run {cfg.run_id}: {topo.n_islands} islands in {len(topo.regions)} regions "
        f"({','.join(topo.regions)}), preset {cfg.model}, {cfg.steps} steps, "
        f"H_r={topo.h_r} H_g={topo.h_g} tau={topo.tau}, codecs {cfg.regional_codec}/"
        f"{cfg.global_codec}, outer {cfg.outer.name}, inner {cfg.inner.name}"
        + (f", {cfg.fragments} streaming fragments" if cfg.fragments > 1 else ""),
        flush=True,
    )

    def show(e: dict[str, Any]) -> None:
        print(
            f"round {e['round']:3d}  step {e['step']:5d}  train {e['train_loss']:.4f}  "
            f"held-out {e['heldout_loss']:.4f}",
            flush=True,
        )

    res = run_reference(cfg, on_event=show)
    ratio = res.fp32_bytes / res.bytes_per_sync
    busy = res.seconds_train + res.seconds_sync
    print(
        f"held-out loss {res.initial_loss:.4f} -> {res.final_loss:.4f}; "
        f"{res.bytes_per_sync / 1024:.1f} KiB per island per sync ({ratio:.1f}x smaller than fp32); "
        f"sync overhead {100 * res.seconds_sync / busy:.1f}% of train+sync time"
    )
    print(f"final state digest {res.final_digest}")
    if cfg.lawa:
        print(
            f"LAWA average of the last {cfg.lawa} global rounds: held-out loss "
            f"{res.lawa_loss:.4f}, digest {res.lawa_digest}"
        )
    if args.json:
        summary = {
            "config": cfg.to_dict(),
            "initial_loss": res.initial_loss,
            "final_loss": res.final_loss,
            "final_digest": res.final_digest,
            **({"lawa_digest": res.lawa_digest, "lawa_loss": res.lawa_loss} if cfg.lawa else {}),
            "bytes_per_sync": res.bytes_per_sync,
            "fp32_bytes": res.fp32_bytes,
            "seconds_train": res.seconds_train,
            "seconds_sync": res.seconds_sync,
            "seconds_eval": res.seconds_eval,
            "rounds": res.rounds,
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hypertrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train (in-process reference run with --local)")
    run.add_argument("--local", action="store_true", help="all roles in this process")
    run.add_argument("--json", type=Path, help="write a summary JSON here")
    add_run_config_flags(run)
    run.set_defaults(func=cmd_run)
    up = sub.add_parser("up", help="the whole system as separate processes on loopback")
    up.add_argument("--run-dir", help="run folder (default runs/<run_id>-<UTC time>)")
    up.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    up.add_argument(
        "--prometheus",
        action="store_true",
        help="also start a local Prometheus (if installed) scraping the cluster, on 127.0.0.1",
    )
    up.add_argument(
        "--island-ranks",
        type=int,
        default=1,
        metavar="K",
        help="run each island as K data-parallel ranks under torchrun (gloo; default 1)",
    )
    up.add_argument(
        "--island-device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the islands train (cuda: rank r on cuda:r, NCCL between the ranks)",
    )
    up.add_argument(
        "--keep-rounds",
        type=int,
        default=0,
        metavar="K",
        help="relays and the aggregator keep the checkpoints and inputs of their newest K "
        "global rounds only (K >= 2; default 0: every round); audit the run from the oldest "
        "kept (--chaos does: docs/operations.md, Disk)",
    )
    up.add_argument(
        "--chaos",
        type=int,
        metavar="SEED",
        help="kill, restart, stop and add islands at seeded steps (cutoffs on); then print "
        "the members of every round and audit the run (docs/operations.md, step 9)",
    )
    add_run_config_flags(up)
    up.set_defaults(func=lambda a: __import__("hypertrain.up", fromlist=["cmd_up"]).cmd_up(a))
    data_cmd.register(sub)
    keys_cmd.register(sub)
    plan_cmd.register(sub)
    audit_cmd.register(sub)
    sim_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HypertrainError as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
