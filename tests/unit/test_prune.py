"""Bounded state folders: a node run with ``keep_rounds`` (the daemons' ``--keep-rounds``)
keeps the checkpoints and published inputs of its newest global rounds, changes no number,
resumes from what it kept at every crash point of its pruning, and its run is audited from
the oldest round kept (the toy model, real files, no sockets)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from hypertrain.cli import main
from hypertrain.common.config import RunConfig
from hypertrain.common.errors import ConfigError
from hypertrain.common.rounds.store import (
    MIN_KEEP_ROUNDS,
    PRUNED_FILE,
    TRASH_DIR,
    NodeStore,
    Pruned,
    Swept,
    atomic_save,
    checkpoint_path,
    checkpoints_of,
)
from hypertrain.common.settings import AggregatorSettings, IslandSettings, RelaySettings
from hypertrain.common.trust.audit import (
    AuditError,
    Auditor,
    RunLayout,
    audit_run,
    parse_rounds,
    round_arg,
)
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, daemon_key_names
from hypertrain.common.trust.ledger import flat_digest
from hypertrain.common.trust.schema import InputEntry, parse
from hypertrain.common.trust.tape import verify_tape
from hypertrain.up import config_toml
from tests.unit.toycluster import CrashHook, crash_at, drive, toy_cluster

CFG = RunConfig.from_dict(
    {
        "model": "toy",
        "steps": 24,  # 6 global rounds
        "topology": {"regions": ["a", "b"], "islands_per_region": 2, "h_r": 2, "h_g": 4, "tau": 1},
    }
)
KEYS = {n: SigningKey.generate(n) for n in daemon_key_names(CFG.topology)}
TRUSTED = TrustedKeys.of(KEYS.values())
NODES = ("aggregator", "relay-a", "relay-b")


def _run(run_dir: Path | None, keep: int = 0, crash: CrashHook | None = None) -> torch.Tensor:
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run.toml").write_text(config_toml(CFG))
    cluster = toy_cluster(CFG, run_dir, KEYS, TRUSTED, crash, keep_rounds=keep)
    theta = drive(cluster).final_theta()
    for actor in (*cluster.aggregators, *cluster.relays.values()):
        if actor.alive and actor.node.store is not None:
            actor.node.store.close()
    return theta


@pytest.fixture(scope="module")
def reference() -> str:
    return flat_digest(_run(None))


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("pruned")
    return run_dir, flat_digest(_run(run_dir, keep=2))


def _rounds(folder: Path) -> list[int]:
    return list(checkpoints_of(folder))


def test_a_pruning_node_keeps_its_newest_rounds_and_changes_no_number(
    pruned: tuple[Path, str], reference: str
) -> None:
    run_dir, digest = pruned
    assert digest == reference
    for node in NODES:
        folder = run_dir / node
        assert _rounds(folder) == [4, 5], node  # the run's last two global rounds
        assert json.loads((folder / PRUNED_FILE).read_text()) == {"kept_from_round": 4}
        # published: exactly the inputs taped after the oldest kept round's checkpoint
        start = torch.load(folder / "checkpoints" / "round-000004.pt", weights_only=True)
        entries = verify_tape(folder / "tape", TRUSTED).entries
        taped = [parse(e) for e in entries]
        wanted = {r.digest for r in taped[start["tape_seq"] :] if isinstance(r, InputEntry)}
        assert wanted and {p.name for p in (folder / "published").iterdir()} == wanted, node
        assert len({r.digest for r in taped if isinstance(r, InputEntry)}) > len(wanted)


def test_a_pruned_run_is_audited_from_its_oldest_kept_round(pruned: tuple[Path, str]) -> None:
    run_dir, _ = pruned
    with pytest.raises(AuditError, match=r"pruned their oldest rounds.*--from-round 4"):
        audit_run(run_dir, TRUSTED)
    layout = RunLayout.of(run_dir)
    assert Auditor(layout, TRUSTED).pruned_from() == 4
    report = audit_run(run_dir, TRUSTED, from_round=4)
    assert report.segment and report.first_round == 5 and report.last_round == 5
    assert report.final_digest  # the state digest of the run's final parameters
    with pytest.raises(AuditError, match="no aggregator checkpoint for round 3"):
        audit_run(run_dir, TRUSTED, from_round=3)


def test_a_run_that_keeps_everything_is_not_pruned(tmp_path: Path, reference: str) -> None:
    assert flat_digest(_run(tmp_path)) == reference
    for node in NODES:
        assert _rounds(tmp_path / node) == list(range(6))
        assert not (tmp_path / node / PRUNED_FILE).exists()
    assert Auditor(RunLayout.of(tmp_path), TRUSTED).pruned_from() is None
    audit_run(tmp_path, TRUSTED)


@pytest.mark.parametrize("point", ["prune_marked", "prune_mid"])
@pytest.mark.parametrize("nth", [1, 2])
def test_a_node_killed_while_it_prunes_resumes_and_its_run_audits(
    tmp_path: Path, reference: str, point: str, nth: int
) -> None:
    """Each node dies the ``nth`` time it passes ``point`` (after the marker; between
    deleting checkpoints and inputs), restarts from what it kept, and the run ends on the
    fault-free digest and audits from its oldest kept round."""
    fired: list[str] = []
    assert flat_digest(_run(tmp_path, keep=2, crash=crash_at(point, nth, fired))) == reference
    assert sorted(fired) == sorted(NODES)
    start = Auditor(RunLayout.of(tmp_path), TRUSTED).pruned_from()
    assert start == 4
    audit_run(tmp_path, TRUSTED, from_round=start)


SPLIT = RunConfig.from_dict({**CFG.to_dict(), "fragments": 2})
"""CFG in two streaming fragments: fragment 1's first round is a partial one, so it
ends the run with one round more than fragment 0."""


def _run_split(run_dir: Path, keep: int) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.toml").write_text(config_toml(SPLIT))
    cluster = toy_cluster(SPLIT, run_dir, KEYS, TRUSTED, keep_rounds=keep)
    digest = flat_digest(drive(cluster).final_theta())
    for actor in (*cluster.aggregators, *cluster.relays.values()):
        actor.node.close()
    return digest


def test_a_pruned_run_in_streaming_fragments_is_audited_from_each_ones_kept_rounds(
    tmp_path: Path, pruned: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each fragment's nodes prune their own rounds; the whole audit names a round per
    fragment to start from, and the segment audit from them ends on the whole run's
    final state."""
    whole = _run_split(tmp_path / "whole", keep=0)
    assert _run_split(tmp_path / "pruned", keep=2) == whole
    want = audit_run(tmp_path / "whole", TRUSTED)
    run_dir = tmp_path / "pruned"
    kept = [_rounds(run_dir / "aggregator" / f"fragment-{f}") for f in range(2)]
    assert kept == [[4, 5], [5, 6]]
    assert Auditor(RunLayout.of(run_dir), TRUSTED).pruned_from() == (4, 5)
    with pytest.raises(
        AuditError, match=r"aggregator/fragment-0.*rounds 4,5 \(one per .*--from-round 4,5`"
    ):
        audit_run(run_dir, TRUSTED)
    report = audit_run(run_dir, TRUSTED, from_round=(4, 5))
    assert report.segment and report.complete and report.fragments == 2
    assert report.starts == (4, 5) and "(fragments from rounds 4,5)" in report.summary()
    assert report.final_digest == want.final_digest
    # One round for every fragment: fragment 1's round 4 is gone.
    with pytest.raises(AuditError, match="no aggregator checkpoint for round 4"):
        audit_run(run_dir, TRUSTED, from_round=4)
    with pytest.raises(AuditError, match=r"3 rounds to start from \(4,5,-\).*2 streaming"):
        audit_run(run_dir, TRUSTED, from_round=(4, 5, None))
    with pytest.raises(AuditError, match=r"\(3,4\), and the run is not split .*: name one round"):
        audit_run(pruned[0], TRUSTED, from_round=(3, 4))  # CFG, not split
    # The command line takes the rounds as the hint names them.
    keys = run_dir / "trusted_keys.json"
    keys.write_text(json.dumps(TRUSTED.to_json()))
    cli = ["audit", str(run_dir), "--trusted-keys", str(keys)]
    assert main([*cli, "--from-round", "4,5"]) == 0
    assert "fragments from rounds 4,5" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main([*cli, "--from-round", "4,x"])
    assert exit_.value.code == 2 and "'4,x': a global round" in capsys.readouterr().err
    # A fragment whose nodes did not prune is replayed whole ("-").
    report = audit_run(tmp_path / "whole", TRUSTED, from_round=(None, 5))
    assert report.segment and report.starts == (None, 5)
    assert report.final_digest == want.final_digest


