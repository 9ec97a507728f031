"""Regenerate the committed protobuf/gRPC modules from proto/hypertrain/v1/*.proto.

    .venv/bin/python scripts/gen_proto.py            # rewrite proto/hypertrain/v1/*_pb2*.py
    .venv/bin/python scripts/gen_proto.py --check    # exit 1 if regenerating would change them

Generated code is committed (a fresh clone needs no build step) and
tests/unit/test_proto.py runs the check, so the .proto and the code never drift.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PACKAGE = PROTO_ROOT / "hypertrain" / "v1"
GENERATED = ("hypertrain_pb2.py", "hypertrain_pb2.pyi", "hypertrain_pb2_grpc.py")


def generate(out: Path) -> None:
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(PACKAGE / "hypertrain.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("gen_proto: protoc failed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if not args.check:
        generate(PROTO_ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            name
            for name in GENERATED
            if not filecmp.cmp(
                Path(tmp) / "hypertrain" / "v1" / name, PACKAGE / name, shallow=False
            )
        ]
    if stale:
        print(f"gen_proto: stale generated code: {', '.join(stale)}; run scripts/gen_proto.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
