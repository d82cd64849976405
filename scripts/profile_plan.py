"""Profile `coral plan --stack STACK` with cProfile and write the heaviest functions as a table.

The stack's template library is built first (an unprofiled `coral plan`), so the profile shows
a warm plan: what every re-plan and every `pulumi preview` pays. The tables list the plan's
phases (cumulative time: inside them and everything they call) and the functions with the most
time of their own (`tottime`), with call counts, from one run. cProfile slows Python-heavy code more than the
solver's C++, so shares, not seconds, are what to compare.

Run through `scripts/profile_plan` (it sets up the environment first).
"""

from __future__ import annotations

import cProfile
import pstats
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

REPO = Path(__file__).resolve().parents[1]
# The functions to always show: the phases a plan goes through (library load, SLO capacity,
# ILP, closed-loop simulation, verification), by where they live.
PHASES = {
    "solver/plan/planner.py:libraries_for": "library load",
    "solver/capacity/slo_capacity.py:capacity_factors": "SLO capacity model",
    "solver/allocation/solve.py:solve_allocation": "ILP (all solves)",
    "solver/allocation/solve.py:_most_served": "ILP: most-served (scarce)",
    "solver/simulation/simulator.py:simulate": "simulation (closed loop and verification)",
    "solver/plan/attainment.py:verify_plan": "verification",
}


def _plan(stack: str, out: Path) -> list[str]:
    # One process: cProfile does not see worker processes (the restricted searches').
    return ["plan", "--stack", stack, "--out", str(out), "--workers", "1"]


def _name(func: tuple[str, int, str]) -> str:
    path, line, name = func
    try:
        path = str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        path = Path(path).name
    return f"{path}:{name}" if line else name


def main(
    stack: Annotated[str, typer.Argument(help="A committed stack (stacks/Pulumi.<stack>.yaml).")],
    top: Annotated[int, typer.Option(help="Rows of the heaviest functions.")] = 25,
    markdown: Annotated[Path | None, typer.Option(help="Write the table here.")] = None,
) -> None:
    from coral_iac.cli.app import app

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        subprocess.run([str(REPO / ".venv/bin/coral"), *_plan(stack, out)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        profile = cProfile.Profile()
        begin = time.perf_counter()
        profile.enable()
        try:
            app(_plan(stack, out), standalone_mode=False)
        finally:
            profile.disable()
        wall = time.perf_counter() - begin
    stats = pstats.Stats(profile)
    rows = stats.stats  # type: ignore[attr-defined]
    by_name = {_name(f): (cc, nc, tt, ct) for f, (cc, nc, tt, ct, _callers) in rows.items()}
    heaviest = sorted(
        (item for item in by_name.items() if item[0].startswith(("solver/", "coral_iac/"))
         or "Solve" in item[0]),
        key=lambda kv: -kv[1][2],
    )[:top]  # fmt: skip
    lines = [
        f"# Where `coral plan --stack {stack}` spends its time",
        "",
        f"One warm plan (library already built) under cProfile: {wall:.1f} s wall. Written by "
        f"`scripts/profile_plan {stack}`; cProfile slows Python code more than the solver's, so "
        "compare shares.",
        "",
        "## By phase",
        "",
        "Phases nest: verification and the closed loop both simulate, and the most-served "
        "solves are part of all solves.",
        "",
        "| phase | function | calls | cumulative s | share |",
        "|---|---|---:|---:|---:|",
    ]
    for name, phase in PHASES.items():
        if name in by_name:
            _cc, nc, _tt, ct = by_name[name]
            lines.append(f"| {phase} | `{name}` | {nc} | {ct:.1f} | {ct / wall:.0%} |")
    lines += [
        "",
        "## Heaviest functions (own time)",
        "",
        "| function | calls | own s | cumulative s | share |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (_cc, nc, tt, ct) in heaviest:
        lines.append(f"| `{name}` | {nc} | {tt:.1f} | {ct:.1f} | {ct / wall:.0%} |")
    text = "\n".join(lines) + "\n"
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(text)
    typer.echo(text)


if __name__ == "__main__":
    typer.run(main)
