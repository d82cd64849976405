"""The paper's evaluation setup beside ours (#19): a first table, at equal SLO attainment.

Per stack (default paper-core), two variants, each planned through `coral plan`'s path
(`plan_with_library`: libraries, `solver.plan.attainment.plan_to_target`, validation), so every
method is sized for the same SLO attainment targets:

- paper: the stack in paper mode (`solver.templates.paper_mode`) on the paper market
  (`solver.catalog.paper_market`, Table 1 prices), with the paper's baselines homo-paper and
  cauchy-paper (`solver.allocation.paper_baselines`);
- ours: the stack as committed (its mode and the real catalog), with today's homo and cauchy.

Printed per row: $/hour, GPUs, served fraction, the lowest verified attainment over the models
(with its target) and the models below target, the method's cost over Coral's (the paper's ratio
when everyone serves all demand) and Coral's served fraction over the method's (its goodput
ratio when scarce). Libraries are cached under .coral/paper_eval/.

Run: .venv/bin/python scripts/paper_eval.py --stack paper-core [--workers 2]
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from solver.performance.default_model import load_perf_model
from solver.plan.planner import plan_with_library
from solver.plan.schema import Method, Plan
from solver.stack import FleetConfig, load_stack

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".coral" / "paper_eval"
VARIANTS: dict[str, tuple[Method, ...]] = {
    "paper": ("coral", "homo-paper", "cauchy-paper"),
    "ours": ("coral", "homo", "cauchy"),
}
PAPER_RATIOS = {  # paper Sec. 6: Homo / Coral and Cauchy / Coral
    "paper-core": "1.62x / 1.60x",
    "paper-extended": "3.14x / 2.66x",
    "paper-extended-large-heavy": "- / 2.79x goodput",
    "paper-core-scarce": "- / 2.39x goodput",
}


def paper_variant(fleet: FleetConfig) -> FleetConfig:
    """The stack in the paper's template space, on the paper's market."""
    library = fleet.library.model_copy(update={"mode": "paper"})
    market = fleet.market.model_copy(update={"kind": "paper"})
    return fleet.model_copy(update={"library": library, "market": market})


def lowest_attainment(plan: Plan) -> str:
    """The lowest verified attainment over the models, with that model's target."""
    found = [a for a in plan.attainment if a.verified is not None]
    if not found:
        return "-"
    low = min(found, key=lambda a: a.verified or 0.0)
    return f"{100 * (low.verified or 0.0):.1f}% / {100 * low.target:g}%"


def below_target(plan: Plan) -> str:
    return ", ".join(a.model for a in plan.below_target()) or "none"


def main(
    stack: Annotated[list[str] | None, typer.Option(help="Stacks (repeatable).")] = None,
    workers: Annotated[int, typer.Option(help="Library build processes.")] = 1,
    variant: Annotated[list[str] | None, typer.Option(help="paper and/or ours.")] = None,
) -> None:
    """Plan each stack's variants with their methods and print the table."""
    perf, console = load_perf_model(), Console(width=140)
    table = Table(title="Paper setup vs ours, at equal SLO attainment (#19)")
    for col in (
        "stack",
        "variant",
        "method",
        "$/hour",
        "GPUs",
        "served",
        "min attain. / target",
        "below",
        "cost/Coral",
        "Coral served/",
    ):
        table.add_column(col, justify="left" if col in ("stack", "variant", "method") else "right")
    for name in stack or ["paper-core"]:
        base = load_stack(ROOT / "stacks", name)
        for v in variant or list(VARIANTS):
            fleet = paper_variant(base) if v == "paper" else base
            coral_cost, coral_served = None, 0.0
            for method in VARIANTS[v]:
                t0 = time.perf_counter()
                plan = plan_with_library(
                    name,
                    fleet,
                    perf,
                    CACHE / f"{name}__{v}",
                    method=method,
                    workers=workers,
                    root=ROOT,
                )
                took = time.perf_counter() - t0
                console.print(f"{name} {v} {method}: {plan.hourly_cost_usd:.2f} $/h ({took:.0f} s)")
                if method == "coral":
                    coral_cost, coral_served = plan.hourly_cost_usd, plan.served_fraction
                ratio = plan.hourly_cost_usd / coral_cost if coral_cost else float("nan")
                table.add_row(
                    name,
                    v,
                    method,
                    f"{plan.hourly_cost_usd:.2f}",
                    str(plan.gpus(perf.catalog)),
                    f"{plan.served_fraction:.1%}",
                    lowest_attainment(plan),
                    below_target(plan),
                    f"{ratio:.2f}",
                    f"{coral_served / plan.served_fraction:.2f}" if plan.served_fraction else "inf",
                )
        console.print(f"{name}: paper reports {PAPER_RATIOS.get(name, '-')} (Homo / Cauchy)")
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
