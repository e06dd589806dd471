"""The library stays a library: ``accept_head`` never imports an entry point, its modules import each other without a
cycle, and docs/architecture.md names every one of its modules. All are read statically (ast, text), so nothing is
imported or run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "accept_head"
ENTRY_POINTS = ("data_gen", "train", "eval")
INSTALLED_ENTRY_POINTS = "accept_head_cli"
"""The package the entry points install under (``pyproject.toml``'s ``package-dir``); the library imports it neither."""
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
    assert {"__init__.py", "chain/decoding.py", "labelgen/run.py", "training/cli.py"} <= names


def test_imported_names_sees_imports_inside_functions_and_skips_relative_ones() -> None:
    tree = ast.parse("import os\ndef f():\n    from train.cli import cli_main\n    from .eval import x\n")
    assert imported_names(tree) == [(1, "os"), (3, "train.cli")]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(LIBRARY).as_posix())
def test_no_library_module_imports_an_entry_point(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    entry_points = (*ENTRY_POINTS, INSTALLED_ENTRY_POINTS)
    bad = [f"line {line}: {name}" for line, name in imported_names(tree) if name.split(".")[0] in entry_points]
    assert not bad, (
        f"{path.relative_to(REPO)} imports an entry point ({', '.join(bad)}); "
        "move what it needs into accept_head/ and import it from there."
    )


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path`` below ``root`` (``accept_head/labelgen/__init__.py`` →
    ``accept_head.labelgen``)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the modules of ``package`` (a folder), from every import statement
    anywhere in a module — at module level, inside functions, under ``if TYPE_CHECKING`` — relative or absolute.
    ``from .x import y`` is an edge to ``x.y`` when that is a module, else to ``x``; imports of anything outside
    ``package`` are left out."""
    root = package.parent
    paths = {module_name(path, root): path for path in sorted(package.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {name: {} for name in paths}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]  # the importing package
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # level 1 is the importing package itself, each further dot one package up
                parts = (here[: len(here) - node.level + 1] if node.level else []) + (
                    [node.module] if node.module else []
                )
                base = ".".join(parts)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in paths:  # `from a.b.pairs import x` → a.b.pairs
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def tangled_groups(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The groups of two or more modules that all reach each other through imports (the strongly connected
    components, by Tarjan's algorithm); empty when the graph has no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:  # node is the root of a group: everything above it on the stack
            group = set(stack[stack.index(node) :])
            del stack[stack.index(node) :]
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def shortest_cycle(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A shortest cycle ``[a, b, ..., a]`` through the alphabetically first module of ``group`` (breadth-first)."""
    start = min(group)
    parent: dict[str, str] = {}
    frontier = [start]
    while start not in parent:
        reached = []
        for node in frontier:
            for other in sorted(graph[node]):
                if other in group and other not in parent:
                    parent[other] = node
                    reached.append(other)
        frontier = reached
    cycle = [start, parent[start]]
    while cycle[-1] != start:
        cycle.append(parent[cycle[-1]])
    return cycle[::-1]


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """``a (line 3) → b (line 9) → a``: each module with the line of its import of the next."""
    return " → ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" → {cycle[-1]}"


def test_import_graph_sees_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("from .sub import b\ndef f():\n    pass\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("import os\ndef g():\n    from ..c import h\n")
    (package / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import f\n")
    (package / "d.py").write_text("from . import c\nfrom .a import f\n")  # imports into the cycle, not part of it
    graph = import_graph(package)
    assert graph["pkg"] == {"pkg.a": 1} and graph["pkg.d"] == {"pkg.c": 1, "pkg.a": 2}
    assert tangled_groups(graph) == [{"pkg.a", "pkg.sub.b", "pkg.c"}]
    cycle = shortest_cycle(graph, {"pkg.a", "pkg.sub.b", "pkg.c"})
    assert describe_cycle(cycle, graph) == "pkg.a (line 1) → pkg.sub.b (line 3) → pkg.c (line 3) → pkg.a"
    (package / "c.py").write_text("import typing\n")
    assert tangled_groups(import_graph(package)) == []


def test_the_library_imports_without_a_cycle() -> None:
    """Every import counts, including those inside functions: a cycle hidden from Python by a function-level import
    still makes a reader go round it. Lower modules must not import higher ones (docs/architecture.md, "Loading")."""
    graph = import_graph(LIBRARY)
    assert "accept_head.models.pairs" in graph and graph["accept_head.specdecpp.bundle"], "the graph found no imports"
    tangles = [
        f"{len(group)} modules {sorted(group)} import each other, e.g. "
        + describe_cycle(shortest_cycle(graph, group), graph)
        for group in tangled_groups(graph)
    ]
    assert not tangles, "import cycles in accept_head/:\n  " + "\n  ".join(tangles)


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


LAYERS = (
    ("core",),
    ("models",),
    ("acceptance",),
    ("chain",),
    ("trees", "labelgen"),
    ("learning_free", "specdecpp"),
    ("engine",),
    ("training",),
    ("evaluation",),
)
"""The sub-packages of ``accept_head`` from the bottom up: each imports only packages on lower floors (never one on
its own floor or above). ``accept_head/__init__.py`` and ``__main__.py`` stand above them all."""
MAX_FLOORS = 10
MAX_ENTRIES = 13
"""``accept_head/``'s top level: ``__init__.py``, ``__main__.py`` and the sub-packages."""
MAX_MODULES = 14
"""Modules in one folder, ``__init__.py`` included."""


def package_of(module: str) -> str:
    """The sub-package a library module belongs to (``accept_head.chain.decoding`` → ``chain``), or the module itself
    for ``accept_head`` and ``accept_head.__main__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (LIBRARY / parts[1]).is_dir() else module


def package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """``{package: {imported package: 'module → module'}}``: the module graph with each sub-package as one node."""
    out: dict[str, dict[str, str]] = {}
    for module, imported in graph.items():
        edges = out.setdefault(package_of(module), {})
        for other in imported:
            if package_of(other) != package_of(module):
                edges.setdefault(package_of(other), f"{module} (line {imported[other]}) → {other}")
    return out


def floors(graph: dict[str, dict]) -> int:
    """The longest import chain of an acyclic graph, counted in nodes (a node importing nothing is floor 1)."""
    memo: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in memo:
            memo[node] = 1 + max((floor(other) for other in graph[node]), default=0)
        return memo[node]

    return max(floor(node) for node in graph)


def test_every_sub_package_has_a_floor_and_says_what_it_owns() -> None:
    folders = {path.name for path in LIBRARY.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert folders == {name for layer in LAYERS for name in layer}, "add the new sub-package to LAYERS"
    for name in folders:
        doc = ast.get_docstring(ast.parse((LIBRARY / name / "__init__.py").read_text()))
        assert doc, f"accept_head/{name}/__init__.py needs a docstring saying what the package owns"


def test_each_sub_package_imports_only_those_below_it() -> None:
    floor = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward = [
        f"{package} imports {other}: {how}"
        for package, edges in package_graph(import_graph(LIBRARY)).items()
        for other, how in edges.items()
        if package in floor and (other not in floor or floor[other] >= floor[package])
    ]
    assert not upward, "imports that are not downward:\n  " + "\n  ".join(upward)


def test_floors_counts_the_longest_chain() -> None:
    assert floors({"a": {"b": 1}, "b": {"c": 1}, "c": {}, "d": {"c": 1}}) == 3


def test_the_package_graph_is_low_and_the_folders_small() -> None:
    packages = package_graph(import_graph(LIBRARY))
    assert floors(packages) <= MAX_FLOORS, f"the sub-packages stand {floors(packages)} floors high"
    entries = sorted(p.name for p in LIBRARY.iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_ENTRIES, f"accept_head/ holds {len(entries)} entries: {entries}"
    for folder in [LIBRARY, *(p for p in LIBRARY.iterdir() if p.is_dir() and p.name != "__pycache__")]:
        modules = list(folder.glob("*.py"))
        assert len(modules) <= MAX_MODULES, f"{folder.relative_to(REPO)} holds {len(modules)} modules"


def long_functions(folder: Path, limit: int) -> list[str]:
    """``path:line name (N lines)`` of every function and method under ``folder`` longer than ``limit`` lines, its
    docstring included (``end_lineno - lineno + 1``, from the ``def`` line)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(REPO).as_posix()}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_library_function_is_over_80_lines() -> None:
    """A command reads as its named steps (load, choose on validation, run, write) and a decoder as its numbered round,
    each short enough to read whole, the way gpt-fast's ``generate`` does."""
    long = long_functions(LIBRARY, 80)
    assert not long, "split these into named steps (≤ 80 lines each, docstring included):\n  " + "\n  ".join(long)
