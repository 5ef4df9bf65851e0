"""The shape of scripts/ and benchmarks/: scripts/ holds only the user-facing commands; benchmarks/ has no import
circle, imports no test module, and every suite registered has the suite interface and lists its sections (a
static AST check plus ``--list``: no suite is run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmarks import cli

pytestmark = pytest.mark.device_independent

REPO = Path(__file__).resolve().parents[2]
SCRIPTS_KEPT = {"main_job.py", "run_main_job.sh", "setup_env.sh", "run_tests.sh", "convert_zero1_checkpoint.py"}
"""scripts/: the README's main job, the environment and test commands, and NxD's ZeRO-1 converter command line."""


def module_name(path: Path, root: Path) -> str:
    """The dotted name of ``path`` in the package rooted at ``root``'s parent."""
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def package_imports(root: Path) -> dict[str, set[str]]:
    """For each module of the package ``root``: the package's modules it imports (function-level imports too)."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
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


def test_scripts_keeps_only_the_user_commands() -> None:
    assert {p.name for p in (REPO / "scripts").iterdir() if not p.name.startswith(".")} == SCRIPTS_KEPT


def test_benchmarks_have_no_import_circle() -> None:
    assert find_circle(package_imports(REPO / "benchmarks")) is None


def test_benchmarks_import_no_test_module() -> None:
    offenders = sorted(
        (name, m) for name, targets in package_imports(REPO / "benchmarks").items() for m in targets
        if m.startswith("tests")
    )  # fmt: skip
    assert offenders == []


def test_the_circle_checker_finds_a_synthetic_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    import pkg.b\n")
    (pkg / "b.py").write_text("from pkg.c import x\n")
    (pkg / "c.py").write_text("from pkg import a\nx = 1\n")
    graph = package_imports(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert find_circle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("x = 1\n")
    assert find_circle(package_imports(pkg)) is None


@pytest.mark.parametrize("name", sorted(cli.SUITES))
def test_every_suite_has_the_interface_and_lists_its_sections(name: str, capsys) -> None:
    suite = cli.load_suite(name)
    assert suite.TITLE and suite.SECTIONS and callable(suite.add_options) and callable(suite.run)
    assert cli.main([name, "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(suite.SECTIONS)


def test_suites_and_sections_are_checked(capsys) -> None:
    assert cli.main(["--list"]) == 0
    assert set(cli.SUITES) <= {line.split()[0] for line in capsys.readouterr().out.splitlines()[3:]}
    assert cli.main(["no_such_suite"]) == 2
    assert "unknown suite 'no_such_suite'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["coordinator", "--sections", "steps,nope"])
    assert "unknown sections ['nope']" in capsys.readouterr().err


def test_no_benchmark_is_named_after_a_tracker_issue() -> None:
    assert [p.name for p in (REPO / "benchmarks").rglob("*") if "issue" in p.name.lower()] == []
