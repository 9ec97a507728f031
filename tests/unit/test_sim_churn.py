"""Churn in the simulator (experiments/sim/engine/churn.py) and its registration
(experiments/sim/churn_prereg.json): p = 0 is the run without churn bit for bit, a merge
with islands absent is the fixed-order mean over the members present, the absences are
drawn from the seed alone, and the churn study's design, grid and summary."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hypertrain.common.config import MembershipConfig
from hypertrain.common.errors import ConfigError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import Fragment, partition
from hypertrain.common.model import build_model
from hypertrain.common.outer import OuterConfig
from hypertrain.sim.engine.churn import Absence, Churn
from hypertrain.sim.engine.job import SimJob, flat_job
from hypertrain.sim.engine.run import FragmentSync, run_job
from hypertrain.sim.study.design import Design, PreregError, Scale
from hypertrain.sim.study.grid import RUNS_FILE, default_out, job_for, plan_jobs, read_rows
from hypertrain.sim.study.prereg import (
    CHURN_PATH,
    DEFAULT_PATH,
    churn_design,
    design_hash,
    load_prereg,
    registered_design,
    verify_registered,
    write_prereg,
)

SMALL: dict[str, Any] = dict(model="tiny", steps=20, global_batch=8, holdout=16, eval_points=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- the draw ----------------------------------------------------------------------------


def test_the_drop_schedule_is_the_seeds_alone_and_nested_in_p() -> None:
    steps = range(10, 3010, 10)
    a = [Churn(0.3, 0, 8, 1).at(s) for s in steps]
    assert a == [Churn(0.3, 0, 8, 1).at(s) for s in steps]  # deterministic per seed
    torch.manual_seed(123)  # the training's generators play no part
    assert a == [Churn(0.3, 0, 8, 1).at(s) for s in steps]
    assert a != [Churn(0.3, 1, 8, 1).at(s) for s in steps]  # another seed, other absences
    low = [Churn(0.1, 0, 8, 1).at(s) for s in steps]
    assert all(set(x.absent) <= set(y.absent) for x, y in zip(low, a, strict=True))
    rate = sum(len(x.absent) for x in a) / (8 * len(a))
    assert 0.25 < rate < 0.31  # p = 0.3, a little below it: the quorum waits now and then
    assert all(8 - len(x.absent) >= 4 for x in a)  # never below the quorum of 4


def test_below_the_quorum_the_step_waits_for_the_least_late() -> None:
    churn = Churn(0.9, 5, 8, 1)
    assert churn.quorum == MembershipConfig().quorum("global", 8) == 4
    for step in range(10, 200, 10):
        u = churn.draws(step)
        got = churn.at(step)
        late = [i for i in range(8) if u[i] < 0.9]
        if len(late) <= 4:
            assert got == Absence(step, tuple(late), 0)
            continue
        # Four present: those on time, then the late islands with the largest draws.
        assert len(got.absent) == 4 and got.waited == 4 - (8 - len(late))
        back = sorted(set(late) - set(got.absent))
        assert min(u[i] for i in back) > max(u[i] for i in got.absent)
    # A hierarchy: each region keeps its own quorum (2 of 3 islands), regions all forward.
    hier = Churn(0.9, 5, 2, 3)
    assert (hier.level, hier.quorum, hier.applies("regional")) == ("regional", 2, True)
    for step in range(5, 100, 5):
        gone = hier.at(step).absent
        assert sum(i < 3 for i in gone) <= 1 and sum(i >= 3 for i in gone) <= 1
    assert not Churn(0.5, 0, 8, 1).applies("regional")  # flat: global steps only
    with pytest.raises(ValueError):
        Churn(0.0, 0, 8, 1)


# -- p = 0 is the run without churn --------------------------------------------------------


def test_p0_is_the_run_without_churn_bit_for_bit() -> None:
    job = flat_job(4, 5, **SMALL)
    assert "drop" not in job.to_dict()  # no churn: the job and its key are what they were
    assert job.replace(drop=0.0) == job and job.replace(drop=0.0).key() == job.key()
    # The whole churn path (draws, filtering) with nobody ever absent changes no bit.
    never = job.replace(drop=1e-12)
    assert never.key() != job.key() and never.to_dict()["drop"] == 1e-12
    assert SimJob.from_dict(never.to_dict()) == never
    a, b = run_job(job), run_job(never)
    assert a.final_params is not None and b.final_params is not None
    assert torch.equal(a.final_params, b.final_params) and a.final_loss == b.final_loss
    assert a.curve == b.curve and a.absent == []
    assert [s for s, _, _ in b.absent] == [5, 10, 15, 20] and not any(g for _, g, _ in b.absent)


def test_the_registered_p0_arm_is_the_parity_grids_arm() -> None:
    """The churn registration's controls and p = 0 arm are the parity grid's jobs, key for key
    (same model, data, steps, seeds, optimizers; the cell field drop = 0 changes nothing)."""
    new, old = churn_design(), registered_design()
    shared = [j for j in plan_jobs(new, "cpu-tiny") if j.cell.kind != "churn"]
    assert len(shared) == 18
    for j in shared:
        was = job_for(old, old.scale("cpu-tiny"), old.cell(j.cell.id), j.seed, j.eta)
        assert was.key() == j.sim.key(), j.job_id
    churn = [j for j in plan_jobs(new, "cpu-tiny") if j.cell.kind == "churn"]
    assert len(churn) == 24 and {j.sim.drop for j in churn} == {0.1, 0.3}
    for j in churn:  # the same job as its baseline's but for drop
        base = job_for(new, new.scale("cpu-tiny"), new.cell(j.cell.baseline or ""), j.seed, j.eta)
        assert j.sim.replace(drop=0.0) == base


# -- the merge is over the members present ---------------------------------------------------


class _Fixed(Churn):
    """Churn whose absences are given."""

    def __init__(self, absent: tuple[int, ...], regions: int, n_r: int) -> None:
        super().__init__(0.5, 0, regions, n_r)
        self.fixed = absent

    def at(self, step: int) -> Absence:
        return Absence(step, self.fixed, 0)


class _Rows:
    """A ReplicaSet of given parameter rows (what FragmentSync reads and writes)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows.clone()
        self.n = rows.shape[0]

    def train_step(self, step: int) -> torch.Tensor:  # pragma: no cover - not called
        raise AssertionError

    def read(self, frag: Fragment) -> torch.Tensor:
        return self.rows[:, frag.lo : frag.hi].clone()

    def write(self, frag: Fragment, start: int, stop: int, rows: torch.Tensor) -> None:
        self.rows[start:stop, frag.lo : frag.hi] = rows


