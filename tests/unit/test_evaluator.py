"""The aggregator's held-out evaluation keeps at most one state waiting, and none older
than the newest once a newer one came in."""

from __future__ import annotations

import time

import pytest

from hypertrain.aggregator import server
from hypertrain.aggregator.server import Evaluator
from hypertrain.common.config import RunConfig
from hypertrain.common.roles import initial_parameters
from hypertrain.wire.metrics import Metrics


def _evaluate(
    capsys: pytest.CaptureFixture[str], windows: int, states: list[tuple[int, int]]
) -> tuple[list[str], list[str], list[str]]:
    """Hand an evaluator ``states`` ((round, step), each a slightly scaled theta0) at
    once; its output lines: all, the evaluations, the skips."""
    cfg = RunConfig(holdout_windows=windows)
    layout, theta = initial_parameters(cfg)
    evaluator = Evaluator(cfg, Metrics("aggregator"), layout)
    for round_, step in states:
        evaluator.submit(round_, step, theta * (1 + round_ / 100))
    evaluator.close(finish=True)
    lines = capsys.readouterr().out.splitlines()
    evaluated = [line for line in lines if line.startswith("event=eval ")]
    skipped = [line for line in lines if line.startswith("event=eval_skipped ")]
    return lines, evaluated, skipped


def test_a_newer_state_replaces_the_one_waiting_and_the_newest_is_evaluated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # faster than it evaluates: the waiting state is replaced
    lines, evaluated, skipped = _evaluate(capsys, 4, [(k, 20 * (k + 1)) for k in range(6)])
    assert len(evaluated) + len(skipped) == 6 and len(skipped) >= 3, lines
    assert "round=5 step=120" in evaluated[-1]  # the newest, always
    assert all("is newer and is evaluated instead" in s for s in skipped)


def test_a_state_handed_in_after_a_newer_one_is_skipped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # out of order: two handlers, the older one last
    lines, evaluated, skipped = _evaluate(capsys, 2, [(1, 40), (0, 20)])
    assert evaluated[-1].startswith("event=eval role=aggregator round=1 step=40 ")
    assert any(
        x.startswith("event=eval_skipped role=aggregator round=0 step=20 ") for x in skipped
    ), lines


def _started(evaluator: Evaluator) -> None:
    deadline = time.monotonic() + 120
    while not evaluator.evaluating:  # its model reads the state now
        assert time.monotonic() < deadline, "the evaluation never started"
        time.sleep(0.001)


def test_an_outer_step_ends_the_evaluation_of_a_state_it_does_not_start_from(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before an outer step the node asks the evaluator to hold nothing but the state it
    steps from: an evaluation of an older one ends (at its next batch, logged as
    skipped), the call returns once the model let it go, and the newer state handed in
    after the step is evaluated.  (An outer step holds its old and new parameters and
    the momentum; a stale state under evaluation was a fourth model.)"""
    monkeypatch.setattr(server, "STALE_STATE_BYTES", 0)  # as at gpt-125m
    cfg = RunConfig(holdout_windows=512)
    layout, theta = initial_parameters(cfg)
    evaluator = Evaluator(cfg, Metrics("aggregator"), layout)
    evaluator.submit(-1, 0, theta)
    _started(evaluator)
    newer = theta * 1.01
    evaluator.release_except(newer)
    assert not evaluator.evaluating  # the model holds no state now
    evaluator.submit(0, 20, newer)
    evaluator.close(finish=True)
    lines = capsys.readouterr().out.splitlines()
    evaluated = [line for line in lines if line.startswith("event=eval ")]
    skipped = [line for line in lines if line.startswith("event=eval_skipped ")]
    assert [x.split()[2:4] for x in evaluated] == [["round=0", "step=20"]], lines
    assert len(skipped) == 1 and "round=-1 step=0 " in skipped[0], lines
    assert "outer step let this state go" in skipped[0]


def test_the_state_an_outer_step_starts_from_is_evaluated_through_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state the step starts from, and any state of a small model, is evaluated to
    the end."""
    monkeypatch.setattr(server, "STALE_STATE_BYTES", 0)
    cfg = RunConfig(holdout_windows=64)
    layout, theta = initial_parameters(cfg)
    evaluator = Evaluator(cfg, Metrics("aggregator"), layout)
    evaluator.submit(-1, 0, theta)
    _started(evaluator)
    evaluator.release_except(theta)  # returns at once: it is the state kept
    monkeypatch.setattr(server, "STALE_STATE_BYTES", 4 * theta.numel() + 1)
    evaluator.release_except(theta * 2)  # returns at once: a small model
    evaluator.close(finish=True)
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[2:4] for x in lines if x.startswith("event=eval ")] == [
        ["round=-1", "step=0"]
    ], lines
    assert not any(x.startswith("event=eval_skipped ") for x in lines)
    assert not evaluator.evaluating
