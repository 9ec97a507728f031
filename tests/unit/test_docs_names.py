"""Every code name and repository path written in the docs resolves.

Documents checked: ``docs/*.md``, ``README.md``, ``services/*/README.md``, ``deploy/README.md``.
Citations ``docs/design.md §N`` (or ``§N.M``) anywhere in the repository's text files must name
a section heading of docs/design.md.

The rule, precisely.  Text is split into fenced code blocks (``` or ~~~) and paragraphs; an
inline code span is a run of one or more backticks, its text, and the same run again (it may
wrap lines inside one paragraph).  Braces expand first: ``hypertrain.{island,relay}`` is
checked as ``hypertrain.island`` and ``hypertrain.relay``.

In an inline code span, after stripping spaces and one trailing argument list ``(...)``:

1. ``PATH: NAME`` with PATH ending in ``.py`` (``common/roles.py: IslandCore``): PATH must
   exist (relative to the repository root) and NAME must resolve inside the module PATH is,
   found through pyproject's ``package-dir`` mapping.
2. A dotted name, identifiers joined by dots (``module.Class.method``, ``Class.method``,
   ``hypertrain.x.y``), whose last part is not a file extension (``state.pt``, ``README.md``
   are file names, not code): it must resolve by its first part:

   - ``hypertrain``: import it, then walk the rest;
   - a CamelCase name (starts upper case, has a lower-case letter, no underscore): a class of
     that name defined in some ``hypertrain.*`` module (every module is walked with pkgutil);
     any such class that has the rest of the path will do;
   - a lower-case name: the last part of a ``hypertrain.*`` module (``ledger.transfer_message``
     is ``hypertrain.common.trust.ledger.transfer_message``), else an importable top-level
     module (``torch.optim.SGD``);
   - anything else (``F.linear``, ``EF_i.encode``) fails: write the full module path.

   Walking the rest: an attribute (``getattr``), a submodule (imported), or, on a class, an
   instance attribute: annotated on the class or one of its hypertrain bases, or assigned as
   ``self.NAME`` in their source.  Past an instance attribute the path is not checked further.
3. A repository path: no spaces and none of ``< > $ ~ = : *``, at least one ``/``, not
   starting with ``/`` or ``.``, whose first part is an entry of the repository root or of
   the document's own folder (``deploy/README.md`` writes ``k8s/aggregator.yaml``): it must
   exist relative to that base.  Other slashed words (``checkpoints/round-N.pt``, a path on a
   deployed host, ``nvidia.com/gpu``) are not repository paths and are not checked.

In a fenced block only the unambiguous code names are checked: dotted names whose first part
is ``hypertrain`` or a CamelCase class (rule 2).  Pseudo-code (``base.sub_(mean)``), shell and
paths there are left alone.  Relative markdown link targets (``[text](../deploy/README.md)``)
must exist relative to the document.

``test_checker_catches_planted_names`` plants a nonexistent name of every form, so the checker
cannot pass by checking nothing.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"


def documents() -> list[Path]:
    docs = sorted((ROOT / "docs").glob("*.md"))
    docs += [ROOT / "README.md", *sorted(ROOT.glob("services/*/README.md"))]
    docs.append(ROOT / "deploy" / "README.md")
    return [d for d in docs if d.is_file()]


# -- reading markdown -----------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass(frozen=True, slots=True)
class Code:
    """One piece of code text of a document: an inline span or a fenced block."""

    line: int
    text: str
    fenced: bool


def _blocks(text: str) -> Iterator[tuple[int, str, bool]]:
    """(first line, text, fenced?) for each fenced block and each paragraph outside them."""
    lines = text.splitlines()
    i, para, start = 0, [], 1
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            if para:
                yield start, "\n".join(para), False
                para = []
            fence, body, j = m.group(1), [], i + 1
            while j < len(lines) and not lines[j].lstrip().startswith(fence):
                body.append(lines[j])
                j += 1
            yield i + 2, "\n".join(body), True
            i = j + 1
            continue
        if lines[i].strip():
            if not para:
                start = i + 1
            para.append(lines[i])
        elif para:
            yield start, "\n".join(para), False
            para = []
        i += 1
    if para:
        yield start, "\n".join(para), False


def code_of(text: str) -> list[Code]:
    out = []
    for start, block, fenced in _blocks(text):
        if fenced:
            out.append(Code(start, block, True))
            continue
        for m in SPAN.finditer(block):
            out.append(Code(start + block.count("\n", 0, m.start()), m.group(2), False))
    return out


def links_of(text: str) -> list[tuple[int, str]]:
    out = []
    for start, block, fenced in _blocks(text):
        if fenced:
            continue
        plain = SPAN.sub(lambda m: " " * len(m.group(0)), block)
        for m in LINK.finditer(plain):
            out.append((start + block.count("\n", 0, m.start()), m.group(1)))
    return out


def expand_braces(text: str) -> list[str]:
    """``a{b,c}d{e,f}`` -> abde, abdf, acde, acdf (no nesting)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", text)
    if m is None:
        return [text]
    head, tail = text[: m.start()], text[m.end() :]
    return [x for alt in m.group(1).split(",") for x in expand_braces(head + alt + tail)]


