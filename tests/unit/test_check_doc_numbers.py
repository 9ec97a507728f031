"""scripts/check_doc_numbers.py: run as a real process on a temporary tree, and on the repo's docs/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_doc_numbers.py"

SUMMARY = {
    "cells": [
        {"id": "dp-adamw", "gap": {"mean": 0.0}},
        {
            "id": "flat-M8-Hg30",
            "gap": {"mean": 0.012456, "n": 3},
            "verdict": "equivalent at delta = 0.005",
        },
    ],
    "by_id": {"hier-2x4-Hr5-Hg30": {"p": 0.0175, "ok": True, "tau": None}},
    "eta": {"0.4": 2.5},
}
GOOD = """# Results

The gap at M = 8 is <!--num experiments/results/summary.json:cells[1].gap.mean x100 %.2f-->1.25<!--/num-->%
over <!--num experiments/results/summary.json:cells[1].gap.n-->3<!--/num--> seeds,
verdict: <!--num experiments/results/summary.json:cells[1].verdict-->equivalent at delta = 0.005<!--/num-->.
p = <!--num experiments/results/summary.json:by_id["hier-2x4-Hr5-Hg30"].p-->0.018<!--/num--> (rounded as printed),
two on one line: <!--num experiments/results/summary.json:cells[-1].gap.n %d-->3<!--/num--> and
<!--num experiments/results/summary.json:eta["0.4"]-->2.5<!--/num-->, flags
<!--num experiments/results/summary.json:by_id.hier-2x4-Hr5-Hg30.ok-->true<!--/num--> and
<!--num experiments/results/summary.json:by_id.hier-2x4-Hr5-Hg30.tau-->n/a<!--/num-->;
row <!--num experiments/results/runs.jsonl:[1].loss %.3f-->2.346<!--/num-->,
csv <!--num experiments/results/grid.csv:[0].loss-->2.35<!--/num-->.

```
<!--num experiments/results/summary.json:no.such.key-->9<!--/num-->  (inside a code block: not checked)
```
and `<!--num nofile.json:x-->1<!--/num-->` in a code span is not checked either.
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    res = tmp_path / "experiments" / "results"
    res.mkdir(parents=True)
    (res / "summary.json").write_text(json.dumps(SUMMARY))
    (res / "runs.jsonl").write_text('{"loss": 2.3}\n{"loss": 2.3456}\n')
    (res / "grid.csv").write_text("cell,loss\nflat-M8-Hg30,2.3501\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text(GOOD)
    return tmp_path


def _run(root: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *paths],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _with(tree: Path, line: str) -> Path:
    doc = tree / "docs" / "results.md"
    doc.write_text(GOOD + "\n" + line + "\n")
    return doc


def test_passes_on_a_correct_doc(tree: Path) -> None:
    out = _run(tree)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout == ""
    assert "10 tag(s) in 1 file(s), all match" in out.stderr


def test_fails_on_a_wrong_number_naming_tag_file_key_and_both_values(tree: Path) -> None:
    _with(
        tree,
        "bad: <!--num experiments/results/summary.json:cells[1].gap.mean x100 %.2f-->1.30<!--/num-->",
    )
    out = _run(tree)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("docs/results.md:19: ")
    assert "<!--num experiments/results/summary.json:cells[1].gap.mean x100 %.2f-->" in line
    assert "experiments/results/summary.json key cells[1].gap.mean" in line
    assert "printed 1.30" in line and "0.012456" in line and "x100 %.2f -> 1.25" in line


def test_rounding_without_a_format_is_checked(tree: Path) -> None:
    _with(
        tree,
        "<!--num experiments/results/summary.json:by_id.hier-2x4-Hr5-Hg30.p-->0.019<!--/num-->",
    )
    out = _run(tree)
    assert out.returncode == 1 and "printed 0.019, file has 0.0175 (-> 0.018)" in out.stdout


def test_fails_on_a_missing_key(tree: Path) -> None:
    _with(tree, "<!--num experiments/results/summary.json:cells[1].gap.median-->1<!--/num-->")
    out = _run(tree)
    assert out.returncode == 1
    assert (
        "missing key cells[1].gap.median: no 'median' at cells[1].gap (has: mean, n)" in out.stdout
    )
    _with(tree, "<!--num experiments/results/summary.json:cells[5].gap-->1<!--/num-->")
    out = _run(tree)
    assert "index 5 out of range at cells (length 2)" in out.stdout


def test_fails_on_a_missing_file(tree: Path) -> None:
    _with(tree, "<!--num experiments/results/nothing.json:a.b-->1<!--/num-->")
    out = _run(tree)
    assert out.returncode == 1
    assert "tag <!--num experiments/results/nothing.json:a.b-->" in out.stdout
    assert "missing file" in out.stdout and "nothing.json (wanted key a.b)" in out.stdout


def test_fails_on_a_wrong_string_and_a_malformed_tag(tree: Path) -> None:
    _with(
        tree,
        "<!--num experiments/results/summary.json:cells[1].verdict-->within noise<!--/num-->\n"
        "<!--num experiments/results/summary.json:cells[0].id-->dp<!--/num \n"
        "<!--num experiments/results/summary.json-->1<!--/num-->",
    )
    out = _run(tree)
    assert out.returncode == 1
    text = out.stdout
    assert "printed 'within noise', file has 'equivalent at delta = 0.005'" in text
    assert "docs/results.md:20: unclosed or malformed" in text
    assert "malformed tag (want FILE:KEY [xSCALE] [FORMAT])" in text
    assert len(text.splitlines()) == 3


def test_the_repository_docs_pass() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_generated_parity_tables_pass_and_a_changed_value_fails(tmp_path: Path) -> None:
    """scripts/parity_tables.py prints tags the checker accepts, for every committed grid
    (the parity registrations, the churn study and the exploratory ones)."""
    summaries = sorted(ROOT.glob("experiments/results/*/summary.json"))
    assert any(s.parent.name.startswith("parity-") for s in summaries), "no parity grid summary"
    (tmp_path / "docs").mkdir()
    for summary in summaries:
        rel = summary.relative_to(ROOT)
        (tmp_path / rel).parent.mkdir(parents=True)
        (tmp_path / rel).write_bytes(summary.read_bytes())
        tables = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "parity_tables.py"), str(rel)],
            capture_output=True, text=True, timeout=60, cwd=ROOT, check=True,
        ).stdout  # fmt: skip
        assert tables.count("<!--num ") > (50 if rel.parent.name.startswith("parity") else 5)
        (tmp_path / "docs" / f"{rel.parent.name}.md").write_text(tables)
    out = _run(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    # The same tables after the summary's numbers move: the checker notices.
    rel = Path("experiments/results/parity-cpu-tiny/summary.json")
    data = json.loads((tmp_path / rel).read_text())
    seed0 = str(data["seeds"][0])
    data["cells"]["dp-adamw"]["losses"][seed0] += 0.01
    (tmp_path / rel).write_text(json.dumps(data))
    out = _run(tmp_path)
    assert out.returncode == 1
    assert f'cells["dp-adamw"].losses["{seed0}"]' in out.stdout + out.stderr