@pytest.mark.parametrize(
    ("text", "rounds"), [("4", 4), ("4,5", (4, 5)), ("-, 3", (None, 3)), ("-", None)]
)
def test_from_round_takes_a_round_or_one_per_fragment(text: str, rounds: object) -> None:
    assert parse_rounds(text) == rounds
    assert parse_rounds(round_arg(rounds)) == rounds  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "why"), [("x", "a global round"), ("3,-2", "0 or more")])
def test_a_bad_from_round_is_refused_naming_it(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_rounds(text)


def _store(folder: Path, keep: int, seen: list[Pruned]) -> NodeStore:
    return NodeStore(folder, "run", KEYS["aggregator"], keep_rounds=keep, on_prune=seen.append)


def _round(store: NodeStore, r: int, inputs: list[bytes]) -> None:
    """Tape and publish ``inputs`` for round ``r``, then its checkpoint after them."""
    from hypertrain.common.aggregate import blob_digest

    for i, data in enumerate(inputs):
        digest = blob_digest(data)
        store.publish(digest, data)
        store.record(InputEntry(round=r, sync_step=r, sender=f"s{i}", digest=digest,
                                size=len(data), codec="fp32", signature=""))  # fmt: skip
    seq, head = store.tape_position
    atomic_save(checkpoint_path(store.folder, r), {"tape_seq": seq, "tape_head": head})


def test_prune_deletes_only_what_no_kept_round_refers_to(tmp_path: Path) -> None:
    from hypertrain.common.aggregate import blob_digest

    seen: list[Pruned] = []
    store = _store(tmp_path, 2, seen)
    _round(store, 0, [b"old", b"again"])
    _round(store, 1, [b"one"])
    assert store.prune() is None and not seen  # two rounds: nothing to delete
    _round(store, 2, [b"two", b"again"])  # "again" is taped once more, after round 1
    store.publish(blob_digest(b"untaped"), b"untaped")  # accepted, not taped yet
    got = store.prune()
    assert got == seen[-1] and got is not None
    # Kept: round 1's checkpoint and what is taped after it; round 1's own inputs come
    # before it (a restart from it does not replay them), so they go with round 0's.
    assert (got.kept_from, got.checkpoints, got.inputs, got.error) == (1, 1, 2, "")
    assert got.bytes > len(b"old") + len(b"one")
    assert [p.name for p in checkpoints_of(tmp_path).values()] == [
        "round-000001.pt",
        "round-000002.pt",
    ]
    left = {p.name for p in store.published.iterdir()}
    assert left == {blob_digest(d) for d in (b"again", b"two", b"untaped")}
    assert store.pruned_from() == 1
    store.close()


def test_a_file_that_cannot_be_deleted_is_reported_and_deleted_next_time(tmp_path: Path) -> None:
    from hypertrain.common.aggregate import blob_digest

    seen: list[Pruned] = []
    store = _store(tmp_path, 2, seen)
    _round(store, 0, [b"old"])
    _round(store, 1, [b"one"])
    _round(store, 2, [b"two"])
    stuck = store.published / blob_digest(b"old")
    stuck.unlink()
    stuck.mkdir()  # unlink() of a folder fails: the input stays, the error is said
    (stuck / "x").write_bytes(b"")
    got = store.prune()
    assert got is not None and "IsADirectoryError" in got.error and got.checkpoints == 1
    assert seen == [got]  # reported, not raised: the round is durable either way
    (stuck / "x").unlink()
    stuck.rmdir()
    stuck.write_bytes(b"old")
    _round(store, 3, [b"three"])
    again = store.prune()
    assert again is not None and again.error == "" and again.checkpoints == 1
    assert {p.name for p in store.published.iterdir()} == {blob_digest(b"three")}
    store.close()


def _three_rounds(folder: Path, seen: list[Pruned], sync: bool = True) -> NodeStore:
    """A store that keeps 2 rounds and holds three (one to prune: a checkpoint and two
    inputs, round 1's own being taped before its checkpoint)."""
    store = NodeStore(
        folder, "run", KEYS["aggregator"], keep_rounds=2, on_prune=seen.append, sync=sync
    )
    for r in range(3):
        _round(store, r, [f"input {r}".encode()])
    return store


def _gone(folder: Path) -> list[str]:
    """What a prune of ``_three_rounds`` takes away, as the trash names it."""
    from hypertrain.common.aggregate import blob_digest

    return sorted(
        ["checkpoints-round-000000.pt"]
        + [f"published-{blob_digest(f'input {r}'.encode())}" for r in (0, 1)]
    )


def test_a_prune_moves_the_files_to_the_trash_and_a_thread_deletes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the driver's lock a prune only renames (a model-sized unlink frees its pages
    and extents, 0.1 s per 400 MB); the deleting is done on the store's own thread."""
    import hypertrain.common.rounds.store as store_module

    release, ran_on = threading.Event(), []
    empty = store_module.empty_trash

    def held(trash: Path) -> list[str]:
        ran_on.append(threading.current_thread())
        release.wait(10)
        return empty(trash)

    monkeypatch.setattr(store_module, "empty_trash", held)
    seen: list[Pruned] = []
    store = _three_rounds(tmp_path, seen)
    got = store.prune()
    assert got is not None and (got.checkpoints, got.inputs, got.error) == (1, 2, "")
    assert not checkpoint_path(tmp_path, 0).exists()  # gone from its place at once
    assert sorted(p.name for p in store.trash.iterdir()) == _gone(tmp_path)  # not deleted yet
    release.set()
    store.wait_trash()
    assert list(store.trash.iterdir()) == []
    assert ran_on and all(t is not threading.current_thread() for t in ran_on)
    store.close()


