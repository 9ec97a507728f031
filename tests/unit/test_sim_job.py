"""The simulator's job is the core's RunConfig plus the simulator's own fields.

What it carries where, that the flat vocabulary (build / to_dict / from_dict / replace)
means what it meant before, that the canonical constructor refuses a run the simulator
would misread, and that a field added to RunConfig needs no second definition."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from hypertrain.common.config import CUSTOM_MODEL, RunConfig, TopologyConfig
from hypertrain.common.errors import ConfigError
from hypertrain.common.model import PRESETS, ModelConfig
from hypertrain.common.optim import InnerConfig
from hypertrain.common.outer import OuterConfig
from hypertrain.sim.engine import job as job_module
from hypertrain.sim.engine.job import (
    FLAT_FIELDS,
    RUN_EXTRAS,
    TOPOLOGY_EXTRAS,
    SimJob,
    dp_job,
    flat_job,
    region_names,
)

SHAPE = ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=64)
SMALL: dict[str, Any] = dict(model="tiny", steps=20, global_batch=8, holdout=32, eval_points=2)


# -- RunConfig carries a model that is no preset -------------------------------------------


def test_run_config_carries_a_model_shape(tmp_path: Path) -> None:
    assert CUSTOM_MODEL not in PRESETS
    plain = RunConfig()
    assert "model_shape" not in plain.to_dict()  # a preset run's dict (and digest) as before
    assert plain.model_config() == PRESETS["tiny"]
    custom = RunConfig(model=CUSTOM_MODEL, model_shape=SHAPE)
    assert custom.model_config() is SHAPE
    assert custom.to_dict()["model_shape"] == {
        "n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64, "vocab_size": 256,
        "mlp_ratio": 4,
    }  # fmt: skip
    assert RunConfig.from_dict(custom.to_dict()) == custom
    assert custom.digest != plain.digest  # the same shape as tiny, but not the preset
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[run]\nmodel = "custom"\n[run.model_shape]\nn_layer = 2\nd_model = 64\n'
        "n_head = 4\nseq_len = 64\n"
    )
    assert RunConfig.from_toml(toml) == custom
    with pytest.raises(ConfigError, match="needs a model_shape"):
        RunConfig(model=CUSTOM_MODEL)
    with pytest.raises(ConfigError, match="model_shape"):
        RunConfig(model="tiny", model_shape=SHAPE)  # a preset name would hide the shape
    with pytest.raises(ConfigError, match="n_head"):
        RunConfig.from_dict({"model": CUSTOM_MODEL, "model_shape": {**asdict(SHAPE), "n_head": 5}})


# -- the job is its run ------------------------------------------------------------------------


def test_the_job_holds_its_run_config() -> None:
    job = SimJob.build(
        model=SHAPE, regions=12, islands_per_region=2, h_r=5, h_g=10, steps=40, global_batch=48,
        holdout=64, seed=3, regional_codec="int8", tau=1, fragments=2, lawa_k=2,
    )  # fmt: skip
    run = job.run
    assert job.core_config() is run
    assert run.topology == TopologyConfig(
        regions=tuple(f"r{k:02d}" for k in range(12)), islands_per_region=2, h_r=5, h_g=10, tau=1
    )
    assert sorted(run.topology.regions) == list(run.topology.regions)  # sorted = replica order
    assert (run.model, run.model_shape, run.model_config()) == (CUSTOM_MODEL, SHAPE, SHAPE)
    assert (run.steps, run.batch_per_island, run.global_batch, run.seed) == (40, 2, 48, 3)
    assert (run.holdout_windows, run.regional_codec, run.threads, run.run_id) == (
        64, "int8", 1, "local")  # fmt: skip
    assert (job.n_replicas, job.regions, job.model, job.holdout, job.tau) == (24, 12, SHAPE, 64, 1)
    assert (job.fragments, job.lawa_k, job.dp, job.dp_steps) == (2, 2, False, None)
    assert SimJob.build(**job.flat()) == job
    assert SimJob.from_dict(job.to_dict()) == job
    assert list(job.to_dict()) == list(FLAT_FIELDS)
    assert region_names(1) == ("r0",) and region_names(11)[-2:] == ("r09", "r10")
    preset_job = flat_job(2, 10, **SMALL)
    assert (preset_job.run.model, preset_job.run.model_shape, preset_job.model) == (
        "tiny", None, "tiny")  # fmt: skip


def test_the_data_parallel_control_trains_its_own_steps() -> None:
    """h_g is only the control's cadence: its steps need not be a multiple of it."""
    job = dp_job(h=10, steps=45, global_batch=8, model="tiny", holdout=16)
    assert (job.dp, job.dp_steps, job.steps, job.h_g, job.h_r) == (True, 45, 45, 10, 10)
    assert (job.run.steps, job.run.batch_per_island, job.n_replicas) == (40, 8, 1)
    assert job.run.topology.regions == ("r0",)
    assert job.to_dict()["steps"] == 45 and job.to_dict()["dp"] is True
    assert SimJob.from_dict(job.to_dict()) == job
    assert dp_job(h=10, steps=5, model="tiny").run.steps == 10  # at least one h_g
    longer = job.replace(steps=60)
    assert (longer.dp_steps, longer.run.steps) == (60, 60)
    with pytest.raises(ConfigError, match="one replica"):
        dp_job(h=10, steps=40, regions=2, global_batch=8, model="tiny")
    with pytest.raises(ConfigError, match="h_r == h_g"):
        dp_job(h=10, h_r=5, steps=40, model="tiny")


