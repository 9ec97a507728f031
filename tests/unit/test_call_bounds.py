"""CallGuard: the per-caller cap and the watchdog's two bounds, on a fake clock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hypertrain.wire import calls
from hypertrain.wire.calls import HEADROOM, CallGuard, CallLimits, Watch
from hypertrain.wire.errors import WireError
from hypertrain.wire.wireformat import GO_METADATA


class Context:
    """What CallGuard asks of a servicer context (plaintext: the caller is its address)."""

    def __init__(self, peer: str = "ipv4:10.0.0.1:5000", name: str | None = None) -> None:
        self._peer, self._name = peer, name
        self.cancelled = 0
        self.active = True
        self.sent: tuple[tuple[str, str], ...] | None = None  # initial metadata

    def is_active(self) -> bool:
        return self.active

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_common_name": [self._name.encode()]} if self._name else {}

    def peer(self) -> str:
        return self._peer

    def cancel(self) -> None:
        self.cancelled += 1

    def send_initial_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        if self.sent is not None:
            raise ValueError("Initial metadata no longer allowed!")  # as gRPC's context
        self.sent = metadata


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


LIMITS = CallLimits(per_peer=2, idle_s=10.0, min_bytes_s=1000.0)


@pytest.fixture(autouse=True)
def _no_watchdog_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests make the watchdog's passes themselves (``check``) on the fake clock; the
    real thread, on the same clock, could make one between a test's tick and its check."""
    monkeypatch.setattr(CallGuard, "_start", lambda self: None)


def test_a_caller_past_its_cap_is_refused_and_others_are_not() -> None:
    refused: list[str] = []
    guard = CallGuard(LIMITS, on_refused=refused.append)
    eve = Context(name="island-eu-1")
    with guard.call(eve, False), guard.call(Context(peer="x", name="island-eu-1"), False):
        with pytest.raises(WireError) as err, guard.call(eve, False):
            pass
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "island-eu-1 has 2 calls in flight here" in err.value.message
        with guard.call(Context(name="island-eu-0"), False):  # another caller: its own cap
            assert guard.held() == {"island-eu-1": 2, "island-eu-0": 1}
    assert guard.held() == {} and refused == ["per_peer"]
    with guard.call(eve, False):  # released: admitted again
        pass


def test_a_call_that_moves_nothing_is_ended_after_the_idle_bound() -> None:
    clock, refused = Clock(), []
    guard = CallGuard(LIMITS, clock, on_refused=refused.append)
    ctx = Context()
    with guard.call(ctx, True) as watch:
        assert watch is not None
        clock.t += 10.0
        assert guard.check() == []  # at the bound, not past it
        clock.t += 0.5
        assert guard.check() == [watch] and ctx.cancelled == 1
        assert watch.ended is not None and "no data moved for 10 s" in watch.ended
        assert guard.check() == []  # ended once
    assert refused == ["idle"]


def test_a_trickle_is_ended_by_the_least_rate_and_a_steady_call_is_not() -> None:
    clock = Clock()
    guard = CallGuard(LIMITS, clock)
    slow, steady = Context(peer="a"), Context(peer="b")
    with guard.call(slow, True) as s, guard.call(steady, True) as f:
        assert s is not None and f is not None
        for _ in range(30):  # 30 s: one byte a second, and 1000 bytes a second
            clock.t += 1.0
            s.moved(1, clock.t)
            f.moved(1000, clock.t)
            ended = guard.check()
            if ended:
                break
        assert ended == [s] and slow.cancelled == 1 and steady.cancelled == 0
        assert s.ended is not None and "slower than the least rate of 0.976562 KiB/s" in s.ended
        assert clock.t == 11.0 + 100.0  # the first second past the idle bound's grace


