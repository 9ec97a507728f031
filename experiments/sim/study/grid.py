"""The grid runner of docs/design.md §7.11: every registered job of a scale, in worker
processes, resumable.

    from hypertrain.sim.study.grid import run_grid
    run_grid(prereg_path, "smoke", out_dir, processes=2)      # then summary.summarize(...)

A job is one cell x seed x outer learning rate of the cell's sweep (a control
has no sweep) at one registered scale; ``job_for`` maps it to a ``SimJob`` and
``run_job`` (engine/run.py) trains it.  Each finished job appends one JSON row to
``<out>/parity_runs.jsonl`` at once (flushed and fsynced), so a run that is
interrupted, or stopped by a cap, resumes where it stopped.

Invariants:

- The runner refuses a pre-registration file whose stored hash does not match
  its design (``load_prereg``); each registration file of the repository must moreover
  register exactly the design prereg.py builds for it (``verify_registered``,
  ``prereg.design_for``).  The device
  and the execution path are outside the design (and outside the job keys).
- A results folder belongs to one design hash and one scale; rows of another
  design or scale make the runner refuse the folder.
- Jobs whose latest row is ``done`` or ``divergent`` (with the job key the plan
  computes now) are never run again; ``error`` jobs are retried on the next run;
  the newest row of a job is its status.  A registered job with no row is
  ``censored``: the wall-clock cap (no job is started after it), ``--max-jobs``,
  or an interruption stopped the runner before it ran.  Nothing is dropped:
  done + divergent + error + censored = the registered jobs.
- Workers are ``spawn``ed (a forked torch can hang) with one torch thread each.
- A job in flight saves its whole state to ``<out>/checkpoints/<hash of its key>.pt``
  every ``checkpoint_every_s`` seconds (``run_job``'s checkpoint); a job started again
  after its process died (a killed worker, a preempted machine, an interrupted run)
  resumes there, with the same result bit for bit.  The file is removed once the job's
  final row is written.
- Sharded (``shard=(i, n)``, ``hypertrain sim grid --shard I/N``): shard i runs the
  jobs at slots i, i + n, i + 2n, ... of the plan (``shard_jobs``), so every job
  is in exactly one shard of n and each shard gets a share of every priority band.
  Shard i of n appends only to its own files (``parity_runs.shard-<i>-of-<n>.jsonl``,
  ``grid_invocations.shard-<i>-of-<n>.jsonl``), so n machines can write to one shared
  folder at once with no lock; ``read_rows`` reads every runs file of the folder,
  ordered by finish time, and ``hypertrain sim summarize`` merges them.
- Verdict seeds (``Design.verdict_seeds``, the second parity registration): the plan
  is the selection jobs (every eta on ``Design.seeds``), then the verdict jobs, each with
  a fixed slot. A control's verdict jobs are planned at once; an arm's once all of its
  selection jobs are final (done or divergent), at the eta the registered rule chose
  (``eta_choices``), so a choice never changes and no verdict row goes stale. One
  invocation runs both: after every finished job it plans again. Shards split on slots,
  so a verdict job's shard does not depend on its eta; a shard whose verdict jobs wait for
  another shard's selection jobs re-reads the shared folder every ``poll_s`` seconds
  until they are final or its wall-clock cap. A selection job that errors leaves its arm's
  verdict jobs waiting (counted as censored) until a later invocation reruns it; no shard
  waits for it (an error row is final for this invocation).
- Jobs run in a fixed priority order (``plan_jobs``), so that a capped run
  completes whole comparisons first: churn cells with their controls and baseline (a
  churn registration), the controls and the negative control, then
  the H1 hierarchies with their flat baselines, the other flat cells (H2, H4),
  the mechanisms (H3); inside a cell, by eta then seed.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import math
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hypertrain.common.errors import ConfigError
from hypertrain.common.model import ModelConfig
from hypertrain.common.optim import InnerConfig
from hypertrain.common.outer import OuterConfig
from hypertrain.sim.engine.job import ExecPath, SimJob
from hypertrain.sim.study.prereg import (
    DEFAULT_PATH,
    REGISTRATIONS,
    Cell,
    Design,
    Prereg,
    PreregError,
    Scale,
    design_for,
    load_prereg,
    verify_registered,
)
from hypertrain.sim.study.stats import EtaChoice, select_outer_lr

RUNS_FILE = "parity_runs.jsonl"
INVOCATIONS_FILE = "grid_invocations.jsonl"
Shard = tuple[int, int]
"""(i, n): shard i (0-based) of n."""
REPO_ROOT = Path(__file__).resolve().parents[3]
FINAL = ("done", "divergent")
"""Statuses that are never run again."""


def default_out(scale: str, prereg: str | Path | None = None) -> Path:
    """``experiments/results/<study>-<scale>`` of the repository: the study is the name of
    the registration file before ``_prereg`` (``churn_prereg.json``: churn), ``parity``
    for the default registration and any file not named that way."""
    stem = Path(prereg).stem if prereg is not None else "parity_prereg"
    study = stem.removesuffix("_prereg") if stem.endswith("_prereg") and stem != "_prereg" else ""
    return REPO_ROOT / "experiments" / "results" / f"{study or 'parity'}-{scale}"


def load_checked(path: str | Path | None = None) -> Prereg:
    """The registration the runner may use: its hash verified; a registration file of the
    repository (prereg.REGISTRATIONS) must also register exactly the design prereg.py
    builds for it."""
    path = Path(path) if path is not None else DEFAULT_PATH
    pre = load_prereg(path)
    if any(path.resolve() == known.resolve() for known in REGISTRATIONS):
        pre = verify_registered(path, design_for(path))
    return pre


# -- jobs -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GridJob:
    """One registered job: a cell at one seed and (for arms) one outer lr."""

    job_id: str
    cell: Cell
    seed: int
    eta: float | None
    sim: SimJob
    slot: int = -1
    """Its position in the design's whole plan, where every verdict job has its (cell,
    seed) slot whether its eta is chosen yet or not: what shards split on."""
    verdict: bool = False
    """A job on a verdict seed (``Design.verdict_seeds``)."""


def job_id(cell_id: str, seed: int, eta: float | None) -> str:
    return f"{cell_id}/seed{seed}" + ("" if eta is None else f"/eta{eta:g}")


def _dp_h(design: Design, scale: Scale) -> int:
    """The DP control's eval cadence: the smallest H_g of the scale's flat cells (or 1)."""
    hs = [c.h_g for c in design.cells_of(scale.name) if c.kind == "flat" and c.h_g]
    return min(hs) if hs else 1


def job_for(
    design: Design,
    scale: Scale,
    cell: Cell,
    seed: int,
    eta: float | None,
    *,
    device: str | None = None,
    path: ExecPath = "batched",
) -> SimJob:
    """The ``SimJob`` of a registered cell at ``scale``, ``seed`` and outer lr ``eta``."""
    s, d = scale, design.inner
    inner = InnerConfig(
        name=cell.inner, lr=cell.inner_lr, weight_decay=d.weight_decay, beta1=d.beta1,
        beta2=d.beta2, warmup_steps=s.warmup_steps, decay_fraction=d.decay_fraction,
        min_lr_ratio=d.min_lr_ratio, grad_clip=d.grad_clip,
    )  # fmt: skip
    model = ModelConfig(n_layer=s.n_layer, d_model=s.d_model, n_head=s.n_head, seq_len=s.seq_len)
    common: dict[str, Any] = dict(
        model=model, steps=s.steps, global_batch=s.global_batch, seed=seed, inner=inner,
        holdout=s.holdout_windows, diverge_ratio=design.divergence.max_heldout_ratio,
        path=path, device=device, threads=1,
    )  # fmt: skip
    if cell.kind == "control":
        if eta is not None:
            raise ConfigError(f"grid: control {cell.id} has no outer lr")
        h = _dp_h(design, scale)
        return SimJob.build(dp=True, h_r=h, h_g=h, **common)
    sweep = design.sweep(cell, scale.name)
    if eta is None or eta not in sweep:
        raise ConfigError(f"grid: eta {eta} is not in {cell.id}'s sweep {sweep} at {scale.name}")
    assert cell.outer is not None and cell.h_g is not None and cell.h_r is not None
    outer = OuterConfig(name=cell.outer, eta=eta, mu=cell.outer_momentum)
    return SimJob.build(
        regions=cell.regions, islands_per_region=cell.islands_per_region, h_r=cell.h_r,
        h_g=cell.h_g, outer=outer, regional_codec=cell.regional_codec,
        global_codec=cell.global_codec, fragments=cell.fragments, tau=cell.tau,
        anneal=cell.anneal, lawa_k=design.lawa_checkpoints if cell.lawa else 0,
        drop=cell.drop, **common,
    )  # fmt: skip


def cell_priority(design: Design, scale: str) -> list[Cell]:
    """The scale's cells in run order (see the module docstring)."""
    cells = design.cells_of(scale)
    by_id = {c.id: c for c in cells}
    order: list[str] = []

    def add(*ids: str | None) -> None:
        order.extend(i for i in ids if i is not None and i in by_id and i not in order)

    for c in cells:  # churn: its controls, its no-churn baseline, then the churn arm
        if c.kind == "churn":
            add(c.control, c.control_alt, c.baseline, c.id)
    hier = [c for c in cells if c.kind == "hier"]
    for c in hier:
        add(c.control, c.control_alt)
    add(*(c.id for c in cells if c.kind == "negative_control"))
    for c in cells:
        if c.kind == "negative_control":
            add(c.control, c.control_alt)
    for c in hier:
        add(c.baseline, c.baseline_full, c.id)
    add(*(c.id for c in cells if c.kind == "flat"))
    for c in cells:
        if c.kind == "mechanism":
            add(c.control, c.control_alt, c.baseline, c.id)
    add(*(c.id for c in cells))
    return [by_id[i] for i in order]


