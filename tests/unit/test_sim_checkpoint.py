"""A simulator job saves its state and resumes from it (engine/run.py ``run_job``'s
checkpoint): a run stopped at any step and started again gives the uninterrupted run's
result bit for bit, on both execution paths and with every mechanism that keeps state
(streaming with overlap, LAWA, Muon, churn, the M = 1 anneal, hierarchies, the DP control);
a damaged or foreign file is never trusted; and the grid resumes a job whose worker was
killed with SIGKILL from its checkpoint."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hypertrain.sim.engine import run as run_mod
from hypertrain.sim.engine.job import JobResult
from hypertrain.sim.engine.run import SimJob, dp_job, flat_job, run_job
from hypertrain.sim.study.design import Scale
from hypertrain.sim.study.grid import CHECKPOINTS, read_rows, run_grid
from hypertrain.sim.study.prereg import registered_design, write_prereg


class Stop(Exception):
    """Stands for the process dying right after a save."""


STEPS = 20


def _variant(name: str) -> SimJob:
    base = flat_job(4, 10, steps=STEPS, model="tiny", seed=3).to_dict()
    muon = {**base["inner"], "name": "muon"}
    changes: dict[str, dict[str, Any]] = {
        "stream-overlap-lawa": {"fragments": 2, "tau": 1, "lawa_k": 2},
        "stream-overlap-lawa-per-replica": {"fragments": 2, "tau": 1, "lawa_k": 2,
                                            "path": "per_replica"},
        "muon": {"inner": muon},
        "churn": {"drop": 0.3},
        "anneal-m1-lawa": {"anneal": "m1", "lawa_k": 2},
        "hier-2x2": {"regions": 2, "islands_per_region": 2, "h_r": 5},
    }  # fmt: skip
    if name == "dp":
        return dp_job(steps=STEPS, model="tiny", seed=3, h=10)
    return SimJob.from_dict({**base, **changes[name]})


def _same(a: JobResult, b: JobResult) -> None:
    assert a.final_params is not None and b.final_params is not None
    assert torch.equal(a.final_params, b.final_params)
    assert (a.lawa_params is None) == (b.lawa_params is None)
    if a.lawa_params is not None and b.lawa_params is not None:
        assert torch.equal(a.lawa_params, b.lawa_params)
    for f in ("final_loss", "final_loss_raw", "initial_loss", "curve", "train_curve",
              "absent", "steps_done", "diverged"):  # fmt: skip
        assert getattr(a, f) == getattr(b, f), f


def _dies_after_saving(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """The next run saves only at ``step`` and dies right after that save."""
    save = run_mod.save_checkpoint

    def save_then_die(path: Path, state: dict[str, Any], replicas: Any) -> None:
        if state["step"] == step:
            save(path, state, replicas)
            raise Stop

    monkeypatch.setattr(run_mod, "save_checkpoint", save_then_die)


@pytest.mark.parametrize(
    ("name", "step"),
    [("stream-overlap-lawa", 10), ("stream-overlap-lawa", 13),
     ("stream-overlap-lawa-per-replica", 5), ("muon", 10), ("churn", 10),
     ("anneal-m1-lawa", 17), ("hier-2x2", 5), ("dp", 10)],
)  # fmt: skip
def test_a_run_stopped_and_resumed_is_the_uninterrupted_run_bit_for_bit(
    name: str, step: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped right after the save at ``step``: at a sync step of a fragment with tau = 1
    its merge is still in flight (10, 5), in the overlap (13), in the M = 1 anneal (17)."""
    job = _variant(name)
    whole = run_job(job)
    ck = tmp_path / "job.pt"
    with monkeypatch.context() as m:
        _dies_after_saving(m, step)
        with pytest.raises(Stop):
            run_job(job, checkpoint=ck, checkpoint_every_s=1e-9)
    assert ck.exists() and [p.name for p in tmp_path.iterdir()] == ["job.pt"]  # no temp left
    resumed = run_job(job, checkpoint=ck, checkpoint_every_s=3600)
    _same(whole, resumed)
    assert resumed.resumed_from == [step] and whole.resumed_from == []
    if name == "churn":
        assert any(gone for _, gone, _ in resumed.absent)


