"""The grid runner of docs/design.md §7.11 (hypertrain.sim.study.grid / summary / plots /
sim_cmd), end to end on a test-only design of eight short jobs registered into tmp: it
refuses an altered registration, records errors and censored jobs, resumes without redoing
finished jobs, and writes every output file."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hypertrain import sim_cmd
from hypertrain.common.errors import ConfigError
from hypertrain.sim.study.design import Design, PreregError, Scale
from hypertrain.sim.study.grid import (
    RUNS_FILE,
    job_for,
    load_checked,
    parse_shard,
    plan_jobs,
    read_rows,
    run_grid,
    shard_jobs,
)
from hypertrain.sim.study.prereg import DEFAULT_PATH, registered_design, write_prereg
from hypertrain.sim.study.summary import CSV_FILE, SUMMARY_FILE, summarize

SCALE = "unit"
FLAT = "flat-M2-Hg10"
NEG = "negctl-M1-H1-average"
SUMMARY_KEYS = {
    "protocol", "prereg", "scale", "seeds", "delta", "alpha", "counts", "cells",
    "negative_control", "h1", "h2", "h3", "h4", "power", "winners_curse", "selection_rule",
    "invocations",
}  # fmt: skip


def unit_design() -> Design:
    """Registered cells, two seeds, a two-eta sweep, a 10-step scale: 8 jobs."""
    reg = registered_design()
    keep = ("dp-adamw", "dp-adamw-lr2", NEG, FLAT)
    cells = tuple(
        dataclasses.replace(c, outer_lrs=(0.4, 0.8)) if c.id == FLAT else c
        for c in reg.cells
        if c.id in keep
    )
    scale = Scale(
        name=SCALE, note="test only", steps=10, model="tiny", n_layer=1, d_model=32, n_head=2,
        seq_len=16, global_batch=4, holdout_windows=8, warmup_steps=1,
        cells=("dp-adamw", NEG, FLAT), wall_clock_cap_s=600, process_cap=2,
    )  # fmt: skip
    return dataclasses.replace(reg, seeds=(0, 1), scales=(scale,), cells=cells)


@pytest.fixture
def prereg(tmp_path: Path) -> Path:
    path = tmp_path / "prereg.json"
    write_prereg(path, unit_design())
    return path


def test_plan_covers_every_registered_job() -> None:
    """Every registered job of every scale maps to a valid SimJob, controls and negctl first."""
    design = registered_design()
    for sc in design.scales:
        jobs = plan_jobs(design, sc.name)
        cells = design.cells_of(sc.name)
        want = sum(len(design.seeds) * max(1, len(design.sweep(c, sc.name))) for c in cells)
        assert len(jobs) == want == len({j.job_id for j in jobs})
        assert jobs[0].cell.kind in ("control", "negative_control")
    tiny = design.scale("cpu-tiny")
    cell = design.cell("mech-M8-Hg30-lawa")
    job = job_for(design, tiny, cell, 1, 0.2)
    assert (job.n_replicas, job.h_g, job.lawa_k, job.outer.eta, job.seed) == (8, 30, 5, 0.2, 1)
    assert job.model_config().d_model == tiny.d_model and job.steps == tiny.steps
    # cpu-tiny registers its own Nesterov sweep; the full scale keeps the starting grid of
    # docs/design.md §5.4, and cells with another outer keep theirs at every scale.
    assert design.sweep(cell, "cpu-tiny") == (0.05, 0.1, 0.2, 0.4)
    assert design.sweep(cell, "full") == (0.4, 0.6, 0.8, 1.0)
    sparse = design.cell("mech-M8-Hg30-sparseloco")
    assert design.sweep(sparse, "cpu-tiny") == sparse.outer_lrs == (0.4, 0.6, 0.8, 1.0)
    with pytest.raises(ConfigError, match=r"not in .* sweep"):
        job_for(design, tiny, cell, 1, 0.6)


def test_refuses_altered_or_foreign_registration(prereg: Path, tmp_path: Path) -> None:
    doc = json.loads(prereg.read_text())
    doc["design"]["seeds"] = [0, 1, 2]  # changed after registration, hash not updated
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(PreregError, match="hash mismatch"):
        run_grid(bad, SCALE, tmp_path / "out", log=None)
    assert not (tmp_path / "out" / RUNS_FILE).exists()
    load_checked(None)  # the repository's registration is intact
    assert load_checked(DEFAULT_PATH).design == registered_design()
    # A results folder of another design is refused.
    out = tmp_path / "foreign"
    out.mkdir()
    (out / RUNS_FILE).write_text(json.dumps({"job_id": "x", "design_sha256": "0" * 64}) + "\n")
    with pytest.raises(PreregError, match=r"holds rows of design"):
        run_grid(prereg, SCALE, out, log=None)


def test_smoke_grid_errors_censoring_resume_outputs(prereg: Path, tmp_path: Path) -> None:
    out = tmp_path / "res"
    ids = [j.job_id for j in plan_jobs(unit_design(), SCALE)]
    assert len(ids) == 8
    lines: list[str] = []

    # Nothing starts after a zero-ish wall-clock cap: every job is censored, none lost.
    rep = run_grid(prereg, SCALE, out, wall_cap_s=1e-9, log=lines.append)
    assert rep.started == 0 and rep.counts == dict(done=0, divergent=0, error=0, censored=8)

    # Interrupted after three jobs (a job cap), one of them failing.
    failing = ids[1]
    rep = run_grid(prereg, SCALE, out, processes=1, max_jobs=3, inject_errors={failing},
                   log=lines.append)  # fmt: skip
    rows = read_rows(out)
    assert [r["job_id"] for r in rows] == ids[:3]
    by_id = {r["job_id"]: r for r in rows}
    assert by_id[failing]["status"] == "error"
    assert "injected failure" in by_id[failing]["error"]
    assert rep.counts["error"] == 1 and rep.counts["censored"] == 5
    assert any(line.startswith("[3/8]") and "err 1" in line for line in lines)
    s = summarize(prereg, SCALE, out, plots=False)
    assert s["counts"] == dict(total=8, done=2, divergent=0, error=1, censored=5)

    # Resumed: the two finished jobs are not redone; the error and the rest run now.
    rep = run_grid(prereg, SCALE, out, processes=2, log=lines.append)
    assert rep.skipped == 2 and rep.started == 6
    rows = read_rows(out)
    runs = Counter(r["job_id"] for r in rows)
    assert runs[failing] == 2 and all(runs[i] == 1 for i in ids if i != failing)
    assert len(rows) == 9
    for r in rows[3:]:
        assert r["status"] in ("done", "divergent")
        assert r["design_sha256"] == json.loads(prereg.read_text())["design_sha256"]
        assert r["device"] == "cpu" and r["wall_s"] > 0 and r["curve"]

    # A third run finds nothing to do.
    rep = run_grid(prereg, SCALE, out, log=None)
    assert rep.started == 0 and len(read_rows(out)) == 9

    s = summarize(prereg, SCALE, out)
    for name in (RUNS_FILE, CSV_FILE, SUMMARY_FILE, "curves.png", "gap_vs_m.png",
                 "mechanisms.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    on_disk = json.loads((out / SUMMARY_FILE).read_text())
    assert set(on_disk) >= SUMMARY_KEYS
    assert on_disk["counts"]["censored"] == 0 and on_disk["counts"]["error"] == 0
    assert on_disk["counts"]["done"] + on_disk["counts"]["divergent"] == 8
    with (out / CSV_FILE).open() as f:
        grid = list(csv.DictReader(f))
    assert sorted(r["job_id"] for r in grid) == sorted(ids)
    flat = on_disk["cells"][FLAT]
    assert flat["verdict"] in (
        "equivalent at delta = 0.005",
        "equivalence not demonstrated at delta = 0.005",
    )
    assert set(flat["vs_control"]) >= {"gaps", "tost", "power"}
    assert flat["best_control"] == "dp-adamw" and "vs_best_control" in flat
    assert flat["chosen_eta"] in (0.4, 0.8, None)
    # The negative control: M = 1, H = 1, plain averaging is data-parallel training.
    neg = on_disk["negative_control"]
    assert neg["cell"] == NEG and neg["max_abs_rel_diff"] < 1e-5
    assert neg["verdict"] == "equivalent at delta = 0.005"
    assert "Hg10" in on_disk["h2"] and "Hg10" in on_disk["h4"]
    assert on_disk["power"][FLAT]["n"] == 2


def _cli(*argv: str) -> int:
    ap = argparse.ArgumentParser(prog="hypertrain")
    sub = ap.add_subparsers(dest="command", required=True)
    sim_cmd.register(sub)
    args = ap.parse_args(list(argv))
    rc: Any = args.func(args)
    return int(rc)


def test_cli_prereg_check_and_summarize(prereg: Path, tmp_path: Path) -> None:
    assert _cli("sim", "prereg", "--check") == 0
    assert _cli("sim", "prereg", "--check", str(prereg)) == 1  # not the registered design
    out = tmp_path / "empty"
    assert _cli("sim", "summarize", "--scale", SCALE, "--prereg", str(prereg),
                "--out", str(out), "--no-plots") == 0  # fmt: skip
    s = json.loads((out / SUMMARY_FILE).read_text())
    assert s["counts"] == dict(total=8, done=0, divergent=0, error=0, censored=8)


def test_cli_device_check_on_cpu(prereg: Path, tmp_path: Path) -> None:
    """The device check of docs/design.md §7.11 wraps engine_device on real (shortened) grid jobs of the scale."""
    out = tmp_path / "dev"
    argv = ["sim", "device-check", "--device", "cpu", "--scale", SCALE, "--prereg", str(prereg)]
    assert _cli(*argv, "--steps", "10", "--max-jobs", "2", "--out", str(out)) == 0
    report = json.loads((out / "device_check.json").read_text())
    assert report["ok"] and len(report["rows"]) == 2
    assert all(r["rel_diff"] == 0.0 for r in report["rows"])


def test_cross_check_matches_jobs_by_design_key_bit_for_bit(tmp_path: Path) -> None:
    def row(job: str, key: str, loss: float, status: str = "done") -> dict[str, Any]:
        return dict(job_id=job, key=key, status=status, final_loss=loss, initial_loss=5.5,
                    curve=[[10, 3.0], [20, loss]])  # fmt: skip

    a, b = tmp_path / "a", tmp_path / "b"
    for d, rows in (
        (a, [row("x/seed0/eta0.4", "k1", 2.5), row("y/seed0", "k2", 2.25),
             row("z/seed0/eta0.1", "k3", 2.0)]),
        (b, [row("x/seed0/eta0.4", "k1", 2.5), row("y-renamed/seed0", "k2", 2.25),
             row("w/seed0", "k4", 1.0), row("e/seed0", "k3", 2.0, status="error")]),
    ):  # fmt: skip
        d.mkdir()
        (d / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _cli("sim", "cross-check", "--scale", "cpu-tiny", "--out", str(a), "--with", str(b)) == 0
    report = json.loads((a / "cross_check.json").read_text())
    assert (report["shared_jobs"], report["identical"], report["differing"]) == (2, 2, [])
    # One ulp of difference in one shared job's loss fails the check and names the job.
    rows = [json.loads(line) for line in (b / RUNS_FILE).read_text().splitlines()]
    rows[0]["final_loss"] = math.nextafter(2.5, 3.0)
    (b / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _cli("sim", "cross-check", "--scale", "cpu-tiny", "--out", str(a), "--with", str(b)) == 1
    report = json.loads((a / "cross_check.json").read_text())
    assert report["differing"] == ["x/seed0/eta0.4"] and report["max_abs_final_loss_diff"] > 0
    assert _cli("sim", "cross-check", "--scale", "cpu-tiny", "--out", str(a),
                "--with", str(tmp_path / "none")) == 2  # fmt: skip
    # Nothing in common is not a pass.
    c = tmp_path / "c"
    c.mkdir()
    (c / RUNS_FILE).write_text(json.dumps(row("v/seed0", "k9", 1.5)) + "\n")
    assert _cli("sim", "cross-check", "--scale", "cpu-tiny", "--out", str(a), "--with", str(c)) == 1


def test_plots_of_every_committed_grid(tmp_path: Path) -> None:
    """The plots draw from each committed summary (e.g. two hierarchies at the same M)."""
    from hypertrain.sim.study.plots import make_plots

    root = DEFAULT_PATH.parents[2]
    summaries = sorted(root.glob("experiments/results/parity-*/summary.json"))
    assert summaries
    for i, path in enumerate(summaries):
        out = tmp_path / str(i)
        out.mkdir()
        summary = json.loads(path.read_text())
        for png in make_plots(summary, read_rows(path.parent), out):
            assert png.stat().st_size > 10_000, png


# -- the grid in shards ------------------------------------------------------------------------


def test_shards_split_the_plan_into_disjoint_interleaved_shares(tmp_path: Path) -> None:
    jobs = plan_jobs(registered_design(), "smoke")
    for n in (1, 2, 3, 5, len(jobs) + 2):
        parts = [shard_jobs(jobs, (i, n)) for i in range(n)]
        ids = [j.job_id for part in parts for j in part]
        assert sorted(ids) == sorted(j.job_id for j in jobs)  # every job, each once
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parse_shard("2/3") == (2, 3)
    with pytest.raises(ConfigError, match="got '3/3'"):  # refused before anything is written
        run_grid(None, "smoke", tmp_path / "never", shard=(3, 3), log=None)
    assert not (tmp_path / "never").exists()
    for bad in ("3/3", "-1/3", "1", "a/b", "1/0"):
        with pytest.raises(ConfigError, match="--shard takes I/N with 0 <= I < N"):
            parse_shard(bad)
    cli = subprocess.run(
        [sys.executable, "-m", "hypertrain", "sim", "grid", "--scale", "smoke", "--shard", "3/3"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert cli.returncode == 2 and "--shard takes I/N with 0 <= I < N" in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr


RESULT_FIELDS = ("key", "status", "final_loss", "final_loss_raw", "initial_loss", "curve",
                 "steps_done", "diverged_at", "reason")  # fmt: skip
TIMING = {"invocations", "job_seconds_total", "wall_s_total"}
"""Summary fields that time the runs (they differ from run to run)."""


def test_the_smoke_grid_in_three_concurrent_shards_is_the_unsharded_grid_bit_for_bit(
    tmp_path: Path,
) -> None:
    """The registered smoke grid run as shards 0, 1 and 2 of 3, three processes writing to
    one folder at once, then summarized: every job's result and the summary (all but its
    timings) equal the unsharded run's bit for bit; each shard wrote only its own files,
    and a shard run again finds nothing left to do."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_grid(None, "smoke", whole, processes=2, log=None)
    summarize(None, "smoke", whole, plots=False)
    argv = [sys.executable, "-m", "hypertrain", "sim", "grid", "--scale", "smoke", "--out",
            str(split), "--processes", "1", "--no-plots"]  # fmt: skip
    procs = [
        subprocess.Popen([*argv, "--shard", f"{i}/3"], stdout=subprocess.PIPE, text=True)
        for i in range(3)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all(f"shard {i} of 3 done" in out for i, out in enumerate(outs))
    assert sorted(p.name for p in split.iterdir()) == sorted(
        [f"parity_runs.shard-{i}-of-3.jsonl" for i in range(3)]
        + [f"grid_invocations.shard-{i}-of-3.jsonl" for i in range(3)]
        + ["checkpoints"]
    )
    assert list((split / "checkpoints").iterdir()) == []  # every job's removed with its row
    jobs = plan_jobs(registered_design(), "smoke")
    for i in range(3):  # each shard's file holds its own jobs
        rows = [json.loads(x) for x in (split / f"parity_runs.shard-{i}-of-3.jsonl").open()]
        assert [r["job_id"] for r in rows] == [j.job_id for j in shard_jobs(jobs, (i, 3))]
    a = {r["job_id"]: r for r in read_rows(whole)}
    b = {r["job_id"]: r for r in read_rows(split)}
    assert a.keys() == b.keys() == {j.job_id for j in jobs}
    for job in a:
        assert {f: a[job].get(f) for f in RESULT_FIELDS} == {
            f: b[job].get(f) for f in RESULT_FIELDS
        }
    assert _cli("sim", "summarize", "--scale", "smoke", "--out", str(split), "--no-plots") == 0
    sa = json.loads((whole / SUMMARY_FILE).read_text())
    sb = json.loads((split / SUMMARY_FILE).read_text())
    assert {k: v for k, v in sa.items() if k not in TIMING} == {
        k: v for k, v in sb.items() if k not in TIMING
    }
    assert sorted(inv["shard"] for inv in sb["invocations"]) == ["0/3", "1/3", "2/3"]
    assert sb["counts"]["censored"] == 0
    rep = run_grid(None, "smoke", split, shard=(1, 3), log=None)
    assert rep.started == 0 and rep.stale_rows == 0
    assert rep.total == len(shard_jobs(jobs, (1, 3)))
