"""Who has downloaded a merge (``MergeBoard.serve``), which a daemon waits for before it
writes the round's checkpoint (``CHECKPOINT_HOLD_S``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hypertrain.common.aggregate import Commitment
from hypertrain.common.config import RunConfig
from hypertrain.common.rounds.machines import Committed
from hypertrain.wire import rounds
from hypertrain.wire.rounds import MergeBoard
from hypertrain.wire.server import Shutdown


def _merge(step: int, members: tuple[str, ...] = ("eu", "us")) -> Committed:
    return Committed(
        "global",
        step // 4,
        step,
        step,
        Commitment({}, members, tuple("0" * 64 for _ in members), ""),
        torch.ones(3),
        "global",
        None,
    )


def test_when_all_is_called_once_every_member_took_the_last_part() -> None:
    board = MergeBoard(RunConfig(), Shutdown())
    merge = _merge(4)
    calls: list[int] = []
    parts = list(board.serve(merge, "eu", merge.commitment.members, lambda: calls.append(1)))
    assert len(parts) == 2  # the header and the 12 bytes
    assert calls == [] and board.served[(4, "global")] == {"eu"}
    cut = board.serve(merge, "us", merge.commitment.members, lambda: calls.append(1))
    next(cut)  # a download cut short after its header counts for nothing
    cut.close()
    assert calls == [] and board.served[(4, "global")] == {"eu"}
    list(board.serve(merge, "us", merge.commitment.members, lambda: calls.append(1)))
    assert calls == [1] and board.served[(4, "global")] == {"eu", "us"}


def test_only_the_two_newest_steps_are_remembered() -> None:
    board = MergeBoard(RunConfig(), Shutdown())
    for step in (4, 8, 12):
        list(board.serve(_merge(step), "eu"))
    assert sorted(board.served) == [(8, "global"), (12, "global")]


def test_wait_served_returns_when_the_members_have_it() -> None:
    board = MergeBoard(RunConfig(), Shutdown())
    merge = _merge(4)
    got: list[bool] = []
    waiter = threading.Thread(
        target=lambda: got.append(board.wait_served(4, "global", ("eu", "us"), lambda: False))
    )
    waiter.start()
    list(board.serve(merge, "eu"))
    time.sleep(0.1)
    assert waiter.is_alive()  # one of two
    list(board.serve(merge, "us"))
    waiter.join(5)
    assert got == [True]


def test_wait_served_gives_up_after_the_hold_or_when_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rounds, "CHECKPOINT_HOLD_S", 0.2)
    board = MergeBoard(RunConfig(), Shutdown())
    assert board.wait_served(4, "global", ("eu",), lambda: False) is False
    monkeypatch.setattr(rounds, "CHECKPOINT_HOLD_S", 60.0)
    t0 = time.monotonic()
    assert board.wait_served(4, "global", ("eu",), lambda: True) is False
    assert time.monotonic() - t0 < 30.0
    assert board.wait_served(4, "global", (), lambda: False) is True  # nobody to wait for
