"""Does a small demand increase only add instances? Plan each stack, re-plan it with every
model's demand times --growth and the first plan as the running one (`--previous`), and count
the instances added and removed, with the default objective and with allocation.add_only.

Usage: .venv/bin/python scripts/replan_churn.py [--growth 1.03] [--library-root DIR] STACK ...
Libraries come from (or are built in) <library-root>/<stack>, as `coral plan` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from coral_iac.demand_sources import resolve_demand
from solver.performance.default_model import load_perf_model
from solver.performance.perf_model import PerfModel
from solver.plan.demand import stack_demand
from solver.plan.planner import libraries_for, plan_stack
from solver.plan.validator import validate_plan
from solver.plan_schema import Plan, diff_plans
from solver.stack import FleetConfig, load_stack

ROOT = Path(__file__).resolve().parents[1]


def grown(fleet: FleetConfig, growth: float, add_only: bool) -> FleetConfig:
    """`fleet` with every model's demand times `growth` (requests/s or tokens/s)."""
    models = {}
    for name, spec in fleet.models.items():
        d = spec.demand
        assert d is not None
        if d.requests_per_s is not None:
            d = d.model_copy(update={"requests_per_s": d.requests_per_s * growth})
        else:
            assert d.tokens_per_s is not None
            t = d.tokens_per_s
            tokens = t.model_copy(
                update={"prefill": t.prefill * growth, "decode": t.decode * growth}
            )
            d = d.model_copy(update={"tokens_per_s": tokens})
        models[name] = spec.model_copy(update={"demand": d})
    allocation = fleet.allocation.model_copy(update={"add_only": add_only})
    return fleet.model_copy(update={"models": models, "allocation": allocation})


def replan(
    stack: str, fleet: FleetConfig, growth: float, library_root: Path, perf: PerfModel
) -> list[str]:
    """One table row: the first plan, then the re-plan without and with add_only."""
    libs = libraries_for(perf, fleet, list(stack_demand(fleet.models)), library_root / stack)

    def plan(f: FleetConfig, previous: Plan | None = None) -> Plan:
        p = plan_stack(stack, f, perf.catalog, libs, previous)
        return validate_plan(p, f.plan_scope(), perf.catalog, perf.cards)

    first = plan(fleet)
    row = [stack, f"{fleet.allocation.startup_penalty_k:.3g}", str(len(first.instances))]
    row.append(f"{first.hourly_cost_usd:,.2f} ({first.served_fraction:.1%})")
    for add_only in (False, True):
        again = plan(grown(fleet, growth, add_only), first)
        diff = diff_plans(first, again)
        row += [f"+{len(diff['added'])} -{len(diff['removed'])}"]
        row.append(f"{again.hourly_cost_usd:,.2f} ({again.served_fraction:.1%})")
    return row


def main(
    stacks: Annotated[list[str], typer.Argument(help="Stack names.")],
    growth: Annotated[float, typer.Option(help="Demand multiplier of the re-plan.")] = 1.03,
    boot_minutes: Annotated[
        float | None, typer.Option(help="Override allocation.boot_minutes (K).")
    ] = None,
    library_root: Annotated[Path, typer.Option(help="One library folder per stack.")] = ROOT
    / ".coral/library",
) -> None:
    perf = load_perf_model()
    table = Table(title=f"Re-plan with demand x{growth} and the first plan running")
    columns = ("stack", "K", "instances", "$/h (served)", "change", "$/h (served)",
               "add-only change", "$/h (served)")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "stack" else "right")
    for stack in stacks:
        fleet = resolve_demand(load_stack(ROOT / "stacks", stack), stack, ROOT / "stacks")
        if boot_minutes is not None:
            allocation = fleet.allocation.model_copy(update={"boot_minutes": boot_minutes})
            fleet = fleet.model_copy(update={"allocation": allocation})
        table.add_row(*replan(stack, fleet, growth, library_root, perf))
    Console(width=140).print(table)


if __name__ == "__main__":
    typer.run(main)
