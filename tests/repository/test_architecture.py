"""The import structure of `solver` and `coral_iac`, read from their source with `ast` (nothing
is imported, so an import inside a function counts as much as one at the top):

1. no import cycle among their modules;
2. no module imports from a layer above its own (`LAYERS`, lowest first);
3. an import inside a function has a comment on the line above it (or on its own lines) that
   says why it is there: the one reason is to defer a heavy optional dependency (Pulumi,
   ortools, scipy.stats, torch, vLLM, matplotlib) that the CLI should not load at start-up.

Imports under `if TYPE_CHECKING:` count like any other: a cycle through them is still a cycle
for mypy and for a reader. Importing `a.b.c` also runs the package `a.b`, so for cycles it
counts as an import of `a.b` as well (not of the packages `solver` and `coral_iac`: their
`__init__.py` hold documentation only). Each failure names the module, its file and line.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

ROOTS = ("solver", "coral_iac")

# Layers, lowest first. A module belongs to the layer of the longest entry that names it or one
# of its packages, and may import its own layer (without a cycle) and those below it. A new
# module in a listed package needs no entry; a new package or top-level module needs one.
LAYERS: list[tuple[str, ...]] = [
    # Vocabulary every stage shares (phases, jobs, frozen models), the library modes' strategies
    # (what differs between vllm, general and paper), the errors, timers.
    ("solver.types", "solver.modes", "solver.errors", "solver.timing"),
    # Reading and writing files (YAML, JSON, digests, atomic writes).
    ("solver.io",),
    # What can be rented and served, before any stack: GPU types, node configs, offers, model
    # cards (shipped and a stack's own), vLLM support, and the market setting a stack picks.
    ("solver.catalog",),
    # The stack config (`coral:fleet`), the input of every stage; it checks its own lists.
    ("solver.stack",),
    # The stack's market: the catalog's offers or the paper's Table 1, with the stack's overrides.
    ("solver.catalog.market", "solver.catalog.paper_market"),
    # The stack checked against the catalog and the model cards.
    ("solver.validation",),
    # Stage 2: layer times and the profile table T̂ (analytical, measured, calibrated); the GPU
    # profiler (torch) that measures tables.
    ("solver.performance",),
    # Stage 3, offline: serving templates (placement search, enumeration, pruning, library) and
    # one instance's engine model.
    ("solver.serving",),
    # The plan's types: what the planner writes and allocation, simulation, operations and the
    # Pulumi program read.
    ("solver.plan_schema",),
    # Stage 4, online: the allocation ILP and the baselines.
    ("solver.allocation",),
    # Request traces and the event-driven simulator: any plan replayed.
    ("solver.simulation",),
    # The SLO capacity model: each template's capacity at its model's attainment target, from
    # the planning workload's lengths and burstiness (the allocation prices it, the closed loop
    # corrects it).
    ("solver.capacity",),
    # Stage 5: the planner (allocation, then simulation for SLO attainment), the validator,
    # length routing, epochs of re-planning.
    ("solver.plan",),
    # Beside the pipeline: demand rules and the safe-reconfiguration state machine.
    ("solver.operations",),
    # Exact but slow test oracles, and the evaluation: the paper's scenarios, its comparison,
    # the measurements behind it, Helix and the figures (`coral bench paper`, ...), and outside
    # references (Vidur). They may use any stage and no stage uses them.
    ("solver.oracles", "solver.evaluation"),
    # The deployment side's pure parts: the project folder, the stack's `deploy` section, demand
    # sources with I/O, model files, quotas, what a plan needs to deploy, each vLLM process's
    # arguments.
    (
        "coral_iac.project",
        "coral_iac.deploy_settings",
        "coral_iac.engine_args",
        "coral_iac.exposure",
        "coral_iac.model_files",
        "coral_iac.quota",
        "coral_iac.deployable",
        "coral_iac.demand_sources",
    ),
    # Declaring resources: cloud-init rendering, per-region networks and identities, the
    # gateway (and its configuration), one replica's nodes, and what the gateway and the fleet
    # cost.
    (
        "coral_iac.bootstrap",
        "coral_iac.infra",
        "coral_iac.gateway_config",
        "coral_iac.gateway",
        "coral_iac.gateway_cost",
        "coral_iac.cost_report",
        "coral_iac.components",
    ),
    # The running fleet read back (its latency histograms by replica label, as the nodes are
    # tagged), and a stack file edited in place (`coral calibrate --write`).
    ("coral_iac.fleet_metrics", "coral_iac.stack_files"),
    # The Pulumi program: the fleet of a stack's plan.
    ("coral_iac.program",),
    # The program run offline under Pulumi's mocks (`coral preview`, `coral render`, tests).
    ("coral_iac.preview",),
    # The CLI's helpers every command shares: console, plan tables, Markdown reports.
    ("coral_iac.cli.console", "coral_iac.cli.plan_output", "coral_iac.cli.reports"),
    # The CLI's command groups, one module each (`deploy` and `simulate` read plans via `plan`).
    ("coral_iac.cli",),
    # The `coral` tool: registers every command group.
    ("coral_iac.cli.app",),
]


@dataclass(frozen=True)
class Import:
    """One imported module of one import statement."""

    module: str  # the importing module
    path: Path
    line: int
    name: str  # the imported module, as written (a name from it resolved to the module)
    target: str | None  # the module of `solver` or `coral_iac` it loads; None: another package
    in_function: bool
    commented: bool  # a comment on the line above its run of imports, or on its own lines

    def where(self) -> str:
        return f"{self.module} ({self.path.relative_to(REPO)}:{self.line})"


@cache
def modules() -> dict[str, Path]:
    """Every module of `solver` and `coral_iac` (a package by its `__init__.py`)."""
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _ours(name: str) -> str | None:
    """The module `name` loads, if ours: itself, or for `pkg.mod.Name` its longest module."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules():
            return ".".join(parts)
        parts.pop()
    return None


