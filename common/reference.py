"""The in-process run: the whole cluster in one process, on the in-process transport.

    hypertrain run --local

It runs the real relay and aggregator nodes and the islands' round logic
(common/rounds/local.py) with every message delivered at once and in order, the
islands stepping together: the reference the daemons must match bit for bit (final
global state digest).  Nothing is written to disk and nothing is signed.

Islands of a step train concurrently on a thread pool: each island's ops run
single-threaded in its worker (``RunConfig.threads`` intra-op threads, 1 by
default), so the result is independent of scheduling.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.data import (
    HOLDOUT_WINDOWS,
    SampleStream,
    TokenDataset,
    ensure_default_dataset,
    holdout_windows,
)
from hypertrain.common.digest import state_digest
from hypertrain.common.errors import HypertrainError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import run_fragments
from hypertrain.common.model import build_model, evaluate
from hypertrain.common.roles import IslandCore, initial_parameters
from hypertrain.common.rounds.local import Cluster, IslandActor
from hypertrain.common.schedule import Schedule

Event = dict[str, Any]


@dataclass(slots=True)
class RunResult:
    """What a reference run reports."""

    initial_loss: float
    final_loss: float
    final_digest: str
    rounds: list[Event] = field(default_factory=list)
    bytes_per_sync: float = 0.0
    """Mean encoded bytes one island sends per regional sync."""
    fp32_bytes: int = 0
    """Bytes of the same delta in fp32 (the compression baseline)."""
    seconds_train: float = 0.0
    """Wall time in forward/backward/optimizer steps."""
    seconds_sync: float = 0.0
    """Wall time in codecs, aggregation, digests and merges."""
    seconds_eval: float = 0.0
    final_params: torch.Tensor | None = None
    """The final global parameters (flat, name-sorted layout)."""
    lawa_params: torch.Tensor | None = None
    """RunConfig.lawa: the aggregator's LAWA average (flat), published as the final model."""
    lawa_digest: str = ""
    lawa_loss: float = float("nan")
    """Held-out loss of the LAWA average."""


def open_dataset(cfg: RunConfig) -> TokenDataset:
    return TokenDataset.open(cfg.data) if cfg.data else ensure_default_dataset()


def model_cluster(
    cfg: RunConfig,
    layout: ParamLayout,
    theta0: torch.Tensor,
    stream: SampleStream,
    **kwargs: Any,
) -> Cluster:
    """The in-process cluster of ``cfg``'s model: islands training on ``stream``, every
    node cut into the run's fragments when it has several (``kwargs``: Cluster's own,
    e.g. ``run_dir``, ``keys``, ``observer``)."""
    frags = run_fragments(cfg, layout) if cfg.fragments > 1 else None
    return Cluster(
        cfg,
        theta0,
        lambda i: IslandCore(cfg, i, stream, theta0, fragments=frags),
        fragments=frags,
        **kwargs,
    )


def run_reference(
    cfg: RunConfig, on_event: Callable[[Event], None] | None = None, workers: int | None = None
) -> RunResult:
    """Train ``cfg`` in-process; ``on_event`` receives one dict per global round."""
    torch.set_num_threads(cfg.threads)
    emit = on_event or (lambda e: None)
    mcfg = cfg.model_config()
    dataset = open_dataset(cfg)
    stream = SampleStream(dataset, mcfg.seq_len, cfg.global_batch, cfg.seed)
    # The holdout region is always sized for the registered 512 windows so that the
    # training windows never depend on how many of them a run evaluates.
    holdout = holdout_windows(dataset, mcfg.seq_len, n=HOLDOUT_WINDOWS, seed=cfg.seed)
    eval_windows = holdout.windows[: cfg.holdout_windows]
    layout, theta0 = initial_parameters(cfg)
    cluster = model_cluster(cfg, layout, theta0, stream)
    frags = cluster.fragments
    every = list(cluster.islands.values())
    eval_model = build_model(mcfg, seed=cfg.seed)
    # Rounds are counted (and evaluated) at the global merges of fragment 0, whose
    # schedule is the run's; with fragments the model evaluated is every fragment's
    # newest global state.
    sched = Schedule.of(cfg, None if frags is None else 0)

    def held_out(theta: torch.Tensor) -> float:
        layout.load(eval_model, theta)
        return evaluate(eval_model, eval_windows)

    t0 = time.perf_counter()
    result = RunResult(held_out(theta0), 0.0, "", fp32_bytes=4 * layout.numel)
    result.seconds_eval = time.perf_counter() - t0
    losses: list[float] = []
    pool = ThreadPoolExecutor(max_workers=workers or min(len(every), os.cpu_count() or 1))
    committed = cluster.aggregator.node.committed
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        islands = cluster.training()  # an islands:K anneal stops the others at its start
        trained = list(pool.map(IslandActor.train, islands))
        losses.extend(trained)
        t1 = time.perf_counter()
        result.seconds_train += t1 - t0
        cluster.step_together(trained)  # pushes, then the merges pinned to this step
        t2 = time.perf_counter()
        result.seconds_sync += t2 - t1
        for merge in committed:
            loss = held_out(merge.payload if frags is None else cluster.global_theta())
            event = {
                "round": merge.round,
                "step": merge.sync_step,
                "train_loss": sum(losses) / len(losses),
                "heldout_loss": loss,
                "bytes_per_sync": _sent(every)[0] / max(_sent(every)[1], 1),
            }
            losses.clear()
            result.rounds.append(event)
            emit(event)
        committed.clear()
        result.seconds_eval += time.perf_counter() - t2
    pool.shutdown()
    if len(result.rounds) != sched.rounds:
        raise HypertrainError(f"in-process run: {len(result.rounds)} of {sched.rounds} rounds")
    theta = cluster.final_theta()
    result.final_loss = result.rounds[-1]["heldout_loss"]
    result.final_digest = state_digest(layout.unflatten(theta))
    result.final_params = theta
    averaged = cluster.lawa_average()
    if cfg.lawa:
        if averaged is None:
            raise HypertrainError("in-process run: the aggregator published no LAWA average")
        t0 = time.perf_counter()
        result.lawa_params = averaged
        result.lawa_digest = state_digest(layout.unflatten(averaged))
        result.lawa_loss = held_out(averaged)
        result.seconds_eval += time.perf_counter() - t0
    sent, sends = _sent(every)
    result.bytes_per_sync = sent / max(sends, 1)
    return result


def _sent(islands: list[IslandActor]) -> tuple[int, int]:
    return sum(i.sent_bytes for i in islands), sum(i.sends for i in islands)