def plan_jobs(
    design: Design,
    scale: str,
    *,
    device: str | None = None,
    path: ExecPath = "batched",
    latest: Mapping[str, dict[str, Any]] | None = None,
) -> list[GridJob]:
    """Every registered job of ``scale`` in priority order (cell, then eta, then seed).

    With verdict seeds (``Design.verdict_seeds``) the plan continues with every cell's
    verdict jobs: a control's on each verdict seed; an arm's on each verdict seed at the
    eta its selection jobs chose (``eta_choices`` over the ``latest`` rows), planned only
    once every selection job of the arm is final (so the choice can never change), and
    never where every eta diverged."""
    sc = design.scale(scale)
    jobs: list[GridJob] = []
    cells = cell_priority(design, scale)
    for cell in cells:
        sweep = design.sweep(cell, scale)
        etas: Iterable[float | None] = sweep if cell.kind != "control" else (None,)
        for eta in etas:
            for seed in design.seeds:
                sim = job_for(design, sc, cell, seed, eta, device=device, path=path)
                jobs.append(GridJob(job_id(cell.id, seed, eta), cell, seed, eta, sim, len(jobs)))
    if not design.verdict_seeds:
        return jobs
    chosen = eta_choices(design, scale, jobs, latest or {}, complete=True)
    for slot, cell, seed in verdict_slots(design, scale):
        at: float | None = None
        if cell.kind != "control":
            choice = chosen.get(cell.id)
            if choice is None or choice.eta is None:
                continue  # not chosen yet, or every eta diverged
            at = choice.eta
        sim = job_for(design, sc, cell, seed, at, device=device, path=path)
        jobs.append(GridJob(job_id(cell.id, seed, at), cell, seed, at, sim, slot, True))
    return jobs


