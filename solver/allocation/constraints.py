"""The allocation ILP's variables and constraint families, one function each (paper Sec. 4.3).

Notation (shared by `objective` and `explain`):

- nu[r,t]: integer instances of template t in region r (one column of the problem);
- U[c,t]: nodes of config c one instance of t uses; A[r,c]: nodes of config c region r sells;
- P[r,g]: GPUs of type g in region r's pool, where one is set; n_g(c): GPUs per node of c;
- T(t): an instance's throughput; D[m]: demand of job m = (model, phase), in T's unit;
- p[r,t]: $/hour of one instance; B: the budget; K: the start-up penalty (boot / interval);
- nu0[r,t]: the running plan; phi[m]: the fraction of model m's demand served, an integer in
  steps of 1 / FRACTION_STEPS (or a fixed fraction f of every model's).

Every constraint is named after its family and index (``avail[aws:us-east-2,l4x1]``), so an
exported model (`solver.ExportModelAsLpFormat`) reads like this list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from ortools.linear_solver import pywraplp

from solver.allocation.problem import Problem, upper_bound
from solver.catalog.market import RegionId, region_name
from solver.types import Job

FRACTION_STEPS = 10_000  # phi is solved in steps of 0.01%

Slot = tuple[RegionId, str]  # (region, node config)
Row = tuple[Any, float]  # a constraint's left-hand expression and its limit (for `explain`)


def column_name(problem: Problem, i: int) -> str:
    """A column's readable name: ``[aws:us-east-2,phi-4/decode/<template key>]``."""
    c = problem.columns[i]
    return f"[{region_name(c.region)},{c.job[0]}/{c.job[1]}/{c.template.key}]"


def instance_counts(solver: pywraplp.Solver, problem: Problem) -> list[Any]:
    """nu[r,t] in {0, ..., ub[r,t]}, one integer per column.

    ub[r,t] = min(min_c A[r,c] // U[c,t], min_g P[r,g] // sum_c U[c,t] n_g(c),
    ceil(D[m] / T(t))): more than availability allows is infeasible, and more than demand needs
    is never cheaper. With ``add_only`` ub is at least nu0[r,t], so a running count above
    today's demand stays expressible.
    """
    out = []
    for i, c in enumerate(problem.columns):
        ub = upper_bound(c, problem.market, problem.demand[c.job])
        if problem.settings.add_only:
            ub = max(ub, problem.running.get(c.running_key, 0))
        out.append(solver.IntVar(0, ub, f"nu{column_name(problem, i)}"))
    return out


def node_usage(problem: Problem) -> dict[Slot, list[tuple[int, int]]]:
    """(r, c) -> [(column index, U[c,t])] over the columns that use node config c in r."""
    use: dict[Slot, list[tuple[int, int]]] = {}
    for i, col in enumerate(problem.columns):
        for node, k in col.usage:
            use.setdefault((col.region, node), []).append((i, k))
    return use


def add_availability(
    solver: pywraplp.Solver, problem: Problem, nu: list[Any], use: dict[Slot, list[tuple[int, int]]]
) -> dict[Slot, Row]:
    """Availability, for every (r, c) some column uses: sum_t U[c,t] nu[r,t] <= A[r,c].

    Returns:
        (r, c) -> (left-hand side, A[r,c]), to tell later which rows are saturated.
    """
    rows: dict[Slot, Row] = {}
    for slot, terms in sorted(use.items()):
        expr = solver.Sum([k * nu[i] for i, k in terms])
        limit = problem.market.available[slot]
        rows[slot] = (expr, limit)
        solver.Add(expr <= limit, name=f"avail[{region_name(slot[0])},{slot[1]}]")
    return rows


