"""A scarce plan holds in the fleet: its whole demand arrives, the gateway's admission control
sheds what the plan does not serve, and the admitted requests meet their target. Without the
admission control every request's latency collapses together (before it, a plan serving 62% of
a production trace's demand met both SLOs for 4.4% of its requests).

On the packaged Azure conversation trace (the held-out stack's phi-4 at twice its rate), with
only two L40S nodes to be had: planned and verified at full offered traffic, then replayed
again without admission control to show what the gateway prevents."""

from __future__ import annotations

import pytest
import yaml

from solver.plan.attainment import _traces
from solver.plan.planner import plan_with_library
from solver.simulation.admission import admission_limits
from solver.simulation.simulator import simulate
from solver.simulation.workload import model_contexts
from solver.stack import load_stack
from tests.conftest import REPO


@pytest.fixture(scope="module")
def scarce(tmp_path_factory):
    from solver.performance.default_model import load_perf_model

    held_out = REPO / "tests" / "fixtures" / "held-out" / "Pulumi.held-out.yaml"
    config = yaml.safe_load(held_out.read_text())
    fleet = config["config"]["coral:fleet"]
    fleet["models"] = {"phi-4": fleet["models"]["phi-4"] | {"demand": {"requests_per_s": 11.0}}}
    fleet["regions"] = [{"cloud": "aws", "region": "us-east-2"}]
    fleet["node_configs"] = ["l40sx1"]
    fleet["availability"] = [{"cloud": "aws", "region": "us-east-2", "node": "l40sx1", "count": 2}]
    folder = tmp_path_factory.mktemp("stacks")
    (folder / "Pulumi.scarce.yaml").write_text(yaml.safe_dump(config))
    perf = load_perf_model()
    stack = load_stack(folder, "scarce")
    lib = tmp_path_factory.mktemp("lib")
    return perf, stack, plan_with_library("scarce", stack, perf, lib, root=REPO)


def test_a_scarce_plan_is_verified_at_its_whole_demand_and_its_admitted_requests_hold(scarce):
    _, fleet, plan = scarce
    served = plan.fraction_of("phi-4")
    assert 0 < served < 0.9, plan.served_fractions  # the two nodes serve part of the demand
    (row,) = plan.attainment
    # Judged on the admitted requests at the whole demand; the rest shed, about the share the
    # plan does not serve (the admission limit rounds down to whole requests per minute).
    assert row.verified is not None and row.verified >= row.target, row
    assert row.shed == pytest.approx(1 - served, abs=0.05), (row.shed, served)
    assert row.spike is not None and row.spike_shed is not None and row.spike_shed > row.shed


def test_without_admission_control_the_same_traffic_misses_for_nearly_every_request(scarce):
    perf, fleet, plan = scarce
    contexts = model_contexts(fleet.models, perf.cards)
    traces, window = _traces(fleet.models, "verify", 1_800, plan, REPO, contexts, offered=1.0)
    gated = simulate(
        plan, fleet.models, perf, traces, window, admission=admission_limits(plan, fleet.models)
    )
    flooded = simulate(plan, fleet.models, perf, traces, window)
    admitted = gated.models["phi-4"]
    assert admitted.offered == len(flooded.models["phi-4"].met)
    assert admitted.admitted_attainment >= plan.attainment[0].target
    assert flooded.models["phi-4"].met.mean() < 0.5 * admitted.admitted_attainment
