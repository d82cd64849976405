"""Homo and Cauchy-like respect every constraint Coral does: availability, GPU pools, colocated
phases (`colocate_phases`) and the budget, or say which one they cannot meet."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from coral_iac.cli.app import app
from solver.allocation.baselines import homo_solution
from solver.allocation.problem import Column
from solver.catalog.market import Market
from solver.plan.planner import plan_stack
from solver.plan.validator import validate_plan
from solver.plan_schema import Plan
from solver.stack import FleetConfig
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf, rps_needing

REPO = Path(__file__).resolve().parents[2]
A, B = ("aws", "cheap"), ("aws", "dear")


def hand_built(
    available_a: int, available_b: int, demand: float, **allocation: Any
) -> tuple[FleetConfig, Market, dict[tuple[str, str], float], list[Column]]:
    """One model, one node config `x` (1 GPU each) in two regions: `cheap` at 1 $/h and `dear`
    at 2 $/h. Each phase has one template: one node of x serving 100 units."""
    f = fleet(models={"phi-4": SMALL_FLEET["models"]["phi-4"]}, allocation=allocation)
    market = Market(
        price={(A, "x"): 1.0, (B, "x"): 2.0},
        available={(A, "x"): available_a, (B, "x"): available_b},
        gpu_pools={},
        gpu_of={"x": ("g", 1)},
    )
    columns = [
        Column(
            ("phi-4", phase),
            region,
            SimpleNamespace(throughput=100.0, key="x"),  # type: ignore[arg-type]
            market.price[(region, "x")],
            (("x", 1),),
        )
        for phase in ("decode", "prefill")
        for region in (A, B)
    ]
    return f, market, {("phi-4", "decode"): demand, ("phi-4", "prefill"): demand}, columns


def placed(columns: list[Column], counts: dict[int, int]) -> dict[str, set[tuple[str, str]]]:
    """phase -> regions it runs in."""
    out: dict[str, set[tuple[str, str]]] = {}
    for i, n in counts.items():
        if n:
            out.setdefault(columns[i].job[1], set()).add(columns[i].region)
    return out


def cost(columns: list[Column], counts: dict[int, int]) -> float:
    return sum(columns[i].price * n for i, n in counts.items())


def test_homo_keeps_both_phases_in_one_region_when_the_cheap_one_fits_only_one():
    """One node in the cheap region: the old greedy gave it to decode and sent prefill to the
    dear region (an invalid plan under colocate_phases). Now both go to the dear region."""
    f, market, demand, columns = hand_built(1, 2, 100)
    s = homo_solution(f.models, f.allocation, market, demand, columns)
    assert s.fraction == 1 and s.binding == []
    assert placed(columns, s.counts) == {"decode": {B}, "prefill": {B}}
    assert cost(columns, s.counts) == pytest.approx(4.0)
    # the paper's formulation (no colocation) still splits them, the cheaper way
    free_fleet = hand_built(1, 2, 100, colocate_phases=False)[0]
    free = homo_solution(free_fleet.models, free_fleet.allocation, market, demand, columns)
    assert placed(columns, free.counts) == {"decode": {A}, "prefill": {B}}
    assert cost(columns, free.counts) == pytest.approx(3.0)


def test_homo_names_colocation_when_no_region_fits_both_phases():
    f, market, demand, columns = hand_built(1, 1, 100)
    s = homo_solution(f.models, f.allocation, market, demand, columns)
    assert s.fraction == 0 and s.counts == {}
    assert any("colocate_phases needs its prefill and decode in one region" in b for b in s.binding)


def test_homo_under_a_budget_serves_the_largest_fraction_it_can_afford():
    """300 units per phase need 3 + 3 nodes in the dear region (12 $/h). 8 $/h buys 2 + 2:
    2/3 of demand."""
    f, market, demand, columns = hand_built(0, 10, 300, budget_usd_per_hour=8)
    s = homo_solution(f.models, f.allocation, market, demand, columns)
    assert s.fraction == pytest.approx(2 / 3, abs=1e-3) and s.fraction <= 2 / 3
    assert cost(columns, s.counts) <= 8
    assert any(b.startswith("budget: 8.0 $/hour lets Homo serve 66.") for b in s.binding)
    assert any("needs 12.00 $/hour" in b for b in s.binding)


def test_homo_serves_nothing_when_one_pair_costs_more_than_the_budget():
    f, market, demand, columns = hand_built(0, 10, 300, budget_usd_per_hour=3)
    s = homo_solution(f.models, f.allocation, market, demand, columns)
    assert s.fraction == 0 and s.counts == {}
    assert any("raise coral:fleet.allocation.budget_usd_per_hour" in b for b in s.binding)


def test_homo_under_a_budget_falls_back_to_a_config_it_can_afford():
    """Config `big` serves 300 units per node at 5 $/h (the most efficient), `x` 100 at 1 $/h.
    A 6 $/h budget pays for no pair of `big`, so Homo must fall back to `x`: 3 + 3 nodes serve
    all 300 units per phase. (It used to buy nothing: the best config's pair did not fit.)"""
    f, market, demand, columns = hand_built(10, 0, 300, budget_usd_per_hour=6)
    big = Market(
        {**market.price, (A, "big"): 5.0},
        {**market.available, (A, "big"): 10},
        {},
        {**market.gpu_of, "big": ("g", 1)},
    )
    columns += [
        Column(("phi-4", ph), A, SimpleNamespace(throughput=300.0, key="big"), 5.0, (("big", 1),))  # type: ignore[arg-type]
        for ph in ("decode", "prefill")
    ]
    s = homo_solution(f.models, f.allocation, big, demand, columns)
    assert s.fraction == pytest.approx(1.0) and s.binding == []
    assert cost(columns, s.counts) == pytest.approx(6.0)
    assert {columns[i].usage[0][0] for i in s.counts} == {"x"}


def test_homo_leaves_one_model_out_when_whole_instances_crowd_each_other_out():
    """Three nodes for two models that each need one prefill and one decode instance of one
    node: either fits alone, both at any fraction need four nodes. Homo serves one in full and
    leaves the other out (it used to hold both at 0 and serve nothing)."""
    f = fleet(models=SMALL_FLEET["models"])
    market = Market({(A, "x"): 1.0}, {(A, "x"): 3}, {}, {"x": ("g", 1)})
    models = sorted(SMALL_FLEET["models"])
    columns = [
        Column((m, ph), A, SimpleNamespace(throughput=100.0, key="x"), 1.0, (("x", 1),))  # type: ignore[arg-type]
        for m in models
        for ph in ("decode", "prefill")
    ]
    demand = {(m, ph): 100.0 for m in models for ph in ("decode", "prefill")}
    s = homo_solution(f.models, f.allocation, market, demand, columns)
    assert len(models) == 2 and sorted(s.fractions.values()) == [0.0, 1.0]
    assert cost(columns, s.counts) == pytest.approx(2.0)


def test_homo_names_the_gpu_pool_that_stops_it():
    f, market, demand, columns = hand_built(5, 5, 300)
    pooled = Market(market.price, market.available, {(A, "g"): 2, (B, "g"): 2}, market.gpu_of)
    s = homo_solution(f.models, f.allocation, pooled, demand, columns)
    assert 0 < s.fraction < 1
    assert any("GPU pools short at aws:cheap g (0 of 2 GPUs left)" in b for b in s.binding)


# The small real stack, one node of each config per region: the old greedy split both models'
# phases across the two regions here (4 "only prefill/decode in" problems).
ONE_EACH = [
    {"cloud": "aws", "region": r, "node": n, "count": 1}
    for r in ("us-east-2", "ap-northeast-2")
    for n in SMALL_FLEET["node_configs"]
]


def with_rps(phi: float, gpt: float, **more: Any) -> FleetConfig:
    models = {
        "phi-4": SMALL_FLEET["models"]["phi-4"] | {"demand": {"requests_per_s": phi}},
        "gpt-oss-20b": SMALL_FLEET["models"]["gpt-oss-20b"] | {"demand": {"requests_per_s": gpt}},
    }
    return fleet(models=models, **more)


def solve(f: FleetConfig, method: str) -> Plan:
    p = plan_stack("test", f, perf().catalog, libraries(), method=method)  # type: ignore[arg-type]
    return validate_plan(p, f.plan_scope(), perf().catalog, perf().cards)


def regions_by_phase(plan: Plan) -> dict[str, dict[str, set[str]]]:
    out: dict[str, dict[str, set[str]]] = {}
    for i in plan.instances:
        out.setdefault(i.model, {}).setdefault(i.phase, set()).add(i.region)
    return out


@pytest.mark.parametrize("method", ["homo", "cauchy"])
@pytest.mark.parametrize("rps", [(1, 1), (3, 4)])
def test_baselines_colocate_phases_on_scarce_availability(method, rps):
    p = solve(with_rps(*rps, availability=ONE_EACH), method)  # validates, colocation included
    assert p.served_fraction == 1 and p.instances
    for model, phases in regions_by_phase(p).items():
        assert phases["prefill"] == phases["decode"], model


@pytest.mark.parametrize("method", ["homo", "cauchy"])
def test_baselines_stay_within_the_budget_and_say_so(method):
    """A budget halfway between the baseline's plan for 1% of demand (what serving any of it
    costs: one instance per job) and its plan for all of it. phi-4 decode needs 2.6 l40sx1
    instances, its only template, so the full plan costs more than the 1% one."""
    phi, gpt = rps_needing("phi-4", "decode", "l40sx1", 2.6), 8
    free = solve(with_rps(phi, gpt), method)
    least = solve(with_rps(phi / 100, gpt / 100), method)
    budget = round((least.hourly_cost_usd + free.hourly_cost_usd) / 2, 2)
    assert least.hourly_cost_usd < budget < free.hourly_cost_usd
    p = solve(with_rps(phi, gpt, allocation={"budget_usd_per_hour": budget}), method)
    assert 0 < p.served_fraction < 1
    assert p.hourly_cost_usd <= budget + 1e-6
    assert any(line.startswith("budget") for line in p.binding)


def test_cli_plan_homo_on_a_committed_two_region_stack(tmp_path, monkeypatch):
    """staging: AWS and GCP regions, colocated phases, a budget, scarce l40sx4 nodes."""
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(
        app,
        ["plan", "--stack", "staging", "--baseline", "homo", "--library", str(tmp_path), "--json"],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["method"] == "homo" and data["served_fraction"] == 1
    plan = Plan.model_validate({k: v for k, v in data.items() if k in Plan.model_fields})
    for model, phases in regions_by_phase(plan).items():
        assert phases.get("prefill") == phases.get("decode"), model
    assert plan.hourly_cost_usd <= 60
