"""The paper's placement ILP (Sec. 4.2), a test oracle for `solver.serving.placement_search`.

Per stage count S: x[s,j] = 1 iff stage s holds j layers, y[s,k] = 1 iff node k serves stage s,
z[s,j,k] = x[s,j] * y[s,k] linearised; maximise T subject to T <= sum_k sum_j T̂_j(k) z[s,j,k]
for every stage s. Solved with OR-Tools SCIP. Exact but slow, so the production path uses the
combinatorial search and a property test checks that both agree.
"""

from __future__ import annotations

import numpy as np
from ortools.linear_solver import pywraplp

from solver.serving.placement_search import Placement, Tables, _monotone


def place_ilp(
    tables: Tables,
    n_layers: int,
    stage_counts: list[int] | None = None,
    one_node_per_stage: bool = False,
) -> Placement | None:
    """The paper's placement ILP, solved once per S with SCIP; the best S wins."""
    best: Placement | None = None
    n = next(iter(tables.values())).shape[0]
    for s in stage_counts or list(range(1, n + 1)):
        if s not in tables or s > n_layers or (one_node_per_stage and s != n):
            continue
        result = _solve_ilp_for_s(_monotone(tables[s]), n_layers, s, one_node_per_stage)
        if result and (best is None or result.throughput > best.throughput * (1 + 1e-9)):
            best = result
    return best


def _solve_ilp_for_s(tab: np.ndarray, n_layers: int, s_count: int, one: bool) -> Placement | None:
    n, big_l = tab.shape
    solver = pywraplp.Solver.CreateSolver("SCIP")
    stages, layers = range(s_count), range(1, big_l + 1)
    x = {(s, j): solver.BoolVar(f"x[{s},{j}]") for s in stages for j in layers}
    y = {(s, k): solver.BoolVar(f"y[{s},{k}]") for s in stages for k in range(n)}
    z = {
        (s, j, k): solver.NumVar(0, 1, f"z[{s},{j},{k}]")
        for s in stages
        for j in layers
        for k in range(n)
        if tab[k, j - 1] > 0
    }
    t = solver.NumVar(0, float(tab.sum()), "T")
    for s in stages:
        solver.Add(sum(x[s, j] for j in layers) == 1)  # one layer count per stage
        if one:
            solver.Add(sum(y[s, k] for k in range(n)) == 1)  # vLLM: one node per stage
        # T <= sum over members k of T̂_j(k), through z = x * y
        solver.Add(t <= sum(float(tab[k, j - 1]) * v for (ss, j, k), v in z.items() if ss == s))
    for k in range(n):
        solver.Add(sum(y[s, k] for s in stages) == 1)  # every node in exactly one stage
        # Symmetry breaking: T ignores stage order, so number the stages by their lowest node;
        # then node k can only sit in stages 0..k.
        for s in stages:
            if s > k:
                solver.Add(y[s, k] == 0)
    solver.Add(sum(j * x[s, j] for s in stages for j in layers) == n_layers)
    for (s, j, k), v in z.items():
        solver.Add(v <= x[s, j])
        solver.Add(v <= y[s, k])
    solver.Maximize(t)
    if solver.Solve() != pywraplp.Solver.OPTIMAL or t.solution_value() <= 1e-9:
        return None
    members = [tuple(k for k in range(n) if y[s, k].solution_value() > 0.5) for s in stages]
    js = [next(j for j in layers if x[s, j].solution_value() > 0.5) for s in stages]
    order = sorted(range(s_count), key=lambda i: members[i])
    return Placement(
        t.solution_value(), tuple(members[i] for i in order), tuple(js[i] for i in order)
    )