def verdict_slots(design: Design, scale: str) -> list[tuple[int, Cell, int]]:
    """(slot, cell, seed) of every verdict job of ``scale``, in plan order (after every
    selection job's slot)."""
    cells = cell_priority(design, scale)
    base = sum(len(design.seeds) * (len(design.sweep(c, scale)) if c.kind != "control" else 1)
               for c in cells)  # fmt: skip
    return [(base + k * len(design.verdict_seeds) + t, c, seed)
            for k, c in enumerate(cells) for t, seed in enumerate(design.verdict_seeds)]  # fmt: skip


def eta_choices(
    design: Design,
    scale: str,
    jobs: Iterable[GridJob],
    latest: Mapping[str, dict[str, Any]],
    *,
    complete: bool = False,
) -> dict[str, EtaChoice]:
    """Per arm of ``scale``, its outer lr chosen by the registered rule (``select_outer_lr``)
    on its jobs on the selection seeds (``Design.seeds``) that are final in ``latest``.
    ``complete``: only arms whose selection jobs are all final."""
    runs: dict[str, dict[float, dict[int, float | None]]] = {}
    pending: set[str] = set()
    for j in jobs:
        if j.eta is None or j.verdict:
            continue
        r = latest.get(j.job_id)
        if r is None or r["status"] not in FINAL:
            pending.add(j.cell.id)
            continue
        loss = r.get("final_loss") if r["status"] == "done" else None
        runs.setdefault(j.cell.id, {}).setdefault(j.eta, {})[j.seed] = loss
    out = {}
    for c in design.cells_of(scale):
        if c.kind != "control" and not (complete and c.id in pending):
            out[c.id] = select_outer_lr(runs.get(c.id, {}), design.seeds, design.sweep(c, scale))
    return out


