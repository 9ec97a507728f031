"""``hypertrain data prepare``: turn text files or folders into a token dataset.

    hypertrain data prepare                      # stdlib corpus -> default_data_dir()
    hypertrain data prepare notes/ README.md --out data/mine

Prints one parseable summary line on stdout:
``data prepare: tokens=N shards=S fingerprint=HEX out=DIR seconds=T``.
Bad input (missing path, empty input, a folder that is not a dataset) exits 2
with one line ``hypertrain data prepare: error: ...`` on stderr, the argparse
convention, so scripts can tell a usage error from a crash.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hypertrain.common.data import DEFAULT_SHARD_TOKENS, default_data_dir, prepare
from hypertrain.common.errors import HypertrainError

_PROG = "hypertrain data prepare"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``data`` (with its ``prepare`` subcommand) to the top-level parser."""
    data = subparsers.add_parser("data", help="prepare token datasets")
    sub = data.add_subparsers(dest="data_command", metavar="{prepare}", required=True)
    p = sub.add_parser(
        "prepare",
        help="text files or folders -> memory-mapped byte-level token shards",
        description=(
            "Tokenize text into byte-level shards plus manifest.json. Folders are searched "
            "recursively for *.py, *.txt, *.md, *.rst (sorted by relative path); files named "
            "explicitly are always taken. With no PATH, the Python standard library's source "
            "is used (no download)."
        ),
    )
    p.add_argument("paths", nargs="*", type=Path, metavar="PATH", help="text files or folders")
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        default=None,
        help="dataset folder (default with no PATH: $HYPERTRAIN_DATA_DIR or "
        "~/.cache/hypertrain/data/stdlib; required with PATH)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS})",
    )
    p.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    """Handler of ``data prepare``; returns the exit code."""
    paths: list[Path] = list(args.paths)
    if paths and args.out is None:
        return _fail("--out DIR is required when PATH is given")
    out: Path = args.out if args.out is not None else default_data_dir()
    t0 = time.perf_counter()
    try:
        m = prepare(paths or None, out, shard_tokens=args.shard_tokens)
    except HypertrainError as e:
        return _fail(str(e))
    seconds = time.perf_counter() - t0
    print(
        f"data prepare: tokens={m.n_tokens} shards={len(m.shards)} "
        f"fingerprint={m.fingerprint} out={out} seconds={seconds:.2f}"
    )
    return 0


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return 2
