"""Repository layout rules: the package list covers every code folder; common/ stays gRPC-free."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_ROOTS = ["entry", "common", "services", "proto", "experiments"]


def _package_dirs() -> dict[str, str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = cfg["package-dir"]
    assert sorted(cfg["packages"]) == sorted(mapping), "packages and package-dir disagree"
    return mapping


def test_every_folder_with_python_code_is_a_listed_package() -> None:
    listed = {str((ROOT / d).resolve()) for d in _package_dirs().values()}
    missing = []
    for top in CODE_ROOTS:
        for py in (ROOT / top).rglob("*.py") if (ROOT / top).exists() else []:
            if "__pycache__" in py.parts:
                continue
            if str(py.parent.resolve()) not in listed:
                missing.append(str(py.relative_to(ROOT)))
    assert not missing, f"not in pyproject's package list (would drop out of the wheel): {missing}"


def test_listed_packages_have_init_files() -> None:
    for pkg, folder in _package_dirs().items():
        assert (ROOT / folder / "__init__.py").is_file(), f"{pkg}: {folder}/__init__.py missing"


ENTRY_MODULES = {p.stem for p in (ROOT / "entry").glob("*.py") if p.stem != "__init__"}
TRANSPORT = ("grpc", "hypertrain.wire", "hypertrain.v1")
DAEMONS = ("hypertrain.island", "hypertrain.relay", "hypertrain.aggregator")
ENTRY = tuple(f"hypertrain.{m}" for m in ENTRY_MODULES)


def _imports(folder: str) -> dict[str, set[str]]:
    """Every module each file under ``folder`` imports (``from a import b`` gives a and a.b)."""
    out: dict[str, set[str]] = {}
    for py in (ROOT / folder).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(py.read_text(), filename=str(py))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        out[str(py.relative_to(ROOT))] = names
    return out


def _offenders(folder: str, banned: tuple[str, ...]) -> list[str]:
    """Imports under ``folder`` of a banned module (generated protobuf code counts as the
    transport when ``grpc`` is banned)."""
    bad = []
    for path, names in _imports(folder).items():
        for name in sorted(names):
            hit = any(name == b or name.startswith(b + ".") for b in banned)
            generated = "grpc" in banned and name.endswith(("_pb2", "_pb2_grpc"))
            if hit or generated:
                bad.append(f"{path}: {name}")
    return bad


def test_the_core_imports_no_transport_daemon_simulator_or_entry_code() -> None:
    """common/ is the pure core: no gRPC, no wire, no generated code, no driver."""
    banned = (*TRANSPORT, *DAEMONS, "hypertrain.sim", *ENTRY)
    assert not _offenders("common", banned), _offenders("common", banned)


def test_no_daemon_imports_another() -> None:
    for daemon in ("island", "relay", "aggregator"):
        others = tuple(d for d in DAEMONS if not d.endswith(daemon))
        bad = _offenders(f"services/{daemon}", (*others, "hypertrain.sim"))
        assert not bad, bad


def test_the_simulator_imports_no_transport_daemon_or_entry_code() -> None:
    """The simulator (engine, study, chaos) drives the core in one process: the fault
    simulation uses the in-process transport of the core, never gRPC."""
    bad = _offenders("experiments", (*TRANSPORT, *DAEMONS, *ENTRY))
    assert not bad, bad


def test_wire_imports_no_entry_code_and_no_daemon() -> None:
    bad = _offenders("services/wire", (*ENTRY, *DAEMONS, "hypertrain.sim"))
    assert not bad, bad


def test_the_layout_rules_can_fail() -> None:
    """The checker sees an import where there is one (it cannot pass vacuously)."""
    assert _offenders("services/relay", ("hypertrain.wire",))
    assert _offenders("entry", ("hypertrain.common",))
