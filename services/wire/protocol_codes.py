"""Decision codes of the round machines and nodes (common/rounds/) <-> gRPC status codes."""

from __future__ import annotations

import grpc

from hypertrain.common.rounds import machines
from hypertrain.common.rounds.node import FORBIDDEN

STATUS = {
    machines.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    machines.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    machines.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    machines.CORRUPT: grpc.StatusCode.DATA_LOSS,
    machines.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
}
