"""The signed event tape: clean tapes verify, every tampering is caught and named, crashes recover.

Real files and real Ed25519 signatures throughout; the tampering is done on the
raw bytes, the way an attacker (or a bad disk) would.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest

from hypertrain.common.errors import TapeError
from hypertrain.common.trust import merkle
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, init_keys, load_signing_key
from hypertrain.common.trust.tape import (
    Checkpoint,
    Entry,
    TapeWriter,
    checkpoint_from_dict,
    read_tape,
    verify_checkpoints_consistent,
    verify_tape,
)
from hypertrain.common.trust.tape_format import MAGIC, Record, canonical_json, encode_record

RUN = "run-test"
AGG = SigningKey.from_seed("aggregator", b"\x01" * 32)
RELAY = SigningKey.from_seed("relay-eu", b"\x02" * 32)
STRANGER = SigningKey.from_seed("stranger", b"\x03" * 32)
TRUSTED = TrustedKeys.of([AGG, RELAY])
KINDS = ["regional_merge", "global_merge", "membership", "rejection"]


def _body(i: int) -> dict[str, Any]:
    return {
        "round": i,
        "sync_step": 10 * i,
        "tau": 0,
        "merge_step": 10 * i,
        "inputs": [{"sender": f"island-eu-{k}", "digest": f"{i:02x}{k:062x}"} for k in range(2)],
        "lr": repr(0.7),
        "note": "naïve ✓",  # non-ASCII text is stored \u-escaped
    }


def _write(path: Path, n: int, every: int = 4, key: SigningKey = AGG, start: int = 0) -> TapeWriter:
    w = TapeWriter.open(path, RUN, key, checkpoint_every=every)
    for i in range(start, start + n):
        w.append(KINDS[i % len(KINDS)], _body(i))
    return w


@pytest.fixture
def tape(tmp_path: Path) -> Path:
    p = tmp_path / "aggregator.tape"
    _write(p, 10).close()  # 10 entries + checkpoints at seq 4 and 9 -> 12 records
    return p


def _rewrite(path: Path, records: list[Record]) -> None:
    path.write_bytes(
        MAGIC + b"".join(encode_record(r.key_id, r.data, r.signature) for r in records)
    )


def _resign(rec: Record, key: SigningKey, **changes: Any) -> Record:
    obj = json.loads(rec.data)
    obj.update(changes)
    obj["signer"] = changes.get("signer", key.key_id)
    data = canonical_json(obj)
    return Record(rec.offset, key.key_id, data, key.sign(data))


def _fails(path: Path, reason: str, seq: int, **kw: Any) -> TapeError:
    with pytest.raises(TapeError) as e:
        verify_tape(path, TRUSTED, **kw)
    assert e.value.reason == reason, str(e.value)
    assert e.value.seq == seq, str(e.value)
    assert f"entry {seq} at offset {e.value.offset}: {reason}: " in str(e.value)
    return e.value


# -- clean tapes ---------------------------------------------------------------------
def test_clean_tape_verifies_with_keys_from_files(tmp_path: Path) -> None:
    trusted_path = init_keys(tmp_path / "keys", ["aggregator"])
    key = load_signing_key(tmp_path / "keys" / "aggregator.key")
    p = tmp_path / "agg.tape"
    w = _write(p, 10, key=key)
    first = w.leaf_hashes()
    w.close()
    rep = verify_tape(p, TrustedKeys.load(trusted_path), run_id=RUN, signer="aggregator")
    assert rep.n_entries == 12 and rep.run_id == RUN
    assert rep.n_bytes == p.stat().st_size
    assert [e.seq for e in rep.entries] == list(range(12))
    assert [c.seq for c in rep.checkpoints] == [4, 9]
    cp = rep.last_checkpoint
    assert cp is not None and cp.size == 9
    assert cp.root == merkle.root(rep.leaf_hashes()[:9])
    assert rep.leaf_hashes() == first
    assert rep.entries[0].body == json.loads(json.dumps(_body(0)))
    assert rep.entries[0].prev == "0" * 64
    assert all(b.prev == a.hash for a, b in zip(rep.entries, rep.entries[1:], strict=False))
    assert rep.head == rep.entries[-1].hash
    assert "12 entries" in rep.summary()
    # the stored bytes are exactly what was signed: raw records agree with the entries
    recs = read_tape(p)
    assert [r.data for r in recs] == [e.data for e in rep.entries]
    assert all(key.trusted().verify(r.data, r.signature) for r in recs)


def test_empty_tape_and_appended_entry_are_returned(tmp_path: Path) -> None:
    p = tmp_path / "t.tape"
    with TapeWriter.open(p, RUN, AGG) as w:
        assert verify_tape(p, TRUSTED).n_entries == 0
        e = w.append("global_merge", {"round": 0})
        assert isinstance(e, Entry) and e.seq == 0 and e.data in p.read_bytes()
        assert e.hash == w.head and w.next_seq == 1
    assert verify_tape(p, TRUSTED).entries == [e]


# -- tampering, each named ------------------------------------------------------------
def test_flipped_byte_in_entry_body(tape: Path) -> None:
    recs = read_tape(tape)
    raw = bytearray(tape.read_bytes())
    at = recs[6].offset + 16 + recs[6].data.index(b'"round"') + 9
    raw[at] ^= 0x01
    tape.write_bytes(bytes(raw))
    err = _fails(tape, "bad signature", 6)
    assert err.offset == recs[6].offset


def test_flipped_byte_in_signature_and_in_frame(tape: Path) -> None:
    recs = read_tape(tape)
    raw = bytearray(tape.read_bytes())
    raw[recs[3].offset + recs[3].size - 1] ^= 0x80
    tape.write_bytes(bytes(raw))
    _fails(tape, "bad signature", 3)
    raw[recs[3].offset + recs[3].size - 1] ^= 0x80
    raw[recs[2].offset + 1] ^= 0x01  # the length field
    tape.write_bytes(bytes(raw))
    _fails(tape, "corrupt record frame", 2)


def test_edited_entry_resigned_by_unknown_key(tape: Path) -> None:
    recs = read_tape(tape)
    recs[5] = _resign(recs[5], STRANGER, body={"round": 999})
    _rewrite(tape, recs)
    err = _fails(tape, "unknown key", 5)
    assert STRANGER.key_id in str(err)


def test_tape_signed_by_key_not_in_trusted_list(tmp_path: Path) -> None:
    p = tmp_path / "t.tape"
    _write(p, 3, key=STRANGER).close()
    _fails(p, "unknown key", 0)


def test_entry_resigned_by_another_trusted_daemon(tape: Path) -> None:
    recs = read_tape(tape)
    recs[7] = _resign(recs[7], RELAY, body={"round": 999})
    _rewrite(tape, recs)
    _fails(tape, "wrong signer", 7)
    _fails(tape, "wrong signer", 0, signer="relay-eu")


def test_dropped_entry(tape: Path) -> None:
    recs = read_tape(tape)
    del recs[2]
    _rewrite(tape, recs)
    err = _fails(tape, "sequence gap", 2)
    assert "expected seq 2, found 3" in str(err)


def test_reordered_entries(tape: Path) -> None:
    recs = read_tape(tape)
    recs[5], recs[6] = recs[6], recs[5]
    _rewrite(tape, recs)
    _fails(tape, "reordered entries", 5)


def test_duplicated_entry(tape: Path) -> None:
    recs = read_tape(tape)
    recs.insert(4, recs[3])
    _rewrite(tape, recs)
    err = _fails(tape, "duplicate entry", 4)
    assert "seq 3 repeats entry 3" in str(err)


def test_broken_chain_even_when_signed_by_the_right_key(tape: Path) -> None:
    recs = read_tape(tape)
    recs[3] = _resign(recs[3], AGG, prev="ab" * 32)
    _rewrite(tape, recs)
    _fails(tape, "broken chain", 3)


def test_forged_checkpoint_root_and_size(tape: Path) -> None:
    recs = read_tape(tape)
    good = recs[9]
    recs[9] = _resign(good, AGG, body={"root": "cd" * 32, "size": 9})
    _rewrite(tape, recs)
    _fails(tape, "checkpoint root mismatch", 9)
    recs[9] = _resign(good, AGG, body={"root": json.loads(good.data)["body"]["root"], "size": 8})
    _rewrite(tape, recs)
    _fails(tape, "checkpoint size mismatch", 9)


@pytest.mark.parametrize(
    "data",
    [
        b'{"body":{},"kind":"x","prev":"%s","run_id":"r","seq":0,"signer":"%s","v":2, "z":1}',
        b'{"body":{},"kind":"x","prev":"%s","run_id":"r","seq":0,"signer":"%s","v":2,"v":1}',
        b'{"body":{"a":1.5},"kind":"x","prev":"%s","run_id":"r","seq":0,"signer":"%s","v":2}',
        b'{"kind":"x","body":{},"prev":"%s","run_id":"r","seq":0,"signer":"%s","v":2}',
        b'{"body":{},"kind":"x","prev":"%s","run_id":"r","seq":0,"signer":"%s","v":2} ',
    ],
)
def test_validly_signed_but_not_canonical(tmp_path: Path, data: bytes) -> None:
    data = data % (b"0" * 64, AGG.key_id.encode())
    p = tmp_path / "t.tape"
    _rewrite(p, [Record(0, AGG.key_id, data, AGG.sign(data))])
    _fails(p, "malformed entry", 0)


def test_an_entry_of_digest_format_1_is_refused_by_name(tmp_path: Path) -> None:
    """A version 1 tape names sha256 digests: it is refused as such, not audited as if
    every digest in it had changed."""
    data = b'{"body":{},"kind":"x","prev":"%s","run_id":"r","seq":0,"signer":"%s","v":1}'
    data = data % (b"0" * 64, AGG.key_id.encode())
    p = tmp_path / "t.tape"
    _rewrite(p, [Record(0, AGG.key_id, data, AGG.sign(data))])
    err = _fails(p, "malformed entry", 0)
    assert "format version 1 (sha256 digests" in str(err)


def test_wrong_run_id(tape: Path) -> None:
    _fails(tape, "wrong run id", 0, run_id="another-run")


# -- truncation and forks --------------------------------------------------------------
def test_truncated_mid_record(tape: Path) -> None:
    full = tape.read_bytes()
    last = read_tape(tape)[-1]
    for cut in (1, 15, 16, 17, last.size // 2, last.size - 1):
        tape.write_bytes(full[:-cut])
        err = _fails(tape, "truncated record", 11)
        assert err.offset == last.offset
        rep = verify_tape(tape, TRUSTED, allow_torn_tail=True)
        assert rep.n_entries == 11 and rep.torn_tail_bytes == last.size - cut
        with pytest.raises(TapeError, match="truncated record"):
            read_tape(tape)


def test_truncated_at_a_record_boundary_before_a_seen_checkpoint(tape: Path) -> None:
    rep = verify_tape(tape, TRUSTED)
    seen = rep.last_checkpoint
    assert seen is not None and seen.seq == 9
    recs = read_tape(tape)
    _rewrite(tape, recs[:7])  # a clean prefix: on its own it verifies
    assert verify_tape(tape, TRUSTED).n_entries == 7
    err = _fails(tape, "truncated tape", 7, expect_checkpoint=seen)
    assert "a checkpoint seen before is entry 9" in str(err)
    kept = checkpoint_from_dict(json.loads(json.dumps(seen.to_dict())), TRUSTED)
    assert kept == seen
    _fails(tape, "truncated tape", 7, expect_checkpoint=[rep.checkpoints[0], kept])


def _fork(tmp_path: Path) -> tuple[Path, Path]:
    """Two tapes of one run and key sharing 6 records, then diverging."""
    a, b = tmp_path / "a.tape", tmp_path / "b.tape"
    _write(a, 10).close()
    _rewrite(b, read_tape(a)[:6])
    w = TapeWriter.open(b, RUN, AGG, checkpoint_every=4)
    for i in range(4):
        w.append("global_merge", {"round": 100 + i})
    w.close()
    return a, b


def test_fork_against_a_seen_checkpoint(tmp_path: Path) -> None:
    a, b = _fork(tmp_path)
    rep_a, rep_b = verify_tape(a, TRUSTED), verify_tape(b, TRUSTED)
    cp_a = rep_a.checkpoints[1]
    assert cp_a.seq == 9 and rep_b.checkpoints[1].seq == 9
    _fails(b, "fork", 9, expect_checkpoint=cp_a)
    verify_tape(b, TRUSTED, expect_checkpoint=rep_a.checkpoints[0])  # the shared prefix


def test_two_conflicting_signed_checkpoints(tmp_path: Path) -> None:
    a, b = _fork(tmp_path)
    rep_a, rep_b = verify_tape(a, TRUSTED), verify_tape(b, TRUSTED)
    cp_a4, cp_a9 = rep_a.checkpoints
    cp_b4, cp_b9 = rep_b.checkpoints
    assert cp_a4 == cp_b4
    with pytest.raises(TapeError, match="fork: two signed checkpoints of size 9") as e:
        verify_checkpoints_consistent(cp_a9, cp_b9, trusted=TRUSTED)
    assert e.value.reason == "fork"
    # b's second checkpoint is consistent with b's first but not with a's longer history
    verify_checkpoints_consistent(cp_b4, cp_b9, leaf_hashes=rep_b.leaf_hashes(), trusted=TRUSTED)
    proof = merkle.consistency_proof(4, rep_a.leaf_hashes()[:9])
    verify_checkpoints_consistent(cp_a9, cp_a4, proof)
    with pytest.raises(TapeError, match="is not a prefix") as e:
        verify_checkpoints_consistent(
            cp_b4, cp_a9, merkle.consistency_proof(4, rep_b.leaf_hashes()[:9])
        )
    assert e.value.reason == "fork"
    # a later checkpoint of b, proven with a's leaves, is a fork as well
    with pytest.raises(TapeError, match="is not a prefix"):
        verify_checkpoints_consistent(cp_a4, cp_b9, leaf_hashes=rep_a.leaf_hashes())
    with pytest.raises(TapeError, match="different tapes"):
        other = tmp_path / "r.tape"
        _write(other, 5, key=RELAY).close()
        verify_checkpoints_consistent(cp_a4, verify_tape(other, TRUSTED).checkpoints[0])


def test_forged_kept_checkpoint_is_refused(tape: Path) -> None:
    cp = verify_tape(tape, TRUSTED).checkpoints[0]
    d = cp.to_dict()
    d["signature"] = ("00" if d["signature"][:2] != "00" else "11") + d["signature"][2:]
    with pytest.raises(TapeError, match="bad signature"):
        checkpoint_from_dict(d, TRUSTED)
    with pytest.raises(TapeError, match="unknown key"):
        checkpoint_from_dict(cp.to_dict(), TrustedKeys.of([RELAY]))


# -- writing, resuming, crashes ----------------------------------------------------------
def test_resume_continues_the_chain_and_the_checkpoint_cadence(tmp_path: Path) -> None:
    p = tmp_path / "t.tape"
    w = _write(p, 3)
    head, seq = w.head, w.next_seq
    w.close()
    w = TapeWriter.open(p, RUN, AGG, checkpoint_every=4)
    assert (w.head, w.next_seq, w.recovered_bytes) == (head, seq, 0)
    assert [e.body["round"] for e in w.entries] == [0, 1, 2]  # what a restart resumes from
    e = w.append("global_merge", {"round": 3})
    assert e.seq == 3 and e.prev == head
    assert w.last_checkpoint is not None and w.last_checkpoint.seq == 4  # 4 since the start
    w.close()
    rep = verify_tape(p, TRUSTED)
    assert [x.kind for x in rep.entries][3:] == ["global_merge", "checkpoint"]
    # a checkpoint that is due is written on open (a crash between an entry and its checkpoint)
    _write(p, 3, every=0, start=4).close()
    w = TapeWriter.open(p, RUN, AGG, checkpoint_every=2)
    assert w.last_checkpoint is not None and w.last_checkpoint.seq == 8
    assert w.last_checkpoint.size == 8
    assert w.last_checkpoint.root == merkle.root(w.leaf_hashes()[:8])
    assert w.root() == merkle.root(w.leaf_hashes())
    w.close()
    verify_tape(p, TRUSTED)


def test_resume_refuses_another_key_or_run_and_a_second_writer(tape: Path) -> None:
    with pytest.raises(TapeError, match=r"cannot resume tape .*: entry 0 at offset 8: unknown key"):
        TapeWriter.open(tape, RUN, RELAY)
    with pytest.raises(TapeError, match="a daemon with a new key starts a new tape"):
        TapeWriter.open(tape, RUN, RELAY)
    with pytest.raises(TapeError, match="wrong run id"):
        TapeWriter.open(tape, "other-run", AGG)
    with TapeWriter.open(tape, RUN, AGG), pytest.raises(TapeError, match="another writer"):
        TapeWriter.open(tape, RUN, AGG)
    w = TapeWriter.open(tape, RUN, AGG)  # the lock went with the first writer
    w.close()


def test_append_rejects_what_cannot_be_canonical(tmp_path: Path) -> None:
    with TapeWriter.open(tmp_path / "t.tape", RUN, AGG) as w:
        with pytest.raises(TapeError, match=r"body.loss: floats are not allowed.*repr"):
            w.append("global_merge", {"loss": 0.5})
        with pytest.raises(TapeError, match="64 bits"):
            w.append("global_merge", {"x": [1 << 70]})
        with pytest.raises(TapeError, match="not a string"):
            w.append("global_merge", {"x": {1: 2}})  # type: ignore[dict-item]
        with pytest.raises(TapeError, match="bad entry kind"):
            w.append("Global Merge", {})
        with pytest.raises(TapeError, match="checkpoint"):
            w.append("checkpoint", {})
        assert w.next_seq == 0
    with pytest.raises(TapeError, match="closed"):
        w.append("global_merge", {})


def _recovers(p: Path, good_entries: int, tail: bytes) -> None:
    with p.open("ab") as f:
        f.write(tail)
    w = TapeWriter.open(p, RUN, AGG, checkpoint_every=0)
    assert w.recovered_bytes == len(tail) and w.next_seq == good_entries
    w.append("global_merge", {"after": "crash"})
    w.close()
    assert verify_tape(p, TRUSTED).n_entries == good_entries + 1


def test_crash_torn_last_record_is_truncated_on_open(tmp_path: Path) -> None:
    ref = tmp_path / "ref.tape"
    _write(ref, 4, every=0).close()
    recs = read_tape(ref)
    full = ref.read_bytes()
    # what the next append would have written, cut at every kind of point
    nxt = _resign(recs[-1], AGG, seq=4, prev=verify_tape(ref, TRUSTED).head)
    rec = encode_record(nxt.key_id, nxt.data, nxt.signature)
    for cut in (1, 4, 15, 16, 17, len(rec) // 2, len(rec) - 64, len(rec) - 1):
        p = tmp_path / f"cut{cut}.tape"
        p.write_bytes(full)
        _recovers(p, 4, rec[:cut])
    p = tmp_path / "zeros.tape"
    p.write_bytes(full)
    _recovers(p, 4, bytes(len(rec)))  # size updated, data never written
    p = tmp_path / "header.tape"
    p.write_bytes(b"")
    _recovers(p, 0, MAGIC[:5])  # a crash while creating the file


def test_crash_never_truncates_a_complete_record(tape: Path) -> None:
    raw = bytearray(tape.read_bytes())
    raw[-10] ^= 0x01  # the last record is complete but its signature is wrong
    tape.write_bytes(bytes(raw))
    with pytest.raises(
        TapeError, match=r"cannot resume tape .*: entry 11 at offset \d+: bad signature"
    ):
        TapeWriter.open(tape, RUN, AGG)
    assert tape.read_bytes() == bytes(raw)
    raw[-10] ^= 0x01
    tape.write_bytes(bytes(raw) + b"\x07" * 40)  # non-zero garbage after the last record
    with pytest.raises(TapeError, match="corrupt record frame"):
        TapeWriter.open(tape, RUN, AGG)


def test_failed_write_breaks_the_writer_until_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "t.tape"
    w = _write(p, 2, every=0)
    real_write = os.write

    def enospc(fd: int, data: Any) -> int:
        real_write(fd, bytes(data)[:10])  # a partial record reaches the file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", enospc)
    with pytest.raises(TapeError, match="append failed: No space left on device"):
        w.append("global_merge", {"round": 2})
    monkeypatch.setattr(os, "write", real_write)
    with pytest.raises(TapeError, match="reopen to resume"):
        w.append("global_merge", {"round": 2})
    w.close()
    assert verify_tape(p, TRUSTED).n_entries == 2
    w = TapeWriter.open(p, RUN, AGG)
    assert w.next_seq == 2
    w.close()


def test_checkpoint_type(tape: Path) -> None:
    cp = verify_tape(tape, TRUSTED).checkpoints[0]
    assert isinstance(cp, Checkpoint) and (cp.seq, cp.size) == (4, 4) and cp.run_id == RUN
