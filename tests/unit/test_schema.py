"""The typed tape schema: one record per kind, bodies unchanged on disk, strict parsing."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hypertrain.common.trust.keys import SigningKey
from hypertrain.common.trust.schema import (
    KINDS,
    ForwardEntry,
    GlobalAppliedEntry,
    GlobalMergeEntry,
    InputEntry,
    RegionalMergeEntry,
    RejectionEntry,
    SchemaError,
    parse,
    tape_safe,
)
from hypertrain.common.trust.tape import TapeWriter
from hypertrain.common.trust.tape_format import canonical_json

H = "ab" * 32

RECORDS: list[Any] = [
    InputEntry(round=0, sync_step=5, sender="eu-0", digest=H, size=12, codec="int8", signature=""),
    RejectionEntry(code="invalid_argument", reason="bad", sender="eu-1", sync_step=5, round=0),
    RejectionEntry(code="data_loss", reason="corrupt transfer"),
    RegionalMergeEntry(
        round=0,
        sync_step=5,
        tau=1,
        merge_step=6,
        codec=tape_safe({"name": "int8", "block": 256, "scale": 0.5}),
        members=(("eu-0", H), ("eu-1", H)),
        mean=H,
        commitment=H,
        pre_base=H,
        post_base=H,
    ),
    ForwardEntry(
        round=0, sync_step=10, codec="fp32", digest=H, size=4, pre_residual=H, post_residual=H
    ),
    GlobalAppliedEntry(round=0, sync_step=10, merge_step=11, theta=H),
    GlobalMergeEntry(
        round=0,
        sync_step=10,
        tau=1,
        merge_step=11,
        codec={"name": "fp32"},
        outer=tape_safe({"name": "nesterov", "eta": 0.7, "mu": 0.9}),
        members=(("eu", H), ("us", H)),
        mean=H,
        commitment=H,
        pre_state=H,
        post_state=H,
        pre_outer=H,
        post_outer=H,
    ),
]


def test_bodies_are_the_ones_written_before_the_records_existed() -> None:
    """The bytes on disk did not change: the canonical JSON of a body, pinned."""
    regional = RECORDS[3].to_body()
    assert canonical_json(regional) == (
        b'{"codec":{"block":256,"name":"int8","scale":"0.5"},"commitment":"' + H.encode()
        + b'","mean":"' + H.encode() + b'","members":[["eu-0","' + H.encode() + b'"],["eu-1","'
        + H.encode() + b'"]],"merge_step":6,"post_base":"' + H.encode() + b'","pre_base":"'
        + H.encode() + b'","round":0,"sync_step":5,"tau":1}'
    )  # fmt: skip
    assert RECORDS[2].to_body() == {"code": "data_loss", "reason": "corrupt transfer"}
    assert set(RECORDS[6].to_body()) == {
        "round", "sync_step", "tau", "merge_step", "codec", "outer", "members", "mean",
        "commitment", "pre_state", "post_state", "pre_outer", "post_outer",
    }  # fmt: skip


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: f"{r.KIND}")
def test_every_kind_round_trips_through_a_real_tape(rec: Any, tmp_path: Path) -> None:
    key = SigningKey.generate("relay-eu")
    with TapeWriter.open(tmp_path / "tape", "run", key, sync=False) as w:
        entry = w.append(rec.KIND, rec.to_body())
    assert parse(entry) == rec


@pytest.mark.parametrize(
    "kind,change,words",
    [
        ("input", {"size": "12"}, "field 'size' has the wrong type"),
        ("input", {"sync_step": True}, "field 'sync_step' has the wrong type"),
        ("regional_merge", {"members": [["eu-0"]]}, "field 'members' has the wrong type"),
        ("forward", {"extra": 1}, "unexpected field 'extra'"),
        ("global_applied", {"theta": None}, "field 'theta' has the wrong type"),
    ],
)
def test_a_body_that_is_not_its_kind_is_refused_naming_the_field(
    kind: str, change: dict[str, Any], words: str
) -> None:
    rec = next(r for r in RECORDS if kind == r.KIND)
    body = rec.to_body() | change
    with pytest.raises(SchemaError, match=words):
        KINDS[kind].from_body(body)


def test_a_missing_field_and_an_unknown_kind_are_refused(tmp_path: Path) -> None:
    body = RECORDS[0].to_body()
    del body["digest"]
    with pytest.raises(SchemaError, match="input entry: missing field 'digest'"):
        InputEntry.from_body(body)
    key = SigningKey.generate("aggregator")
    with TapeWriter.open(tmp_path / "tape", "run", key, sync=False) as w:
        entry = w.append("membership", {"who": "eu-0"})
    with pytest.raises(SchemaError, match="entry 0: unknown entry kind 'membership'"):
        parse(entry)


def test_first_difference_names_the_first_field_in_declaration_order() -> None:
    a = RECORDS[3]
    b = dataclasses.replace(a, mean="0" * 64, post_base="1" * 64)
    assert a.first_difference(b) == "mean"
    assert a.first_difference(a) is None
