"""The simulator's job runner: ``run_job(SimJob) -> JobResult``.

    from hypertrain.sim.engine.run import SimJob, flat_job, dp_job, run_job
    res = run_job(flat_job(8, 30, steps=300, model="tiny", seed=0))
    res.final_loss, res.curve, res.diverged

It drives the same core as the daemons and common/reference.py, per fragment:
islands' deltas ``base - theta_i`` go through the regional codec with the
island's ``ErrorFeedback``; each region's ``RegionCore.merge`` takes their
fixed-order mean (``aggregate``); at a global sync each ``RegionCore`` encodes
its ``D_r`` with the global codec and ``GlobalCore.step`` applies the outer
optimizer.  Replicas take the merged state at sync_step + tau (with tau > 0:
merged + the local progress made during the overlap).  For F = 1 this is
exactly the algorithm of docs/design.md §4.1 and of common/reference.py (a test
compares final parameters).  The replicas themselves are a ``ReplicaSet``:
the per-replica path (replicas.py) or the batched one (batched.py),
chosen by ``SimJob.path``; everything here is shared by both.

Beyond the reference run: churn (``drop`` > 0: islands absent from sync steps, drawn
from the seed; churn.py), streaming fragments (streaming.py), the anneal at
M = 1 (from the last global sync at or before the WSD decay start, all
replicas are set to their fixed-order fp32 mean after every step), LAWA over
the last k checkpoints (one per ``lawa_every`` steps, of the global
parameters), the data-parallel control (one replica on the whole batch, no
outer loop), held-out evaluation along the run, and divergence detection
(non-finite losses or parameters, or a held-out loss above ``diverge_ratio``
times the initial one): a divergent run stops and is reported, never raised.

Invariants: merges are pinned to steps, never to time; every number that
matters comes from a function of common/; the island's base is the region's
base (the two are updated by the same ops in the daemons, so one copy is kept).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from hypertrain.common.aggregate import aggregate
from hypertrain.common.codec import ErrorFeedback, make_codec
from hypertrain.common.config import anneal_islands
from hypertrain.common.data import (
    HOLDOUT_WINDOWS,
    SampleStream,
    TokenDataset,
    ensure_default_dataset,
    holdout_windows,
)
from hypertrain.common.errors import CodecError, ConfigError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import Fragment, partition
from hypertrain.common.model import GPT, build_model, evaluate
from hypertrain.common.optim import LAWA
from hypertrain.common.roles import GlobalCore, RegionCore
from hypertrain.common.schedule import PendingMerges, Schedule, SyncKind, overlap_merge
from hypertrain.common.schedule import anneal_start as schedule_anneal_start
from hypertrain.sim.engine.batched import Batched
from hypertrain.sim.engine.churn import Absence, Churn
from hypertrain.sim.engine.job import JobResult, SimJob, dp_job, flat_job
from hypertrain.sim.engine.replicas import PerReplica, ReplicaSet

_log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_FORMAT",
    "FragmentSync",
    "JobResult",
    "SimJob",
    "anneal_start",
    "dp_job",
    "eval_steps",
    "flat_job",
    "load_checkpoint",
    "make_replicas",
    "run_job",
    "save_checkpoint",
]


class Diverged(Exception):
    """Internal: the run diverged at ``step`` (caught by run_job, reported in the result)."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(reason)
        self.step = step
        self.reason = reason


@lru_cache(maxsize=4)
def _dataset(data: str | None) -> TokenDataset:
    return TokenDataset.open(data) if data else ensure_default_dataset()


@lru_cache(maxsize=8)
def _holdout(data: str | None, seq_len: int, seed: int) -> torch.Tensor:
    # Always the registered 512 windows (so training windows never depend on n evaluated).
    return holdout_windows(_dataset(data), seq_len, n=HOLDOUT_WINDOWS, seed=seed).windows


def resolve_device(job: SimJob) -> torch.device:
    name = job.resolved_device()
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"sim job: device {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"sim job: device must be cpu or cuda, got {name!r}")
    return device


def eval_steps(job: SimJob) -> list[int]:
    """Steps with a held-out evaluation: ``eval_points`` near-even points on the h_g grid."""
    h, total = job.h_g, job.steps
    points = {total}
    for k in range(1, job.eval_points):
        points.add(min(total, max(h, round(k * total / job.eval_points / h) * h)))
    return sorted(points)


