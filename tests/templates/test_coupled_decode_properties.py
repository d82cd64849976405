"""Coupled decode pipelines (#19 item 5): `place_coupled` is exact (a brute force over every
ordered partition, layer split and period agrees) and never above the uncoupled `place_fast`.

Synthetic nodes time a stage of j layers at micro-batch b as j x (alpha + beta x b) + gamma
(+ a hop on every stage but the last) and hold KV for kv // (j x S) sequences per micro-batch,
so both tables come from one model, as `solver.serving.paper_mode.coupled_seqs` builds them.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.serving.placement_search import place_coupled, place_fast

QUICK = settings(max_examples=40, deadline=None, derandomize=True)
PERIODS = 6


def stage_ms(node: dict[str, float], j: int, b: np.ndarray, last: bool) -> np.ndarray:
    hop = 0.0 if last else node["hop"]
    return j * (node["alpha"] + node["beta"] * b) + node["gamma"] + hop


def cap(node: dict[str, float], j: int, s: int) -> int:
    return int(node["kv"] // (j * s))


def uncoupled_row(node: dict[str, float], s: int, last: bool, budget: float, n_layers: int):
    """T̂_j: tokens/s at the largest batch within the budget and the KV share (0: none)."""
    out = np.zeros(n_layers)
    for j in range(1, n_layers + 1):
        b = np.arange(1, cap(node, j, s) + 1)
        ok = b[stage_ms(node, j, b, last) <= budget]
        if len(ok):
            out[j - 1] = ok[-1] * 1e3 / float(stage_ms(node, j, ok[-1:], last)[0])
    return out


def seqs_row(node: dict[str, float], s: int, last: bool, periods: np.ndarray, n_layers: int):
    """x_j(p): the most sequences within period p and the KV share."""
    out = np.zeros((len(periods), n_layers))
    for j in range(1, n_layers + 1):
        b = np.arange(1, cap(node, j, s) + 1)
        t = stage_ms(node, j, b, last)
        for i, p in enumerate(periods):
            ok = b[t <= p]
            out[i, j - 1] = ok[-1] if len(ok) else 0
    return out


@st.composite
def pipelines(draw, max_nodes: int = 3, max_layers: int = 5):
    n = draw(st.integers(2, max_nodes))
    n_layers = draw(st.integers(n, max_layers))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    nodes = [
        {
            "alpha": float(rng.uniform(0.5, 3)),
            "beta": float(rng.uniform(0.005, 0.2)),
            "gamma": float(rng.uniform(0.5, 4)),
            "hop": float(rng.uniform(0, 2)),
            "kv": float(rng.uniform(10, 400)),
        }
        for _ in range(n)
    ]
    slo = float(rng.uniform(30, 200))
    up, up_last, sq, sq_last, per = {}, {}, {}, {}, {}
    for s in range(2, n + 1):
        budget = slo / s
        per[s] = budget * np.geomspace(0.1, 1.0, PERIODS)
        up[s] = np.array([uncoupled_row(x, s, False, budget, n_layers) for x in nodes])
        up_last[s] = np.array([uncoupled_row(x, s, True, budget, n_layers) for x in nodes])
        sq[s] = np.stack([seqs_row(x, s, False, per[s], n_layers) for x in nodes], axis=1)
        sq_last[s] = np.stack([seqs_row(x, s, True, per[s], n_layers) for x in nodes], axis=1)
    return up, up_last, sq, sq_last, per, n_layers, tuple(range(n))


def brute_force(sq, sq_last, per, n_layers: int, n: int) -> float:
    """Every ordered partition (stage labels, the last label last), layer split and period."""
    best = 0.0
    for s in sq:
        for assign in itertools.product(range(s), repeat=n):
            if set(assign) != set(range(s)):
                continue
            for split in itertools.product(range(1, n_layers + 1), repeat=s):
                if sum(split) != n_layers:
                    continue
                for i, p in enumerate(per[s]):
                    batch = min(
                        sum(
                            (sq_last if g == s - 1 else sq)[s][i, k, split[g] - 1]
                            for k in range(n)
                            if assign[k] == g
                        )
                        for g in range(s)
                    )
                    best = max(best, batch * 1e3 / p)
    return best


@QUICK
@given(pipelines())
def test_coupled_search_is_exact_and_below_the_uncoupled(inst):
    up, up_last, sq, sq_last, per, n_layers, labels = inst
    found = place_coupled(up, up_last, sq, sq_last, per, n_layers, labels)
    expected = brute_force(sq, sq_last, per, n_layers, len(labels))
    assert (found.throughput if found else 0.0) == pytest.approx(expected, rel=1e-9)
    loose = place_fast(up, n_layers, labels, sorted(up), last=up_last)
    if found is not None:
        assert loose is not None and found.throughput <= loose.throughput * (1 + 1e-9)
        assert sum(found.layers) == n_layers and min(found.layers) >= 1
        assert sorted(k for st_ in found.stages for k in st_) == list(labels)


def test_a_stage_with_little_kv_caps_the_pipeline():
    """Two identical nodes, then the same with one node's KV cut to a tenth: the uncoupled T̂
    barely notices (each stage picks its own batch, the small one at a higher rate per
    sequence), the coupled one falls with the small stage's batch, and stays below it."""
    fast = {"alpha": 1.0, "beta": 0.02, "gamma": 2.0, "hop": 0.5, "kv": 2000.0}
    n_layers, slo = 8, 200.0
    rates = {}
    for name, kv in (("even", 2000.0), ("small", 200.0)):
        nodes = [fast, fast | {"kv": kv}]
        budget = slo / 2
        per = {2: budget * np.geomspace(0.05, 1.0, 64)}
        up = {2: np.array([uncoupled_row(x, 2, False, budget, n_layers) for x in nodes])}
        up_last = {2: np.array([uncoupled_row(x, 2, True, budget, n_layers) for x in nodes])}
        sq = {2: np.stack([seqs_row(x, 2, False, per[2], n_layers) for x in nodes], axis=1)}
        sq_last = {2: np.stack([seqs_row(x, 2, True, per[2], n_layers) for x in nodes], axis=1)}
        coupled = place_coupled(up, up_last, sq, sq_last, per, n_layers, (0, 1))
        loose = place_fast(up, n_layers, (0, 1), [2], last=up_last)
        assert coupled is not None and loose is not None
        rates[name] = (coupled.throughput, loose.throughput)
    (even_c, even_u), (small_c, small_u) = rates["even"], rates["small"]
    assert even_c <= even_u * (1 + 1e-9) and small_c <= small_u * (1 + 1e-9)
    assert even_c >= 0.9 * even_u  # no KV imbalance: coupling costs little (the grid, the hop)
    assert small_c < 0.75 * small_u  # one stage with little KV caps them all
    assert small_c < even_c
