"""Streaming fragments in the round engine (RunConfig.fragments, issue 16): the staggered
schedule's rounds, the config's limits, the fragment bound into every delta and tape entry,
the island's per-fragment state, and the in-process run against the simulator's streaming
paths, bit for bit (the tiny preset; real tapes and signatures where the test says so)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypertrain.common.codec import make_codec
from hypertrain.common.config import RunConfig
from hypertrain.common.data import SampleStream
from hypertrain.common.digest import state_digest
from hypertrain.common.errors import ConfigError, HypertrainError
from hypertrain.common.fragments import fragment_offset, run_fragments
from hypertrain.common.optim import InnerConfig
from hypertrain.common.reference import model_cluster, open_dataset, run_reference
from hypertrain.common.roles import IslandCore, IslandState, initial_parameters
from hypertrain.common.rounds.island import IslandRounds
from hypertrain.common.rounds.local import Crash
from hypertrain.common.rounds.machines import INVALID, Committed, Delta, RelayMachine
from hypertrain.common.runflags import add_run_config_flags, run_config_from_args
from hypertrain.common.schedule import PendingMerge, Schedule
from hypertrain.common.toy import ToyIsland, toy_layout, toy_parameters
from hypertrain.common.trust.audit import AuditError, audit_run
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, daemon_key_names
from hypertrain.common.trust.ledger import island_key
from hypertrain.common.trust.schema import AnnealEntry, GenesisEntry, InputEntry, parse
from hypertrain.common.trust.tape import verify_tape
from hypertrain.sim.engine.job import SimJob
from hypertrain.sim.engine.run import run_job
from hypertrain.up import config_toml
from hypertrain.wire.server import PartShutdown, Shutdown
from tests.unit.toycluster import Restarter, drive

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _cfg(fragments: int, tau: int = 0, h_r: int = 2, h_g: int = 4, steps: int = 16) -> RunConfig:
    return RunConfig.from_dict(
        {
            "steps": steps,
            "batch_per_island": 4,
            "holdout_windows": 16,
            "fragments": fragments,
            "topology": {
                "regions": ["r0", "r1"],
                "islands_per_region": 2,
                "h_r": h_r,
                "h_g": h_g,
                "tau": tau,
            },
        }
    )


# -- the staggered schedule ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("h_r", "k", "n_frag", "rounds"),
    list(itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3, 4), (1, 3))),
)
def test_every_schedule_query_agrees_with_sync_kind_for_every_fragment(
    h_r: int, k: int, n_frag: int, rounds: int
) -> None:
    h_g = h_r * k
    if n_frag > h_g:
        return
    steps = rounds * h_g
    for f in range(n_frag):
        s = Schedule(h_r=h_r, h_g=h_g, tau=0, steps=steps, offset=fragment_offset(f, n_frag, h_g))
        kinds = {t: s.sync_kind(t) for t in range(1, steps + 1)}
        globals_ = [t for t, kind in kinds.items() if kind == "global"]
        regionals = [t for t, kind in kinds.items() if kind is not None]
        assert s.sync_steps("global") == globals_ and s.sync_steps("regional") == regionals
        assert globals_[-1] == steps  # every fragment's last sync is the run's last step
        assert s.rounds == len(globals_)
        for r, g in enumerate(globals_):
            assert s.round_of(g) == r and s.global_step_of(r) == g
        for t in regionals:  # a regional sync belongs to the round its next global closes
            assert s.round_of(t) == s.round_of(next(g for g in globals_ if g >= t))
        for level, listed in (("global", globals_), ("regional", regionals)):
            assert s.first_sync_step(level) == listed[0]  # type: ignore[arg-type]
            for a, b in itertools.pairwise([0, *listed]):
                assert s.next_sync_step(level, a) == b  # type: ignore[arg-type]
                assert s.prev_sync_step(level, b) == a  # type: ignore[arg-type]
            assert s.next_sync_step(level, steps) > steps  # type: ignore[arg-type]
            for t in range(1, steps + 1):
                assert s.is_sync_step(t, level) == (t in listed)  # type: ignore[arg-type]
        if f == 0:  # offset 0: the formulas of the whole-model schedule
            assert all(s.round_of(t) == (t - 1) // h_g for t in regionals)
            assert s.rounds == steps // h_g


def test_a_fragment_with_an_offset_has_a_short_first_and_last_round() -> None:
    s = Schedule.of(_cfg(2), fragment=1)  # offset 2 of h_g 4, 16 steps
    assert (s.offset, s.fragment) == (2, 1)
    assert s.sync_steps("global") == [2, 6, 10, 14, 16] and s.rounds == 5
    assert s.sync_steps("regional") == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [s.round_of(t) for t in (1, 2, 3, 6, 15, 16)] == [0, 0, 1, 1, 4, 4]
    with pytest.raises(HypertrainError, match="fragment None of a run with 2 fragments"):
        Schedule.of(_cfg(2))
    with pytest.raises(HypertrainError, match="fragment 2 of a run with 2"):
        Schedule.of(_cfg(2), fragment=2)
    with pytest.raises(HypertrainError, match="fragment 0 of a run with 1"):
        Schedule.of(_cfg(1), fragment=0)


# -- the configuration -------------------------------------------------------------------------


def test_the_config_names_what_fragments_do_not_work_with_yet() -> None:
    assert "fragments" not in RunConfig().to_dict()  # configs from before keep their digest
    assert _cfg(2).to_dict()["fragments"] == 2
    with pytest.raises(ConfigError, match=r"fragments must be in \[1, h_g = 4\] .*, got 5"):
        _cfg(5)
    with pytest.raises(ConfigError, match="fragments must be in"):
        _cfg(0)
    base = _cfg(2).to_dict()
    for change, named in (
        ({"membership": {"standby": ["r0-1"]}}, "standby islands"),
        ({"membership": {"regional_cutoff_s": 5.0}}, "membership cutoffs"),
        ({"topology": {**base["topology"], "relay_shards": 2}}, "relay shards"),
        ({"robust": {"rule": "trimmed_mean"}}, "a robust rule"),
    ):
        with pytest.raises(ConfigError, match=f"fragments > 1 does not work with {named}"):
            RunConfig.from_dict({**base, **change})
    # the anneal and LAWA combine with fragments; each fragment needs a start of its own
    RunConfig.from_dict({**base, "anneal": "islands:1", "lawa": 2})
    late = dataclasses.replace(_cfg(4, h_r=2, h_g=8), inner=InnerConfig(decay_fraction=0.7))
    assert [late.anneal_step_of(f) for f in range(3)] == [None] * 3  # (anneal full_m)
    with pytest.raises(ConfigError, match="fragment 3 has no global sync step at or before"):
        late.with_overrides(anneal="h_r1")
    assert [late.with_overrides(fragments=3, anneal="h_r1").anneal_step_of(f)
            for f in range(3)] == [0, 2, 5]  # fmt: skip
    with pytest.raises(ConfigError, match="anneal h_r1 needs tau = 0"):
        _cfg(2, tau=1).with_overrides(anneal="h_r1")
    assert _cfg(2, tau=1).with_overrides(anneal="islands:1").topology.tau == 1  # overlap: yes
    early = dataclasses.replace(_cfg(2, h_r=2, h_g=8), inner=InnerConfig(decay_fraction=0.6))
    assert [early.with_overrides(anneal="h_r1").anneal_step_of(f) for f in range(2)] == [0, 4]
    with pytest.raises(ConfigError, match="islands:1: the decay starts before the first global"):
        early.with_overrides(anneal="islands:1")


def test_the_fragment_cut_is_a_named_choice_of_the_config_and_the_simulators_job() -> None:
    """``values`` is the run's default (left out of the config dict, so the digest of a run
    from before the choice stays); ``params`` is the simulator's (its registered cells);
    ``SimJob.of_run`` carries the run's cut, and a job of one fragment has no cut to set."""
    assert "fragment_cut" not in _cfg(2).to_dict() and _cfg(2).fragment_cut == "values"
    params = _cfg(2).with_overrides(fragment_cut="params")
    assert params.to_dict()["fragment_cut"] == "params"
    assert RunConfig.from_dict(params.to_dict()) == params
    with pytest.raises(ConfigError, match="fragment_cut must be one of values, params, got 'x'"):
        _cfg(2).with_overrides(fragment_cut="x")
    parser = argparse.ArgumentParser()
    add_run_config_flags(parser)
    args = parser.parse_args(["--fragments", "2", "--fragment-cut", "params"])
    assert run_config_from_args(args).fragment_cut == "params"
    assert SimJob.of_run(_cfg(2)).fragment_cut == "values"
    assert SimJob.of_run(params).fragment_cut == "params"
    assert SimJob.of_run(_cfg(1)).fragment_cut == "params"  # the simulator's default
    assert "fragment_cut" not in SimJob.of_run(_cfg(1)).to_dict()  # keys from before stay
    assert SimJob.of_run(_cfg(2)).to_dict()["fragment_cut"] == "values"
    with pytest.raises(ConfigError, match="fragment_cut is only set with fragments > 1"):
        SimJob.of_run(_cfg(1)).replace(fragment_cut="values")
    with pytest.raises(ConfigError, match=r"run\.fragments and run\.fragment_cut stay at their"):
        SimJob(run=_cfg(1).with_overrides(fragment_cut="params"))