def plan_with_rows(
    design: Design,
    scale: str,
    rows: Iterable[dict[str, Any]],
    *,
    device: str | None = None,
    path: ExecPath = "batched",
) -> tuple[list[GridJob], dict[str, dict[str, Any]], int]:
    """(the plan, job id -> its newest matching row, stale rows ignored) given the folder's
    rows: the verdict jobs the rows' selections make ready are in the plan."""
    rows = list(rows)
    plan = plan_jobs(design, scale, device=device, path=path)
    if design.verdict_seeds:
        latest, _ = latest_rows(rows, plan)
        plan = plan_jobs(design, scale, device=device, path=path, latest=latest)
    latest, stale = latest_rows(rows, plan)
    return plan, latest, stale


def parse_shard(text: str) -> Shard:
    """``I/N`` (``0 <= I < N``) as (I, N); a ConfigError naming the problem otherwise."""
    i, sep, n = text.partition("/")
    try:
        shard = (int(i), int(n)) if sep else (-1, 0)
    except ValueError:
        shard = (-1, 0)
    return check_shard(shard, text)


def check_shard(shard: Shard, given: str | None = None) -> Shard:
    """``shard`` if it is shard I of N with 0 <= I < N, else a ConfigError naming it
    (``given``: as the user wrote it)."""
    if not 0 <= shard[0] < shard[1]:
        shown = given if given is not None else f"{shard[0]}/{shard[1]}"
        raise ConfigError(
            f"grid: --shard takes I/N with 0 <= I < N (a 0-based index), got {shown!r}"
        )
    return shard


def shard_jobs(jobs: list[GridJob], shard: Shard | None) -> list[GridJob]:
    """Shard i of n's jobs: those at slots i, i + n, ... of the plan (all of them for None)."""
    if shard is None:
        return jobs
    i, n = shard
    return [j for j in jobs if j.slot % n == i]


def _file_of(name: str, shard: Shard | None) -> str:
    """``name``, or for a shard ``<stem>.shard-<i>-of-<n>.jsonl``."""
    if shard is None:
        return name
    stem = name.removesuffix(".jsonl")
    return f"{stem}.shard-{shard[0]}-of-{shard[1]}.jsonl"


