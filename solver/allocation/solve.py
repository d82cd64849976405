"""Online allocation (paper Sec. 4.3): the cheapest mix of template instances across regions.

Integer nu[r, t] = instances of template t in region r. Constraints: availability per (region,
node config) and per GPU pool; demand per (model, phase); optional budget. Objective: $/hour
plus the start-up penalty I[r, t] >= K p[r, t] (nu - nu0) against the running plan nu0 (only
scaling up pays). Solved with OR-Tools (CP-SAT, SCIP or HiGHS, a stack setting).

Scarcity: when demand cannot be met, a first solve finds the largest fraction phi of every
model's demand that can be served (uniform across models, as the paper does); a second finds the
cheapest plan serving phi. Saturated constraints of the first solve are reported in words.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from ortools.linear_solver import pywraplp

from solver.allocation.problem import Column, Problem, Solution, upper_bound
from solver.catalog.market import RegionId, region_name
from solver.errors import CoralError
from solver.plan.schema import SolverReport
from solver.types import Job

FRACTION_STEPS = 10_000  # phi is solved in steps of 0.01%
BACKEND_IDS = {"cp-sat": "CP_SAT", "scip": "SCIP", "highs": "HIGHS"}


class _Model:
    """The ILP over a problem's columns, with demand scaled by phi (fixed or a variable)."""

    def __init__(self, problem: Problem, maximise_fraction: bool, min_fraction: float) -> None:
        s = problem.settings
        self.problem = problem
        solver = pywraplp.Solver.CreateSolver(BACKEND_IDS[s.backend])
        if solver is None:
            raise RuntimeError(f"OR-Tools has no {s.backend} backend in this build")
        solver.SuppressOutput()  # HiGHS prints a banner to stdout otherwise (breaks --json)
        self.solver = solver
        cols, market = problem.columns, problem.market
        self.nu = [
            solver.IntVar(0, upper_bound(c, market, problem.demand[c.job]), f"nu{i}")
            for i, c in enumerate(cols)
        ]
        # Availability per (region, node config), and per (region, GPU pool) where set.
        use: dict[tuple[RegionId, str], list[tuple[int, int]]] = {}
        for i, c in enumerate(cols):
            for n, k in c.usage:
                use.setdefault((c.region, n), []).append((i, k))
        self.slot_rows = {}
        for slot, terms in sorted(use.items()):
            expr = solver.Sum([k * self.nu[i] for i, k in terms])
            self.slot_rows[slot] = (expr, market.available[slot])
            solver.Add(expr <= market.available[slot])
        self.pool_rows = {}
        for (region, gpu), gpus in sorted(market.gpu_pools.items()):
            terms = [
                k * market.gpu_of[n][1] * self.nu[i]
                for (r, n), items in use.items()
                if r == region and market.gpu_of[n][0] == gpu
                for i, k in items
            ]
            if terms:
                expr = solver.Sum(terms)
                self.pool_rows[(region, gpu)] = (expr, gpus)
                solver.Add(expr <= gpus)
        # Demand per (model, phase), scaled by phi.
        self.phi = solver.IntVar(0, FRACTION_STEPS, "phi") if maximise_fraction else None
        by_job: dict[Job, list[int]] = {}
        for i, c in enumerate(cols):
            by_job.setdefault(c.job, []).append(i)
        for job, d in sorted(problem.demand.items()):
            if d <= 0:
                continue
            supply = solver.Sum(
                [cols[i].template.throughput * self.nu[i] for i in by_job.get(job, [])]
            )
            if self.phi is not None:
                solver.Add(supply >= (d / FRACTION_STEPS) * self.phi)
            else:
                solver.Add(supply >= d * min_fraction)
        if s.colocate_phases:
            self._colocate(cols)
        self.cost = solver.Sum([c.price * self.nu[i] for i, c in enumerate(cols)])
        if s.budget_usd_per_hour is not None:
            solver.Add(self.cost <= s.budget_usd_per_hour)
        if self.phi is not None:
            solver.Maximize(self.phi)
            return
        # Start-up penalty: new instances pay K x price; running ones only above nu0.
        penalty = []
        for i, c in enumerate(cols):
            running = problem.running.get(c.running_key, 0)
            if running == 0:
                penalty.append(s.startup_penalty_k * c.price * self.nu[i])
            else:
                extra = solver.NumVar(0, solver.infinity(), f"I{i}")
                solver.Add(extra >= s.startup_penalty_k * c.price * (self.nu[i] - running))
                penalty.append(extra)
        self.penalty = solver.Sum(penalty)
        solver.Minimize(self.cost + self.penalty)

    def _colocate(self, cols: list[Column]) -> None:
        """Per (model, region): prefill and decode instances both zero or both at least one."""
        paired = {
            m
            for (m, ph), d in self.problem.demand.items()
            if ph == "prefill" and d > 0 and self.problem.demand.get((m, "decode"), 0) > 0
        }
        groups: dict[tuple[str, RegionId], dict[str, list[int]]] = {}
        for i, c in enumerate(cols):
            if c.job[0] in paired and c.job[1] in ("prefill", "decode"):
                groups.setdefault((c.job[0], c.region), {}).setdefault(c.job[1], []).append(i)
        for (model, region), phases in sorted(groups.items()):
            used = self.solver.BoolVar(f"open[{model},{region_name(region)}]")
            for phase in ("prefill", "decode"):
                idx = phases.get(phase, [])
                count = self.solver.Sum([self.nu[i] for i in idx])
                big = sum(self.nu[i].ub() for i in idx)
                self.solver.Add(count <= big * used)
                self.solver.Add(count >= used)

    def hint_from(self, counts: dict[int, int] | None) -> None:
        """Give the solver a feasible starting plan (SCIP and CP-SAT; OR-Tools 9.15's HiGHS
        interface crashed with a hint, so HiGHS starts cold). A most-served model also gets
        the plan's served fraction, so the hint is a complete solution."""
        if not counts or self.problem.settings.backend == "highs":
            return
        variables = list(self.nu)
        values = [float(counts.get(i, 0)) for i in range(len(self.nu))]
        if self.phi is not None:
            variables.append(self.phi)
            values.append(float(self._served_steps(counts)))
        self.solver.SetHint(variables, values)

    def _served_steps(self, counts: dict[int, int]) -> int:
        """The largest phi (in FRACTION_STEPS) that `counts` serves for every job."""
        have: dict[Job, float] = {}
        for i, n in counts.items():
            job = self.problem.columns[i].job
            have[job] = have.get(job, 0.0) + n * self.problem.columns[i].template.throughput
        ratios = [have.get(j, 0.0) / d for j, d in self.problem.demand.items() if d > 0]
        return max(0, min(FRACTION_STEPS, math.floor(min(ratios, default=1.0) * FRACTION_STEPS)))

    def solve(self) -> tuple[int, float]:
        s, solver = self.problem.settings, self.solver
        solver.SetTimeLimit(int(s.time_limit_s * 1000))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, s.relative_gap)
        # SCIP and HiGHS run single-threaded (SCIP segfaulted with threads > 1).
        if s.backend == "cp-sat":
            # Fixed seed and interleaved workers: the same inputs give the same plan.
            solver.SetSolverSpecificParametersAsString(
                f"num_workers:{s.threads} interleave_search:true random_seed:0 "
                f"relative_gap_limit:{s.relative_gap}"
            )
        start = time.perf_counter()
        status = solver.Solve(params)
        return status, time.perf_counter() - start