# A comment that only silences a tool says nothing about why.
PRAGMA = re.compile(
    r"#\s*(noqa(:\s*[A-Z0-9, ]+)?|type:\s*ignore(\[[^\]]*\])?|pragma:.*|fmt:\s*\w+)\s*$"
)


def _comment_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT and not PRAGMA.match(t.string)}


def _statement_lists(tree: ast.AST) -> list[list[ast.stmt]]:
    out = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            value = getattr(node, field, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                out.append(value)
    return out


def _parse(module: str, path: Path, source: str) -> list[Import]:
    tree = ast.parse(source, str(path))
    comments = _comment_lines(source)
    in_function = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        for n in ast.walk(f)
        if isinstance(n, ast.Import | ast.ImportFrom)
    }
    # Consecutive import statements (blank lines between allowed) share the comment above the
    # first of them.
    commented: dict[int, bool] = {}
    for body in _statement_lists(tree):
        run = False
        for stmt in body:
            if not isinstance(stmt, ast.Import | ast.ImportFrom):
                run = False
                continue
            own = any(n in comments for n in range(stmt.lineno - 1, (stmt.end_lineno or 0) + 1))
            run = own or run
            commented[id(stmt)] = run
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = [(base, f"{base}.{a.name}") for a in node.names]
        else:
            continue
        seen = set()
        for written, full in names:
            target = _ours(full)
            key = target or written
            if key in seen:
                continue
            seen.add(key)
            out.append(
                Import(
                    module,
                    path,
                    node.lineno,
                    target or written,
                    target,
                    id(node) in in_function,
                    commented.get(id(node), False),
                )
            )
    return out


@cache
def all_imports() -> list[Import]:
    return [i for m, p in modules().items() for i in _parse(m, p, p.read_text(encoding="utf-8"))]


