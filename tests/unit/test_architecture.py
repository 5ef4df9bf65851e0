"""The package's shape: no import circles (static import graph, function-level imports included)."""

from __future__ import annotations

import ast
import os

import pytest

pytestmark = pytest.mark.device_independent  # the import graph: runs once, in the CPU lane

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "nxd_ckpt"


def _modules() -> dict[str, str]:
    out = {}
    root = os.path.join(REPO, PACKAGE)
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), REPO)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, name)
    return out


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """Package modules ``module`` imports anywhere in its body (``from . import x`` counts x if a module)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    is_pkg = path.endswith("__init__.py")
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(PACKAGE)}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(PACKAGE):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {m for m in found if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {m: _imports(m, p, known) for m, p in mods.items()}
    # importing a.b runs a/__init__ first: not an edge of our own making, so packages' own __init__ are skipped
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    graph = _graph()
    assert "nxd_ckpt.format.metadata" in graph["nxd_ckpt.format.describe"]
    assert "nxd_ckpt.knobs" in graph["nxd_ckpt.statefile"]


def test_no_import_circles():
    """Modules import each other one way only (a function-level import does not hide a circle)."""
    graph = {m: d for m, d in _graph().items() if m != PACKAGE}  # the package's facade imports the public API
    assert _cycles(graph) == []


def test_no_circles_between_units():
    """Each sub-package (``save/``, ``load/``, ``device/``...) counts as one unit beside the top-level modules: no
    two units import each other, directly or through others."""
    units: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        if module == PACKAGE:
            continue
        unit = module.split(".")[1]
        units.setdefault(unit, set())
        for dep in deps:
            if dep != PACKAGE and dep.split(".")[1] != unit:
                units[unit].add(dep.split(".")[1])
                units.setdefault(dep.split(".")[1], set())
    assert _cycles(units) == []


def test_a_circle_between_units_is_found():
    assert _cycles({"save": {"statefile"}, "statefile": {"save"}, "tree": set()}) != []


LAYERS = [
    {"errors", "knobs", "lazy", "tree", "rng", "pages"},
    {"storage", "serialization", "ranks", "xla"},
    {"format", "log", "watchdog", "parallel_state", "device"},
    {"statefile", "adapters", "inspection", "inspect", "tier"},
    {"options", "rank_state"},
    {"save", "load"},
    {"manager", "tools", "testing", "dcp"},
    {"api", "cli", "lightning", "torchtitan", "compat"},
]
"""Dependencies point down: a module imports only from its own layer or lower ones (the folders' order)."""


def _layer(module: str) -> int:
    top = module.split(".")[1]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/unit/test_architecture.py: add {top!r} to one")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module -> dependency`` for every import of a module from a higher layer than its own."""
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m != PACKAGE
        for d in deps
        if d != PACKAGE and _layer(d) > _layer(m)
    )


def test_dependencies_point_down_the_layers():
    upward = upward_imports(_graph())
    assert upward == [], "modules importing from a higher layer:\n" + "\n".join(upward)


def test_an_upward_import_is_found():
    """statefile (layer 3) importing save.plan (layer 5), as it did before the redesign, is named."""
    graph = {"nxd_ckpt.statefile": {"nxd_ckpt.save.plan", "nxd_ckpt.tree"}, "nxd_ckpt.save.plan": {"nxd_ckpt.tree"}}
    assert upward_imports(graph) == ["nxd_ckpt.statefile -> nxd_ckpt.save.plan"]


MAX_FUNCTION_LINES = 60


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, body lines) of each function in ``source`` whose body, docstring aside, is over ``limit``
    lines (nested functions counted in their parent too, and on their own)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if len(body) > 1 and ast.get_docstring(node, clean=False) is not None:
            body = body[1:]
        lines = (node.end_lineno or node.lineno) - body[0].lineno + 1
        if lines > limit:
            out.append((node.name, node.lineno, lines))
    return out


