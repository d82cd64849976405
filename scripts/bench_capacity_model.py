"""Time the SLO capacity model of a stack's whole library, in one process and in worker
processes, and check that both give the same factors.

The library must be built (a first `coral plan --stack S`); nothing is read from or written to
the capacity cache. Run through `scripts/bench_capacity_model` (it sets up the environment).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from coral_iac.demand_sources import resolve_demand
from solver.performance.default_model import load_perf_model
from solver.plan.attainment import base_factors
from solver.plan.demand import stack_demand
from solver.plan.planner import libraries_for
from solver.stack import load_stack

ROOT = Path(__file__).resolve().parents[1]


def main(
    stack: Annotated[str, typer.Argument(help="A committed stack whose library is built.")],
    workers: Annotated[int, typer.Option(help="Worker processes of the second run.")] = 2,
) -> None:
    stacks = ROOT / "stacks"
    fleet = resolve_demand(load_stack(stacks, stack), stack, stacks, warn=lambda _: None)
    perf = load_perf_model(cards=fleet.model_cards, corrections=fleet.step_corrections())
    libs = libraries_for(
        perf, fleet, list(stack_demand(fleet.models)), ROOT / ".coral/library" / stack
    )
    factors = {}
    for n in (1, workers):
        start = time.perf_counter()
        factors[n] = base_factors(fleet.models, perf, libs, ROOT, None, workers=n)
        seconds = time.perf_counter() - start
        print(f"{stack}: {len(factors[n]):,} templates, workers {n}: {seconds:.1f} s")
    print("same factors:", factors[1] == factors[workers])


if __name__ == "__main__":
    typer.run(main)
