"""Online allocation (paper Sec. 4.3): the cheapest mix of template instances across regions.

Integer nu[r, t] = instances of template t in region r. The formulation is in `constraints`
(availability per (region, node config) and per GPU pool; demand per (model, phase); colocation
of a disaggregated model's phases; optional budget) and `objective` ($/hour plus the start-up
penalty I[r, t] >= K p[r, t] (nu - nu0) against the running plan nu0, so only scaling up pays).
Solved with OR-Tools (CP-SAT, SCIP or HiGHS, a stack setting; `model`), part by part first
(`decompose`), on the columns `reduction` keeps; docs/allocation.md has the measurements.

Scarcity: when demand cannot be met, most-served solves choose a fraction phi[m] of each model's
demand (`_most_served`): max-min fair first (the least fraction as large as it can be), then the
most served in total (the sum of the fractions), priority tier by priority tier (the stack's
`priority`, highest first). So a model that cannot be served no longer holds the others at 0%,
as a uniform fraction (the paper's) did. The cost solve then finds the cheapest plan serving
those fractions. Saturated constraints are reported in words (`explain`).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from ortools.linear_solver import pywraplp

from solver.allocation.constraints import FRACTION_STEPS
from solver.allocation.decompose import Part, objective_of, sequential_plan, solve_parts, union
from solver.allocation.explain import MostServed, binding
from solver.allocation.model import (
    BACKEND_IDS,
    STATUS,
    Fairness,
    IlpModel,
    new_solver,
    served_models,
    served_steps,
    values,
)
from solver.allocation.problem import Problem, Solution, priority_tiers, scaled_demand
from solver.allocation.reduction import reduce_columns, undominated
from solver.errors import AllocationError
from solver.plan_schema import SolverReport

__all__ = ["BACKEND_IDS", "FRACTION_STEPS", "new_solver", "solve_allocation"]

_Model = IlpModel  # the name tests patch
# Branch-and-bound nodes a most-served solve may take (SCIP): a limit of work, not of time, so
# a solve that does not finish ends at the same plan on any machine. paper-extended's hardest
# took 923 nodes (10 s) to prove; with its 60 s time limit alone, its plan changed run to run.
MOST_SERVED_NODES = 2_000


# What to change when a solve ends without a plan, by its status.
_NUMBERS_FIX = (
    "the solver could not work with the model's numbers: look for extreme demand, prices or "
    "budget in the stack (or try coral:fleet.allocation.backend: highs)"
)
FIXES = {
    pywraplp.Solver.NOT_SOLVED: "raise coral:fleet.allocation.time_limit_s or use fewer node "
    "configs",
    pywraplp.Solver.INFEASIBLE: "a constraint no plan can meet: check the stack's availability, "
    "gpu_pools and budget",
    pywraplp.Solver.ABNORMAL: _NUMBERS_FIX,
    pywraplp.Solver.MODEL_INVALID: _NUMBERS_FIX,
}


def _check(status: int, what: str, problem: Problem) -> None:
    """Return if the solve produced a plan.

    Raises:
        AllocationError: it did not (infeasible, out of time without a solution, abnormal),
            with the status.
    """
    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return
    words = STATUS.get(status, str(status))
    fix = FIXES.get(status, FIXES[pywraplp.Solver.NOT_SOLVED])
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
    problem: Problem, fairness: Fairness | None = None
) -> tuple[dict[int, int] | None, float]:
    """A feasible start, with its solve time, from single-node-config templates only (a much
    smaller problem): the cheapest plan that serves all of the problem's demand (None if none
    does), or with `fairness`, that most-served solve."""
    idx = [i for i, c in enumerate(problem.columns) if len(c.usage) == 1]
    sub = replace(problem, columns=[problem.columns[i] for i in idx])
    model = IlpModel(sub, min_fraction=0.0 if fairness else 1.0, fairness=fairness)
    status, seconds = model.solve() if fairness is None else _solve_most_served(model)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None, seconds
    return {idx[k]: round(v.solution_value()) for k, v in enumerate(model.nu)}, seconds


def _price(problem: Problem, counts: dict[int, int]) -> float:
    return sum(n * problem.columns[i].price for i, n in counts.items())


def solve_allocation(problem: Problem) -> Solution:
    """The cheapest plan meeting all demand, or, when scarce, the cheapest serving the most of
    it (`_most_served`: max-min fair across models, then the most in total).

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
    if not any(c.is_spot for c in problem.columns):
        return _solve(problem, 0.0)
    return _with_spot(problem)


