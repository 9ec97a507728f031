"""Transport errors and the one table that maps exceptions to gRPC status codes.

``WireError(code, message)`` is what the wire layer raises when a stream breaks its
contract (no header first, wrong byte count, digest mismatch, too large) or a peer
cannot be reached.  It carries the ``grpc.StatusCode`` the servicer must answer with,
so the daemons never pick codes themselves.

Invariants:

- ``status_of`` is the only place where an exception becomes a status code; the
  servicer decorator (``server.maps_errors``) and the tests use it.
- Only our own exception types are mapped.  Any other exception is a bug in the
  daemon, not the caller's fault, and stays UNKNOWN (gRPC's default) with its traceback
  in the daemon's log.

The table, with the caller-visible meaning of each code:

=====================  ==================================================================
INVALID_ARGUMENT       the stream disagrees with its own header (no header first, a second
                       header, more or fewer bytes than ``header.size``), a malformed
                       header, or the core rejected the content (``HypertrainError``:
                       ``ConfigError``, ``CodecError``, ``DataError``).  Do not retry.
DATA_LOSS              the bytes arrived but their blob / tensor digest is not the one
                       the header announced: corrupted in transit.  Resending may work.
RESOURCE_EXHAUSTED     the announced size is over the receiver's ``max_size``.
FAILED_PRECONDITION,   raised by the daemons themselves (wrong run, wrong round, already
ALREADY_EXISTS, ...    committed) as ``WireError(code, message)``; passed through as is.
UNAVAILABLE            a peer is not reachable (``client.connect``); the only retried code.
INTERNAL               the receiver failed locally (spool write error).
=====================  ==================================================================
"""

from __future__ import annotations

import grpc

from hypertrain.common.errors import HypertrainError

#: Trailing metadata key of a FAILED_PRECONDITION that says "your step closed without
#: you at its cutoff": resending cannot help; take the step's merge instead.
STALE_KEY = "hypertrain-stale"
#: Trailing metadata key of a refusal that says "the run is over for this request" (a join
#: with no round left to join, or any change after the run completed): nothing to retry.
OVER_KEY = "hypertrain-over"


#: Trailing metadata key of a refusal that says "your build's wire format is not mine"
#: (``wireformat.py``): no retry, no restart can help; run one build across the run.
MISMATCH_KEY = "hypertrain-wire-mismatch"


class WireError(Exception):
    """A transfer or call failed with a definite gRPC status; ``message`` names the problem.
    ``stale``: a delta refused because its sync step closed without its sender (sent to
    the caller as ``STALE_KEY`` trailing metadata beside FAILED_PRECONDITION)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        stale: bool = False,
        over: bool = False,
        mismatch: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.stale = stale
        self.over = over
        """The run is over for this request (``OVER_KEY``; ``Decision.over``)."""
        self.mismatch = mismatch
        """The peer refused this build's wire format (``MISMATCH_KEY``): the caller stops
        as on a bad config (exit code 2)."""

    def marked(self, key: str) -> bool:
        """Is this refusal marked with the trailing metadata ``key`` (``STALE_KEY``,
        ``OVER_KEY``, ``MISMATCH_KEY``)?"""
        return {STALE_KEY: self.stale, OVER_KEY: self.over, MISMATCH_KEY: self.mismatch}[key]

    @property
    def mark(self) -> str | None:
        """The trailing metadata key a server answers this refusal with (the first set of
        ``STALE_KEY``, ``OVER_KEY``, ``MISMATCH_KEY``), or None."""
        return next((k for k in (STALE_KEY, OVER_KEY, MISMATCH_KEY) if self.marked(k)), None)


class StaleDelta(WireError):
    """The peer refused a delta as stale (see ``WireError.stale``)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message, stale=True)

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a servicer answers ``exc`` with, or None when ``exc`` is not ours (a bug)."""
    if isinstance(exc, WireError):
        return exc.code, exc.message
    if isinstance(exc, HypertrainError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return None
