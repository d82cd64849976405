"""What a plan costs without whole instances: the granularity part of a ratio.

- `lp_relaxation`: the allocation ILP with continuous instance counts, built from the ILP's own
  constraint families (`solver.allocation.constraints`: availability, GPU pools, demand) and
  its objective (`solver.allocation.objective.hourly_cost`), on GLOP;
- `fractional_cost`: a plan's own templates at fractional counts (for the greedy baselines);
- `relaxed_cost`: the LP relaxation for coral and cauchy, the fractional cost for the others.

Both are never above the plan's cost.
"""

from __future__ import annotations

from ortools.linear_solver import pywraplp

from solver.allocation.baselines import cauchy_columns
from solver.allocation.constraints import add_availability, add_demand, add_gpu_pools, node_usage
from solver.allocation.objective import hourly_cost
from solver.allocation.problem import Problem, make_columns
from solver.catalog.market import Market, build_market
from solver.evaluation.scenarios import Planned
from solver.performance.perf_model import PerfModel
from solver.plan.demand import capacity_needed, stack_demand
from solver.plan.planner import at_capacity
from solver.plan_schema import Method, Plan, template_ref
from solver.serving.serving_template import ServingTemplate
from solver.stack import FleetConfig
from solver.types import Job


def fractional_cost(plan: Plan, fleet: FleetConfig) -> float:
    """The plan's own templates at fractional instance counts: each (model, phase)'s $/hour
    times the capacity it needs (served fraction x demand / target utilization) over the
    capacity it bought. Never above the plan's cost."""
    u = fleet.allocation.target_utilization
    total = 0.0
    for j in plan.jobs:
        need = plan.fraction_of(j.model) * j.demand / u
        total += j.usd_per_hour * (min(1.0, need / j.throughput) if j.throughput > 0 else 0.0)
    return total


def lp_relaxation(
    fleet: FleetConfig,
    market: Market,
    templates: dict[Job, list[ServingTemplate]],
    fraction: float,
    cauchy: bool = False,
    demand: dict[Job, float] | None = None,
) -> float | None:
    """The allocation ILP's LP relaxation: continuous instance counts over the same columns
    (templates at their capacity factors, every region selling their nodes), the same
    availability per (region, node config) and GPU pools, demand x `fraction` (the plan's served
    fraction) / target utilization. Startup penalty, budget and colocation are left out (none
    binds in the paper stacks: no previous plan, no budget, colocate_phases false or one region).
    `demand`: per (model, phase), default the stack's (`stack_demand`). None: the LP is
    infeasible."""
    demand = stack_demand(fleet.models) if demand is None else demand
    columns = make_columns(templates, market, demand)
    if cauchy:
        columns = cauchy_columns(columns)
    problem = Problem(capacity_needed(fleet.allocation, demand), columns, market, fleet.allocation)
    solver = pywraplp.Solver.CreateSolver("GLOP")
    x = [solver.NumVar(0.0, solver.infinity(), f"x{i}") for i in range(len(columns))]
    use = node_usage(problem)
    add_availability(solver, problem, x, use)
    add_gpu_pools(solver, problem, x, use)
    add_demand(solver, problem, x, None, fraction)
    solver.Minimize(hourly_cost(solver, problem, x))
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    return float(solver.Objective().Value())


def relaxed_cost(p: Planned, fleet: FleetConfig, perf: PerfModel, method: Method) -> float:
    """Cost without whole instances: the LP relaxation for coral and cauchy (at the least served
    fraction), the plan's templates at fractional counts for the others. Never above the
    plan's cost."""
    frac = fractional_cost(p.plan, fleet)
    if method not in ("coral", "cauchy") or not p.plan.instances:
        return frac
    templates = {
        job: [
            at_capacity(t, f)
            for t in lib.templates
            if (f := p.factors.get(template_ref(*job, t.key), 0.0)) > 0
        ]
        for job, lib in p.libs.items()
    }
    market = build_market(fleet.market_scope(), perf.catalog)
    lp = lp_relaxation(fleet, market, templates, p.plan.served_fraction, method == "cauchy")
    return min(frac, lp) if lp is not None else frac
