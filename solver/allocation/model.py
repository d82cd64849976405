"""The allocation ILP on an OR-Tools backend: the model over a problem's columns, and a solve.

`IlpModel` builds the formulation of `constraints` and `objective` (cost, or with
`maximise_fraction` the served fraction phi) and solves it within the stack's limits.
"""

from __future__ import annotations

import math
import time

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
from solver.allocation.objective import hourly_cost, startup_penalty
from solver.allocation.problem import Problem
from solver.errors import AllocationError
from solver.types import Job

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


class IlpModel:
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