def _setup(job: SimJob, absent: tuple[int, ...]) -> tuple[FragmentSync, _Rows, torch.Tensor]:
    layout = ParamLayout.of(build_model(job.model_config(), seed=0))
    theta0 = layout.flatten(build_model(job.model_config(), seed=0))
    frag = partition(layout, 1, job.h_g, job.fragment_cut)[0]
    gen = torch.Generator().manual_seed(7)
    rows = theta0 + 1e-2 * torch.randn(job.n_replicas, theta0.numel(), generator=gen)
    churn = _Fixed(absent, job.regions, job.islands_per_region)
    return FragmentSync(job, frag, theta0, churn), _Rows(rows), rows


def test_flat_merge_is_the_mean_over_the_islands_present() -> None:
    job = flat_job(4, 5, outer=OuterConfig(name="average"), drop=0.5, **SMALL)
    sync, replicas, rows = _setup(job, absent=(1, 3))
    theta = sync.glob.theta.clone()
    sync.sync(replicas, 5, "global")
    # By hand, in the cores' operations: each island's region merges it alone (b = theta -
    # (theta - x) / 1), forwards D = theta - b; the aggregator sums D in region order over
    # the regions present, divides by their count, and averaging takes theta - G.
    forwards = {}
    for k in range(4):
        base = theta - (torch.zeros_like(theta) + (theta - rows[k])) / 1
        forwards[k] = theta - base
    acc = torch.zeros_like(theta)
    for k in (0, 2):
        acc += forwards[k]
    want = theta - acc / 2
    assert torch.equal(sync.glob.theta, want)
    everyone = theta - (forwards[0] + forwards[1] + forwards[2] + forwards[3]) / 4
    assert not torch.equal(want, everyone)
    # Every island, absent or not, takes the merge; the absence is recorded.
    assert all(torch.equal(replicas.rows[i], want) for i in range(4))
    assert sync.absences == [Absence(5, (1, 3), 0)]