def test_close_waits_for_the_trash_to_be_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hypertrain.common.rounds.store as store_module

    empty = store_module.empty_trash

    def slow(trash: Path) -> list[str]:
        time.sleep(0.3)
        return empty(trash)

    monkeypatch.setattr(store_module, "empty_trash", slow)
    store = _three_rounds(tmp_path, [])
    assert store.prune() is not None
    store.close()
    assert list(store.trash.iterdir()) == []


def test_a_store_that_does_not_fsync_empties_the_trash_on_its_own_thread(tmp_path: Path) -> None:
    """The fault simulation's stores (``sync=False``) start no thread: the trash is
    emptied before the prune returns."""
    store = _three_rounds(tmp_path, [], sync=False)
    got = store.prune()
    assert got is not None and got.checkpoints == 1
    assert list(store.trash.iterdir()) == [] and store._deleter is None
    store.close()


def test_a_prune_makes_a_removed_trash_again(tmp_path: Path) -> None:
    """An operator who deleted ``trash/`` (it is never state) does not stop the pruning."""
    seen: list[Pruned] = []
    store = _three_rounds(tmp_path, seen)
    shutil.rmtree(store.trash)
    got = store.prune()
    assert got is not None and (got.checkpoints, got.inputs, got.error) == (1, 2, "")
    assert not checkpoint_path(tmp_path, 0).exists()
    store.wait_trash()
    assert list(store.trash.iterdir()) == []
    store.close()


