"""scripts/*.py import one another only through the shared helper modules, and never in a circle (a static AST
check: no script is run or imported)."""

from __future__ import annotations

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

HELPER_MODULES = {
    "benchlib": "helpers shared by the benchmark scripts (section registry, Bench, PeakRSS, ...)",
    "benchmark_memory_sections": "scripts/benchmark.py's memory sections, registered on benchlib's registry",
}
"""The modules in scripts/ that are imported, never run; a script imports no other script."""


def _imported_names(tree: ast.AST) -> set[str]:
    """Top-level module names a file imports anywhere (function-local imports and ``__import__("x")`` too)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value.split(".")[0])
    return names


def script_imports(directory: Path) -> dict[str, set[str]]:
    """For each ``*.py`` in ``directory``: the other modules of ``directory`` it imports (itself left out)."""
    modules = {path.stem: path for path in sorted(directory.glob("*.py"))}
    graph = {}
    for name, path in modules.items():
        imported = _imported_names(ast.parse(path.read_text(), filename=str(path)))
        graph[name] = {other for other in imported if other in modules and other != name}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` as ``[a, b, ..., a]``, or ``None`` when there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            circle = visit(target, [*path, node])
            if circle is not None:
                return circle
        done.add(node)
        return None

    for start in sorted(graph):
        circle = visit(start, [])
        if circle is not None:
            return circle
    return None


def forbidden_imports(graph: dict[str, set[str]], helpers: set[str]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for each import of a script that is not a helper module."""
    return sorted((src, dst) for src, targets in graph.items() for dst in targets if dst not in helpers)


def _has_main_guard(path: Path) -> bool:
    """Whether the file has an ``if __name__ == "__main__":`` block (it is meant to be run)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            left = node.test.left
            if isinstance(left, ast.Name) and left.id == "__name__":
                return True
    return False


def test_scripts_have_no_import_circle() -> None:
    assert find_circle(script_imports(SCRIPTS)) is None


def test_scripts_import_only_the_helper_modules() -> None:
    assert forbidden_imports(script_imports(SCRIPTS), set(HELPER_MODULES)) == []


def test_helper_modules_exist_and_are_not_run() -> None:
    for name in HELPER_MODULES:
        path = SCRIPTS / f"{name}.py"
        assert path.is_file(), name
        assert not _has_main_guard(path), f"{name} is a helper module: imported, never run"


def test_scripts_are_not_named_after_tracker_issues() -> None:
    offenders = [p.name for p in SCRIPTS.iterdir() if "issue" in p.name.lower()]
    assert offenders == []


def test_checker_finds_a_synthetic_circle(tmp_path: Path) -> None:
    (tmp_path / "bench_a.py").write_text("import helper\n\ndef f():\n    import bench_b\n")
    (tmp_path / "bench_b.py").write_text("from bench_c import x\n")
    (tmp_path / "bench_c.py").write_text("x = __import__('bench_a')\n")
    (tmp_path / "helper.py").write_text("import os\n")
    graph = script_imports(tmp_path)
    assert graph == {"bench_a": {"helper", "bench_b"}, "bench_b": {"bench_c"}, "bench_c": {"bench_a"}, "helper": set()}
    assert find_circle(graph) == ["bench_a", "bench_b", "bench_c", "bench_a"]
    expected = [("bench_a", "bench_b"), ("bench_b", "bench_c"), ("bench_c", "bench_a")]
    assert forbidden_imports(graph, {"helper"}) == expected
    (tmp_path / "bench_c.py").write_text("import helper\n")
    assert find_circle(script_imports(tmp_path)) is None
