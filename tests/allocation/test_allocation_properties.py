"""Allocation invariants on small real problems (Hypothesis), and brute force on tiny ones."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from solver.allocation.problem import Column, Problem
from solver.allocation.solve import solve_allocation
from solver.catalog.market import Market
from solver.plan.demand import stack_demand
from solver.plan.planner import plan_stack
from solver.plan.validator import validate_plan
from solver.serving.serving_template import ServingTemplate, Stage, StageMember
from solver.stack import AllocationSettings
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf

SLOTS = [
    (region, node)
    for region in ("us-east-2", "ap-northeast-2")
    for node in SMALL_FLEET["node_configs"]
]
demands = st.fixed_dictionaries({"phi-4": st.floats(0.2, 6), "gpt-oss-20b": st.floats(0.2, 8)})
availability = st.lists(st.integers(0, 6), min_size=len(SLOTS), max_size=len(SLOTS))
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def with_inputs(rps: dict[str, float], avail: list[int], price_scale: float = 1.0, **more):
    models = {
        m: spec | {"demand": {"requests_per_s": round(rps[m], 3)}}
        for m, spec in SMALL_FLEET["models"].items()
    }
    cat = perf().catalog
    prices = []
    if price_scale != 1.0:
        for region, node in SLOTS:
            offer = next(o for o in cat.offers if (o.region, o.node) == (region, node))
            prices.append(
                {
                    "cloud": "aws",
                    "region": region,
                    "node": node,
                    "usd_per_hour": offer.price_usd_per_hour * price_scale,
                    "source": "test: scaled catalog price",
                }
            )
    overrides = [
        {"cloud": "aws", "region": r, "node": n, "count": a}
        for (r, n), a in zip(SLOTS, avail, strict=True)
    ]
    return fleet(models=models, availability=overrides, prices=prices, **more)


def solve(f):
    plan = plan_stack("test", f, perf().catalog, libraries())
    return validate_plan(plan, f.plan_scope(), perf().catalog, perf().cards)  # every plan validates


@SETTINGS
@given(demands, availability, st.integers(0, len(SLOTS) - 1), st.integers(1, 4))
def test_more_availability_never_raises_the_optimum(rps, avail, slot, extra):
    assume(any(avail))  # no node available anywhere is an input error (market)
    base = solve(with_inputs(rps, avail))
    more = list(avail)
    more[slot] += extra
    richer = solve(with_inputs(rps, more))
    assert richer.served_fraction >= base.served_fraction - 1e-9
    if base.served_fraction == richer.served_fraction == 1:
        assert richer.solver.objective <= base.solver.objective * (1 + 1e-9)


@SETTINGS
@given(demands, availability, st.floats(0.3, 1.0))
def test_less_demand_never_raises_the_optimum(rps, avail, factor):
    assume(any(avail))  # no node available anywhere is an input error (market)
    full = solve(with_inputs(rps, avail))
    less = solve(with_inputs({m: d * factor for m, d in rps.items()}, avail))
    if full.served_fraction == 1:
        assert less.served_fraction == 1
        assert less.solver.objective <= full.solver.objective * (1 + 1e-9)


@SETTINGS
@given(demands, st.floats(0.25, 4.0))
def test_scaling_every_price_scales_the_optimum(rps, k):
    avail = [8] * len(SLOTS)
    base = solve(with_inputs(rps, avail, 1.0))
    scaled = solve(with_inputs(rps, avail, k))
    assert scaled.solver.objective == pytest.approx(k * base.solver.objective, rel=1e-6)


@SETTINGS
@given(demands, availability)
def test_relabelling_regions_and_models_changes_nothing(rps, avail):
    assume(any(avail))  # no node available anywhere is an input error (market)
    base = solve(with_inputs(rps, avail))
    f = with_inputs(rps, avail)
    swapped = f.model_copy(
        update={
            "regions": list(reversed(f.regions)),
            "models": dict(reversed(list(f.models.items()))),
        }
    )
    other = solve(swapped)
    assert other.served_fraction == pytest.approx(base.served_fraction, abs=1e-4)
    assert other.solver.objective == pytest.approx(base.solver.objective, rel=1e-6)


@SETTINGS
@given(demands, st.floats(0.5, 1.5), st.floats(0.5, 1.5))
def test_an_add_only_replan_never_removes_a_running_instance(rps, phi_scale, gpt_scale):
    from solver.plan_schema import diff_plans

    avail = [6] * len(SLOTS)
    first = solve(with_inputs(rps, avail))
    scaled = {"phi-4": rps["phi-4"] * phi_scale, "gpt-oss-20b": rps["gpt-oss-20b"] * gpt_scale}
    f = with_inputs(scaled, avail, allocation={"add_only": True, "relative_gap": 0.0})
    again = validate_plan(
        plan_stack("test", f, perf().catalog, libraries(), first),
        f.plan_scope(),
        perf().catalog,
        perf().cards,
    )
    assert diff_plans(first, again)["removed"] == []


# ---------------------------------------------------------------- brute force on tiny problems

REGIONS = [("aws", "r1"), ("aws", "r2")]
NODES = {"a": ("ga", 1), "b": ("gb", 1)}


def _template(key: str, nodes: list[str], throughput: float) -> ServingTemplate:
    return ServingTemplate(
        key=key,
        model="m",
        phase="prefill",
        mode="vllm",
        nodes=nodes,
        stages=[Stage(layers=1, members=[StageMember(node=0, gpus=[0], tp=1)])],
        throughput=throughput,
        unit="tokens/s",
        stage_budget_ms=[100.0],
    )


@st.composite
def tiny_problems(draw):
    prices = {(r, n): draw(st.floats(0.5, 5)) for r in REGIONS for n in NODES}
    avail = {(r, n): draw(st.integers(0, 3)) for r in REGIONS for n in NODES}
    shapes = draw(
        st.lists(st.sampled_from([["a"], ["b"], ["a", "b"], ["a", "a"]]), min_size=1, max_size=3)
    )
    columns = []
    for i, nodes in enumerate(shapes):
        t = _template(f"t{i}", nodes, draw(st.floats(1, 10)))
        for r in REGIONS:
            if all(avail[(r, n)] > 0 for n in nodes):
                usage = tuple(sorted((n, nodes.count(n)) for n in set(nodes)))
                columns.append(
                    Column(("m", "prefill"), r, t, sum(prices[(r, n)] for n in nodes), usage)
                )
    market = Market(prices, avail, {}, dict(NODES))
    demand = draw(st.floats(1, 25))
    boot = draw(st.sampled_from([6, 20]))  # K = 0.1 (the paper's) or 1/3 (the default)
    settings_ = AllocationSettings(relative_gap=0.0, boot_minutes=boot)
    return Problem({("m", "prefill"): demand}, columns, market, settings_)


def _within_availability(p: Problem) -> Iterator[tuple[int, ...]]:
    """Every plan of 0-3 instances per column that the nodes available allow."""
    for counts in itertools.product(*[range(0, 4) for _ in p.columns]):
        use: dict = {}
        for c, n in zip(p.columns, counts, strict=True):
            for node, k in c.usage:
                use[(c.region, node)] = use.get((c.region, node), 0) + n * k
        if all(v <= p.market.available[s] for s, v in use.items()):
            yield counts


def _brute_force(p: Problem) -> tuple[float, float]:
    """(best uniform fraction in FRACTION steps, cheapest objective at it) by enumeration."""
    best = (0.0, 0.0)
    demand = p.demand[("m", "prefill")]
    for counts in _within_availability(p):
        supply = sum(c.template.throughput * n for c, n in zip(p.columns, counts, strict=True))
        frac = min(1.0, int(supply / demand * 10_000) / 10_000)
        cost = sum(
            c.price * n * (1 + p.settings.startup_penalty_k)
            for c, n in zip(p.columns, counts, strict=True)
        )
        if frac > best[0] + 1e-12 or (abs(frac - best[0]) <= 1e-12 and cost < best[1]):
            best = (frac, cost)
    return best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tiny_problems())
def test_allocation_matches_brute_force(problem):
    assume(problem.columns)
    frac, cost = _brute_force(problem)
    sol = solve_allocation(problem)
    assert sol.fraction == pytest.approx(frac, abs=1e-4)
    assert sol.report.objective == pytest.approx(cost, rel=1e-6, abs=1e-6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tiny_problems())
def test_served_fraction_is_the_brute_force_maximum_whatever_the_cost_gap(problem):
    """phi is solved to optimality: a loose cost gap (here 50%) must not stop it short."""
    assume(problem.columns)
    loose = replace(problem, settings=problem.settings.model_copy(update={"relative_gap": 0.5}))
    frac, _ = _brute_force(loose)
    assume(frac < 1)  # scarce: the most-served solve runs
    assert solve_allocation(loose).fraction == pytest.approx(frac, abs=1e-4)


@SETTINGS
@given(demands, availability)
def test_coral_is_never_dearer_than_a_restriction_of_itself_at_the_same_capacities(rps, avail):
    """Homo (whole single-config replicas) and Cauchy (single-node templates) plan from
    subsets of Coral's templates at the same capacities, so Coral's ILP never serves less,
    and where all serve everything it never costs more. (The closed loop around the ILP can
    still end dearer: see docs/slo-attainment.md.)"""
    assume(any(avail))
    f = with_inputs(rps, avail)
    coral = plan_stack("test", f, perf().catalog, libraries())
    for method in ("homo", "cauchy"):
        other = plan_stack("test", f, perf().catalog, libraries(), method=method)
        assert coral.served_fraction >= other.served_fraction - 1e-9, method
        if coral.served_fraction == other.served_fraction == 1:
            assert coral.hourly_cost_usd <= other.hourly_cost_usd * (1 + 1e-6) + 1e-6, method


# ------------------------------------------- scarcity across models: max-min, then the most


@st.composite
def tiny_two_model_problems(draw):
    """Two models ("m", "n") on the same tiny market: one template each (a shape, a rate)."""
    prices = {(r, n): draw(st.floats(0.5, 5)) for r in REGIONS for n in NODES}
    avail = {(r, n): draw(st.integers(0, 3)) for r in REGIONS for n in NODES}
    columns, demand = [], {}
    for model in ("m", "n"):
        nodes = draw(st.sampled_from([["a"], ["b"], ["a", "b"]]))
        t = _template(f"{model}0", nodes, draw(st.floats(1, 10)))
        for r in REGIONS:
            if all(avail[(r, x)] > 0 for x in nodes):
                usage = tuple(sorted((x, nodes.count(x)) for x in set(nodes)))
                price = sum(prices[(r, x)] for x in nodes)
                columns.append(Column((model, "prefill"), r, t, price, usage))
        demand[(model, "prefill")] = draw(st.floats(1, 25))
    settings_ = AllocationSettings(relative_gap=0.0, colocate_phases=False)
    return Problem(demand, columns, Market(prices, avail, {}, dict(NODES)), settings_)


def _fair_brute_force(p: Problem) -> tuple[float, float]:
    """(largest least fraction, then largest sum of fractions) over every plan, by enumeration
    (fractions floored to 0.01%, as the solver's steps)."""
    best = (-1.0, -1.0)
    for counts in _within_availability(p):
        fractions = []
        for job, d in sorted(p.demand.items()):
            supply = sum(
                c.template.throughput * k
                for c, k in zip(p.columns, counts, strict=True)
                if c.job == job
            )
            fractions.append(min(1.0, int(supply / d * 10_000) / 10_000))
        best = max(best, (min(fractions), sum(fractions)))
    return best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tiny_two_model_problems())