def test_a_damaged_or_foreign_checkpoint_is_never_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _variant("muon")
    whole = run_job(job)
    ck = tmp_path / "job.pt"
    ck.write_bytes(b"not a checkpoint")
    _same(whole, fresh := run_job(job, checkpoint=ck, checkpoint_every_s=3600))
    assert fresh.resumed_from == []
    ck.unlink()
    with monkeypatch.context() as m:  # another job's state at this path
        _dies_after_saving(m, 10)
        with pytest.raises(Stop):
            run_job(_variant("churn"), checkpoint=ck, checkpoint_every_s=1e-9)
    assert ck.exists()
    _same(whole, fresh := run_job(job, checkpoint=ck, checkpoint_every_s=3600))
    assert fresh.resumed_from == []
    # this job's state, but written on the other execution path, or by other code
    ck.unlink()
    per_replica = SimJob.from_dict({**job.to_dict(), "path": "per_replica"})
    with monkeypatch.context() as m:
        _dies_after_saving(m, 10)
        with pytest.raises(Stop):
            run_job(per_replica, checkpoint=ck, checkpoint_every_s=1e-9)
    _same(whole, fresh := run_job(job, checkpoint=ck, checkpoint_every_s=3600))
    assert fresh.resumed_from == []
    monkeypatch.setattr(run_mod, "code_fingerprint", lambda: "other code")
    _same(whole, fresh := run_job(per_replica, checkpoint=ck, checkpoint_every_s=3600))
    assert fresh.resumed_from == []


def test_a_checkpoint_whose_resumed_run_fails_is_set_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state that loads but fails to train on is never resumed from again: the retry
    starts over (and still gives the uninterrupted result)."""
    job = _variant("dp")
    whole = run_job(job)
    ck = tmp_path / "job.pt"
    with monkeypatch.context() as m:
        _dies_after_saving(m, 10)
        with pytest.raises(Stop):
            run_job(job, checkpoint=ck, checkpoint_every_s=1e-9)

    def broken(step: int, loss: float) -> None:
        raise RuntimeError("a step that fails after the resume")

    with pytest.raises(RuntimeError, match="after the resume"):
        run_job(job, broken, checkpoint=ck, checkpoint_every_s=3600)
    assert not ck.exists() and ck.with_name("job.pt.failed").exists()
    _same(whole, fresh := run_job(job, checkpoint=ck, checkpoint_every_s=3600))
    assert fresh.resumed_from == []


FLAT = "flat-M2-Hg10"


def test_the_grid_resumes_a_job_whose_worker_was_killed_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """`hypertrain sim grid` killed with SIGKILL (runner and worker) while a job is in
    flight and has saved: the next invocation resumes that job from its checkpoint, every
    result equals an uninterrupted grid's bit for bit, and no checkpoint is left."""
    reg = registered_design()
    scale = Scale(
        name="unit", note="test only", steps=400, model="tiny", n_layer=1, d_model=32,
        n_head=2, seq_len=16, global_batch=4, holdout_windows=8, warmup_steps=1,
        cells=("dp-adamw", FLAT), wall_clock_cap_s=600, process_cap=1,
        nesterov_outer_lrs=(0.4,),
    )  # fmt: skip
    design = dataclasses.replace(reg, seeds=(0,), scales=(scale,))
    prereg = tmp_path / "prereg.json"
    write_prereg(prereg, design)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    run_grid(prereg, "unit", clean, processes=1, checkpoint_every_s=None, log=None)
    argv = [sys.executable, "-m", "hypertrain", "sim", "grid", "--scale", "unit", "--prereg",
            str(prereg), "--out", str(killed), "--processes", "1", "--checkpoint-every",
            "0.05", "--no-plots"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while not list((killed / CHECKPOINTS).glob("*.pt")):
            assert proc.poll() is None, "the grid finished before any checkpoint was saved"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    rep = run_grid(prereg, "unit", killed, processes=1, checkpoint_every_s=0.05, log=None)
    assert rep.counts["done"] == 2 and rep.counts["error"] == 0
    a = {r["job_id"]: r for r in read_rows(clean)}
    b = {r["job_id"]: r for r in read_rows(killed)}
    assert a.keys() == b.keys()
    for job in a:
        for f in ("key", "status", "final_loss", "final_loss_raw", "initial_loss", "curve"):
            assert a[job][f] == b[job][f], (job, f)
    assert any(r.get("resumed_from") for r in b.values())
    assert not any("resumed_from" in r for r in a.values())
    assert list((killed / CHECKPOINTS).iterdir()) == []