def anneal_start(job: SimJob, offset: int = 0) -> int | None:
    """The anneal's first step (m1, h_r1, islands:K): the last global sync step at or before
    the WSD decay start (common/schedule.py ``anneal_start``, the system's rule); of the
    streaming fragment at ``offset``, its own last one."""
    if job.anneal == "full_m" or job.dp:
        return None
    return schedule_anneal_start(job.steps, job.h_g, job.inner.decay_fraction, offset)


@dataclass(slots=True)
class _Targets:
    """A computed merge: per replica range the fragment's new rows."""

    targets: list[tuple[int, int, torch.Tensor]]
    snapshot: torch.Tensor | None
    """Replicas' fragment rows at sync_step (tau > 0: the overlap rule's reference)."""


class FragmentSync:
    """One fragment's outer loop: its RegionCores, GlobalCore and the islands' error feedback."""

    def __init__(
        self, job: SimJob, frag: Fragment, theta0: torch.Tensor, churn: Churn | None = None
    ) -> None:
        cfg = job.core_config()
        topo = cfg.topology
        self.frag = frag
        self.schedule = Schedule(
            h_r=job.h_r,
            h_g=job.h_g,
            tau=job.tau,
            steps=job.steps,
            offset=frag.offset,
            anneal_at=anneal_start(job, frag.offset) if job.anneal == "h_r1" else None,
        )
        self.island_ids = topo.island_ids()
        self.n_r = topo.islands_per_region
        theta = theta0[frag.lo : frag.hi]
        self.regions = [RegionCore(cfg, r, theta) for r in sorted(topo.regions)]
        self.glob = GlobalCore(cfg, theta)
        self.feedback = [
            ErrorFeedback(make_codec(cfg.regional_codec), frag.numel, beta=cfg.ef_beta)
            for _ in self.island_ids
        ]
        self.pending: PendingMerges[_Targets] = PendingMerges(self.schedule)
        k, a = anneal_islands(job.anneal), anneal_start(job, frag.offset)
        self.kept = None if k is None or a is None else (a, frozenset(range(k)))
        """islands:K anneal: after its first step (the fragment's own) only replicas 0..K-1
        sync (the system's ``RunConfig.anneal_kept``: the first K islands); the others'
        training is ignored."""
        self.lawa = LAWA(job.lawa_k) if job.lawa_per_fragment else None
        """Streaming fragments with LAWA: this fragment's states after its last ``lawa_k``
        global rounds (the system's aggregator of the fragment keeps the same)."""
        self.churn = churn
        self.absences: list[Absence] = []
        """Churn: who missed each sync step the draw applied to (engine/churn.py)."""

    def sync(self, replicas: ReplicaSet, step: int, level: SyncKind) -> None:
        """Encode, aggregate and (global) outer-step; queue the merge for its merge step."""
        for p in self.pending.flush():  # only at the final sync: the merge in flight, now
            self._apply(replicas, p.item)
        rows = replicas.read(self.frag)
        if not bool(torch.isfinite(rows).all()):
            raise Diverged(step, "non-finite parameters at a sync")
        absent: frozenset[int] = frozenset()
        if self.churn is not None and self.churn.applies(level):
            drawn = self.churn.at(step)
            self.absences.append(drawn)
            absent = frozenset(drawn.absent)
        targets: list[tuple[int, int, torch.Tensor]] = []
        left: set[str] = set()  # regions without an island after an islands:K anneal
        for k, core in enumerate(self.regions):
            lo, hi = k * self.n_r, (k + 1) * self.n_r
            if self.kept is not None and step > self.kept[0]:
                stay = [i for i in range(lo, hi) if i in self.kept[1]]
                if not stay:
                    left.add(core.region)
                    continue
                blobs = {
                    self.island_ids[i]: self.feedback[i].encode(core.base - rows[i]) for i in stay
                }
                core.merge(blobs, keep=False)
                # only the kept replicas (the first of the region's: kept is 0..K-1) take it:
                # one that left may train on to another fragment's later start (streaming)
                targets.append((lo, lo + len(stay), core.base.clone()))
                continue
            blobs = {
                self.island_ids[i]: self.feedback[i].encode(core.base - rows[i])
                for i in range(lo, hi)
            }
            if absent and self.n_r > 1:  # churn: late islands' deltas are refused as stale
                blobs = {self.island_ids[i]: blobs[self.island_ids[i]]
                         for i in range(lo, hi) if i not in absent}  # fmt: skip
            core.merge(blobs, keep=False)
            targets.append((lo, hi, core.base.clone()))
        if level == "global":
            forwards = {
                core.region: core.encode_global_delta()
                for core in self.regions
                if core.region not in left
            }
            if absent and self.n_r == 1:  # churn, flat: region k is replica k's, and late
                forwards = {c.region: forwards[c.region]
                            for k, c in enumerate(self.regions) if k not in absent}  # fmt: skip
            self.glob.step(forwards)
            if self.lawa is not None:
                self.lawa.add(self.glob.theta)
            for core in self.regions:
                core.set_global(self.glob.theta)
            targets = [(0, len(self.island_ids), self.glob.theta.clone())]
        self.pending.add(step, level, _Targets(targets, rows if self.schedule.tau else None))
        self.apply(replicas, step)

    def apply(self, replicas: ReplicaSet, step: int) -> None:
        """Apply the merges pinned to ``step``."""
        for p in self.pending.due(step):
            self._apply(replicas, p.item)

    def _apply(self, replicas: ReplicaSet, m: _Targets) -> None:
        now = replicas.read(self.frag) if m.snapshot is not None else None
        for lo, hi, target in m.targets:
            if now is None or m.snapshot is None:
                replicas.write(self.frag, lo, hi, target)
            else:  # merged state plus the local progress made during the overlap
                replicas.write(
                    self.frag, lo, hi, overlap_merge(target, now[lo:hi], m.snapshot[lo:hi])
                )


