"""The in-process reference run: the whole hierarchy in one process, plain calls.

It runs exactly the algorithm of architecture.md ("The algorithm, precisely")
with the role classes of common/roles.py, and is the reference the daemons
must match bit for bit (final global state digest).

Islands of a phase train concurrently on a thread pool: each island's ops run
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
from hypertrain.common.model import build_model, evaluate, preset
from hypertrain.common.roles import GlobalCore, IslandCore, RegionCore, initial_parameters

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


def open_dataset(cfg: RunConfig) -> TokenDataset:
    return TokenDataset.open(cfg.data) if cfg.data else ensure_default_dataset()


def run_reference(
    cfg: RunConfig, on_event: Callable[[Event], None] | None = None, workers: int | None = None
) -> RunResult:
    """Train ``cfg`` in-process; ``on_event`` receives one dict per global round."""
    torch.set_num_threads(cfg.threads)
    emit = on_event or (lambda e: None)
    topo = cfg.topology
    mcfg = preset(cfg.model)
    dataset = open_dataset(cfg)
    stream = SampleStream(dataset, mcfg.seq_len, cfg.global_batch, cfg.seed)
    # The holdout region is always sized for the registered 512 windows so that the
    # training windows never depend on how many of them a run evaluates.
    holdout = holdout_windows(dataset, mcfg.seq_len, n=HOLDOUT_WINDOWS, seed=cfg.seed)
    eval_windows = holdout.windows[: cfg.holdout_windows]
    layout, theta0 = initial_parameters(cfg)
    islands = [IslandCore(cfg, i, stream, theta0) for i in topo.island_ids()]
    regions = {r: RegionCore(cfg, r, theta0) for r in sorted(topo.regions)}
    glob = GlobalCore(cfg, theta0)
    eval_model = build_model(mcfg, seed=cfg.seed)

    def held_out(theta: torch.Tensor) -> float:
        layout.load(eval_model, theta)
        return evaluate(eval_model, eval_windows)

    t0 = time.perf_counter()
    result = RunResult(held_out(glob.theta), 0.0, "", fp32_bytes=4 * layout.numel)
    result.seconds_eval = time.perf_counter() - t0
    sent_bytes, sends = 0, 0
    losses: list[float] = []
    pool = ThreadPoolExecutor(max_workers=workers or min(len(islands), os.cpu_count() or 1))

    # Merges waiting for their pinned step: (merge_step, island, kind, payload, sync_step).
    pending: list[tuple[int, IslandCore, str, torch.Tensor, int]] = []

    def apply_due(step: int) -> None:
        while pending and pending[0][0] == step:
            _, island, kind, payload, sync_step = pending.pop(0)
            island.apply_merge(kind, payload, sync_step)

    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        losses.extend(pool.map(IslandCore.train_step, islands))
        t1 = time.perf_counter()
        result.seconds_train += t1 - t0
        apply_due(step)
        if step % topo.h_r:
            result.seconds_sync += time.perf_counter() - t1
            continue
        is_global = step % topo.h_g == 0
        merges: list[tuple[IslandCore, str, torch.Tensor]] = []
        for region, core in regions.items():
            members = [i for i in islands if i.region == region]
            blobs = {i.island_id: i.sync() for i in members}
            sent_bytes += sum(len(b) for b in blobs.values())
            sends += len(blobs)
            mean, _ = core.merge(blobs)
            merges.extend((i, "regional", mean) for i in members)
        if is_global:
            glob.step({r: c.encode_global_delta() for r, c in regions.items()})
            for core in regions.values():
                core.set_global(glob.theta)
            theta_new = glob.theta.clone()
            merges = [(i, "global", theta_new) for i in islands]
        pending.extend((step + topo.tau, i, kind, payload, step) for i, kind, payload in merges)
        apply_due(step)
        t2 = time.perf_counter()
        result.seconds_sync += t2 - t1
        if is_global:
            loss = held_out(glob.theta)
            result.seconds_eval += time.perf_counter() - t2
            event = {
                "round": step // topo.h_g - 1,
                "step": step,
                "train_loss": sum(losses) / len(losses),
                "heldout_loss": loss,
                "bytes_per_sync": sent_bytes / sends,
            }
            losses.clear()
            result.rounds.append(event)
            emit(event)
    pool.shutdown()
    result.final_loss = result.rounds[-1]["heldout_loss"]
    result.final_digest = state_digest(layout.unflatten(glob.theta))
    result.final_params = glob.theta
    result.bytes_per_sync = sent_bytes / max(sends, 1)
    return result
