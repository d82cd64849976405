"""The cost diff `pulumi preview` and `coral preview` print: $/hour per model before and after,
instances added and removed, and what the instances leaving the plan still cost."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from solver.operations.reconfiguration import FleetState
from solver.plan.schema import Plan, diff_plans


def cost_diff_table(previous: Plan | None, plan: Plan, state: FleetState | None = None) -> str:
    """One screen: $/hour per model before and after, instances added and removed; with the
    fleet state, also what the instances leaving the plan still cost this interval."""
    empty = plan.model_copy(update={"instances": [], "hourly_cost_usd": 0.0})
    diff = diff_plans(previous or empty, plan)
    table = Table(
        title=f"Coral plan: {plan.hourly_cost_usd:,.2f} $/hour "
        f"({diff['hourly_cost_delta_usd']:+,.2f}), served {plan.served_fraction:.1%}"
    )
    for col in ("model", "$/hour before", "$/hour after", "added", "removed"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for model, row in diff["by_model"].items():
        table.add_row(
            model,
            f"{row['before']:,.2f}",
            f"{row['after']:,.2f}",
            str(row["added"]),
            str(row["removed"]),
        )
    buffer = io.StringIO()
    console = Console(file=buffer, width=100, force_terminal=False)
    console.print(table)
    if state is not None:
        by = state.by_state()
        leaving = [state.members[k] for k in by["retiring"] + by["draining"]]
        cost = sum(m.instance.usd_per_hour for m in leaving)
        # Short lines: the CLI reprints this on an 80-column console.
        console.print(
            f"Instances: {len(by['ready'])} ready, {len(by['starting'])} starting, "
            f"{len(by['retiring'])} retiring, {len(by['draining'])} draining.\n"
            f"Leaving ones cost {cost:,.2f} $/hour this interval; all declared: "
            f"{state.hourly_cost_usd():,.2f} $/hour."
        )
    return buffer.getvalue()