def _check(status: int, what: str, problem: Problem) -> None:
    """Raise a clear error unless the solve produced a plan."""
    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return
    limit = problem.settings.time_limit_s
    raise CoralError(
        f"allocation: {what} ended {STATUS.get(status, status)} within {limit:g} s "
        f"({len(problem.columns)} template-region columns); raise "
        f"coral:fleet.allocation.time_limit_s or use fewer node configs"
    )


def _homogeneous_plan(
    problem: Problem, maximise_fraction: bool = False, min_fraction: float = 1.0
) -> tuple[dict[int, int] | None, float]:
    """A feasible start, with its solve time, from single-node-config templates only (a much
    smaller problem): the cheapest plan that serves `min_fraction` of demand (None if none
    does), or with `maximise_fraction`, the most-served plan."""
    idx = [i for i, c in enumerate(problem.columns) if len(c.usage) == 1]
    sub = replace(problem, columns=[problem.columns[i] for i in idx])
    model = _Model(
        sub,
        maximise_fraction=maximise_fraction,
        min_fraction=0.0 if maximise_fraction else min_fraction,
    )
    status, seconds = model.solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None, seconds
    return {idx[k]: round(v.solution_value()) for k, v in enumerate(model.nu)}, seconds


def _price(problem: Problem, counts: dict[int, int]) -> float:
    return sum(n * problem.columns[i].price for i, n in counts.items())


