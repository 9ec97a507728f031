"""``hypertrain keys init``: make the daemons' Ed25519 signing keys and the trusted list.

    hypertrain keys init keys/                     # default 2 x 2 run: 7 keys
    hypertrain keys init keys/ --config run.toml   # the daemons of that run
    hypertrain keys init keys/ --names aggregator,relay-eu --force

Writes ``DIR/<name>.key`` (mode 0600, PEM PKCS#8) for aggregator, relay-<region>
and island-<island id> of the run config (default regions eu,us with 2 islands
each), and ``DIR/trusted_keys.json`` for auditors to pin (file formats:
``hypertrain.common.trust.keys``).  Prints one line per key,
``key name=N id=KEYID file=PATH``, then ``keys init: keys=K dir=DIR trusted=PATH``.
Bad input (existing keys without --force, a bad name, a bad config) exits 2
with one line ``hypertrain keys init: error: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import HypertrainError
from hypertrain.common.trust.keys import daemon_key_names, init_keys, load_signing_key

_PROG = "hypertrain keys init"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``keys`` (with its ``init`` subcommand) to the top-level parser."""
    keys = subparsers.add_parser("keys", help="Ed25519 signing keys of the daemons")
    sub = keys.add_subparsers(dest="keys_command", metavar="{init}", required=True)
    p = sub.add_parser(
        "init",
        help="one private key per daemon (mode 0600) and the public trusted_keys.json",
        description=(
            "Make one Ed25519 private key per daemon (DIR/<name>.key, mode 0600) and add "
            "their public keys to DIR/trusted_keys.json, the list auditors pin. Existing "
            "key files are never replaced without --force."
        ),
    )
    p.add_argument("dir", type=Path, metavar="DIR", help="key folder (created mode 0700)")
    p.add_argument(
        "--config",
        type=Path,
        metavar="F",
        help="run config TOML: keys for its aggregator, relays and islands "
        "(default: regions eu,us with 2 islands each)",
    )
    p.add_argument(
        "--names", metavar="A,B", help="comma-separated key names instead of the run's daemons"
    )
    p.add_argument("--force", action="store_true", help="replace existing key files")
    p.set_defaults(func=run_init)


def run_init(args: argparse.Namespace) -> int:
    """Handler of ``keys init``; returns the exit code."""
    try:
        if args.names is not None:
            names = [n.strip() for n in args.names.split(",") if n.strip()]
            if args.config is not None:
                return _fail("give --names or --config, not both")
        elif args.config is not None:
            names = daemon_key_names(RunConfig.from_toml(args.config).topology)
        else:
            names = daemon_key_names(RunConfig().topology)
        trusted = init_keys(args.dir, names, force=args.force)
        for n in names:
            path = args.dir / f"{n}.key"
            key = load_signing_key(path)  # read back: proves the file is usable as written
            print(f"key name={n} id={key.key_id} file={path}")
    except HypertrainError as e:
        return _fail(str(e))
    print(f"keys init: keys={len(names)} dir={args.dir} trusted={trusted}")
    return 0


def _fail(message: str) -> int:
    print(f"{_PROG}: error: {message}", file=sys.stderr)
    return 2