def runs_files(out: Path, name: str = RUNS_FILE) -> list[Path]:
    """The folder's files of ``name``: the unsharded one, then every shard's, in name order."""
    stem = name.removesuffix(".jsonl")
    files = [out / name] if (out / name).exists() else []
    return files + sorted(out.glob(f"{stem}.shard-*-of-*.jsonl"))


# -- the results folder ---------------------------------------------------------------


def read_rows(out: Path, name: str = RUNS_FILE) -> list[dict[str, Any]]:
    """Every row of the folder's runs files (``runs_files``: the unsharded file and every
    shard's), each file in its order (a torn last line is skipped); with shard files, all
    merged by finish time (a stable sort: rows of one file keep their order), so the newest
    row of a job is last wherever it was written."""
    files = runs_files(out, name)
    rows = []
    for f in files:
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                if i != len(lines) - 1:
                    raise PreregError(f"{f}: line {i + 1} is not JSON") from None
    if len(files) > 1:
        rows.sort(key=lambda r: str(r.get("finished_utc") or r.get("end_utc") or ""))
    return rows


def latest_rows(
    rows: Iterable[dict[str, Any]], jobs: Iterable[GridJob]
) -> tuple[dict[str, dict[str, Any]], int]:
    """(job id -> its newest row whose key matches the plan, count of stale rows ignored)."""
    keys = {j.job_id: j.sim.key() for j in jobs}
    latest: dict[str, dict[str, Any]] = {}
    stale = 0
    for r in rows:
        if keys.get(r.get("job_id", "")) == r.get("key"):
            latest[r["job_id"]] = r
        else:
            stale += 1
    return latest, stale