class _Anneal:
    """M = 1 anneal: after every step all replicas take their fixed-order fp32 mean."""

    def __init__(self, frag: Fragment, island_ids: tuple[str, ...], theta: torch.Tensor) -> None:
        self.frag = frag
        self.island_ids = island_ids
        self.codec = make_codec("fp32")
        self.base = theta.clone()

    def merge(self, replicas: ReplicaSet, step: int) -> None:
        rows = replicas.read(self.frag)
        if not bool(torch.isfinite(rows).all()):
            raise Diverged(step, "non-finite parameters at an anneal merge")
        blobs = {
            rid: self.codec.encode(self.base - rows[i]) for i, rid in enumerate(self.island_ids)
        }
        mean, _ = aggregate(blobs, self.codec, tuple(self.base.shape))
        self.base.sub_(mean)
        replicas.write(self.frag, 0, len(self.island_ids), self.base)


def _stream(job: SimJob, template: GPT) -> SampleStream:
    return SampleStream(_dataset(job.data), template.cfg.seq_len, job.global_batch, job.seed)


def make_replicas(
    job: SimJob, template: GPT, layout: ParamLayout, theta0: torch.Tensor, device: torch.device
) -> ReplicaSet:
    """The job's replicas on ``device``, all at ``theta0``: per-replica or batched (``job.path``)."""
    stream = _stream(job, template)
    kind = Batched if job.path == "batched" else PerReplica
    return kind(template, layout, theta0, job.n_replicas, job.inner, job.steps, stream, device)


