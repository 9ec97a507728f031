"""Receipts: a merge is applied only with valid signed heads of the nodes that made it,
and they are kept where the audit finds them (real tapes, keys and files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hypertrain.common.errors import HypertrainError
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.receipts import (
    ReceiptError,
    Witness,
    find_receipts,
    open_receipt,
    producers,
    raw_receipt,
    read_receipts,
)
from hypertrain.common.trust.tape import TapeWriter
from hypertrain.common.trust.tape_format import encode_record

RUN = "run-1"
KEYS = {n: SigningKey.generate(n) for n in ("aggregator", "relay-eu", "island-eu-0")}
TRUSTED = TrustedKeys.of(KEYS.values())


def _heads(tmp_path: Path, name: str, run_id: str = RUN) -> tuple[bytes, bytes]:
    """A checkpoint receipt of ``name``'s tape, and the raw record of a plain entry."""
    with TapeWriter.open(tmp_path / f"{name}-{run_id}.tape", run_id, KEYS[name]) as w:
        plain = w.append("note", {"n": 1})
        cp = w.checkpoint()
    return raw_receipt(cp), encode_record(plain.signer, plain.data, plain.signature)


def test_who_must_sign_a_merge() -> None:
    assert producers("regional", "relay-eu") == ["relay-eu"]
    assert producers("global", "relay-eu") == ["aggregator", "relay-eu"]
    assert producers("global", "aggregator") == ["aggregator"]


def test_valid_receipts_are_kept_and_read_back(tmp_path: Path) -> None:
    agg, _ = _heads(tmp_path, "aggregator")
    relay, _ = _heads(tmp_path, "relay-eu")
    w = Witness(tmp_path / "island", "island-eu-0", RUN, TRUSTED)
    w.take(4, "regional", (relay,), "relay-eu")
    w.take(8, "global", (agg, relay), "relay-eu")
    kept = read_receipts(tmp_path / "island" / "receipts")
    assert [(k.holder, k.step, k.kind, k.signer) for k in kept] == [
        ("island-eu-0", 4, "regional", "relay-eu"),
        ("island-eu-0", 8, "global", "aggregator"),
        ("island-eu-0", 8, "global", "relay-eu"),
    ]
    assert kept[1].raw == agg and kept[2].raw == relay
    assert open_receipt(agg, TRUSTED, RUN, "aggregator").size == 1
    again = Witness(tmp_path / "island", "island-eu-0", RUN, TRUSTED)  # a restart
    assert again.passed_on(8, "aggregator") == agg
    assert again.passed_on(12, "aggregator") == agg  # none for 12: the newest kept
    assert again.passed_on(8, "relay-us") is None
    assert list(find_receipts([tmp_path])) == [tmp_path / "island" / "receipts"]


@pytest.mark.parametrize(
    "case,words",
    [
        ("missing", "came with 1 receipts, not 2 (aggregator, relay-eu)"),
        ("swapped", "aggregator's receipt is invalid: signed by relay-eu, not by aggregator"),
        ("flipped", "relay-eu's receipt is invalid: bad signature"),
        ("not_a_checkpoint", "relay-eu's receipt is invalid: a note entry, not a checkpoint"),
        ("other_run", "relay-eu's receipt is invalid: of run 'run-2', not 'run-1'"),
        ("garbage", "relay-eu's receipt is invalid: not one framed record"),
        ("unpinned", "relay-eu's receipt is invalid: signed by key"),
    ],
)
def test_a_merge_without_valid_receipts_is_refused_and_nothing_is_kept(
    tmp_path: Path, case: str, words: str
) -> None:
    agg, _ = _heads(tmp_path, "aggregator")
    relay, plain = _heads(tmp_path, "relay-eu")
    other, _ = _heads(tmp_path, "relay-eu", run_id="run-2")
    stranger = SigningKey.generate("relay-eu")  # same name, a key nobody pinned
    with TapeWriter.open(tmp_path / "stranger.tape", RUN, stranger) as t:
        t.append("note", {})
        unpinned = raw_receipt(t.checkpoint())
    flipped = bytearray(relay)
    flipped[-1] ^= 1
    receipts = {
        "missing": (relay,),
        "swapped": (relay, agg),
        "flipped": (agg, bytes(flipped)),
        "not_a_checkpoint": (agg, plain),
        "other_run": (agg, other),
        "garbage": (agg, b"\x00" * 40),
        "unpinned": (agg, unpinned),
    }[case]
    w = Witness(tmp_path / "island", "island-eu-0", RUN, TRUSTED)
    with pytest.raises(ReceiptError) as err:
        w.take(8, "global", receipts, "relay-eu")
    assert words in str(err.value), str(err.value)
    assert "the global merge of step 8 from relay-eu" in str(err.value)
    assert not (tmp_path / "island" / "receipts").exists() and not w.held


