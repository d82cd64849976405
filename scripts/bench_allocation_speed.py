"""The speed half of `scripts/bench_allocation` (issue #20): per-stack times and the scaling plot.

Run through `scripts/bench_allocation` (it sets up the environment first).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table
from scaling_problems import scaled_problem

from solver.allocation.problem import Problem, Solution, make_columns
from solver.allocation.solve import solve_allocation
from solver.catalog.market import build_market
from solver.performance.default_model import load_perf_model
from solver.plan.demand import capacity_needed
from solver.plan.planner import libraries_for, plan_stack, stack_demand
from solver.plan.validator import validate_plan
from solver.stack import FleetConfig, load_stack

ROOT = Path(__file__).resolve().parents[1]
console = Console(width=200)
SPEED_COLUMNS = [
    "stack",
    "load s",
    "columns",
    "after reduction",
    "backend",
    "solve s",
    "coral plan s",
    "gap",
    "served",
    "$/hour",
]


def family(stack: str) -> Path:
    """The library folder a paper stack plans with (its scenarios share their base's)."""
    for base in ("paper-core", "paper-extended"):
        if stack.startswith(base):
            return ROOT / ".coral/library" / base
    return ROOT / ".coral/library" / stack


def speed_table(stacks: list[str], repeats: int, gap: float) -> list[str]:
    """One row per stack (module doc of bench_allocation); returns the markdown lines."""
    perf = load_perf_model()
    table = Table(title=f"Allocation speed: solve s is the median of {repeats}, gap {gap:.1%}")
    for c in SPEED_COLUMNS:
        table.add_column(c, justify="left" if c in ("stack", "backend") else "right")
    md = ["| " + " | ".join(SPEED_COLUMNS) + " |", "|---|" + "---:|" * (len(SPEED_COLUMNS) - 1)]
    for name in stacks:
        fleet = _at_gap(load_stack(ROOT / "stacks", name), gap)
        start = time.perf_counter()
        libs = libraries_for(perf, fleet, list(stack_demand(fleet.models)), family(name), False)
        load = time.perf_counter() - start
        demand = stack_demand(fleet.models)
        market = build_market(fleet.market_scope(), perf.catalog)
        columns = make_columns({j: lib.templates for j, lib in libs.items()}, market, demand)
        problem = Problem(
            capacity_needed(fleet.allocation, demand), columns, market, fleet.allocation
        )
        times, solutions = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            solutions.append(solve_allocation(problem))
            times.append(time.perf_counter() - start)
        plan = plan_stack(name, fleet, perf.catalog, libs)
        validate_plan(
            plan, fleet.plan_scope(), perf.catalog, perf.cards
        )  # raises if it does not validate
        row = _row(name, load, solutions[0], fleet, statistics.median(times), _cli_wall(name, gap))
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    return md


def _row(
    name: str, load: float, sol: Solution, fleet: FleetConfig, solve: float, wall: float | None
) -> list[str]:
    report = sol.report
    assert report is not None
    return [
        name,
        f"{load:.2f}",
        f"{sol.columns[0]:,}",
        f"{sol.columns[1]:,}",
        fleet.allocation.backend,
        f"{solve:.2f}",
        "-" if wall is None else f"{wall:.1f}",
        "unknown" if report.gap is None else f"{100 * report.gap:.2f}%",
        f"{sol.fraction:.4f}",
        f"{report.objective:.2f}",
    ]


def _at_gap(fleet: FleetConfig, gap: float) -> FleetConfig:
    return fleet.model_copy(
        update={"allocation": fleet.allocation.model_copy(update={"relative_gap": gap})}
    )


def _cli_wall(name: str, gap: float) -> float | None:
    """Wall seconds of `coral plan --stack NAME --json` in a scratch folder: the stack at
    `gap`, with the SLO attainment loop and its simulation off where the stack has them."""
    doc = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{name}.yaml").read_text(encoding="utf-8"))
    spec = doc["config"]["coral:fleet"]
    spec.setdefault("allocation", {})["relative_gap"] = gap
    if "attainment" in FleetConfig.model_fields:
        spec["attainment"] = {"rounds": 0, "verify_minutes": 0}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "stacks").mkdir()
        (Path(tmp) / "stacks" / f"Pulumi.{name}.yaml").write_text(yaml.safe_dump(doc))
        coral = ROOT / ".venv/bin/coral"
        cmd = [str(coral), "plan", "--stack", name, "--library", str(family(name)), "--json"]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, env=os.environ.copy())
        wall = time.perf_counter() - start
    return wall if done.returncode in (0, 3) else None


def scaling_table(scales: list[int], gap: float, plot: Path) -> list[str]:
    """Solve time against size on the scaling family of paper-extended, and its plot."""
    perf = load_perf_model()
    fleet = _at_gap(load_stack(ROOT / "stacks", "paper-extended"), gap)
    libs = libraries_for(
        perf, fleet, list(stack_demand(fleet.models)), family("paper-extended"), False
    )
    demand = stack_demand(fleet.models)
    market = build_market(fleet.market_scope(), perf.catalog)
    columns = make_columns({j: lib.templates for j, lib in libs.items()}, market, demand)
    base = Problem(capacity_needed(fleet.allocation, demand), columns, market, fleet.allocation)
    table = Table(title=f"Scaling (paper-extended x k, gap {gap:.1%}, median of 3)")
    heads = ["scale", "demand rows", "regions", "columns", "after reduction", "solve s", "gap"]
    for c in heads:
        table.add_column(c, justify="right")
    md = ["| " + " | ".join(heads) + " |", "|" + "---:|" * len(heads)]
    sizes, seconds = [], []
    for k in scales:
        problem = scaled_problem(base, k)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            sol = solve_allocation(problem)
            times.append(time.perf_counter() - start)
        report = sol.report
        assert report is not None
        regions = len({c.region for c in problem.columns})
        gap_text = "unknown" if report.gap is None else f"{100 * report.gap:.2f}%"
        row = [
            str(k),
            str(len(problem.demand)),
            str(regions),
            f"{len(problem.columns):,}",
            f"{sol.columns[1]:,}",
            f"{statistics.median(times):.2f}",
            gap_text,
        ]
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
        sizes.append(len(problem.columns))
        seconds.append(statistics.median(times))
    console.print(table)
    _plot(sizes, seconds, plot)
    console.print(f"Wrote {plot}")
    return md


def _plot(sizes: list[int], seconds: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(sizes, seconds, marker="o")
    ax.set_xlabel("columns (template x region) before reduction")
    ax.set_ylabel("solve s (median of 3)")
    ax.set_title("Allocation solve time vs size (paper-extended x k)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