def test_hierarchy_merge_is_the_mean_over_each_regions_islands_present() -> None:
    job = SimJob.build(regions=2, islands_per_region=3, h_r=5, h_g=10, drop=0.5,
                       **{**SMALL, "global_batch": 12})  # fmt: skip
    sync, replicas, rows = _setup(job, absent=(1,))
    theta = sync.glob.theta.clone()
    sync.sync(replicas, 5, "regional")
    zero = torch.zeros_like(theta)
    region0 = theta - (zero + (theta - rows[0]) + (theta - rows[2])) / 2
    region1 = theta - (zero + (theta - rows[3]) + (theta - rows[4]) + (theta - rows[5])) / 3
    assert torch.equal(sync.regions[0].base, region0)
    assert torch.equal(sync.regions[1].base, region1)
    assert all(torch.equal(replicas.rows[i], region0) for i in range(3))  # island 1 included
    assert all(torch.equal(replicas.rows[i], region1) for i in range(3, 6))


def test_a_churn_run_is_deterministic_and_both_paths_agree() -> None:
    job = flat_job(8, 5, drop=0.3, seed=1, **SMALL)
    a = run_job(job.replace(path="per_replica"))
    b = run_job(job.replace(path="batched"))
    assert a.final_params is not None and b.final_params is not None
    assert torch.equal(a.final_params, b.final_params) and a.absent == b.absent
    assert [s for s, _, _ in a.absent] == [5, 10, 15, 20]
    assert a.absent == [(x.step, x.absent, x.waited) for x in
                        (Churn(0.3, 1, 8, 1).at(s) for s in (5, 10, 15, 20))]  # fmt: skip
    assert any(gone for _, gone, _ in a.absent)
    without = run_job(job.replace(drop=0.0, path="batched"))
    assert without.final_params is not None
    assert not torch.equal(without.final_params, b.final_params)
    assert b.to_dict()["absent"] == [[s, list(g), w] for s, g, w in b.absent]


def test_drop_is_refused_where_it_has_no_meaning() -> None:
    for changes, msg in (
        ({"drop": 1.0}, "drop must be in"),
        ({"drop": -0.1}, "drop must be in"),
        ({"drop": 0.1, "fragments": 2}, "drop needs"),
        ({"drop": 0.1, "anneal": "m1"}, "drop needs"),
    ):
        with pytest.raises(ConfigError, match=msg):
            flat_job(4, 5, **{**SMALL, **changes})
    with pytest.raises(ConfigError, match="drop needs"):
        SimJob.build(dp=True, drop=0.1, **SMALL)


# -- the design and its registration ----------------------------------------------------------


def test_the_new_field_leaves_the_old_registration_and_its_hash_alone() -> None:
    parity = load_prereg(DEFAULT_PATH)
    assert parity.design_sha256 == design_hash(registered_design())
    assert all("drop" not in c for c in registered_design().to_dict()["cells"])
    doc = json.loads(DEFAULT_PATH.read_text())
    assert Design.from_dict(doc["design"]).to_dict() == doc["design"]
    # drop = 0 written out is not the canonical form: a file with it is refused.
    doc["design"]["cells"][0]["drop"] = 0.0
    assert design_hash(doc["design"]) != parity.design_sha256


def test_the_committed_churn_registration() -> None:
    pre = verify_registered(CHURN_PATH, churn_design())
    assert pre.design_sha256 != load_prereg(DEFAULT_PATH).design_sha256
    d = pre.design
    assert d.seeds == registered_design().seeds
    cpu = d.scale("cpu-tiny")
    parity_cpu = registered_design().scale("cpu-tiny")
    assert dataclasses.replace(cpu, note="", cells=None, wall_clock_cap_s=1) == dataclasses.replace(
        parity_cpu, note="", cells=None, wall_clock_cap_s=1
    )
    churn = [c for c in d.cells if c.kind == "churn"]
    assert [(c.id, c.drop, c.baseline) for c in churn] == [
        ("churn-M8-Hg10-p0.1", 0.1, "flat-M8-Hg10"),
        ("churn-M8-Hg10-p0.3", 0.3, "flat-M8-Hg10"),
    ]
    assert [c["drop"] for c in d.to_dict()["cells"] if "drop" in c] == [0.1, 0.3]
    assert default_out("cpu-tiny", CHURN_PATH).name == "churn-cpu-tiny"
    assert default_out("cpu-tiny", DEFAULT_PATH).name == "parity-cpu-tiny"
    assert default_out("cpu-tiny").name == "parity-cpu-tiny"


