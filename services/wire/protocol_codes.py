"""Decision codes of the sans-I/O machines (common/protocol.py) -> gRPC status codes."""

from __future__ import annotations

import grpc

from hypertrain.common import protocol

STATUS = {
    protocol.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    protocol.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    protocol.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
}