def edges(packages: bool = False) -> list[tuple[Import, str]]:
    """(import, module of ours it loads); with `packages`, also each package above that module
    (whose `__init__.py` the import runs first)."""
    out = []
    for i in all_imports():
        if i.target is None:
            continue
        parts = i.target.split(".")
        for n in range(len(parts), 1 if packages else len(parts) - 1, -1):  # not the roots
            target = ".".join(parts[:n])
            if target != i.module and target in modules():
                out.append((i, target))
    return out


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (entry length, layer)
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (
                best is None or len(entry) > best[0]
            ):
                best = (len(entry), index)
    return None if best is None else best[1]


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for i, target in edges(packages=True):
        graph[i.module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_source_was_read():
    """Guards the checks below against passing on nothing."""
    assert {"solver.stack", "solver.plan.planner", "coral_iac.cli.app"} <= set(modules())
    assert len(edges()) > 300
    assert any(i.in_function and i.commented for i in all_imports())


def test_no_import_cycles():
    problems = []
    for component in _cycles():
        inside = set(component)
        lines = [
            f"  {i.where()} imports {target}"
            for i, target in edges(packages=True)
            if i.module in inside and target in inside
        ]
        problems.append(f"cycle among {', '.join(component)}:\n" + "\n".join(lines))
    assert not problems, "\n".join(problems)


def test_every_module_has_a_layer():
    missing = [m for m in modules() if m not in ROOTS and layer_of(m) is None]
    assert not missing, f"add these to LAYERS in {__file__}: {missing}"


def test_no_module_imports_a_higher_layer():
    problems = []
    for i, target in edges():
        low, high = layer_of(i.module), layer_of(target)
        if low is not None and high is not None and high > low:
            problems.append(
                f"{i.where()} imports {target}, a higher layer "
                f"({', '.join(LAYERS[high])} above {', '.join(LAYERS[low])})"
            )
    assert not problems, "imports against the layers:\n" + "\n".join(sorted(set(problems)))


def test_every_import_inside_a_function_says_why():
    problems = [
        f"{i.where()} imports {i.name} inside a function without a comment on the line above: "
        "move it to the top of the module, or say why it is deferred (a heavy optional "
        "dependency)"
        for i in all_imports()
        if i.in_function and not i.commented
    ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("def f():\n    import os\n", "uncommented"),
        ("def f():\n    # os is heavy\n    import os\n\n    import sys\n", None),
        ("def f():\n    x = 1\n    import os  # heavy\n", None),
        ("def f():\n    # heavy\n    import os\n    x = 1\n    import sys\n", "uncommented"),
        ("import os\n", None),
        ("def f():  # type: ignore[no-untyped-def]\n    import os  # noqa: F401\n", "pragma"),
        ("def f():\n    import os  # noqa: F401  (sets up a logger)\n", None),
    ],
)
def test_the_comment_rule_on_examples(source, problem):
    found = [
        i
        for i in _parse("solver.example", REPO / "solver" / "example.py", source)
        if i.in_function and not i.commented
    ]
    assert bool(found) == (problem is not None)


# The modules a stack config (`FleetConfig`) may reach from the Pulumi program, each for a reason:
# every stage below takes a narrow typed input instead (`MarketScope`, `LibraryScope`,
# `AttainmentScope`, `PlanScope`, the models' specs, one settings section), built once here.
FLEET_ROOMS = {
    "solver.stack": "defines it and checks its own lists",
    "solver.validation": "checks it against the catalog and the model cards",
    "coral_iac.demand_sources": "resolves its demand from the stack's demand source",
    "coral_iac.program": "reads it from the stack config and splits it for the stages",
    "solver.plan.planner": "splits it for the planning stages (market, library, loop, checks)",
    "solver.plan.length_routing": "plans a routed model's length buckets as models of the fleet",
}


def fleet_rooms(start: str = "coral_iac.program") -> dict[str, list[str]]:
    """Module -> its functions with a `FleetConfig` parameter, for the modules `start` reaches
    through imports (itself included)."""
    reach: dict[str, set[str]] = {}
    for i, target in edges():
        reach.setdefault(i.module, set()).add(target)
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(reach.get(module, ()))
    rooms = {}
    for module in sorted(seen):
        tree = ast.parse(modules()[module].read_text(encoding="utf-8"))
        takes = [
            f.name
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for a in f.args.posonlyargs + f.args.args + f.args.kwonlyargs
            if a.annotation is not None and "FleetConfig" in ast.unparse(a.annotation)
        ]
        if takes:
            rooms[module] = takes
    return rooms


def test_the_stack_config_reaches_at_most_six_modules_from_the_program():
    rooms = fleet_rooms()
    assert "solver.plan.planner" in rooms  # the walk is read at all
    extra = {m: f for m, f in rooms.items() if m not in FLEET_ROOMS}
    assert not extra, (
        "these modules take the whole stack config (FleetConfig); give them the narrow input "
        f"they read (a scope from FleetConfig, the models' specs, one settings section): {extra}"
    )
    assert len(FLEET_ROOMS) <= 6