# -- the fragment on the wire and on the tape --------------------------------------------------


def test_a_node_of_one_fragment_refuses_another_fragment_s_delta_and_its_signature_binds_it(
    tmp_path: Path,
) -> None:
    cfg = _cfg(2)
    layout, theta0 = initial_parameters(cfg)
    frags = run_fragments(cfg, layout)
    key = SigningKey.generate(island_key("r0-0"))
    trusted = TrustedKeys.of([key])
    relay = RelayMachine(cfg, "r0", theta0[frags[1].lo : frags[1].hi], trusted, fragment=1)
    codec = make_codec(cfg.regional_codec)
    for f in (0, 1):
        numel = frags[f].numel
        blob = codec.encode(torch.zeros(numel))
        d = Delta.of(cfg.run_id, 2, "r0-0", str(codec.spec), blob, Schedule.of(cfg, fragment=f))
        d = d.signed(key.sign(d.transfer_message()))
        decision, _ = relay.on_delta(d)
        if f == 0:
            assert decision.code == INVALID
            assert (
                decision.reason
                == "delta of fragment 0 sent to the relay of r0, which serves fragment 1"
            )
            continue
        assert decision.accepted, decision.reason
        # the same bytes and signature, relabelled as another fragment's: not what was signed
        moved = dataclasses.replace(d, fragment=0, sync_step=4, round=0)
        assert moved.transfer_message() != d.transfer_message()
        assert b'"fragment":1' in d.transfer_message()
    plain = _cfg(1)
    whole = RelayMachine(plain, "r0", theta0)
    blob = codec.encode(torch.zeros(frags[1].numel))
    d = Delta.of(cfg.run_id, 2, "r0-0", str(codec.spec), blob, Schedule.of(cfg, fragment=1))
    decision, _ = whole.on_delta(d)
    assert decision.code == INVALID
    assert decision.reason == (
        "delta of fragment 1 sent to the relay of r0, which serves a run without fragments"
    )


