"""Online allocation (paper Sec. 4.3): the cheapest mix of template instances across regions.

Integer nu[r, t] = instances of template t in region r. The formulation is in `constraints`
(availability per (region, node config) and per GPU pool; demand per (model, phase); colocation
of a disaggregated model's phases; optional budget) and `objective` ($/hour plus the start-up
penalty I[r, t] >= K p[r, t] (nu - nu0) against the running plan nu0, so only scaling up pays).
Solved with OR-Tools (CP-SAT, SCIP or HiGHS, a stack setting).

Scarcity: when demand cannot be met, a first solve finds the largest fraction phi of every
model's demand that can be served (uniform across models, as the paper does); a second finds the
cheapest plan serving phi. Saturated constraints of the first solve are reported in words
(`explain`).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from ortools.linear_solver import pywraplp

from solver.allocation.constraints import (
    FRACTION_STEPS,
    add_availability,
    add_budget,
    add_colocation,
    add_demand,
    add_gpu_pools,
    add_keep_running,
    instance_counts,
    node_usage,
)
from solver.allocation.explain import MostServed, binding
from solver.allocation.objective import hourly_cost, startup_penalty
from solver.allocation.problem import Problem, Solution
from solver.errors import AllocationError
from solver.plan.schema import SolverReport
from solver.types import Job

__all__ = ["BACKEND_IDS", "FRACTION_STEPS", "new_solver", "solve_allocation"]

BACKEND_IDS = {"cp-sat": "CP_SAT", "scip": "SCIP", "highs": "HIGHS"}


def new_solver(backend: str) -> pywraplp.Solver:
    """An empty OR-Tools model on `backend`, quiet.

    Raises:
        AllocationError: this OR-Tools build has no such backend.
    """
    solver = pywraplp.Solver.CreateSolver(BACKEND_IDS[backend])
    if solver is None:
        raise AllocationError(
            f"OR-Tools has no {backend} backend in this build",
            "unavailable",
            "set coral:fleet.allocation.backend to another of scip, cp-sat, highs, or "
            "reinstall ortools",
        )
    solver.SuppressOutput()  # HiGHS prints a banner to stdout otherwise (breaks --json)
    return solver


class _Model:
    """The ILP over a problem's columns, with demand scaled by phi (fixed or a variable)."""

    def __init__(self, problem: Problem, maximise_fraction: bool, min_fraction: float) -> None:
        s = problem.settings
        self.problem = problem
        self.solver = solver = new_solver(s.backend)
        self.nu = instance_counts(solver, problem)
        use = node_usage(problem)
        self.slot_rows = add_availability(solver, problem, self.nu, use)
        self.pool_rows = add_gpu_pools(solver, problem, self.nu, use)
        self.phi = solver.IntVar(0, FRACTION_STEPS, "phi") if maximise_fraction else None
        add_demand(solver, problem, self.nu, self.phi, min_fraction)
        if s.colocate_phases:
            add_colocation(solver, problem, self.nu)
        if s.add_only:
            add_keep_running(solver, problem, self.nu)
        self.cost = hourly_cost(solver, problem, self.nu)
        if s.budget_usd_per_hour is not None:
            add_budget(solver, self.cost, s.budget_usd_per_hour)
        if self.phi is not None:
            solver.Maximize(self.phi)
            return
        self.penalty = startup_penalty(solver, problem, self.nu)
        solver.Minimize(self.cost + self.penalty)

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

    def solve(self, relative_gap: float | None = None) -> tuple[int, float]:
        """Solve within the stack's time limit, to `relative_gap` (default: the stack's).

        Returns:
            The OR-Tools status and the seconds the solve took.
        """
        s, solver = self.problem.settings, self.solver
        gap = s.relative_gap if relative_gap is None else relative_gap
        solver.SetTimeLimit(int(s.time_limit_s * 1000))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, gap)
        # SCIP and HiGHS run single-threaded (SCIP segfaulted with threads > 1).
        if s.backend == "cp-sat":
            # Fixed seed and interleaved workers: the same inputs give the same plan.
            solver.SetSolverSpecificParametersAsString(
                f"num_workers:{s.threads} interleave_search:true random_seed:0 "
                f"relative_gap_limit:{gap}"
            )
        start = time.perf_counter()
        status = solver.Solve(params)
        return status, time.perf_counter() - start


