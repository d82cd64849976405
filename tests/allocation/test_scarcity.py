"""Scarcity serves what it can: each model gets its own served fraction, max-min fair across
models, then the most served in total, higher priorities first; Coral and the baselines alike.

Hand-built markets (one region, node configs of one GPU, every template one node serving 100
units), so each expected fraction can be counted on one's fingers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from solver.allocation.baselines import homo_solution
from solver.allocation.paper_baselines import paper_baseline
from solver.allocation.problem import Column, Problem, Solution
from solver.allocation.solve import solve_allocation
from solver.catalog.market import Market
from solver.stack import FleetConfig
from tests.allocation_helpers import SMALL_FLEET, fleet

REGION = ("aws", "r")
PHI, GPT = "phi-4", "gpt-oss-20b"


def market_and_columns(
    nodes: dict[str, int], node_of: dict[str, str]
) -> tuple[Market, list[Column]]:
    """`nodes`: node config -> nodes available; `node_of`: model -> the node config all of its
    templates use (one node, 100 units per phase, 1 $/hour)."""
    market = Market(
        price={(REGION, n): 1.0 for n in nodes},
        available={(REGION, n): k for n, k in nodes.items()},
        gpu_pools={},
        gpu_of={n: (f"gpu-{n}", 1) for n in nodes},
    )
    template = SimpleNamespace(throughput=100.0, key="one-node")
    columns = [
        Column((model, phase), REGION, template, 1.0, ((node, 1),))  # type: ignore[arg-type]
        for model, node in sorted(node_of.items())
        for phase in ("decode", "prefill")
    ]
    return market, columns


def stack(priority: dict[str, int] | None = None, **allocation: Any) -> FleetConfig:
    models = {
        m: SMALL_FLEET["models"][m] | {"priority": (priority or {}).get(m, 0)} for m in (PHI, GPT)
    }
    # One region, so colocation changes nothing; off, as cauchy-paper requires.
    base = SMALL_FLEET["allocation"] | {"colocate_phases": False}
    return fleet(models=models, allocation=base | allocation)


def demand_of(units: dict[str, float]) -> dict[tuple[str, str], float]:
    return {(m, ph): d for m, d in units.items() for ph in ("decode", "prefill")}


def by_method(
    f: FleetConfig, market: Market, demand: dict[tuple[str, str], float], columns: list[Column]
) -> dict[str, Solution]:
    priorities = {m: s.priority for m, s in f.models.items()}
    return {
        "coral": solve_allocation(
            Problem(demand, columns, market, f.allocation, priorities=priorities)
        ),
        "homo": homo_solution(f.models, f.allocation, market, demand, columns),
        "cauchy-paper": paper_baseline(
            "cauchy-paper", f.models, f.allocation, market, demand, columns
        )[1],
    }


def instances_of(solution: Solution, columns: list[Column]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i, n in solution.counts.items():
        if n:
            out[columns[i].job[0]] = out.get(columns[i].job[0], 0) + n
    return out


@pytest.mark.parametrize("method", ["coral", "homo", "cauchy-paper"])
def test_a_model_that_cannot_be_served_no_longer_holds_the_others_at_zero(method):
    """gpt-oss-20b's only node config has none available: before, the one uniform fraction
    made every method serve 0% of both models; phi-4 is now served in full."""
    market, columns = market_and_columns({"x": 4, "y": 0}, {PHI: "x", GPT: "y"})
    s = by_method(stack(), market, demand_of({PHI: 100, GPT: 100}), columns)[method]
    assert s.fractions == {PHI: 1.0, GPT: 0.0}
    assert instances_of(s, columns) == {PHI: 2}  # nothing bought that serves nothing


def test_coral_says_which_model_it_cannot_serve_and_why():
    market, columns = market_and_columns({"x": 4, "y": 0}, {PHI: "x", GPT: "y"})
    s = by_method(stack(), market, demand_of({PHI: 100, GPT: 100}), columns)["coral"]
    assert s.binding[0] == f"{GPT}: serves 0.0% of its demand"
    alone = f"{GPT} decode: even with every available node to itself"
    assert any(line.startswith(alone) for line in s.binding)


def test_a_served_fraction_bought_with_room_says_how_much_of_the_demand_it_is():
    """With target_utilization 0.8 the problem's demand is the stack's / 0.8: half of it is
    62.5% of what the stack declared, and the line says both."""
    market, columns = market_and_columns({"x": 4}, {PHI: "x", GPT: "x"})
    s = by_method(stack(target_utilization=0.8), market, demand_of({PHI: 200, GPT: 200}), columns)
    assert s["coral"].binding[:2] == [
        f"{m}: serves 50.0% of its demand / target_utilization 0.8 (62.5% of its demand)"
        for m in sorted((PHI, GPT))
    ]


@pytest.mark.parametrize("method", ["coral", "homo", "cauchy-paper"])
def test_models_short_of_the_same_nodes_share_them_evenly(method):
    """4 nodes, each model needs 2 + 2 for all of its demand: each gets 1 + 1 (50%)."""
    market, columns = market_and_columns({"x": 4}, {PHI: "x", GPT: "x"})
    s = by_method(stack(), market, demand_of({PHI: 200, GPT: 200}), columns)[method]
    assert s.fractions == {PHI: 0.5, GPT: 0.5}


@pytest.mark.parametrize("method", ["coral", "homo", "cauchy-paper"])
def test_after_the_least_fraction_the_rest_goes_to_whoever_can_use_it(method):
    """6 nodes; phi-4 needs 1 + 1, gpt-oss-20b 3 + 3. The least fraction is gpt-oss-20b's
    2 + 2 (66.7%), and phi-4 is not held down to it: it is served in full."""
    market, columns = market_and_columns({"x": 6}, {PHI: "x", GPT: "x"})
    s = by_method(stack(), market, demand_of({PHI: 100, GPT: 300}), columns)[method]
    assert s.fractions[PHI] == 1.0
    assert s.fractions[GPT] == pytest.approx(2 / 3, abs=1e-3) and s.fractions[GPT] <= 2 / 3


@pytest.mark.parametrize("method", ["coral", "homo", "cauchy-paper"])
def test_a_higher_priority_is_served_first(method):
    market, columns = market_and_columns({"x": 4}, {PHI: "x", GPT: "x"})
    f = stack(priority={GPT: 1})
    s = by_method(f, market, demand_of({PHI: 200, GPT: 200}), columns)[method]
    assert s.fractions == {PHI: 0.0, GPT: 1.0}
    assert instances_of(s, columns) == {GPT: 4}


def test_the_budget_is_shared_by_the_same_rule():
    """8 nodes, 4 $/hour: 4 nodes' worth, shared evenly."""
    market, columns = market_and_columns({"x": 8}, {PHI: "x", GPT: "x"})
    f = stack(budget_usd_per_hour=4)
    for method, s in by_method(f, market, demand_of({PHI: 200, GPT: 200}), columns).items():
        assert s.fractions == {PHI: 0.5, GPT: 0.5}, method
        assert sum(s.counts.values()) <= 4, method