def _taped_run(run_dir: Path, cfg: RunConfig) -> torch.Tensor:
    """``cfg``'s run in process with tapes, signed, in ``run_dir`` (with its run.toml)."""
    torch.set_num_threads(cfg.threads)  # a module fixture runs before ``one_thread``
    layout, theta0 = initial_parameters(cfg)
    stream = SampleStream(open_dataset(cfg), cfg.model_config().seq_len, cfg.global_batch, 0)
    cluster = model_cluster(cfg, layout, theta0, stream, run_dir=run_dir, keys=KEYS,
                            trusted=TRUSTED)  # fmt: skip
    (run_dir / "run.toml").write_text(config_toml(cfg))
    return cluster.run_lockstep()


TAPED = _cfg(2, tau=1, steps=8)
KEYS = {n: SigningKey.generate(n) for n in daemon_key_names(TAPED.topology)}
TRUSTED = TrustedKeys.of(KEYS.values())


@pytest.fixture(scope="module")
def taped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """One signed, taped fragment run (2 fragments, tau 1, 8 steps), never changed."""
    run_dir = tmp_path_factory.mktemp("taped")
    return run_dir, _taped_run(run_dir, TAPED)


def test_each_fragment_s_nodes_keep_their_own_tape_and_every_entry_names_the_fragment(
    taped: tuple[Path, torch.Tensor],
) -> None:
    run_dir, theta = taped
    cfg = TAPED
    assert torch.equal(theta, run_reference(cfg).final_params)  # type: ignore[arg-type]
    tapes = sorted(run_dir.glob("*/fragment-*/tape"))
    assert [str(t.relative_to(run_dir)) for t in tapes] == [
        f"{node}/fragment-{f}/tape"
        for node in ("aggregator", "relay-r0", "relay-r1")
        for f in (0, 1)
    ]
    for tape in tapes:
        f = int(tape.parent.name.split("-")[1])
        entries = verify_tape(tape, TRUSTED).entries
        records = [parse(e) for e in entries]
        assert isinstance(records[0], GenesisEntry) and records[0].fragment == f
        assert all(r.fragment == f for r in records if r is not None), tape
        inputs = [r for r in records if isinstance(r, InputEntry)]
        schedule = Schedule.of(cfg, fragment=f)
        level = "global" if tape.parts[-3] == "aggregator" else "regional"
        assert sorted({r.sync_step for r in inputs}) == schedule.sync_steps(level)  # type: ignore[arg-type]
    lines = (run_dir / "island-r0-0" / "receipts").read_text().splitlines()
    assert {json.loads(line)["fragment"] for line in lines} == {0, 1}


def test_the_audit_replays_each_fragment_and_joins_their_final_states(
    taped: tuple[Path, torch.Tensor],
) -> None:
    run_dir, theta = taped
    layout, _ = initial_parameters(TAPED)
    report = audit_run(run_dir, TRUSTED)
    assert report.complete and report.fragments == 2
    assert report.final_digest == state_digest(layout.unflatten(theta))
    assert report.receipts > 0
    assert " in 2 fragments, " in report.summary()
    segment = audit_run(run_dir, TRUSTED, from_round=0)  # each fragment from its round 0
    assert segment.segment and segment.complete and segment.first_round == 1
    assert segment.final_digest == report.final_digest
    # Fragment 0's round 1 is its last: a segment from there replays none of its rounds.
    with pytest.raises(AuditError, match="fragment-0/tape: no global round after round 1"):
        audit_run(run_dir, TRUSTED, from_round=1)
    assert audit_run(run_dir, TRUSTED, from_round=(0, 1)).starts == (0, 1)


