"""The library stays a library: ``accept_head`` never imports an entry point, and docs/architecture.md names every
one of its modules. Both are read statically (ast, text), so nothing is imported or run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "accept_head"
ENTRY_POINTS = ("data_gen", "train", "eval")
MODULES = sorted(LIBRARY.rglob("*.py"))


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every absolute import anywhere in ``tree`` (module level, functions, branches)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
    return names


def test_the_library_has_modules_to_check() -> None:
    names = {path.relative_to(LIBRARY).as_posix() for path in MODULES}
    assert {"__init__.py", "decoding.py", "labelgen/run.py", "training/cli.py"} <= names


def test_imported_names_sees_imports_inside_functions_and_skips_relative_ones() -> None:
    tree = ast.parse("import os\ndef f():\n    from train.cli import cli_main\n    from .eval import x\n")
    assert imported_names(tree) == [(1, "os"), (3, "train.cli")]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(LIBRARY).as_posix())
def test_no_library_module_imports_an_entry_point(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [f"line {line}: {name}" for line, name in imported_names(tree) if name.split(".")[0] in ENTRY_POINTS]
    assert not bad, (
        f"{path.relative_to(REPO)} imports an entry point ({', '.join(bad)}); "
        "move what it needs into accept_head/ and import it from there."
    )


def test_every_library_module_is_named_in_docs_architecture() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = []
    for path in MODULES:
        name = path.relative_to(LIBRARY).as_posix()  # e.g. decoding.py, labelgen/run.py
        # The name must stand alone: `feature_draft.py` is not named by `training/feature_draft.py`.
        if not re.search(rf"(?<![\w/.]){re.escape(name)}(?![\w/])", doc):
            missing.append(name)
    assert not missing, (
        f"docs/architecture.md does not name {missing} (paths relative to accept_head/); "
        "add a one-line entry for each to its module table."
    )


def test_every_library_package_is_installed() -> None:
    """A sub-package missing from pyproject's package list imports from the repository, not after ``pip install``."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {".".join(p.parent.relative_to(REPO).parts) for p in LIBRARY.rglob("__init__.py")}
    assert packages <= listed, f"add {sorted(packages - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_entry_points_are_argument_parsing_only() -> None:
    """``data_gen/``, ``train/`` and ``eval/`` parse flags and call the library; their code lives in ``accept_head``."""
    for name in ENTRY_POINTS:
        lines = sum(len(p.read_text().splitlines()) for p in (REPO / name).glob("*.py"))
        assert lines < 200, f"{name}/ holds {lines} lines; move the logic into accept_head/ and call it from there"


def test_entry_points_install_only_under_a_namespaced_package() -> None:
    """``pip install`` must not put generic top-level names (``train``, ``eval``) into site-packages, and every console
    script must name a function that exists in the entry point it is mapped to."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    assert {name.split(".")[0] for name in setuptools["packages"]} == {"accept_head", "accept_head_cli"}
    mapped = setuptools["package-dir"]
    assert {mapped[f"accept_head_cli.{name}"] for name in ENTRY_POINTS} == set(ENTRY_POINTS)
    for script, target in project["project"]["scripts"].items():
        module, function = target.split(":")
        parts = module.split(".")
        if parts[0] == "accept_head_cli":
            parts = [mapped[".".join(parts[:2])], *parts[2:]]
        source = REPO.joinpath(*parts[:-1], f"{parts[-1]}.py")
        defined = {node.name for node in ast.parse(source.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert function in defined, f"console script {script} names {target}, but {source} defines no {function}()"