def check_folder(rows: Iterable[dict[str, Any]], pre: Prereg, scale: str, out: Path) -> None:
    """Refuse a results folder that holds rows of another design or scale."""
    for r in rows:
        if r.get("design_sha256") != pre.design_sha256 or r.get("scale") != scale:
            raise PreregError(
                f"results folder {out} holds rows of design {r.get('design_sha256')} scale "
                f"{r.get('scale')!r}, not {pre.design_sha256} {scale!r}; use another --out"
            )


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _append(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row, sort_keys=True, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


# -- the worker -----------------------------------------------------------------------


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def run_one(task: dict[str, Any]) -> dict[str, Any]:
    """Train one job (in a worker) and return its row; never raises."""
    from hypertrain.sim.engine.run import run_job

    row = dict(task["row"])
    t0 = time.perf_counter()
    try:
        if task.get("inject_error"):
            raise RuntimeError(f"injected failure (test hook) in {row['job_id']}")
        ck = task.get("checkpoint")
        res = run_job(SimJob.from_dict(task["job"]), checkpoint=Path(ck) if ck else None,
                      checkpoint_every_s=task.get("checkpoint_every_s") or 0.0)  # fmt: skip
        d = res.to_dict()
        row.update(
            status="divergent" if res.diverged else "done",
            final_loss=d["final_loss"], final_loss_raw=d["final_loss_raw"],
            initial_loss=d["initial_loss"], curve=d["curve"], steps_done=res.steps_done,
            diverged_at=res.diverged_at, reason=res.reason, steps_per_s=_finite(res.steps_per_s),
            wall_s=res.seconds, path=res.path, device=res.device, n_params=res.n_params,
        )  # fmt: skip
        if res.absent:  # churn: who missed which sync step (a row without churn is as before)
            row["absent"] = d["absent"]
        if res.resumed_from:  # resumed from its checkpoint after these steps
            row["resumed_from"] = res.resumed_from
    except Exception as e:  # recorded, never lost
        tb = traceback.format_exc(limit=6)
        row.update(status="error", error=f"{type(e).__name__}: {e}", traceback=tb[-4000:])
        row.update(wall_s=time.perf_counter() - t0)
    row["finished_utc"] = utc_now()
    return row


CHECKPOINTS = "checkpoints"
"""The results folder's sub-folder of in-flight jobs' checkpoints (one file per job,
removed once its row is written)."""


def checkpoint_path(out: Path, job: GridJob) -> Path:
    """Where ``job`` saves its state in ``out``: named by the hash of its design key."""
    digest = hashlib.sha256(job.sim.key().encode()).hexdigest()[:24]
    return out / CHECKPOINTS / f"{digest}.pt"


def _task(
    job: GridJob,
    pre: Prereg,
    scale: str,
    inject: bool,
    checkpoint: Path | None = None,
    every_s: float | None = None,
) -> dict[str, Any]:
    row = {
        "job_id": job.job_id, "cell": job.cell.id, "kind": job.cell.kind, "seed": job.seed,
        "eta": job.eta, "key": job.sim.key(), "scale": scale,
        "design_sha256": pre.design_sha256, "path": job.sim.path,
        "device": job.sim.resolved_device(),
    }  # fmt: skip
    return {"job": job.sim.to_dict(), "row": row, "inject_error": inject,
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "checkpoint_every_s": every_s}  # fmt: skip


# -- the runner -----------------------------------------------------------------------


@dataclass(slots=True)
class GridReport:
    """What one invocation did, and the state of the whole grid after it."""

    total: int
    skipped: int
    """Jobs already final in the folder (not rerun)."""
    started: int
    counts: dict[str, int]
    """Over the whole grid after this run: done, divergent, error, censored."""
    wall_s: float
    stale_rows: int


def _fmt_s(s: float) -> str:
    return f"{s / 60:.1f}m" if s >= 90 else f"{s:.0f}s"


def _progress(
    row: dict[str, Any], counts: dict[str, int], total: int, elapsed: float, eta_s: float
) -> str:
    """One line per finished job: done/total, its status, the counts so far, elapsed, ETA."""
    loss = row.get("final_loss")
    what = f"loss {loss:.4f}" if loss is not None else (row.get("error") or row.get("reason") or "")
    return (
        f"[{sum(counts.values())}/{total}] {row['status']:9s} {row['job_id']} {what[:70]} "
        f"({_fmt_s(row.get('wall_s') or 0.0)}) | done {counts['done']} div "
        f"{counts['divergent']} err {counts['error']} | elapsed {_fmt_s(elapsed)}, "
        f"ETA {_fmt_s(eta_s)}"
    )


def run_grid(
    prereg: str | Path | None,
    scale: str,
    out: str | Path | None = None,
    *,
    processes: int | None = None,
    wall_cap_s: float | None = None,
    max_jobs: int | None = None,
    device: str | None = None,
    path: ExecPath = "batched",
    inject_errors: Collection[str] = (),
    log: Callable[[str], None] | None = print,
    shard: Shard | None = None,
    poll_s: float = 30.0,
    checkpoint_every_s: float | None = 300.0,
) -> GridReport:
    """Run the jobs of ``scale`` (of its ``shard``, see the module docstring) not yet final
    in ``out``; caps may only be lowered."""
    t_start = time.monotonic()
    pre = load_checked(prereg)
    sc = pre.design.scale(scale)
    procs = min(sc.process_cap, processes or sc.process_cap)
    cap = min(float(sc.wall_clock_cap_s), wall_cap_s if wall_cap_s is not None else math.inf)
    bad = [name for name, ok in (
        ("processes", procs >= 1), ("the wall-clock cap", cap > 0),
        ("--max-jobs", max_jobs is None or max_jobs >= 0), ("--poll", poll_s > 0),
        ("--checkpoint-every (0: never)", checkpoint_every_s is None or checkpoint_every_s > 0),
    ) if not ok]  # fmt: skip
    if bad:
        raise ConfigError(f"grid: {', '.join(bad)} must be positive")
    if shard is not None:
        check_shard(shard)  # before anything is written
    out = Path(out) if out is not None else default_out(scale, prereg)
    out.mkdir(parents=True, exist_ok=True)
    if checkpoint_every_s:
        (out / CHECKPOINTS).mkdir(exist_ok=True)
    design = pre.design
    rows = read_rows(out)
    check_folder(rows, pre, scale, out)
    plan, everyone, stale = plan_with_rows(design, scale, rows, device=device, path=path)
    # (rows of other shards are not stale)
    waiting, blocked = verdict_waiting(design, scale, plan, everyone, shard)
    jobs = shard_jobs(plan, shard)
    mine = {j.job_id for j in jobs}
    latest = {k: r for k, r in everyone.items() if k in mine}
    todo = [j for j in jobs if latest.get(j.job_id, {}).get("status") not in FINAL]
    skipped = len(jobs) - len(todo)
    say = log or (lambda _m: None)
    part = "" if shard is None else f" (shard {shard[0]} of {shard[1]})"
    later = f" (and {waiting} verdict jobs once their eta is chosen)" if waiting else ""
    say(
        f"grid {scale}{part}: {len(jobs) + waiting} registered jobs, {skipped} already final, "
        f"running {len(todo)}{later} with {procs} processes, wall-clock cap {_fmt_s(cap)}, "
        f"design {pre.design_sha256[:12]}" + (f" ({stale} stale rows ignored)" if stale else "")
    )
    counts = {s: 0 for s in ("done", "divergent", "error")}
    for r in latest.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    runs_file, started, finished, busy = out / _file_of(RUNS_FILE, shard), 0, 0, 0.0
    queue = list(todo)
    queued = {j.job_id for j in queue} | set(latest)
    budget = math.inf if max_jobs is None else max_jobs
    ctx = multiprocessing.get_context("spawn")

    def replan() -> bool:
        """Queue the verdict jobs the rows now make ready (this shard's and, in a shared
        folder, the other shards'); True while some wait for another shard's selection."""
        nonlocal jobs, waiting
        if not design.verdict_seeds:
            return False
        rows_now = read_rows(out)
        check_folder(rows_now, pre, scale, out)
        new_plan, new_latest, _ = plan_with_rows(design, scale, rows_now, device=device,
                                                 path=path)  # fmt: skip
        jobs = shard_jobs(new_plan, shard)
        for j in jobs:
            if j.job_id not in queued and new_latest.get(j.job_id, {}).get("status") not in FINAL:
                queue.append(j)
                queued.add(j.job_id)
        waiting, others = verdict_waiting(design, scale, new_plan, new_latest, shard)
        return others

    def new_pool() -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(procs, mp_context=ctx, initializer=_init_worker)

    inflight: dict[cf.Future[dict[str, Any]], GridJob] = {}
    pool, broken_pools = new_pool(), 0
    blocked = replan()
    try:
        while queue or inflight or blocked:
            try:
                while (queue and len(inflight) < procs and started < budget
                       and time.monotonic() - t_start < cap):  # fmt: skip
                    ck = checkpoint_path(out, queue[0]) if checkpoint_every_s else None
                    task = _task(queue[0], pre, scale, queue[0].job_id in inject_errors, ck,
                                 checkpoint_every_s)  # fmt: skip
                    inflight[pool.submit(run_one, task)] = queue[0]
                    queue.pop(0)
                    started += 1
            except BrokenProcessPool:
                pass  # the in-flight futures report it below
            if not inflight:
                if queue or not blocked or started >= budget or time.monotonic() - t_start >= cap:
                    break  # a cap: nothing more is started
                # verdict jobs wait for selection jobs another shard runs: poll the folder
                time.sleep(poll_s)
                blocked = replan()
                continue
            ready, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
            broken = False
            for fut in ready:
                job = inflight.pop(fut)
                try:
                    row = fut.result()
                except Exception as e:  # a worker died (killed, out of memory): an error row
                    broken = broken or isinstance(e, BrokenProcessPool)
                    row = _task(job, pre, scale, False)["row"]
                    row.update(status="error", error=f"worker failed: {e!r}", wall_s=None)
                    row["finished_utc"] = utc_now()
                _append(runs_file, row)
                if row["status"] in FINAL:  # (an error or a dead worker resumes from it)
                    for f in (ck := checkpoint_path(out, job), ck.with_name(ck.name + ".tmp")):
                        f.unlink(missing_ok=True)
                old = latest.get(job.job_id, {}).get("status")
                if old in counts:
                    counts[old] -= 1
                latest[job.job_id] = row
                counts[row["status"]] += 1
                finished += 1
                busy += row.get("wall_s") or 0.0
                say(_progress(row, counts, len(jobs) + waiting, time.monotonic() - t_start,
                              busy / finished * (len(queue) + len(inflight)) / procs))  # fmt: skip
            blocked = replan()
            if broken:  # a fresh pool for the rest; give up if workers keep dying
                broken_pools += 1
                pool.shutdown(wait=False, cancel_futures=True)
                if broken_pools > 3:
                    raise RuntimeError("grid: worker processes died 4 times; stopping")
                pool = new_pool()
    finally:
        for fut in inflight:
            fut.cancel()
        pool.shutdown(wait=not inflight, cancel_futures=True)
    wall = time.monotonic() - t_start
    total = len(jobs) + waiting
    final = dict(counts, censored=total - sum(counts.values()))
    _append(
        out / _file_of(INVOCATIONS_FILE, shard),
        {
            **({} if shard is None else {"shard": f"{shard[0]}/{shard[1]}"}),
            "end_utc": utc_now(), "wall_s": wall, "scale": scale, "processes": procs,
            "wall_clock_cap_s": cap, "max_jobs": max_jobs, "started": started,
            "finished": finished, "skipped": skipped, "counts": final,
            "device": device or os.environ.get("HYPERTRAIN_SIM_DEVICE") or "cpu", "path": path,
            "design_sha256": pre.design_sha256,
        },
    )  # fmt: skip
    say(
        f"grid {scale}{part}: {finished} jobs run in {_fmt_s(wall)}; now done {final['done']}, "
        f"divergent {final['divergent']}, error {final['error']}, censored {final['censored']} "
        f"of {total}"
    )
    return GridReport(total, skipped, started, final, wall, stale)


def verdict_waiting_cells(
    design: Design, scale: str, plan: list[GridJob], latest: Mapping[str, dict[str, Any]]
) -> set[str]:
    """The arms whose verdict jobs are not planned yet: their selection is not final."""
    if not design.verdict_seeds:
        return set()
    chosen = eta_choices(design, scale, plan, latest, complete=True)
    return {c.id for c in design.cells_of(scale) if c.kind != "control" and c.id not in chosen}


def verdict_waiting(
    design: Design,
    scale: str,
    plan: list[GridJob],
    latest: Mapping[str, dict[str, Any]],
    shard: Shard | None,
) -> tuple[int, bool]:
    """(how many of ``shard``'s verdict jobs wait for their arm's eta, whether any waits
    for a selection job another shard may still finish: one in no final and no error row,
    so not this shard's, which it either runs now or retries next time).  ``latest``: every
    shard's rows."""
    waiting = verdict_waiting_cells(design, scale, plan, latest)
    mine_slot = (lambda slot: True) if shard is None else (lambda slot: slot % shard[1] == shard[0])
    mine = [c.id for slot, c, _ in verdict_slots(design, scale)
            if c.id in waiting and mine_slot(slot)]  # fmt: skip
    cells, n = set(mine), len(mine)
    others = any(
        j.cell.id in cells and not j.verdict and not mine_slot(j.slot)
        and latest.get(j.job_id, {}).get("status") not in (*FINAL, "error")
        for j in plan
    )  # fmt: skip
    return n, others
