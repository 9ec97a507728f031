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


def test_common_never_imports_grpc_or_generated_code() -> None:
    offenders = []
    for py in (ROOT / "common").rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text(), filename=str(py))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            for name in names:
                if (
                    name.split(".")[0] == "grpc"
                    or name.endswith(("_pb2", "_pb2_grpc"))
                    or (
                        name.startswith("hypertrain.")
                        and name.split(".")[1] in ("island", "relay", "aggregator", "proto")
                    )
                ):
                    offenders.append(f"{py.relative_to(ROOT)}: {name}")
    assert not offenders, f"common/ must stay free of gRPC and driver imports: {offenders}"
