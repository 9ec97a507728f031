"""Daemon bootstrap shared by the relay, the aggregator and the island's endpoint.

    server = make_server()
    add_servicer(RelayService(...), server, "Relay")        # not add_RelayServicer_to_server
    address = bind(server, args.listen)                      # "127.0.0.1:0" -> "127.0.0.1:41237"
    server.start()
    return run_until_signal(                                 # SIGTERM/SIGINT handlers, then
        server, on_stop=relay.close, shutdown=shutdown,      # stdout: hypertrain-relay listening
        ready=lambda: announce("relay", address),            #   on 127.0.0.1:41237
    )

The announce line is the one stdout line a daemon prints about its address, flushed at
once, matching ``ANNOUNCE_RE``:

    hypertrain-<role> listening on <host>:<port>

``<role>`` is lowercase letters, digits and dashes; ``<host>`` is what was asked for
(an IPv6 literal keeps its brackets, ``[::1]``) and ``<port>`` is the real bound port.
Launchers and tests start a daemon with ``--listen 127.0.0.1:0`` and read this line.

Servicer methods stay short: decorate them with ``maps_errors`` and raise
``WireError`` / ``HypertrainError``; ``errors.status_of`` turns them into statuses.
"""

from __future__ import annotations

import errno
import functools
import inspect
import itertools
import logging
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from types import FrameType
from typing import Any, NoReturn, TypeVar, cast

import grpc

from hypertrain.common.errors import ConfigError
from hypertrain.common.settings import parse_address
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire import frames
from hypertrain.wire.calls import CallGuard, part_size
from hypertrain.wire.errors import WireError, status_of
from hypertrain.wire.lines import write_line
from hypertrain.wire.options import SERVER_OPTIONS, tune_allocator
from hypertrain.wire.tls import PLAINTEXT, Security
from hypertrain.wire.wireformat import format_refusal

log = logging.getLogger("hypertrain.wire")

#: The announce line (see the module docstring); groups role, address, host, port.
ANNOUNCE_RE = re.compile(
    r"^hypertrain-(?P<role>[a-z][a-z0-9-]*) listening on "
    r"(?P<address>(?P<host>\[[0-9A-Fa-f:.%a-z]+\]|[^\s:\[\]]+):(?P<port>[0-9]{1,5}))$"
)
_ROLE = re.compile(r"[a-z][a-z0-9-]*")
_CHUNKS = (pb.DeltaChunk, pb.MergeChunk)
F = TypeVar("F", bound=Callable[..., Any])


def make_server(max_workers: int = 16) -> grpc.Server:
    """A gRPC server with hypertrain's options (``options.SERVER_OPTIONS``); not started.

    ``max_workers`` threads run RPCs (``CallLimits.pool_size``): each in-flight push or
    a blocked FetchMerge holds one.  As many calls again may wait for a thread; past
    that gRPC answers RESOURCE_EXHAUSTED at once.
    """
    tune_allocator()
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc")
    return grpc.server(pool, options=SERVER_OPTIONS, maximum_concurrent_rpcs=2 * max_workers)


def add_servicer(
    servicer: object, server: grpc.Server, service: str, guard: CallGuard | None = None
) -> None:
    """Register ``servicer`` for ``service`` ("Relay", "Aggregator") of the .proto.

    Same methods and wire format as the generated ``add_<Service>Servicer_to_server``,
    with the zero-copy chunk codec (``frames.py``) for DeltaChunk and MergeChunk: a
    streaming request then yields ``DeltaChunk`` headers and memoryview data parts
    (give it to ``receive_delta``), and a streaming response may yield memoryviews
    (what ``merge_chunks`` produces).  Bytes that do not parse are answered
    INVALID_ARGUMENT naming the problem, never INTERNAL (``frames.Malformed``).  Every
    method runs under ``guard``'s bounds (``calls.py``; default: ``CallLimits()``).
    """
    guard = guard or CallGuard()
    desc = pb.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in desc.methods:
        request = getattr(pb, method.input_type.name)
        response = getattr(pb, method.output_type.name)
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            _guarded(
                getattr(servicer, method.name)
                if method.client_streaming
                else _parsed(getattr(servicer, method.name)),
                guard,
                method.client_streaming,
                method.server_streaming,
            ),
            request_deserializer=frames.decoder(request)
            if request in _CHUNKS
            else frames.parser(request),
            response_serializer=frames.encode
            if response in _CHUNKS
            else response.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(desc.full_name, handlers),)
    )
    server.add_registered_method_handlers(desc.full_name, handlers)


