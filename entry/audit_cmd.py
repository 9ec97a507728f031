"""``hypertrain audit RUN_DIR``: verify a run's tapes and replay every merge.

    hypertrain audit runs/local-... [--from-round G] [--trusted-keys keys/trusted_keys.json]
                                    [--receipts DIR ...] [--ca-cert ca.crt] [--partial]

Prints one line, and exits 0 only when it begins ``audit OK``:

- ``audit OK: complete, rounds 0..b of R (steps x..y of S), N entries and B bytes
  checked, K receipts agree, final state digest D``: every tape replayed to the run's
  last step, and every receipt found is a head of its tape;
- ``audit INCOMPLETE: tapes end at round r of R (the run's configuration says S
  steps); ...`` (exit 1): what was there verified, but the run has not ended (or its
  tapes were cut); ``--partial`` accepts that: ``audit OK (partial): rounds ...``;
- ``audit FAILED: <tape> entry N (<kind>, step s): <why>`` (exit 1), or ``audit
  FAILED: fork: <daemon>'s tape disagrees with the head <holder> received at step s``:
  the daemon rewrote (or cut) its tape after it handed that receipt out.

Receipts are read from the run folder's island and relay state folders
(``*/receipts``) and from every ``receipts`` file under ``--receipts DIR`` (collected
from islands elsewhere).

``--from-round G`` audits the segment after global round G's checkpoint and says so
(``segment rounds ...``); in a run with streaming fragments, after each fragment's round G,
or ``--from-round G0,G1,...`` names each fragment's (``-``: that one from its start), as the
whole audit of a pruned run suggests.  Pin the trusted keys you got out of band; the default (the
run folder's own keys/trusted_keys.json) is for local runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hypertrain.common.errors import HypertrainError
from hypertrain.common.trust.audit import AuditError, audit_run, parse_rounds
from hypertrain.common.trust.keys import TrustedKeys


def run_audit(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    trusted_path = args.trusted_keys or run_dir / "keys" / "trusted_keys.json"
    try:
        trusted = TrustedKeys.load(trusted_path)
        report = audit_run(run_dir, trusted, args.from_round, tuple(args.receipts), args.ca_cert)
    except AuditError as e:
        print(f"audit FAILED: {e}")
        return 1
    except HypertrainError as e:
        print(f"hypertrain audit: error: {e}", file=sys.stderr)
        return 2
    print(report.verdict(partial=args.partial))
    return 0 if report.complete or args.partial else 1


def _rounds(text: str) -> object:
    try:
        return parse_rounds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub: Any) -> None:
    p = sub.add_parser("audit", help="verify a run's tapes and replay every merge")
    p.add_argument("run_dir", type=Path, help="the run folder (hypertrain up's --run-dir)")
    p.add_argument(
        "--from-round",
        type=_rounds,
        metavar="G",
        help="segment audit from this global round's checkpoint (a run with streaming "
        "fragments: one round for all, or G0,G1,... one per fragment, - for one from its start)",
    )
    p.add_argument("--trusted-keys", type=Path, help="pinned public keys (trusted_keys.json)")
    p.add_argument(
        "--ca-cert",
        type=Path,
        help="the run CA's certificate (keys/ca.crt): every tape must pin it (default: the "
        "tapes must agree with the aggregator's)",
    )
    p.add_argument(
        "--receipts",
        type=Path,
        nargs="+",
        default=[],
        metavar="DIR",
        help="more receipts: folders searched for 'receipts' files (islands' state "
        "folders collected elsewhere), or such files",
    )
    p.add_argument(
        "--partial",
        action="store_true",
        help="accept tapes that end before the run's last step (a run still going)",
    )
    p.set_defaults(func=run_audit)