@pytest.mark.parametrize("sync", [True, False])
def test_what_a_stopped_prune_left_in_the_trash_is_deleted_when_the_store_opens(
    tmp_path: Path, sync: bool
) -> None:
    trash = tmp_path / TRASH_DIR
    trash.mkdir(parents=True)
    (trash / "checkpoints-round-000000.pt").write_bytes(b"x" * 4096)
    (trash / ("published-" + "0" * 64)).write_bytes(b"y")
    (trash / "odd-folder").mkdir()
    (trash / "odd-folder" / "z").write_bytes(b"z")
    store = NodeStore(tmp_path, "run", KEYS["aggregator"], keep_rounds=2, sync=sync)
    store.wait_trash()
    assert list(trash.iterdir()) == []
    store.close()


def test_a_sweep_takes_what_a_process_that_died_mid_write_left(tmp_path: Path) -> None:
    """Temp files of interrupted atomic writes (a checkpoint's is the state's size) and an
    input published but never taped are not state: a taped store's sweep moves them to
    the trash, says so, and keeps everything else (state files of every kind included)."""
    from hypertrain.common.aggregate import blob_digest

    store = _store(tmp_path, 0, [])
    _round(store, 0, [b"taped"])
    store.publish(blob_digest(b"never taped"), b"never taped")
    store.mark_final("eu/1")
    store.close()
    for name in ("state.pt", "lawa.pt", PRUNED_FILE, "receipts", ".hidden-note"):
        (tmp_path / name).write_bytes(b"state")  # names a sweep must not take
    leftovers = [
        tmp_path / "checkpoints" / ".round-000001.pt.k2j4h1x9",
        tmp_path / "published" / f".{blob_digest(b'x')}.a8s7d6f5",
        tmp_path / "published" / ".incoming-q1w2e3r4.part",
        tmp_path / ".lawa.pt.z9x8c7v6",
        tmp_path / ".state.pt.4242.4243.link",
        tmp_path / f".{PRUNED_FILE}.p0o9i8u7",
    ]
    for i, path in enumerate(leftovers):
        path.write_bytes(b"t" * (100 + i))
    kept = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    swept: list[Swept] = []
    again = NodeStore(tmp_path, "run", KEYS["aggregator"], on_sweep=swept.append)
    assert not swept and all(p.exists() for p in leftovers)  # not at the open: once asked
    got = again.sweep()
    assert list(again.trash.iterdir()) == []  # deleted before it returns
    size = sum(100 + i for i in range(len(leftovers))) + len(b"never taped")
    assert swept == [got] and got == Swept(len(leftovers) + 1, size)
    left = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    gone = {p.relative_to(tmp_path) for p in leftovers}
    gone.add(Path("published") / blob_digest(b"never taped"))
    assert left == [p for p in kept if p not in gone]
    assert (tmp_path / "published" / blob_digest(b"taped")).exists()
    assert checkpoint_path(tmp_path, 0).exists()
    swept.clear()  # nothing is left: the next sweep finds nothing and says nothing
    assert again.sweep() == Swept(0, 0) and swept == []
    again.close()


