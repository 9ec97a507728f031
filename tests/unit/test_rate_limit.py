"""Refusals are logged at a bounded rate (services/wire/server.py RateLimit)."""

from hypertrain.wire.server import RateLimit


def test_one_line_per_key_per_interval_and_the_next_says_how_many_were_left_out() -> None:
    now = [0.0]
    limit = RateLimit(1.0, clock=lambda: now[0])
    assert limit.admit("a") == 0
    assert [limit.admit("a") for _ in range(5)] == [None] * 5
    assert limit.admit("b") == 0  # another kind is not held back by the first
    now[0] = 1.0
    assert limit.admit("a") == 5
    assert limit.admit("a") is None
    now[0] = 2.5
    assert limit.admit("a") == 1 and limit.admit("b") == 0
