"""The package's shape: no import circles, dependencies down the layers (static import graph, function-level
imports included), the only modules that import torch_xla, and a test file in tests/unit for every module."""

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
            found |= {a.name for a in node.names if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")}
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
    # importing a.b runs a/__init__ first: not an edge of our own making, so packages' own __init__ are skipped;
    # the facade, ``nxd_ckpt`` itself, is imported only when a module names it (``import nxd_ckpt``, or a name
    # ``from nxd_ckpt import`` that is no module): an edge to the facade's layer
    return {m: {d for d in deps if d == PACKAGE or not m.startswith(d + ".")} for m, deps in graph.items()}


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
    """Modules import each other one way only (a function-level import does not hide a circle). The facade, which
    resolves the public API lazily, is left out: a module importing it is an upward import unless in its layer."""
    graph = {m: d - {PACKAGE} for m, d in _graph().items() if m != PACKAGE}
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
        for dep in deps - {PACKAGE}:
            if dep.split(".")[1] != unit:
                units[unit].add(dep.split(".")[1])
                units.setdefault(dep.split(".")[1], set())
    assert _cycles(units) == []


def test_a_circle_between_units_is_found():
    assert _cycles({"save": {"statefile"}, "statefile": {"save"}, "tree": set()}) != []


LAYERS = [
    {"errors", "knobs", "lazy", "tree", "rng", "pages", "optimizers"},
    {"storage", "serialization", "ranks", "xla"},
    {"format", "log", "watchdog", "parallel_state", "device"},
    {"statefile", "adapters", "inspection", "inspect", "tier"},
    {"options", "resume_state"},
    {"save", "load"},
    {"manager", "tools", "testing", "dcp"},
    {"api", "cli", "lightning", "compat", "torchtitan"},
]
"""Dependencies point down: a module imports only from its own layer or lower ones (the folders' order)."""
FACADE_LAYER = len(LAYERS) - 1
"""``nxd_ckpt`` itself (``import nxd_ckpt``, ``from nxd_ckpt import save_checkpoint``) stands for the whole public
API, so importing it is importing from the top layer."""


def _layer(module: str) -> int:
    if module == PACKAGE:
        return FACADE_LAYER
    top = module.split(".")[1]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/unit/test_architecture.py: add {top!r} to one")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``module -> dependency`` for every import of a module from a higher layer than its own."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if m != PACKAGE for d in deps if _layer(d) > _layer(m))


def test_dependencies_point_down_the_layers():
    upward = upward_imports(_graph())
    assert upward == [], "modules importing from a higher layer:\n" + "\n".join(upward)


def test_an_upward_import_is_found():
    """statefile (layer 3) importing save.plan (layer 5), as it did before the redesign, is named."""
    graph = {"nxd_ckpt.statefile": {"nxd_ckpt.save.plan", "nxd_ckpt.tree"}, "nxd_ckpt.save.plan": {"nxd_ckpt.tree"}}
    assert upward_imports(graph) == ["nxd_ckpt.statefile -> nxd_ckpt.save.plan"]


def test_importing_the_facade_counts_as_importing_the_top_layer(tmp_path):
    """``import nxd_ckpt`` or ``from nxd_ckpt import SaveOptions`` inside the package is an edge to the facade (a
    module name imported from it is not); below the top layer, that edge is upward."""
    source = tmp_path / "statefile.py"
    source.write_text("import nxd_ckpt as nxd\nfrom nxd_ckpt import SaveOptions, knobs\n")
    known = {PACKAGE, "nxd_ckpt.statefile", "nxd_ckpt.knobs"}
    assert _imports("nxd_ckpt.statefile", str(source), known) == {PACKAGE, "nxd_ckpt.knobs"}
    graph = {"nxd_ckpt.statefile": {PACKAGE}, "nxd_ckpt.cli.parser": {PACKAGE}}
    assert upward_imports(graph) == ["nxd_ckpt.statefile -> nxd_ckpt"]


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
    """A newcomer reads a function in one screen: steps go into named functions, in the package (the shipped test
    helpers too) and in the benchmark suites."""
    offenders = []
    for module, path in sorted({**_modules(), **_benchmark_modules()}.items()):
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


