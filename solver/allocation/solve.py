"""Online allocation (paper Sec. 4.3): the cheapest mix of template instances across regions.

Integer nu[r, t] = instances of template t in region r. The formulation is in `constraints`
(availability per (region, node config) and per GPU pool; demand per (model, phase); colocation
of a disaggregated model's phases; optional budget) and `objective` ($/hour plus the start-up
penalty I[r, t] >= K p[r, t] (nu - nu0) against the running plan nu0, so only scaling up pays).
Solved with OR-Tools (CP-SAT, SCIP or HiGHS, a stack setting; `model`), part by part first
(`decompose`), on the columns `reduction` keeps; docs/allocation.md has the measurements.

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

from solver.allocation.constraints import FRACTION_STEPS
from solver.allocation.decompose import Part, objective_of, sequential_plan, solve_parts, union
from solver.allocation.explain import MostServed, binding
from solver.allocation.model import BACKEND_IDS, STATUS, IlpModel, new_solver, values
from solver.allocation.problem import Problem, Solution
from solver.allocation.reduction import reduce_columns, undominated
from solver.errors import AllocationError
from solver.plan.schema import SolverReport

__all__ = ["BACKEND_IDS", "FRACTION_STEPS", "new_solver", "solve_allocation"]

_Model = IlpModel  # the name tests patch


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
    model = IlpModel(
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


def solve_allocation(problem: Problem) -> Solution:
    """The cheapest plan meeting all demand, or, when scarce, the most uniform fraction of it.

    First each job (or colocated model) alone, on its reduced columns (`decompose`): when the
    parts' plans fit together, that is the plan, within the parts' summed bounds. Otherwise a
    joint cost solve on the columns `reduction` keeps against a feasible start (the cheapest
    plan using single-node-config templates only, or the most-served plan) and the parts'
    bounds, so a time limit still returns a plan with a reported gap.

    Raises:
        AllocationError: the backend is missing, a solve ended without a plan, or an add-only
            re-plan cannot keep a running instance.
    """
    if problem.settings.add_only:
        _check_keepable(problem)
    return _solve(problem, 0.0)


def _solve(problem: Problem, seconds: float) -> Solution:
    """`solve_allocation` after its checks (`seconds` spent so far)."""
    parts, sec = solve_parts(problem, 1.0)
    seconds += sec
    if (plan := union(problem, parts)) is not None:
        return _from_parts(problem, parts, plan, 1.0, [], seconds)
    begin = time.perf_counter()
    solved = all(p.counts is not None for p in parts)
    start_plan = sequential_plan(problem, parts, 1.0) if solved else None
    seconds += time.perf_counter() - begin
    if start_plan is None:
        start_plan, sec = _homogeneous_plan(problem)
        seconds += sec
    fraction, lines = 1.0, list[str]()
    if start_plan is None:
        fraction, lines, start_plan, sec = _most_served(problem)
        parts, more = solve_parts(problem, fraction)
        seconds += sec + more
        if (plan := union(problem, parts)) is not None:
            return _from_parts(problem, parts, plan, fraction, lines, seconds)
    return _joint(problem, parts, start_plan, fraction, lines, seconds)


def _joint(
    problem: Problem,
    parts: list[Part],
    start: dict[int, int],
    fraction: float,
    lines: list[str],
    seconds: float,
) -> Solution:
    """The cost solve of the whole on the columns no plan cheaper than `start` can spare.

    Raises:
        AllocationError: it ended without a plan.
    """
    upper = objective_of(problem, start)
    lower = {p.jobs: p.bound for p in parts if p.bound is not None}
    used = {i for i, n in start.items() if n}
    # Both reductions together keep an optimal plan: swap each dominated column in it for its
    # dominator (no dearer, `undominated`); each column of that plan is within its budget.
    fewer = set(reduce_columns(problem, upper, lower, fraction)) & set(undominated(problem))
    kept = sorted(fewer | used)
    small = replace(problem, columns=[problem.columns[i] for i in kept])
    model = IlpModel(small, maximise_fraction=False, min_fraction=fraction)
    where = {i: k for k, i in enumerate(kept)}
    model.hint_from({where[i]: n for i, n in start.items() if n})
    status, sec = model.solve()
    _check(status, "the cost solve", problem)
    counts = {kept[k]: n for k, n in values(model).items()}
    objective = model.solver.Objective().Value()
    bound = proven_bound(model.solver.Objective().BestBound())
    if objective > upper:  # the solver stopped short of its start: keep the start
        counts, objective = {i: n for i, n in start.items() if n}, upper
    if bound is not None:
        bound = min(bound, upper)  # every plan cheaper than `start` is a plan of `small`
    report = _report(problem, STATUS.get(status, str(status)), objective, bound, seconds + sec)
    return Solution(counts, fraction, report, lines, (len(problem.columns), len(kept)))


def _from_parts(
    problem: Problem,
    parts: list[Part],
    plan: dict[int, int],
    fraction: float,
    lines: list[str],
    seconds: float,
) -> Solution:
    """The parts' plans as the plan: their summed objective and bounds."""
    bounds = [p.bound for p in parts]
    bound = None if any(b is None for b in bounds) else sum(b for b in bounds if b is not None)
    optimal = all(p.status == pywraplp.Solver.OPTIMAL for p in parts)
    report = _report(
        problem,
        "optimal" if optimal else "feasible",
        objective_of(problem, plan),
        bound,
        seconds,
    )
    after = sum(p.columns[1] for p in parts)
    return Solution(plan, fraction, report, lines, (len(problem.columns), after))


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
    # Without a budget cost plays no part here, so prices are not compared in dominance.
    budgeted = problem.settings.budget_usd_per_hour is not None
    keep = list(range(len(problem.columns))) if budgeted else undominated(problem, False)
    sub = replace(problem, columns=[problem.columns[i] for i in keep])
    scarce = IlpModel(sub, maximise_fraction=True, min_fraction=0.0)
    # Start from the most-served single-config plan, so a time limit never leaves Coral
    # serving less than the homogeneous (Cauchy-like) templates alone would.
    homogeneous, seconds = _homogeneous_plan(sub, maximise_fraction=True)
    scarce.hint_from(homogeneous)
    # phi is an integer number of steps, so gap 0 (proven optimal) is what "the largest
    # fraction" means; the stack's gap is for cost, and a 1% gap here served up to 1% less.
    status, sec = scarce.solve(relative_gap=0.0)
    seconds += sec
    _check(status, "the most-served solve", problem)
    assert scarce.phi is not None
    steps = round(scarce.phi.solution_value())
    found = {i: round(v.solution_value()) for i, v in enumerate(scarce.nu)}
    lines: list[str] = []
    if steps < FRACTION_STEPS:
        solved = MostServed(
            found, scarce.slot_rows, scarce.pool_rows, steps, _unbudgeted_steps(problem)
        )
        lines = binding(sub, solved)
    counts = {keep[i]: n for i, n in found.items()}
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
    free = replace(problem, settings=settings)
    free = replace(free, columns=[problem.columns[i] for i in undominated(free, False)])
    unbounded = IlpModel(free, True, 0.0)
    status, _ = unbounded.solve(relative_gap=0.0)  # compared with the optimal phi
    _check(status, "the most-served solve without the budget", problem)
    assert unbounded.phi is not None
    return int(round(unbounded.phi.solution_value()))


def _report(
    problem: Problem, status: str, objective: float, bound: float | None, seconds: float
) -> SolverReport:
    """What the plan records of the cost solve: status, objective, bound, gap, time."""
    gap = relative_gap_of(objective, bound)
    s = problem.settings
    return SolverReport(
        backend=s.backend,
        status=status,
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