STATUS = {
    pywraplp.Solver.OPTIMAL: "optimal",
    pywraplp.Solver.FEASIBLE: "feasible",
    pywraplp.Solver.INFEASIBLE: "infeasible",
    pywraplp.Solver.UNBOUNDED: "unbounded",
    pywraplp.Solver.ABNORMAL: "abnormal",
    pywraplp.Solver.NOT_SOLVED: "not solved",
}


def solve_allocation(problem: Problem) -> Solution:
    """The cheapest plan meeting all demand, or, when scarce, the most uniform fraction of it.

    Each cost solve starts from a feasible hint when one is at hand (the cheapest plan using
    single-node-config templates only, or the most-served plan), so a time limit still returns
    a plan with a reported gap.
    """
    start_plan, seconds = _homogeneous_plan(problem)
    fraction, binding = 1.0, []
    if start_plan is None:
        # No single-config plan meets demand: find the most-served plan first. That solve is
        # always feasible (nothing is a solution), and its plan is the cost solve's start, so a
        # cost solve that times out still has a plan (a cold one could end with none).
        scarce = _Model(problem, maximise_fraction=True, min_fraction=0.0)
        # Start from the most-served single-config plan, so a time limit never leaves Coral
        # serving less than the homogeneous (Cauchy-like) templates alone would.
        homogeneous, sec_h = _homogeneous_plan(problem, maximise_fraction=True)
        seconds += sec_h
        scarce.hint_from(homogeneous)
        status_f, sec_f = scarce.solve()
        seconds += sec_f
        _check(status_f, "the most-served solve", problem)
        assert scarce.phi is not None
        fraction = round(scarce.phi.solution_value()) / FRACTION_STEPS
        if fraction < 1:
            binding = _binding(problem, scarce)
        start_plan = {i: round(v.solution_value()) for i, v in enumerate(scarce.nu)}
        # The cost solve starts from the cheaper of that plan and the cheapest single-config
        # plan serving the same fraction, so it never ends dearer than the Cauchy-like one.
        cheap, sec_c = _homogeneous_plan(problem, min_fraction=fraction)
        seconds += sec_c
        if cheap is not None and _price(problem, cheap) < _price(problem, start_plan):
            start_plan = cheap
    model = _Model(problem, maximise_fraction=False, min_fraction=fraction)
    model.hint_from(start_plan)
    status, sec = model.solve()
    seconds += sec
    _check(status, "the cost solve", problem)
    counts = {
        i: round(v.solution_value()) for i, v in enumerate(model.nu) if v.solution_value() > 0.5
    }
    objective = model.solver.Objective().Value()
    bound = model.solver.Objective().BestBound()
    gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)
    s = problem.settings
    report = SolverReport(
        backend=s.backend,
        status=STATUS.get(status, str(status)),
        objective=round(objective, 6),
        best_bound=round(bound, 6),
        gap=round(gap, 6),
        solve_seconds=round(seconds, 4),
        time_limit_s=s.time_limit_s,
        relative_gap=s.relative_gap,
    )
    return Solution(counts, fraction, report, binding)


