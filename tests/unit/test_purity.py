"""solver/ stays pure: importing it loads no cloud SDK."""

from __future__ import annotations

import subprocess
import sys


def test_solver_imports_no_cloud_sdk():
    code = (
        "import sys, solver.defaults, solver.skypilot, solver.calibration\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('pulumi', 'pulumi_aws', 'pulumi_gcp', 'boto3', 'google', 'coral_iac')]\n"
        "print(bad); raise SystemExit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plan_validator_imports_no_solver():
    """The validator checks plans independently: no OR-Tools behind it."""
    code = (
        "import sys, solver.validate\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'ortools' or m in "
        "('solver.allocation', 'solver.placement', 'solver.template_library')]\n"
        "print(bad); raise SystemExit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
