"""Column reduction before a solve: drop the columns no plan cheaper than a known one can use.

Notation as in `constraints`. For a column k of job m, let c_k be the least one instance adds to
the objective: p[r,t] (1 + K), or p[r,t] when it runs today (its first nu0 instances pay no
start-up). Let rate_m = min_k c_k / T(k) over job m's columns: no plan covers a unit of m's
demand for less. A plan that runs at least one instance of k then spends on m at least

    f_k = c_k + max(0, D[m] f - T(k)) rate_m,

k itself and the rest of the demand at the best rate (a fractional knapsack: a relaxation of
every constraint but demand). If a feasible plan costing U is at hand, and every other job i
costs at least L_i in any plan, job m can spend at most B_m = U - sum_{i != m} L_i in a plan no
dearer than U. A column with f_k > B_m is in no such plan: dropping it never changes the
optimum, and the reduced problem's bound, capped at U, is a bound of the full one.

L_i is `fractional_bounds`'s D[i] f rate_i unless a tighter bound is known (a solve of job i
alone, `decompose`). Running columns are always kept: add-only re-plans and the start-up
penalty read them. Identical columns cannot occur (one template per node multiset, job and
region), so there is nothing to aggregate.
"""

from __future__ import annotations

from solver.allocation.problem import Problem
from solver.types import Job

SLACK = 1e-9  # relative: a column exactly at the budget is kept


def least_costs(problem: Problem) -> list[float]:
    """c_k per column: the least an instance of it adds to the objective."""
    k = problem.settings.startup_penalty_k
    return [
        c.price if problem.running.get(c.running_key, 0) > 0 else c.price * (1 + k)
        for c in problem.columns
    ]


def best_rates(problem: Problem, costs: list[float]) -> dict[Job, float]:
    """rate_m per job: the least objective per unit of throughput over its columns."""
    rates: dict[Job, float] = {}
    for c, cost in zip(problem.columns, costs, strict=True):
        r = cost / c.template.throughput
        if r < rates.get(c.job, float("inf")):
            rates[c.job] = r
    return rates


def fractional_bounds(problem: Problem, fraction: float) -> dict[Job, float]:
    """L_m = D[m] f rate_m: no plan serving `fraction` of demand spends less on job m."""
    rates = best_rates(problem, least_costs(problem))
    return {
        job: d * fraction * rates[job] if job in rates else 0.0
        for job, d in problem.demand.items()
        if d > 0
    }


def reduce_columns(
    problem: Problem,
    upper: float,
    lower: dict[tuple[Job, ...], float] | None = None,
    fraction: float = 1.0,
) -> list[int]:
    """Indices of the columns some plan costing at most `upper` may use (module doc).

    Args:
        problem: the problem; its columns are judged against its demand times `fraction`.
        upper: the objective of a feasible plan (U).
        lower: groups of jobs (disjoint) -> a lower bound on their share of the objective in
            any feasible plan, e.g. from solving the group alone; a job in no group is bounded
            by `fractional_bounds`. Within a group, job m's budget counts the others at their
            fractional bound.
        fraction: the share of demand the plans serve.

    Returns:
        The kept column indices, in order.
    """
    costs = least_costs(problem)
    rates = best_rates(problem, costs)
    floor = fractional_bounds(problem, fraction)
    groups = {job: group for group in (lower or {}) for job in group}
    group_bound = {g: max(b, sum(floor.get(j, 0.0) for j in g)) for g, b in (lower or {}).items()}
    total = sum(group_bound.values()) + sum(f for j, f in floor.items() if j not in groups)
    budget: dict[Job, float] = {}
    for job, f in floor.items():
        g = groups.get(job)
        others = total - (group_bound[g] if g else f)  # every other group or job at its bound
        mates = sum(floor.get(j, 0.0) for j in g if j != job) if g else 0.0
        budget[job] = upper - others - mates + SLACK * max(1.0, abs(upper))
    kept = []
    for i, (c, cost) in enumerate(zip(problem.columns, costs, strict=True)):
        need = problem.demand[c.job] * fraction
        spend = cost + max(0.0, need - c.template.throughput) * rates[c.job]
        if spend <= budget.get(c.job, float("inf")) or problem.running.get(c.running_key, 0):
            kept.append(i)
    return kept
