"""Running fault schedules: one seed, or thousands on a process pool.

    hypertrain sim chaos --seeds 10000            # toy model; prints N schedules, K events, V violations
    hypertrain sim chaos --seed 17 --trace        # one schedule: its events, and the first broken invariant
    hypertrain sim chaos --model tiny --seeds 20  # the real tiny model

One schedule (``run_schedule``): draw the cluster and the faults from the seed, build
the whole cluster in one process over the in-process transport (common/rounds/local.py:
the real nodes, stores on a memory file system, signing keys, island cores), and step
it in virtual time: islands train when they are not waiting; messages arrive late,
twice or never; links partition; nodes crash between events or at crash points inside
their durable writes, and restart from their folders.  After every event the checker
(invariants.py) runs; at the end the run must be complete, end on the digest of the
same cluster run without faults, and its tapes must pass ``hypertrain audit``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from hypertrain.common import planted
from hypertrain.common.config import TOY_MODEL, RunConfig
from hypertrain.common.data import SampleStream
from hypertrain.common.errors import HypertrainError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.fragments import Fragment, run_fragments
from hypertrain.common.reference import open_dataset
from hypertrain.common.roles import IslandCore, IslandState, initial_parameters
from hypertrain.common.rounds.local import (
    Actor,
    Cluster,
    IslandActor,
    ProtocolFailure,
)
from hypertrain.common.toy import ToyIsland
from hypertrain.common.trust.audit import AuditError, Auditor, RunLayout
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, daemon_key_names
from hypertrain.common.trust.ledger import flat_digest, relay_key
from hypertrain.sim.chaos.faults import Churn, Faults, draw_config, draw_keep_rounds
from hypertrain.sim.chaos.invariants import Checker, Violation

MAX_EVENTS = 200_000
"""A schedule still running after this many events is stuck (a liveness violation)."""
STEP_TIME = (0.5, 1.5)
"""Virtual seconds an island takes per inner step (drawn per island)."""


@dataclass
class Outcome:
    """What one schedule did."""

    seed: int
    events: int = 0
    violation: str | None = None
    trace: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    crashes: int = 0
    absences: int = 0
    """Commits that went ahead without some member (after a cutoff)."""
    changes: int = 0
    """Joins and leaves taped by the relays."""


def _core_factory(
    cfg: RunConfig, theta0: torch.Tensor, frags: list[Fragment] | None
) -> Callable[[str], IslandState]:
    if cfg.model == TOY_MODEL:
        return lambda i: ToyIsland(cfg, i, theta0, frags)
    stream = SampleStream(open_dataset(cfg), cfg.model_config().seq_len, cfg.global_batch, cfg.seed)
    return lambda i: IslandCore(cfg, i, stream, theta0, fragments=frags)


def _cluster(cfg: RunConfig, layout: ParamLayout, theta0: torch.Tensor, **kwargs: Any) -> Cluster:
    """The in-process cluster of ``cfg`` (``kwargs``: Cluster's own), its nodes cut into
    the run's streaming fragments when it has several."""
    frags = run_fragments(cfg, layout) if cfg.fragments > 1 else None
    return Cluster(cfg, theta0, _core_factory(cfg, theta0, frags), fragments=frags, **kwargs)


@functools.lru_cache(maxsize=64)
def _keys(names: tuple[str, ...]) -> tuple[dict[str, SigningKey], TrustedKeys]:
    keys = {n: SigningKey.from_seed(n, n.encode().ljust(32, b".")) for n in names}
    return keys, TrustedKeys.of(keys.values())


def fault_free_digest(cfg: RunConfig) -> str:
    """The final parameters' digest of ``cfg`` run without faults, with no bug planted."""
    return _fault_free(_shape(cfg))[0]


def fault_free_lawa(cfg: RunConfig) -> str:
    """The digest of the LAWA average ``cfg`` publishes without faults ("" without LAWA;
    with streaming fragments, each fragment's, joined by commas: ``lawa_digests``)."""
    return _fault_free(_shape(cfg))[1]


def _shape(cfg: RunConfig) -> str:
    shape = cfg.to_dict()
    shape.pop("run_id")  # names the run; changes no number
    return json.dumps(shape, sort_keys=True)


@functools.lru_cache(maxsize=4096)
def _fault_free(cfg_json: str) -> tuple[str, str]:
    cfg = RunConfig.from_dict(json.loads(cfg_json))
    was = planted.active()
    planted.enable(None)
    try:
        cluster = _cluster(cfg, *initial_parameters(cfg))
        return flat_digest(cluster.run_lockstep()), lawa_digests(cluster)
    finally:
        planted.enable(was)


def lawa_digests(cluster: Cluster) -> str:
    """The LAWA averages the aggregator published (each fragment's, in fragment order),
    by digest, joined by commas; "" while none is."""
    averaged = [a.node.averaged for a in cluster.aggregators]
    return ",".join(a.record.average for a in averaged if a is not None)


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    d = Path(tempfile.mkdtemp(prefix="hypertrain-chaos-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_schedule(seed: int, model: str = TOY_MODEL, trace: bool = False) -> Outcome:
    """Run the fault schedule of ``seed``; never raises for a broken invariant (it is the
    outcome's ``violation``)."""
    rng = random.Random(seed)
    cfg = draw_config(rng, seed, model)
    out = Outcome(seed, config=cfg.to_dict())
    log = out.trace.append if trace else None
    with _scratch() as run_dir:
        try:
            _run(cfg, rng, run_dir, out, log)
        except (Violation, ProtocolFailure, HypertrainError) as e:
            out.violation = f"{type(e).__name__}: {e}"
        except Exception as e:  # a crash of the code under test is a finding too
            where = traceback.extract_tb(e.__traceback__)[-1]
            out.violation = (
                f"unexpected {type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})"
            )
    return out


def _run(
    cfg: RunConfig,
    rng: random.Random,
    run_dir: Path,
    out: Outcome,
    log: Callable[[str], None] | None,
) -> None:
    topo = cfg.topology
    layout, theta0 = initial_parameters(cfg)
    shards = cfg.shards(theta0.numel())
    relay_members = shards.members(topo.regions)  # a region, or its shards "a/0", "a/1"
    # Each node, or with streaming fragments each fragment's part of it ("aggregator.f1")
    parts = [None] if cfg.fragments == 1 else list(range(cfg.fragments))
    relay_names = [Cluster.fragment_name(relay_key(m), f) for f in parts for m in relay_members]
    aggregators = [Cluster.fragment_name("aggregator", f) for f in parts]
    names = [*aggregators, *relay_names, *topo.island_ids()]
    step_times = {i: rng.uniform(*STEP_TIME) for i in topo.island_ids()}
    horizon = cfg.steps * STEP_TIME[1] * 2
    faults = Faults.draw(rng, names, horizon)
    members = {a: relay_members for a in aggregators}
    members.update(
        {
            Cluster.fragment_name(relay_key(m), f): topo.islands_of(shards.split(m)[0])
            for f in parts
            for m in relay_members
        }
    )
    restarts: list[str] = []
    kept = cfg.anneal_kept()
    starts = tuple(s for s in cfg.anneal_starts if s is not None)  # each fragment's
    checker = Checker(
        members,
        on_crash=restarts.append,
        shards=shards,
        standby=cfg.membership.standby,
        anneal=None if kept is None or len(starts) != cfg.fragments else (starts, kept),
    )
    keys, trusted = _keys(tuple(daemon_key_names(topo)))
    keep_rounds = draw_keep_rounds(out.seed)
    out.config["keep_rounds"] = keep_rounds
    cluster = _cluster(
        cfg,
        layout,
        theta0,
        run_dir=run_dir,
        keys=keys,
        trusted=trusted,
        policy=faults,
        observer=checker,
        crash_hook=faults.hook,
        keep_rounds=keep_rounds,
    )
    checker.attach(cluster)
    net = cluster.net
    net.trace = log

    churn = Churn.draw(out.seed, cfg, horizon)
    unstarted: set[str] = set()  # a standby island before its start: no process to kill
    for island in cluster.islands.values():
        if churn.join is None or island.name != churn.join[0]:
            cluster.start_training(island, step_times[island.name])
    if churn.join is not None:  # the standby island starts, and joins, mid-run
        joiner = cluster.islands[churn.join[0]]
        unstarted.add(joiner.name)

        def join() -> None:
            unstarted.discard(joiner.name)
            cluster.start_training(joiner, step_times[joiner.name])

        net.at(churn.join[1], join)
    if churn.leave is not None:  # an island leaves (SIGTERM), and perhaps comes back
        leaver = cluster.islands[churn.leave[0]]
        net.at(churn.leave[1], leaver.leave)
        if churn.back is not None:  # started again once it has stopped
            restart = _restart(cluster, leaver.name, log, step_times)

            def back() -> None:
                if leaver.alive:
                    net.at(net.now + 1.0, back)
                else:
                    restart()

            net.at(churn.back, back)

    def kill(victim: Actor) -> None:
        if victim.name not in unstarted:
            victim.crash()

    for _ in range(rng.randrange(0, 4)):  # crashes between events
        victim = cluster.actors[rng.choice(names)]
        net.at(rng.uniform(0, horizon), functools.partial(kill, victim))

    def after_event() -> None:
        for name in restarts:  # every crash (between events or at a crash point) restarts later
            net.at(net.now + rng.uniform(0.5, 20.0), _restart(cluster, name, log, step_times))
            out.crashes += 1
            if log:
                log(f"t={net.now:.2f} crash {name}")
        restarts.clear()
        checker.after_event()

    try:
        out.events = cluster.drive(MAX_EVENTS, after_event)
    except ProtocolFailure as e:
        out.events = net.events
        if str(e).startswith("stuck"):
            raise Violation(str(e)) from None
        raise
    if log:
        for c in faults.crashes_at_points:
            log(f"crash point: {c}")
    final = flat_digest(cluster.final_theta())
    # Absences the checker did not see (a merge redone by a recovery is not observed)
    # are in the machines, which rebuilt them from their tapes.
    levels = [a.node.machine.level for a in cluster.aggregators]
    levels += [r.node.machine.level for r in cluster.relays.values()]
    if not checker.absences and any(lv.absent_at or lv.skipped for lv in levels):
        checker.absences = 1
    out.changes = sum(len(lv.changes) for lv in levels)
    # A join or leave changes who trains what: only a run without either (and without
    # absences) must end where the fault-free run does.
    if not checker.absences and not out.changes and not cfg.membership.standby:
        want = fault_free_digest(cfg)
        if final != want:
            raise Violation(f"final digest {final[:16]} != the fault-free run's {want[:16]}")
        if (got := lawa_digests(cluster)) != (want := fault_free_lawa(cfg)):
            raise Violation(
                f"LAWA average {got[:16] or 'none'} != the fault-free run's {want[:16]}"
            )
    out.absences = checker.absences
    for island in cluster.islands.values():  # every process stops: the tapes close
        island.alive = False
    for relay in cluster.relays.values():
        if not relay.alive:  # killed after the run needed it (a region an anneal left):
            relay.restart()  # its supervisor starts it once more; it resumes from its tape
    nodes = [(a.name, a) for a in cluster.aggregators] + list(cluster.relays.items())
    for name, actor in nodes:  # every node restarted after its last crash swept its folder
        store = actor.node.store if actor.alive else None
        if store is not None and (left := store.leftovers()):
            raise Violation(f"{name}: what a crash left is still there: {[p.name for p in left]}")
    for _, actor in nodes:
        if actor.alive:
            actor.node.close()
    relays = {m: run_dir / relay_key(m) for m in sorted(relay_members)}
    auditor = Auditor(RunLayout(cfg, run_dir / "aggregator", relays), trusted)
    # Nodes that prune keep their newest rounds: the run is audited from the oldest kept.
    start = auditor.pruned_from() if keep_rounds else None
    try:
        auditor.run(start)
    except AuditError as e:
        raise Violation(f"audit failed: {e}") from None


def _restart(
    cluster: Cluster,
    name: str,
    log: Callable[[str], None] | None,
    step_times: dict[str, float],
) -> Callable[[], None]:
    actor = cluster.actors[name]
    net = cluster.net

    def restart() -> None:
        if actor.alive:  # already started again (a leaver brought back after its crash)
            return
        if log:
            log(f"t={net.now:.2f} restart {name}")
        actor.restart()
        if isinstance(actor, IslandActor) and actor.alive:  # trains again from its saved state
            cluster.start_training(actor, step_times[name])

    return restart


@dataclass
class Summary:
    schedules: int = 0
    events: int = 0
    crashes: int = 0
    violations: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    with_absences: int = 0
    """Schedules in which some step went ahead without a member."""
    with_changes: int = 0
    """Schedules in which an island joined or left."""

    def line(self) -> str:
        return (
            f"{self.schedules} schedules ({self.with_absences} with absent members, "
            f"{self.with_changes} with joins or leaves), "
            f"{self.events} events, {len(self.violations)} invariant violations"
        )


def _one(args: tuple[int, str, str | None]) -> Outcome:
    seed, model, bug = args
    torch.set_num_threads(1)
    planted.enable(bug)
    return run_schedule(seed, model)


def run_seeds(
    seeds: range,
    model: str = TOY_MODEL,
    processes: int = 2,
    plant: str | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> Summary:
    """Run every seed of ``seeds`` (on ``processes`` workers); ``plant`` turns on a bug."""
    s = Summary()
    t0 = time.perf_counter()
    jobs = [(seed, model, plant) for seed in seeds]
    if processes <= 1:
        results: Iterator[Outcome] = map(_one, jobs)
        pool = None
    else:
        pool = get_context("forkserver").Pool(processes)
        results = pool.imap(_one, jobs, chunksize=8)
    try:
        for o in results:
            s.schedules += 1
            s.events += o.events
            s.crashes += o.crashes
            s.with_absences += o.absences > 0
            s.with_changes += o.changes > 0
            if o.violation is not None:
                s.violations.append(o)
            if on_outcome is not None:
                on_outcome(o)
    finally:
        if pool is not None:
            pool.terminate()
    s.seconds = time.perf_counter() - t0
    return s
