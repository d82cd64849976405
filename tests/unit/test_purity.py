"""Dependencies point one way: solver/ loads no cloud SDK nor torch, the plan validator no solver."""

from __future__ import annotations

import subprocess
import sys

import pytest

SOLVER_MODULES = (
    "solver.defaults, solver.skypilot, solver.calibration, solver.library, solver.allocation, "
    "solver.planner, solver.baselines, solver.monolithic, solver.simulator, solver.traces"
)
# torch and the profiler are the optional `profile` extra: solver/ must import without them.
CLOUD = ("pulumi", "pulumi_aws", "pulumi_gcp", "boto3", "google", "coral_iac", "torch", "profiler")
SOLVERS = ("ortools", "solver.allocation", "solver.placement", "solver.template_library")


@pytest.mark.parametrize(
    ("imports", "forbidden"),
    [(SOLVER_MODULES, CLOUD), ("solver.validate", SOLVERS)],
    ids=["solver-has-no-cloud-sdk", "validator-has-no-solver"],
)
def test_import_loads_nothing_forbidden(imports, forbidden):
    code = (
        f"import sys, {imports}\n"
        f"bad = [m for m in sys.modules if m in {forbidden!r} or m.split('.')[0] in {forbidden!r}]\n"
        "print(bad); raise SystemExit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