def test_the_audit_refuses_a_receipt_of_a_fragment_the_run_does_not_have(
    taped: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(taped[0], run_dir)
    receipts = run_dir / "island-r0-0" / "receipts"
    line = json.loads(receipts.read_text().splitlines()[0])
    line["fragment"] = 7
    with receipts.open("a") as f:
        f.write(json.dumps(line) + "\n")
    with pytest.raises(AuditError, match="a receipt of fragment 7, which this run"):
        audit_run(run_dir, TRUSTED)


def test_a_daemon_of_several_fragments_stops_when_all_are_done_or_one_fails() -> None:
    whole, parts = Shutdown(), []
    a, b = (PartShutdown(whole, parts, "run complete", 2) for _ in range(2))
    a.request("run complete: every island has the final merge")
    assert a.requested and not b.requested and not whole.requested  # b's run goes on
    b.request("run complete: every island has the final merge")
    assert whole.requested
    whole, parts = Shutdown(), []
    first = PartShutdown(whole, parts, "run complete", 2)
    first.request("run complete")  # recovered a finished fragment while the daemon starts
    assert not whole.requested  # the second part does not exist yet: not a whole run
    second = PartShutdown(whole, parts, "run complete", 2)
    second.request("forwarding failed: the aggregator refused")
    assert whole.requested and whole.reason == "forwarding failed: the aggregator refused"
    whole, parts = Shutdown(), []
    c, d = (PartShutdown(whole, parts, "run complete", 2) for _ in range(2))
    whole.request("SIGTERM")
    assert c.requested and d.requested


def test_the_audit_catches_a_tampered_fragment_input_and_a_tape_of_another_fragment(
    taped: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(taped[0], run_dir)
    published = sorted((run_dir / "relay-r1" / "fragment-1" / "published").iterdir())
    victim = published[len(published) // 2]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1  # one bit of one island's delta of fragment 1
    victim.write_bytes(bytes(data))
    with pytest.raises(
        AuditError, match=r"relay-r1/fragment-1/tape entry \d+ \(input.*changed input"
    ):
        audit_run(run_dir, TRUSTED)
    shutil.rmtree(run_dir)
    shutil.copytree(taped[0], run_dir)
    for name in ("tape", "checkpoints", "published"):  # fragment 0's relay folder as 1's
        target = run_dir / "relay-r0" / "fragment-1" / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        src = run_dir / "relay-r0" / "fragment-0" / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, target)
    with pytest.raises(
        AuditError, match=r"fragment-1/tape entry 0 \(genesis\): recomputed fragment"
    ):
        audit_run(run_dir, TRUSTED)


# -- the island's state by fragment ------------------------------------------------------------


def test_an_island_saves_and_restores_its_error_feedback_and_snapshots_per_fragment() -> None:
    cfg = _cfg(3, tau=1)
    layout, theta0 = initial_parameters(cfg)
    frags = run_fragments(cfg, layout)
    stream = SampleStream(open_dataset(cfg), cfg.model_config().seq_len, cfg.global_batch, 0)
    core = IslandCore(cfg, "r0-0", stream, theta0, fragments=frags)
    for _ in range(2):
        core.train_step()
    for f in range(3):
        if core.schedules[f].sync_kind(2) is not None:
            core.sync(fragment=f)
    state = core.state_dict()
    assert isinstance(state["feedback"], list) and len(state["feedback"]) == 3
    assert [sorted(s) for s in state["snapshots"]] == [
        [2] if core.schedules[f].sync_kind(2) else [] for f in range(3)
    ]
    again = IslandCore(cfg, "r0-0", stream, theta0, fragments=frags)
    again.load_state_dict(state)
    assert torch.equal(again.params(), core.params())
    # One fragment's merge may wait while a rejoin state with the base is written: no
    # merge is received into the base of a split run.
    with pytest.raises(HypertrainError, match="no merge target with fragments"):
        core.merge_target()
    for a, b in zip(again.feedbacks, core.feedbacks, strict=True):
        ra, rb = a.state_dict()["residual"], b.state_dict()["residual"]
        assert (ra is None and rb is None) or torch.equal(ra, rb)
    whole = IslandCore(_cfg(1, tau=1), "r0-0", stream, theta0)
    with pytest.raises(HypertrainError, match="not of a run with 1 fragments"):
        whole.load_state_dict(state)
    with pytest.raises(HypertrainError, match="needs their ranges"):
        IslandCore(cfg, "r0-0", stream, theta0)


class _FragmentToy(ToyIsland):
    """The fault simulation's toy island, split into the run's fragments."""

    def __init__(self, cfg: RunConfig, island_id: str) -> None:
        theta0 = toy_parameters(cfg)
        IslandState.__init__(self, cfg, island_id, theta0, run_fragments(cfg, toy_layout()))
        self.theta = theta0.clone()


@pytest.mark.parametrize(
    ("fragments", "tau", "h_r", "anneal", "island"),
    [(1, 1, 2, "full_m", "r0-0"), (3, 1, 2, "full_m", "r0-0"), (4, 3, 4, "full_m", "r0-0"),
     (2, 1, 2, "islands:2", "r1-1"), (4, 3, 4, "islands:3", "r1-1"), (3, 0, 2, "full_m", "r0-0")],
    ids=["f1-tau1", "f3-tau1", "f4-tau3-flush", "f2-tau1-stops", "f4-tau3-stops", "f3-tau0"],
)  # fmt: skip
def test_the_merges_an_island_may_fetch_ahead_are_exactly_those_it_takes_later(
    fragments: int, tau: int, h_r: int, anneal: str, island: str
) -> None:
    """``IslandRounds.ahead`` right after each sync step's push (where the island daemon
    starts its fetches ahead) names every merge the island later takes at a later step, by
    ``due``, ``before_sync`` or ``final_due``, and no other: not the last merge of an
    island an ``islands:K`` anneal stops (r1-1: it never takes it), and none with tau 0."""
    cfg = _cfg(fragments, tau, h_r, 2 * h_r).with_overrides(anneal=anneal)
    rounds = IslandRounds(_FragmentToy(cfg, island), cfg.run_id)
    ahead: set[tuple[int, int]] = set()
    later: set[tuple[int, int]] = set()

    def taken(merges: list[PendingMerge[int]]) -> None:
        later.update((p.item, p.sync_step) for p in merges if p.merge_step > p.sync_step)

    while not rounds.finished:
        rounds.core.train_step()
        taken(rounds.before_sync())
        rounds.after_step()
        now = rounds.ahead()
        assert all(p.merge_step > rounds.step for p in now)
        ahead.update((p.item, p.sync_step) for p in now)
        taken(rounds.due())
    if rounds.stops_early:
        assert any(len(q) for q in rounds.pendings)  # its last merge: never taken
        rounds.stop()
    while (final := rounds.final_due()) is not None:
        taken([final])
        fr = rounds.core.fragments[final.item]
        rounds.finish(torch.zeros(fr.hi - fr.lo))
    assert ahead == later
    assert bool(ahead) == (tau > 0)


# -- the in-process run is the simulator's streaming path ---------------------------------------


@pytest.mark.parametrize(
    ("fragments", "tau", "h_r", "h_g", "cut"),
    [(2, 0, 2, 4, "values"), (3, 1, 2, 4, "values"), (4, 3, 4, 8, "values"),
     (3, 1, 2, 4, "params")],
    ids=["f2-tau0", "f3-tau1", "f4-tau3-flush", "f3-tau1-params"],
)  # fmt: skip
def test_in_process_run_with_fragments_is_the_simulators_streaming_run_bit_for_bit(
    fragments: int, tau: int, h_r: int, h_g: int, cut: str
) -> None:
    """f4-tau3-flush: fragment 1 syncs at step 14 with its merge pinned past the last step
    16; it is applied before the final sync there (``IslandRounds.before_sync``).  The
    values cut (the default) falls inside parameters; the params cut is the registered
    cells'."""
    cfg = _cfg(fragments, tau, h_r, h_g).with_overrides(fragment_cut=cut)
    assert (cut == "values") == ("fragment_cut" not in cfg.to_dict())
    ref = run_reference(cfg)
    assert len(ref.rounds) == cfg.steps // h_g  # evaluated at fragment 0's global merges
    for path in ("per_replica", "batched"):
        job = SimJob.of_run(cfg, path=path, eval_points=1)
        sim = run_job(job)
        assert torch.equal(ref.final_params, sim.final_params), path  # type: ignore[arg-type]
        assert ref.final_loss == sim.final_loss
    whole = run_reference(cfg.with_overrides(fragments=1))
    assert not torch.equal(whole.final_params, ref.final_params)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fragments", "tau", "anneal", "lawa", "paths"),
    [
        (2, 0, "h_r1", 0, ("per_replica",)),
        (2, 0, "islands:1", 0, ("per_replica",)),
        (2, 1, "islands:2", 0, ("per_replica",)),
        (2, 1, "full_m", 2, ("per_replica",)),
        (3, 1, "islands:1", 2, ("per_replica", "batched")),
        (3, 0, "h_r1", 2, ("per_replica",)),
        (4, 3, "islands:3", 2, ("per_replica",)),
    ],
    ids=[
        "f2-h_r1",
        "f2-islands1",
        "f2-tau1-islands2",
        "f2-tau1-lawa2",
        "all3-tau1-islands1",
        "all3-h_r1",
        "f4-tau3-islands3",
    ],
)
def test_fragments_with_the_anneal_and_lawa_are_the_simulators_run_bit_for_bit(
    fragments: int, tau: int, anneal: str, lawa: int, paths: tuple[str, ...]
) -> None:
    """Each fragment switches after its own last global sync at or before the decay's start
    (f3: steps 12, 13 and 10); an island ``islands:K`` stops leaves each fragment there,
    takes the merges of those it left pinned up to its own last step (13) and trains on
    (f4-tau3: starts 8, 10, 12, 6 with h_g 8; r1-1 stops at 12 and takes the merges of 6
    and 8 at 9 and 11, not that of 10); LAWA is each fragment's mean over its own last
    rounds (fragments with an offset have one more)."""
    h_r = 4 if tau == 3 else 2
    cfg = _cfg(fragments, tau, h_r, 2 * h_r).with_overrides(anneal=anneal, lawa=lawa)
    if fragments == 3:
        assert [cfg.anneal_step_of(f) for f in range(3)] == [12, 13, 10]
    if fragments == 4:
        assert [cfg.anneal_step_of(f) for f in range(4)] == [8, 10, 12, 6]
    ref = run_reference(cfg)
    for path in paths:
        job = SimJob.of_run(cfg, path=path, eval_points=1)
        sim = run_job(job)
        assert torch.equal(ref.final_params, sim.final_params), path  # type: ignore[arg-type]
        if lawa:
            assert torch.equal(ref.lawa_params, sim.lawa_params), path  # type: ignore[arg-type]
            assert ref.lawa_loss == sim.final_loss
        else:
            assert ref.final_loss == sim.final_loss
    if anneal == "full_m":  # the average is not the final state
        assert not torch.equal(ref.lawa_params, ref.final_params)  # type: ignore[arg-type]
    else:  # the anneal changed the run
        plain = run_reference(cfg.with_overrides(anneal="full_m", lawa=0))
        assert not torch.equal(plain.final_params, ref.final_params)  # type: ignore[arg-type]


ALL3 = _cfg(3, tau=1, steps=16).with_overrides(anneal="islands:1", lawa=2)


def test_the_audit_replays_fragments_with_the_anneal_and_lawa_and_catches_a_tampered_average(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    theta = _taped_run(run_dir, ALL3)
    ref = run_reference(ALL3)
    assert torch.equal(theta, ref.final_params)  # type: ignore[arg-type]
    report = audit_run(run_dir, TRUSTED)
    assert report.complete and report.fragments == 3
    assert report.lawa_digest == ref.lawa_digest and report.lawa_digest
    for f, start in enumerate((12, 13, 10)):
        tape = run_dir / "aggregator" / f"fragment-{f}" / "tape"
        records = [parse(e) for e in verify_tape(tape, TRUSTED).entries]
        kinds = [(r.KIND, r.fragment) for r in records if r is not None]
        assert ("anneal", f) in kinds and ("lawa", f) in kinds
        (switch,) = [r for r in records if isinstance(r, AnnealEntry)]
        assert switch.step == start
    path = run_dir / "aggregator" / "fragment-1" / "lawa.pt"
    ck = torch.load(path, weights_only=True)
    ck["theta"][0] += 1e-3
    torch.save(ck, path)
    with pytest.raises(AuditError, match=r"fragment-1/lawa.pt: not the LAWA average of rounds"):
        audit_run(run_dir, TRUSTED)


# -- the command line ---------------------------------------------------------------------------


def test_run_local_takes_fragments_and_prints_the_in_process_digest() -> None:
    flags = ["--fragments", "2", "--steps", "8", "--h-r", "2", "--h-g", "4", "--batch", "2"]
    flags += ["--regions", "eu", "--islands-per-region", "2", "--holdout-windows", "4"]
    run = subprocess.run(
        [sys.executable, "-m", "hypertrain", "run", "--local", *flags],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "2 streaming fragments" in run.stdout
    cfg = RunConfig.from_dict(
        {
            "steps": 8,
            "batch_per_island": 2,
            "holdout_windows": 4,
            "fragments": 2,
            "topology": {"regions": ["eu"], "islands_per_region": 2, "h_r": 2, "h_g": 4},
        }
    )
    assert f"final state digest {run_reference(cfg).final_digest}" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "hypertrain", "run", "--local", *flags[:-6], "--fragments", "5"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "fragments must be in [1, h_g = 4]" in bad.stderr


def test_the_readme_s_recipe_is_streaming_a_one_island_decay_and_lawa_within_the_decay() -> None:
    """The README's one-command recipe parses to what it says: 2 fragments, the decay on the
    first island, LAWA over rounds that lie in the decay, on the default cluster (that it
    runs to the end is tests/integration/test_streaming_daemons.py's ALL3, smaller)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("bash scripts/demo.sh --fragm")]
    p = argparse.ArgumentParser()
    add_run_config_flags(p)
    cfg = run_config_from_args(p.parse_args(shlex.split(line)[2:]))
    assert (cfg.fragments, cfg.anneal, cfg.lawa, cfg.topology.tau) == (2, "islands:1", 2, 1)
    assert cfg.anneal_kept() == ("eu-0",)
    decay = cfg.steps - round(cfg.inner.decay_fraction * cfg.steps)
    for f in range(cfg.fragments):
        schedule = Schedule.of(cfg, fragment=f)
        start = cfg.anneal_step_of(f)
        assert start is not None and start <= decay
        first = schedule.rounds - cfg.lawa  # the averaged rounds end after the switch
        assert schedule.global_step_of(first) > start


# -- restarts -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def all3() -> tuple[torch.Tensor, torch.Tensor]:
    """The fault-free final state and LAWA average of ALL3 (fragments, the islands:1 anneal
    and LAWA)."""
    ref = run_reference(ALL3)
    assert ref.final_params is not None and ref.lawa_params is not None
    return ref.final_params, ref.lawa_params


@pytest.mark.parametrize(
    ("victim", "point", "nth", "run"),
    [
        ("relay-r0.f1", "relay_before_merge_entry", 2, "taped"),
        ("relay-r1.f0", "relay_after_forward_entry", 1, "taped"),
        ("relay-r0.f1", "relay_after_checkpoint", 2, "taped"),
        ("aggregator.f1", "before_tape", 2, "taped"),
        ("aggregator.f0", "after_tape", 1, "taped"),
        ("r0-1", "island", 2, "taped"),
        ("aggregator.f1", "before_anneal_entry", 1, "all3"),
        ("relay-r1.f2", "before_anneal_entry", 1, "all3"),
        ("aggregator.f2", "before_lawa_entry", 1, "all3"),
        ("r0-1", "island", 8, "all3"),  # stopped by the anneal, after fragment 2 left at 10
    ],
)
def test_a_process_that_dies_in_a_fragment_round_resumes_on_the_same_state(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    victim: str,
    point: str,
    nth: int,
    run: str,
) -> None:
    """``victim`` (one fragment's relay or aggregator, or an island holding merges of
    several fragments) dies the ``nth`` time it passes ``point`` (an island: after its
    ``nth`` global merge), is restarted from its folder while the others go on, and the
    run ends on the fault-free final state with tapes that audit clean; ``all3``: with the
    anneal's switch and the LAWA average of each fragment."""
    torch.set_num_threads(1)
    cfg = TAPED if run == "taped" else ALL3
    expected = (
        request.getfixturevalue("taped")[1] if run == "taped" else request.getfixturevalue("all3")
    )
    fired: list[str] = []
    seen = [0]

    def hook(name: str) -> Callable[[str], None]:
        def crash(p: str) -> None:
            if name == victim and p == point:
                seen[0] += 1
                if seen[0] == nth:
                    fired.append(p)
                    raise Crash(f"{name} at {p}")

        return crash

    class Watch(Restarter):
        def applied(
            self, island: str, kind: str, sync_step: int, base: torch.Tensor, fragment: int = 0
        ) -> None:
            if island == victim and kind == "global":
                seen[0] += 1
                if seen[0] == nth:
                    fired.append(point)
                    actor = self.cluster.islands[island]
                    self.cluster.net.at(self.cluster.net.now + 0.5, actor.crash)

    layout, theta0 = initial_parameters(cfg)
    stream = SampleStream(open_dataset(cfg), cfg.model_config().seq_len, cfg.global_batch, 0)
    watch = Watch()
    cluster = model_cluster(cfg, layout, theta0, stream, run_dir=tmp_path, keys=KEYS,
                            trusted=TRUSTED, observer=watch, crash_hook=hook)  # fmt: skip
    watch.cluster = cluster
    (tmp_path / "run.toml").write_text(config_toml(cfg))
    drive(cluster)
    assert fired == [point]
    assert torch.equal(cluster.final_theta(), expected[0] if run == "all3" else expected)
    if run == "all3":
        assert torch.equal(cluster.lawa_average(), expected[1])  # type: ignore[arg-type]
    for a in cluster.aggregators:
        a._drop()  # close the tapes as a stopped process would
    for r in cluster.relays.values():
        r._drop()
    assert audit_run(tmp_path, TRUSTED).summary().startswith("audit OK: complete")


def test_a_relay_recomputes_a_round_0_merge_of_its_own_fragment(tmp_path: Path) -> None:
    """An island restarted from its last global state asks again for the regional merges
    of the round it retrains; a relay that no longer holds one recomputes it from the
    round's first parameters.  In round 0 those are the initial ones of its fragment's
    range, not of the model's first values (fragment 1 of 2, offset 2 with h_g = 4, has a
    regional step 1 in its short round 0; found by the fault simulation)."""
    from hypertrain.common.rounds.local import Cluster
    from hypertrain.common.trust.ledger import flat_digest

    cfg = RunConfig.from_dict(
        {
            "run_id": "recompute",
            "model": "toy",
            "steps": 8,
            "fragments": 2,
            "topology": {"regions": ["a"], "islands_per_region": 2, "h_r": 1, "h_g": 4},
        }
    )
    keys = {n: SigningKey.generate(n) for n in daemon_key_names(cfg.topology)}
    frags = run_fragments(cfg, toy_layout())
    theta0 = toy_parameters(cfg)
    cluster = Cluster(cfg, theta0, lambda i: ToyIsland(cfg, i, theta0, frags), fragments=frags,
                      run_dir=tmp_path, keys=keys, trusted=TrustedKeys.of(keys.values()))  # fmt: skip
    cluster.run_lockstep()
    for name in ("relay-a.f0", "relay-a.f1"):
        node = cluster.relays[name].node
        schedule = node.machine.schedule
        regional = [t for t in range(1, 5) if schedule.sync_kind(t) == "regional"]
        assert regional  # round 0 (and 1) hold regional steps of this fragment
        for step in regional:
            again = node._recomputed(step)
            assert again is not None and flat_digest(again.payload) == node.machine.bases[step]


def test_a_relay_serves_an_older_global_merge_from_its_checkpoint(tmp_path: Path) -> None:
    """tau = 1, two fragments: an island saves its rejoin state with fragment 1's global
    merge of step 5 still to take; dead in the last step's sync, its last deltas pushed,
    it asks for that merge again after the relay holds only the final one.  The relay
    serves it from its checkpoint of that round, the bits it served then (before: "not
    committed yet", for ever; found by the fault simulation, seed 795); a checkpoint that
    does not hash to its global_applied entry is refused by name."""
    from hypertrain.common.rounds.local import Cluster
    from hypertrain.common.rounds.store import load_state
    from hypertrain.common.trust.ledger import flat_digest

    cfg = RunConfig.from_dict(
        {
            "run_id": "older-global",
            "model": "toy",
            "steps": 6,
            "fragments": 2,
            "topology": {"regions": ["a"], "islands_per_region": 2, "h_r": 2, "h_g": 2,
                         "tau": 1},
        }
    )  # fmt: skip
    keys = {n: SigningKey.generate(n) for n in daemon_key_names(cfg.topology)}
    frags = run_fragments(cfg, toy_layout())
    theta0 = toy_parameters(cfg)
    served: dict[int, str] = {}

    class Watch:
        def committed(self, node: str, effect: object) -> None: ...
        def pushed(self, *args: object) -> None: ...
        def finished(self, *args: object) -> None: ...
        def crashed(self, *args: object) -> None: ...

        def applied(self, island: str, kind: str, sync_step: int, base: torch.Tensor,
                    fragment: int = 0) -> None:  # fmt: skip
            if fragment == 1 and kind == "global":
                served[sync_step] = flat_digest(base[frags[1].lo : frags[1].hi])

    cluster = Cluster(cfg, theta0, lambda i: ToyIsland(cfg, i, theta0, frags), fragments=frags,
                      run_dir=tmp_path, keys=keys, trusted=TrustedKeys.of(keys.values()),
                      observer=Watch())  # type: ignore[arg-type]  # fmt: skip
    cluster.run_lockstep()
    node = cluster.relays["relay-a.f1"].node
    assert sorted(t for t, c in node.machine.merges.items() if c.kind == "global") == [6]
    got = node.fetch(cfg.run_id, "a-0", 5, "global")
    assert isinstance(got, Committed) and got.sync_step == 5 and got.receipts
    assert flat_digest(got.payload) == got.payload_digest == served[5]
    assert node.fetch(cfg.run_id, "a-0", 6, "global").payload_digest != served[5]  # type: ignore[union-attr]
    path = node.store.folder / "checkpoints" / "round-000002.pt"  # type: ignore[union-attr]
    state = load_state(path)
    state["theta"] = state["theta"] + 1.0
    torch.save(state, path)
    with pytest.raises(HypertrainError, match="its checkpoint of the global merge of step 5"):
        node.fetch(cfg.run_id, "a-0", 5, "global")


def test_without_fragments_an_older_global_merge_is_not_served_again(tmp_path: Path) -> None:
    """Without fragments an island never waits for a global merge older than its rejoin
    state; one that asks for one was left behind at a cutoff and must take the newest
    instead (``RelayNode.newer``), so the relay does not serve the old one from its
    checkpoint (it did, for a moment: the daemons' churn test caught it)."""
    from hypertrain.common.rounds.local import Cluster

    cfg = RunConfig.from_dict(
        {
            "run_id": "no-older-global",
            "model": "toy",
            "steps": 6,
            "topology": {"regions": ["a"], "islands_per_region": 2, "h_r": 2, "h_g": 2},
        }
    )
    keys = {n: SigningKey.generate(n) for n in daemon_key_names(cfg.topology)}
    theta0 = toy_parameters(cfg)
    cluster = Cluster(cfg, theta0, lambda i: ToyIsland(cfg, i, theta0), run_dir=tmp_path,
                      keys=keys, trusted=TrustedKeys.of(keys.values()))  # fmt: skip
    cluster.run_lockstep()
    node = cluster.relays["relay-a"].node
    assert (node.store.folder / "checkpoints" / "round-000001.pt").is_file()  # type: ignore[union-attr]
    assert node._lookup(cfg.run_id, "a-0", 4, "global") is None
