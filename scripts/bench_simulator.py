"""Benchmark the simulator (issue #6): 30 simulated minutes of paper-extended at its demand
(25 req/s per model, about 270,000 requests) on one core; median wall and CPU time of --repeats
runs (on a shared machine the CPU time is the steadier figure), plus the plan reality check (SLO
attainment at 1x demand and at the given utilization targets).

Run through `scripts/bench_simulator`.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Annotated

import typer

from solver.performance.default_model import load_perf_model
from solver.plan.planner import libraries_for, plan_stack, stack_demand
from solver.simulation.simulator import simulate
from solver.simulation.workload import model_contexts, stack_requests
from solver.stack import load_stack

ROOT = Path(__file__).resolve().parents[1]


def main(
    stack: Annotated[str, typer.Option()] = "paper-extended",
    duration: Annotated[float, typer.Option(help="Simulated seconds.")] = 1800,
    repeats: Annotated[int, typer.Option()] = 3,
    utilization: Annotated[list[float] | None, typer.Option(help="Targets to check.")] = None,
) -> None:
    perf = load_perf_model()
    base = load_stack(ROOT / "stacks", stack)
    family = "paper-core" if stack.startswith("paper-core") else "paper-extended"
    libs = libraries_for(
        perf, base, list(stack_demand(base.models)), ROOT / ".coral/library" / family
    )
    for u in utilization or [1.0, 0.8, 0.7]:
        settings = base.allocation.model_copy(update={"target_utilization": u})
        fleet = base.model_copy(update={"allocation": settings})
        plan = plan_stack(stack, fleet, perf.catalog, libs)
        traces = stack_requests(
            fleet.models, duration, root=ROOT, max_contexts=model_contexts(fleet.models, perf.cards)
        )
        times, cpu, summary = [], [], {}
        for _ in range(repeats if u == 1.0 else 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            summary = simulate(plan, fleet.models, perf, traces, duration).summary()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(
            f"{stack} target_utilization={u}: {plan.hourly_cost_usd:.2f} $/h, "
            f"{summary['requests']} requests, SLO attainment {summary['slo_attainment']:.3f}, "
            f"TTFT p50 {summary['ttft_p50_ms']:.0f} ms, TPOT p50 {summary['tpot_p50_ms']:.1f} ms, "
            f"simulated in {statistics.median(times):.2f} s wall, "
            f"{statistics.median(cpu):.2f} s CPU (median of {len(times)})"
        )


if __name__ == "__main__":
    typer.run(main)
