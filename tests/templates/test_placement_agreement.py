"""The fast exact placement search agrees with the paper's ILP, and, with a hop-free last stage,
with a brute force over every placement (issue #3, item 3).

The ILP comparisons solve one SCIP model per stage count, so the default run uses small
instances (at most 3 nodes, 6 layers); the full-size run (4 nodes, 10 layers, 200 examples each)
is marked slow (`scripts/test_slow`).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.oracles.placement_ilp import place_ilp
from solver.serving.placement_search import Placement, Tables, place_chain, place_fast

QUICK = settings(max_examples=25, deadline=None, derandomize=True)
FULL = settings(max_examples=200, deadline=None, derandomize=True)


@st.composite
def small_instances(draw, max_nodes: int = 4, max_layers: int = 10):
    """1-max_nodes nodes of up to 3 types, L <= max_layers, T̂ decreasing in j, zero past a
    memory limit. Also a last-stage table per S: the same T̂ up to a per-type factor in [1, 1.5]
    (the last stage sends no hop, so it is never slower)."""
    n_types = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_nodes))
    labels = tuple(sorted(draw(st.lists(st.integers(0, n_types - 1), min_size=n, max_size=n))))
    n_layers = draw(st.integers(n, max(n, max_layers)))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    base = {t: np.sort(rng.uniform(1, 100, n_layers))[::-1] for t in range(n_types)}
    fit = {t: int(rng.integers(1, n_layers + 1)) for t in range(n_types)}
    gain = {t: float(rng.uniform(1, 1.5)) for t in range(n_types)}
    tables: Tables = {}
    last: Tables = {}
    for s in range(1, n + 1):
        rows = []
        for lab in labels:
            row = base[lab] / s
            row = np.where(np.arange(1, n_layers + 1) <= fit[lab], row, 0.0)
            rows.append(row)
        tables[s] = np.array(rows)
        last[s] = tables[s] * np.array([[gain[lab]] for lab in labels]) if s > 1 else tables[s]
    return tables, last, n_layers, labels


def _check_general(inst) -> None:
    tables, _, n_layers, labels = inst
    fast = place_fast(tables, n_layers, labels)
    ilp = place_ilp(tables, n_layers)
    assert (fast is None) == (ilp is None)
    if fast is not None and ilp is not None:
        assert fast.throughput == pytest.approx(ilp.throughput, rel=1e-6)
        assert sum(fast.layers) == n_layers
        assert sorted(k for s in fast.stages for k in s) == list(range(len(labels)))


def _check_chain(inst) -> None:
    """vLLM mode: every node its own stage (S = nodes)."""
    tables, _, n_layers, labels = inst
    n = len(labels)
    chain = place_chain(tables[n], n_layers)
    ilp = place_ilp(tables, n_layers, [n], one_node_per_stage=True)
    assert (chain is None) == (ilp is None)
    if chain is not None and ilp is not None:
        assert chain.throughput == pytest.approx(ilp.throughput, rel=1e-6)


@QUICK
@given(small_instances(max_nodes=3, max_layers=6))
def test_fast_search_matches_ilp_general(inst):
    _check_general(inst)


@QUICK
@given(small_instances(max_nodes=3, max_layers=6))
def test_chain_matches_ilp_one_node_per_stage(inst):
    _check_chain(inst)


@pytest.mark.slow
@FULL
@given(small_instances())
def test_fast_search_matches_ilp_general_full_size(inst):
    _check_general(inst)


@pytest.mark.slow
@FULL
@given(small_instances())
def test_chain_matches_ilp_one_node_per_stage_full_size(inst):
    _check_chain(inst)


def _partitions(items: list[int]) -> list[list[list[int]]]:
    """Every set partition of `items` (no deduplication)."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in _partitions(rest):
        out.append([[first], *part])
        for i in range(len(part)):
            out.append([*part[:i], [first, *part[i]], *part[i + 1 :]])
    return out


def _brute_force(tables: Tables, last: Tables, n_layers: int, n: int) -> float:
    """Best T over every partition, every group as the last stage, every layer split."""
    best = 0.0
    for part in _partitions(list(range(n))):
        s = len(part)
        if s > n_layers:
            continue
        mono = np.minimum.accumulate(tables[s], axis=1)
        mono_last = np.minimum.accumulate(last[s], axis=1)
        for b in range(s):
            groups = [mono[g].sum(axis=0) for i, g in enumerate(part) if i != b]
            groups.append(mono_last[part[b]].sum(axis=0))
            for cuts in itertools.combinations(range(1, n_layers), s - 1):
                js = np.diff([0, *cuts, n_layers])
                best = max(best, min(float(g[j - 1]) for g, j in zip(groups, js, strict=True)))
    return best


def _value(p: Placement, tables: Tables, last: Tables) -> float:
    """The throughput a placement reaches, its last stage read from the last-stage table."""
    s = len(p.stages)
    values = []
    for i, (members, j) in enumerate(zip(p.stages, p.layers, strict=True)):
        mono = np.minimum.accumulate((last if i == s - 1 else tables)[s], axis=1)
        values.append(float(mono[list(members), j - 1].sum()))
    return min(values)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(small_instances(max_nodes=3, max_layers=7))
def test_fast_search_with_a_hop_free_last_stage_matches_brute_force(inst):
    """With a last-stage table, the search also picks which group ends the pipeline; the
    stages it returns end with that group and reach the throughput it reports."""
    tables, last, n_layers, labels = inst
    fast = place_fast(tables, n_layers, labels, last=last)
    best = _brute_force(tables, last, n_layers, len(labels))
    assert (fast is None) == (best <= 0)
    if fast is not None:
        assert fast.throughput == pytest.approx(best, rel=1e-9)
        assert _value(fast, tables, last) == pytest.approx(fast.throughput, rel=1e-9)
        assert sum(fast.layers) == n_layers
        assert sorted(k for s in fast.stages for k in s) == list(range(len(labels)))


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


def test_worked_example_hop_free_last_stage_goes_last():
    """One stage count (S=2) over A: 45, 30, 20, 15 and B: 25, 15, 10, 5. Without a hop the
    last stage is 1.6x faster. A last: B holds 1 layer (25), A 3 (32) -> 25. B last: A holds
    2 (30), B 2 (24) -> 24, or A 3 (20). So A ends the pipeline, at 25; the stages come back
    in pipeline order, B first."""
    a = np.array([90.0, 60, 40, 30]) / 2
    b = np.array([50.0, 30, 20, 10]) / 2
    tables = {2: np.stack([a, b])}
    fast = place_fast(tables, 4, (0, 1), stage_counts=[2], last={2: tables[2] * 1.6})
    assert fast.throughput == pytest.approx(25)
    assert fast.stages == ((1,), (0,)) and fast.layers == (1, 3)


def test_worked_example_vllmplace_chain():
    """vLLM chain over the same nodes at S=2 budgets: A: 45, 30, 20, 15; B: 25, 15, 10, 5.
    Splits (A,B): (3,1) -> min(20, 25) = 20; (2,2) -> 15; (1,3) -> 10. Optimum 20 at 3+1."""
    a = np.array([90.0, 60, 40, 30]) / 2
    b = np.array([50.0, 30, 20, 10]) / 2
    chain = place_chain(np.stack([a, b]), 4)
    assert chain.throughput == pytest.approx(20) and chain.layers == (3, 1)