def add_gpu_pools(
    solver: pywraplp.Solver, problem: Problem, nu: list[Any], use: dict[Slot, list[tuple[int, int]]]
) -> dict[tuple[RegionId, str], Row]:
    """GPU pools, for every (r, g) with a pool: sum_t sum_c U[c,t] n_g(c) nu[r,t] <= P[r,g],
    the sum over the node configs c whose GPU is g.

    Returns:
        (r, g) -> (left-hand side, P[r,g]) for the pools some column uses.
    """
    market = problem.market
    rows: dict[tuple[RegionId, str], Row] = {}
    for (region, gpu), gpus in sorted(market.gpu_pools.items()):
        terms = [
            k * market.gpu_of[n][1] * nu[i]
            for (r, n), items in use.items()
            if r == region and market.gpu_of[n][0] == gpu
            for i, k in items
        ]
        if terms:
            expr = solver.Sum(terms)
            rows[(region, gpu)] = (expr, gpus)
            solver.Add(expr <= gpus, name=f"pool[{region_name(region)},{gpu}]")
    return rows


def add_demand(
    solver: pywraplp.Solver,
    problem: Problem,
    nu: list[Any],
    phi: Mapping[str, Any] | None,
    fraction: float,
) -> None:
    """Demand, for every job (model, phase) with D > 0: sum_{r, t of the job} T(t) nu[r,t] >=
    D phi[model] / FRACTION_STEPS when phi holds a variable per model (the most-served solves),
    else >= D f."""
    by_job = columns_by_job(problem)
    for job, d in sorted(problem.demand.items()):
        if d <= 0:
            continue
        supply = solver.Sum(
            [problem.columns[i].template.throughput * nu[i] for i in by_job.get(job, [])]
        )
        solver.Add(supply >= _need(d, job, phi, fraction), name=f"demand[{job[0]}/{job[1]}]")


def columns_by_job(problem: Problem) -> dict[Job, list[int]]:
    """Job -> the indices of its columns, in order."""
    by_job: dict[Job, list[int]] = {}
    for i, c in enumerate(problem.columns):
        by_job.setdefault(c.job, []).append(i)
    return by_job


def _need(d: float, job: Job, phi: Mapping[str, Any] | None, fraction: float) -> Any:
    """What a job's demand row asks: D phi[model] / FRACTION_STEPS, or D f."""
    return (d / FRACTION_STEPS) * phi[job[0]] if phi is not None else d * fraction


def add_spot(
    solver: pywraplp.Solver,
    problem: Problem,
    nu: list[Any],
    phi: Mapping[str, Any] | None,
    fraction: float,
) -> None:
    """Spot rules, for every job with spot columns (`allocation.spot`; T(t) of a spot column is
    net of its expected downtime, N(t) its throughput while up, N(t) = T(t) on-demand):

    - share: sum_{spot t} N(t) nu[r,t] <= s sum_t N(t) nu[r,t], s = `max_share`;
    - zone spread, for each (region, zone) z its spot columns use: sum_t T(t) nu[r,t] -
      sum_{t in z} T(t) nu[r,t] >= w D[m] phi[m] (or w D[m] f), w = `zone_loss_serves`: with
      every spot instance of one zone gone, the rest still serves w of what the demand row
      asks.
    """
    rules, cols = problem.settings.spot, problem.columns
    for job, idx in sorted(columns_by_job(problem).items()):
        d = problem.demand.get(job, 0.0)
        spot = [i for i in idx if cols[i].is_spot]
        if d <= 0 or not spot:
            continue
        name = f"{job[0]}/{job[1]}"
        full = solver.Sum([cols[i].full_throughput * nu[i] for i in idx])
        spot_full = solver.Sum([cols[i].full_throughput * nu[i] for i in spot])
        solver.Add(spot_full <= rules.max_share * full, name=f"spot_share[{name}]")
        supply = solver.Sum([cols[i].template.throughput * nu[i] for i in idx])
        need = _need(d, job, phi, fraction)
        zones: dict[tuple[RegionId, str], list[int]] = {}
        for i in spot:
            zones.setdefault((cols[i].region, cast(str, cols[i].zone)), []).append(i)
        for (region, zone), members in sorted(zones.items()):
            lost = solver.Sum([cols[i].template.throughput * nu[i] for i in members])
            solver.Add(
                supply - lost >= rules.zone_loss_serves * need,
                name=f"spot_zone[{name},{region_name(region)},{zone}]",
            )