def test_ended_requests_raise_the_reason_not_grpcs_bare_error() -> None:
    guard = CallGuard(LIMITS, Clock())
    ctx = Context()

    def parts():  # type: ignore[no-untyped-def]
        yield b"abc"
        raise grpc.RpcError()  # what gRPC's iterator raises once the call is cancelled

    with guard.call(ctx, True) as watch:
        assert watch is not None
        it = watch.requests(parts(), guard.clock)
        assert next(it) == b"abc" and watch.bytes == 3
        watch.ended = "no data moved for 31 s (the idle bound is 30 s)"
        with pytest.raises(WireError) as err:
            next(it)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.message.startswith("no data moved")


def test_the_pool_has_room_for_every_member_at_its_cap() -> None:
    assert CallLimits(per_peer=4).pool_size(8) == 8 * 4 + HEADROOM
    assert CallLimits(per_peer=1).pool_size(1) == 16


# -- pushes reading at once ------------------------------------------------------------
def _push(watch: Watch, guard: CallGuard, data: int = 3) -> Iterator[object]:
    """A push's request stream under ``guard``: a header, then ``data`` parts of 1 KiB."""
    parts = iter([object(), *[b"x" * 1024] * data])
    return watch.requests(parts, guard.clock, guard)


def _start(it: Iterator[object]) -> threading.Thread:
    """Read ``it`` to its end on a thread of its own (the handler)."""
    t = threading.Thread(target=lambda: list(it), daemon=True)
    t.start()
    return t


