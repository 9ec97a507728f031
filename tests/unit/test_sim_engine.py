"""The simulator's engine: same algorithm as the reference run, two paths that agree,
the negative control, streaming, anneal, LAWA, divergence, and the device switch."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import Fragment, partition
from hypertrain.common.model import GPT, Block, ModelConfig, build_model
from hypertrain.common.optim import InnerConfig, InnerOptimizer
from hypertrain.common.outer import OuterConfig
from hypertrain.common.reference import run_reference
from hypertrain.common.schedule import Schedule
from hypertrain.sim.engine import device as engine_device
from hypertrain.sim.engine.batched import Batched, StackedInnerOptimizer
from hypertrain.sim.engine.job import DEVICE_ENV, JobResult, SimJob, dp_job, flat_job
from hypertrain.sim.engine.run import _dataset, anneal_start, eval_steps, make_replicas, run_job
from hypertrain.sim.engine.stacked import StackedGPT

INNER = InnerConfig(warmup_steps=2)
MUON = InnerConfig(name="muon", warmup_steps=2)
SMALL: dict[str, Any] = dict(model="tiny", steps=20, global_batch=8, holdout=32, eval_points=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _both(job: SimJob) -> tuple[JobResult, JobResult]:
    return run_job(job.replace(path="per_replica")), run_job(job.replace(path="batched"))


# -- the algorithm is the reference's -----------------------------------------------------


@pytest.mark.parametrize("tau,codec", [(0, "int8"), (1, "sparseloco")])
def test_per_replica_path_is_the_reference_run_bit_for_bit(tau: int, codec: str) -> None:
    """F = 1: the engine and common/reference.py end on identical global parameters."""
    cfg = RunConfig.from_dict(
        {
            "steps": 20,
            "holdout_windows": 32,
            "batch_per_island": 2,
            "regional_codec": codec,
            "inner": {"warmup_steps": 2},
            "topology": {"regions": ["r0", "r1"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
        }
    ).with_overrides(**{"topology.tau": tau})
    ref = run_reference(cfg)
    job = SimJob(run=cfg, eval_points=2, path="per_replica")  # the reference's own config
    assert job == SimJob.build(
        regions=2, islands_per_region=2, h_r=5, h_g=10, tau=tau, inner=cfg.inner,
        outer=cfg.outer, regional_codec=codec, path="per_replica", **SMALL,
    )  # fmt: skip
    res = run_job(job)
    assert res.final_params is not None and ref.final_params is not None
    assert torch.equal(res.final_params, ref.final_params)
    assert res.final_loss == ref.final_loss


def test_replica_batches_are_slices_of_the_dp_batch() -> None:
    from hypertrain.common.data import SampleStream

    stream = SampleStream(_dataset(None), 64, 8, seed=3)
    for step in (0, 7):
        rows = stream.global_batch_at(step).view(4, 2, -1)
        for i in range(4):
            assert torch.equal(rows[i], stream.replica_batch(step, i, 4))


# -- batched == per-replica ---------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        dict(inner=INNER),
        dict(inner=MUON, regions=2),
        dict(inner=INNER, fragments=3, tau=1),
        dict(inner=INNER, regions=2, islands_per_region=2, h_r=5, regional_codec="int8"),
        dict(inner=INNER, anneal="m1", lawa_k=2, lawa_every=5),
    ],
    ids=["adamw", "muon", "streaming-overlap", "hier-int8", "anneal-m1-lawa"],
)
def test_batched_equals_per_replica(changes: dict[str, Any]) -> None:
    job = SimJob.build(**{**SMALL, "regions": 4, "h_r": 10, "h_g": 10, **changes})
    per, bat = _both(job)
    assert not per.diverged and not bat.diverged
    assert abs(per.final_loss - bat.final_loss) < 1e-5, (per.final_loss, bat.final_loss)
    for (s1, l1), (s2, l2) in zip(per.curve, bat.curve, strict=True):
        assert s1 == s2 and abs(l1 - l2) < 1e-5
    assert per.final_loss < per.initial_loss - 0.5  # it trains
    # Stronger than the tolerance of docs/design.md §7.11: on CPU the two paths agree bit for bit.
    assert per.final_params is not None and bat.final_params is not None
    assert torch.equal(per.final_params, bat.final_params)


@pytest.mark.parametrize(
    "changes",
    [
        dict(inner=INNER),
        dict(inner=MUON),
        # regions [0, 2) and [2, 4) straddle the 3+1 chunks; overlapped streaming writes
        # [N, numel] blocks across the chunk boundary
        dict(inner=INNER, regions=2, islands_per_region=2, h_r=5, fragments=3, tau=1),
    ],
    ids=["adamw", "muon", "hier-streaming-overlap"],
)
def test_batched_in_replica_chunks_changes_no_bit(
    changes: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU chunking of the batched step (whole replicas per chunk) is invisible in the bits."""
    job = SimJob.build(**{**SMALL, "regions": 4, "h_r": 10, "h_g": 10, **changes})
    whole = run_job(job.replace(path="batched"))
    rows = 2 * 64  # one replica: 2 sequences of 64 tokens
    for chunk_rows, chunks in ((rows, 4), (3 * rows, 2)):  # 1+1+1+1 and 3+1 replicas
        monkeypatch.setattr(Batched, "CHUNK_ROWS", chunk_rows)
        reps = make_replicas(job.replace(path="batched"), *_init(job), torch.device("cpu"))
        assert isinstance(reps, Batched) and -(-reps.n // reps.chunk) == chunks
        part = run_job(job.replace(path="batched"))
        assert whole.final_params is not None and part.final_params is not None
        assert torch.equal(whole.final_params, part.final_params), chunk_rows
        assert whole.curve == part.curve


def _init(job: SimJob) -> tuple[GPT, ParamLayout, torch.Tensor]:
    template = build_model(job.model_config(), seed=job.seed)
    layout = ParamLayout.of(template)
    return template, layout, layout.flatten(template)


def _grads(template: torch.nn.Module, n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn((n, *p.shape), generator=g) * (0.5 if seed % 2 else 2.0)
        for name, p in template.named_parameters()
    }


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_stacked_optimizer_is_the_per_replica_optimizer(name: str) -> None:
    """AdamW elementwise on the stack, Muon per replica view, clipping per replica."""
    n, cfg = 3, InnerConfig(name=name, lr=1e-2, grad_clip=1.0)  # type: ignore[arg-type]
    template = build_model("tiny", seed=0)
    layout = ParamLayout.of(template)
    stacks = {k: v.detach().clone().unsqueeze(0).repeat(n, *[1] * v.ndim) for k, v in
              template.named_parameters()}  # fmt: skip
    stacked = StackedInnerOptimizer(template, stacks, cfg)
    models = [build_model("tiny", seed=0) for _ in range(n)]
    singles = [InnerOptimizer(m, cfg) for m in models]
    for step in range(3):
        grads = _grads(template, n, seed=step)
        stacked.set_lr_factor(0.5 + step)
        stacked.zero_grad()
        for k, g in grads.items():
            stacks[k].grad = g.clone()
        stacked.step()
        for i, (m, opt) in enumerate(zip(models, singles, strict=True)):
            opt.set_lr_factor(0.5 + step)
            opt.zero_grad()
            for k, p in m.named_parameters():
                p.grad = grads[k][i].clone()
            opt.step()
    for i, m in enumerate(models):
        mine = torch.cat([stacks[k][i].reshape(-1) for k in layout.names])
        assert torch.equal(mine, layout.flatten(m))


def test_stacked_forward_is_gpt_loss_bit_for_bit() -> None:
    """Losses and every gradient of StackedGPT equal GPT.loss's, replica by replica."""
    template = build_model("tiny", seed=0)
    n, g = 3, torch.Generator().manual_seed(5)
    stacks = {
        k: (
            v.detach().unsqueeze(0) + 0.02 * torch.randn((n, *v.shape), generator=g)
        ).requires_grad_(True)
        for k, v in template.named_parameters()
    }
    windows = torch.randint(0, 256, (n, 2, 65), generator=g)
    losses = StackedGPT(template).losses(stacks, windows)
    losses.sum().backward()
    for i in range(n):
        model = build_model("tiny", seed=0)
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(stacks[k][i])
        loss = model.loss(windows[i])
        loss.backward()
        assert torch.equal(loss.detach(), losses[i].detach())
        for k, p in model.named_parameters():
            assert p.grad is not None and torch.equal(p.grad, stacks[k].grad[i]), k  # type: ignore[index]


def test_stacked_forward_refuses_a_changed_model(monkeypatch: pytest.MonkeyPatch) -> None:
    class Changed(GPT):
        pass

    with pytest.raises(HypertrainError, match="update StackedGPT"):
        StackedGPT(Changed(ModelConfig(n_layer=1, d_model=32, n_head=2, seq_len=16)))
    template = build_model("tiny", seed=0)
    template.blocks[0].ln1.eps = 1e-6  # type: ignore[union-attr]
    with pytest.raises(HypertrainError, match="LayerNorms differ"):
        StackedGPT(template)
    template = build_model("tiny", seed=0)
    stacked = StackedGPT(template)
    windows = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    stacked.check_against(template, windows)
    monkeypatch.setattr(Block, "forward", lambda self, x: x)  # the model changed under us
    with pytest.raises(HypertrainError, match=r"update sim/engine/stacked\.py"):
        stacked.check_against(template, windows)


# -- the negative control -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["per_replica", "batched"])
def test_negative_control_dp_equals_m1_h1_average(path: str) -> None:
    kw = {**SMALL, "inner": INNER, "path": path}
    dp = run_job(dp_job(h=1, **kw))
    m1 = run_job(flat_job(1, 1, outer=OuterConfig(name="average"), **kw))
    assert abs(dp.final_loss - m1.final_loss) < 1e-5, (dp.final_loss, m1.final_loss)
    assert dp.final_loss < dp.initial_loss - 0.5


# -- streaming, anneal, LAWA, eval points ---------------------------------------------------


def test_fragments_partition_the_layout_and_stagger() -> None:
    layout = ParamLayout.of(build_model("proxy"))
    frags = partition(layout, 3, 30, "params")
    assert [f.offset for f in frags] == [0, 10, 20]
    assert frags[0].lo == 0 and frags[-1].hi == layout.numel
    assert all(a.hi == b.lo for a, b in itertools.pairwise(frags))
    pieces = [p for f in frags for p in f.pieces]  # whole parameters, each once, in order
    assert [p.name for p in pieces] == list(layout.names)
    assert all((p.start, p.stop) == (0, math.prod(p.shape)) for p in pieces)
    assert max(f.numel for f in frags) < 0.5 * layout.numel  # near-equal, by layer

    def sync_level(f: Fragment, t: int, h_r: int, h_g: int, steps: int) -> str | None:
        return Schedule(h_r=h_r, h_g=h_g, tau=0, steps=steps, offset=f.offset).sync_kind(t)

    one = partition(layout, 1, 10, "params")[0]
    for t in range(1, 41):  # F = 1 is the reference schedule
        want = "global" if t % 10 == 0 else ("regional" if t % 5 == 0 else None)
        assert sync_level(one, t, 5, 10, 40) == want
    assert sync_level(frags[1], 10, 30, 30, 90) == "global"  # (t - offset) % H == 0
    assert sync_level(frags[1], 30, 30, 30, 90) is None
    assert sync_level(frags[1], 90, 30, 30, 90) == "global"  # the final flush


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_the_values_cut_gives_equal_ranges_cut_inside_parameters(n: int) -> None:
    """Fragment f is exactly [numel f / F, numel (f + 1) / F); its pieces cover that range,
    every value of the model once, cutting a parameter where a boundary falls."""
    layout = ParamLayout.of(build_model("proxy"))
    frags = partition(layout, n, 30, "values")
    assert [(f.lo, f.hi) for f in frags] == [
        (layout.numel * i // n, layout.numel * (i + 1) // n) for i in range(n)
    ]
    offsets = dict(zip(layout.names, layout.offsets, strict=True))
    covered = []
    for f in frags:
        assert sum(p.numel for p in f.pieces) == f.numel
        covered += [(offsets[p.name] + p.start, offsets[p.name] + p.stop) for p in f.pieces]
    assert covered[0][0] == 0 and covered[-1][1] == layout.numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))  # no gap, no overlap
    cut = [p for f in frags for p in f.pieces if p.numel < math.prod(p.shape)]
    assert cut  # the proxy's boundaries fall inside parameters (the tied embedding at F = 2)
    params = partition(layout, n, 30, "params")
    assert max(f.numel for f in frags) <= max(f.numel for f in params)
    with pytest.raises(ConfigError, match="fragment cut must be one of values, params"):
        partition(layout, n, 30, "layers")