def test_a_holder_that_pins_no_keys_checks_and_keeps_nothing(tmp_path: Path) -> None:
    w = Witness(tmp_path, "island-eu-0", RUN, None)
    w.take(8, "global", (), "relay-eu")
    assert not (tmp_path / "receipts").exists()


def test_a_torn_last_line_is_skipped_and_a_bad_line_is_named(tmp_path: Path) -> None:
    relay, _ = _heads(tmp_path, "relay-eu")
    Witness(tmp_path / "i", "island-eu-0", RUN, TRUSTED).take(4, "regional", (relay,), "relay-eu")
    path = tmp_path / "i" / "receipts"
    whole = path.read_bytes()
    path.write_bytes(whole + whole[:30])  # a crash mid-append
    assert len(read_receipts(path)) == 1
    path.write_bytes(whole + b'{"holder": 1}\n')
    with pytest.raises(HypertrainError, match=r"receipts line 2: not a receipt line"):
        read_receipts(path)


def test_a_witness_holds_only_the_newest_steps_to_pass_on(tmp_path: Path) -> None:
    """Every receipt stays in the file; memory holds the newest ``HELD_STEPS`` steps of each
    signer, and an older step is passed on with the newest receipt held."""
    agg, _ = _heads(tmp_path, "aggregator")
    w = Witness(tmp_path / "relay", "relay-eu", RUN, TRUSTED)
    for step in (4, 8, 12, 16, 20):
        w.take(step, "global", (agg,), "aggregator")
    assert len(read_receipts(tmp_path / "relay" / "receipts")) == 5
    assert sorted(w.held) == [(16, "aggregator"), (20, "aggregator")]
    again = Witness(tmp_path / "relay", "relay-eu", RUN, TRUSTED)
    assert sorted(again.held) == [(16, "aggregator"), (20, "aggregator")]
    assert again.passed_on(4, "aggregator") == agg


def test_a_short_write_is_finished_and_a_failed_append_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that takes fewer bytes than asked (nearly full): the append goes on until
    the lines are whole; one that then fails (ENOSPC) is cut back to where it began and
    raised, so no torn line sits in the middle of the file once a later append comes."""
    import errno
    import os

    from hypertrain.common.trust import receipts

    agg, _ = _heads(tmp_path, "aggregator")
    relay, _ = _heads(tmp_path, "relay-eu")
    w = Witness(tmp_path / "i", "island-eu-0", RUN, TRUSTED)
    w.take(4, "regional", (relay,), "relay-eu")
    path = tmp_path / "i" / "receipts"
    before = path.read_bytes()
    real_write = os.write
    calls: list[int] = []

    def short(fd: int, data: bytes) -> int:  # 7 bytes a call
        calls.append(len(data))
        return real_write(fd, bytes(data)[:7])

    monkeypatch.setattr(receipts.os, "write", short)
    w.take(8, "global", (agg, relay), "relay-eu")
    assert len(calls) > 2  # it went on after the first short write
    assert [(k.step, k.signer) for k in read_receipts(path)] == [
        (4, "relay-eu"), (8, "aggregator"), (8, "relay-eu")
    ]  # fmt: skip
    whole = path.read_bytes()

    def full(fd: int, data: bytes) -> int:  # 9 bytes, then the disk is full
        if calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        calls.append(len(data))
        return real_write(fd, bytes(data)[:9])

    calls.clear()
    monkeypatch.setattr(receipts.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        w.take(12, "global", (agg, relay), "relay-eu")
    assert path.read_bytes() == whole and whole.startswith(before)
    assert (12, "aggregator") not in w.held  # nothing kept of the failed take
    monkeypatch.setattr(receipts.os, "write", real_write)
    w.take(12, "global", (agg, relay), "relay-eu")  # the disk has room again
    assert [k.step for k in read_receipts(path)] == [4, 8, 8, 12, 12]