def test_a_sweep_leaves_untaped_inputs_that_no_crash_explains(tmp_path: Path) -> None:
    """A crash leaves at most one input published without its entry: several, or inputs
    found by a tape that began with this open (a folder written without a key, say),
    stay where they are and are reported."""
    from hypertrain.common.aggregate import blob_digest

    published = tmp_path / "published"
    published.mkdir()
    for data in (b"one", b"two"):  # inputs of a start that kept no tape
        (published / blob_digest(data)).write_bytes(data)
    swept: list[Swept] = []
    store = NodeStore(tmp_path, "run", KEYS["aggregator"], on_sweep=swept.append)
    assert store.sweep() == Swept(0, 0, untaped_kept=2) and len(swept) == 1
    _round(store, 0, [b"taped"])  # this start's own input, taped
    store.close()
    again = NodeStore(tmp_path, "run", KEYS["aggregator"])  # the tape is older now
    assert again.sweep() == Swept(0, 0, untaped_kept=2)  # still more than a crash leaves
    (published / blob_digest(b"two")).unlink()
    got = again.sweep()  # one: a crash's
    assert (got.files, got.untaped_kept) == (1, 0)
    assert [p.name for p in published.iterdir()] == [blob_digest(b"taped")]
    again.close()


def test_a_start_refused_for_its_tape_leaves_the_folder_as_it_was(tmp_path: Path) -> None:
    """A relay whose tape is not the one its folder was written with (moved aside, or an
    older copy restored) is refused before anything is swept: the inputs stay, and once
    the tape is back the run audits."""
    from hypertrain.common.roles import initial_parameters
    from hypertrain.common.rounds.node import RelayNode

    run_dir = tmp_path / "run"
    _run(run_dir)
    relay = run_dir / "relay-a"
    before = sorted(p.name for p in (relay / "published").iterdir())
    (relay / "tape").rename(tmp_path / "tape.aside")
    swept: list[Swept] = []
    store = NodeStore(relay, CFG.run_id, KEYS["relay-a"], on_sweep=swept.append)
    _, theta0 = initial_parameters(CFG)
    with pytest.raises(ConfigError, match="does not contain what"):
        RelayNode(CFG, "a", theta0, store, TRUSTED).recover()
    assert store.tape is not None
    store.tape.close()
    assert swept == [] and sorted(p.name for p in (relay / "published").iterdir()) == before
    (relay / "tape").unlink()
    (tmp_path / "tape.aside").rename(relay / "tape")
    assert audit_run(run_dir, TRUSTED).final_digest