@pytest.mark.parametrize("path", ["per_replica", "batched"])
def test_replica_sets_read_and_write_fragments_cut_inside_parameters(path: str) -> None:
    """What a replica set reads of a fragment is its range of the flat vector; what it
    writes lands there and nowhere else, for one row and for a block of replicas."""
    job = flat_job(4, 10, **SMALL).replace(path=path, fragments=3, fragment_cut="values")
    template, layout, theta0 = _init(job)
    reps = make_replicas(job, template, layout, theta0, torch.device("cpu"))
    frags = partition(layout, 3, job.h_g, "values")
    assert any(p.numel < math.prod(p.shape) for f in frags for p in f.pieces)
    whole = partition(layout, 1, job.h_g, "values")[0]
    g = torch.Generator().manual_seed(3)
    want = reps.read(whole)
    for f in frags:
        rows = torch.randn(reps.n, f.numel, generator=g)
        reps.write(f, 1, reps.n, rows[1:])
        reps.write(f, 0, 1, rows[0])
        want[:, f.lo : f.hi] = rows
        assert torch.equal(reps.read(f), rows)
        assert torch.equal(reps.read(whole), want)


def test_eval_points_anneal_start_and_lawa() -> None:
    job = flat_job(2, 10, **{**SMALL, "steps": 40, "eval_points": 4})
    assert eval_steps(job) == [10, 20, 30, 40]
    assert anneal_start(job) is None
    m1 = job.replace(anneal="m1", inner=InnerConfig(decay_fraction=0.3))
    assert anneal_start(m1) == 20  # decay starts at 28: the last global sync before is 20
    one = run_job(flat_job(2, 10, **{**SMALL, "inner": INNER, "lawa_k": 1}))
    assert one.final_loss == one.final_loss_raw  # LAWA of the last checkpoint alone
    three = run_job(flat_job(2, 10, **{**SMALL, "inner": INNER, "lawa_k": 2, "lawa_every": 5}))
    assert three.final_loss != three.final_loss_raw and math.isfinite(three.final_loss)