def _binding(problem: Problem, model: _Model) -> list[str]:
    """Constraints at their limit in the most-served solution, in words a user can act on."""
    out = []
    cols = problem.columns
    users: dict[tuple[RegionId, str], dict[Job, int]] = {}
    for i, c in enumerate(cols):
        n = round(model.nu[i].solution_value())
        for node, k in c.usage if n else ():
            per = users.setdefault((c.region, node), {})
            per[c.job] = per.get(c.job, 0) + n * k
    for (region, node), (expr, limit) in model.slot_rows.items():
        if limit > 0 and expr.solution_value() >= limit - 1e-6:
            who = ", ".join(
                f"{m} {ph} {k}" for (m, ph), k in sorted(users.get((region, node), {}).items())
            )
            out.append(
                f"{region_name(region)} {node}: all {limit} available nodes are in use ({who}); "
                f"raise its count under coral:fleet.availability, or allow another region or node config"
            )
    for (region, gpu), (expr, limit) in model.pool_rows.items():
        if limit > 0 and expr.solution_value() >= limit - 1e-6:
            out.append(
                f"{region_name(region)} {gpu} GPU pool: all {limit} GPUs are in use; "
                f"raise it under coral:fleet.gpu_pools"
            )
    budget = problem.settings.budget_usd_per_hour
    if budget is not None:
        # Integer instances rarely spend a budget exactly: ask whether lifting it serves more.
        free = replace(
            problem, settings=problem.settings.model_copy(update={"budget_usd_per_hour": None})
        )
        unbounded = _Model(free, maximise_fraction=True, min_fraction=0.0)
        unbounded.solve()
        assert unbounded.phi is not None and model.phi is not None
        if unbounded.phi.solution_value() > model.phi.solution_value() + 0.5:
            out.append(
                f"budget: {budget} $/hour serves {model.phi.solution_value() / FRACTION_STEPS:.1%} "
                f"of demand, without it {unbounded.phi.solution_value() / FRACTION_STEPS:.1%}; "
                f"raise coral:fleet.allocation.budget_usd_per_hour"
            )
    alone: dict[Job, float] = {}  # most each job could get with every node to itself
    for c in cols:
        ub = upper_bound(c, problem.market, problem.demand[c.job] * 1e6)
        alone[c.job] = alone.get(c.job, 0.0) + c.template.throughput * ub
    for job in sorted(problem.demand):
        d = problem.demand[job]
        if d <= 0 or alone.get(job, 0.0) >= d:
            continue
        if job not in alone:
            out.append(
                f"{job[0]} {job[1]}: no serving template fits any region's node configs; "
                f"add larger node configs or regions, or relax its SLO"
            )
            continue
        short = sorted(
            {
                f"{n} in {region_name(c.region)} ({problem.market.available[(c.region, n)]})"
                for c in cols
                if c.job == job
                for n, _ in c.usage
            }
        )
        out.append(
            f"{job[0]} {job[1]}: even with every node to itself it gets "
            f"{100 * alone[job] / d:.0f}% of its demand; its templates use "
            f"{', '.join(short[:6])}{' ...' if len(short) > 6 else ''} (available nodes in "
            f"brackets): raise those under coral:fleet.availability or gpu_pools"
        )
    if not out:  # phi = 0 with nothing saturated: the jobs cannot all get one instance at once
        jobs = sorted(j for j, d in problem.demand.items() if d > 0)
        options = "; ".join(
            f"{m} {ph}: "
            + ", ".join(sorted({n for c in cols if c.job == (m, ph) for n, _ in c.usage}))
            for m, ph in jobs
        )
        out.append(
            f"the available nodes cannot give all {len(jobs)} (model, phase) pairs one instance "
            f"each at the same time (the served fraction is uniform, so one unserved pair means "
            f"0%). Node configs each can use: {options}. Raise their availability"
        )
    return out