def test_scarce_fractions_are_max_min_fair_then_the_most_served(problem):
    least, total = _fair_brute_force(problem)
    assume(least < 1)  # scarce
    sol = solve_allocation(problem)
    assert min(sol.fractions.values()) == pytest.approx(least, abs=2e-4)
    assert sum(sol.fractions.values()) == pytest.approx(total, abs=4e-4)
    # what it says it serves, its instances serve
    for job, d in problem.demand.items():
        supply = sum(problem.columns[i].template.throughput * k for i, k in sol.counts.items()
                     if problem.columns[i].job == job)  # fmt: skip
        assert supply >= d * sol.fractions[job[0]] - 1e-6


@cache
def unmixed_libraries() -> dict[tuple[str, str], Any]:
    """The small fleet's libraries with `library.mixing: false` (one GPU type per template)."""
    from solver.serving.library import build_libraries

    f = fleet(library=SMALL_FLEET["library"] | {"mixing": False})
    return {
        (lib.model, lib.phase): lib
        for lib in build_libraries(perf(), f.library_scope(), list(stack_demand(f.models)))
    }


@settings(max_examples=4, deadline=None, derandomize=True)
@given(demands, availability)
def test_coral_after_its_closed_loop_is_never_dearer_than_a_restriction_of_itself(rps, avail):
    """Cauchy (single-config templates) and Coral on a library without mixing (one GPU type
    per template) plan from subsets of Coral's templates, each along its own closed-loop path.
    Where such a plan meets every target Coral's meets, Coral's serves at least as much (max-min
    fair, then in total) and, serving as much, costs no more."""
    from solver.plan.planner import plan_to_targets, served_key

    loop = {"rounds": 2, "planning_minutes": 5, "verify_minutes": 5}
    f = with_inputs(rps, avail, attainment=loop)
    coral = plan_to_targets("t", f, perf(), libraries(), method="coral")
    restricted = {
        "cauchy": plan_to_targets("t", f, perf(), libraries(), method="cauchy"),
        "one GPU type": plan_to_targets("t", f, perf(), unmixed_libraries(), method="coral"),
    }
    tiers = {m: 0 for m in f.models}
    for name, other in restricted.items():
        if {a.model for a in other.below_target()} <= {a.model for a in coral.below_target()}:
            assert served_key(coral, tiers) >= served_key(other, tiers), name
            if served_key(coral, tiers) == served_key(other, tiers):
                assert coral.hourly_cost_usd <= other.hourly_cost_usd + 1e-6, name
