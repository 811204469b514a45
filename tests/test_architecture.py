"""The code as a reader expects it, checked on every run: short files and functions, no private name imported
across modules, and imports that flow one way through the layers (corpora -> retrieval -> agent -> training;
eval reads agent and corpora; ``sleuth`` is the composition root that may import anything)."""

from __future__ import annotations

import ast
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("corpora", "retrieval", "agent", "training", "eval", "sleuth")
#: what each layer may import (besides itself); ``sleuth`` is the composition root
ALLOWED = {
    "corpora": set(),
    "retrieval": {"corpora"},
    "agent": {"corpora", "retrieval"},
    "training": {"corpora", "retrieval", "agent"},
    "eval": {"corpora", "retrieval", "agent"},
    "sleuth": set(PACKAGES),
}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100
FUNCTION_LIMIT_PACKAGES = ("training", "agent", "eval", "sleuth")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """``(module, imported names, line)`` of every absolute import in ``tree`` (nested ones included)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
    return out


def test_no_source_file_is_over_600_lines():
    long = {_rel(p): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_is_over_100_lines():
    long = {}
    for p in _sources():
        if p.relative_to(ROOT).parts[0] not in FUNCTION_LIMIT_PACKAGES:
            continue
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
