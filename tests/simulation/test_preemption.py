"""Spot preemptions: sampled and loaded outages, the simulator's retries, and verification's
attainment under preemption."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from solver.catalog.market import Slot, SpotTerms
from solver.catalog.preemption import Preemption
from solver.errors import InputError
from solver.plan_schema import Instance, Plan, instance_key, template_ref
from solver.simulation.preemption import Outage, load_outages, sample_outages
from solver.simulation.results import ModelResult
from solver.simulation.simulator import simulate
from solver.simulation.traces import Trace, WorkloadShape, generate_trace
from solver.stack import ModelSpec
from tests.allocation_helpers import fleet, libraries, perf
from tests.factories import PHI4_SPEC, single_node_template

SPEC = ModelSpec.model_validate(PHI4_SPEC | {"serving": "aggregated"})
MODELS = {"phi-4": SPEC}
FIXED = WorkloadShape(arrival_cv=1.0, prompt_sigma=0.0, output_sigma=0.0)
REGION = ("aws", "us-east-2")


def spot_instance(
    i: int, node: str = "l40sx1", zone: str | None = "use2-az1", nodes: int = 1
) -> Instance:
    """An aggregated phi-4 instance on `nodes` x `node`; spot in `zone` (None: on-demand)."""
    return Instance(
        key=instance_key("phi-4", "aggregated", *REGION, node, i, zone),
        model="phi-4",
        phase="aggregated",
        cloud=REGION[0],
        region=REGION[1],
        template=node,
        index=i,
        nodes=[node] * nodes,
        usd_per_hour=1.0,
        throughput=1.0,
        market="on-demand" if zone is None else "spot",
        zone=zone,
    )


def aggregated_plan(instances: list[Instance]) -> Plan:
    """phi-4 served aggregated by one l40sx1 per instance (every instance of one template)."""
    template = single_node_template("phi-4", "l40sx1", 40).model_copy(
        update={"phase": "aggregated", "unit": "requests/s"}
    )
    return Plan(
        stack="test", method="coral", mode="vllm", served_fraction=1.0,
        hourly_cost_usd=float(len(instances)), startup_penalty_usd_per_hour=0.0,
        cost_by_model={}, jobs=[], instances=instances,
        templates={template_ref("phi-4", "aggregated", "l40sx1"): template}, binding=[],
        solver=None, input_hashes={},
    )  # fmt: skip


def terms(rate_per_hour: float, correlation: float, zones: tuple[str, ...]) -> SpotTerms:
    return SpotTerms(0.5, zones, Preemption(rate_per_hour=rate_per_hour,
                                            zone_correlation=correlation, source="test"))  # fmt: skip


def run(plan: Plan, trace: Trace, duration_s: float, outages: list[Outage] | None = None):
    if outages is None:
        return simulate(plan, MODELS, perf(), {"phi-4": trace}, duration_s).models["phi-4"]
    return simulate(plan, MODELS, perf(), {"phi-4": trace}, duration_s, outages).models["phi-4"]


def same(a: ModelResult, b: ModelResult) -> bool:
    return (
        np.array_equal(a.first_token_s, b.first_token_s)
        and np.array_equal(a.finish_s, b.finish_s)
        and a.max_kv_used == b.max_kv_used
        and a.retried == b.retried == 0
    )


def test_a_preempted_instances_requests_finish_on_the_other_one():
    """Two aggregated instances, A taken back at 60 s with a boot longer than the run. Before
    60 s nothing changes (routing and the engine are causal); the requests on A at 60 s
    (alternate requests go to A, weights being equal) are retried on B from 60 s: every request
    finishes, those after 60 s and counting from their arrival, and the count retried is
    theirs."""
    plan = aggregated_plan([spot_instance(0), spot_instance(1)])
    a = plan.instances[0].key
    trace = generate_trace(2, 120, 1020, 129, seed=1, shape=FIXED)
    before = run(plan, trace, 120)
    after = run(plan, trace, 120, [Outage(a, 60.0, 10_000.0)])
    on_a = np.arange(len(trace)) % 2 == 0
    in_flight = on_a & (trace.arrival_s < 60) & (before.finish_s > 60)
    assert 3 <= in_flight.sum() and after.retried == in_flight.sum()
    assert np.isfinite(after.finish_s).all()
    assert (after.first_token_s[in_flight] > 60).all() and (after.finish_s[in_flight] > 60).all()
    assert (after.ttft_ms[in_flight] >= (60 - trace.arrival_s[in_flight]) * 1e3).all()
    done_before = before.finish_s <= 60
    assert np.array_equal(after.finish_s[done_before], before.finish_s[done_before])
    # After 60 s B serves everything: what arrives then finishes later than it did on two.
    late = trace.arrival_s >= 60
    assert after.finish_s[late].sum() > before.finish_s[late].sum()
    assert after.met.mean() < before.met.mean()


def test_attainment_falls_as_the_preemption_rate_rises():
    """Two instances serving 3 requests/s meet the SLOs for all (100%); one alone for 5%.
    Sampled outages (no zone correlation, a minute's boot) at 1, 10 and 100 preemptions an
    hour, three seeds each: mean attainment falls at each step by a clear margin (measured:
    100%, 74%, 6.5%)."""
    plan = aggregated_plan([spot_instance(0), spot_instance(1)])
    trace = generate_trace(3, 200, 1020, 129, seed=1, shape=FIXED)
    means = []
    for rate in (1.0, 10.0, 100.0):
        spot = {(REGION, "l40sx1"): terms(rate, 0.0, ("use2-az1",))}
        met = [
            run(plan, trace, 200, sample_outages(plan.instances, spot, 200, 60, seed)).met.mean()
            for seed in range(3)
        ]
        means.append(float(np.mean(met)))
    assert means[0] > means[1] + 0.1 and means[1] > means[2] + 0.1, means


def test_no_outages_or_outages_after_the_last_request_change_nothing():
    """Without outages the simulator is as before (the same arrays, bit for bit). An outage after
    every request has finished goes through the replay (routing skips down instances, each
    life's engine runs apart) and still gives the same arrays: the replay's round-robin and
    passes are the plain ones. Also for a disaggregated plan's prefill and decode instances."""
    plan = aggregated_plan([spot_instance(0), spot_instance(1)])
    trace = generate_trace(2, 60, 1020, 129, seed=2)
    plain = run(plan, trace, 60)
    assert same(run(plan, trace, 60, []), plain)
    end = float(plain.finish_s.max()) + 1
    assert same(run(plan, trace, 60, [Outage(plan.instances[1].key, end, end + 5)]), plain)

    f = fleet()
    disagg = two_decodes()
    traces = {m: demand_trace(s, 60, seed=3) for m, s in f.models.items()}
    plain_d = simulate(disagg, f.models, perf(), traces, 60).models
    late = [Outage(i.key, 10_000.0, 10_001.0) for i in disagg.instances]
    replayed = simulate(disagg, f.models, perf(), traces, 60, late).models
    for m in f.models:
        assert same(replayed[m], plain_d[m]), m
        assert np.array_equal(replayed[m].prefill_done_s, plain_d[m].prefill_done_s)


def demand_trace(spec: ModelSpec, duration_s: float, seed: int) -> Trace:
    """Requests at the model's demand and mean lengths (the default lognormal shape)."""
    assert spec.demand is not None and spec.demand.requests_per_s is not None
    return generate_trace(spec.demand.requests_per_s, duration_s, spec.mean_prompt_tokens,
                          spec.mean_output_tokens, seed=seed)  # fmt: skip


def two_decodes() -> Plan:
    """The small fleet's plan (one prefill and one decode instance per model) with phi-4's
    decode instance twice."""
    f = fleet()
    from solver.plan.planner import plan_stack

    plan = plan_stack("test", f, perf().catalog, libraries())
    (dec,) = [i for i in plan.instances if i.model == "phi-4" and i.phase == "decode"]
    twin = dec.model_copy(update={"index": 1, "key": dec.key[:-1] + "1"})
    return plan.model_copy(update={"instances": [*plan.instances, twin]})


def test_disaggregated_phases_retry_and_wait_for_an_instance_to_come_back():
    """phi-4 disaggregated, two decode instances and one prefill. A decode outage at 20 s: the
    requests decoding there finish on the other one. The only prefill instance down for 10 s
    from about 30 s: what was in prefill then, and what arrives meanwhile, waits for it and is
    prefilled after it is back; down from about 50 s past the window's end: what was in prefill
    then or arrives later never finishes, and the rest does."""
    f = fleet()
    plan = two_decodes()
    spec = f.models["phi-4"]
    trace = demand_trace(spec, 60, seed=4)
    keys = {i.phase: i.key for i in plan.instances if i.model == "phi-4" and i.index == 0}
    base = simulate(plan, f.models, perf(), {"phi-4": trace}, 60).models["phi-4"]
    assert base.prefill_done_s is not None

    r = simulate(plan, f.models, perf(), {"phi-4": trace}, 60,
                 [Outage(keys["decode"], 20.0, 1_000.0)]).models["phi-4"]  # fmt: skip
    assert r.retried > 0 and np.isfinite(r.finish_s).all()
    assert np.array_equal(r.prefill_done_s, base.prefill_done_s)

    def mid_prefill(after: float) -> float:
        """A time in the middle of the prefill of the first request to arrive after `after`."""
        assert base.prefill_done_s is not None
        j = int(np.searchsorted(trace.arrival_s, after))
        return float(trace.arrival_s[j] + base.prefill_done_s[j]) / 2

    def in_prefill(t: float) -> np.ndarray:
        assert base.prefill_done_s is not None
        return np.asarray((trace.arrival_s < t) & (base.prefill_done_s > t))

    down = mid_prefill(30)
    r = simulate(plan, f.models, perf(), {"phi-4": trace}, 60,
                 [Outage(keys["prefill"], down, down + 10)]).models["phi-4"]  # fmt: skip
    assert r.prefill_done_s is not None and np.isfinite(r.finish_s).all()
    waited = (trace.arrival_s >= down) & (trace.arrival_s < down + 10)
    assert waited.any() and (r.prefill_done_s[waited | in_prefill(down)] > down + 10).all()
    assert r.retried == in_prefill(down).sum() > 0

    down = mid_prefill(50)
    r = simulate(plan, f.models, perf(), {"phi-4": trace}, 60,
                 [Outage(keys["prefill"], down, 1_000.0)]).models["phi-4"]  # fmt: skip
    lost = (trace.arrival_s >= down) | in_prefill(down)
    assert np.isinf(r.finish_s[lost]).all() and np.isfinite(r.finish_s[~lost]).all()
    assert r.retried == in_prefill(down).sum() > 0


def test_an_outage_of_an_instance_the_plan_does_not_have_is_an_error():
    plan = aggregated_plan([spot_instance(0)])
    trace = generate_trace(1, 10, 100, 10, seed=0)
    with pytest.raises(InputError, match="not in the plan"):
        run(plan, trace, 10, [Outage("phi-4/aggregated/aws:us-east-2/l4x1/9", 1.0, 2.0)])


# Sampling ---------------------------------------------------------------------------------


def zone_fleet() -> list[Instance]:
    """a, b: l40sx1 in az1; c: l4x1 in az1; d: l40sx1 in az2; e: l40sx1 on-demand."""
    return [
        spot_instance(0), spot_instance(1), spot_instance(2, node="l4x1"),
        spot_instance(3, zone="use2-az2"), spot_instance(4, zone=None),
    ]  # fmt: skip


def spot_terms(correlation: float) -> dict[Slot, SpotTerms]:
    zones = ("use2-az1", "use2-az2")
    return {
        (REGION, "l40sx1"): terms(20.0, correlation, zones),
        (REGION, "l4x1"): terms(20.0, correlation, zones),
    }


def downs(outages: list[Outage], key: str) -> set[float]:
    return {o.down_s for o in outages if o.instance == key}


def test_sampled_outages_are_deterministic_and_only_of_spot_instances():
    fleet_ = zone_fleet()
    one = sample_outages(fleet_, spot_terms(0.5), 3_600, 60, seed=7)
    assert one == sample_outages(fleet_, spot_terms(0.5), 3_600, 60, seed=7)
    assert one != sample_outages(fleet_, spot_terms(0.5), 3_600, 60, seed=8)
    assert one == sorted(one, key=lambda o: (o.down_s, o.instance))
    assert len(one) > 20 and all(0 <= o.down_s < 3_600 and o.up_s == o.down_s + 60 for o in one)
    assert {o.instance for o in one} == {i.key for i in fleet_ if i.is_spot}  # never e
    for i in fleet_:  # an instance is never taken while it is down
        mine = [o for o in one if o.instance == i.key]
        assert all(b.down_s >= a.up_s for a, b in zip(mine, mine[1:], strict=False))


def test_zone_correlation_takes_the_zones_instances_of_that_node_config_together():
    """Correlation 1: every preemption of a or b takes the other (same zone, same node config),
    never c (another node config) or d (another zone). Correlation 0: a and b never go down
    together, over hundreds of preemptions."""
    a, b, c, d, _ = (i.key for i in zone_fleet())
    together = sample_outages(zone_fleet(), spot_terms(1.0), 36_000, 60, seed=1)
    assert downs(together, a) == downs(together, b) and len(downs(together, a)) > 50
    assert not downs(together, a) & (downs(together, c) | downs(together, d))
    apart = sample_outages(zone_fleet(), spot_terms(0.0), 36_000, 60, seed=1)
    assert len(downs(apart, a)) > 50 and not downs(apart, a) & downs(apart, b)


def test_a_multi_node_instance_is_taken_at_its_nodes_summed_rate():
    """Two nodes: down when either is taken, so about twice as often as one node."""
    single, double = spot_instance(0), spot_instance(1, nodes=2, zone="use2-az2")
    spot = {(REGION, "l40sx1"): terms(3_600.0, 0.0, ("use2-az1", "use2-az2"))}  # 1 a second
    out = sample_outages([single, double], spot, 2_000, 0.001, seed=3)
    ratio = len(downs(out, double.key)) / len(downs(out, single.key))
    assert ratio == pytest.approx(2.0, rel=0.1)


def test_a_spot_instance_the_market_sells_no_spot_for_is_an_error():
    with pytest.raises(InputError, match="does not sell as spot"):
        sample_outages([spot_instance(0, node="l4x1")], {}, 60, 60, seed=0)


# Loading ----------------------------------------------------------------------------------


def test_an_outage_trace_loads_and_a_bad_row_names_its_line(tmp_path: Path):
    keys = [i.key for i in zone_fleet()]
    f = tmp_path / "outages.csv"
    f.write_text(f"instance,down_s,up_s\n{keys[1]},90,\n{keys[0]},30,45.5\n\n{keys[0]},50,\n")
    assert load_outages(f, 120, keys) == [
        Outage(keys[0], 30.0, 45.5), Outage(keys[0], 50.0, 170.0), Outage(keys[1], 90.0, 210.0),
    ]  # fmt: skip
    f.write_text(f"down_s,instance\n12,{keys[2]}\n")  # columns in any order, no up_s
    assert load_outages(f, 60, keys) == [Outage(keys[2], 12.0, 72.0)]
    bad = {
        f"instance,down_s\n{keys[0]},10\n{keys[0]},soon\n": r"outages.csv:3: not a number",
        f"instance,down_s\n{keys[0]},10\n{keys[0][:-1]}7,20\n": r"outages.csv:3: unknown instance",
        f"instance,down_s,up_s\n{keys[0]},10,5\n": r"outages.csv:2: times out of order",
        f"instance,down_s,up_s\n{keys[0]},10,50\n{keys[0]},20,\n": r"outages.csv:3: .* still down",
        f"{keys[0]},10\n": r"outages.csv:1: the header must name",
    }
    for text, message in bad.items():
        f.write_text(text)
        with pytest.raises(InputError, match=message):
            load_outages(f, 60, keys)
    with pytest.raises(InputError, match="no such outage file"):
        load_outages(tmp_path / "none.csv", 60, keys)


# Verification -----------------------------------------------------------------------------


def test_verification_reports_attainment_under_preemption_only_for_spot_plans(monkeypatch):
    """The small fleet's plan verified as is (on-demand) has no `under_preemption`, and its JSON
    no such key. With phi-4's instances on spot, all in one zone, it has one for phi-4: that
    zone's loss a third into the window takes every phi-4 instance for the stack's 20-minute
    boot, so it falls below the verified share; none for gpt-oss-20b, which runs no spot; the
    same on a second run."""
    from solver.catalog.market import build_market
    from solver.plan import attainment

    monkeypatch.setattr(attainment, "MIN_REQUESTS", 300)  # a short window: a fast test
    f = fleet(attainment={"rounds": 0, "verify_minutes": 15})
    scope = f.attainment_scope()
    plan = two_decodes()
    on_demand = attainment.verify_plan(plan, scope, perf(), {}, {}, None)
    assert all(a.under_preemption is None for a in on_demand.attainment)
    assert "under_preemption" not in on_demand.model_dump_json()
    spot = build_market(f.market_scope(), perf().catalog).spot

    def on_spot(i: Instance) -> Instance:
        if i.model != "phi-4":
            return i
        zone = spot[((i.cloud, i.region), i.nodes[0])].zones[0]
        return i.model_copy(update={"market": "spot", "zone": zone})

    spot_plan = plan.model_copy(update={"instances": [on_spot(i) for i in plan.instances]})
    verified = attainment.verify_plan(spot_plan, scope, perf(), {}, {}, None)
    rows = {a.model: a for a in verified.attainment}
    under = rows["phi-4"].under_preemption
    assert under is not None and 0 <= under < rows["phi-4"].verified
    assert rows["gpt-oss-20b"].under_preemption is None
    assert json.loads(verified.model_dump_json())["attainment"][1]["under_preemption"] == under
    again = attainment.verify_plan(spot_plan, scope, perf(), {}, {}, None)
    assert {a.model: a.under_preemption for a in again.attainment} == {
        m: a.under_preemption for m, a in rows.items()
    }

    # Regression: a real trace's held-out window can end long before the simulated window (8
    # of 30 minutes on the Azure trace), and a loss a third into the window then came after
    # the last request, reading as no loss at all. The loss is a third into the requests.
    def early(*args: object, **kwargs: object) -> tuple[dict[str, Trace], float]:
        traces, duration = real_traces(*args, **kwargs)
        cut = {m: t.arrival_s < duration / 4 for m, t in traces.items()}
        return {m: Trace(t.arrival_s[k], t.prompt[k], t.output[k])
                for (m, t), k in zip(traces.items(), cut.values(), strict=True)}, duration  # fmt: skip

    real_traces = attainment._traces
    monkeypatch.setattr(attainment, "_traces", early)
    short = attainment.verify_plan(spot_plan, scope, perf(), {}, {}, None)
    phi4 = next(a for a in short.attainment if a.model == "phi-4")
    assert phi4.under_preemption is not None and phi4.under_preemption < phi4.verified
