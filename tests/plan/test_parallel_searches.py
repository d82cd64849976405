"""The closed loop's restricted searches in worker processes (`plan_to_targets` with workers > 1)
plan exactly as one after the other, pass on their progress, and end with the plan."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest

from solver.errors import AllocationError
from solver.plan import planner
from solver.plan.planner import plan_to_targets
from solver.plan_schema import Plan
from solver.stack import FleetConfig
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf

LOOP = {"rounds": 2, "planning_minutes": 5, "verify_minutes": 5}
STACK = fleet(attainment=LOOP)


def what_it_buys(plan: Plan) -> dict[str, Any]:
    """A plan less its solve times (which differ run to run)."""
    return plan.model_dump(exclude={"solver"})


def planned(
    workers: int, stack: FleetConfig = STACK
) -> tuple[Plan, list[str], list[tuple[float, list[Any]]]]:
    lines: list[str] = []
    solves: list[tuple[float, list[Any]]] = []
    plan = plan_to_targets(
        "t",
        stack,
        perf(),
        libraries(),
        on_round=lines.append,
        workers=workers,
        on_solve=lambda p, _: solves.append((p.hourly_cost_usd, p.instances)),
    )
    return plan, lines, solves


def test_restricted_searches_in_workers_plan_as_one_after_the_other() -> None:
    one, one_lines, one_solves = planned(1)
    two, two_lines, two_solves = planned(2)
    assert planner._restrictions(libraries())  # there is something to run elsewhere
    assert what_it_buys(two) == what_it_buys(one)
    assert two_solves == one_solves  # every solve, in search order
    assert two_lines == one_lines  # every progress line, in the same order
    assert any(line.startswith("single config search, round 0") for line in two_lines)


def test_with_spot_the_on_demand_search_runs_here_and_the_spot_searches_in_workers() -> None:
    """With spot allowed the on-demand search comes first (in this process) and the mixed
    search with spot columns runs in a worker: the same plan, solves and lines either way."""
    spot = {"enabled": True}
    stack = fleet(
        attainment={"rounds": 1, "planning_minutes": 3, "verify_minutes": 3},
        allocation=SMALL_FLEET["allocation"] | {"spot": spot},
    )
    one, one_lines, one_solves = planned(1, stack)
    two, two_lines, two_solves = planned(2, stack)
    assert what_it_buys(two) == what_it_buys(one)
    assert two_solves == one_solves and two_lines == one_lines
    assert any(line.startswith("mixed search, round 0") for line in two_lines)
    assert any(line.startswith("single config, on-demand search, round 0") for line in two_lines)


def test_a_restricted_search_that_fails_is_reported_and_the_others_plan(monkeypatch) -> None:
    solve = planner.plan_stack

    def failing(*args: Any, **kwargs: Any) -> Plan:
        if kwargs.get("restriction") == "single config":
            raise AllocationError("the cost solve ended infeasible", "infeasible", "test")
        return solve(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_stack", failing)  # before the fork: workers see it
    plan, lines, _ = planned(2)
    assert any(line.startswith("single config search, failed:") for line in lines)
    assert "single config" not in (plan.closed_loop_stop or "")
    assert plan.instances


def test_an_error_in_the_mixed_search_ends_the_workers(monkeypatch) -> None:
    solve = planner.plan_stack

    def slow_or_broken(*args: Any, **kwargs: Any) -> Plan:
        if kwargs.get("restriction") is None:
            raise RuntimeError("mixed search broke")
        time.sleep(120)  # a restricted search still running
        return solve(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_stack", slow_or_broken)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="mixed search broke"):
        planned(2)
    assert time.perf_counter() - start < 60
    assert multiprocessing.active_children() == []
