"""The code as a reader expects it, checked on every run: short files and functions, no private name imported
across modules, imports that flow one way through the layers (corpora -> retrieval -> agent -> training;
eval reads agent and corpora; ``sleuth`` is the composition root that may import anything, as may the
``bench/`` scripts and ``examples/``), and no import circle: between modules, counting imports inside
functions, nor between the sub-packages of a package (each sub-package sits on a layer of its own)."""

from __future__ import annotations

import ast
import itertools
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("corpora", "retrieval", "agent", "training", "eval", "sleuth")
#: every folder of shipped Python the checks cover: the packages, the benchmark scripts and the examples
SOURCE_DIRS = (*PACKAGES, "bench", "examples")
#: what each layer may import (besides itself); ``sleuth``, ``bench`` and ``examples`` compose the others
ALLOWED = {
    "corpora": set(),
    "retrieval": {"corpora"},
    "agent": {"corpora", "retrieval"},
    "training": {"corpora", "retrieval", "agent"},
    "eval": {"corpora", "retrieval", "agent"},
    "sleuth": set(PACKAGES),
    "bench": set(PACKAGES),
    "examples": set(PACKAGES),
}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100


def _sources(root: Path = ROOT, dirs: Iterable[str] = SOURCE_DIRS) -> list[Path]:
    return sorted(p for d in dirs for p in (root / d).rglob("*.py"))


def _rel(p: Path, root: Path = ROOT) -> str:
    return str(p.relative_to(root))


