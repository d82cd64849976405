"""The allocation ILP on an OR-Tools backend: the model over a problem's columns, and a solve.

`IlpModel` builds the formulation of `constraints` and `objective` (cost, or with a `Fairness`
the served fractions phi[m]) and solves it within the stack's limits.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ortools.linear_solver import pywraplp

from solver.allocation.constraints import (
    FRACTION_STEPS,
    add_availability,
    add_budget,
    add_colocation,
    add_demand,
    add_gpu_pools,
    add_keep_running,
    add_one_config,
    add_spot,
    instance_counts,
    node_usage,
)
from solver.allocation.objective import hourly_cost, startup_penalty
from solver.allocation.problem import Problem
from solver.errors import AllocationError
from solver.types import Job, per_model

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


@dataclass(frozen=True)
class Fairness:
    """What a most-served solve maximises. Every model keeps at least its `floors` (in
    FRACTION_STEPS); then either the least fraction of the `active` models (max-min), or, with
    `total`, the sum of the active models' fractions (the most served once the least is set)."""

    floors: Mapping[str, int] = field(default_factory=dict)
    active: frozenset[str] = frozenset()
    total: bool = False


class IlpModel:
    """The ILP over a problem's columns: the cheapest plan serving a fixed fraction of every
    model's demand, or (`fairness` given) a most-served solve with a fraction phi[m] per model."""

    def __init__(
        self, problem: Problem, min_fraction: float = 1.0, fairness: Fairness | None = None
    ) -> None:
        s = problem.settings
        self.problem = problem
        self.fairness = fairness
        self.solver = solver = new_solver(s.backend)
        self.nu = instance_counts(solver, problem)
        use = node_usage(problem)
        self.slot_rows = add_availability(solver, problem, self.nu, use)
        self.pool_rows = add_gpu_pools(solver, problem, self.nu, use)
        self.phi: dict[str, Any] | None = None
        self.least: Any = None
        if fairness is not None:
            self.phi = {
                m: solver.IntVar(fairness.floors.get(m, 0), FRACTION_STEPS, f"phi[{m}]")
                for m in served_models(problem)
            }
        add_demand(solver, problem, self.nu, self.phi, min_fraction)
        add_spot(solver, problem, self.nu, self.phi, min_fraction)
        if s.colocate_phases:
            add_colocation(solver, problem, self.nu)
        if s.add_only:
            add_keep_running(solver, problem, self.nu)
        if problem.one_config_per_job:
            add_one_config(solver, problem, self.nu)
        self.cost = hourly_cost(solver, problem, self.nu)
        if s.budget_usd_per_hour is not None:
            add_budget(solver, self.cost, s.budget_usd_per_hour)
        if fairness is not None and self.phi is not None:
            active = [self.phi[m] for m in sorted(fairness.active & self.phi.keys())]
            # Cost breaks ties only: all of it weighs less than one step of a fraction, so the
            # most-served plan buys nothing that serves nothing (a 70B's prefill alone).
            tie = 0.5 / (1.0 + market_cost(problem))
            if fairness.total:
                solver.Maximize(solver.Sum(active) - tie * self.cost)
                return
            self.least = solver.IntVar(0, FRACTION_STEPS, "least")
            for var in active:
                solver.Add(var >= self.least)
            solver.Maximize(self.least - tie * self.cost)
            return
        self.penalty = startup_penalty(solver, problem, self.nu)
        solver.Minimize(self.cost + self.penalty)

    def hint_from(self, counts: dict[int, int] | None) -> None:
        """Give the solver a feasible starting plan (SCIP and CP-SAT; OR-Tools 9.15's HiGHS
        interface crashed with a hint, so HiGHS starts cold). A most-served model also gets
        the plan's served fractions, so the hint is a complete solution."""
        if not counts or self.problem.settings.backend == "highs":
            return
        variables = list(self.nu)
        values = [float(counts.get(i, 0)) for i in range(len(self.nu))]
        if self.phi is not None:
            steps = served_steps(self.problem, counts)
            for m, var in sorted(self.phi.items()):
                variables.append(var)
                values.append(float(steps.get(m, 0)))
            if self.least is not None and self.fairness is not None:
                variables.append(self.least)
                least = min((steps.get(m, 0) for m in self.fairness.active), default=0)
                values.append(float(least))
        self.solver.SetHint(variables, values)

    def fractions(self) -> dict[str, int]:
        """A solved most-served model's phi per model, in FRACTION_STEPS."""
        assert self.phi is not None
        return {m: round(v.solution_value()) for m, v in self.phi.items()}

    def solve(
        self, relative_gap: float | None = None, node_limit: int | None = None
    ) -> tuple[int, float]:
        """Solve within the stack's time limit, to `relative_gap` (default: the stack's), and
        with SCIP within `node_limit` branch-and-bound nodes: unlike time, a limit that ends a
        solve at the same plan on any machine.

        Returns:
            The OR-Tools status and the seconds the solve took.
        """
        s, solver = self.problem.settings, self.solver
        gap = s.relative_gap if relative_gap is None else relative_gap
        solver.SetTimeLimit(int(s.time_limit_s * 1000))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, gap)
        # SCIP and HiGHS run single-threaded (SCIP segfaulted with threads > 1). Neither SCIP
        # nor CP-SAT may catch Ctrl-C itself: each would end the solve as if its time limit
        # hit and return a plan (`solve_interruptibly` stops it instead).
        if s.backend == "cp-sat":
            # Fixed seed and interleaved workers: the same inputs give the same plan.
            solver.SetSolverSpecificParametersAsString(
                f"num_workers:{s.threads} interleave_search:true random_seed:0 "
                f"relative_gap_limit:{gap} catch_sigint_signal:false"
            )
        if s.backend == "scip":
            nodes = f"limits/nodes = {node_limit}\n" if node_limit is not None else ""
            solver.SetSolverSpecificParametersAsString(f"misc/catchctrlc = FALSE\n{nodes}")
        start = time.perf_counter()
        status = solve_interruptibly(solver, params)
        return status, time.perf_counter() - start