def spot_rules_hold(problem: Problem, counts: Mapping[int, int], fraction: float) -> bool:
    """Whether a plan (column -> instances) keeps `add_spot`'s rules at a fixed `fraction`."""
    rules = problem.settings.spot
    supply: dict[Job, float] = {}
    full: dict[Job, float] = {}
    spot_full: dict[Job, float] = {}
    zone: dict[tuple[Job, RegionId, str], float] = {}
    for i, n in counts.items():
        c = problem.columns[i]
        supply[c.job] = supply.get(c.job, 0.0) + n * c.template.throughput
        full[c.job] = full.get(c.job, 0.0) + n * c.full_throughput
        if c.zone is not None:
            spot_full[c.job] = spot_full.get(c.job, 0.0) + n * c.full_throughput
            key = (c.job, c.region, c.zone)
            zone[key] = zone.get(key, 0.0) + n * c.template.throughput
    tol = 1e-6
    if any(s > rules.max_share * full[job] + tol for job, s in spot_full.items()):
        return False
    return all(
        supply[job] - lost >= rules.zone_loss_serves * problem.demand[job] * fraction - tol
        for (job, _, _), lost in zone.items()
    )


def add_one_config(solver: pywraplp.Solver, problem: Problem, nu: list[Any]) -> None:
    """One node config per job (Cauchy's phase-homogeneous replicas): binary y[m,c] per job m
    and node config c its columns use, sum_c y[m,c] <= 1, and nu[r,t] <= ub[r,t] y[m,c(t)]."""
    by_job: dict[Job, dict[tuple[str, ...], list[int]]] = {}
    for i, c in enumerate(problem.columns):
        config = tuple(n for n, _ in c.usage)
        by_job.setdefault(c.job, {}).setdefault(config, []).append(i)
    for job, configs in sorted(by_job.items()):
        chosen = []
        for config, idx in sorted(configs.items()):
            y = solver.BoolVar(f"one[{job[0]}/{job[1]},{'+'.join(config)}]")
            chosen.append(y)
            for i in idx:
                solver.Add(nu[i] <= nu[i].ub() * y, name=f"one_config{column_name(problem, i)}")
        solver.Add(solver.Sum(chosen) <= 1, name=f"one_config[{job[0]}/{job[1]}]")


def add_colocation(solver: pywraplp.Solver, problem: Problem, nu: list[Any]) -> None:
    """Colocation, for every disaggregated model m and region r, with open[m,r] binary and
    ph in (prefill, decode): open[m,r] <= sum_{t of (m, ph)} nu[r,t] <= M open[m,r], M the sum
    of those nu's bounds. So a region hosts both phases of m or neither."""
    demand = problem.demand
    paired = {
        m
        for (m, ph), d in demand.items()
        if ph == "prefill" and d > 0 and demand.get((m, "decode"), 0) > 0
    }
    groups: dict[tuple[str, RegionId], dict[str, list[int]]] = {}
    for i, c in enumerate(problem.columns):
        if c.job[0] in paired and c.job[1] in ("prefill", "decode"):
            groups.setdefault((c.job[0], c.region), {}).setdefault(c.job[1], []).append(i)
    for (model, region), phases in sorted(groups.items()):
        where = f"{model},{region_name(region)}"
        used = solver.BoolVar(f"open[{where}]")
        for phase in ("prefill", "decode"):
            idx = phases.get(phase, [])
            count = solver.Sum([nu[i] for i in idx])
            big = sum(nu[i].ub() for i in idx)
            solver.Add(count <= big * used, name=f"colocate_max[{where},{phase}]")
            solver.Add(count >= used, name=f"colocate_min[{where},{phase}]")


def add_budget(solver: pywraplp.Solver, cost: Any, budget: float) -> None:
    """Budget: sum_{r,t} p[r,t] nu[r,t] <= B, `cost` being the left-hand side."""
    solver.Add(cost <= budget, name="budget")


def add_keep_running(solver: pywraplp.Solver, problem: Problem, nu: list[Any]) -> None:
    """Add-only re-plan (``allocation.add_only``): nu[r,t] >= nu0[r,t] for every running column,
    so a re-plan only adds instances. Running instances without a column (a model or template
    gone from the stack or library) cannot be kept."""
    for i, c in enumerate(problem.columns):
        running = problem.running.get(c.running_key, 0)
        if running > 0:
            solver.Add(nu[i] >= running, name=f"keep{column_name(problem, i)}")
