"""The fast exact placement search and the paper's ILP agree (issue #3, item 3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.oracles.placement_ilp import place_ilp
from solver.templates.placement_search import place_chain, place_fast


@st.composite
def small_instances(draw):
    """2-4 nodes of up to 3 types, L <= 10, T̂ decreasing in j, zero past a memory limit."""
    n_types = draw(st.integers(1, 3))
    n = draw(st.integers(1, 4))
    labels = tuple(sorted(draw(st.lists(st.integers(0, n_types - 1), min_size=n, max_size=n))))
    n_layers = draw(st.integers(n, 10))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    base = {t: np.sort(rng.uniform(1, 100, n_layers))[::-1] for t in range(n_types)}
    fit = {t: int(rng.integers(1, n_layers + 1)) for t in range(n_types)}
    tables = {}
    for s in range(1, n + 1):
        rows = []
        for lab in labels:
            row = base[lab] / s
            row = np.where(np.arange(1, n_layers + 1) <= fit[lab], row, 0.0)
            rows.append(row)
        tables[s] = np.array(rows)
    return tables, n_layers, labels


@settings(max_examples=200, deadline=None, derandomize=True)
@given(small_instances())
def test_fast_search_matches_ilp_general(inst):
    tables, n_layers, labels = inst
    fast = place_fast(tables, n_layers, labels)
    ilp = place_ilp(tables, n_layers)
    if fast is None or ilp is None:
        assert fast is None and ilp is None
        return
    assert fast.throughput == pytest.approx(ilp.throughput, rel=1e-6)
    assert sum(fast.layers) == n_layers and sorted(k for s in fast.stages for k in s) == list(
        range(len(labels))
    )


@settings(max_examples=200, deadline=None, derandomize=True)
@given(small_instances())
def test_chain_matches_ilp_one_node_per_stage(inst):
    """vLLM mode: every node its own stage (S = nodes)."""
    tables, n_layers, labels = inst
    n = len(labels)
    chain = place_chain(tables[n], n_layers)
    ilp = place_ilp(tables, n_layers, [n], one_node_per_stage=True)
    if chain is None or ilp is None:
        assert chain is None and ilp is None
        return
    assert chain.throughput == pytest.approx(ilp.throughput, rel=1e-6)


def test_worked_example_general():
    """Two nodes, L = 4. Node A: T̂ = 90, 60, 40, 30; node B: 50, 30, 20, 10 (S=2 halves them).
    S=1 (both share all 4 layers): 30 + 10 = 40. S=2, A and B separate: budgets halve every
    T̂; best split A=3 layers (20), B=1 layer (25) -> 20; A=2 (30) B=2 (15) -> 15. Optimum: 40."""
    a = np.array([90.0, 60, 40, 30])
    b = np.array([50.0, 30, 20, 10])
    tables = {1: np.stack([a, b]), 2: np.stack([a, b]) / 2}
    fast = place_fast(tables, 4, (0, 1))
    assert fast.throughput == pytest.approx(40)
    assert fast.stages == ((0, 1),) and fast.layers == (4,)


def test_worked_example_vllmplace_chain():
    """vLLM chain over the same nodes at S=2 budgets: A: 45, 30, 20, 15; B: 25, 15, 10, 5.
    Splits (A,B): (3,1) -> min(20, 25) = 20; (2,2) -> 15; (1,3) -> 10. Optimum 20 at 3+1."""
    a = np.array([90.0, 60, 40, 30]) / 2
    b = np.array([50.0, 30, 20, 10]) / 2
    chain = place_chain(np.stack([a, b]), 4)
    assert chain.throughput == pytest.approx(20) and chain.layers == (3, 1)