CHECKPOINT_FORMAT = "hypertrain-sim-checkpoint/1"


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 of the source of the code a job's numbers come from (the core, common/, and
    the simulator's engine): a checkpoint resumes only under the code that wrote it, since
    a state written by other code would make a result that neither code computes."""
    import hypertrain.common as common

    h = hashlib.sha256()
    for folder in (Path(common.__file__).parent, Path(__file__).parent):
        for f in sorted(folder.rglob("*.py")):
            h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _identity(job: SimJob) -> dict[str, Any]:
    """What a checkpoint must match to be resumed by ``job``: the design key, the execution
    path and device (outside the key, but inside the saved objects) and the code."""
    return {"format": CHECKPOINT_FORMAT, "key": job.key(), "path": job.path,
            "device": job.resolved_device(), "code": code_fingerprint()}  # fmt: skip


def save_checkpoint(path: Path, state: dict[str, Any], replicas: ReplicaSet) -> None:
    """Write a job's state atomically (a temporary file of this process, fsynced, renamed
    over ``path``).  The replicas' data stream is left out: it is a function of the job,
    rebuilt on load.  A failed write (a full disk) is logged and the run goes on: a
    checkpoint only saves time."""
    stream, replicas.stream = replicas.stream, None  # type: ignore[assignment]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _log.warning("sim job: checkpoint %s not written (%s); the run goes on", path, e)
    finally:
        replicas.stream = stream
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path | None, job: SimJob) -> dict[str, Any] | None:
    """The state a run of ``job`` saved at ``path``; None where there is none, or where it
    is unreadable, of another job, path or device, or written by other code (logged: the job
    then starts over, which is always correct, only slower).  Tensors come back on the
    devices they were saved from (the replicas on the job's device, the cores on CPU)."""
    if path is None or not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # a damaged file: never trusted, never fatal
        _log.warning("sim job: checkpoint %s unreadable (%s); starting over", path, e)
        return None
    want = _identity(job)
    if not isinstance(state, dict) or {k: state.get(k) for k in want} != want:
        _log.warning("sim job: checkpoint %s is not this job's, path's, device's or "
                     "code's; starting over", path)  # fmt: skip
        return None
    return state


def run_job(
    job: SimJob,
    on_eval: Callable[[int, float], None] | None = None,
    *,
    checkpoint: Path | None = None,
    checkpoint_every_s: float = 300.0,
) -> JobResult:
    """Train ``job`` and report it (``on_eval(step, heldout)`` is called at each eval point).

    ``checkpoint``: a file the run saves its whole state to, between two steps, at most
    every ``checkpoint_every_s`` seconds, and resumes from when it exists: a resumed run
    gives the uninterrupted run's result bit for bit (its timings aside).  The caller
    removes the file once it has the result."""
    t_start = time.perf_counter()
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    device = resolve_device(job)
    mcfg = job.model_config()
    template = build_model(mcfg, seed=job.seed)
    layout = ParamLayout.of(template)
    theta0 = layout.flatten(template)
    saved = load_checkpoint(checkpoint, job)
    try:
        return _run(job, on_eval, checkpoint, checkpoint_every_s, saved, t_start, device,
                    template, layout, theta0)  # fmt: skip
    except Exception:
        if saved is not None and checkpoint is not None:  # never resumed from twice if it fails
            checkpoint.replace(checkpoint.with_name(checkpoint.name + ".failed"))
            _log.warning("sim job: failed after resuming from %s; set aside", checkpoint)
        raise


def _run(
    job: SimJob,
    on_eval: Callable[[int, float], None] | None,
    checkpoint: Path | None,
    checkpoint_every_s: float,
    saved: dict[str, Any] | None,
    t_start: float,
    device: torch.device,
    template: GPT,
    layout: ParamLayout,
    theta0: torch.Tensor,
) -> JobResult:
    """``run_job`` once its model is built and its checkpoint (``saved``) read."""
    mcfg = template.cfg
    if saved is None:
        replicas = make_replicas(job, template, layout, theta0, device)
    else:
        replicas = saved["replicas"]
        replicas.stream = _stream(job, template)
    eval_model = copy.deepcopy(template).to(device)
    windows = _holdout(job.data, mcfg.seq_len, job.holdout_seed)[: job.holdout].to(device)

    def held_out(theta: torch.Tensor) -> float:
        layout.load(eval_model, theta)
        return evaluate(eval_model, windows)

    frags = partition(layout, job.fragments, job.h_g, job.fragment_cut)
    full = partition(layout, 1, job.h_g, job.fragment_cut)[0]
    churn = None
    if job.drop:
        churn = Churn(job.drop, job.seed, job.regions, job.islands_per_region,
                      job.run.membership)  # fmt: skip
    a_start = anneal_start(job)
    m1_start = a_start if job.anneal == "m1" else None  # h_r1 is the schedule's (FragmentSync)
    syncs: list[FragmentSync]
    anneal: _Anneal | None
    lawa: LAWA | None
    if saved is None:
        syncs = [] if job.dp else [FragmentSync(job, f, theta0, churn) for f in frags]
        anneal = None
        if m1_start == 0:  # the whole run is the anneal
            anneal = _Anneal(full, syncs[0].island_ids, theta0)
        # LAWA: of the joined state every lawa_every steps, or each fragment's
        # (FragmentSync.lawa)
        lawa = LAWA(job.lawa_k) if job.lawa_k and not job.lawa_per_fragment else None
    else:
        syncs, anneal, lawa = saved["syncs"], saved["anneal"], saved["lawa"]
    lawa_every = job.lawa_every or job.h_g
    evals = set(eval_steps(job))
    log_every = max(1, job.steps // 100)

    def global_theta() -> torch.Tensor:
        if anneal is not None:
            return anneal.base.clone()
        if job.dp:
            return replicas.read(full)[0]
        return torch.cat([s.glob.theta for s in syncs])

    first, before = 1, 0.0
    if saved is None:
        res = JobResult(
            key=job.key(),
            final_loss=math.nan,
            final_loss_raw=math.nan,
            initial_loss=math.nan,
            n_params=layout.numel,
            path=job.path,
            device=str(device),
            anneal_start=a_start,
        )
        t0 = time.perf_counter()
        res.initial_loss = held_out(theta0)
        res.seconds_eval += time.perf_counter() - t0
        loss_sum, loss_n = 0.0, 0
    else:
        res = saved["res"]
        loss_sum, loss_n = saved["loss"]
        first, before = saved["step"] + 1, saved["elapsed"]
        torch.set_rng_state(saved["rng"].cpu())
        if saved["cuda_rng"] is not None:
            torch.cuda.set_rng_state(saved["cuda_rng"].cpu(), device)
        res.resumed_from.append(saved["step"])
    last_save = time.monotonic()
    try:
        for step in range(first, job.steps + 1):
            t0 = time.perf_counter()
            losses = replicas.train_step(step - 1)
            t1 = time.perf_counter()
            res.seconds_train += t1 - t0
            if not bool(torch.isfinite(losses).all()):
                raise Diverged(step, "non-finite training loss")
            loss_sum, loss_n = loss_sum + float(losses.double().mean()), loss_n + 1
            if step % log_every == 0 or step == job.steps:
                res.train_curve.append((step, loss_sum / loss_n))
                loss_sum, loss_n = 0.0, 0
            if anneal is not None:
                anneal.merge(replicas, step)
            else:
                for s in syncs:
                    s.apply(replicas, step)
                    level = s.schedule.sync_kind(step)
                    if level is not None:
                        s.sync(replicas, step, level)
                if m1_start is not None and step == m1_start:
                    anneal = _Anneal(full, syncs[0].island_ids, syncs[0].glob.theta)
            if lawa is not None and step % lawa_every == 0:
                lawa.add(global_theta())
            t2 = time.perf_counter()
            res.seconds_sync += t2 - t1
            res.steps_done = step
            if step in evals:
                loss = held_out(global_theta())
                res.curve.append((step, loss))
                res.seconds_eval += time.perf_counter() - t2
                if on_eval is not None:
                    on_eval(step, loss)
                if not math.isfinite(loss) or loss > job.diverge_ratio * res.initial_loss:
                    raise Diverged(step, f"held-out loss {loss:.6g} at step {step}")
            if (checkpoint is not None and step < job.steps
                    and time.monotonic() - last_save >= checkpoint_every_s):  # fmt: skip
                state = {
                    **_identity(job), "step": step, "replicas": replicas, "syncs": syncs,
                    "anneal": anneal, "lawa": lawa, "res": res, "loss": (loss_sum, loss_n),
                    "rng": torch.get_rng_state(), "elapsed": before + time.perf_counter() - t_start,
                    "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                }  # fmt: skip
                save_checkpoint(checkpoint, state, replicas)
                last_save = time.monotonic()
        res.final_loss_raw = res.curve[-1][1]
        res.final_params = global_theta()
        res.final_loss = res.final_loss_raw
        if lawa is not None or job.lawa_per_fragment:
            t0 = time.perf_counter()
            res.lawa_params = (
                lawa.average()
                if lawa is not None
                else torch.cat([s.lawa.average() for s in syncs if s.lawa is not None])
            )
            res.final_loss = held_out(res.lawa_params)
            res.seconds_eval += time.perf_counter() - t0
            if not math.isfinite(res.final_loss):
                raise Diverged(job.steps, "non-finite held-out loss of the LAWA average")
    except (Diverged, CodecError) as e:
        res.diverged = True
        res.diverged_at = e.step if isinstance(e, Diverged) else res.steps_done + 1
        res.reason = e.reason if isinstance(e, Diverged) else f"codec refused a delta: {e}"
        res.final_loss = res.final_loss_raw = math.nan
    if churn is not None:
        res.absent = [(a.step, a.absent, a.waited) for a in syncs[0].absences]
    res.seconds = before + time.perf_counter() - t_start
    busy = res.seconds_train + res.seconds_sync
    res.steps_per_s = res.steps_done / busy if busy > 0 else 0.0
    return res
