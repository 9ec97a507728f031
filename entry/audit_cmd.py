"""``hypertrain audit RUN_DIR``: verify a run's tapes and replay every merge.

    hypertrain audit runs/local-... [--from-round G] [--trusted-keys keys/trusted_keys.json]

Prints one line: ``audit OK: rounds a..b (steps x..y), N entries and B bytes
checked, final state digest D`` (exit 0), or ``audit FAILED: <tape> entry N
(<kind>, step s): <why>`` (exit 1).  Pin the trusted keys you got out of band;
the default (the run folder's own keys/trusted_keys.json) is for local runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hypertrain.common.errors import HypertrainError
from hypertrain.common.trust.audit import AuditError, audit_run
from hypertrain.common.trust.keys import TrustedKeys


def run_audit(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    trusted_path = args.trusted_keys or run_dir / "keys" / "trusted_keys.json"
    try:
        trusted = TrustedKeys.load(trusted_path)
        report = audit_run(run_dir, trusted, args.from_round)
    except AuditError as e:
        print(f"audit FAILED: {e}")
        return 1
    except HypertrainError as e:
        print(f"hypertrain audit: error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("audit", help="verify a run's tapes and replay every merge")
    p.add_argument("run_dir", type=Path, help="the run folder (hypertrain up's --run-dir)")
    p.add_argument(
        "--from-round", type=int, help="segment audit from this global round's checkpoint"
    )
    p.add_argument("--trusted-keys", type=Path, help="pinned public keys (trusted_keys.json)")
    p.set_defaults(func=run_audit)
