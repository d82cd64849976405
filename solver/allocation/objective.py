"""The allocation ILP's objective: $/hour plus the start-up penalty (notation: `constraints`).

minimise sum_{r,t} p[r,t] nu[r,t] + sum_{r,t} I[r,t], with I[r,t] >= K p[r,t] (nu[r,t] -
nu0[r,t]) and I >= 0: only instances above the running plan pay their start-up. Under scarcity
the first solve maximises phi instead (`solve`).
"""

from __future__ import annotations

from typing import Any

from ortools.linear_solver import pywraplp

from solver.allocation.constraints import column_name
from solver.allocation.problem import Problem


def hourly_cost(solver: pywraplp.Solver, problem: Problem, nu: list[Any]) -> Any:
    """The fleet's $/hour: sum_{r,t} p[r,t] nu[r,t]."""
    return solver.Sum([c.price * nu[i] for i, c in enumerate(problem.columns)])


def startup_penalty(solver: pywraplp.Solver, problem: Problem, nu: list[Any]) -> Any:
    """The start-up penalty sum_{r,t} I[r,t], in $/hour.

    A column with nu0[r,t] = 0 is folded in as K p[r,t] nu[r,t] (no variable); a running one
    gets I[r,t] >= 0 with I[r,t] >= K p[r,t] (nu[r,t] - nu0[r,t]), so keeping or shrinking it
    costs nothing and only its extra instances pay.
    """
    k = problem.settings.startup_penalty_k
    terms = []
    for i, c in enumerate(problem.columns):
        running = problem.running.get(c.running_key, 0)
        if running == 0:
            terms.append(k * c.price * nu[i])
            continue
        name = column_name(problem, i)
        extra = solver.NumVar(0, solver.infinity(), f"I{name}")
        solver.Add(extra >= k * c.price * (nu[i] - running), name=f"startup{name}")
        terms.append(extra)
    return solver.Sum(terms)