def test_when_only_one_model_fits_at_a_time_the_greedy_serves_one():
    """Three models, each needing two whole units at any fraction, and three units: no two fit
    together. `scale_fairly` leaves models out until one is served (it used to hold all three
    at 0, serving nothing)."""
    from solver.allocation.baselines import scale_fairly

    models = ("a", "b", "c")
    demand = {(m, "decode"): 1.0 for m in models}

    def run(d: dict[tuple[str, str], float]) -> Solution:
        wanted = [m for m in models if d[(m, "decode")] > 0]
        fits = 2 * len(wanted) <= 3
        return Solution({}, {m: 1.0 if fits else 0.0 for m in wanted}, None, [])

    fractions, _ = scale_fairly(run, demand, lambda s: s.fraction >= 1, {})
    assert sorted(fractions.values()) == [0.0, 0.0, 1.0]


def test_a_length_bucket_keyed_by_its_own_name_keeps_its_priority():
    """In a routed fleet the buckets are models of their own (``a@b0``); keyed either way,
    they sit in their model's tier."""
    from solver.allocation.problem import priority_tiers

    high, low = frozenset({"a@b0", "a@b1"}), frozenset({"c"})
    names = ["a@b0", "a@b1", "c"]
    assert priority_tiers(names, {"a@b0": 2, "a@b1": 2, "c": 0}) == [high, low]
    assert priority_tiers(names, {"a": 2}) == [high, low]
