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

- **Pushes reading at once** (``CallLimits.reading``): a streaming request (a push) takes
  one of ``reading`` slots once its first part (the header) has been read, before it reads
  its data, and gives it back when it has read its last part; a push that finds no slot
  free waits, first come first served, neither reading nor counted by the watchdog (its
  bounds start again when it is let in), and is told to send its data only once let in
  (``Watch.go``, wire format 3: until then the client sends nothing past its header).
  What a server holds for the pushes it receives is then that of ``reading`` transfers
  plus a header and a waiting thread for each other one (bench/bench_waiting_push.py),
  not that of every push at once (bench/bench_sync_scale.py --part A --islands 8, P = 1e8:
  the relay's peak less the interpreter 2.22-2.23m with every push reading, 2.16-2.20m
  with two in five runs, against a bound of 2m + 64 MiB = 2.17m; experiments/results/
  bench_sync_scale_reading_ab.json).
  A slot holder that moves less than ``FAST_BYTES_S`` over a window of ``FAST_S`` (a
  slow link, a stall, a trickle) does not count against the slots until a window in
  which it moves faster, so it never holds the others back: they are let in beside it;
  and the slots count callers, not calls, so one caller's pushes take at most one.  What
  a member can still do: count in one slot for as long as a push of the largest size
  takes at ``FAST_BYTES_S`` (its counted windows each moved that much), delaying the
  pushes in line by about that much.  (A holder found slow once and never counted again
  was tried: an honest push with one slow half second then stopped counting, and with 8
  islands every push read at once again, bench_sync_scale.py: 2m + 88 MiB.)

