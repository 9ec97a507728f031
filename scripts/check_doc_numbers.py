#!/usr/bin/env python3
"""Verify every tagged number in the docs against the result file it names (docs/design.md §7.12).

    python scripts/check_doc_numbers.py                 # every docs/*.md of the repo
    python scripts/check_doc_numbers.py docs/parity.md  # some files or folders
    python scripts/check_doc_numbers.py --root /tmp/x   # another tree (docs/ under it)

Exit 0 when every tag matches; 1 otherwise, with one line per problem
(``doc:line: tag ...: what is wrong``); 2 on bad arguments.

Tag syntax (one line, invisible when the markdown is rendered)::

    <!--num FILE:KEY [xSCALE] [FORMAT]-->PRINTED<!--/num-->

- FILE: a path relative to the root (the repository), e.g.
  ``experiments/results/summary.json``.  ``.json`` is one document; ``.jsonl``
  is a list of its rows (one JSON value per line); ``.csv`` is a list of row
  objects, cells that parse as numbers becoming numbers.
- KEY: a path into it: names joined by dots, list indices and quoted names in
  brackets: ``h1[0].vs_flat_r.tost.ci.hi``, ``cells["flat-M8-Hg30"].gap``,
  ``[2].loss`` (a list at the root), ``rows[-1].step``.  A bare name may hold
  letters, digits, ``_`` and ``-``; anything else goes in ``["..."]``.  No spaces.
- xSCALE (optional): multiply the value first, e.g. ``x100`` for percent.
- FORMAT (optional): a printf format, e.g. ``%.2f``, ``%.3g``, ``%.1e``, ``%+.2f``;
  the value formatted with it must equal PRINTED exactly.  Without FORMAT,
  PRINTED is a number and must be the value rounded to PRINTED's own decimals
  (``1.23`` accepts 1.2251..1.2349, either way at an exact tie).
- A string value (e.g. a verdict) must equal PRINTED exactly (no SCALE or
  FORMAT); ``true``/``false`` print as such; a JSON null prints as ``n/a``.

Tags inside fenced code blocks and inline code spans are not checked, so the
syntax can be shown in a document.  Every problem names the tag, the file, the
key, and both the printed and the file's value.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r"<!--num\s+(?P<spec>[^>]*?)\s*-->(?P<printed>.*?)<!--/num-->")
OPEN = re.compile(r"<!--num\b")
SPEC = re.compile(
    r"^(?P<file>[^\s:]+):(?P<key>\S+)(?:\s+x(?P<scale>[-+0-9.eE]+))?(?:\s+(?P<fmt>%\S+))?$"
)
STEP = re.compile(r'\.?(?P<name>[A-Za-z0-9_-]+)|\[(?P<index>-?\d+)\]|\["(?P<quoted>[^"]*)"\]')
NUMBER = re.compile(r"^[+-]?(?P<int>\d+)(?:\.(?P<frac>\d*))?(?:[eE](?P<exp>[+-]?\d+))?$")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:.*?)\1")


class Problem(Exception):
    """One mismatch; its message is the rest of the report line."""


def parse_key(key: str) -> list[str | int]:
    """``a.b[3]["x.y"]`` -> ["a", "b", 3, "x.y"]; Problem if it does not parse."""
    steps: list[str | int] = []
    pos = 0
    while pos < len(key):
        m = STEP.match(key, pos)
        if m is None or (m.group("name") is not None and pos > 0 and key[pos] != "."):
            raise Problem(f"malformed key {key!r} at character {pos + 1}")
        if m.group("name") is not None:
            steps.append(m.group("name"))
        elif m.group("index") is not None:
            steps.append(int(m.group("index")))
        else:
            steps.append(m.group("quoted"))
        pos = m.end()
    if not steps:
        raise Problem("empty key")
    return steps


def _show(steps: list[str | int]) -> str:
    out = ""
    for s in steps:
        if isinstance(s, int):
            out += f"[{s}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", s):
            out += f".{s}" if out else s
        else:
            out += f'["{s}"]'
    return out or "(root)"


def resolve(doc: Any, key: str) -> Any:
    """Walk ``key`` into ``doc``; Problem naming the step that failed."""
    steps = parse_key(key)
    cur = doc
    for i, step in enumerate(steps):
        here = _show(steps[:i])
        if isinstance(step, int):
            if not isinstance(cur, list):
                raise Problem(f"missing key {key}: {here} is not a list, cannot take [{step}]")
            if not -len(cur) <= step < len(cur):
                raise Problem(
                    f"missing key {key}: index {step} out of range at {here} (length {len(cur)})"
                )
            cur = cur[step]
        else:
            if isinstance(cur, list) and step.lstrip("-").isdigit():
                raise Problem(f"missing key {key}: {here} is a list, write [{step}]")
            if not isinstance(cur, dict) or step not in cur:
                if not isinstance(cur, dict):
                    raise Problem(f"missing key {key}: {here} is not an object, no {step!r}")
                known = ", ".join(sorted(map(str, cur))[:12])
                raise Problem(f"missing key {key}: no {step!r} at {here} (has: {known})")
            cur = cur[step]
    return cur


def _csv_value(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def load(path: Path) -> Any:
    """The document of a result file (.json, .jsonl or .csv); Problem if unreadable."""
    if not path.is_file():
        raise Problem(f"missing file {path}")
    try:
        text = path.read_text()
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        if path.suffix == ".csv":
            rows = csv.DictReader(text.splitlines())
            return [{k: _csv_value(v) for k, v in row.items()} for row in rows]
        return json.loads(text)
    except (OSError, ValueError) as e:
        raise Problem(f"unreadable file {path}: {e}") from None


def _rounded_match(value: float, printed: str) -> tuple[bool, str]:
    """Is ``printed`` the value rounded to printed's decimals?  (ok, value as printed)."""
    m = NUMBER.match(printed)
    if m is None:
        raise Problem(f"printed text {printed!r} is not a number (give a FORMAT for other text)")
    decimals = len(m.group("frac") or "")
    exp = int(m.group("exp") or 0)
    shown = f"{value:.{decimals}e}" if m.group("exp") else f"{value:.{decimals}f}"
    if not math.isfinite(value):
        return False, shown
    half_ulp = 0.5 * 10.0 ** (exp - decimals)
    ok = abs(value - float(printed)) <= half_ulp * (1 + 1e-9) + 1e-12 * max(1.0, abs(value))
    return ok, shown