def test_what_a_sweep_cannot_move_stays_and_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hypertrain.wire.daemon import log_swept

    store = _store(tmp_path, 0, [])
    _round(store, 0, [b"taped"])
    store.close()
    temp = tmp_path / "checkpoints" / ".round-000001.pt.k2j4h1x9"
    temp.write_bytes(b"t")
    again = NodeStore(tmp_path, "run", KEYS["aggregator"], on_sweep=log_swept("aggregator", {}))
    again.trash.rmdir()
    again.trash.write_bytes(b"not a folder")
    got = again.sweep()
    assert got.files == 0 and "NotADirectoryError" in got.error and temp.exists()
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("event=warning role=aggregator message=") and "sweeping:" in line
    again.trash.unlink()
    again.trash.mkdir()
    assert again.sweep().files == 1 and not temp.exists()  # tried again, at the next start
    again.close()


def test_a_store_without_a_tape_sweeps_nothing(tmp_path: Path) -> None:
    """Without a tape there is no lock that keeps other processes out, nor a record of
    what was taped: nothing is taken."""
    leftover = tmp_path / "checkpoints" / ".round-000001.pt.k2j4h1x9"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"t")
    (tmp_path / "published").mkdir()
    (tmp_path / "published" / ("ab" * 32)).write_bytes(b"an input")
    store = NodeStore(tmp_path, "run", None)
    assert store.sweep() == Swept(0, 0)
    store.close()
    assert leftover.exists() and (tmp_path / "published" / ("ab" * 32)).exists()


def _three_rounds_with_a_file_for_trash(folder: Path, seen: list[Pruned]) -> NodeStore:
    """``_three_rounds``, and the trash is a file."""
    store = _three_rounds(folder, seen)
    store.trash.rmdir()
    store.trash.write_bytes(b"not a folder")
    return store


def test_a_trash_that_cannot_take_files_is_reported_and_nothing_is_lost(tmp_path: Path) -> None:
    """A prune whose files cannot be moved leaves them where they are and says why; the
    next prune, once the trash is a folder again, takes them."""
    from hypertrain.common.aggregate import blob_digest

    seen: list[Pruned] = []
    store = _three_rounds_with_a_file_for_trash(tmp_path, seen)
    got = store.prune()
    assert got is not None and "NotADirectoryError" in got.error
    assert (got.checkpoints, got.inputs) == (0, 0) and seen == [got]
    assert checkpoint_path(tmp_path, 0).exists()
    assert (store.published / blob_digest(b"input 0")).exists()
    store.trash.unlink()
    store.trash.mkdir()
    _round(store, 3, [b"input 3"])
    again = store.prune()
    assert again is not None and again.error == ""
    assert (again.checkpoints, again.inputs) == (2, 3)
    store.wait_trash()
    assert list(store.trash.iterdir()) == []
    store.close()


