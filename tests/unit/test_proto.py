"""The committed generated gRPC code matches the .proto (regenerating changes nothing)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_generated_modules_import_under_the_package_root() -> None:
    from hypertrain.v1 import hypertrain_pb2, hypertrain_pb2_grpc

    assert hypertrain_pb2.DESCRIPTOR.package == "hypertrain.v1"
    assert hasattr(hypertrain_pb2_grpc, "RelayServicer")
