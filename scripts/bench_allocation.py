"""Benchmark the online allocation on the paper's stacks: speed (issue #20) and baselines (#4).

Default: per stack, the libraries' load time, the columns before and after reduction, the
backend, the solve time (median of --repeats solves, at --gap), the wall time of `coral plan`
(a subprocess, the SLO attainment loop and its simulation off), the gap and the served
fraction; then the scaling family (`scaling_problems`) and its plot.

`--baselines`: Coral's hourly cost, served fraction, solve time and gap; Homo's and
Cauchy-like's cost and served fraction; and the ratios the paper reports (cost when every
method serves everything; goodput, i.e. served fraction, when scarce).

Run through `scripts/bench_allocation` (it sets up the environment first).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from solver.evaluation.paper_results import paper_results
from solver.evaluation.scenarios import scenario_of_stack
from solver.performance.default_model import load_perf_model
from solver.plan.planner import libraries_for, plan_stack, stack_demand
from solver.plan.validator import validate_plan
from solver.stack import load_stack

ROOT = Path(__file__).resolve().parents[1]
STACKS = [
    "paper-core",
    "paper-extended",
    "paper-core-scarce",
    "paper-extended-scarce",
    "paper-extended-large-heavy",
    "paper-extended-small-heavy",
]
console = Console(width=200)


def paper_claim(stack: str) -> str:
    """The paper's Sec. 6 ratios and solve time for a scenario stack (solver/data/paper_results.yaml)."""
    key = scenario_of_stack(stack)
    return "" if key is None else paper_results().summary(key, with_solve_time=True)


def main(
    stacks: Annotated[list[str] | None, typer.Option(help="Stacks to run.")] = None,
    repeats: Annotated[int, typer.Option(help="Coral solves per stack (median time).")] = 5,
    markdown: Annotated[Path | None, typer.Option(help="Also write the table here.")] = None,
    baselines: Annotated[bool, typer.Option(help="The baseline comparison instead.")] = False,
    gap: Annotated[float, typer.Option(help="Relative gap of the speed table's solves.")] = 0.005,
    scaling: Annotated[
        list[int] | None, typer.Option(help="Scales of the scaling family (default 1-3).")
    ] = None,
    plot: Annotated[Path, typer.Option(help="Where the scaling plot goes.")] = ROOT
    / "docs/allocation-scaling.png",
    backends: Annotated[
        list[str] | None,
        typer.Option(help="Compare these OR-Tools backends instead (one solve each)."),
    ] = None,
    backend_stack: Annotated[str, typer.Option(help="Stack for --backends.")] = "paper-extended",
    time_limit: Annotated[float, typer.Option(help="Time limit per solve for --backends.")] = 120,
) -> None:
    if backends:
        md = compare_backends(backend_stack, backends, time_limit)
        if markdown:
            markdown.write_text("\n".join(md) + "\n", encoding="utf-8")
        return
    if not baselines:
        from bench_allocation_speed import scaling_table, speed_table

        md = speed_table(stacks or STACKS, repeats, gap)
        md += ["", *scaling_table(scaling or [1, 2, 3], gap, plot)]
        if markdown:
            markdown.write_text("\n".join(md) + "\n", encoding="utf-8")
        return
    perf = load_perf_model()
    table = Table(title=f"Allocation: Coral vs baselines (solve time: median of {repeats})")
    cols = [
        "stack",
        "Coral $/h",
        "served",
        "solve s",
        "gap",
        "Homo $/h",
        "served",
        "Cauchy $/h",
        "served",
        "Homo/Coral",
        "Cauchy/Coral",
        "paper",
    ]
    for c in cols:
        table.add_column(c, justify="left" if c in ("stack", "paper") else "right")
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name in stacks or STACKS:
        fleet = load_stack(ROOT / "stacks", name)
        base = "paper-core" if name.startswith("paper-core") else "paper-extended"
        libs = libraries_for(
            perf, fleet, list(stack_demand(fleet.models)), ROOT / ".coral/library" / base
        )
        plans, times = [], []
        for _ in range(repeats):
            p = plan_stack(name, fleet, perf.catalog, libs)
            plans.append(p)
            assert p.solver is not None
            times.append(p.solver.solve_seconds)
        coral = validate_plan(plans[0], fleet.plan_scope(), perf.catalog, perf.cards)
        homo = validate_plan(
            plan_stack(name, fleet, perf.catalog, libs, method="homo"),
            fleet.plan_scope(),
            perf.catalog,
            perf.cards,
        )
        cauchy = validate_plan(
            plan_stack(name, fleet, perf.catalog, libs, method="cauchy"),
            fleet.plan_scope(),
            perf.catalog,
            perf.cards,
        )
        assert coral.solver is not None
        row = [
            name,
            f"{coral.hourly_cost_usd:.2f}",
            f"{coral.served_fraction:.3f}",
            f"{statistics.median(times):.2f}",
            _gap(coral.solver.gap),
            f"{homo.hourly_cost_usd:.2f}",
            f"{homo.served_fraction:.3f}",
            f"{cauchy.hourly_cost_usd:.2f}",
            f"{cauchy.served_fraction:.3f}",
            _ratio(homo, coral),
            _ratio(cauchy, coral),
            paper_claim(name),
        ]
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    console.print(
        "Ratios: cost ratio when both serve all demand; otherwise goodput (served fraction) of "
        "Coral over the baseline, with the cost ratio."
    )
    if markdown:
        markdown.write_text("\n".join(md) + "\n", encoding="utf-8")


def compare_backends(stack: str, backends: list[str], time_limit: float) -> list[str]:
    """One Coral solve per OR-Tools backend on one stack: status, objective, gap, seconds."""
    perf = load_perf_model()
    base = load_stack(ROOT / "stacks", stack)
    family = "paper-core" if stack.startswith("paper-core") else "paper-extended"
    libs = libraries_for(
        perf, base, list(stack_demand(base.models)), ROOT / ".coral/library" / family
    )
    table = Table(
        title=f"Backends on {stack} (time limit {time_limit:g} s, gap {base.allocation.relative_gap:.0%})"
    )
    for col in ("backend", "status", "$/hour", "gap", "solve s"):
        table.add_column(col, justify="left" if col in ("backend", "status") else "right")
    md = ["| backend | status | $/hour | gap | solve s |", "|---|---|---:|---:|---:|"]
    for backend in backends:
        settings = base.allocation.model_copy(
            update={"backend": backend, "time_limit_s": time_limit}
        )
        fleet = base.model_copy(update={"allocation": settings})
        p = plan_stack(stack, fleet, perf.catalog, libs)
        assert p.solver is not None
        row = [
            backend,
            p.solver.status,
            f"{p.hourly_cost_usd:.2f}",
            _gap(p.solver.gap),
            f"{p.solver.solve_seconds:.1f}",
        ]
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    return md


def _gap(gap: float | None) -> str:
    return "unknown" if gap is None else f"{100 * gap:.2f}%"


def _ratio(baseline: object, coral: object) -> str:
    b_cost, c_cost = baseline.hourly_cost_usd, coral.hourly_cost_usd  # type: ignore[attr-defined]
    b_served, c_served = baseline.served_fraction, coral.served_fraction  # type: ignore[attr-defined]
    cost = f"{b_cost / c_cost:.2f}x cost" if c_cost else "-"
    if b_served >= 1 and c_served >= 1:
        return cost
    goodput = f"{c_served / b_served:.2f}x goodput" if b_served else "baseline serves 0"
    return f"{goodput}, {cost}"


if __name__ == "__main__":
    typer.run(main)