def _with_spot(problem: Problem) -> Solution:
    """A problem with spot columns, solved with them and with the on-demand columns alone; the
    better plan (more served, then cheaper) is kept.

    Every on-demand plan is a plan of the problem with spot, so spot should never serve less or
    cost more; but the most-served solves stop at a node limit, and on four times the columns
    they can stop at a worse plan (paper-core-scarce served 77% with spot allowed, 84% without).
    A problem whose running plan is on spot (add-only) is solved with its spot columns only.
    """
    with_spot = _solve(problem, 0.0)
    running = {c.running_key for c in problem.columns if c.is_spot}
    if problem.settings.add_only and any(problem.running.get(k, 0) for k in running):
        return with_spot
    keep = [i for i, c in enumerate(problem.columns) if not c.is_spot]
    alone = replace(problem, columns=[problem.columns[i] for i in keep])
    try:
        on_demand = _solve(alone, 0.0)
    except AllocationError:
        return with_spot
    seconds = (with_spot.report.solve_seconds if with_spot.report else 0.0) + (
        on_demand.report.solve_seconds if on_demand.report else 0.0
    )

    def merit(sol: Solution) -> tuple[float, float, float]:
        cost = sol.report.objective if sol.report is not None else math.inf
        fractions = sol.fractions.values()
        return (round(sol.fraction, 4), round(sum(fractions), 4), -round(cost, 6))

    if merit(with_spot) >= merit(on_demand):
        report = with_spot.report
        if report is not None:
            report = report.model_copy(update={"solve_seconds": round(seconds, 4)})
        return replace(with_spot, report=report)
    report = on_demand.report
    if report is not None:
        # Its bound holds for the on-demand columns; the spot solve's, at the same fractions,
        # for the whole problem.
        spot_bound = with_spot.report.best_bound if with_spot.report is not None else None
        same = with_spot.fractions == on_demand.fractions
        bound = min(spot_bound, report.objective) if same and spot_bound is not None else None
        gap = relative_gap_of(report.objective, bound)
        report = report.model_copy(
            update={
                "solve_seconds": round(seconds, 4),
                "best_bound": None if bound is None else round(bound, 6),
                "gap": None if gap is None else round(gap, 6),
                "status": report.status if same and report.status == "optimal" and gap == 0
                else "feasible",
            }
        )  # fmt: skip
    counts = {keep[i]: n for i, n in on_demand.counts.items()}
    return replace(on_demand, counts=counts, report=report)


def _solve(problem: Problem, seconds: float) -> Solution:
    """`solve_allocation` after its checks (`seconds` spent so far)."""
    full = dict.fromkeys(served_models(problem), 1.0)
    parts, sec = solve_parts(problem, 1.0)
    seconds += sec
    if (plan := union(problem, parts)) is not None:
        return _from_parts(problem, parts, plan, full, [], seconds)
    begin = time.perf_counter()
    solved = all(p.counts is not None for p in parts)
    start_plan = sequential_plan(problem, parts, 1.0) if solved else None
    seconds += time.perf_counter() - begin
    if start_plan is None:
        start_plan, sec = _homogeneous_plan(problem)
        seconds += sec
    if start_plan is not None:
        return _joint(problem, parts, start_plan, full, [], seconds)
    fractions, lines, start_plan, sec = _most_served(problem)
    # The cost solve serves those fractions: the same problem with each model's demand scaled.
    scaled = replace(problem, demand=scaled_demand(problem.demand, fractions))
    parts, more = solve_parts(scaled, 1.0)
    seconds += sec + more
    if (plan := union(scaled, parts)) is not None:
        return _from_parts(scaled, parts, plan, fractions, lines, seconds)
    return _joint(scaled, parts, start_plan, fractions, lines, seconds)