def printed_text(value: str | bool | None) -> str:
    """How a value that is not a number prints in a doc: null as n/a, booleans lower-case."""
    if value is None:
        return "n/a"
    return str(value).lower() if isinstance(value, bool) else value


def check_tag(spec: str, printed: str, root: Path, cache: dict[Path, Any]) -> None:
    """Raise Problem unless the tag's value, scaled and formatted, equals ``printed``."""
    m = SPEC.match(spec)
    if m is None:
        raise Problem("malformed tag (want FILE:KEY [xSCALE] [FORMAT])")
    rel, key = m.group("file"), m.group("key")
    path = (root / rel) if not Path(rel).is_absolute() else Path(rel)
    if path not in cache:
        try:
            cache[path] = load(path)
        except Problem as e:
            raise Problem(f"{str(e).replace(str(path), rel)} (wanted key {key})") from None
    value = resolve(cache[path], key)
    where = f"{rel} key {key}"
    printed = printed.strip().replace("\u2212", "-")
    scale_text, fmt = m.group("scale"), m.group("fmt")
    if value is None or isinstance(value, (str, bool)):
        if scale_text or fmt:
            raise Problem(f"{where}: value {value!r} is not a number, SCALE/FORMAT do not apply")
        expected = printed_text(value)
        if printed != expected:
            raise Problem(f"{where}: printed {printed!r}, file has {expected!r}")
        return
    if not isinstance(value, (int, float)):
        raise Problem(f"{where}: value is a {type(value).__name__}, not a number")
    try:
        scaled = value * float(scale_text) if scale_text else value
    except ValueError:
        raise Problem(f"malformed scale x{scale_text}") from None
    how = " ".join(p for p in (f"x{scale_text}" if scale_text else "", fmt or "") if p)
    if fmt:
        try:
            shown = fmt % scaled
        except (TypeError, ValueError) as e:
            raise Problem(f"bad format {fmt!r}: {e}") from None
        ok = printed == shown
    else:
        ok, shown = _rounded_match(float(scaled), printed)
    if not ok:
        detail = f" ({how} -> {shown})" if how else f" (-> {shown})"
        raise Problem(f"{where}: printed {printed}, file has {value!r}{detail}")


def _lines_outside_code(text: str) -> list[tuple[int, str]]:
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, CODE_SPAN.sub("", line)))
    return out


def check_doc(doc: Path, root: Path, cache: dict[Path, Any]) -> tuple[int, list[str]]:
    """(number of tags, problem lines) for one markdown file."""
    shown = doc.relative_to(root) if doc.is_relative_to(root) else doc
    count, problems = 0, []
    for no, line in _lines_outside_code(doc.read_text()):
        tags = list(TAG.finditer(line))
        if len(OPEN.findall(line)) != len(tags):
            problems.append(f"{shown}:{no}: unclosed or malformed <!--num ...--> tag on this line")
        for t in tags:
            count += 1
            try:
                check_tag(t.group("spec"), t.group("printed"), root, cache)
            except Problem as e:
                problems.append(f"{shown}:{no}: tag <!--num {t.group('spec')}-->: {e}")
    return count, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check tagged numbers in docs against result files.")
    ap.add_argument(
        "paths", nargs="*", type=Path, help="markdown files or folders (default: ROOT/docs)"
    )
    ap.add_argument("--root", type=Path, default=ROOT, help="tag paths are relative to this")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    targets = args.paths or [root / "docs"]
    docs: list[Path] = []
    for t in targets:
        t = t if t.is_absolute() else Path.cwd() / t
        if t.is_dir():
            docs += sorted(t.rglob("*.md"))
        elif t.is_file():
            docs.append(t)
        else:
            print(f"check_doc_numbers: no such file or folder: {t}", file=sys.stderr)
            return 2
    cache: dict[Path, Any] = {}
    n_tags, problems = 0, []
    for doc in docs:
        n, p = check_doc(doc.resolve(), root, cache)
        n_tags += n
        problems += p
    for line in problems:
        print(line)
    verdict = f"{len(problems)} problem(s)" if problems else "all match"
    print(f"check_doc_numbers: {n_tags} tag(s) in {len(docs)} file(s), {verdict}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
