"""Column reduction and the part-by-part solve never change the optimum (brute force, Hypothesis).

Tiny problems with two jobs sharing two regions' nodes, so the parts' plans sometimes do not fit
together and the joint solve (on reduced columns) runs.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from solver.allocation.decompose import objective_of
from solver.allocation.problem import Column, Problem
from solver.allocation.reduction import fractional_bounds, reduce_columns, undominated
from solver.allocation.solve import solve_allocation
from solver.catalog.market import Market
from solver.serving.serving_template import ServingTemplate, Stage, StageMember
from solver.stack import AllocationSettings

REGIONS = [("aws", "r1"), ("aws", "r2")]
NODES = {"a": ("ga", 1), "b": ("gb", 1)}
JOBS = [("m", "prefill"), ("m", "decode")]
SHAPES = [["a"], ["b"], ["a", "b"], ["a", "a"], ["b", "b"]]


def _template(job, key: str, nodes: list[str], throughput: float) -> ServingTemplate:
    return ServingTemplate(
        key=key,
        model=job[0],
        phase=job[1],
        mode="vllm",
        nodes=nodes,
        stages=[Stage(layers=1, members=[StageMember(node=0, gpus=[0], tp=1)])],
        throughput=throughput,
        unit="tokens/s",
        stage_budget_ms=[100.0],
    )


@st.composite
def two_job_problems(draw):
    prices = {(r, n): draw(st.floats(0.5, 5)) for r in REGIONS for n in NODES}
    avail = {(r, n): draw(st.integers(1, 3)) for r in REGIONS for n in NODES}
    columns = []
    for job in JOBS:
        shapes = draw(st.lists(st.sampled_from(SHAPES), min_size=1, max_size=2, unique_by=str))
        for i, nodes in enumerate(shapes):
            t = _template(job, f"t{i}", nodes, draw(st.floats(1, 10)))
            usage = tuple(sorted((n, nodes.count(n)) for n in set(nodes)))
            for r in REGIONS:
                price = sum(prices[(r, n)] for n in nodes)
                columns.append(Column(job, r, t, price, usage))
    demand = {job: draw(st.floats(1, 18)) for job in JOBS}
    colocate = draw(st.booleans())
    settings_ = AllocationSettings(relative_gap=0.0, boot_minutes=6, colocate_phases=colocate)
    # GPU pools on some (region, GPU): small ones imply availability rows (dominance drops them).
    pools = {
        (r, gpu): draw(st.integers(1, 4))
        for r in REGIONS
        for gpu, _ in NODES.values()
        if draw(st.booleans())
    }
    return Problem(demand, columns, Market(prices, avail, pools, dict(NODES)), settings_)


def _plans(p: Problem, columns: list[int]):
    """Every plan on `columns` (0..3 instances each) meeting all demand and availability."""
    for counts in itertools.product(range(4), repeat=len(columns)):
        plan = {i: n for i, n in zip(columns, counts, strict=True) if n}
        use: dict = {}
        have = dict.fromkeys(p.demand, 0.0)
        regions: dict = {}
        for i, n in plan.items():
            c = p.columns[i]
            have[c.job] += n * c.template.throughput
            regions.setdefault(c.job[1], set()).add(c.region)
            for node, k in c.usage:
                use[(c.region, node)] = use.get((c.region, node), 0) + n * k
        if any(v > p.market.available[s] for s, v in use.items()):
            continue
        gpus: dict = {}
        for (region, node), v in use.items():
            gpu, per_node = p.market.gpu_of[node]
            gpus[(region, gpu)] = gpus.get((region, gpu), 0) + v * per_node
        if any(v > p.market.gpu_pools.get(pool, v) for pool, v in gpus.items()):
            continue
        if any(have[j] < d - 1e-9 for j, d in p.demand.items()):
            continue
        if p.settings.colocate_phases and regions.get("prefill") != regions.get("decode"):
            continue
        yield plan


def _optimum(p: Problem, columns: list[int]) -> float:
    return min((objective_of(p, plan) for plan in _plans(p, columns)), default=math.inf)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(two_job_problems(), st.data())
def test_reduction_never_changes_the_optimum(problem, data):
    every = list(range(len(problem.columns)))
    plans = list(_plans(problem, every))
    assume(plans)
    best = min(objective_of(problem, plan) for plan in plans)
    upper = objective_of(problem, data.draw(st.sampled_from(plans)))  # any feasible plan
    floor = fractional_bounds(problem, 1.0)
    assert sum(floor.values()) <= best + 1e-9  # a bound indeed
    kept = reduce_columns(problem, upper)
    assert _optimum(problem, kept) == pytest.approx(best, rel=1e-9)
    if problem.settings.colocate_phases:
        return  # the two jobs form one part; its bound is the joint optimum itself
    # With each job's exact optimum alone as its bound (what a part's solve proves).
    alone = {
        (job,): _optimum(
            Problem({job: problem.demand[job]}, problem.columns, problem.market, problem.settings),
            [i for i, c in enumerate(problem.columns) if c.job == job],
        )
        for job in JOBS
    }
    kept = reduce_columns(problem, upper, alone)
    assert _optimum(problem, kept) == pytest.approx(best, rel=1e-9)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(two_job_problems())
def test_the_part_by_part_solve_finds_the_joint_optimum(problem):
    best = _optimum(problem, list(range(len(problem.columns))))
    assume(math.isfinite(best))
    sol = solve_allocation(problem)
    assert sol.fraction == 1
    assert sol.report is not None and sol.report.objective == pytest.approx(best, rel=1e-6)
    assert objective_of(problem, sol.counts) == pytest.approx(best, rel=1e-6)
    assert sol.report.gap is not None and sol.report.gap <= 1e-6


@settings(max_examples=25, deadline=None, derandomize=True)
@given(two_job_problems())
def test_dominance_never_changes_the_optimum(problem):
    every = list(range(len(problem.columns)))
    best = _optimum(problem, every)
    assume(math.isfinite(best))
    kept = undominated(problem)
    assert _optimum(problem, kept) == pytest.approx(best, rel=1e-9)
    # Without prices (the most-served solve): every plan of the full problem has one on the
    # kept columns serving at least as much; with all demand servable, one still exists.
    assert math.isfinite(_optimum(problem, undominated(problem, by_price=False)))