def _joint(
    problem: Problem,
    parts: list[Part],
    start: dict[int, int],
    fractions: dict[str, float],
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
    fewer = set(reduce_columns(problem, upper, lower, 1.0)) & set(undominated(problem))
    kept = sorted(fewer | used)
    small = replace(problem, columns=[problem.columns[i] for i in kept])
    model = IlpModel(small)
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
    return Solution(counts, fractions, report, lines, (len(problem.columns), len(kept)))


def _from_parts(
    problem: Problem,
    parts: list[Part],
    plan: dict[int, int],
    fractions: dict[str, float],
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
    return Solution(plan, fractions, report, lines, (len(problem.columns), after))


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


def _most_served(problem: Problem) -> tuple[dict[str, float], list[str], dict[int, int], float]:
    """When no plan serves all demand: the fraction of each model's demand to serve.

    Priority tier by priority tier (highest first, the tiers above held at what they got): the
    least fraction of the tier's models as large as it can be (max-min fairness), then the sum
    of their fractions as large as it can be with none below that least. Each proves its
    fractions to the step (`whole_steps_gap`) within MOST_SERVED_NODES nodes (else keeps the
    best it found), from the best plan of the solve before (or of single-config templates
    alone, so a limit never serves less than the Cauchy-like templates would).

    Returns:
        The fraction per model, the binding constraints in words (none when all are served),
        the cost solve's start (a plan serving those fractions) and the seconds spent.
    """
    # These solves are always feasible (nothing is a solution). Without a budget cost plays
    # no part here, so prices are not compared in dominance.
    budgeted = problem.settings.budget_usd_per_hour is not None
    keep = list(range(len(problem.columns))) if budgeted else undominated(problem, False)
    sub = replace(problem, columns=[problem.columns[i] for i in keep])
    floors: dict[str, int] = {}
    found: dict[int, int] = {}
    seconds = 0.0
    model = None
    for tier in priority_tiers(served_models(problem), problem.priorities):
        for total in (False, True):
            fairness = Fairness(dict(floors), tier, total)
            model = IlpModel(sub, min_fraction=0.0, fairness=fairness)
            if not found:
                homogeneous, sec = _homogeneous_plan(sub, fairness)
                found, seconds = homogeneous or {}, seconds + sec
            model.hint_from(found)
            status, sec = _solve_most_served(model)
            seconds += sec
            _check(status, "the most-served solve", problem)
            found = {i: round(v.solution_value()) for i, v in enumerate(model.nu)}
            got = model.fractions()
            if total or len(tier) == 1:
                floors |= {m: got[m] for m in tier}
                break  # (one model: its most is its least)
            floors |= dict.fromkeys(tier, round(model.least.solution_value()))
    assert model is not None
    steps = served_steps(sub, found)
    least = min(steps.values(), default=FRACTION_STEPS)
    lines: list[str] = []
    if least < FRACTION_STEPS:
        solved = MostServed(
            found, model.slot_rows, model.pool_rows, least, _unbudgeted_steps(problem)
        )
        u = problem.settings.target_utilization
        lines = [*_short_models(steps, u), *binding(sub, solved, problem)]
    counts = {keep[i]: n for i, n in found.items() if n}
    fractions = {m: floors.get(m, 0) / FRACTION_STEPS for m in served_models(problem)}
    # The cost solve starts from the cheaper of that plan and the cheapest single-config
    # plan serving the same fractions, so it never ends dearer than the Cauchy-like one.
    scaled = replace(problem, demand=scaled_demand(problem.demand, fractions))
    cheap, sec = _homogeneous_plan(scaled)
    seconds += sec
    start = (
        cheap if cheap is not None and _price(problem, cheap) < _price(problem, counts) else counts
    )
    return fractions, lines, start, seconds


def whole_steps_gap(scale: int) -> float:
    """The relative gap at which a most-served solve has proven its fractions: its
    objective is whole FRACTION_STEPS (the least fraction, or the sum of the fractions, at most
    `scale` steps) less a cost tie-break below half a step, so a bound within 0.4 of the plan
    found leaves no better whole step. Only the tie-break (the cheapest of the plans serving
    those fractions) is left unproven, and the cost solve that follows settles the cost.
    Proving the tie-break too took SCIP 28-40 s on paper-extended's max-min solve."""
    return 0.4 / scale


def _solve_most_served(model: IlpModel) -> tuple[int, float]:
    """A most-served model solved until its fractions are proven to the step, within
    MOST_SERVED_NODES nodes: the status and the seconds it took."""
    assert model.fairness is not None
    steps = FRACTION_STEPS * (len(model.fairness.active) if model.fairness.total else 1)
    return model.solve(relative_gap=whole_steps_gap(steps), node_limit=MOST_SERVED_NODES)


def _short_models(steps: dict[str, int], u: float = 1.0) -> list[str]:
    """One line per model served less than in full, least served first; with a target
    utilization `u` below 1 the fraction is of demand / u, and the line says how much of the
    demand itself that is."""

    def line(m: str, n: int) -> str:
        f = n / FRACTION_STEPS
        if u >= 1:
            return f"{m}: serves {f:.1%} of its demand"
        return (
            f"{m}: serves {f:.1%} of its demand / target_utilization {u:g} "
            f"({min(1.0, f / u):.1%} of its demand)"
        )

    return [
        line(m, n)
        for m, n in sorted(steps.items(), key=lambda kv: (kv[1], kv[0]))
        if n < FRACTION_STEPS
    ]


def _unbudgeted_steps(problem: Problem) -> int | None:
    """The least served fraction (max-min, all models alike) with the budget lifted, in
    FRACTION_STEPS (None when the stack sets no budget)."""
    if problem.settings.budget_usd_per_hour is None:
        return None
    settings = problem.settings.model_copy(update={"budget_usd_per_hour": None})
    free = replace(problem, settings=settings)
    free = replace(free, columns=[problem.columns[i] for i in undominated(free, False)])
    unbounded = IlpModel(
        free, min_fraction=0.0, fairness=Fairness(active=frozenset(served_models(free)))
    )
    status, _ = _solve_most_served(unbounded)
    _check(status, "the most-served solve without the budget", problem)
    return int(round(unbounded.least.solution_value()))


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
