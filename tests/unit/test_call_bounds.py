"""CallGuard: the per-caller cap and the watchdog's two bounds, on a fake clock."""

from __future__ import annotations

import grpc
import pytest

from hypertrain.wire.calls import HEADROOM, CallGuard, CallLimits
from hypertrain.wire.errors import WireError


class Context:
    """What CallGuard asks of a servicer context (plaintext: the caller is its address)."""

    def __init__(self, peer: str = "ipv4:10.0.0.1:5000", name: str | None = None) -> None:
        self._peer, self._name = peer, name
        self.cancelled = 0

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_common_name": [self._name.encode()]} if self._name else {}

    def peer(self) -> str:
        return self._peer

    def cancel(self) -> None:
        self.cancelled += 1


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
