"""The two-stage method loses nothing (paper Sec. 2): on small random instances where every
node combination is enumerated, template library + allocation ILP cost the same as the joint
integer program that chooses nodes and placements for all models at once."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.allocation.problem import Column, Problem
from solver.allocation.solve import solve_allocation
from solver.catalog.market import Market
from solver.oracles.joint_model import JointModel, solve_joint
from solver.stack import AllocationSettings
from solver.templates.placement_search import place_fast
from solver.templates.serving_template import ServingTemplate, Stage, StageMember

TYPES = ["a", "b"]
REGION = ("aws", "r")
N_MAX = 3


@st.composite
def instances(draw):
    prices = {c: draw(st.sampled_from([1.0, 1.5, 2.0, 3.0, 4.0])) for c in TYPES}
    available = {c: draw(st.integers(2, 5)) for c in TYPES}
    models = {}
    for name in draw(st.sampled_from([["m1"], ["m1", "m2"]])):
        layers = draw(st.integers(2, 4))
        rng = np.random.default_rng(draw(st.integers(0, 2**31)))
        fit = {c: int(rng.integers(max(1, layers - 2), layers + 1)) for c in TYPES}
        base = {c: sorted(rng.integers(5, 60, layers).tolist(), reverse=True) for c in TYPES}
        tables = {
            s: {c: [v // s if j < fit[c] else 0 for j, v in enumerate(base[c])] for c in TYPES}
            for s in range(1, N_MAX + 1)
        }
        models[name] = JointModel(layers, draw(st.integers(10, 80)), tables)
    return models, prices, available


def two_stage_cost(models, prices, available) -> float:
    """Enumerate every multiset of at most N_MAX nodes, place it exactly, then allocate."""
    columns = []
    for name, jm in sorted(models.items()):
        for size in range(1, N_MAX + 1):
            for combo in itertools.combinations_with_replacement(TYPES, size):
                tables = {
                    s: np.array([jm.tables[s][c] for c in combo], dtype=float)
                    for s in range(1, size + 1)
                }
                labels = tuple(TYPES.index(c) for c in combo)
                placed = place_fast(tables, jm.layers, labels)
                if placed is None:
                    continue
                t = ServingTemplate(
                    key="+".join(combo),
                    model=name,
                    phase="prefill",
                    mode="general",
                    nodes=list(combo),
                    stages=[Stage(layers=1, members=[StageMember(node=0, gpus=[0], tp=1)])],
                    throughput=placed.throughput,
                    unit="tokens/s",
                    stage_budget_ms=[1.0],
                )
                usage = tuple(sorted((c, combo.count(c)) for c in set(combo)))
                price = sum(prices[c] for c in combo)
                columns.append(Column((name, "prefill"), REGION, t, price, usage))
    market = Market(
        {(REGION, c): prices[c] for c in TYPES},
        {(REGION, c): available[c] for c in TYPES},
        {},
        {c: (c, 1) for c in TYPES},
    )
    demand = {(name, "prefill"): float(jm.demand) for name, jm in models.items()}
    problem = Problem(
        demand, columns, market, AllocationSettings(startup_penalty_k=0, relative_gap=0)
    )
    sol = solve_allocation(problem)
    if sol.fraction < 1:
        return float("inf")
    return sum(columns[i].price * n for i, n in sol.counts.items())


@settings(max_examples=30, deadline=None, derandomize=True)
@given(instances())
def test_two_stage_costs_the_same_as_the_joint_optimum(inst):
    models, prices, available = inst
    joint = solve_joint(models, prices, available, N_MAX, max_replicas=sum(available.values()))
    assert joint.status in ("optimal", "infeasible")
    two = two_stage_cost(models, prices, available)
    if joint.status == "infeasible":
        assert two == float("inf")
    else:
        assert two == pytest.approx(joint.cost, abs=1e-6)