def test_what_the_trash_could_not_delete_the_next_prune_reports(tmp_path: Path) -> None:
    seen: list[Pruned] = []
    store = _three_rounds_with_a_file_for_trash(tmp_path, seen)
    store._emptied()  # the thread's work, on a trash it cannot list
    store.trash.unlink()
    store.trash.mkdir()
    got = store.prune()
    assert got is not None and got.error == ""  # the prune itself went through
    assert got.trash_error.startswith(f"emptying {store.trash}: NotADirectoryError")
    assert (got.checkpoints, got.inputs) == (1, 2) and seen == [got]
    store.wait_trash()
    assert list(store.trash.iterdir()) == []
    store.close()


def test_a_daemon_logs_a_prune_and_what_the_trash_could_not_delete(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hypertrain.wire.daemon import log_pruned

    log = log_pruned("relay", {"region": "eu"})
    log(Pruned(3, 1, 2, 1200, trash_error="emptying /s/trash: PermissionError: no"))
    log(Pruned(4, 0, 0, 0, error="IsADirectoryError: x"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("event=warning role=relay region=eu message=")
    assert "emptying /s/trash: PermissionError: no" in lines[0]
    assert lines[1].startswith(
        "event=pruned role=relay region=eu kept_from_round=3 checkpoints=1 inputs=2 bytes=1200"
    )
    assert "pruning rounds before 4 stopped short: IsADirectoryError: x" in lines[2]
    assert len(lines) == 3


@pytest.mark.parametrize("cls", [RelaySettings, AggregatorSettings])
def test_keep_rounds_below_the_minimum_is_refused_naming_it(cls: type[RelaySettings]) -> None:
    assert cls(keep_rounds=0).keep_rounds == 0
    assert cls(keep_rounds=MIN_KEEP_ROUNDS).keep_rounds == MIN_KEEP_ROUNDS
    with pytest.raises(ConfigError, match=rf"{cls.TABLE}: keep_rounds must be 0 .* got 1"):
        cls(keep_rounds=1)
    with pytest.raises(ConfigError, match="got -1"):
        cls.resolve({"keep_rounds": -1})
    with pytest.raises(ConfigError, match="keep_rounds must be 0"):
        NodeStore(Path("/nonexistent"), "run", None, keep_rounds=1)


def test_an_island_has_no_keep_rounds() -> None:
    with pytest.raises(ConfigError, match="unknown key 'keep_rounds'"):
        IslandSettings.resolve({"keep_rounds": 2})


def test_an_island_that_starts_late_takes_a_newer_merge_when_the_old_inputs_are_pruned(
    tmp_path: Path,
) -> None:
    """With cutoffs the region goes on without an island that starts late; asked for a
    regional merge of round 0 whose inputs were pruned, the relay does not recompute it
    (it cannot), and the island takes a newer merge instead, as when it was left behind."""
    cfg = RunConfig.from_dict(
        {
            "model": "toy",
            "steps": 24,
            "topology": {"regions": ["a"], "islands_per_region": 3, "h_r": 2, "h_g": 4},
            "membership": {"regional_cutoff_s": 3.0, "global_cutoff_s": 3.0,
                           "regional_quorum": 2},
        }
    )  # fmt: skip
    keys = {n: SigningKey.generate(n) for n in daemon_key_names(cfg.topology)}
    cluster = toy_cluster(cfg, tmp_path, keys, TrustedKeys.of(keys.values()), keep_rounds=2)
    late = cluster.islands["a-0"]
    for island in cluster.islands.values():
        if island is not late:
            cluster.start_training(island, 1.0)
    cluster.net.at(60.0, lambda: cluster.start_training(late, 1.0))  # after round 0 is pruned
    cluster.drive(100_000)
    assert cluster.complete
    assert _rounds(tmp_path / "relay-a") == [4, 5]