def _until(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _hold_and_queue(
    guard: CallGuard, holder: Watch, waiter: Watch
) -> tuple[Iterator[object], threading.Thread]:
    """``holder``'s push takes the one slot (while its stream, returned, is alive: a
    stream dropped gives its slot back); ``waiter``'s, on its own thread, waits for it."""
    it = _push(holder, guard)
    next(it), next(it)
    assert holder.reading
    waiting = _push(waiter, guard)
    next(waiting)
    t = _start(waiting)
    _until(lambda: waiter.waiting)
    return it, t


def test_a_push_past_the_reading_slots_waits_after_its_header_first_come_first_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock, waiting, order = Clock(), [], []
    limits = CallLimits(per_peer=2, idle_s=10.0, min_bytes_s=1000.0, reading=1)
    guard = CallGuard(limits, clock, on_waiting=waiting.append)
    let_in = guard._let_in
    monkeypatch.setattr(
        guard, "_let_in", lambda w, now: (order.append(w.context._peer), let_in(w, now))
    )
    a, b, c = Context(peer="a"), Context(peer="b"), Context(peer="c")
    with guard.call(a, True) as wa, guard.call(b, True) as wb, guard.call(c, True) as wc:
        assert wa is not None and wb is not None and wc is not None
        ia = _push(wa, guard)
        next(ia), next(ia)  # the header, then a's first data part: a holds the slot
        assert wa.reading
        ib, ic = _push(wb, guard), _push(wc, guard)
        next(ib)  # b's header is read; its data waits for the slot
        tb = _start(ib)
        _until(lambda: wb.waiting)
        next(ic)
        tc = _start(ic)
        _until(lambda: wc.waiting)
        clock.t += 60.0  # far past the idle bound: waiting calls are not ended
        assert guard.check() == [wa] and not b.cancelled and not c.cancelled
        assert list(ia) == [b"x" * 1024] * 2  # a reads to its end: the slot is b's
        tb.join(5)
        assert not tb.is_alive() and wb.bytes == 3 * 1024 and not wb.reading
        tc.join(5)  # then c's, in the order they came
        assert not tc.is_alive() and wc.bytes == 3 * 1024
        # the bounds of a call let in restart: its wait counts neither as idle nor slow
        assert wc.start == clock.t and wc.last == clock.t
    assert guard._readers == set() and not guard._queue
    assert waiting == [1, 2, 1, 0]  # the gauge of pushes waiting: b, then c; b in; c in
    assert order == ["a", "b", "c"]


def test_a_push_is_told_to_send_its_data_once_it_holds_a_slot_not_before() -> None:
    """The go (wire format 3: the call's initial metadata) goes after the header, and
    for a push in line only once it is let in; never to a call that ended meanwhile."""
    guard = CallGuard(CallLimits(reading=1), Clock())
    a, b, c = Context(peer="a"), Context(peer="b"), Context(peer="c")
    with guard.call(a, True) as wa, guard.call(b, True) as wb, guard.call(c, True) as wc:
        assert wa is not None and wb is not None and wc is not None
        ia = _push(wa, guard)
        next(ia)
        assert a.sent is None  # the header is read: not told yet (it may be refused)
        next(ia)
        assert a.sent == GO_METADATA and wa.reading
        ib = _push(wb, guard)
        next(ib)
        tb = _start(ib)
        _until(lambda: wb.waiting)
        ic = _push(wc, guard)
        next(ic)
        tc = _start(ic)
        _until(lambda: wc.waiting)
        c.active = False  # c's caller gave up while in line
        time.sleep(3 * calls.ADMIT_POLL_S)
        assert b.sent is None and c.sent is None  # in line: no data asked for
        assert list(ia) == [b"x" * 1024] * 2  # a ends: b is let in
        tb.join(5)
        tc.join(5)
        assert b.sent == GO_METADATA and c.sent is None


def test_a_slow_slot_holder_stops_counting_and_lets_the_next_push_in() -> None:
    clock = Clock()
    guard = CallGuard(CallLimits(reading=1), clock)
    slow, next_ = Context(peer="slow"), Context(peer="next")
    with guard.call(slow, True) as ws, guard.call(next_, True) as wn:
        assert ws is not None and wn is not None
        _held, t = _hold_and_queue(guard, ws, wn)
        clock.t += calls.FAST_S / 2  # within its first window: still counted
        time.sleep(3 * calls.ADMIT_POLL_S)
        assert wn.waiting
        ws.moved(1024, clock.t)  # 1 KiB in a whole window: far below FAST_BYTES_S
        clock.t += calls.FAST_S
        t.join(5)
        assert not t.is_alive() and wn.bytes == 3 * 1024  # let in beside the slow one
        assert ws.reading and not ws.fast
    assert guard._readers == set()


def test_a_cancelled_waiting_push_leaves_the_line_without_a_slot() -> None:
    clock = Clock()
    guard = CallGuard(CallLimits(reading=1), clock)
    a, b = Context(peer="a"), Context(peer="b")
    with guard.call(a, True) as wa, guard.call(b, True) as wb:
        assert wa is not None and wb is not None
        _held, t = _hold_and_queue(guard, wa, wb)
        b.active = False  # the client went away (or the server stops)
        t.join(5)
        assert not t.is_alive() and not wb.reading and not guard._queue
        assert guard._readers == {wa}
    assert guard._readers == set()  # the call's end gives a's slot back too


def test_a_handler_that_fails_mid_push_gives_its_slot_back() -> None:
    guard = CallGuard(CallLimits(reading=1), Clock())
    ctx = Context()
    with pytest.raises(RuntimeError), guard.call(ctx, True) as watch:
        assert watch is not None
        it = _push(watch, guard)
        next(it), next(it)
        assert guard._readers == {watch}
        raise RuntimeError("the handler refused the data")
    assert guard._readers == set() and not watch.reading


def test_no_reading_limit_lets_every_push_read() -> None:
    guard = CallGuard(CallLimits(reading=0), Clock())
    ctxs = [Context(peer=str(i)) for i in range(4)]
    with guard.call(ctxs[0], True) as w0, guard.call(ctxs[1], True) as w1:
        assert w0 is not None and w1 is not None
        its = [_push(w, guard) for w in (w0, w1)]
        for it in its:
            next(it), next(it)
        assert not w0.waiting and not w1.waiting and guard._readers == set()


def test_a_slow_holder_counts_again_once_it_moves_fast() -> None:
    clock = Clock()
    guard = CallGuard(CallLimits(reading=1), clock)
    slow, first, second = Context(peer="slow"), Context(peer="1"), Context(peer="2")
    with guard.call(slow, True) as ws, guard.call(first, True) as w1:
        assert ws is not None and w1 is not None
        _held, t = _hold_and_queue(guard, ws, w1)
        clock.t += calls.FAST_S  # a window with nothing moved: slow
        t.join(5)
        assert not t.is_alive() and not ws.fast and not w1.reading  # 1 read to its end
        ws.moved(calls.FAST_BYTES_S, clock.t)  # a whole window at full speed
        clock.t += calls.FAST_S
        with guard.call(second, True) as w2:
            assert w2 is not None
            it = _push(w2, guard)
            next(it)
            t2 = _start(it)
            _until(lambda: w2.waiting)  # it counts again: 2 waits
            assert ws.fast
            clock.t += calls.FAST_S  # and a slow window again: 2 is let in
            t2.join(5)
            assert not t2.is_alive() and w2.bytes == 3 * 1024 and not ws.fast


def test_a_callers_pushes_take_one_slot_between_them() -> None:
    guard = CallGuard(CallLimits(reading=2), Clock())
    eve1, eve2 = Context(name="island-eu-1"), Context(name="island-eu-1")  # one caller
    other, late = Context(name="island-eu-0"), Context(name="island-eu-2")
    with guard.call(eve1, True) as e1, guard.call(eve2, True) as e2:
        assert e1 is not None and e2 is not None
        ie1, ie2 = _push(e1, guard), _push(e2, guard)
        next(ie1), next(ie1), next(ie2), next(ie2)  # both of eve's in: they count once
        with guard.call(other, True) as o, guard.call(late, True) as w:
            assert o is not None and w is not None
            io = _push(o, guard)
            next(io)
            took = threading.Thread(target=lambda: next(io), daemon=True)
            took.start()  # another caller: the second slot
            took.join(5)
            assert not took.is_alive() and e1.reading and e2.reading and o.reading
            iw = _push(w, guard)
            next(iw)
            t = _start(iw)
            _until(lambda: w.waiting)  # two callers count: the third waits
            time.sleep(3 * calls.ADMIT_POLL_S)
            assert w.waiting
            assert list(ie1) == [b"x" * 1024] * 2 and w.waiting  # eve still counts once
            assert list(ie2) == [b"x" * 1024] * 2  # eve's last gives the slot
            t.join(5)
            assert not t.is_alive() and w.bytes == 3 * 1024


@pytest.mark.parametrize("spooled", [True, False])
def test_a_push_holds_no_sink_until_its_first_data_part(tmp_path: Path, spooled: bool) -> None:
    """``receive_delta`` makes its sink (worker threads, a spool file) once the first data
    part is in, not at the header: a push waiting for a reading slot between the two
    (``Watch.requests``) holds neither.  The delta still lands whole."""
    from hypertrain.common.digest import blob_digest
    from hypertrain.v1 import hypertrain_pb2 as pb
    from hypertrain.wire.chunks import delta_chunks, receive_delta

    blob = bytes(range(256)) * 4096 * 3  # 3 MiB: three chunks
    header = pb.TransferHeader(digest=blob_digest(blob), size=len(blob))
    spool = tmp_path / "spool"
    spool.mkdir()
    seen: dict[str, object] = {}

    def parts() -> Iterator[object]:
        stream = iter(delta_chunks(header, blob))
        yield next(stream)  # the header
        # Here a push would wait for its reading slot.
        seen["threads"] = sorted(
            t.name for t in threading.enumerate() if t.name.startswith("wire-")
        )
        seen["files"] = sorted(p.name for p in spool.iterdir())
        yield from stream

    got = receive_delta(parts(), max_size=len(blob), spool_dir=spool if spooled else None)
    assert seen == {"threads": [], "files": []}
    assert got.digest == header.digest and bytes(got.data) == blob