def test_a_churn_cell_is_its_baseline_with_drop() -> None:
    d = churn_design()
    p3 = d.cell("churn-M8-Hg10-p0.3")
    with pytest.raises(PreregError, match="drop must be in"):
        dataclasses.replace(p3, drop=0.0)
    with pytest.raises(PreregError, match="drop must be in"):
        dataclasses.replace(d.cell("flat-M8-Hg10"), drop=0.1)
    cells = tuple(dataclasses.replace(c, h_g=30, h_r=30) if c.id == p3.id else c for c in d.cells)
    with pytest.raises(PreregError, match="must equal its baseline"):
        dataclasses.replace(d, cells=cells)
    cells = tuple(dataclasses.replace(c, baseline="dp-adamw") if c.id == p3.id else c
                  for c in d.cells)  # fmt: skip
    with pytest.raises(PreregError, match="is not a flat cell"):
        dataclasses.replace(d, cells=cells)


# -- the grid and the summary of a churn registration ------------------------------------------


def _unit_churn_design() -> Design:
    reg = churn_design()
    scale = Scale(
        name="unit", note="test only", steps=20, model="tiny", n_layer=1, d_model=32, n_head=2,
        seq_len=16, global_batch=8, holdout_windows=8, warmup_steps=1,
        cells=("dp-adamw", "flat-M8-Hg10", "churn-M8-Hg10-p0.3"), wall_clock_cap_s=600,
        process_cap=1, nesterov_outer_lrs=(0.2,),
    )  # fmt: skip
    return dataclasses.replace(reg, seeds=(0, 1), scales=(scale,))


def test_churn_grid_and_summary(tmp_path: Path) -> None:
    from hypertrain import sim_cmd
    from hypertrain.sim.study.grid import run_grid
    from hypertrain.sim.study.summary import SUMMARY_FILE

    prereg = tmp_path / "churn_prereg.json"
    write_prereg(prereg, _unit_churn_design())
    out = tmp_path / "res"
    rep = run_grid(prereg, "unit", out, processes=1, log=None)
    assert rep.counts == dict(done=6, divergent=0, error=0, censored=0)
    rows = read_rows(out)
    assert [r["cell"] for r in rows[:2]] == ["dp-adamw", "dp-adamw"]  # controls first
    assert all(("absent" in r) == (r["cell"].startswith("churn")) for r in rows)
    ap = argparse.ArgumentParser(prog="hypertrain")
    sim_cmd.register(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["sim", "summary", "--scale", "unit", "--prereg", str(prereg),
                          "--out", str(out)])  # fmt: skip
    assert args.func(args) == 0
    s = json.loads((out / SUMMARY_FILE).read_text())
    c = s["churn"]["churn-M8-Hg10-p0.3"]
    assert c["baseline"] == "flat-M8-Hg10" and c["cost"]["tost"]["ci"]["n"] == 2
    assert c["verdict"] in ("equivalent at delta = 0.005",
                            "equivalence not demonstrated at delta = 0.005")  # fmt: skip
    assert c["absence"]["syncs"] == 4 and 0 <= c["absence"]["rate"] <= 0.5
    assert set(c["cost_by_eta"]) == {"0.2"}
    assert s["cells"]["churn-M8-Hg10-p0.3"]["drop"] == 0.3
    assert s["cells"]["churn-M8-Hg10-p0.3"]["verdict"].startswith("equivalen")
    assert (out / "churn.png").stat().st_size > 10_000 and (out / "curves.png").exists()
    assert not (out / "mechanisms.png").exists()
    assert (out / RUNS_FILE).exists()


def test_plots_of_the_committed_churn_run(tmp_path: Path) -> None:
    from hypertrain.sim.study.plots import make_plots

    folder = default_out("cpu-tiny", CHURN_PATH)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["prereg"]["design_sha256"] == load_prereg(CHURN_PATH).design_sha256
    pngs = make_plots(summary, read_rows(folder), tmp_path)
    assert [p.name for p in pngs] == ["curves.png", "churn.png"]
    assert all(p.stat().st_size > 10_000 for p in pngs)