Nothing here is taped: these are transport limits, not decisions about deltas.
"""

from __future__ import annotations

import collections
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
from hypertrain.wire.wireformat import GO_METADATA

log = logging.getLogger("hypertrain.wire")

#: Threads a server keeps beyond every member at its cap (operators' Status calls,
#: a member's retry while its old call is being ended).
HEADROOM = 8
#: How often the watchdog looks at the calls in flight.
POLL_S = 0.5
#: A push holding a reading slot counts against the slots only while it moves at least
#: ``FAST_BYTES_S`` bytes a second, measured over windows of ``FAST_S`` seconds.
FAST_S = 0.5
FAST_BYTES_S = 8 << 20
#: How often a push waiting for a slot looks again (a slot given back wakes it at once).
ADMIT_POLL_S = 0.05


@dataclass(frozen=True)
class CallLimits:
    """The bounds (module docstring); the defaults are the daemons' settings' defaults."""

    per_peer: int = 4
    idle_s: float = 30.0
    min_bytes_s: float = 256 * 1024
    reading: int = 2
    """Callers whose pushes read their data at once (0: no limit)."""

    def pool_size(self, members: int) -> int:
        """Threads for a server with ``members`` callers at their caps, plus headroom."""
        return max(16, members * self.per_peer + HEADROOM)


class Watch:
    """One streaming call under watch: bytes moved and when it last moved."""

    def __init__(self, context: grpc.ServicerContext, now: float, caller: str = "") -> None:
        self.context = context
        self.caller = caller  # ``caller_key``: a caller's pushes count once at most
        self.start = self.last = now
        self.bytes = 0
        self.ended: str | None = None  # why the watchdog ended it
        self.waiting = False  # for a reading slot: not watched meanwhile
        self.reading = False  # holds a reading slot
        self.fast = True  # counts against the slots: not slow in its last window (``_counts``)
        self.mark = (now, 0)  # (time, bytes) at the start of its current rate window

    def moved(self, n: int, now: float) -> None:
        self.bytes += n
        self.last = now

    def requests(
        self,
        parts: Iterator[Any],
        clock: Callable[[], float],
        guard: CallGuard | None = None,
    ) -> Iterator[Any]:
        """``parts`` (a request stream), counted; a call the watchdog ended raises
        WireError(DEADLINE_EXCEEDED) with its reason instead of gRPC's bare error.
        ``guard``: its reading slot is taken after the first part and given back after
        the last (``CallGuard.admit``).  After the first part (and the slot), the caller
        is told to send the rest (``go``)."""
        try:
            first = True
            for part in parts:
                self.moved(part_size(part), clock())
                yield part
                if first:
                    if guard is not None:
                        guard.admit(self)
                    self.go()
                first = False
        except grpc.RpcError:
            if self.ended is not None:
                raise WireError(grpc.StatusCode.DEADLINE_EXCEEDED, self.ended) from None
            raise
        finally:
            # (not taking the guard's lock when there is nothing to give back: an
            # abandoned stream is closed wherever the garbage collector runs, which may be
            # a thread holding that lock; its call's end gave the slot back already)
            if guard is not None and self.reading:
                guard.done_reading(self)

    def go(self) -> None:
        """Tell the caller to send its data (wire format 3: ``wireformat.GO_KEY``, the
        call's initial metadata), unless the call ended meanwhile: a push that waited for
        its reading slot sent nothing past its header until now."""
        if self.context.is_active():
            self.context.send_initial_metadata(GO_METADATA)


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
        on_waiting: Callable[[int], None] = lambda n: None,
    ) -> None:
        """``on_refused(reason)``: told of each call refused ("per_peer") or ended
        ("idle", "slow"); ``on_waiting(n)``: the pushes waiting for a reading slot, each
        time that changes: the daemon exports both as metrics."""
        self.limits = limits or CallLimits()
        self.clock = clock
        self.on_refused = on_refused
        self.on_waiting = on_waiting
        self._lock = threading.Lock()
        self._slots = threading.Condition(self._lock)  # a reading slot given back
        self._held: dict[str, int] = {}
        self._watched: set[Watch] = set()
        self._queue: collections.deque[Watch] = collections.deque()  # waiting for a slot
        self._readers: set[Watch] = set()
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
            watch = Watch(context, self.clock(), key) if streaming else None
            if watch is not None:
                self._watched.add(watch)
                self._start()
        try:
            yield watch
        finally:
            if watch is not None:
                self.done_reading(watch)
            with self._lock:
                self._watched.discard(watch)
                left = self._held[key] - 1
                if left:
                    self._held[key] = left
                else:
                    del self._held[key]

    def admit(self, watch: Watch) -> None:
        """Wait for a reading slot for ``watch``'s push (module docstring): first come
        first served, while the call is active; the watchdog's bounds restart once it is
        let in.  A call cancelled meanwhile goes on without one, and its next read fails."""
        limit = self.limits.reading
        if limit <= 0:
            return
        context = watch.context
        with self._slots:
            t0 = self.clock()
            if not self._queue and self._counts(t0) < limit:
                self._let_in(watch, t0)
                return
            watch.waiting = True
            self._queue.append(watch)
            self.on_waiting(len(self._queue))
            try:
                while not (self._queue[0] is watch and self._counts(self.clock()) < limit):
                    if not context.is_active():
                        return
                    self._slots.wait(ADMIT_POLL_S)
                self._let_in(watch, self.clock())
            finally:
                self._queue.remove(watch)
                self.on_waiting(len(self._queue))
                now = self.clock()
                watch.start += now - t0  # the wait is neither idle nor slow
                watch.last = now
                watch.waiting = False  # last: the watchdog reads these without the lock
                self._slots.notify_all()  # the next in line may fit too

    def _let_in(self, watch: Watch, now: float) -> None:
        """``watch`` takes a slot, counted from ``now`` (under the lock)."""
        watch.reading = True
        watch.mark = (now, watch.bytes)
        watch.fast = True
        self._readers.add(watch)

    def done_reading(self, watch: Watch) -> None:
        """Give back ``watch``'s reading slot, if it holds one (idempotent)."""
        with self._slots:
            if watch.reading:
                watch.reading = False
                self._readers.discard(watch)
                self._slots.notify_all()

    def _counts(self, now: float) -> int:
        """What counts against the slots (under the lock): the callers with a slot holder
        that moved at least ``FAST_BYTES_S`` over its last whole window of ``FAST_S``
        since it was let in (or is in its first); a caller counts once however many of
        its pushes hold slots, so one member cannot fill them."""
        callers = set()
        for w in self._readers:
            t, b = w.mark
            if now - t >= FAST_S:
                w.fast = w.bytes - b >= FAST_BYTES_S * (now - t)
                w.mark = (now, w.bytes)
            if w.fast:
                callers.add(w.caller)
        return len(callers)

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
            if w.ended is not None or w.waiting:
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
