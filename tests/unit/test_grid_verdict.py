"""Verdict seeds (the second parity registration, experiments/sim/parity2_prereg.json): each
arm's eta is chosen on the selection seeds, its verdict jobs run at that eta on fresh seeds,
the sensitivity control is the best DP lr on the selection seeds, and the grid runs both
phases in one invocation, resumes, and splits them into shards that wait for each other.
The designs here are test-only, registered into tmp; the registered files are checked by
test_prereg.py and below (their hashes are unchanged by the new fields)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hypertrain.sim.study.design import Design, PreregError, Scale
from hypertrain.sim.study.grid import (
    GridJob,
    eta_choices,
    plan_jobs,
    plan_with_rows,
    read_rows,
    run_grid,
    shard_jobs,
    verdict_slots,
    verdict_waiting,
)
from hypertrain.sim.study.prereg import (
    H2_PATH,
    PARITY2_PATH,
    REGISTRATIONS,
    load_prereg,
    parity2_design,
    write_prereg,
)
from hypertrain.sim.study.summary import SUMMARY_FILE, summarize

SCALE = "unit"
FLAT = "flat-M2-Hg10"
LOW, HIGH = "dp-adamw-lr0.001", "dp-adamw"
SEEDS, VERDICT = (0, 1), (10, 11, 12)


def unit_design() -> Design:
    """parity2's cells cut to two DP lrs and one flat arm (eta 0.4 or 0.8), 10 steps: 8
    selection jobs and 9 verdict jobs."""
    reg = parity2_design()
    sweep = (LOW, HIGH)
    cells = tuple(
        dataclasses.replace(c, outer_lrs=(0.4, 0.8), control_sweep=sweep) if c.id == FLAT else c
        for c in reg.cells
        if c.id in (LOW, HIGH, FLAT)
    )
    scale = Scale(
        name=SCALE, note="test only", steps=10, model="tiny", n_layer=1, d_model=32, n_head=2,
        seq_len=16, global_batch=4, holdout_windows=8, warmup_steps=1,
        cells=(LOW, HIGH, FLAT), wall_clock_cap_s=600, process_cap=2, nesterov_outer_lrs=None,
    )  # fmt: skip
    return dataclasses.replace(
        reg, seeds=SEEDS, verdict_seeds=VERDICT, scales=(scale,), cells=cells
    )


@pytest.fixture
def prereg(tmp_path: Path) -> Path:
    path = tmp_path / "prereg.json"
    write_prereg(path, unit_design())
    return path


def _row(j: GridJob, loss: float | None, status: str = "done") -> dict[str, Any]:
    return {"job_id": j.job_id, "key": j.sim.key(), "status": status, "final_loss": loss}


# -- the design ------------------------------------------------------------------------------


def test_new_fields_are_out_of_the_older_registrations_and_refused_when_inconsistent() -> None:
    for path, build in REGISTRATIONS.items():
        d = build().to_dict()
        pre = load_prereg(path)
        assert pre.design == build()
        if path != PARITY2_PATH:  # registered before the fields existed: hashes unchanged
            assert "verdict_seeds" not in d
            assert all("control_sweep" not in c for c in d["cells"])
    p2 = parity2_design()
    assert Design.from_dict(p2.to_dict()) == p2
    assert p2.verdict_seeds == tuple(range(100, 120)) and p2.seeds == (0, 1, 2)
    flat = p2.cell("flat-M8-Hg30")
    assert flat.sensitivity_controls() == (LOW, "dp-adamw-lr0.002", HIGH, "dp-adamw-lr0.006")
    assert {c.id for c in p2.cells if c.h_g == 100} == {"flat-M8-Hg100"}
    assert {c.h_r for c in p2.cells if c.kind == "hier"} == {1, 5, 10}
    with pytest.raises(PreregError, match="verdict_seeds must be distinct and not selection"):
        dataclasses.replace(p2, verdict_seeds=(2, 100))
    with pytest.raises(PreregError, match="at least 2 verdict_seeds"):
        dataclasses.replace(p2, verdict_seeds=(100,))
    with pytest.raises(PreregError, match="its control among them"):
        dataclasses.replace(flat, control_sweep=(LOW,))
    with pytest.raises(PreregError, match="replaces control_alt"):
        dataclasses.replace(flat, control_alt=LOW)
    with pytest.raises(PreregError, match=r"control_sweep\[1\] 'dp-x' is not a control"):
        dataclasses.replace(p2, cells=tuple(
            dataclasses.replace(c, control_sweep=(HIGH, "dp-x")) if c.id == flat.id else c
            for c in p2.cells))  # fmt: skip
    scale = p2.scale("smoke")
    with pytest.raises(PreregError, match=r"needs its control_sweep\[0\]"):
        dataclasses.replace(p2, scales=(dataclasses.replace(scale, cells=(HIGH, FLAT)),))


# -- the plan ------------------------------------------------------------------------------


def test_an_arm_is_planned_on_verdict_seeds_only_once_its_selection_is_final() -> None:
    design = unit_design()
    plan = plan_jobs(design, SCALE)
    selection = [j for j in plan if not j.verdict]
    assert len(selection) == 8 and {j.seed for j in selection} == set(SEEDS)
    # the controls' verdict jobs at once, the arm's not yet
    assert {(j.cell.id, j.seed) for j in plan if j.verdict} == {
        (c, s) for c in (LOW, HIGH) for s in VERDICT
    }
    assert verdict_waiting(design, SCALE, plan, {}, None) == (3, False)
    arm = [j for j in selection if j.cell.id == FLAT]
    losses = {0.4: 3.0, 0.8: 2.5}
    latest = {j.job_id: _row(j, losses[j.eta or 0] + j.seed / 100) for j in arm[:-1]}
    assert FLAT not in eta_choices(design, SCALE, plan, latest, complete=True)
    assert [
        j for j in plan_jobs(design, SCALE, latest=latest) if j.cell.id == FLAT and j.verdict
    ] == []
    latest[arm[-1].job_id] = _row(arm[-1], losses[arm[-1].eta or 0] + 0.01)
    full = plan_jobs(design, SCALE, latest=latest)
    verdict = [j for j in full if j.cell.id == FLAT and j.verdict]
    assert [(j.seed, j.eta) for j in verdict] == [(s, 0.8) for s in VERDICT]
    assert [j.sim.outer.eta for j in verdict] == [0.8] * 3
    assert verdict_waiting(design, SCALE, full, latest, None) == (0, False)
    # every slot once, and a job keeps its slot whether its eta is known yet or not
    slots = [s for s, _, _ in verdict_slots(design, SCALE)]
    assert sorted(j.slot for j in full) == list(range(8 + len(slots)))
    assert {j.job_id: j.slot for j in plan} == {j.job_id: j.slot for j in full if j.job_id in
                                                 {x.job_id for x in plan}}  # fmt: skip
    for n in (2, 3, 5):
        parts = [shard_jobs(full, (i, n)) for i in range(n)]
        assert sorted(j.job_id for p in parts for j in p) == sorted(j.job_id for j in full)
    # an eta that diverged is never chosen; an arm whose every eta diverged has no verdict jobs
    bad = {j.job_id: _row(j, None, "divergent") for j in arm}
    bad[arm[0].job_id] = _row(arm[0], 2.0)
    assert eta_choices(design, SCALE, plan, bad, complete=True)[FLAT].eta != arm[0].eta
    dead = {j.job_id: _row(j, None, "divergent") for j in arm}
    assert eta_choices(design, SCALE, plan, dead, complete=True)[FLAT].eta is None
    assert [
        j for j in plan_jobs(design, SCALE, latest=dead) if j.cell.id == FLAT and j.verdict
    ] == []
    assert verdict_waiting(design, SCALE, plan, dead, None) == (0, False)


# -- the grid, end to end ------------------------------------------------------------------


def _loss_means(rows: dict[int, float]) -> float:
    return math.fsum(rows.values()) / len(rows)


def test_one_invocation_runs_selection_then_verdict_and_the_summary_uses_fresh_seeds(
    prereg: Path, tmp_path: Path
) -> None:
    out = tmp_path / "res"
    flat_sel = [j.job_id for j in plan_jobs(unit_design(), SCALE) if j.cell.id == FLAT]
    # A selection job that fails leaves the arm's verdict jobs waiting, and the run ends.
    lines: list[str] = []
    rep = run_grid(prereg, SCALE, out, processes=2, inject_errors={flat_sel[0]},
                   log=lines.append)  # fmt: skip
    assert rep.total == 17 and rep.counts == {"done": 13, "divergent": 0, "error": 1,
                                              "censored": 3}  # fmt: skip
    assert "(and 3 verdict jobs once their eta is chosen)" in lines[0]
    # The next invocation reruns it and, in the same invocation, the verdict jobs.
    rep = run_grid(prereg, SCALE, out, processes=2, log=None)
    assert rep.started == 4 and rep.counts == {"done": 17, "divergent": 0, "error": 0,
                                                "censored": 0}  # fmt: skip
    assert run_grid(prereg, SCALE, out, log=None).started == 0
    summary = summarize(prereg, SCALE, out, plots=True)
    assert (out / "curves.png").exists()
    cell = summary["cells"][FLAT]
    chosen = cell["chosen_eta"]
    sel = cell["eta_selection"]
    assert chosen == float(min(sel["mean_by_eta"], key=lambda e: (sel["mean_by_eta"][e], float(e))))
    rows = {r["job_id"]: r for r in read_rows(out) if r["status"] == "done"}
    assert {int(s) for s in cell["losses"]} == set(VERDICT)
    assert {int(s) for s in cell["selection_losses"]} == set(SEEDS)
    for s in VERDICT:
        assert cell["losses"][str(s)] == rows[f"{FLAT}/seed{s}/eta{chosen:g}"]["final_loss"]
    assert cell["vs_control"]["seeds"] == list(VERDICT)
    assert cell["vs_control"]["reference"] == HIGH
    # the sensitivity control is the DP lr with the lower mean on the selection seeds
    sel_means = {c: _loss_means({int(k): v for k, v in summary["cells"][c]["selection_losses"]
                                 .items()}) for c in (LOW, HIGH)}  # fmt: skip
    assert cell["best_control"] == min(sel_means, key=lambda c: sel_means[c])
    assert cell["vs_best_control"]["seeds"] == list(VERDICT)
    wc = cell["winners_curse"]
    assert (wc["selection_n"], wc["verdict_n"]) == (2, 3)
    assert wc["verdict_minus_selection"] == pytest.approx(wc["verdict_gap"] - wc["selection_gap"])
    assert summary["verdict_seeds"] == list(VERDICT)
    assert "selection seeds alone" in summary["winners_curse"]
    over = summary["winners_curse_over_arms"]  # the one DiLoCo arm here
    assert over["arms"] == 1 and over["min_arm"] == over["max_arm"] == FLAT
    assert over["mean"] == over["min"] == over["max"] == wc["verdict_minus_selection"]
    assert over["positive"] == int(wc["verdict_minus_selection"] > 0)
    for c in (LOW, HIGH):  # the controls' selection-seed means, from the rows themselves
        mean = sum(rows[f"{c}/seed{s}"]["final_loss"] for s in SEEDS) / len(SEEDS)
        assert summary["cells"][c]["selection_mean_loss"] == pytest.approx(mean, rel=1e-12)
    assert cell["selection_mean_loss"] == pytest.approx(cell["eta_selection"]["mean_loss"])
    assert summary["power"][FLAT]["n"] == 3
    assert summary["counts"] == {"total": 17, "done": 17, "divergent": 0, "error": 0,
                                 "censored": 0}  # fmt: skip


RESULT_FIELDS = ("key", "status", "final_loss", "initial_loss", "curve")


def test_two_shards_wait_for_each_others_selection_and_equal_the_unsharded_grid(
    prereg: Path, tmp_path: Path
) -> None:
    """Shards 0 and 1 of 2 as two processes on one folder: each arm's verdict jobs are
    split across both, so each shard waits for selection jobs the other runs; the merged
    rows and summary equal one unsharded invocation's bit for bit."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_grid(prereg, SCALE, whole, processes=1, log=None)
    design = unit_design()
    rows = read_rows(whole)
    plan, _, _ = plan_with_rows(design, SCALE, rows)
    for i in range(2):  # each shard has some of the arm's selection and verdict jobs
        mine = shard_jobs(plan, (i, 2))
        assert any(j.cell.id == FLAT and j.verdict for j in mine)
        assert any(j.cell.id == FLAT and not j.verdict for j in mine)
    argv = [sys.executable, "-m", "hypertrain", "sim", "grid", "--scale", SCALE, "--prereg",
            str(prereg), "--out", str(split), "--processes", "1", "--poll", "0.2"]  # fmt: skip
    procs = [
        subprocess.Popen([*argv, "--shard", f"{i}/2"], stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    a = {r["job_id"]: r for r in rows}
    b = {r["job_id"]: r for r in read_rows(split)}
    assert a.keys() == b.keys() == {j.job_id for j in plan} and len(a) == 17
    for job in a:
        assert {f: a[job].get(f) for f in RESULT_FIELDS} == {
            f: b[job].get(f) for f in RESULT_FIELDS
        }
    sa = summarize(prereg, SCALE, whole, plots=False)
    sb = summarize(prereg, SCALE, split, plots=False)
    timing = {"invocations", "job_seconds_total", "wall_s_total"}
    assert json.dumps({k: v for k, v in sa.items() if k not in timing}) == json.dumps(
        {k: v for k, v in sb.items() if k not in timing}
    )
    assert json.loads((split / SUMMARY_FILE).read_text())["counts"]["censored"] == 0


def test_a_shard_stops_waiting_at_its_wall_clock_cap(prereg: Path, tmp_path: Path) -> None:
    """Shard 1 of 2 alone: the verdict jobs it owns wait for shard 0's selection jobs,
    which never run; it polls until its cap, then stops with those jobs censored."""
    lines: list[str] = []
    rep = run_grid(prereg, SCALE, tmp_path / "res", processes=1, shard=(1, 2), wall_cap_s=5,
                   poll_s=0.2, log=lines.append)  # fmt: skip
    assert rep.counts["error"] == 0 and rep.counts["censored"] > 0
    assert rep.counts["done"] == rep.started
    with pytest.raises(Exception, match="grid: --poll must be positive"):
        run_grid(prereg, SCALE, tmp_path / "res", poll_s=0, log=None)
    for flag, value, said in (
        ("--poll", "0", "--poll"),
        ("--checkpoint-every", "-1", "--checkpoint-every (0: never)"),
    ):
        cli = subprocess.run(
            [sys.executable, "-m", "hypertrain", "sim", "grid", "--scale", SCALE, "--prereg",
             str(prereg), "--out", str(tmp_path / "never"), flag, value],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert cli.returncode == 2 and f"grid: {said} must be positive" in cli.stderr
        assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert not (tmp_path / "never").exists()


# -- divergence and errors on the verdict seeds -----------------------------------------------


def _fabricated(prereg: Path, out: Path, loss: dict[str, float], diverged: set[str]) -> None:
    """A results folder whose every job is done with ``loss[cell] + seed / 1e5`` (or
    divergent where its job id is in ``diverged``), as if the grid had run."""
    pre = load_prereg(prereg)
    design = pre.design
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    while True:  # plan again until the verdict jobs of every arm are in
        plan, latest, _ = plan_with_rows(design, SCALE, rows)
        new = [j for j in plan if j.job_id not in latest]
        if not new:
            break
        for j in new:
            dead = j.job_id in diverged
            rows.append({
                **_row(j, None if dead else loss[j.cell.id] + j.seed / 1e5 + (j.eta or 0) / 1e3,
                       "divergent" if dead else "done"),
                "cell": j.cell.id, "seed": j.seed, "eta": j.eta, "scale": SCALE,
                "design_sha256": pre.design_sha256, "finished_utc": "2026-12-04T00:00:00Z",
            })  # fmt: skip
    (out / "parity_runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_verdict_seed_that_diverged_makes_the_verdict_undefined_never_dropped(
    prereg: Path, tmp_path: Path
) -> None:
    loss = {LOW: 3.01, HIGH: 3.0, FLAT: 3.0}
    _fabricated(prereg, tmp_path / "ok", loss, set())
    ok = summarize(prereg, SCALE, tmp_path / "ok", plots=False)["cells"][FLAT]
    assert ok["chosen_eta"] == 0.4 and ok["verdict"] == "equivalent at delta = 0.005"
    for dead in (f"{FLAT}/seed11/eta0.4", f"{HIGH}/seed11"):  # the arm's, the control's
        _fabricated(prereg, tmp_path / "dead", loss, {dead})
        cell = summarize(prereg, SCALE, tmp_path / "dead", plots=False)["cells"][FLAT]
        assert cell["vs_control"]["seeds"] == list(VERDICT)  # seed 11 kept, as undefined
        assert cell["vs_control"]["tost"]["classification"] == "undefined"
        assert cell["verdict"] == "equivalence not demonstrated at delta = 0.005"


def test_no_shard_waits_for_a_selection_job_that_errored(prereg: Path) -> None:
    design = unit_design()
    plan = plan_jobs(design, SCALE)
    arm = [j for j in plan if j.cell.id == FLAT and not j.verdict]
    theirs = next(j for j in arm if j.slot % 2 == 0)  # a selection job of shard 0
    latest = {j.job_id: _row(j, 3.0) for j in plan if j is not theirs}
    n, others = verdict_waiting(design, SCALE, plan, latest, (1, 2))
    assert n > 0 and others  # shard 0 has not written its row yet: shard 1 waits
    latest[theirs.job_id] = _row(theirs, None, "error")
    n2, others = verdict_waiting(design, SCALE, plan, latest, (1, 2))
    assert n2 == n and not others  # it errored: shard 1 stops, its verdict jobs censored
    assert verdict_waiting(design, SCALE, plan, {}, None)[1] is False  # unsharded: never


def test_the_h2_registration_runs_and_summarizes_with_one_seed(tmp_path: Path) -> None:
    """h2_prereg.json's smoke scale end to end: one seed gives no verdict, but each M's
    best eta and the direction of H2."""
    out = tmp_path / "h2"
    rep = run_grid(H2_PATH, "smoke", out, processes=2, log=None)
    assert rep.counts == {"done": 5, "divergent": 0, "error": 0, "censored": 0}
    summary = summarize(H2_PATH, "smoke", out, plots=False)
    assert set(summary["h2"]["Hg30"]["eta_by_m"]) == {"1", "32"}
    for m in (1, 32):
        cell = summary["cells"][f"flat-M{m}-Hg30"]
        assert set(cell["eta_selection"]["mean_by_eta"]) == {"0.4", "1.0"}
        assert cell["vs_control"]["tost"]["classification"] == "undefined"  # n = 1


def test_the_curse_over_arms_splits_off_the_controls_term_and_skips_what_it_cannot_use() -> None:
    from types import SimpleNamespace

    from hypertrain.sim.study.summary import _curse_over_arms

    def cell(kind: str, control: str | None = "dp") -> SimpleNamespace:
        return SimpleNamespace(kind=kind, control=control)

    ids = ["dp", "neg", "a", "b", "c", "nan", "none"]
    kinds = ["control", "negative_control", "flat", "flat", "hier", "flat", "flat"]
    design = SimpleNamespace(
        cells=[
            SimpleNamespace(id=i, **vars(cell(k, None if k == "control" else "dp")))
            for i, k in zip(ids, kinds, strict=True)
        ]
    )

    def wc(sel: float, diff: float | None) -> dict[str, object]:
        return {"winners_curse": {"selection_gap": sel, "verdict_minus_selection": diff}}

    cells = {
        "dp": {"selection_mean_loss": 2.2, "mean_loss": 2.0},  # 10% worse on the selection seeds
        "neg": wc(0.0, 0.5),  # no choice: not an arm here
        "a": wc(0.10, 0.20),
        "b": wc(0.20, -0.05),
        "c": wc(0.00, 0.30),
        "nan": wc(0.10, float("nan")),  # a divergent verdict seed
        "none": wc(0.10, None),
    }
    over = _curse_over_arms(design, cells)  # type: ignore[arg-type]
    assert over["arms"] == 3 and over["left_out"] == ["nan", "none"]
    assert (over["positive"], over["min_arm"], over["max_arm"]) == (2, "b", "c")
    assert over["mean"] == pytest.approx(0.15) and (over["min"], over["max"]) == (-0.05, 0.30)
    assert over["control_shift"] == {"dp": pytest.approx(0.1)}
    # the control's term: (1 + selection gap) x its shift; the rest: what is left
    term = over["control_term"]
    assert (term["min"], term["max"]) == (pytest.approx(0.10), pytest.approx(0.12))
    assert (term["min_arm"], term["max_arm"]) == ("c", "b")
    rest = over["rest"]
    assert rest["mean"] == pytest.approx((0.09 - 0.17 + 0.20) / 3)
    assert (rest["min_arm"], rest["max_arm"], rest["positive"]) == ("b", "c", 2)
    assert _curse_over_arms(design, {"dp": cells["dp"]})["arms"] == 0  # type: ignore[arg-type]
