"""The import rules of docs/architecture.md, checked on the source of every module.

Each ``.py`` file under ``shared/``, ``services/``, ``tools/`` and ``lab/`` is parsed (never
imported) and every import in it, at any depth (inside functions and ``TYPE_CHECKING`` blocks
too, and ``importlib.import_module`` with a literal name), is held to the rules below. A rule broken by
code that is being moved is listed in ``ALLOWED`` with the reason, an import inside a function
that may wait for its call in ``LAZY_ALLOWED``; an entry nothing needs any more fails the
suite, so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services", "tools", "lab")
SERVICES = ("gateway", "gpu_worker", "provisioner", "scheduler")

# The pure modules (the policy core, the simulator and the handoff's state tables) stay pure: no
# torch, no messaging, no storage, no HTTP and none of the heavy libraries only the worker, the
# gateway or the evaluation's plots use.
PURE = ("services.scheduler.core", "lab.sim", "services.gpu_worker.handoff.protocol")
NOT_IN_PURE = (
    "torch",
    "nats",
    "redis",
    "aiohttp",
    "aiortc",
    "av",
    "msgspec",
    "structlog",
    "transformers",
    "diffusers",
    "safetensors",
    "matplotlib",
    "scipy",
    "pandas",
    "kubernetes",
    "PIL",
)

# The policy core imports only itself and these contracts of shared/: the latency profiles and
# the names of the policies the live scheduler may run.
CORE = "services.scheduler.core"
CORE_CONTRACTS = ("shared.profile", "shared.policies")
# What the lab may use of the services: the policy core and the shipped rho_hat tables (the
# profiler writes them, the evaluation reads them as the live scheduler does).
LAB_USES = (CORE, "services.scheduler.shipped")

# (importing file, imported module) -> why it is allowed for now. Each entry names the owner's
# move that removes it.
ALLOWED: dict[tuple[str, str], str] = {}

# Imports inside a function that the purity rule does not follow from a pure module: (importing
# file, imported module) -> why the import waits for the call. Every other import inside a
# function counts as if it ran on import. An entry nothing needs any more fails the suite.
LAZY_ALLOWED: dict[tuple[str, str], str] = {
    ("lab/eval/plots.py", "matplotlib"): "matplotlib loads only when sim evaluate draws a "
    "figure, so the simulator's commands start without it",
    ("lab/eval/plots.py", "matplotlib.pyplot"): "the same: pyplot only when a figure is drawn",
}

# Import circles still in the tree: the circle's modules, sorted -> why, and the move that
# breaks it. An entry nothing needs any more fails the suite, so the list only shrinks.
CIRCLES_ALLOWED: dict[tuple[str, ...], str] = {}  # none left: the suite keeps it so


@dataclass(frozen=True)
class Import:
    path: str  # the importing file, relative to the repository root
    line: int
    importer: str  # the importing module's dotted name
    module: str  # the imported module's absolute dotted name
    names: tuple[str, ...] = ()  # for ``from module import names``
    deferred: bool = False  # inside a function: it runs when called, not on import


@dataclass(frozen=True)
class Breach:
    rule: str
    imp: Import

    def __str__(self) -> str:
        what = self.imp.module + (f" ({', '.join(self.imp.names)})" if self.imp.names else "")
        return f"{self.imp.path}:{self.imp.line}: {self.rule}: imports {what}"


def module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_in(path: str, source: str) -> Iterator[Import]:
    """Every import in ``source`` (the file at ``path``), relative ones made absolute."""
    importer = module_name(path)
    package = importer if path.endswith("__init__.py") else importer.rpartition(".")[0]
    tree = ast.parse(source, path)
    deferred = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for inner in ast.walk(node)
        if inner is not node
    }
    for node in ast.walk(tree):
        later = id(node) in deferred
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, importer, alias.name, deferred=later)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = tuple(alias.name for alias in node.names)
            if node.level and not node.module:
                # ``from . import x`` imports the submodules (or names) x of the package.
                for name in names:
                    yield Import(path, node.lineno, importer, f"{module}.{name}", deferred=later)
            else:
                yield Import(path, node.lineno, importer, module, names, later)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Import(path, node.lineno, importer, node.args[0].value, deferred=later)


def private_attributes(path: str, source: str) -> Iterator[Import]:
    """``alias._name`` where ``alias`` is bound by an import of one of our modules: reaching
    into a module's private name without importing it by name."""
    tree = ast.parse(source, path)
    ours: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    ours[alias.asname or alias.name.partition(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and _ours(node.module or ""):
            for alias in node.names:
                ours[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    importer = module_name(path)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ours
            and _private(node.attr)
        ):
            yield Import(path, node.lineno, importer, ours[node.value.id], (node.attr,))


def _ours(module: str) -> bool:
    return module.partition(".")[0] in PACKAGES


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _service(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" else None


def breaches(imp: Import) -> list[Breach]:
    """The rules ``imp`` breaks (none for most)."""
    found = []
    mine, theirs = _service(imp.importer), _service(imp.module)
    if mine == "gpu_worker" and theirs is not None and theirs != mine:
        found.append("the worker imports no other service")
    elif mine is not None and theirs is not None and theirs != mine:
        found.append("a service imports only its own package and shared")
    top = imp.module.partition(".")[0]
    if imp.importer.partition(".")[0] in ("services", "shared") and top == "tools":
        found.append("services and shared never import tools")
    if _within(imp.importer, "shared") and top == "services":
        found.append("shared imports no service")
    if imp.importer.partition(".")[0] in ("services", "shared") and top == "lab":
        found.append("services and shared never import lab")
    if (
        _within(imp.importer, CORE)
        and _ours(imp.module)
        and not _within(imp.module, CORE)
        and not any(_within(imp.module, c) for c in CORE_CONTRACTS)
    ):
        found.append("the core imports only the core and shared's contracts")
    if (
        _within(imp.importer, "lab")
        and top == "services"
        and not any(_within(imp.module, u) for u in LAB_USES)
    ):
        found.append("the lab uses only the policy core and the shipped tables of the services")
    if (
        _within(imp.importer, "tools")
        and top in ("services", "shared")
        and (
            any(_private(part) for part in imp.module.split("."))
            or any(_private(name) for name in imp.names)
        )
    ):
        found.append("tools use only public names of services and shared")
    if any(_within(imp.importer, p) for p in PURE) and top in NOT_IN_PURE:
        found.append("the pure modules stay pure")
    return [Breach(rule, imp) for rule in found]


def tree_imports() -> list[Import]:
    found = []
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            source = file.read_text()
            found += list(imports_in(path, source))
            if package == "tools":
                found += list(private_attributes(path, source))
    return found


def pure_closure(
    imports: list[Import], lazy: dict[tuple[str, str], str] | None = None
) -> list[Breach]:
    """What a pure module can load through other modules of ours: a module it imports, on
    import or inside a function (which runs when called), that imports a library the pure
    packages may not. An import inside a function named in ``lazy`` (``LAZY_ALLOWED`` unless
    given) is not followed."""
    lazy = LAZY_ALLOWED if lazy is None else lazy
    by_importer: dict[str, list[Import]] = {}
    for imp in imports:
        if not (imp.deferred and (imp.path, imp.module) in lazy):
            by_importer.setdefault(imp.importer, []).append(imp)
    found = []
    for start in sorted(m for m in by_importer if any(_within(m, p) for p in PURE)):
        seen, todo = {start}, [start]
        while todo:
            for imp in by_importer.get(todo.pop(), ()):
                targets = [imp.module] + [f"{imp.module}.{n}" for n in imp.names]
                for target in targets:
                    if target in by_importer and target not in seen:
                        seen.add(target)
                        todo.append(target)
                if (
                    imp.importer != start
                    and imp.module.partition(".")[0] in NOT_IN_PURE
                    and not any(_within(imp.importer, p) for p in PURE)
                ):
                    found.append(
                        Breach(
                            f"the pure modules stay pure (reached from {start})",
                            imp,
                        )
                    )
    return found


def circles(imports: list[Import]) -> list[tuple[str, ...]]:
    """The import circles among our modules, whatever their length and wherever the imports
    are (inside functions too): each set of two or more modules in which every one reaches
    every other through imports, as sorted names. ``from package import name`` reaches the
    package and, where ``name`` is a module, the module."""
    modules = {imp.importer for imp in imports}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        for target in [imp.module] + [f"{imp.module}.{n}" for n in imp.names]:
            if target in modules and target != imp.importer:
                graph[imp.importer].add(target)
    # Tarjan's strongly connected components, without recursion.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(tuple(sorted(component)))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                on_stack.add(step)
                work.append((step, iter(sorted(graph[step]))))
            elif step in on_stack:
                low[node] = min(low[node], index[step])
    return sorted(found)


# --- the tree ---------------------------------------------------------------------------------


def test_the_tree_keeps_the_import_rules() -> None:
    imports = tree_imports()
    assert len(imports) > 500, "the walk found too few imports: is ROOT right?"
    broken = [b for imp in imports for b in breaches(imp)] + pure_closure(imports)
    unexplained = sorted({str(b) for b in broken if (b.imp.path, b.imp.module) not in ALLOWED})
    assert not unexplained, "imports that break docs/architecture.md's rules:\n" + "\n".join(
        unexplained
    )


def test_every_allowed_breach_is_still_there() -> None:
    imports = tree_imports()
    broken = {(b.imp.path, b.imp.module) for imp in imports for b in breaches(imp)} | {
        (b.imp.path, b.imp.module) for b in pure_closure(imports)
    }
    stale = sorted(set(ALLOWED) - broken)
    assert not stale, f"ALLOWED entries nothing needs any more (remove them): {stale}"


def test_no_module_imports_a_module_that_imports_it_back() -> None:
    found = circles(tree_imports())
    unexplained = [" -> ".join(c) for c in found if c not in CIRCLES_ALLOWED]
    assert not unexplained, "import circles:\n" + "\n".join(unexplained)


def test_every_lazy_import_allowed_is_still_there() -> None:
    deferred = {(i.path, i.module) for i in tree_imports() if i.deferred}
    stale = sorted(set(LAZY_ALLOWED) - deferred)
    assert not stale, f"LAZY_ALLOWED entries naming no import inside a function: {stale}"
    everything = [replace(i, deferred=False) for i in tree_imports()]
    needed = {(b.imp.path, b.imp.module) for b in pure_closure(everything, lazy={})}
    unneeded = sorted(set(LAZY_ALLOWED) - needed)
    assert not unneeded, f"LAZY_ALLOWED entries no pure module reaches (remove them): {unneeded}"


def test_every_allowed_circle_is_still_there() -> None:
    stale = sorted(set(CIRCLES_ALLOWED) - set(circles(tree_imports())))
    assert not stale, f"CIRCLES_ALLOWED entries nothing needs any more (remove them): {stale}"


# --- the checker, on made-up sources: each rule can fail ----------------------------------------


def _check(path: str, source: str) -> list[str]:
    found = [b.rule for imp in imports_in(path, source) for b in breaches(imp)]
    if path.startswith("tools/"):
        found += [b.rule for imp in private_attributes(path, source) for b in breaches(imp)]
    return found


@pytest.mark.parametrize(
    ("path", "source", "rule"),
    [
        (
            "services/gpu_worker/service.py",
            "from services.scheduler.core.types import Gpu\n",
            "the worker imports no other service",
        ),
        (
            "services/gpu_worker/engine/engine.py",
            "from ...gateway import sse\n",
            "the worker imports no other service",
        ),
        (
            "services/gpu_worker/pacing.py",
            "import services.provisioner.pool\n",
            "the worker imports no other service",
        ),
        (
            "services/gateway/app.py",
            "def f():\n    from services.gpu_worker import fmp4\n",
            "a service imports only its own package and shared",
        ),
        (
            "services/scheduler/service.py",
            "import importlib\nimportlib.import_module('services.provisioner.pool')\n",
            "a service imports only its own package and shared",
        ),
        (
            "services/provisioner/pool.py",
            "from services.gateway.store import Store\n",
            "a service imports only its own package and shared",
        ),
        (
            "services/scheduler/live.py",
            "from tools.bench.scheduler import bench_one\n",
            "services and shared never import tools",
        ),
        ("shared/wire.py", "import tools.cli\n", "services and shared never import tools"),
        (
            "shared/registry.py",
            "from services.scheduler import live\n",
            "shared imports no service",
        ),
        ("shared/__init__.py", "import services\n", "shared imports no service"),
        (
            "services/scheduler/service.py",
            "import lab.eval.rivals\n",
            "services and shared never import lab",
        ),
        (
            "services/scheduler/core/policies.py",
            "from lab.sim.policies import POLICIES\n",
            "services and shared never import lab",
        ),
        (
            "services/gateway/app.py",
            "def f():\n    from lab.sim import synth\n",
            "services and shared never import lab",
        ),
        (
            "services/scheduler/live.py",
            "import importlib\nimportlib.import_module('lab.eval.cli')\n",
            "services and shared never import lab",
        ),
        ("shared/settings.py", "from lab import sim\n", "services and shared never import lab"),
        (
            "services/scheduler/core/loop.py",
            "from services.scheduler.measured import live_profile\n",
            "the core imports only the core and shared's contracts",
        ),
        (
            "services/scheduler/core/policies.py",
            "from ..shipped import load_rho_table\n",
            "the core imports only the core and shared's contracts",
        ),
        (
            "services/scheduler/core/cluster.py",
            "from shared.wire import Heartbeat\n",
            "the core imports only the core and shared's contracts",
        ),
        (
            "services/scheduler/core/types.py",
            "def f():\n    import shared.registry\n",
            "the core imports only the core and shared's contracts",
        ),
        (
            "services/scheduler/core/autoscale.py",
            "from lab.sim.traceio import Trace\n",
            "the core imports only the core and shared's contracts",
        ),
        (
            "services/scheduler/core/loop.py",
            "import tools.report\n",
            "the core imports only the core and shared's contracts",
        ),
        (
            "lab/eval/runs.py",
            "from services.scheduler.live import LiveScheduler\n",
            "the lab uses only the policy core and the shipped tables of the services",
        ),
        (
            "lab/sim/compare.py",
            "from services.gpu_worker import pacing\n",
            "the lab uses only the policy core and the shipped tables of the services",
        ),
        (
            "tools/ctl.py",
            "from services.gateway.service import _private_helper\n",
            "tools use only public names of services and shared",
        ),
        (
            "tools/bench/worker.py",
            "from services.gpu_worker import _internal\n",
            "tools use only public names of services and shared",
        ),
        (
            "tools/bench/worker.py",
            "import services.gpu_worker._internal.x\n",
            "tools use only public names of services and shared",
        ),
        (
            "tools/replay.py",
            "from shared import wire\nwire._decode(b'')\n",
            "tools use only public names of services and shared",
        ),
        (
            "services/scheduler/core/loop.py",
            "import torch\n",
            "the pure modules stay pure",
        ),
        (
            "lab/sim/simulator.py",
            "def f():\n    import nats.js\n",
            "the pure modules stay pure",
        ),
        (
            "lab/sim/synth.py",
            "from redis.asyncio import Redis\n",
            "the pure modules stay pure",
        ),
        (
            "services/scheduler/core/__init__.py",
            "from aiohttp import web\n",
            "the pure modules stay pure",
        ),
        (
            "services/gpu_worker/handoff/protocol.py",
            "import redis.exceptions\n",
            "the pure modules stay pure",
        ),
        (
            "services/gpu_worker/handoff/protocol.py",
            "from nats.errors import TimeoutError\n",
            "the pure modules stay pure",
        ),
    ],
)
def test_the_checker_flags_a_made_up_breach(path: str, source: str, rule: str) -> None:
    assert rule in _check(path, source)


@pytest.mark.parametrize(
    ("path", "source"),
    [
        ("services/gpu_worker/service.py", "from shared.wire import Assign\nfrom . import inbox\n"),
        ("services/gpu_worker/engine/engine.py", "from ..model.config import ModelConfig\n"),
        ("lab/eval/plots.py", "import matplotlib.pyplot\n"),
        ("services/scheduler/core/loop.py", "from shared.profile import LatencyProfile\n"),
        ("services/scheduler/core/policies.py", "from shared.policies import LIVE_POLICIES\n"),
        ("services/scheduler/core/loop.py", "import math\nfrom .cluster import Cluster\n"),
        ("lab/sim/simulator.py", "from services.scheduler.core.loop import Controller\n"),
        ("lab/sim/profiler.py", "from services.scheduler.shipped import save_rho_table\n"),
        ("lab/eval/results.py", "from tools.bench.scheduler import bench_one\n"),
        ("tools/replay.py", "from lab.sim.viewer import summary\n"),
        (
            "tools/ctl.py",
            "from services.gateway.service import GatewayService\n"
            "from shared import wire\nwire.__name__\n",
        ),
        ("tools/bench/worker.py", "import torch\ntorch._C\n"),
    ],
)
def test_the_checker_passes_what_the_rules_allow(path: str, source: str) -> None:
    assert _check(path, source) == []


def test_a_pure_module_reaching_torch_through_another_is_flagged() -> None:
    imports = list(
        imports_in("services/scheduler/core/loop.py", "from shared.helper import f\n")
    ) + list(imports_in("shared/helper.py", "import torch\n"))
    found = pure_closure(imports)
    assert [str(b) for b in found] == [
        "shared/helper.py:1: the pure modules stay pure "
        "(reached from services.scheduler.core.loop): imports torch"
    ]


def test_relative_imports_are_made_absolute() -> None:
    found = list(
        imports_in(
            "services/gpu_worker/engine/engine.py",
            "from .. import telemetry\nfrom ..model.dit import ChunkCaches\n"
            "from .slots import SlotPool\n",
        )
    )
    assert [(i.module, i.names) for i in found] == [
        ("services.gpu_worker.telemetry", ()),
        ("services.gpu_worker.model.dit", ("ChunkCaches",)),
        ("services.gpu_worker.engine.slots", ("SlotPool",)),
    ]


def test_an_import_inside_a_function_is_followed_from_a_pure_module() -> None:
    imports = list(
        imports_in(
            "lab/sim/cli.py",
            "def evaluate():\n    from lab.eval import report\n",
        )
    ) + list(imports_in("lab/eval/report.py", "def draw():\n    import matplotlib\n"))
    assert [str(b) for b in pure_closure(imports, lazy={})] == [
        "lab/eval/report.py:2: the pure modules stay pure "
        "(reached from lab.sim.cli): imports matplotlib"
    ]
    # Named in the allow-list, with its reason, the lazy import is not followed.
    allowed = {("lab/eval/report.py", "matplotlib"): "only when a figure is drawn"}
    assert pure_closure(imports, lazy=allowed) == []


def _circles(sources: dict[str, str]) -> list[tuple[str, ...]]:
    return circles([imp for path, src in sources.items() for imp in imports_in(path, src)])


def test_a_made_up_circle_is_found_whatever_its_length_and_wherever_the_import() -> None:
    # Two modules, one of them importing inside a function.
    assert _circles(
        {
            "lab/sim/a.py": "from lab.sim.b import f\n",
            "lab/sim/b.py": "def f():\n    from lab.sim import a\n",
        }
    ) == [("lab.sim.a", "lab.sim.b")]
    # Three modules across packages, relative imports made absolute.
    assert _circles(
        {
            "services/scheduler/live.py": "from .executor import Executor\n",
            "services/scheduler/executor.py": "from . import ingest\n",
            "services/scheduler/ingest.py": "import services.scheduler.live\n",
            "services/scheduler/ledger.py": "from .live import LiveScheduler\n",
        }
    ) == [("services.scheduler.executor", "services.scheduler.ingest", "services.scheduler.live")]
    # A package whose __init__ imports a submodule that imports the package back.
    assert _circles(
        {
            "services/provisioner/__init__.py": "from .pool import Pool\n",
            "services/provisioner/pool.py": "import services.provisioner\n",
        }
    ) == [("services.provisioner", "services.provisioner.pool")]


def test_imports_that_only_go_down_make_no_circle() -> None:
    assert (
        _circles(
            {
                "lab/sim/cli.py": "from lab.sim.run import sim_run\nfrom lab.eval import cli\n",
                "lab/eval/cli.py": "def register():\n    from lab.eval import results\n",
                "lab/eval/results.py": "def f():\n    from lab.sim.run import sim_run\n",
                "lab/sim/run.py": "from lab.sim.policies import POLICIES\n",
                "lab/sim/policies.py": "from services.scheduler.core.policies import Policies\n",
            }
        )
        == []
    )
