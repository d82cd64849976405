"""The cost diff `pulumi preview` and `coral preview` print: $/hour per model before and after,
the gateway's line, instances added and removed, and what the instances leaving the plan still
cost."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from solver.operations.reconfiguration import FleetState
from solver.plan_schema import Plan, diff_plans

if TYPE_CHECKING:
    from coral_iac.gateway_cost import GatewayCost


def cost_diff_table(
    previous: Plan | None,
    plan: Plan,
    state: FleetState | None = None,
    gateway: GatewayCost | None = None,
) -> str:
    """One screen: $/hour per model before and after, instances added and removed; with the
    fleet state, also what the instances leaving the plan still cost this interval.

    Args:
        previous: the running plan (None: a new stack).
        plan: the new plan.
        state: the fleet state this run declares.
        gateway: the gateway's cost: a "gateway" row, in the totals (its priced part; on a
            running stack it is taken to have run before too), and a line naming what is
            unpriced.

    Returns:
        The table and notes as plain text, at most 100 columns wide.
    """
    empty = plan.model_copy(update={"instances": [], "hourly_cost_usd": 0.0})
    diff = diff_plans(previous or empty, plan)
    extra = gateway.usd_per_hour if gateway is not None else 0.0
    before = extra if previous is not None else 0.0
    total = plan.hourly_cost_usd + extra
    delta = diff["hourly_cost_delta_usd"] + extra - before
    table = Table(
        title=f"Coral plan: {total:,.2f} $/hour ({delta:+,.2f}), served "
        + (f"{plan.served_fraction:.1%}" if plan.served_fraction >= 1 else plan.short_words())
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
    if gateway is not None:
        mark = "*" if gateway.unpriced else ""
        unknown = len(gateway.unpriced) == len(gateway.items)

        def shown(usd: float) -> str:
            return "unpriced" if unknown and usd == 0 and mark else f"{usd:,.2f}{mark}"

        table.add_row(
            "gateway" + mark,
            shown(before) if previous is not None else "0.00",
            shown(extra),
            "0" if previous is not None else "1",
            "0",
        )
    buffer = io.StringIO()
    console = Console(file=buffer, width=100, force_terminal=False)
    console.print(table)
    if gateway is not None:
        console.print(("* " if gateway.unpriced else "") + gateway.summary())
    if state is not None:
        by = state.by_state()
        leaving = [state.members[k] for k in by["retiring"] + by["draining"]]
        cost = sum(m.instance.usd_per_hour for m in leaving)
        # Short lines: the CLI reprints this on an 80-column console.
        console.print(
            f"Instances: {len(by['ready'])} ready, {len(by['starting'])} starting, "
            f"{len(by['retiring'])} retiring, {len(by['draining'])} draining.\n"
            f"Leaving ones cost {cost:,.2f} $/hour this interval; all declared: "
            f"{state.hourly_cost_usd() + extra:,.2f} $/hour."
        )
    return buffer.getvalue()