def _guarded(
    method: Callable[..., Any], guard: CallGuard, client_streaming: bool, server_streaming: bool
) -> Callable[..., Any]:
    """``method`` under ``guard``: the caller's cap, and a watch on a streaming call's
    data (requests received, responses sent)."""
    clock = guard.clock
    streaming = client_streaming or server_streaming

    if server_streaming:

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                _check_format(context)  # before anything is sent
                with guard.call(context, streaming) as watch:
                    assert watch is not None
                    if client_streaming:
                        request = watch.requests(request, clock, guard)
                    for part in method(request, context):
                        yield part
                        watch.moved(part_size(part), clock())
            except WireError as exc:  # refused at the cap (the method maps its own)
                _reject(method, context, exc)
                raise

        return stream

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            _check_format(context)
            with guard.call(context, streaming) as watch:
                if watch is not None:  # a streaming request (a push)
                    request = watch.requests(request, clock, guard)
                return method(request, context)
        except WireError as exc:
            _reject(method, context, exc)
            raise

    return unary


def _check_format(context: grpc.ServicerContext) -> None:
    """Refuse a caller of another wire format (``wireformat.py``) before its method runs."""
    refusal = format_refusal(context)
    if refusal is not None:
        raise WireError(grpc.StatusCode.UNIMPLEMENTED, refusal, mismatch=True)


def _parsed(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
    """``behavior`` (a servicer's method for a unary request) behind a check: a request
    that did not parse (``frames.Malformed``) is refused INVALID_ARGUMENT naming the
    problem, and the method never sees it.  (Streamed requests reach the method, whose
    readers refuse it: ``chunks.receive_delta``.)"""

    @functools.wraps(behavior)
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, frames.Malformed):
            _reject(behavior, context, request.error())
        return behavior(request, context)

    return handle


def parse_listen(listen: str) -> tuple[str, int]:
    """Split "HOST:PORT" ("[v6]:PORT" for IPv6); ValueError with an example if malformed."""
    try:
        return parse_address(listen)
    except ConfigError as e:
        raise ValueError(f"bad listen address {e}") from None


def _why_not(host: str, port: int) -> str:
    """The OS's reason a plain socket cannot bind there (gRPC's own error says little)."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve host {host!r} ({exc.strerror})"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind(addr)
            except OSError as exc:
                return f"{exc.strerror or errno.errorcode.get(exc.errno or 0, exc)}"
    return "gRPC refused the address"


def bind(server: grpc.Server, listen: str, security: Security = PLAINTEXT) -> str:
    """Add a port for "HOST:PORT" (port 0: any free one), with mutual TLS or plaintext
    (``tls.Security``); the bound "HOST:PORT"."""
    host, port = parse_listen(listen)
    try:
        bound = security.bind(server, f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if not bound:
        raise ValueError(f"cannot listen on {listen!r}: {_why_not(host, port)}")
    return f"{host}:{bound}"


def announce(role: str, address: str) -> None:
    """Print ``hypertrain-<role> listening on <address>`` to stdout and flush it."""
    line = f"hypertrain-{role} listening on {address}"
    if not _ROLE.fullmatch(role) or not ANNOUNCE_RE.fullmatch(line):
        raise ValueError(f"cannot announce role {role!r} at {address!r}: not a parseable line")
    write_line(line)


class Shutdown:
    """A stop request: set by a signal or by the daemon itself when its run is done."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason: str | None = None
        self.failed = False
        """Set with the first reason when that stop is a failure (the daemon exits
        ``code``): a failure after a clean stop was asked (a call cut short by it) does
        not count."""
        self.code = 1

    def request(self, reason: str, failed: bool = False, code: int = 1) -> None:
        """Ask the daemon to stop; the first reason is kept (and logged).  ``failed``: the
        daemon cannot go on (its store failed, say) and exits with ``code`` (2: its setup
        is wrong, as for a bad config, and a restart cannot help)."""
        with self._lock:
            if self.reason is None:
                self.reason, self.failed, self.code = reason, failed, code
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until requested (True) or ``timeout`` seconds pass (False)."""
        return self._event.wait(timeout)


class PartShutdown(Shutdown):
    """The stop request of one part of a daemon (a streaming fragment's node): ``final``,
    the part's own run-complete reason, stops the daemon once all ``count`` parts sharing
    ``parts`` have asked it (a part that recovers a finished run asks while the daemon
    starts, before the others exist); any other reason (a failure) stops the daemon at
    once; a stop of the daemon (``whole``: a signal) is every part's."""

    def __init__(self, whole: Shutdown, parts: list[PartShutdown], final: str, count: int) -> None:
        super().__init__()
        self.whole = whole
        self.parts = parts
        self.final = final
        self.count = count
        parts.append(self)

    def request(self, reason: str, failed: bool = False, code: int = 1) -> None:
        super().request(reason, failed, code)
        done = sum(p._event.is_set() for p in self.parts)
        if failed or not reason.startswith(self.final) or done == self.count:
            self.whole.request(reason, failed, code)

    @property
    def requested(self) -> bool:
        return self._event.is_set() or self.whole.requested


def push_fragment(chunks: Iterator[Any], count: int) -> tuple[int, Iterator[Any]]:
    """The streaming fragment a pushed delta names in its header (0 where it names none,
    or the stream does not start with a header: that part then refuses it by name), and
    the stream as it was.  INVALID_ARGUMENT for a fragment the run does not have."""
    first = next(chunks, None)
    index = 0
    header = first.header if isinstance(first, pb.DeltaChunk) and first.HasField("header") else None
    if header is not None and header.HasField("fragment"):
        index = header.fragment
        if index >= count:
            raise WireError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"delta of fragment {index}: the run has {count} fragments",
            )
    rest = chunks if first is None else itertools.chain([first], chunks)
    return index, rest


