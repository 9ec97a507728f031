"""The node store's checkpoints: streamed, linked, deferred until settled, and held until released."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from hypertrain.common.errors import HypertrainError
from hypertrain.common.rounds.store import NodeStore, atomic_save, load_state


def test_atomic_save_round_trips_and_leaves_no_temp_file(tmp_path: Path) -> None:
    state = {"theta": torch.arange(10, dtype=torch.float32), "none": None, "n": 3}
    atomic_save(tmp_path / "a.pt", state)
    got = load_state(tmp_path / "a.pt")
    assert torch.equal(got["theta"], state["theta"]) and got["none"] is None and got["n"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


def test_a_crash_mid_write_keeps_the_previous_file(tmp_path: Path) -> None:
    atomic_save(tmp_path / "a.pt", {"v": 1})

    def crash(point: str) -> None:
        if point == "mid_write":
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_save(tmp_path / "a.pt", {"v": 2}, crash)
    assert load_state(tmp_path / "a.pt") == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


def test_state_pt_is_a_link_to_the_round_checkpoint(tmp_path: Path) -> None:
    store = NodeStore(tmp_path, "run", None)
    store.write_checkpoint(0, {"round": 0}, copy_as="state.pt")
    store.write_checkpoint(1, {"round": 1}, copy_as="state.pt")
    assert (tmp_path / "state.pt").samefile(tmp_path / "checkpoints" / "round-000001.pt")
    assert load_state(tmp_path / "state.pt") == {"round": 1}
    assert load_state(tmp_path / "checkpoints" / "round-000000.pt") == {"round": 0}


def test_deferred_checkpoints_are_written_in_order_and_settled(tmp_path: Path) -> None:
    gate = threading.Event()
    seen: list[str] = []

    def crash(point: str) -> None:  # holds the writer until the test lets it go
        seen.append(point)
        gate.wait(10)

    store = NodeStore(tmp_path, "run", None, defer=True, crash=crash)
    store.write_checkpoint(0, {"round": 0}, copy_as="state.pt", deferrable=True)
    store.write_checkpoint(1, {"round": 1}, copy_as="state.pt", deferrable=True)
    assert not (tmp_path / "state.pt").exists()  # still being written
    gate.set()
    store.settle()
    assert load_state(tmp_path / "state.pt") == {"round": 1}
    assert seen.count("mid_write") == 2
    store.write_checkpoint(2, {"round": 2})  # not deferrable: written at once
    assert load_state(tmp_path / "checkpoints" / "round-000002.pt") == {"round": 2}
    store.close()


def test_a_failed_deferred_write_is_raised_by_settle(tmp_path: Path) -> None:
    def crash(point: str) -> None:
        if point == "mid_write":
            raise OSError(28, "No space left on device")

    store = NodeStore(tmp_path, "run", None, defer=True, crash=crash)
    store.write_checkpoint(0, {"round": 0}, deferrable=True)
    with pytest.raises(HypertrainError, match="No space left"):
        store.settle()
    store.settle()  # reported once
    assert not (tmp_path / "checkpoints" / "round-000000.pt").exists()


def _checkpoint_written(tmp_path: Path, round_: int, within_s: float) -> bool:
    path = tmp_path / "checkpoints" / f"round-{round_:06d}.pt"
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        if path.exists():
            return True
        time.sleep(0.01)
    return path.exists()


def test_a_held_checkpoint_waits_for_release(tmp_path: Path) -> None:
    """With ``hold_s`` a deferred write starts only once released (every member has the
    round's merge); a second round's write queues behind it, and the writer thread runs
    ``writer_init`` first."""
    inits: list[str] = []
    store = NodeStore(
        tmp_path,
        "run",
        None,
        defer=True,
        hold_s=60.0,
        writer_init=lambda: inits.append(threading.current_thread().name),
    )
    store.write_checkpoint(0, {"round": 0}, copy_as="state.pt", deferrable=True)
    assert not _checkpoint_written(tmp_path, 0, 0.3)  # held
    store.release()
    assert _checkpoint_written(tmp_path, 0, 10.0)
    assert load_state(tmp_path / "state.pt") == {"round": 0}
    assert len(inits) == 1 and inits[0].startswith("checkpoint")
    store.close()


def test_settle_writes_a_held_checkpoint_at_once(tmp_path: Path) -> None:
    """A push that comes before the members fetched (or one of them is dead) settles the
    held write itself: released and waited for, not after the hold."""
    store = NodeStore(tmp_path, "run", None, defer=True, hold_s=60.0)
    store.write_checkpoint(0, {"round": 0}, copy_as="state.pt", deferrable=True)
    t0 = time.monotonic()
    store.settle()
    assert time.monotonic() - t0 < 30.0
    assert load_state(tmp_path / "state.pt") == {"round": 0}
    store.close()


def test_a_held_checkpoint_is_written_after_the_hold_without_release(tmp_path: Path) -> None:
    """A member that never fetches delays the write by ``hold_s``, no longer."""
    store = NodeStore(tmp_path, "run", None, defer=True, hold_s=0.2)
    store.write_checkpoint(0, {"round": 0}, deferrable=True)
    assert _checkpoint_written(tmp_path, 0, 10.0)
    store.close()


@pytest.mark.parametrize("on", ["this thread", "a writer thread"])
def test_a_saved_state_skips_torch_s_unchecked_crc_and_loads_bit_for_bit(
    tmp_path: Path, on: str
) -> None:
    """``atomic_save`` writes no CRC-32 into the zip records (torch.load never checks it,
    and computing it was most of a save's CPU time); the state loads back exactly.  Also
    on a thread that never imported the store, as the daemons' checkpoint writers and the
    island's saver are (torch's serialization config is per thread: set only at import,
    every save of the daemons still computed it)."""
    import zipfile
    from concurrent.futures import ThreadPoolExecutor

    state = {"theta": torch.randn(100_000), "step": 3}
    path = tmp_path / "state.pt"
    if on == "this thread":
        atomic_save(path, state)
    else:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(atomic_save, path, state).result()
    with zipfile.ZipFile(path) as z:
        data = [i for i in z.infolist() if "/data/" in i.filename]
    assert data and all(i.CRC == 0 for i in data)
    back = load_state(path)
    assert back["step"] == 3 and torch.equal(back["theta"], state["theta"])
    # the switch is the store's own: a plain torch.save on this thread still writes CRCs
    plain = tmp_path / "plain.pt"
    torch.save(state, plain)
    with zipfile.ZipFile(plain) as z:
        assert all(i.CRC != 0 for i in z.infolist() if "/data/" in i.filename)
