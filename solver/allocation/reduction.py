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

import numpy as np

from solver.allocation.problem import Problem, upper_bound
from solver.catalog.market import RegionId
from solver.types import Job

SLACK = 1e-9  # relative: a column exactly at the budget is kept
BLOCK = 128  # columns compared at once in `undominated` (a BLOCK x n x rows array)


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


def undominated(problem: Problem, by_price: bool = True) -> list[int]:
    """Indices of the columns no other on-demand column of the same job and region dominates.

    Column j dominates k when T(j) >= T(k), p(j) <= p(k) and j uses no more than k of every
    row that can bind (`_rows`): swapping every instance of k for one of j keeps every
    constraint (colocation counts are per model and region, the same) and costs no more, so
    dropping k never changes the optimum, of the cost or of the served fraction. Of columns that
    dominate each other the first (by throughput, then price, then index) stays. A column
    whose upper bound is 0 (it needs more nodes or GPUs than its region has) goes too. Running
    columns always stay. With `by_price` False prices are not compared: right for the
    most-served solve without a budget, where cost plays no part.

    The library already drops a template when a sub-multiset of its nodes does as well; what is
    new here is the stack's market: an availability row that a GPU pool implies cannot bind, so
    two templates with the same GPUs on different node shapes compete on throughput and price.

    Returns:
        The kept indices, in order.
    """
    if problem.one_config_per_job:  # swapping k for j may break the job's one config
        return list(range(len(problem.columns)))
    groups: dict[tuple[Job, RegionId, str | None], list[int]] = {}
    for i, c in enumerate(problem.columns):
        usable = upper_bound(c, problem.market, problem.demand[c.job]) > 0
        if usable or problem.running.get(c.running_key, 0):
            groups.setdefault((c.job, c.region, c.zone), []).append(i)
    rows = {region: _rows(problem, region) for _, region, _ in groups}
    kept: list[int] = []
    for (_, region, zone), idx in groups.items():
        # With every availability row kept, dominance is the library's own (a sub-multiset
        # doing as well) plus price: rare, and not worth the pairwise comparison. Spot
        # columns all stay: a swap within a zone may break the spot share (`add_spot`).
        implied = any(not any(r == n for r, _ in rs) for n, rs in rows[region].items())
        front = implied and zone is None
        kept.extend(_front(problem, idx, rows[region], by_price) if front else idx)
    return sorted(kept)


def _rows(problem: Problem, region: RegionId) -> dict[str, list[tuple[str, int]]]:
    """Node config -> the rows one node of it counts in, with its weight there: its
    availability row (unless implied: the pool of its GPU holds no more than A[r,c] n_g(c)
    GPUs, so sum U nu n_g <= P[r,g] <= A[r,c] n_g), and its GPU's pool, if any."""
    market = problem.market
    out: dict[str, list[tuple[str, int]]] = {}
    for (r, node), a in market.available.items():
        if r != region:
            continue
        gpu, per_node = market.gpu_of[node]
        pool = market.gpu_pools.get((region, gpu))
        out[node] = [] if pool is not None and a * per_node >= pool else [(node, 1)]
        if pool is not None:
            out[node].append((f"gpu:{gpu}", per_node))
    return out


def _front(
    problem: Problem, idx: list[int], rows: dict[str, list[tuple[str, int]]], by_price: bool
) -> list[int]:
    """The undominated columns among `idx` (one job, one region)."""
    cols = [problem.columns[i] for i in idx]
    names = sorted({name for c in cols for n, _ in c.usage for name, _ in rows[n]})
    at = {name: k for k, name in enumerate(names)}
    use = np.zeros((len(cols), len(names)))
    for row, c in enumerate(cols):
        for node, k in c.usage:
            for name, weight in rows[node]:
                use[row, at[name]] += k * weight
    thr = np.array([c.template.throughput for c in cols])
    price = np.array([c.price if by_price else 0.0 for c in cols])
    order = np.array(sorted(range(len(cols)), key=lambda k: (-thr[k], price[k], idx[k])))
    use, price = use[order], price[order]
    running = np.array([bool(problem.running.get(cols[k].running_key, 0)) for k in order])
    dominated = np.zeros(len(order), dtype=bool)
    for lo in range(0, len(order), BLOCK):  # k in [lo, hi) against every j ordered before it
        hi = min(len(order), lo + BLOCK)
        cheaper = price[None, :hi] <= price[lo:hi, None]
        smaller = np.all(use[None, :hi, :] <= use[lo:hi, None, :], axis=2)
        before = np.arange(hi)[None, :] < np.arange(lo, hi)[:, None]
        dominated[lo:hi] = np.any(cheaper & smaller & before, axis=1)
    return [idx[k] for k, gone in zip(order, dominated & ~running, strict=True) if not gone]
