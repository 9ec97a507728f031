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
from hypertrain.common.rounds.local import Cluster, Crash
from hypertrain.common.rounds.machines import AggregatorMachine, RelayMachine
from hypertrain.common.rounds.node import AggregatorNode, RelayNode
from hypertrain.common.rounds.replay import (
    AggregatorReplay,
    PublishedFolder,
    RelayReplay,
    ReplayError,
)
from hypertrain.common.rounds.store import NodeStore
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, daemon_key_names
from hypertrain.common.trust.ledger import flat_digest, outer_state_digest
from hypertrain.common.trust.tape import TapeWriter, verify_tape
from tests.unit.toycluster import CrashHook, crash_at, drive, toy_cluster

CFG = RunConfig.from_dict(
    {
        "model": "toy",
        "steps": 12,
        "topology": {"regions": ["a", "b"], "islands_per_region": 2, "h_r": 2, "h_g": 4, "tau": 1},
    }
)
KEYS = {n: SigningKey.generate(n) for n in daemon_key_names(CFG.topology)}
TRUSTED = TrustedKeys.of(KEYS.values())


def _cluster(run_dir: Path | None, crash: CrashHook | None = None) -> Cluster:
    return toy_cluster(CFG, run_dir, KEYS, TRUSTED, crash)


def _run(cluster: Cluster) -> torch.Tensor:
    return drive(cluster).final_theta()


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
    "before_seal",
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
    cluster = _cluster(tmp_path, crash_at(point, nth, fired))
    assert flat_digest(_run(cluster)) == reference
    assert fired, f"{point} was never passed {nth} times"


def test_every_tape_starts_with_its_genesis_and_a_node_keeps_to_it(tmp_path: Path) -> None:
    """The aggregator's tape opens with the run's configuration, each relay's with its
    digest and member; a node will not resume a tape started under another configuration
    (or as another member, or pinning another run CA)."""
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
        (lambda st: AggregatorNode(CFG, theta0, st, TRUSTED, "ab" * 32), "aggregator", "another ca"),
        (lambda st: RelayNode(CFG, "a", theta0, st, TRUSTED, ca="ab" * 32), "relay-a", "another ca"),
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


def _tapes(run_dir: Path) -> dict[str, list[tuple[str, dict]]]:  # type: ignore[type-arg]
    return {
        d.name: [(e.kind, e.body) for e in verify_tape(d / "tape", TRUSTED).entries]
        for d in sorted(run_dir.iterdir())
        if (d / "tape").is_file()
    }


def _all_sealed(run_dir: Path) -> None:
    """Each merge entry (and a relay's forward) is followed by a signed checkpoint, the
    receipt it is served with (a relay's forward comes between its last regional merge of
    a round and the seal); a checkpoint never follows a checkpoint."""
    for name, entries in _tapes(run_dir).items():
        kinds = [k for k, _ in entries]
        for i, kind in enumerate(kinds):
            if kind in ("regional_merge", "forward", "global_merge"):
                after = [k for k in kinds[i + 1 :] if k != "forward"]
                assert after[:1] == ["checkpoint"], (name, i, kind)
            if kind == "checkpoint":
                assert kinds[i - 1] != "checkpoint", (name, i)


def test_every_merge_is_sealed_and_a_crash_before_a_seal_is_sealed_on_restart(
    tmp_path: Path, reference: str
) -> None:
    """Every merge is sealed before it is served; a node killed between a merge's entry
    and its seal seals on restart, and its members' receipts agree with the tapes."""
    from hypertrain.common.trust.audit import audit_run
    from hypertrain.up import config_toml

    clean = tmp_path / "clean"
    _run(_cluster(clean))
    _all_sealed(clean)
    fired: list[str] = []

    def hook(name: str) -> Callable[[str], None]:
        def crash(p: str) -> None:
            if p == "before_seal" and name not in fired:
                fired.append(name)
                raise Crash(f"{name} at {p}")

        return crash

    crashed = tmp_path / "crashed"
    assert flat_digest(_run(_cluster(crashed, hook))) == reference
    assert sorted(fired) == ["aggregator", "relay-a", "relay-b"]
    _all_sealed(crashed)
    (crashed / "run.toml").write_text(config_toml(CFG))
    report = audit_run(crashed, TRUSTED)
    assert report.complete and report.receipts > 0


def test_islands_keep_the_receipts_of_every_merge_and_the_audit_checks_them(
    tmp_path: Path,
) -> None:
    """Every island keeps, with each merge it applied, its relay's signed head (and with a
    global merge the aggregator's); the relays keep the aggregator's; all agree with the
    tapes."""
    from hypertrain.common.trust.audit import audit_run
    from hypertrain.common.trust.receipts import read_receipts
    from hypertrain.up import config_toml

    _run(_cluster(tmp_path))
    (tmp_path / "run.toml").write_text(config_toml(CFG))
    kept = 0
    for island in CFG.topology.island_ids():
        lines = read_receipts(tmp_path / f"island-{island}" / "receipts")
        relay = f"relay-{CFG.topology.region_of(island)}"
        by_step: dict[int, list[str]] = {}
        for r in lines:
            assert r.holder == f"island-{island}"
            by_step.setdefault(r.step, []).append(r.signer)
        sync_steps = range(CFG.topology.h_r, CFG.steps + 1, CFG.topology.h_r)
        assert sorted(by_step) == list(sync_steps)
        for step, signers in by_step.items():
            want = ["aggregator", relay] if step % CFG.topology.h_g == 0 else [relay]
            assert signers == want, (island, step)
        kept += len(lines)
    for region in CFG.topology.regions:
        lines = read_receipts(tmp_path / f"relay-{region}" / "receipts")
        assert {r.signer for r in lines} == {"aggregator"}
        assert sorted(r.step for r in lines) == list(
            range(CFG.topology.h_g, CFG.steps + 1, CFG.topology.h_g)
        )
        kept += len(lines)
    report = audit_run(tmp_path, TRUSTED)
    assert report.complete and report.receipts == kept