# -- what a span names ------------------------------------------------------------------

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"^{IDENT}(?:\.{IDENT})+$")
CALL = re.compile(r"^(?P<name>[^()\s]+)\(.*\)$", re.DOTALL)
PATH_NAME = re.compile(rf"^(?P<path>[\w./-]+\.py)\s*:\s*(?P<name>{IDENT}(?:\.{IDENT})*)$")
REPO_PATH = re.compile(r"^[\w.@-]+(?:/[\w.@-]+)*/?$")
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
# In a fenced block: hypertrain.x.y or CamelCase.x, not inside a longer word or path.
FENCED_NAME = re.compile(rf"(?<![\w./-])((?:hypertrain|[A-Z][A-Za-z0-9_]*)(?:\.{IDENT})+)")
_EXTENSIONS = "py pyi md json jsonl csv png svg pt toml yaml yml txt key env service sysusers sh"
FILE_EXTENSIONS = frozenset(
    f"{_EXTENSIONS} proto log gz tar whl cfg ini lock conf pem crt html dockerignore".split(" ")
)


def is_camel(name: str) -> bool:
    return bool(CAMEL.match(name)) and any(c.islower() for c in name)


def is_file_name(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].lower() in FILE_EXTENSIONS


@cache
def package_dirs() -> dict[str, str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(cfg["tool"]["setuptools"]["package-dir"])


def module_of_path(rel: str) -> str | None:
    """The import name of a ``.py`` file of the repository (pyproject's package-dir)."""
    parent, stem = rel.rsplit("/", 1) if "/" in rel else ("", rel)
    stem = stem.removesuffix(".py")
    best: tuple[int, str] | None = None
    for package, folder in package_dirs().items():
        if parent == folder or parent.startswith(folder + "/"):
            rest = parent[len(folder) :].strip("/")
            name = ".".join(p for p in (package, rest.replace("/", "."), stem) if p)
            if best is None or len(folder) > best[0]:
                best = (len(folder), name.removesuffix(".__init__"))
    return None if best is None else best[1]


@cache
def hypertrain_modules() -> tuple[dict[str, ModuleType], dict[str, str]]:
    """Every importable ``hypertrain.*`` module, and the import error of each that is not."""
    import hypertrain

    mods: dict[str, ModuleType] = {"hypertrain": hypertrain}
    errors: dict[str, str] = {}

    def failed(name: str) -> None:
        errors[name] = repr(sys.exc_info()[1])

    for info in pkgutil.walk_packages(hypertrain.__path__, "hypertrain.", onerror=failed):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            mods[info.name] = importlib.import_module(info.name)
        except Exception as e:
            errors[info.name] = repr(e)
    return mods, errors


@cache
def hypertrain_classes() -> dict[str, list[type]]:
    """Class name -> the classes of that name defined in hypertrain modules."""
    out: dict[str, list[type]] = {}
    for mod in hypertrain_modules()[0].values():
        for value in vars(mod).values():
            if (
                isinstance(value, type)
                and str(getattr(value, "__module__", "")).startswith("hypertrain")
                and value not in out.setdefault(value.__name__, [])
            ):
                out[value.__name__].append(value)
    return out


@cache
def instance_attributes(cls: type) -> frozenset[str]:
    """Names annotated on ``cls`` (or a hypertrain base) or assigned as ``self.NAME``."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not str(getattr(base, "__module__", "")).startswith("hypertrain"):
            continue
        names.update(vars(base).get("__annotations__", {}))
        names.update(getattr(base, "__slots__", ()))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return frozenset(names)


def walk(obj: Any, parts: list[str], shown: str) -> str | None:
    """Follow ``parts`` from ``obj``; None when every part resolves, else the problem."""
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, ModuleType):
            sub = f"{obj.__name__}.{part}"
            try:  # only a package has submodules
                spec = importlib.util.find_spec(sub) if hasattr(obj, "__path__") else None
            except Exception as e:
                return f"looking for {sub} failed: {e!r}"
            if spec is None:
                return f"{shown} has no attribute or submodule {part!r}"
            if i == len(parts) - 1:
                return None  # the module exists; importing it is not needed to say so
            try:
                obj = importlib.import_module(sub)
            except Exception as e:
                return f"importing {sub} failed: {e!r}"
        elif isinstance(obj, type) and part in instance_attributes(obj):
            return None  # an instance attribute: its type is not known here
        else:
            return f"{shown} has no attribute {part!r}"
        shown = f"{shown}.{part}"
    return None


def resolve(dotted: str) -> str | None:
    """None if the dotted name resolves (rule 2 of the module docstring), else why not."""
    parts = dotted.split(".")
    head, rest = parts[0], parts[1:]
    if head == "hypertrain":
        return walk(importlib.import_module("hypertrain"), rest, "hypertrain")
    if is_camel(head):
        classes = hypertrain_classes().get(head, [])
        if not classes:
            errors = hypertrain_modules()[1]
            extra = f" (modules that failed to import: {sorted(errors)})" if errors else ""
            return f"no class {head!r} is defined in any hypertrain module{extra}"
        problems = [walk(c, rest, f"{c.__module__}.{head}") for c in classes]
        return None if None in problems else problems[0]
    if head[:1].islower() or head[:1] == "_":
        mods = hypertrain_modules()[0]
        problems = [walk(m, rest, name) for name, m in mods.items() if name.split(".")[-1] == head]
        if None in problems:
            return None
        if problems:
            return problems[0]
        if importlib.util.find_spec(head) is not None:
            return walk(importlib.import_module(head), rest, head)
        return f"{head!r} is neither a hypertrain module nor an importable module"
    return (
        f"{head!r} is not `hypertrain`, a module or a hypertrain class: write its full module path"
    )


def path_problem(span: str, doc: Path) -> str | None:
    """Rule 3: None if ``span`` is no repository path, or one that exists."""
    if not REPO_PATH.match(span) or "/" not in span or span.startswith((".", "/")):
        return None
    first = span.split("/", 1)[0]
    for base in (ROOT, doc.parent):
        if first in {p.name for p in base.iterdir() if not p.name.startswith(".")}:
            if (base / span).exists():
                return None
            return f"no such file or folder: {(base / span).relative_to(ROOT)}"
    return None


def span_problems(span: str, doc: Path) -> list[str]:
    problems: list[str] = []
    for text in expand_braces(" ".join(span.split())):
        m = CALL.match(text)
        name = m.group("name") if m else text
        pn = PATH_NAME.match(text)
        if pn:
            path, attr = pn.group("path"), pn.group("name")
            if not (ROOT / path).is_file():
                problems.append(f"`{text}`: no such file {path}")
                continue
            module = module_of_path(path)
            if module is None:
                problems.append(f"`{text}`: {path} is not in a package of pyproject.toml")
                continue
            why = walk(importlib.import_module(module), attr.split("."), module)
            if why:
                problems.append(f"`{text}`: {why}")
        elif DOTTED.match(name) and not is_file_name(name):
            why = resolve(name)
            if why:
                problems.append(f"`{text}`: {why}")
        else:
            why = path_problem(text, doc)
            if why:
                problems.append(f"`{text}`: {why}")
    return problems


def fenced_problems(block: str) -> list[str]:
    problems = []
    for m in FENCED_NAME.finditer(block):
        name = m.group(1)
        head = name.split(".", 1)[0]
        if is_file_name(name) or not (head == "hypertrain" or is_camel(head)):
            continue
        why = resolve(name)
        if why:
            problems.append(f"`{name}` (code block): {why}")
    return problems


def check_document(doc: Path, text: str | None = None) -> tuple[int, list[str]]:
    """(references checked, problems as ``file:line: ...``) for one markdown document."""
    text = doc.read_text() if text is None else text
    shown = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    checked, problems = 0, []
    for code in code_of(text):
        found = fenced_problems(code.text) if code.fenced else span_problems(code.text, doc)
        checked += 1
        problems += [f"{shown}:{code.line}: {p}" for p in found]
    for line, target in links_of(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        checked += 1
        if not path.exists():
            problems.append(f"{shown}:{line}: link target {target} does not exist")
    return checked, problems


# -- design.md citations ------------------------------------------------------------------

CITATION = re.compile(r"design\.md\s*§\s*(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
SKIP_DIRS = {".git", ".venv", "build", "__pycache__", "node_modules", "results"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".proto", ".txt", ".cfg"}


def design_sections() -> set[str]:
    return set(HEADING.findall(DESIGN.read_text()))


def citations() -> Iterator[tuple[str, int, str]]:
    """(file, line, section) of every ``docs/design.md §N`` in the repository's text files."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        dirs[:] = [d for d in dirs if not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            if path.suffix not in TEXT_SUFFIXES:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for m in CITATION.finditer(text):
                yield str(path.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m.group(1)


# -- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_names_and_paths_in_docs_resolve(doc: Path) -> None:
    _, problems = check_document(doc)
    assert not problems, "names or paths in the docs that do not exist:\n" + "\n".join(problems)


def test_the_docs_are_actually_checked() -> None:
    """Not vacuous: design.md names dozens of real functions, all of them found and checked."""
    checked, problems = check_document(DESIGN)
    names = [c.text for c in code_of(DESIGN.read_text()) if not c.fenced]
    dotted = [n for n in names if DOTTED.match(n) and not is_file_name(n)]
    assert checked > 50 and len(dotted) >= 15, (checked, dotted)
    assert not problems


def test_checker_catches_planted_names(tmp_path: Path) -> None:
    planted = {
        "`hypertrain.common.roles.NoSuchThing`": "no attribute",
        "`hypertrain.common.no_such_module.f`": "no attribute or submodule",
        "`IslandCore.encode_delta`": "no attribute 'encode_delta'",
        "`NoSuchClassAnywhere.method`": "no class",
        "`ledger.no_such_function`": "no attribute",
        "`torch.optim.NoSuchOptimizer(lr=1)`": "no attribute",
        "`F.linear`": "full module path",
        "`common/roles.py: NoSuchName`": "no attribute",
        "`common/no_such_file.py: Name`": "no such file",
        "`common/no_such_folder/`": "no such file or folder",
        "`hypertrain.{common,no_such_pkg}`": "no_such_pkg",
        "[a link](../no_such_file.md)": "link target",
        "```\nx = IslandCore.schedule_merge(m)\n```": "schedule_merge",
    }
    doc = tmp_path / "planted.md"
    for text, why in planted.items():
        _, problems = check_document(doc, f"# Planted\n\n{text}\n")
        assert len(problems) == 1 and why in problems[0], (text, problems)


def test_checker_accepts_every_form_that_exists(tmp_path: Path) -> None:
    good = [
        "`hypertrain.common.aggregate.aggregate`",
        "`hypertrain.common.fragments`",
        "`ErrorFeedback.encode`",
        "`IslandCore.base`",  # an instance attribute, assigned in __init__
        "`RunConfig.threads`",  # a dataclass field
        "`ledger.transfer_message`",
        "`torch.optim.SGD(nesterov=True)`",
        "`common/roles.py: IslandCore.apply_merge`",
        "`common/codec/`",
        "`hypertrain.{island,relay,aggregator}`",
        "`state.pt`, `checkpoints/round-N.pt`, `nvidia.com/gpu`, `base - theta`",
        "```\nbase.sub_(mean); EF_i.encode(x); RegionCore.merge(blobs)\n```",
        "[the index](../README.md)",
    ]
    doc = ROOT / "docs" / "planted.md"  # never written: only its folder is used
    for text in good:
        _, problems = check_document(doc, f"# Fine\n\n{text}\n")
        assert not problems, (text, problems)


def test_design_citations_name_existing_sections() -> None:
    sections = design_sections()
    assert {str(n) for n in range(1, 9)} <= sections, sorted(sections)
    bad = [f"{f}:{line}: §{s}" for f, line, s in citations() if s not in sections]
    text = DESIGN.read_text()
    bad += [
        f"docs/design.md:{text.count(chr(10), 0, m.start()) + 1}: §{m.group(1)}"
        for m in re.finditer(r"§(\d+(?:\.\d+)*)", text)
        if m.group(1) not in sections
    ]
    assert not bad, "citations of sections docs/design.md does not have:\n" + "\n".join(bad)