def test_divergence_is_a_result_not_an_exception() -> None:
    boom = InnerConfig(lr=50.0, warmup_steps=0, grad_clip=0.0)
    res = run_job(flat_job(2, 5, **{**SMALL, "inner": boom, "outer": OuterConfig(eta=5.0)}))
    assert res.diverged and res.reason and res.diverged_at is not None
    assert math.isnan(res.final_loss)
    d = res.to_dict()
    assert d["final_loss"] is None and d["diverged"] is True and "final_params" not in d


# -- the job description ----------------------------------------------------------------------


def test_job_validation_and_design_key() -> None:
    job = flat_job(4, 10, **SMALL)
    assert job.key() == job.replace(path="per_replica", device="cpu", threads=2).key()
    assert job.key() != job.replace(seed=1).key()
    assert SimJob.from_dict(job.to_dict()) == job
    bad: list[dict[str, Any]] = [
        dict(global_batch=6),  # 4 replicas do not divide 6
        dict(steps=25),  # not a multiple of h_g
        dict(anneal="m1", fragments=2),
        dict(tau=10),  # tau < h_r
        dict(outer=OuterConfig(name="sparseloco")),  # needs a sparseloco global codec
        dict(regional_codec="zip"),
        dict(fragments=11),
    ]
    for changes in bad:
        with pytest.raises(ConfigError):
            job.replace(**changes)
    with pytest.raises(ConfigError):
        dp_job(regions=2, **SMALL)


