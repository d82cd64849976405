"""Dependencies point one way: solver/ loads no cloud SDK nor torch, the plan validator no solver,
and every stage package says what it takes in and gives out."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys

import pytest

import solver
from tests.conftest import REPO

PROFILER = "solver.performance.profiler"  # the optional `profile` extra (torch)
# Every module of the core except the profiler, found by walking the package so none is missed.
SOLVER_MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(solver.__path__, "solver.")
    if not m.name.startswith(PROFILER)
)
CLOUD = ("pulumi", "pulumi_aws", "pulumi_gcp", "boto3", "google", "coral_iac", "torch", PROFILER)
SOLVERS = (
    "ortools",
    "solver.allocation.solve",
    "solver.serving.placement_search",
    "solver.serving.enumeration",
)


@pytest.mark.parametrize(
    ("imports", "forbidden"),
    [(", ".join(SOLVER_MODULES), CLOUD), ("solver.plan.validator", SOLVERS)],
    ids=["solver-has-no-cloud-sdk", "validator-has-no-solver"],
)
def test_import_loads_nothing_forbidden(imports, forbidden):
    code = (
        f"import sys, {imports}\n"
        f"bad = [m for m in sys.modules if m in {forbidden!r} or m.split('.')[0] in {forbidden!r}"
        f" or m.startswith({PROFILER!r})]\n"
        "print(bad); raise SystemExit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_walk_found_every_stage():
    stages = {m.split(".")[1] for m in SOLVER_MODULES if m.count(".") >= 1}
    for stage in ("catalog", "performance", "serving", "allocation", "simulation", "capacity", "plan"):
        assert stage in stages


def test_solver_source_never_names_coral_iac():
    """Also where an import is inside a function (which the import test cannot see)."""
    offenders = []
    for path in sorted((REPO / "solver").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith("coral_iac")]
    assert offenders == []


@pytest.mark.parametrize(
    "package",
    sorted(
        str(p.parent.relative_to(REPO))
        for top in ("solver", "coral_iac")
        for p in (REPO / top).rglob("__init__.py")
    ),
)
def test_every_package_docstring_says_what_it_does(package):
    init = REPO / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    assert doc and len(doc.split()) >= 8, f"{package}/__init__.py needs a docstring"
