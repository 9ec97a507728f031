"""The wire format every call states, and the check every server makes of it.

    stub.PushDelta = Stating(channel.stream_unary(...))   # client._fast_stub does this
    refusal = format_refusal(context)                     # server._guarded: None, or why not

Peers of one run must read each other's bytes the same way: the digests a header
announces (``common/digest.py``, ``DIGEST_FORMAT``), the chunk framing, the messages.  A
build that reads them differently does not fail cleanly on its own: an island of an
older build pushing to a newer relay computes another digest of the same bytes, and the
relay answers DATA_LOSS ("corrupt transfer"), which the island retries as a transfer
error for as long as it runs.  So every call states its build's wire format as gRPC
metadata (``FORMAT_KEY``), and every server refuses a call whose format is not its own
UNIMPLEMENTED, naming both, before the call's method runs, with ``MISMATCH_KEY`` in its
trailing metadata.  No daemon retries it (``upstream.Patient``): the caller stops with that
line and exit code 2, as for a bad config (systemd does not restart it: replace the image).

Builds from before wire format 2 state nothing; they are refused in the same way by any
server of this build.  (A client of this build calling a server from before format 2 is
not refused by that server, which does not check: its digests differ, as before.)  From
format 2 on, whichever side is newer names the mismatch.

Bump ``WIRE_FORMAT`` with any change a peer of the previous build would misread, the
digest format's first (``DIGEST_FORMATS`` says which digest format each wire format uses;
a unit test ties the two).

Format 3: a push sends its header, then waits for the server's go (its initial metadata,
``GO_KEY``) before it sends data.  A server sends it once the push may read its data
(``calls.Watch.requests``: after its reading slot, ``CallLimits.reading``), so a push
waiting in line holds no data at the server, where before it held what gRPC's stream
window let in (about 3 MiB each, measured: bench/bench_waiting_push.py).  A client of
format 3 would wait for ever on a server of format 2, which sends no go; the format check
refuses it at once instead.
"""

from __future__ import annotations

from typing import Any

import grpc

WIRE_FORMAT = 3
"""This build's wire format."""
DIGEST_FORMATS = {2: 2, 3: 2}
"""Wire format -> the digest format (``common/digest.DIGEST_FORMAT``) of its digests."""
FORMAT_KEY = "hypertrain-wire-format"
"""The metadata key of the caller's wire format (gRPC metadata keys are lowercase)."""
FORMAT_METADATA = ((FORMAT_KEY, str(WIRE_FORMAT)),)
GO_KEY = "hypertrain-go"
"""The metadata key of a server's go to a push: send your data now (format 3)."""
GO_METADATA = ((GO_KEY, "1"),)


def format_refusal(context: grpc.ServicerContext) -> str | None:
    """Why the call on ``context`` is refused (its caller's wire format is not this
    build's, or it states none), or None when the formats agree."""
    stated = [v for k, v in context.invocation_metadata() or () if k == FORMAT_KEY]
    if stated == [str(WIRE_FORMAT)]:
        return None
    if not stated:
        said = (
            f"the caller states no wire format (no {FORMAT_KEY} metadata): a hypertrain "
            f"build from before wire format {WIRE_FORMAT}, or a client that is not one"
        )
    else:
        said = f"the caller speaks wire format {', '.join(map(_shown, stated))}"
    return (
        f"{said}; this server speaks wire format {WIRE_FORMAT}: run one hypertrain build "
        "(or builds of one wire format) across a run"
    )


def _shown(value: str | bytes) -> str:
    """A stated value as a log line may show it (at most 16 printable ASCII characters;
    quoted unless a number)."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    clean = "".join(c if " " <= c <= "~" else "?" for c in text[:16])
    return repr(clean) if clean != text or not clean.isdigit() else clean


def stated(metadata: Any = None) -> tuple[tuple[str, str], ...]:
    """A call's ``metadata`` with this build's wire format added."""
    return (*(metadata or ()), *FORMAT_METADATA)


class Stating:
    """A multicallable (``channel.unary_unary(...)`` and the like) whose every call states
    this build's wire format beside the metadata it is given; what ``client._fast_stub``
    makes every stub method.  (Not a channel interceptor: ``grpc.intercept_channel`` makes
    the underlying multicallable at each call, and one first called after its channel
    closed crashed the process in grpc 1.85 instead of raising.)"""

    __slots__ = ("_call",)

    def __init__(self, multicallable: Any) -> None:
        self._call = multicallable

    def __call__(
        self, request: Any, timeout: float | None = None, metadata: Any = None, **kw: Any
    ) -> Any:
        return self._call(request, timeout=timeout, metadata=stated(metadata), **kw)

    def with_call(
        self, request: Any, timeout: float | None = None, metadata: Any = None, **kw: Any
    ) -> Any:
        return self._call.with_call(request, timeout=timeout, metadata=stated(metadata), **kw)

    def future(
        self, request: Any, timeout: float | None = None, metadata: Any = None, **kw: Any
    ) -> Any:
        return self._call.future(request, timeout=timeout, metadata=stated(metadata), **kw)