TORCH_XLA_IMPORTERS = {
    f"{PACKAGE}.xla": "the torch_xla seam: detection without importing it, syncs, bulk device <-> host moves",
    f"{PACKAGE}.device.backend": "the XLA device's memory figures (xm.get_memory_info) and whether its runtime is "
    "the CPU client (torch_xla.runtime), asked only once torch_xla is loaded",
    f"{PACKAGE}.rng": "the XLA RNG seed, saved and restored only when the program already imported torch_xla",
    f"{PACKAGE}.lightning.strategies": "NxdXLAStrategy under torchrun registers torch_xla's 'xla' process-group "
    "backend before making the default group, as Lightning's XLA strategy does",
}
"""The modules that import torch_xla, each with why it cannot ask ``nxd_ckpt.xla`` (docs/architecture.md)."""


def _names_imported(node: ast.AST) -> list[str]:
    """The modules ``node`` imports: an import statement's, or the literal name given to
    ``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.level == 0 and node.module else []
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        first = node.args[0]
        if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
            return [first.value] if isinstance(first.value, str) else []
    return []


def imports_torch_xla(source: str) -> list[int]:
    """Lines of ``source`` that import torch_xla or one of its modules: import statements anywhere, and
    ``importlib.import_module`` / ``__import__`` of a literal name (reading ``sys.modules`` is no import)."""
    return sorted(
        node.lineno  # type: ignore[attr-defined]
        for node in ast.walk(ast.parse(source))
        if any(name == "torch_xla" or name.startswith("torch_xla.") for name in _names_imported(node))
    )


def test_only_the_named_modules_import_torch_xla():
    importers = {}
    for module, path in sorted(_modules().items()):
        with open(path) as f:
            lines = imports_torch_xla(f.read())
        if lines:
            importers[module] = lines
    unnamed = {m: lines for m, lines in importers.items() if m not in TORCH_XLA_IMPORTERS}
    assert unnamed == {}, (
        f"torch_xla imported outside the named modules (module: lines): {unnamed}; go through nxd_ckpt.xla, or name "
        "the module in TORCH_XLA_IMPORTERS with the reason (and in docs/architecture.md)"
    )
    assert set(TORCH_XLA_IMPORTERS) <= set(importers), (
        f"named but importing no torch_xla: {sorted(set(TORCH_XLA_IMPORTERS) - set(importers))}: drop them"
    )


def test_a_torch_xla_import_is_found():
    source = (
        "import sys\nimport importlib\nx = sys.modules.get('torch_xla')\n"
        "def f():\n    import torch_xla.core.xla_model as xm\n"
        "from torch_xla import runtime\nimportlib.import_module('torch_xla.distributed.xla_backend')\n"
        "__import__('torch_xla')\nimportlib.import_module('torchvision')\n"
    )
    assert imports_torch_xla(source) == [5, 6, 7, 8]


MIRROR_FOLDERS_ELSEWHERE = {
    "cli": "tests/cli/test_cli.py: the command is tested end to end, one subcommand at a time",
    "tools": "tests/tools: the offline tools run end to end on real checkpoints (export, import, reshard, convert)",
}
"""Sub-packages whose modules are tested outside tests/unit, by what the user runs."""
TESTED_ELSEWHERE = {
    "adapters": "tests/unit/load/test_load_into_live.py: state applied to live modules and optimizers on load",
    "errors": "tests/unit/test_api_first_hour_errors.py: each error type raised with its remedy, as users meet them",
    "inspect": "tests/unit/test_inspection.py: the deprecated alias of inspection, which warns on import",
    "statefile": "tests/unit/serialization/test_xser.py: one state file in each encoding, written and read back",
    "watchdog": "tests/faults/test_deadlines.py: stalled storage calls are ended by the watchdog's deadlines",
    "dcp.checkin": "tests/distributed/test_dcp_deadlines.py: a rank that does not check in is named by the "
    "coordinator's deadline",
    "format.resave": "tests/faults/test_resave.py: a re-save written beside the complete tag, swapped in, a crashed "
    "swap recovered (and tests/unit/test_pipelines.py)",
    "save.capture": "tests/unit/save/test_save_pipeline.py: the state dict built once, meta tensors refused first",
    "save.stage": "tests/unit/save/test_save_pipeline.py: the pooled, budgeted (and test_budget.py) and live "
    "strategies",
    "save.write": "tests/unit/save/test_save_pipeline.py: this rank's files written, watched, with their manifest",
    "tier.shared": "tests/distributed/test_torchtitan_memory_tier.py: one tier runtime per tier and folder for the "
    "DCP writer and reader, node loss resumed from the peer",
    "dcp.contents": "tests/cli/test_dcp_cli.py: a DCP folder described and verified offline, through the command",
    "dcp.place": "tests/unit/dcp/test_dcp_storage.py: the folder, its staging storage and checkpoint_id (the commit "
    "is save.commit's: tests/unit/save/test_commit.py; recovery: tests/faults/test_dcp_kill.py)",
    "dcp.reader": "tests/unit/dcp/test_dcp_storage.py: StorageReader checks .metadata and files against manifests",
    "dcp.writer": "tests/unit/dcp/test_dcp_storage.py: StorageWriter's files, manifests and commit",
    "dcp.stager": "tests/unit/dcp/test_dcp_stager.py: the Stager's staging, its budgets and reuse",
    "device.backend": "tests/unit/device/test_device_layer.py: device kinds, streams and memory figures",
    "device.kept_budget": "tests/unit/device/test_snapshot_budget.py: the snapshot budget agreed, kept and shrunk",
    "device.load_targets": "tests/xla/test_xla_load_into.py: reads into live device tensors through host arenas",
    "device.transfer": "tests/unit/device/test_device_layer.py: device -> host copies in chunks (on a native "
    "device: tests/unit/device/test_device_threads.py)",
    "format.dcp_folders": "tests/cli/test_dcp_cli.py: step-N folders listed, ordered and pruned, through the command",
    "format.describe": "tests/unit/format/test_metadata_and_manifests.py: a tag's layout and the files it holds",
    "format.layout": "tests/unit/format/test_metadata_and_manifests.py: every file name, read back by its owner",
    "format.manifests": "tests/unit/format/test_metadata_and_manifests.py: per-rank checksum files",
    "lightning.factory": "tests/unit/lightning/test_checkpoint_io.py: the classes built over the installed Lightning",
    "lightning.mapping": "tests/unit/lightning/test_checkpoint_io.py: Lightning's path to a tag, its dict's split",
    "lightning.package": "tests/unit/lightning/test_checkpoint_io.py: which Lightning package is used",
    "lightning.strategies": "tests/distributed/test_lightning.py: the strategies on spawned ranks",
    "load.candidates": "tests/unit/test_pipelines.py: the tag resolved, verified and agreed by every rank",
    "load.pipeline": "tests/unit/test_pipelines.py: the steps of a load composed, ranks as threads",
    "load.read": "tests/unit/load/test_load_read_ahead.py: a read plan executed, the optimizer read during the model",
    "load.report": "tests/distributed/test_memory_tier.py: RestoreReport says where a restore read from",
    "load.reshard": "tests/distributed/test_reshard.py: a load at another TP/PP on spawned ranks",
    "load.reshard_optimizer": "tests/distributed/test_reshard.py: plain and ZeRO-1 optimizer state loaded at another "
    "TP (resumed training: tests/distributed/test_zero1_reshard.py)",
    "load.zero1_io": "tests/tools/test_convert_zero1.py: ZeRO-1 shards read and written by the converter (the "
    "shard math: tests/unit/load/test_zero1.py)",
    "ranks.arrivals": "tests/unit/ranks/test_store_ops.py: checking in and waiting on the store, counted",
    "ranks.coordinator": "tests/unit/ranks/test_deadlines_and_failures.py: collectives that carry failures",
    "ranks.failures": "tests/unit/ranks/test_deadlines_and_failures.py: one rank's exception raised on every rank",
    "ranks.replicas": "tests/distributed/test_xser_dp.py: DP replicas sharing the reads of one file",
    "save.barrier": "tests/unit/test_pipelines.py: the commit barrier's arrive and outcome, ranks as threads",
    "save.context": "tests/unit/save/test_save_pipeline.py: the values the steps hand each other",
    "save.pipeline": "tests/unit/save/test_save_pipeline.py: the steps of a save composed",
    "save.plan": "tests/unit/save/test_save_pipeline.py: which rank writes which tensor",
    "save.report": "tests/unit/save/test_save_pipeline.py: SaveReport's fields after a save",
    "serialization.inmemory": "tests/distributed/test_memory_tier.py: no test of its own; the zero-copy loads from "
    "host memory it serves run in every restore from the memory tier",
    "serialization.pickle_scan": "tests/unit/format/test_integrity.py: the pickle globals a file names, scanned on "
    "verify",
    "serialization.plain": "tests/unit/serialization/test_readinto.py: the plain encoding read into live tensors",
    "serialization.structure": "tests/unit/serialization/test_safe_loading.py: structures loaded under the allow-list",
    "serialization.torchzip": "tests/unit/serialization/test_xser.py: the torch-zip reader under both encodings (its "
    "allow-list: tests/unit/serialization/test_safe_loading.py)",
    "storage.range_reads": "tests/unit/load/test_reshard_sources.py: no test of its own; the byte ranges a "
    "re-sharded load reads are counted there",
    "storage.s3": "tests/s3/test_s3_storage.py: S3Storage against the loopback S3 server",
    "storage.s3_upload": "tests/s3/test_s3_storage.py: multipart uploads as parts fill, against the loopback S3 server",
    "testing.fakes": "tests/unit/test_wheel.py: the shipped model trains and compares states without the test extra "
    "(and it is every test's model)",
    "testing.threadworld": "tests/unit/test_manager.py: the manager's policies with ranks as threads",
    "tier.runtime": "tests/distributed/test_memory_tier.py: the tier's steps in saves and restores on spawned ranks",
    "tier.transport": "tests/unit/tier/test_memory_tier_parts.py: the file server and its client, token-checked",
    "tier.view": "tests/distributed/test_memory_tier.py: no test of its own; every restore from node memory or a "
    "peer reads through it",
    "torchtitan.manager": "tests/distributed/test_torchtitan_manager.py: TorchTitan's manager on spawned ranks",
    "torchtitan.staging": "tests/distributed/test_torchtitan_manager.py: async modes and budgets checked",
    "torchtitan.steps": "tests/distributed/test_torchtitan_manager.py: no test of its own; the step-N folders of a "
    "run, saved, listed and pruned by the manager",
}
"""Modules (below ``nxd_ckpt.``) whose tests live in a file not named after them: ``path: what it tests there``."""


def mirror_test_file(module: str, modules: set[str]) -> str | None:
    """``tests/unit/<folders>/test_<name>[_<concept>].py`` for ``nxd_ckpt.<folders>.<name>``, if it exists: a
    test file belongs to the longest sibling module name it starts with (test_read_plan.py is read_plan's, not
    read's)."""
    parts = module.split(".")[1:]
    folder = os.path.join(REPO, "tests", "unit", *parts[:-1])
    siblings = {m.split(".")[-1] for m in modules if m.split(".")[1:-1] == parts[:-1]}
    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        stem = name.removeprefix("test_").removesuffix(".py")
        owners = [s for s in siblings if name.startswith("test_") and (stem == s or stem.startswith(s + "_"))]
        if name.endswith(".py") and owners and max(owners, key=len) == parts[-1]:
            return os.path.join(folder, name)
    return None


def test_every_module_has_its_test_file():
    """tests/unit mirrors the package module by module: each module's tests are in the file named after it, or
    the module is named in TESTED_ELSEWHERE (or its folder in MIRROR_FOLDERS_ELSEWHERE) with where and why."""
    modules = {m for m, p in _modules().items() if not p.endswith(("__init__.py", "__main__.py"))}
    missing = sorted(
        m
        for m in modules
        if m.split(".")[1] not in MIRROR_FOLDERS_ELSEWHERE
        and m.removeprefix(PACKAGE + ".") not in TESTED_ELSEWHERE
        and mirror_test_file(m, modules) is None
    )
    assert missing == [], (
        "modules without tests/unit/<folders>/test_<module>.py: add it, or name the module in TESTED_ELSEWHERE "
        "with the test file that holds its tests:\n" + "\n".join(missing)
    )


def test_the_named_exceptions_are_real():
    """Each exception names a module that exists, has no mirror test file yet, and points at a test file (or
    folder) that exists: the list cannot outlive what it excuses."""
    modules = {m for m, p in _modules().items() if not p.endswith(("__init__.py", "__main__.py"))}
    problems = []
    for name, where in {**TESTED_ELSEWHERE, **MIRROR_FOLDERS_ELSEWHERE}.items():
        path = where.split(":")[0]
        if not os.path.exists(os.path.join(REPO, path)):
            problems.append(f"{name}: {path} does not exist")
    for name in TESTED_ELSEWHERE:
        module = f"{PACKAGE}.{name}"
        if module not in modules:
            problems.append(f"{name}: no such module")
        elif mirror_test_file(module, modules) is not None:
            problems.append(f"{name}: has {mirror_test_file(module, modules)}; drop it from TESTED_ELSEWHERE")
    assert problems == []


def test_a_test_file_belongs_to_the_longest_module_name():
    modules = {f"{PACKAGE}.load.read", f"{PACKAGE}.load.read_plan", f"{PACKAGE}.load.reshard_sources"}
    assert mirror_test_file(f"{PACKAGE}.load.read", modules) is None  # test_read_plan.py is read_plan's
    assert mirror_test_file(f"{PACKAGE}.load.read_plan", modules).endswith("test_read_plan.py")