def _check(status: int, what: str, problem: Problem) -> None:
    """Return if the solve produced a plan.

    Raises:
        AllocationError: it did not (infeasible, out of time without a solution, abnormal),
            with the status.
    """
    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return
    words = STATUS.get(status, str(status))
    fix = "raise coral:fleet.allocation.time_limit_s or use fewer node configs"
    if status == pywraplp.Solver.INFEASIBLE and problem.settings.add_only and problem.running:
        fix = (
            "the running plan no longer fits the stack's availability or budget, so it cannot "
            "be kept whole: turn off coral:fleet.allocation.add_only (or --add-only), or raise "
            "the availability or budget"
        )
    raise AllocationError(
        f"{what} ended {words} within {problem.settings.time_limit_s:g} s "
        f"({len(problem.columns)} template-region columns)",
        words,
        fix,
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

    Raises:
        AllocationError: the backend is missing, a solve ended without a plan, or an add-only
            re-plan cannot keep a running instance.
    """
    if problem.settings.add_only:
        _check_keepable(problem)
    start_plan, seconds = _homogeneous_plan(problem)
    fraction, lines = 1.0, list[str]()
    if start_plan is None:
        fraction, lines, start_plan, sec = _most_served(problem)
        seconds += sec
    model = _Model(problem, maximise_fraction=False, min_fraction=fraction)
    model.hint_from(start_plan)
    status, sec = model.solve()
    seconds += sec
    _check(status, "the cost solve", problem)
    counts = {
        i: round(v.solution_value()) for i, v in enumerate(model.nu) if v.solution_value() > 0.5
    }
    return Solution(counts, fraction, _report(model, status, seconds), lines)


def _check_keepable(problem: Problem) -> None:
    """An add-only re-plan keeps every running instance, so each needs its column.

    Raises:
        AllocationError: running instances whose (model, phase, region, template) is no longer
            a column: the model left the stack, the template the library, or the region sells
            none of its nodes.
    """
    columns = {c.running_key for c in problem.columns}
    lost = sorted(k for k, n in problem.running.items() if n > 0 and k not in columns)
    if lost:
        shown = ", ".join(f"{m}/{ph}/{cloud}:{r}/{t}" for m, ph, cloud, r, t in lost[:4])
        raise AllocationError(
            f"add_only cannot keep {len(lost)} running template(s) that are no longer a choice "
            f"(model, template or region gone, or no nodes available): {shown}"
            + (" ..." if len(lost) > 4 else ""),
            "infeasible",
            "turn off coral:fleet.allocation.add_only (or --add-only) for this re-plan",
        )


def _most_served(problem: Problem) -> tuple[float, list[str], dict[int, int], float]:
    """Step 1 when no single-config plan meets demand: the largest uniform fraction phi.

    Returns:
        phi as a fraction, the binding constraints in words (none when phi = 1), the cost
        solve's start, and the seconds spent.
    """
    # This solve is always feasible (nothing is a solution), and its plan is the cost solve's
    # start, so a cost solve that times out still has a plan (a cold one could end with none).
    scarce = _Model(problem, maximise_fraction=True, min_fraction=0.0)
    # Start from the most-served single-config plan, so a time limit never leaves Coral
    # serving less than the homogeneous (Cauchy-like) templates alone would.
    homogeneous, seconds = _homogeneous_plan(problem, maximise_fraction=True)
    scarce.hint_from(homogeneous)
    # phi is an integer number of steps, so gap 0 (proven optimal) is what "the largest
    # fraction" means; the stack's gap is for cost, and a 1% gap here served up to 1% less.
    status, sec = scarce.solve(relative_gap=0.0)
    seconds += sec
    _check(status, "the most-served solve", problem)
    assert scarce.phi is not None
    steps = round(scarce.phi.solution_value())
    counts = {i: round(v.solution_value()) for i, v in enumerate(scarce.nu)}
    lines: list[str] = []
    if steps < FRACTION_STEPS:
        solved = MostServed(
            counts, scarce.slot_rows, scarce.pool_rows, steps, _unbudgeted_steps(problem)
        )
        lines = binding(problem, solved)
    # The cost solve starts from the cheaper of that plan and the cheapest single-config
    # plan serving the same fraction, so it never ends dearer than the Cauchy-like one.
    cheap, sec = _homogeneous_plan(problem, min_fraction=steps / FRACTION_STEPS)
    seconds += sec
    start = (
        cheap if cheap is not None and _price(problem, cheap) < _price(problem, counts) else counts
    )
    return steps / FRACTION_STEPS, lines, start, seconds


def _unbudgeted_steps(problem: Problem) -> int | None:
    """The most-served phi with the budget lifted (None when the stack sets no budget)."""
    if problem.settings.budget_usd_per_hour is None:
        return None
    settings = problem.settings.model_copy(update={"budget_usd_per_hour": None})
    unbounded = _Model(replace(problem, settings=settings), True, 0.0)
    status, _ = unbounded.solve(relative_gap=0.0)  # compared with the optimal phi
    _check(status, "the most-served solve without the budget", problem)
    assert unbounded.phi is not None
    return int(round(unbounded.phi.solution_value()))


def _report(model: _Model, status: int, seconds: float) -> SolverReport:
    """What the plan records of the cost solve: status, objective, bound, gap, time."""
    objective = model.solver.Objective().Value()
    bound = proven_bound(model.solver.Objective().BestBound())
    gap = relative_gap_of(objective, bound)
    s = model.problem.settings
    return SolverReport(
        backend=s.backend,
        status=STATUS.get(status, str(status)),
        objective=round(objective, 6),
        best_bound=None if bound is None else round(bound, 6),
        gap=None if gap is None else round(gap, 6),
        solve_seconds=round(seconds, 4),
        time_limit_s=s.time_limit_s,
        relative_gap=s.relative_gap,
    )


SOLVER_INFINITY = 1e19  # SCIP reports "no bound" as -1e20, other backends as -inf


def proven_bound(bound: float) -> float | None:
    """The solver's best bound, or None when it proved none (infinite or SCIP's -1e20)."""
    return bound if math.isfinite(bound) and abs(bound) < SOLVER_INFINITY else None


def relative_gap_of(objective: float, bound: float | None) -> float | None:
    """(objective - bound) / objective, 0 for an empty plan, None when no bound is known.

    A plan with objective 0 is optimal whatever the bound (costs are never negative).
    """
    if objective <= 0:
        return 0.0
    if bound is None:
        return None
    return max(0.0, (objective - bound) / objective)