def fragment_of(request: Any, count: int) -> int:
    """The streaming fragment a fetch or status request names (0 where it names none);
    INVALID_ARGUMENT for one the run does not have."""
    index = request.fragment if request.HasField("fragment") else 0
    if index >= count:
        raise WireError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"fragment {index}: the run has {count} fragments",
        )
    return int(index)


def run_until_signal(
    server: grpc.Server,
    on_stop: Callable[[], None] | None = None,
    grace: float = 5.0,
    *,
    shutdown: Shutdown | None = None,
    ready: Callable[[], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT or ``shutdown.request``; then ``on_stop``, drain, return 0.

    Signal handlers are installed only when called from the main thread (elsewhere,
    e.g. in tests, stop it with ``shutdown``) and restored before draining, so a second
    Ctrl-C interrupts a slow drain.  ``ready`` (the daemons' "listening on" line) runs
    once they are installed: whoever reads that line and signals at once gets a clean
    stop, not the default SIGTERM death.  ``server.stop(grace)`` lets calls in flight
    finish for ``grace`` seconds, then cancels them.
    """
    stop = shutdown if shutdown is not None else Shutdown()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.request(f"signal {signal.Signals(signum).name}")

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    if ready is not None:
        ready()
    try:
        while not stop.wait(0.5):  # short waits: the main thread must run signal handlers
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    log.info("stopping: %s", stop.reason)
    try:
        if on_stop is not None:
            on_stop()
    finally:
        server.stop(grace).wait()
    return 0


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the RPC with ``code`` and ``message`` (``context.abort`` raises)."""
    context.abort(code, message)
    raise AssertionError("grpc context.abort returned")  # pragma: no cover


def _reject(method: Callable[..., Any], context: grpc.ServicerContext, exc: Exception) -> None:
    status = status_of(exc)
    if status is None:
        return  # not ours: a bug; gRPC logs it and answers UNKNOWN
    # "Not yet" answers (a round not open, a merge not committed) are part of the
    # protocol's waiting, asked again every few seconds: not worth a warning each.
    level = logging.DEBUG if status[0] in _NOT_YET else logging.WARNING
    more = _LOG_LIMIT.admit((method.__qualname__, status[0]))
    if more is not None:
        extra = f" (and {more} more like it in the last {LOG_EVERY_S:g} s)" if more else ""
        log.log(
            level, "%s rejected: %s: %s%s", method.__qualname__, status[0].name, status[1], extra
        )
    if isinstance(exc, WireError) and exc.mark is not None:
        context.set_trailing_metadata(((exc.mark, "1"),))
    abort(context, *status)


_NOT_YET = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED)

#: Refusals of one kind (method and status) are logged at most once per this many seconds;
#: the next line says how many were left out (a flood of bad calls cannot flood the log).
LOG_EVERY_S = 1.0


class RateLimit:
    """At most one admission per key every ``every`` seconds (monotonic clock)."""

    def __init__(self, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self._last: dict[Any, float] = {}
        self._skipped: dict[Any, int] = {}
        self._lock = threading.Lock()

    def admit(self, key: Any) -> int | None:
        """None: leave this one out; otherwise how many of ``key`` were left out since the
        last one admitted."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every:
                self._skipped[key] = self._skipped.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._skipped.pop(key, 0)


_LOG_LIMIT = RateLimit(LOG_EVERY_S)


def maps_errors(method: F) -> F:
    """Decorate a servicer method: ``WireError`` / ``HypertrainError`` become statuses.

    Works for unary and streaming methods (server-streaming generators included); the
    last positional argument must be the ``grpc.ServicerContext``.
    """
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(*args: Any) -> Iterator[Any]:
            try:
                yield from method(*args)
            except Exception as exc:
                _reject(method, args[-1], exc)
                raise

        return cast(F, stream)

    @functools.wraps(method)
    def unary(*args: Any) -> Any:
        try:
            return method(*args)
        except Exception as exc:
            _reject(method, args[-1], exc)
            raise

    return cast(F, unary)
