"""The paper's joint problem (Sec. 3) as one integer program, for small instances only.

It chooses, at once, how many replicas each model gets, which nodes each replica rents, how
many pipeline stages it has, how many layers each stage holds and which nodes serve each stage
(data parallel inside a stage). Nothing is enumerated ahead of time. Its only use is to check
that the two-stage method (template library, then allocation) loses nothing: on instances where
every node combination is enumerated, both must cost the same.

Formulation (OR-Tools CP-SAT, integer throughputs). Replica slot r of model m has:

- S_r in 0..S_max stages (0 = unused), with b[r, s] <=> s <= S_r;
- l[r, s] layers per stage, summing to L_m when used;
- n[r, s, c] nodes of type c in stage s, at most N_max per replica.

Each node of type c in stage s delivers t[r, s, c] = That_m[S_r][c][l[r, s]] (an element
constraint). The stage delivers the sum of n[r, s, c] * t[r, s, c]. The replica delivers
T_r <= every used stage; slots are ordered by T_r (symmetry breaking). Per model, the sum of T_r is at least its demand; availability holds
per node type. Objective: the price of every rented node.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ortools.sat.python import cp_model


@dataclass(frozen=True)
class JointModel:
    """One model: layers, demand and That[S][c][j-1] (integer tokens/s, non-increasing in j)."""

    layers: int
    demand: int
    tables: dict[int, dict[str, list[int]]]  # S -> node type -> throughput at j = 1..layers


@dataclass(frozen=True)
class JointResult:
    cost: float
    status: str
    replicas: dict[str, list[tuple[int, ...]]]  # model -> per replica: nodes per type (sorted)


def solve_joint(
    models: dict[str, JointModel],
    prices: dict[str, float],
    available: dict[str, int],
    n_max: int,
    max_replicas: int,
    price_scale: int = 10_000,
    time_limit_s: float = 60.0,
) -> JointResult:
    """Cheapest joint allocation and placement; `max_replicas` slots per model."""
    types = sorted(prices)
    m = cp_model.CpModel()
    used_by_type: dict[str, list[cp_model.IntVar]] = {c: [] for c in types}
    slots: dict[str, list[list[list[cp_model.IntVar]]]] = {}
    for name, jm in sorted(models.items()):
        s_max = max(jm.tables)
        replica_tput = []
        slots[name] = []
        for r in range(max_replicas):
            stages = m.new_int_var(0, s_max, f"S[{name},{r}]")
            t_rep = m.new_int_var(
                0,
                max(max(v) for t in jm.tables.values() for v in t.values()) * n_max,
                f"T[{name},{r}]",
            )
            replica_tput.append(t_rep)
            nodes_r: list[list[cp_model.IntVar]] = []
            layer_vars = []
            for s in range(1, s_max + 1):
                active = m.new_bool_var(f"b[{name},{r},{s}]")
                m.add(stages >= s).only_enforce_if(active)
                m.add(stages <= s - 1).only_enforce_if(active.negated())
                layers = m.new_int_var(0, jm.layers, f"l[{name},{r},{s}]")
                m.add(layers >= 1).only_enforce_if(active)
                m.add(layers == 0).only_enforce_if(active.negated())
                layer_vars.append(layers)
                stage_terms = []
                n_stage = []
                for c in types:
                    n = m.new_int_var(0, n_max, f"n[{name},{r},{s},{c}]")
                    m.add(n == 0).only_enforce_if(active.negated())
                    n_stage.append(n)
                    used_by_type[c].append(n)
                    # t = That[S][c][layers]: index S * (L + 1) + layers into a flat table.
                    flat = [0] * ((s_max + 1) * (jm.layers + 1))
                    for big_s, table in jm.tables.items():
                        for j, v in enumerate(table[c], start=1):
                            flat[big_s * (jm.layers + 1) + j] = v
                    index = m.new_int_var(0, len(flat) - 1, "")
                    m.add(index == stages * (jm.layers + 1) + layers)
                    t = m.new_int_var(0, max(flat), "")
                    m.add_element(index, flat, t)
                    prod = m.new_int_var(0, max(flat) * n_max, "")
                    m.add_multiplication_equality(prod, [n, t])
                    stage_terms.append(prod)
                m.add(sum(n_stage) >= 1).only_enforce_if(active)
                m.add(t_rep <= sum(stage_terms)).only_enforce_if(active)
                nodes_r.append(n_stage)
            used = _is_used(m, stages)
            m.add(sum(layer_vars) == jm.layers).only_enforce_if(used)
            m.add(t_rep == 0).only_enforce_if(used.negated())
            m.add(sum(n for stage in nodes_r for n in stage) <= n_max)
            slots[name].append(nodes_r)
        m.add(sum(replica_tput) >= jm.demand)
        for a, b in itertools.pairwise(replica_tput):  # slots are interchangeable: order them
            m.add(b <= a)
    for c in types:
        m.add(sum(used_by_type[c]) <= available[c])
    m.minimize(sum(round(prices[c] * price_scale) * sum(used_by_type[c]) for c in types))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 2
    solver.parameters.random_seed = 0
    status = solver.solve(m)
    names = {
        cp_model.OPTIMAL: "optimal",
        cp_model.FEASIBLE: "feasible",
        cp_model.INFEASIBLE: "infeasible",
    }
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return JointResult(float("inf"), names.get(status, "unknown"), {})
    replicas = {
        name: sorted(
            tuple(sum(solver.value(stage[i]) for stage in rep) for i in range(len(types)))
            for rep in reps
            if any(solver.value(n) for stage in rep for n in stage)
        )
        for name, reps in slots.items()
    }
    cost = sum(prices[c] * sum(solver.value(n) for n in used_by_type[c]) for c in types)
    return JointResult(cost, names[status], replicas)


def _is_used(m: cp_model.CpModel, stages: cp_model.IntVar) -> cp_model.IntVar:
    used = m.new_bool_var("")
    m.add(stages >= 1).only_enforce_if(used)
    m.add(stages == 0).only_enforce_if(used.negated())
    return used
