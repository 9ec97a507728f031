"""Bounds on the calls a server holds: per caller, and per streaming call over time.

A server's RPCs run on a fixed pool of threads, and a streaming call holds one for as
long as it lasts.  Without bounds, a few connections that open a push and then send
nothing (or trickle) hold every thread and the honest islands get no round through.

- **Per caller** (``CallLimits.per_peer``): a caller (its certificate's name; in
  plaintext, its connection) may have at most this many calls in flight; one more is
  answered RESOURCE_EXHAUSTED "<caller> has N calls in flight here (the most per
  caller)" at once, holding nothing.  The server's pool (``pool_size``) has room for
  every member at its cap and ``HEADROOM`` more, so members at their caps never keep
  another member out.
- **Per streaming call**: a call that moves no data (received chunks of a push, sent
  chunks of a fetch) for ``idle_s`` seconds, or that averages less than
  ``min_bytes_s`` after its first ``idle_s`` seconds, is ended DEADLINE_EXCEEDED with a
  message saying which bound and the figures.  So a push of ``size`` bytes lasts at
  most ``idle_s + size / min_bytes_s`` seconds.  One watchdog thread per server checks
  every call each ``POLL_S``; it ends a call by cancelling it in gRPC core with that
  status, which also wakes the handler blocked waiting for the next chunk.  The
  handler then sees a ``WireError`` with the same status (``Watch.requests``).

Nothing here is taped: these are transport limits, not decisions about deltas.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from hypertrain.wire.errors import WireError
from hypertrain.wire.tls import caller_key

log = logging.getLogger("hypertrain.wire")

#: Threads a server keeps beyond every member at its cap (operators' Status calls,
#: a member's retry while its old call is being ended).
HEADROOM = 8
#: How often the watchdog looks at the calls in flight.
POLL_S = 0.5


@dataclass(frozen=True)
class CallLimits:
    """The bounds (module docstring); the defaults are the daemons' settings' defaults."""

    per_peer: int = 4
    idle_s: float = 30.0
    min_bytes_s: float = 256 * 1024

    def pool_size(self, members: int) -> int:
        """Threads for a server with ``members`` callers at their caps, plus headroom."""
        return max(16, members * self.per_peer + HEADROOM)


class Watch:
    """One streaming call under watch: bytes moved and when it last moved."""

    def __init__(self, context: grpc.ServicerContext, now: float) -> None:
        self.context = context
        self.start = self.last = now
        self.bytes = 0
        self.ended: str | None = None  # why the watchdog ended it

    def moved(self, n: int, now: float) -> None:
        self.bytes += n
        self.last = now

    def requests(self, parts: Iterator[Any], clock: Callable[[], float]) -> Iterator[Any]:
        """``parts`` (a request stream), counted; a call the watchdog ended raises
        WireError(DEADLINE_EXCEEDED) with its reason instead of gRPC's bare error."""
        try:
            for part in parts:
                self.moved(part_size(part), clock())
                yield part
        except grpc.RpcError:
            if self.ended is not None:
                raise WireError(grpc.StatusCode.DEADLINE_EXCEEDED, self.ended) from None
            raise


def part_size(part: object) -> int:
    """Data bytes of a chunk part (a header message counts as none)."""
    return len(part) if isinstance(part, bytes | bytearray | memoryview) else 0


class CallGuard:
    """A server's per-caller caps and its watchdog over streaming calls."""

    def __init__(
        self,
        limits: CallLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        """``on_refused(reason)``: told of each call refused ("per_peer") or ended
        ("idle", "slow"): the daemon counts them in a metric."""
        self.limits = limits or CallLimits()
        self.clock = clock
        self.on_refused = on_refused
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._watched: set[Watch] = set()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def call(self, context: grpc.ServicerContext, streaming: bool) -> Iterator[Watch | None]:
        """Hold one of the caller's calls (RESOURCE_EXHAUSTED past its cap) for the
        block; a streaming call is watched meanwhile."""
        key = caller_key(context)
        cap = self.limits.per_peer
        with self._lock:
            held = self._held.get(key, 0)
            if held >= cap:
                self.on_refused("per_peer")
                raise WireError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{key} has {held} calls in flight here (the most per caller); "
                    "wait for one to end",
                )
            self._held[key] = held + 1
            watch = Watch(context, self.clock()) if streaming else None
            if watch is not None:
                self._watched.add(watch)
                self._start()
        try:
            yield watch
        finally:
            with self._lock:
                self._watched.discard(watch)
                left = self._held[key] - 1
                if left:
                    self._held[key] = left
                else:
                    del self._held[key]

    def held(self) -> dict[str, int]:
        """Calls in flight per caller (a copy)."""
        with self._lock:
            return dict(self._held)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="call-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            self.check()

    def check(self) -> list[Watch]:
        """End every watched call past a bound; returns them (the watchdog's one pass)."""
        now = self.clock()
        lim = self.limits
        ended = []
        with self._lock:
            watched = list(self._watched)
        for w in watched:
            if w.ended is not None:
                continue
            quiet, age = now - w.last, now - w.start
            if quiet > lim.idle_s:
                reason = "idle"
                w.ended = f"no data moved for {quiet:.0f} s (the idle bound is {lim.idle_s:g} s)"
            elif age > lim.idle_s and w.bytes < lim.min_bytes_s * (age - lim.idle_s):
                reason = "slow"
                w.ended = (
                    f"{w.bytes} bytes in {age:.0f} s: slower than the least rate of "
                    f"{lim.min_bytes_s / 1024:g} KiB/s after the first {lim.idle_s:g} s"
                )
            else:
                continue
            # At most one line per call, and a call lasts at least idle_s: bounded.
            log.warning("ended a call from %s: %s", caller_key(w.context), w.ended)
            _cancel(w.context, w.ended)
            self.on_refused(reason)
            ended.append(w)
        return ended


def _cancel(context: grpc.ServicerContext, message: str) -> None:
    """End a call from outside its handler with DEADLINE_EXCEEDED and ``message``.

    gRPC's Python servicer context can only abort from the handler's own thread (and a
    handler blocked waiting for a chunk never gets there); its core call object can
    be cancelled from anywhere with a status, which the client receives as it is and
    which wakes the blocked handler.  Without that object (another gRPC), the plain
    ``cancel`` still ends the call (the client then sees CANCELLED)."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        from grpc._cython import cygrpc

        call.cancel(cygrpc.StatusCode.deadline_exceeded, message)  # type: ignore[union-attr]
    except (AttributeError, ImportError, TypeError):
        context.cancel()
