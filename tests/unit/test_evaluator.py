"""The aggregator's held-out evaluation keeps at most one state waiting."""

from __future__ import annotations

import pytest

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