def _imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """``(module, imported names, line)`` of every absolute import in ``tree`` (nested ones included)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
    return out


def _module_name(p: Path, root: Path) -> str:
    parts = list(p.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path = ROOT, dirs: Iterable[str] = SOURCE_DIRS) -> dict[str, dict[str, int]]:
    """The import graph of the modules under ``root``'s ``dirs``: ``{module: {imported module: line}}``.

    Every import counts, at the top of a file or inside a function or class, absolute or relative.
    ``from pkg import name`` imports the module ``pkg.name`` when there is one, else ``pkg`` itself;
    ``import a.b.c`` imports ``a.b.c``. A script folder without ``__init__.py`` (``bench/``) imports its
    sibling scripts by their bare names (``import learning``). Imports of anything else (the standard
    library, third-party packages, ``tests``) are left out."""
    files = {_module_name(p, root): p for p in _sources(root, dirs)}
    graph: dict[str, dict[str, int]] = {}
    for mod, p in files.items():
        package = mod if p.name == "__init__.py" else mod.rpartition(".")[0]
        # in a script folder, `import learning` is the sibling script bench/learning.py
        scripts = package if package and not (p.parent / "__init__.py").exists() else None
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(p.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                start = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    start = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{start}.{a.name}" if _known(f"{start}.{a.name}", files, scripts) else start
                           for a in node.names]
            for t in targets:
                if (hit := _known(t, files, scripts)) is not None and hit != mod:
                    edges.setdefault(hit, node.lineno)
        graph[mod] = edges
    return graph


def _known(name: str, files: dict[str, Path], scripts: str | None) -> str | None:
    """The module of ours that ``name`` imports, or ``None``; in the script folder ``scripts`` a bare name
    may be a sibling script."""
    if name in files:
        return name
    sibling = f"{scripts}.{name}" if scripts else None
    return sibling if sibling in files else None


def _circles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """One circle ``[a, b, ..., a]`` through each strongly connected group of ``graph`` that has one
    (Tarjan's algorithm, then a shortest path back to the group's first member)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for group in groups:
        start, members = group[0], set(group)
        paths, seen = [[start]], {start}
        while paths:  # breadth first: the shortest way round
            path = paths.pop(0)
            nxt = sorted(w for w in graph.get(path[-1], ()) if w in members)
            if start in nxt:
                circles.append([*path, start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append([*path, w])
    return circles


def _layer(module: str, root: Path = ROOT) -> str:
    """The unit a module belongs to for the layering of sub-packages: its sub-package (``agent.loop`` for
    ``agent.loop.nodes``), else the module itself (a package's own top-level modules each stand alone)."""
    parts = module.split(".")
    if len(parts) >= 3 or (len(parts) == 2 and (root / parts[0] / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return module


def _describe(circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """``a -(line 3)-> b -(line 7)-> a``: the circle with the line of each import."""
    return circle[0] + "".join(f" -(line {graph[a][b]})-> {b}" for a, b in itertools.pairwise(circle))


def test_no_source_file_is_over_600_lines():
    long = {_rel(p): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_is_over_100_lines():
    long = {}
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{_rel(p)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_private_name_is_imported_across_modules():
    found = []
    for p in _sources():
        for module, names, line in _imports(ast.parse(p.read_text())):
            if module.split(".")[0] not in PACKAGES:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private or any(part.startswith("_") and not part.startswith("__") for part in module.split(".")):
                found.append(f"{_rel(p)}:{line} from {module} import {', '.join(names)}")
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_imports_flow_one_way_through_the_layers():
    found = []
    for p in _sources():
        layer = p.relative_to(ROOT).parts[0]
        for module, _names, line in _imports(ast.parse(p.read_text())):
            top = module.split(".")[0]
            if top in PACKAGES and top != layer and top not in ALLOWED[layer]:
                found.append(f"{_rel(p)}:{line} ({layer}) imports {module}")
    assert not found, "upward imports:\n" + "\n".join(found)


def test_every_folder_of_modules_is_a_package():
    """A folder of modules inside a package without ``__init__.py`` would be a namespace package: importable
    here, but left out of a built wheel and of the layering checks' sub-packages."""
    missing = sorted({_rel(p.parent) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                      if not (p.parent / "__init__.py").exists()})
    assert not missing, f"folders of modules without __init__.py: {missing}"


def test_no_import_circles_between_modules():
    """No module imports itself round a circle, however deep inside a function the import sits: a circle
    held open by an import inside a function or at the end of a file is still a circle."""
    graph = _import_graph()
    circles = [_describe(c, graph) for c in _circles(graph)]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_import_circles_between_sub_packages():
    """The sub-packages of a package are layers: with each sub-package taken as one unit (and each top-level
    module of a package as its own), the imports still run one way (e.g. ``training.infra`` <-
    ``training.algos`` <- ``training.model`` <- ``training.rollout``)."""
    layers: dict[str, set[str]] = {}
    for mod, deps in _import_graph().items():
        layers.setdefault(_layer(mod), set()).update(_layer(d) for d in deps if _layer(d) != _layer(mod))
    circles = [" -> ".join(c) for c in _circles(layers)]
    assert not circles, "import circles between sub-packages:\n" + "\n".join(circles)


def test_the_circle_check_finds_circles_through_nested_and_relative_imports(tmp_path):
    """The graph counts an import inside a function, a relative import and ``from pkg import module``; the
    check names the circle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("import os\n\n\ndef g():\n    from pkg import a\n")
    (pkg / "d.py").write_text("from pkg.a import f\n")
    graph = _import_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.sub.b": 1} and graph["pkg.sub.b"] == {"pkg.sub.c": 2}
    assert graph["pkg.sub.c"] == {"pkg.a": 5} and graph["pkg.d"] == {"pkg.a": 1}
    assert _circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]
    described = _describe(_circles(graph)[0], graph)
    assert described == "pkg.a -(line 1)-> pkg.sub.b -(line 2)-> pkg.sub.c -(line 5)-> pkg.a"
    (pkg / "sub" / "c.py").write_text("import os\n")
    assert _circles(_import_graph(tmp_path, ["pkg"])) == []


def _machine_paths() -> list[str]:
    """Absolute paths of the machine the tests run on that no committed file may name: the folder holding this
    checkout (and so its sibling checkouts), the home folder, and pytest's temporary folders. A folder that is
    the filesystem root or the temporary folder itself is left out (too general to be a machine's own)."""
    tmp = Path(tempfile.gettempdir())
    folders = {p for p in (ROOT.parent, Path.home()) if p != Path(p.anchor) and p != tmp}
    return sorted({f"{p}/" for p in folders} | {str(tmp / "pytest")})


@pytest.mark.parametrize("pattern", [*_machine_paths(), "issue #", "issue 2", "(issue "])
def test_the_project_speaks_of_itself_alone(pattern):
    """No path of the machine it is developed or tested on and no issue numbers in code, docs or committed
    results."""
    skip_dirs = {".git", ".venv", ".venv-vllm", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", "build"}
    hits = []
    for p in ROOT.rglob("*"):
        if not p.is_file() or set(p.relative_to(ROOT).parts) & skip_dirs or p.name == Path(__file__).name:
            continue
        if p.suffix not in (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".toml", ".txt", ".cu", ".cuh",
                            ".cpp", ".sh", ".html", ".js", ".css", "") or p.stat().st_size > 20_000_000:
            continue
        try:
            text = p.read_text(errors="strict")
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if pattern.lower() in line.lower():
                hits.append(f"{_rel(p)}:{i}: {line.strip()[:100]}")
    assert not hits, f"{pattern!r} found:\n" + "\n".join(hits[:40])