# -- the device switch ----------------------------------------------------------------------


def test_device_switch_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    job = flat_job(2, 10, **SMALL)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert job.resolved_device() == "cpu"
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert job.resolved_device() == "cuda"
    assert job.replace(device="cpu").resolved_device() == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            run_job(job)


def test_device_check_passes_cpu_and_refuses_a_disagreeing_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = [flat_job(2, 10, **{**SMALL, "inner": INNER})]
    report = engine_device.device_equivalence_check(jobs, "cpu", steps=10)
    assert report.ok and report.rows[0]["rel_diff"] == 0.0
    real = engine_device.run_job
    calls: list[str] = []

    def skewed(job: SimJob) -> JobResult:  # the second run of each pair is a "device" 0.1% off
        res = real(job)
        calls.append(job.resolved_device())
        if len(calls) % 2 == 0:
            res.final_loss *= 1.001
        return res

    monkeypatch.setattr(engine_device, "run_job", skewed)
    with pytest.raises(engine_device.DeviceMismatch, match="refusing the device"):
        engine_device.device_equivalence_check(jobs, "cpu", steps=10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_agrees_with_cpu() -> None:
    report = engine_device.device_equivalence_check(
        engine_device.default_check_jobs(steps=30), "cuda"
    )
    assert report.ok
