"""``hypertrain keys``: the daemons' Ed25519 signing keys, the trusted list, and the
run's TLS CA and certificates.

    hypertrain keys init keys/                     # default 2 x 2 run: 7 daemons
    hypertrain keys init keys/ --config run.toml   # the daemons of that run
    hypertrain keys init keys/ --names aggregator,relay-eu --force
    hypertrain keys cert keys/ relay-eu            # a new certificate (rotation)
    hypertrain keys ca keys/ --force               # a new CA, and every certificate again

``init`` writes, for aggregator, relay-<region> and island-<island id> of the run
config (default regions eu,us with 2 islands each): ``DIR/<name>.key`` (the signing
key, mode 0600, PEM PKCS#8), ``DIR/trusted_keys.json`` for auditors to pin (formats:
``hypertrain.common.trust.keys``), the run CA ``DIR/ca.crt`` and ``DIR/ca.key`` (0600)
unless the folder has one, and ``DIR/<name>.crt`` with ``DIR/<name>.tls.key`` (0600)
signed by it (``hypertrain.common.trust.certs``).  Prints one line per daemon,
``key name=N id=KEYID file=PATH cert=PATH expires=YYYY-MM-DD``, then
``keys init: keys=K dir=DIR trusted=PATH ca=PATH``.  ``cert`` issues new certificates
and TLS keys for the named daemons with the folder's CA, replacing the old ones (one
line each, ``cert name=N file=PATH expires=YYYY-MM-DD``).  ``ca`` makes a new CA
(``--force`` to replace one) and issues every certificate in the folder again with it,
signing keys untouched (``ca file=PATH`` then the ``cert`` lines).  Bad input (existing keys
without --force, a bad name, a bad config, no CA) exits 2 with one line
``hypertrain keys <command>: error: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.trust.certs import (
    CA_CERT,
    CERT_DAYS,
    TlsFiles,
    cert_path,
    init_ca,
    init_daemons,
    issue,
)
from hypertrain.common.trust.keys import (
    check_key_name,
    daemon_key_names,
    load_signing_key,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``keys`` (with its ``init`` subcommand) to the top-level parser."""
    keys = subparsers.add_parser("keys", help="signing keys and TLS certificates of the daemons")
    sub = keys.add_subparsers(dest="keys_command", metavar="{init,cert,ca}", required=True)
    p = sub.add_parser(
        "init",
        help="per daemon: a signing key and a TLS certificate; the trusted list and the CA",
        description=(
            "Make one Ed25519 private key per daemon (DIR/<name>.key, mode 0600) and add "
            "their public keys to DIR/trusted_keys.json, the list auditors pin; make the "
            "run's TLS CA (DIR/ca.crt, DIR/ca.key) unless DIR has one, and one certificate "
            "per daemon signed by it (DIR/<name>.crt, DIR/<name>.tls.key). Existing key "
            "files are never replaced without --force."
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
    _days_flag(p)
    p.set_defaults(func=run_init)
    c = sub.add_parser(
        "cert",
        help="new TLS certificates for some daemons, signed by DIR's CA (rotation)",
        description=(
            "Issue a new TLS key and certificate for each named daemon with the CA in DIR, "
            "replacing its old ones. A daemon reads its certificate when it starts: "
            "restart it to use the new one."
        ),
    )
    c.add_argument("dir", type=Path, metavar="DIR", help="the key folder holding ca.crt, ca.key")
    c.add_argument("names", nargs="+", metavar="NAME", help="daemon names, e.g. relay-eu")
    _days_flag(c)
    c.set_defaults(func=run_cert)
    a = sub.add_parser(
        "ca",
        help="a new run CA, and every certificate in DIR issued again by it",
        description=(
            "Make a new run CA in DIR (replacing an existing one only with --force) and "
            "issue every daemon certificate in DIR again with it; signing keys and the "
            "trusted list are not touched. Every daemon then needs its new certificate "
            "and the new ca.crt, and a restart."
        ),
    )
    a.add_argument("dir", type=Path, metavar="DIR", help="the key folder")
    a.add_argument("--force", action="store_true", help="replace an existing CA")
    _days_flag(a)
    a.set_defaults(func=run_ca)


def _days_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--days", type=int, default=CERT_DAYS, help=f"certificate lifetime (default {CERT_DAYS})"
    )


def run_init(args: argparse.Namespace) -> int:
    """Handler of ``keys init``; returns the exit code."""
    try:
        if args.names is not None:
            names = [n.strip() for n in args.names.split(",") if n.strip()]
            if args.config is not None:
                return _fail("init", "give --names or --config, not both")
        elif args.config is not None:
            names = daemon_key_names(RunConfig.from_toml(args.config).topology)
        else:
            names = daemon_key_names(RunConfig().topology)
        _check_days(args.days)
        trusted = init_daemons(args.dir, names, force=args.force, days=args.days)
        for n in names:
            path = args.dir / f"{n}.key"
            key = load_signing_key(path)  # read back: proves the file is usable as written
            cert = cert_path(args.dir, n)
            print(f"key name={n} id={key.key_id} file={path} cert={cert} {_expiry(cert)}")
    except HypertrainError as e:
        return _fail("init", str(e))
    print(f"keys init: keys={len(names)} dir={args.dir} trusted={trusted} ca={args.dir / CA_CERT}")
    return 0


def run_cert(args: argparse.Namespace) -> int:
    """Handler of ``keys cert``; returns the exit code."""
    try:
        _check_days(args.days)
        for n in args.names:
            check_key_name(n)
        for n in args.names:
            cert = issue(args.dir, n, days=args.days, force=True)
            print(f"cert name={n} file={cert} {_expiry(cert)}")
    except HypertrainError as e:
        return _fail("cert", str(e))
    return 0


def run_ca(args: argparse.Namespace) -> int:
    """Handler of ``keys ca``; returns the exit code."""
    try:
        _check_days(args.days)
        names = sorted(p.name.removesuffix(".crt") for p in args.dir.glob("*.crt"))
        names = [n for n in names if n != CA_CERT.removesuffix(".crt")]
        print(f"ca file={init_ca(args.dir, force=args.force)}")
        for n in names:
            cert = issue(args.dir, n, days=args.days, force=True)
            print(f"cert name={n} file={cert} {_expiry(cert)}")
    except HypertrainError as e:
        return _fail("ca", str(e))
    return 0


def _expiry(cert: Path) -> str:
    files = TlsFiles.load(cert)  # read back: the key, the CA's signature, the dates
    return f"expires={files.not_after:%Y-%m-%d}"


def _check_days(days: int) -> None:
    if days < 1:
        raise ConfigError(f"--days must be >= 1, got {days}")


def _fail(command: str, message: str) -> int:
    print(f"hypertrain keys {command}: error: {message}", file=sys.stderr)
    return 2