INTERRUPT_WAIT_S = 5.0  # how long Ctrl-C waits for an interrupted solve to return
INTERRUPT_RETRY_S = 0.05  # how often an interrupt is sent again until the solve returns


def solve_interruptibly(solver: pywraplp.Solver, params: pywraplp.MPSolverParameters) -> int:
    """`solver.Solve(params)`, stopped at once by Ctrl-C.

    Python raises KeyboardInterrupt only between bytecodes of the main thread, never inside
    a C++ call, so a solve run there would finish first (seconds to its time limit). It runs in
    a worker thread instead (pywraplp releases the GIL while it solves) while the main thread
    waits; on Ctrl-C another thread interrupts the solver (`InterruptSolve`, repeated until it
    returns), the main thread waits for it at most INTERRUPT_WAIT_S and re-raises, so no plan
    comes of an interrupted solve.

    Returns:
        The OR-Tools status.
    """
    done = threading.Event()
    result: list[int] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(solver.Solve(params))
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)
        finally:
            done.set()

    def interrupt() -> None:
        # From a thread of its own, again until the solve returns: the call may wait on the
        # solver's own lock while it sets the model up, and SCIP forgets an interrupt that
        # comes before its solve starts. The main thread never waits inside the solver.
        while not done.is_set():
            solver.InterruptSolve()
            done.wait(INTERRUPT_RETRY_S)

    threading.Thread(target=run, name="ilp-solve", daemon=True).start()
    try:
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        threading.Thread(target=interrupt, name="ilp-interrupt", daemon=True).start()
        done.wait(INTERRUPT_WAIT_S)  # SCIP returns within milliseconds once it sees it
        raise
    if failure:
        raise failure[0]
    return result[0]


STATUS = {
    pywraplp.Solver.OPTIMAL: "optimal",
    pywraplp.Solver.FEASIBLE: "feasible",
    pywraplp.Solver.INFEASIBLE: "infeasible",
    pywraplp.Solver.UNBOUNDED: "unbounded",
    pywraplp.Solver.ABNORMAL: "abnormal",
    pywraplp.Solver.NOT_SOLVED: "not solved",
}


def values(model: IlpModel) -> dict[int, int]:
    """Column index -> instances of a solved model, the columns it runs only."""
    return {
        i: round(v.solution_value()) for i, v in enumerate(model.nu) if v.solution_value() > 0.5
    }


def market_cost(problem: Problem) -> float:
    """$/hour of every available node of the market: more than any plan can cost."""
    m = problem.market
    return sum(m.price[slot] * max(0, n) for slot, n in m.available.items() if slot in m.price)


def served_models(problem: Problem) -> list[str]:
    """The models with demand, sorted."""
    return sorted({job[0] for job, d in problem.demand.items() if d > 0})


def served_steps(problem: Problem, counts: dict[int, int]) -> dict[str, int]:
    """Per model with demand, the largest fraction (in FRACTION_STEPS) of every one of its
    jobs' demand that `counts` serves."""
    have: dict[Job, float] = {}
    for i, n in counts.items():
        job = problem.columns[i].job
        have[job] = have.get(job, 0.0) + n * problem.columns[i].template.throughput
    ratios = {job: have.get(job, 0.0) / d for job, d in problem.demand.items() if d > 0}
    least = per_model(ratios)
    return {
        m: max(0, min(FRACTION_STEPS, math.floor(r * FRACTION_STEPS))) for m, r in least.items()
    }
