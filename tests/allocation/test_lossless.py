"""The two-stage method loses nothing (paper Sec. 2): on small random instances where every
node combination is enumerated, the production library path (`enumerate_multisets`, each
multiset's placement search in `best_candidate`, `prune_dominated`, `to_template`) plus the
allocation ILP costs the same as the joint integer program that chooses nodes and placements for
all models at once. Only the T̂ rows are the oracle's numbers instead of the performance
model's."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.allocation.problem import Column, Problem
from solver.allocation.solve import solve_allocation
from solver.catalog.market import Market
from solver.catalog.offers import Catalog, GpuType
from solver.oracles.joint_model import JointModel, solve_joint
from solver.serving.candidates import RowSource
from solver.serving.enumeration import (
    best_candidate,
    enumerate_multisets,
    to_template,
)
from solver.serving.pruning import prune_dominated
from solver.stack import AllocationSettings, ModelSpec, Slo

TYPES = ["ax1", "bx1"]  # one-GPU node configs of two made-up GPU types
REGION = ("aws", "r")
N_MAX = 3
MEMORY_GB = {"a": 16.0, "b": 24.0}
# Memory bounds that admit every multiset of at most N_MAX nodes (the joint model may use any):
# weights = the smallest node's memory, rho = N_MAX x the largest / the smallest.
WEIGHT_BYTES = min(MEMORY_GB.values()) * 1e9
RHO = N_MAX * max(MEMORY_GB.values()) / min(MEMORY_GB.values())
CATALOG = Catalog(
    gpus={
        g: GpuType(
            name=g,
            memory_gb=mem,
            memory_mib=int(mem * 1e9 / 2**20),
            memory_bandwidth_gb_s=1000,
            dense_tflops=100,
            bf16=True,
            source="made up for this test",
            retrieved=dt.date(2026, 1, 1),
        )
        for g, mem in MEMORY_GB.items()
    },
    offers=(),
)
SPEC = ModelSpec(slo_ms=Slo(prefill=1000, decode=100), mean_prompt_tokens=1, mean_output_tokens=1)


@dataclass(frozen=True)
class _Card:
    layers: int


@dataclass(frozen=True)
class _TablePerf:
    """What `RowSource` reads from a `PerfModel` besides T̂: the catalog and the layer count."""

    catalog: Catalog
    layers: int

    def card(self, model: str) -> _Card:
        return _Card(self.layers)


class _OracleRows(RowSource):
    """The production `RowSource` with T̂ rows from the joint model's tables; its placement,
    TP and template code is unchanged. The oracle has one table per S for every stage, so the
    last stage's rows are the same ones."""

    def __init__(self, name: str, jm: JointModel) -> None:
        self.jm = jm
        super().__init__(_TablePerf(CATALOG, jm.layers), name, "prefill", SPEC, list(TYPES))

    def _entry(self, node, stages, tp, last):
        row = np.array(self.jm.tables[stages][node], dtype=float)
        return row, np.ones(len(row), dtype=np.int64)


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


def library_columns(models, prices) -> list[Column]:
    """Each model's library, built as `build_libraries` builds it, as allocation columns."""
    multisets = list(enumerate_multisets(TYPES, N_MAX, RHO, WEIGHT_BYTES, CATALOG))
    assert len(multisets) == 2 + 3 + 4  # every multiset of 1, 2 and 3 nodes of two types
    columns = []
    for name, jm in sorted(models.items()):
        rows = _OracleRows(name, jm)
        found = [c for ms in multisets if (c := best_candidate(rows, ms, "general")) is not None]
        kept, _ = prune_dominated(found)
        for cand in kept:
            t = to_template(rows, cand)
            usage = tuple(sorted((c, t.nodes.count(c)) for c in set(t.nodes)))
            price = sum(prices[c] for c in t.nodes)
            columns.append(Column((name, "prefill"), REGION, t, price, usage))
    return columns


def two_stage_cost(models, prices, available) -> float:
    """Build the libraries through enumeration, placement and pruning, then allocate."""
    columns = library_columns(models, prices)
    market = Market(
        {(REGION, c): prices[c] for c in TYPES},
        {(REGION, c): available[c] for c in TYPES},
        {},
        {c: (c, 1) for c in TYPES},
    )
    demand = {(name, "prefill"): float(jm.demand) for name, jm in models.items()}
    problem = Problem(demand, columns, market, AllocationSettings(relative_gap=0))
    sol = solve_allocation(problem)
    if sol.fraction < 1:
        return float("inf")
    return sum(columns[i].price * n for i, n in sol.counts.items())


@settings(max_examples=20, deadline=None, derandomize=True)
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