def test_replace_takes_fields_or_the_flat_vocabulary() -> None:
    job = flat_job(4, 10, **SMALL)
    assert job.replace(path="per_replica").path == "per_replica"
    assert job.replace(seed=2).run == job.run.with_overrides(seed=2)
    assert job.replace(h_g=20, h_r=20).run.topology.h_g == 20
    avg = job.replace(outer=OuterConfig(name="average", eta=0.4))
    assert avg.replace(seed=1).outer == OuterConfig(name="average", eta=0.4)  # kept as given
    run = job.run.with_overrides(seed=5)
    assert job.replace(run=run).seed == 5
    with pytest.raises(ConfigError, match="unknown field"):
        job.replace(run=run, steps=30)  # one vocabulary at a time


# -- validation ----------------------------------------------------------------------------------


def test_a_run_the_simulator_would_misread_is_refused() -> None:
    run = flat_job(2, 10, **SMALL).run
    for changes, field in [
        ({"topology.regions": ["eu", "us"]}, "run.topology.regions"),
        ({"topology.regions": ["r1", "r0"]}, "run.topology.regions"),
        ({"run_id": "x"}, "run_id"),
        ({"threads": 2}, "threads"),
    ]:
        with pytest.raises(ConfigError, match=field):
            SimJob(run=run.with_overrides(**changes))
    one = dp_job(h=10, steps=40, model="tiny").run
    with pytest.raises(ConfigError, match="dp_steps"):
        SimJob(run=one, dp_steps=0)
    with pytest.raises(ConfigError, match=r"run\.steps"):
        SimJob(run=one, dp_steps=60)  # its run.steps would be 60
    with pytest.raises(ConfigError, match="one replica"):
        SimJob(run=run, dp_steps=20)


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(bogus=1), "bogus"),
        (dict(run_id="x"), "run_id"),  # not the simulator's
        (dict(steps=0), "steps"),
        (dict(h_g=0), "h_g"),
        (dict(global_batch=6), "global_batch"),
        (dict(steps=25), "steps"),
        (dict(holdout=0), "holdout"),
        (dict(model="huge"), "preset"),
        (dict(model={"n_layer": 0, "d_model": 64, "n_head": 4, "seq_len": 64}), "n_layer"),
        (dict(inner={"lr": -1.0}), "lr"),
        (dict(ef_beta=0.0), "ef_beta"),
        (dict(global_codec="zip"), "global_codec"),
        (dict(seed=-1), "seeds"),
        (dict(path="gpu"), "path"),
        (dict(anneal="m2"), "anneal"),
        (dict(threads=0), "threads"),
        (dict(eval_points=0), "eval_points"),
        (dict(fragments=11), "fragments"),
    ],
)
def test_build_names_the_bad_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as e:
        SimJob.from_dict({**flat_job(4, 10, **SMALL).to_dict(), **changes})
    assert str(e.value).count("sim job:") == 1


# -- one vocabulary --------------------------------------------------------------------------------


def test_the_flat_vocabulary_is_unambiguous() -> None:
    """A RunConfig field the mapping does not name is taken under its own name; it must not
    shadow a name of the simulator (if RunConfig gains e.g. ``fragments``, move the
    simulator's into the run instead)."""
    extras = {*RUN_EXTRAS, *TOPOLOGY_EXTRAS}
    assert not extras & set(FLAT_FIELDS)
    assert not extras & {"run", "dp_steps"}
    assert len(extras) == len(RUN_EXTRAS) + len(TOPOLOGY_EXTRAS)


@pytest.mark.parametrize("where,name,value", [("run", "ef_beta", 0.5), ("topology", "tau", 1)])
def test_a_run_field_the_mapping_does_not_name_exists_once(
    monkeypatch: pytest.MonkeyPatch, where: str, name: str, value: Any
) -> None:
    """Pretend ``name`` were a RunConfig (or TopologyConfig) field added after the mapping:
    the job takes it by its name, carries it in its run, and keys it only when it is not at
    its default, so every key written before stays what it was."""
    monkeypatch.setattr(job_module, "FLAT_FIELDS", tuple(f for f in FLAT_FIELDS if f != name))
    if where == "run":
        monkeypatch.setattr(job_module, "RUN_EXTRAS", (name,))
    else:
        monkeypatch.setattr(job_module, "_TOPO_MAPPED", job_module._TOPO_MAPPED - {name})
        monkeypatch.setattr(job_module, "TOPOLOGY_EXTRAS", (name,))
    base = flat_job(2, 10, **{**SMALL, "inner": InnerConfig(warmup_steps=2)})
    assert name not in base.to_dict()  # at its default: not in the key
    job = base.replace(**{name: value})
    carried = job.run if where == "run" else job.run.topology
    assert getattr(carried, name) == value
    assert job.to_dict()[name] == value and job.key() != base.key()
    assert SimJob.from_dict(job.to_dict()) == job
    assert job.flat()[name] == value and job.replace(seed=1).run.seed == 1
