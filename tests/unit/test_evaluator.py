"""The aggregator's held-out evaluation keeps at most one state waiting."""

from __future__ import annotations

import pytest

from hypertrain.aggregator.server import Evaluator
from hypertrain.common.config import RunConfig
from hypertrain.common.roles import initial_parameters
from hypertrain.wire.metrics import Metrics


def test_a_newer_state_replaces_the_one_waiting_and_the_newest_is_evaluated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = RunConfig(holdout_windows=4)
    layout, theta = initial_parameters(cfg)
    evaluator = Evaluator(cfg, Metrics("aggregator"), layout)
    for k in range(6):  # faster than it evaluates: the waiting state is replaced
        evaluator.submit(k, 20 * (k + 1), theta * (1 + k / 100))
    evaluator.close(finish=True)
    lines = capsys.readouterr().out.splitlines()
    evaluated = [line for line in lines if line.startswith("event=eval ")]
    skipped = [line for line in lines if line.startswith("event=eval_skipped ")]
    assert len(evaluated) + len(skipped) == 6 and len(skipped) >= 3, lines
    assert "round=5 step=120" in evaluated[-1]  # the newest, always
    assert all("is newer and is evaluated instead" in s for s in skipped)


def test_a_state_handed_in_after_a_newer_one_is_skipped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = RunConfig(holdout_windows=2)
    layout, theta = initial_parameters(cfg)
    evaluator = Evaluator(cfg, Metrics("aggregator"), layout)
    evaluator.submit(1, 40, theta)
    evaluator.submit(0, 20, theta)  # out of order: two handlers, the older one last
    evaluator.close(finish=True)
    lines = capsys.readouterr().out.splitlines()
    assert [x for x in lines if x.startswith("event=eval ")][-1].startswith(
        "event=eval role=aggregator round=1 step=40 "
    )
    assert any(
        x.startswith("event=eval_skipped role=aggregator round=0 step=20 ") for x in lines
    ), lines
