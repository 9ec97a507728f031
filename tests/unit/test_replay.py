"""Machines own their history: a node's tape and published inputs rebuild its machine exactly,
a changed record is named by the replay, and a node killed at any of its crash points
resumes from its folder to the same result (the toy model, real files, no sockets)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import ConfigError
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.local import Cluster, Crash, IslandActor, Observer
from hypertrain.common.rounds.machines import AggregatorMachine, RelayMachine
from hypertrain.common.rounds.node import AggregatorNode, RelayNode
from hypertrain.common.rounds.replay import (
    AggregatorReplay,
    PublishedFolder,
    RelayReplay,
    ReplayError,
)
from hypertrain.common.rounds.store import NodeStore
from hypertrain.common.toy import ToyIsland
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, daemon_key_names
from hypertrain.common.trust.ledger import flat_digest, outer_state_digest
from hypertrain.common.trust.tape import TapeWriter, verify_tape

CFG = RunConfig.from_dict(
    {
        "model": "toy",
        "steps": 12,
        "topology": {"regions": ["a", "b"], "islands_per_region": 2, "h_r": 2, "h_g": 4, "tau": 1},
    }
)
KEYS = {n: SigningKey.generate(n) for n in daemon_key_names(CFG.topology)}
TRUSTED = TrustedKeys.of(KEYS.values())


class _Restarter(Observer):
    """Restarts a crashed process one virtual second later, from its folder."""

    cluster: Cluster

    def crashed(self, name: str) -> None:
        net, actor = self.cluster.net, self.cluster.actors[name]

        def restart() -> None:
            actor.restart()
            if isinstance(actor, IslandActor) and actor.alive:
                self.cluster.start_training(actor, 1.0)

        net.at(net.now + 1.0, restart)


def _cluster(
    run_dir: Path | None, crash: Callable[[str], Callable[[str], None]] | None = None
) -> Cluster:
    _, theta0 = initial_parameters(CFG)
    kw = {} if crash is None else {"crash_hook": crash}
    restarter = _Restarter()
    cluster = Cluster(
        CFG,
        theta0,
        lambda i: ToyIsland(CFG, i, theta0),
        run_dir=run_dir,
        keys=KEYS if run_dir else {},
        trusted=TRUSTED if run_dir else None,
        observer=restarter,
        **kw,  # type: ignore[arg-type]
    )
    restarter.cluster = cluster
    return cluster


def _run(cluster: Cluster) -> torch.Tensor:
    for island in cluster.islands.values():
        cluster.start_training(island, 1.0)
    cluster.drive(100_000)
    return cluster.final_theta()


@pytest.fixture(scope="module")
def reference() -> str:
    return flat_digest(_run(_cluster(None)))


def test_a_tape_rebuilds_its_machine_exactly(tmp_path: Path, reference: str) -> None:
    cluster = _cluster(tmp_path)
    assert flat_digest(_run(cluster)) == reference  # tapes and stores change no number
    _, theta0 = initial_parameters(CFG)
    for region in ("a", "b"):
        live = cluster.relays[f"relay-{region}"].node.machine
        folder = tmp_path / f"relay-{region}"
        entries = verify_tape(folder / "tape", TRUSTED).entries
        again = RelayMachine(CFG, region, theta0, TRUSTED)
        replay = RelayReplay(again, entries, PublishedFolder(folder / "published"))
        agg = AggregatorMachine(CFG, theta0, TRUSTED)
        agg_replay = AggregatorReplay(
            agg, verify_tape(tmp_path / "aggregator" / "tape", TRUSTED).entries,
            PublishedFolder(tmp_path / "aggregator" / "published"),
        )  # fmt: skip
        while (step := replay.advance()) is not None:
            merge = agg_replay.advance(step)
            assert merge is not None
            from hypertrain.common.rounds.machines import GlobalArrived

            replay.apply_global(GlobalArrived(step, merge.payload, merge.commitment))
        assert flat_digest(again.core.base) == flat_digest(live.core.base)
        assert flat_digest(again.core.feedback.residual) == flat_digest(live.core.feedback.residual)
        assert again.level.accepted == live.level.accepted
        assert again.level.open_step == live.level.open_step and again.done and live.done
    live_agg = cluster.aggregator.node.machine
    assert flat_digest(agg.core.theta) == flat_digest(live_agg.core.theta) == reference
    assert outer_state_digest(agg.core.outer.state_dict()) == outer_state_digest(
        live_agg.core.outer.state_dict()
    )


def test_a_changed_record_is_named_by_the_replay(tmp_path: Path) -> None:
    _run(_cluster(tmp_path))
    folder = tmp_path / "relay-a"
    entries = verify_tape(folder / "tape", TRUSTED).entries
    forged = tmp_path / "forged"
    with TapeWriter.open(forged, CFG.run_id, KEYS["relay-a"], checkpoint_every=0, sync=False) as w:
        done = False
        for e in entries:
            body = dict(e.body)
            if e.kind == "regional_merge" and not done:
                body["post_base"], done = "0" * 64, True
            if e.kind != "checkpoint":
                w.append(e.kind, body)
    _, theta0 = initial_parameters(CFG)
    replay = RelayReplay(
        RelayMachine(CFG, "a", theta0, TRUSTED),
        verify_tape(forged, TRUSTED).entries,
        PublishedFolder(folder / "published"),
    )
    with pytest.raises(ReplayError, match="recomputed post_base differs") as err:
        replay.advance()
    assert err.value.entry is not None and err.value.entry.kind == "regional_merge"


POINTS = [
    "after_publish",
    "relay_before_merge_entry",
    "relay_after_forward_entry",
    "relay_after_checkpoint",
    "before_tape",
    "after_tape",
    "between_checkpoints",
    "mid_write",
    "before_rename",
]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("nth", [1, 3])
def test_a_node_killed_at_a_crash_point_resumes_from_its_folder(
    tmp_path: Path, reference: str, point: str, nth: int
) -> None:
    """Each node dies the ``nth`` time it passes ``point`` (between two of its durable writes),
    is restarted from its folder, and the run ends on the fault-free digest."""
    fired: list[str] = []
    seen: dict[str, int] = {}

    def hook(name: str) -> Callable[[str], None]:
        def crash(p: str) -> None:
            if p == point:
                seen[name] = seen.get(name, 0) + 1
                if seen[name] == nth:
                    fired.append(name)
                    raise Crash(f"{name} at {p}")

        return crash

    cluster = _cluster(tmp_path, hook)
    assert flat_digest(_run(cluster)) == reference
    assert fired, f"{point} was never passed {nth} times"


def test_every_tape_starts_with_its_genesis_and_a_node_keeps_to_it(tmp_path: Path) -> None:
    """The aggregator's tape opens with the run's configuration, each relay's with its
    digest and member; a node will not resume a tape started under another configuration
    (or as another member)."""
    run_dir = tmp_path / "run"
    cluster = _cluster(run_dir)
    _run(cluster)
    for actor in (cluster.aggregator, *cluster.relays.values()):
        assert actor.node.store is not None
        actor.node.store.close()  # the tapes' locks
    first = verify_tape(run_dir / "aggregator" / "tape", TRUSTED).entries[0]
    assert first.seq == 0 and first.kind == "genesis"
    assert json.loads(first.body["config"]) == CFG.to_dict()
    assert first.body["config_digest"] == CFG.digest
    assert first.body["keys"] == {k.name: k.key_id for k in KEYS.values()}
    relay = verify_tape(run_dir / "relay-a" / "tape", TRUSTED).entries[0]
    assert relay.kind == "genesis" and relay.body["member"] == "a"
    assert relay.body["config_digest"] == CFG.digest and "config" not in relay.body

    other = RunConfig.from_dict({**CFG.to_dict(), "outer": {"name": "nesterov", "eta": 0.5}})
    _, theta0 = initial_parameters(other)
    cases: list[tuple[Callable[[NodeStore], object], str, str]] = [
        (lambda st: RelayNode(other, "a", theta0, st, TRUSTED), "relay-a", "another config_digest"),
        (lambda st: RelayNode(CFG, "b", theta0, st, TRUSTED), "relay-a", "another member"),
        (lambda st: AggregatorNode(other, theta0, st, TRUSTED), "aggregator", "another config_digest"),
    ]  # fmt: skip
    for make, name, words in cases:
        store = NodeStore(run_dir / name, CFG.run_id, KEYS[name], sync=False)
        try:
            with pytest.raises(ConfigError, match=f"was not started by this .*{words}"):
                make(store)
        finally:
            store.close()
    store = NodeStore(run_dir / "aggregator", CFG.run_id, KEYS["aggregator"], sync=False)
    AggregatorNode(CFG, theta0, store, TRUSTED)  # the same configuration resumes
    store.close()
