"""Safe reconfiguration over sequences of demand changes, with real plans of the small fleet.

At every run, every (model, phase) keeps serving capacity (ready + retiring) of at least the
smaller of its served demand and what served it before the run; new instances serve only once
booted; draining ones get no traffic and are gone the run after.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.planner import plan_stack
from solver.reconfigure import FleetState, served_demand, transition
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf

START = datetime(2026, 11, 1, tzinfo=UTC)
BOOT = timedelta(minutes=15)


def plan_for(scales: dict[str, float], previous=None):
    models = {
        m: spec | {"demand": {"requests_per_s": spec["demand"]["requests_per_s"] * scales[m]}}
        for m, spec in SMALL_FLEET["models"].items()
    }
    return plan_stack("test", fleet(models=models), perf().catalog, libraries(), previous)


def run(steps: list[tuple[dict[str, float], timedelta]]):
    """Plan and transition once per (demand scales, time since the last run)."""
    now, plan, state = START, None, None
    out = []
    for scales, gap in steps:
        now += gap
        plan = plan_for(scales, plan)
        state = transition(state, plan, now, BOOT.total_seconds())
        out.append((plan, state))
    return out


def check(history: list[tuple[object, FleetState]]) -> None:
    before: dict[tuple[str, str], float] = {}
    previous: FleetState | None = None
    for plan, state in history:
        serving = state.capacity()
        for job, demand in served_demand(plan).items():  # type: ignore[arg-type]
            floor = min(demand, before.get(job, 0.0))
            assert serving.get(job, 0.0) >= floor - 1e-9, (job, serving, demand, before)
        keys = {i.key for i in plan.instances}  # type: ignore[attr-defined]
        for key, m in state.members.items():
            assert (key in keys) == (m.state in ("starting", "ready"))
            if previous is not None and key in previous.members:
                # nothing that was draining comes back as serving unless the plan wants it
                if previous.members[key].state == "draining":
                    assert key in keys
        if previous is not None:
            for key, m in previous.members.items():
                if m.state == "draining" and key not in keys:
                    assert key not in state.members  # deleted one run after it drained
        before, previous = serving, state


scale = st.sampled_from([0.5, 1.0, 1.5, 2.5])
gap = st.sampled_from([timedelta(minutes=5), timedelta(minutes=30)])


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.lists(st.tuples(scale, scale, gap), min_size=2, max_size=4))
def test_capacity_never_drops_below_demand(steps):
    history = run([({"phi-4": a, "gpt-oss-20b": b}, g) for a, b, g in steps])
    check(history)


def test_up_down_and_shift_between_models():
    """Up, down, and demand moving from one model to the other, runs 30 min apart."""
    half = timedelta(minutes=30)
    history = run(
        [
            ({"phi-4": 1.0, "gpt-oss-20b": 1.0}, half),
            ({"phi-4": 2.5, "gpt-oss-20b": 1.0}, half),  # up
            ({"phi-4": 2.5, "gpt-oss-20b": 1.0}, half),  # starting ones become ready
            ({"phi-4": 0.5, "gpt-oss-20b": 1.0}, half),  # down: surplus drains
            ({"phi-4": 0.5, "gpt-oss-20b": 1.0}, half),  # drained ones are deleted
            ({"phi-4": 0.5, "gpt-oss-20b": 2.5}, half),  # shift to the other model
        ]
    )
    check(history)
    states = [s.by_state() for _, s in history]
    assert states[0]["starting"] and not states[0]["ready"]  # a new fleet boots first
    assert states[1]["starting"] and states[1]["ready"]  # scale-up: old serve, new boot
    assert not states[2]["starting"]
    assert states[3]["draining"] and not states[3]["starting"]  # scale-down: no boot wait
    assert not states[4]["draining"] and not states[4]["retiring"]
    assert history[4][1].members.keys() == {i.key for i in history[4][0].instances}


def test_a_replacement_keeps_the_old_instance_serving_until_it_has_booted():
    """A plan that swaps instances keeps the old ones retiring while the new ones start."""
    first = plan_for({"phi-4": 1.0, "gpt-oss-20b": 1.0})
    state = transition(None, first, START, BOOT.total_seconds())
    state = transition(state, first, START + timedelta(hours=1), BOOT.total_seconds())
    assert set(state.by_state()["ready"]) == set(state.members)
    # The same demand served by other instances (the old ones are not in the new plan).
    swapped = first.model_copy(
        update={
            "instances": [
                i.model_copy(update={"key": i.key + "-new", "index": i.index + 100})
                for i in first.instances
            ]
        }
    )
    later = START + timedelta(hours=2)
    state2 = transition(state, swapped, later, BOOT.total_seconds())
    by = state2.by_state()
    assert len(by["starting"]) == len(first.instances)
    assert set(by["retiring"]) == {i.key for i in first.instances}
    assert state2.capacity() == pytest.approx(state.capacity())
    state3 = transition(state2, swapped, later + BOOT, BOOT.total_seconds())
    assert set(state3.by_state()["draining"]) == {i.key for i in first.instances}
    state4 = transition(state3, swapped, later + 2 * BOOT, BOOT.total_seconds())
    assert set(state4.members) == {i.key for i in swapped.instances}
    assert state4.hourly_cost_usd() == pytest.approx(swapped.hourly_cost_usd)
