"""The pre-registration (hypertrain.sim.study.prereg, docs/design.md §7.1): the grid, the hash,
and the file's refusals."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from hypertrain.sim.study.prereg import (
    DEFAULT_PATH,
    Design,
    Divergence,
    Margins,
    PreregError,
    canonical_json,
    design_hash,
    load_prereg,
    main,
    registered_design,
    verify_registered,
    write_prereg,
)

ROOT = Path(__file__).resolve().parents[2]
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


@pytest.fixture(scope="module")
def design() -> Design:
    return registered_design()


@pytest.fixture
def registered(tmp_path: Path, design: Design) -> Path:
    path = tmp_path / "prereg.json"
    write_prereg(path, design)
    return path


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _changed(v: Any) -> Any:
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v * 2 + 1
    if isinstance(v, str):
        return v + "x"
    if v is None:
        return 0
    return [0]  # an empty list


def _set(d: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


def test_round_trip(registered: Path, design: Design) -> None:
    pre = load_prereg(registered)
    assert pre.design == design
    assert pre.design_sha256 == design_hash(design) == design_hash(design.to_dict())
    doc = json.loads(registered.read_text())
    assert doc["design_sha256"] == pre.design_sha256 and doc["registered_utc"] == pre.registered_utc
    assert doc["design"] == design.to_dict()
    assert Design.from_dict(design.to_dict()) == design


def test_canonical_json_is_sorted_compact_ascii_and_refuses_nan() -> None:
    assert (
        canonical_json({"b": 1, "a": [1.0, None, "\u00e9"]}) == '{"a":[1.0,null,"\\u00e9"],"b":1}'
    )
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_registration_time_is_utc_iso8601(tmp_path: Path, design: Design) -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    stamp = write_prereg(tmp_path / "a.json", design).registered_utc
    assert ISO_UTC.match(stamp), stamp
    when = datetime.fromisoformat(stamp)
    assert when.utcoffset() == timedelta(0)
    assert before <= when <= datetime.now(UTC) + timedelta(seconds=1)
    # A clock in another zone is converted, not copied.
    plus2 = datetime(2025, 3, 4, 12, 0, 0, tzinfo=timezone(timedelta(hours=2)))
    assert (
        write_prereg(tmp_path / "b.json", design, now=plus2).registered_utc
        == "2025-03-04T10:00:00Z"
    )
    with pytest.raises(PreregError, match="timezone-aware"):
        write_prereg(tmp_path / "c.json", design, now=datetime(2025, 1, 1))


def test_changing_any_leaf_of_the_design_changes_the_hash(design: Design) -> None:
    base = design.to_dict()
    h0 = design_hash(base)
    # Every leaf outside the cells, and every leaf of a control, a hierarchy and a mechanism
    # (all leaves of all cells would be ~1700 hashes; these cover every kind of field).
    sample = {0, 30, len(base["cells"]) - 1}
    paths = [p for p, _ in _leaves(base) if p[0] != "cells" or p[1] in sample]
    assert len(paths) > 150
    for path in paths:
        value = _get(base, path)
        _set(base, path, _changed(value))
        assert design_hash(base) != h0, path
        _set(base, path, value)
    assert design_hash(base) == h0


def test_load_refuses_a_file_whose_design_was_edited(registered: Path) -> None:
    doc = json.loads(registered.read_text())
    stored = doc["design_sha256"]
    paths = [p for p, _ in _leaves(doc["design"]) if p[0] not in ("cells", "scales")]
    paths += [p for p, _ in _leaves(doc["design"]) if p[:2] in (("cells", 40), ("scales", 1))]
    assert len(paths) > 40
    for path in paths:
        tampered = copy.deepcopy(doc)
        _set(tampered["design"], path, _changed(_get(doc["design"], path)))
        registered.write_text(json.dumps(tampered))
        with pytest.raises(PreregError, match="design hash mismatch") as e:
            load_prereg(registered)
        assert stored in str(e.value) and design_hash(tampered["design"]) in str(e.value)


def _get(d: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        d = d[k]
    return d


def _variants(design: Design) -> Iterator[tuple[str, Design]]:
    """One valid change to every field of the Design dataclass."""
    cell = design.cells[-1]
    scale = design.scales[-1]
    changes: dict[str, Any] = {
        "protocol": "S6b",
        "seeds": (0, 1, 2, 3),
        "verdict_seeds": (100, 101),
        "primary_metric": "heldout_ce_last",
        "gap": "other",
        "alpha": 0.025,
        "ci_level": 0.95,
        "margins": dataclasses.replace(design.margins, heldout_rel=0.004),
        "promotion_sd": 3.0,
        "selection_rule": design.selection_rule + ".",
        "lawa_checkpoints": 4,
        "inner": dataclasses.replace(design.inner, weight_decay=0.0),
        "divergence": dataclasses.replace(design.divergence, max_heldout_ratio=2.0),
        "scales": (*design.scales[:-1], dataclasses.replace(scale, wall_clock_cap_s=601)),
        "cells": (*design.cells[:-1], dataclasses.replace(cell, outer_lrs=(0.5, 1.0))),
    }
    assert set(changes) == {f.name for f in dataclasses.fields(Design)}, "a new field needs a case"
    for name, value in changes.items():
        # alpha and ci_level are tied (ci_level = 1 - 2 alpha): each variant changes both.
        extra = {"alpha": 0.025, "ci_level": 0.95} if name in ("alpha", "ci_level") else {}
        yield name, dataclasses.replace(design, **{name: value, **extra})


def test_every_design_field_changes_the_hash_and_the_old_file_is_refused(
    registered: Path, design: Design
) -> None:
    old = design_hash(design)
    for name, changed in _variants(design):
        new = design_hash(changed)
        assert new != old, name
        with pytest.raises(PreregError, match="register it anew") as e:
            verify_registered(registered, changed)
        assert old in str(e.value) and new in str(e.value), name
    assert verify_registered(registered, design).design_sha256 == old


def test_load_rejects_malformed_files(tmp_path: Path, registered: Path) -> None:
    with pytest.raises(PreregError, match="no such file"):
        load_prereg(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PreregError, match="unreadable"):
        load_prereg(bad)
    doc = json.loads(registered.read_text())
    for mutate, msg in (
        (lambda d: d.update(format="other/1"), "not a hypertrain-parity-prereg/1 file"),
        (lambda d: d.pop("design_sha256"), "missing 'design_sha256'"),
        (lambda d: d.update(registered_utc="2025-01-01 10:00"), "not UTC ISO-8601"),
        (lambda d: d["design"].pop("lawa_checkpoints"), "missing fields \\['lawa_checkpoints'\\]"),
        (lambda d: d["design"]["cells"][3].update(color="red"), "unknown fields \\['color'\\]"),
        (lambda d: d["design"]["cells"][3].update(h_g=7), "'dp-muon-lr2'.*control has m = 1"),
    ):
        d = copy.deepcopy(doc)
        mutate(d)
        if "design_sha256" in d:  # a consistent hash: the other checks must catch it
            d["design_sha256"] = design_hash(d["design"])
        bad.write_text(json.dumps(d))
        with pytest.raises(PreregError, match=msg):
            load_prereg(bad)


def test_grid_covers_s6(design: Design) -> None:
    cells = design.cells
    kinds = {c.kind for c in cells}
    assert kinds == {"control", "negative_control", "flat", "hier", "mechanism"}
    flat = [c for c in cells if c.kind == "flat"]
    assert {c.m for c in flat} == {1, 2, 4, 8, 16, 32}
    assert {c.h_g for c in flat} == {10, 30, 100}
    hier = [c for c in cells if c.kind == "hier"]
    assert {(c.regions, c.islands_per_region, c.h_r, c.h_g) for c in hier} == {
        (r, n, hr, hg)
        for r, n in ((2, 4), (4, 4), (2, 8))
        for hr in (1, 5, 10)
        for hg in (10, 30, 100)
    }
    for c in hier:  # H1's two references: flat M = R and flat M = R * n_r at the same H_g
        assert design.cell(c.baseline or "").m == c.regions
        assert design.cell(c.baseline_full or "").m == c.m
        assert design.cell(c.baseline or "").h_g == c.h_g == design.cell(c.baseline_full or "").h_g
    arms = [c for c in cells if c.kind in ("flat", "hier", "mechanism")]
    assert {c.outer for c in arms} == {"nesterov", "sparseloco"}
    assert {c.inner for c in arms} == {"adamw", "muon"}
    assert {(c.fragments > 1, c.tau > 0) for c in arms} == {
        (False, False),
        (True, False),
        (True, True),
    }
    assert {c.anneal for c in arms} == {"full_m", "m1"} and {c.lawa for c in arms} == {True, False}
    for c in arms:
        assert c.outer_lrs == (0.4, 0.6, 0.8, 1.0)
        assert c.outer_momentum == (0.9 if c.outer == "nesterov" else 0.0)
    for c in (c for c in cells if c.kind == "mechanism"):
        b = design.cell(c.baseline or "")
        assert (b.kind, b.m, b.h_g) == ("flat", c.m, c.h_g)
    controls = {c.id: c for c in cells if c.kind == "control"}
    assert controls["dp-adamw"].inner_lr == flat[0].inner_lr != controls["dp-adamw-lr2"].inner_lr
    assert {design.cell(c.control or "").inner for c in arms if c.inner == "muon"} == {"muon"}
    assert design.seeds == (0, 1, 2) and design.alpha == 0.05 and design.ci_level == 0.90
    m = design.margins
    assert m == Margins(
        heldout_rel=0.005, mmlu_points=1.0, benchmark_mean_points=1.0, gsm8k_points=2.0
    )
    assert len({c.id for c in cells}) == len(cells)


def test_scales(design: Design) -> None:
    from hypertrain.common.model import PRESETS

    full = design.scale("full")
    assert (full.steps, full.n_layer, full.d_model, full.seq_len) == (3000, 4, 128, 256)
    assert (full.global_batch, full.holdout_windows, full.cells) == (32, 512, None)
    assert len(design.cells_of("full")) == len(design.cells)
    for s in design.scales:
        p = PRESETS[s.model]
        assert (p.n_layer, p.d_model, p.n_head, p.seq_len) == (
            s.n_layer,
            s.d_model,
            s.n_head,
            s.seq_len,
        )
        assert s.wall_clock_cap_s > 0 and s.process_cap >= 1
        assert "negctl-M1-H1-average" in {c.id for c in design.cells_of(s.name)}
    assert design.scale("cpu-tiny").process_cap <= 2
    with pytest.raises(PreregError, match="no scale 'huge'"):
        design.scale("huge")


def test_design_validation_names_the_problem(design: Design) -> None:
    dup = (*design.cells, design.cells[0])
    with pytest.raises(PreregError, match="unique"):
        dataclasses.replace(design, cells=dup)
    orphan = dataclasses.replace(design.cells[-1], baseline="flat-M3-Hg30")
    with pytest.raises(PreregError, match="baseline 'flat-M3-Hg30' is not a flat cell"):
        dataclasses.replace(design, cells=(*design.cells[:-1], orphan))
    odd = dataclasses.replace(design.scales[0], steps=3001)
    with pytest.raises(PreregError, match="not a multiple"):
        dataclasses.replace(design, scales=(odd,))
    partial = dataclasses.replace(design.scales[2], cells=("flat-M2-Hg10",))
    with pytest.raises(PreregError, match="needs its control 'dp-adamw'"):
        dataclasses.replace(design, scales=(partial,))
    with pytest.raises(PreregError, match="ci_level"):
        dataclasses.replace(design, alpha=0.1)
    with pytest.raises(PreregError, match="multiple of h_r"):
        dataclasses.replace(design.cells[-1], h_r=7)
    for bad in ((), (0.2, 0.1), (0.1, 0.1), (-0.1, 0.2)):
        with pytest.raises(PreregError, match="nesterov_outer_lrs must be distinct positive"):
            dataclasses.replace(design.scales[1], nesterov_outer_lrs=bad)


def test_divergence_rule() -> None:
    rule = Divergence()
    assert rule.check(5.5, 2.0, False) == (False, "")
    assert rule.check(5.5, 2.0, True)[0] and rule.check(5.5, float("nan"), False)[0]
    assert rule.check(5.5, 5.6, False)[0]


def test_cli_writes_checks_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    assert main(["--write-prereg", str(path)]) == 0
    stamp = json.loads(path.read_text())["registered_utc"]
    assert main(["--write-prereg", str(path)]) == 0  # same design: the registration is kept
    assert json.loads(path.read_text())["registered_utc"] == stamp
    assert "unchanged" in capsys.readouterr().out
    assert main(["--check", str(path)]) == 0
    doc = json.loads(path.read_text())
    doc["design"]["seeds"] = [0, 1]
    path.write_text(json.dumps(doc))
    assert main(["--check", str(path)]) == 1
    assert "design hash mismatch" in capsys.readouterr().err


def test_module_entry_point_and_the_committed_file() -> None:
    """The committed registration matches the design in code (re-register after a change)."""
    assert DEFAULT_PATH == ROOT / "experiments" / "sim" / "parity_prereg.json"
    out = subprocess.run(
        [sys.executable, "-m", "hypertrain.sim.study.prereg", "--check", str(DEFAULT_PATH)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert verify_registered(DEFAULT_PATH, registered_design()).design_sha256 in out.stdout
