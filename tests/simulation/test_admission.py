"""Admission control's rule: what the plan admits per model, which requests a stream keeps, and
the simulator shedding the rest. The same rule against the real HAProxy:
tests/deploy/test_gateway_admission.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.performance.default_model import load_perf_model
from solver.simulation.admission import (
    PERIOD_S,
    admission_limits,
    admit,
    capacity_rps,
    demand_peak,
)
from solver.simulation.simulator import simulate
from solver.simulation.traces import WorkloadShape, generate_trace
from solver.stack import ModelSpec
from tests.deploy.test_gateway import DISAGGREGATED, make_plan
from tests.factories import PHI4_SPEC


def spec(rps: float, prompt: float = 1020, output: float = 129) -> ModelSpec:
    return ModelSpec.model_validate(
        {
            **PHI4_SPEC,
            "mean_prompt_tokens": prompt,
            "mean_output_tokens": output,
            "demand": {"requests_per_s": rps},
        }
    )


AGG = [("phi-4", "aggregated", "l40sx1", "l40sx1", 2.0, 3)]


def test_a_fully_served_model_admits_its_capacity_whatever_the_stated_demand():
    plan = make_plan(AGG)
    low = admission_limits(plan, {"phi-4": spec(1.0)})["phi-4"]
    mid = admission_limits(plan, {"phi-4": spec(3.0)})["phi-4"]
    assert low.basis == mid.basis == "capacity at target"
    assert low.requests_per_s == mid.requests_per_s == 6.0  # three instances of 2 requests/s
    assert capacity_rps(plan, {"phi-4": spec(1.0)}) == capacity_rps(plan, {"phi-4": spec(5.5)})


def test_a_fully_served_model_admits_the_busy_minutes_its_demand_brings():
    """Capacity 6/s against a demand of 5.5/s: the demand's own minutes go above 360 requests
    (Poisson-like at 330 a minute), and the gateway admits them rather than shed traffic the
    instances were sized for; one minute in a hundred of the demand goes past the count."""
    plan = make_plan(AGG)
    models = {"phi-4": spec(5.5)}
    limit = admission_limits(plan, models)["phi-4"]
    assert limit.basis == "demand's busy minutes" and limit.count > 6 * PERIOD_S
    assert limit.count == demand_peak(models, "phi-4")
    demand = generate_trace(5.5, 7_200, 1020, 129, seed=11)
    assert (1 - admit(demand.arrival_s, limit).mean()) < 0.01
    # A scarce plan's window is always full: it admits its share, no busy-minute allowance.
    scarce = plan.model_copy(update={"served_fraction": 0.5, "served_fractions": {"phi-4": 0.5}})
    assert admission_limits(scarce, models)["phi-4"].count == int(0.5 * 5.5 * PERIOD_S)
    # Planned with room (target_utilization 0.8, room 1.25), its served fraction is of 1.25x
    # the demand: half of that is 62.5% of the demand, and 80% of it the whole demand.
    assert admission_limits(scarce, models, room=1.25)["phi-4"].count == int(
        0.625 * 5.5 * PERIOD_S
    )
    most = plan.model_copy(update={"served_fraction": 0.8, "served_fractions": {"phi-4": 0.8}})
    assert admission_limits(most, models, room=1.25)["phi-4"] == limit


def test_a_scarce_model_admits_its_served_share_of_the_demand():
    plan = make_plan(AGG).model_copy(
        update={"served_fraction": 0.25, "served_fractions": {"phi-4": 0.25}}
    )
    limit = admission_limits(plan, {"phi-4": spec(20.0)})["phi-4"]
    assert limit.basis == "served share"
    assert limit.requests_per_s == pytest.approx(5.0)
    # Whole requests per minute, never above the rate, off by less than one request.
    assert limit.period_s == PERIOD_S
    assert 5.0 - 1 / PERIOD_S < limit.admitted_per_s <= 5.0


def test_a_disaggregated_model_admits_what_its_scarcer_phase_serves():
    plan = make_plan(DISAGGREGATED)
    # prefill 2 x 40,000 prompt tokens/s, decode 2 x 3,000 + 1,900 output tokens/s
    caps = capacity_rps(plan, {"llama3.1-70b": spec(1.0, prompt=1000, output=100)})
    assert caps["llama3.1-70b"] == pytest.approx(min(80_000 / 1000, 7_900 / 100))
    caps = capacity_rps(plan, {"llama3.1-70b": spec(1.0, prompt=4000, output=100)})
    assert caps["llama3.1-70b"] == pytest.approx(20.0)


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 200),
    period=st.sampled_from([1, 2, 5, 10, 30, 60]),
    overload=st.floats(1.2, 5.0),
)
def test_over_a_long_run_the_admitted_rate_is_the_limit(count, period, overload):
    limit = admission_limits(make_plan(AGG), {"phi-4": spec(0.1)})["phi-4"].model_copy(
        update={"count": count, "period_s": period}
    )
    rate = overload * count / period
    n = int(rate * period * 20)  # twenty periods of evenly spaced arrivals
    arrivals = np.arange(n) / rate
    kept = admit(arrivals, limit)
    span = arrivals[-1]
    # The first period may admit its whole count at once, then the window holds `count`.
    assert kept.sum() <= count * (span / period + 2)
    assert kept.sum() >= count * (span / period - 2)
    # Below the limit, nothing is shed.
    slow = np.arange(n) / (0.8 * count / period)
    assert admit(slow, limit).all()


def test_the_simulator_sheds_the_excess_and_counts_it():
    perf = load_perf_model()
    plan = make_plan([("phi-4", "aggregated", "l40sx1", "l40sx1", 2.0, 1)])
    models = {"phi-4": spec(1.0)}  # half what the one instance is planned to serve
    # A spike: four times the demand, twice the capacity.
    trace = generate_trace(4.0, 300, 1020, 129, shape=WorkloadShape(1.0, 0.0, 0.0), seed=3)
    limits = admission_limits(plan, models)
    shed = simulate(plan, models, perf, {"phi-4": trace}, 300.0, admission=limits)
    flooded = simulate(plan, models, perf, {"phi-4": trace}, 300.0)
    r = shed.models["phi-4"]
    assert r.offered == len(trace)
    assert r.shed == len(trace) - int(admit(trace.arrival_s, limits["phi-4"]).sum()) > 0
    assert r.offered_attainment <= r.admitted_attainment
    # Shedding half keeps the admitted ones' latency: without it every request waits longer.
    assert np.median(r.ttft_ms) < np.median(flooded.models["phi-4"].ttft_ms)
    summary = shed.summary()["by_model"]["phi-4"]  # type: ignore[index]
    assert summary["shed"] == r.shed and summary["offered"] == len(trace)


def test_coral_plan_warns_of_a_fully_served_model_shed_at_its_demand():
    from coral_iac.cli.plan import shed_warnings
    from solver.plan_schema import ModelAttainment

    def row(model: str, shed: float) -> ModelAttainment:
        return ModelAttainment(
            model=model, target=0.9, workload="w", planned=0.95, verified=0.95, shed=shed
        )

    plan = make_plan(AGG).model_copy(
        update={"attainment": [row("phi-4", 0.05)], "served_fractions": {"phi-4": 1.0}}
    )
    (line,) = shed_warnings(plan)
    assert line.startswith("phi-4: the plan serves all of its demand, yet the gateway sheds 5.0%")
    assert "target_utilization" in line
    calm = plan.model_copy(update={"attainment": [row("phi-4", 0.005)]})
    scarce = plan.model_copy(update={"served_fractions": {"phi-4": 0.5}, "served_fraction": 0.5})
    assert shed_warnings(calm) == [] and shed_warnings(scarce) == []


def test_coral_plan_warns_of_a_model_below_its_target_in_a_spike_and_names_the_remedy():
    from coral_iac.cli.plan import spike_warnings
    from solver.plan_schema import ModelAttainment

    def row(spike: float) -> ModelAttainment:
        return ModelAttainment(
            model="phi-4",
            target=0.9,
            workload="w",
            planned=0.95,
            verified=0.95,
            spike=spike,
            spike_shed=0.13,
        )

    plan = make_plan(AGG).model_copy(update={"attainment": [row(0.835)]})
    (line,) = spike_warnings(plan)
    assert line.startswith("phi-4: at 1.5x its demand the gateway sheds 13.0% and the admitted")
    assert "83.5%" in line and "target_utilization" in line
    assert spike_warnings(plan.model_copy(update={"attainment": [row(0.9)]})) == []
