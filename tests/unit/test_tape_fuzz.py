"""Hostile bytes at the tape's readers: a TapeError naming the problem, never another exception.

``scan`` splits any bytes into records and a framing problem without raising;
``parse_entry`` takes or refuses any entry bytes (garbage, JSON of any shape, nesting past
the stack); ``verify_tape`` on a real tape cut short or with bytes changed either refuses
it or accepts only entries that were signed as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hypertrain.common.errors import TapeError
from hypertrain.common.trust.keys import SigningKey, TrustedKeys
from hypertrain.common.trust.tape import TapeWriter, verify_tape
from hypertrain.common.trust.tape_format import (
    FRAME_BYTES,
    MAGIC,
    SIG_BYTES,
    Record,
    canonical_json,
    encode_record,
    parse_entry,
    scan,
)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
KEY = SigningKey.from_seed("relay-eu", b"\x02" * 32)
RUN = "run-fuzz"


@FUZZ
@given(raw=st.one_of(st.binary(max_size=300), st.binary(max_size=200).map(lambda b: MAGIC + b)))
def test_scan_splits_any_bytes_without_raising(raw: bytes) -> None:
    records, problem = scan(raw)
    end = records[-1].offset + records[-1].size if records else len(MAGIC)
    assert all(r.size == FRAME_BYTES + len(r.data) + SIG_BYTES for r in records)
    assert (problem is None) == (raw[: len(MAGIC)] == MAGIC and end == len(raw))
    if problem is not None:
        assert problem.reason in ("not a tape", "truncated record", "corrupt record frame")


def _containers(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    _containers,
    max_leaves=12,
)
entries = st.fixed_dictionaries(
    {"body": st.dictionaries(st.text(max_size=4), json_values, max_size=3) | json_values, "kind": st.sampled_from(["input", "checkpoint", "Bad kind"]),
     "prev": st.sampled_from(["0" * 64, "x"]), "run_id": st.sampled_from([RUN, ""]),
     "seq": st.integers(0, 9) | json_values, "signer": st.sampled_from([KEY.key_id, "zz"]),
     "v": st.just(1) | json_values},
).map(lambda d: json.dumps(d, sort_keys=True, separators=(",", ":")).encode())  # fmt: skip


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), entries,
                      st.integers(1, 1 << 16).map(lambda n: b"[" * n + b"]" * n)))  # fmt: skip
def test_parse_entry_takes_or_refuses_any_bytes(data: bytes) -> None:
    try:
        e = parse_entry(Record(0, KEY.key_id, data, b""))
    except TapeError as err:
        event("refused")
        assert err.reason == "malformed entry" and str(err).startswith("malformed entry: ")
        return
    event("parsed")
    assert canonical_json(json.loads(data)) == data and e.run_id and e.seq >= 0


@pytest.fixture(scope="module")
def tape(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("tape") / "relay.tape"
    w = TapeWriter.open(path, RUN, KEY, checkpoint_every=3)
    for i in range(5):
        w.append("input", {"round": i, "sync_step": 5 * i, "sender": "eu-0"})
    w.close()
    return path.read_bytes()


@FUZZ
@given(cut=st.integers(0, 4000), flips=st.lists(st.tuples(st.integers(0, 4000),
                                                          st.integers(1, 255)), max_size=3))  # fmt: skip
def test_a_damaged_tape_is_refused_or_holds_only_signed_entries(
    tape: bytes, cut: int, flips: list[tuple[int, int]], tmp_path: Path
) -> None:
    raw = bytearray(tape[: cut % (len(tape) + 1)])
    for at, mask in flips:
        if raw:
            raw[at % len(raw)] ^= mask
    path = tmp_path / "damaged.tape"
    path.write_bytes(bytes(raw))
    signed = {r.data for r in scan(tape)[0]}
    try:
        report = verify_tape(path, TrustedKeys.of([KEY]), allow_torn_tail=True)
    except TapeError as err:
        event(err.reason)
        assert err.reason and str(err).startswith(str(path)), err
        return
    event(f"accepted {len(report.entries)} entries")
    assert all(e.data in signed for e in report.entries)
    kept = MAGIC + b"".join(encode_record(e.signer, e.data, e.signature) for e in report.entries)
    assert bytes(raw).startswith(kept) or (not report.entries and MAGIC.startswith(bytes(raw)))