def _benchmark_modules() -> dict[str, str]:
    """The modules of the benchmark suites (``benchmarks/``, beside the package): name -> path."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(REPO, "benchmarks")):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), REPO)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, name)
    return out


def test_no_function_over_60_lines():
    """A newcomer reads a function in one screen: steps go into named functions (the testing/ harnesses aside),
    in the package and in the benchmark suites."""
    offenders = []
    for module, path in sorted({**_modules(), **_benchmark_modules()}.items()):
        if module.startswith(f"{PACKAGE}.testing"):
            continue
        with open(path) as f:
            offenders += [f"{module}.{name} (line {line}): {n} lines" for name, line, n in long_functions(f.read())]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines (docstring aside):\n" + "\n".join(offenders)


def test_the_benchmark_suites_are_in_the_length_check():
    assert "benchmarks.suites.device.summary" in _benchmark_modules()
    assert "benchmarks.core.report" in _benchmark_modules()


def test_a_long_function_is_found():
    """The checker counts body lines without the docstring: 61 statements fail, 60 (plus a docstring) pass."""

    def source(statements: int) -> str:
        body = "".join(f"    x{i} = {i}\n" for i in range(statements))
        return f'def long():\n    """A docstring\n    over two lines."""\n{body}'

    assert long_functions(source(61)) == [("long", 1, 61)]
    assert long_functions(source(60)) == []


def test_every_public_name_resolves():
    """Every name ``nxd_ckpt`` exports (resolved lazily from its owner module) is there: a moved module updates the
    facade too."""
    import nxd_ckpt

    missing = []
    for name in nxd_ckpt.__all__:
        try:
            getattr(nxd_ckpt, name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name}: {e}")
    assert missing == []


def test_unit_tests_mirror_the_package():
    """``tests/unit/<name>/`` holds the tests of sub-package ``nxd_ckpt/<name>/`` (top-level modules' tests sit in
    ``tests/unit/`` itself), so a module's tests are found where the module is."""
    tests_unit = os.path.join(REPO, "tests", "unit")
    folders = {d for d in os.listdir(tests_unit) if os.path.isdir(os.path.join(tests_unit, d)) and d != "__pycache__"}
    packages = {
        d
        for d in os.listdir(os.path.join(REPO, PACKAGE))
        if os.path.isfile(os.path.join(REPO, PACKAGE, d, "__init__.py"))
    }
    assert folders - packages == set(), "tests/unit folders that name no sub-package of nxd_ckpt"


DEPRECATED_ALIASES = {f"{PACKAGE}.inspect": f"{PACKAGE}.inspection"}
"""Old module names kept importable for users (they warn on import); the package itself uses the new ones."""


def test_no_module_imports_a_deprecated_alias():
    """Importing the package never warns: its modules import ``nxd_ckpt.inspection``, not the alias."""
    graph = _graph()
    users = sorted(
        f"{m} -> {d} (use {DEPRECATED_ALIASES[d]})" for m in graph for d in graph[m] if d in DEPRECATED_ALIASES
    )
    assert users == [], "modules importing a deprecated alias:\n" + "\n".join(users)


MAX_SAVE_PIPELINE_IMPORTS = 12
"""``save/pipeline.py`` composes the steps of a save and does nothing else: each step is a module of its own."""


def test_the_save_pipeline_only_composes():
    """The save pipeline imports at most 12 of the package's modules (27 when it still held the re-save protocol,
    the commit's target, the sharding share, the staging strategies and the memory tier's steps)."""
    imported = sorted(_graph()[f"{PACKAGE}.save.pipeline"])
    assert len(imported) <= MAX_SAVE_PIPELINE_IMPORTS, f"save/pipeline.py imports {len(imported)}: {imported}"


def test_the_load_calls_nothing_of_the_save():
    """A load reports what it resumed and the manager prepares the next save: no module of ``load/`` imports one of
    ``save/`` (an edge the import graph would show), and ``load/candidates.py`` takes no callable (a call back into
    the load's pipeline, an edge it would not)."""
    graph = _graph()
    edges = sorted(f"{m} -> {d}" for m in graph if m.startswith(f"{PACKAGE}.load.") for d in graph[m] if ".save." in d)
    assert edges == []
    with open(_modules()[f"{PACKAGE}.load.candidates"]) as f:
        tree = ast.parse(f.read())
    callables = [
        f"{node.name}({arg.arg})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in [*node.args.args, *node.args.kwonlyargs]
        if arg.annotation is not None and "Callable" in ast.unparse(arg.annotation)
    ]
    assert callables == [], "load/candidates.py takes callbacks: " + ", ".join(callables)
