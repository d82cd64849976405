"""Paper mode places only what the paper's placement ILP allows: every node whole in one stage
(TP inside the node, data parallelism across a stage's nodes), multi-node decode included."""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest

from solver.catalog.offers import load_catalog
from solver.errors import InputError
from solver.oracles.placement_ilp import place_ilp
from solver.plan.demand import stack_demand
from solver.serving.candidates import RowSource
from solver.serving.enumeration import best_candidate
from solver.serving.library import Library, build_libraries, load_library, save_library
from solver.serving.paper_mode import paper_candidate
from solver.stack import FleetConfig
from tests.allocation_helpers import perf

PAPER_FLEET: dict[str, Any] = {
    "models": {
        "phi-4": {
            "slo_ms": {"prefill": 1200, "decode": 60},
            "mean_prompt_tokens": 1020,
            "mean_output_tokens": 129,
            "demand": {"requests_per_s": 2},
        },
    },
    "regions": [{"cloud": "aws", "region": "us-east-2"}],
    "node_configs": ["l4x1", "l4x2", "l40sx1"],
    "library": {"n_max": 3, "rho": 12, "mode": "paper"},
    "market": "paper",
}


def paper_fleet(**changes: Any) -> FleetConfig:
    return FleetConfig.model_validate(PAPER_FLEET | changes)


@cache
def paper_libraries() -> dict[tuple[str, str], Library]:
    f = paper_fleet()
    libs = build_libraries(perf(), f.library_scope(), list(stack_demand(f.models)))  # type: ignore[arg-type]
    return {(lib.model, lib.phase): lib for lib in libs}


def rows(phase: str, decode_slo_ms: float = 60) -> RowSource:
    spec = paper_fleet().models["phi-4"]
    spec = spec.model_copy(
        update={"slo_ms": spec.slo_ms.model_copy(update={"decode": decode_slo_ms})}
    )
    nodes = list(PAPER_FLEET["node_configs"])
    return RowSource(perf(), "phi-4", phase, spec, nodes)  # type: ignore[arg-type]


def test_paper_library_saves_and_loads(tmp_path):
    lib = paper_libraries()[("phi-4", "prefill")]
    save_library(lib, tmp_path)
    loaded = load_library(tmp_path, perf(), paper_fleet().library_scope(), "phi-4", "prefill")
    assert loaded.model_dump() == lib.model_dump()
    assert "__paper.json" in lib.filename


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_every_template_is_a_partition_of_whole_nodes(phase):
    lib = paper_libraries()[("phi-4", phase)]
    assert lib.mode == "paper" and lib.templates
    catalog = perf().catalog
    for t in lib.templates:
        assert t.mode == "paper"
        members = [m for s in t.stages for m in s.members]
        # One stage per node: every node exactly once, never split across stages.
        assert sorted(m.node for m in members) == list(range(len(t.nodes)))
        for m in members:
            gpus = catalog.node(t.nodes[m.node]).gpu_count
            assert m.gpus == list(range(gpus))  # the whole node serves its stage
            assert 1 <= m.tp <= gpus and gpus % m.tp == 0  # TP inside the node
        assert sum(s.layers for s in t.stages) == perf().card("phi-4").layers


def test_multi_node_decode_is_in_the_paper_space_not_in_vllm():
    """phi-4 (28 GB of weights) fits no single L4: decode needs two L4 nodes, which vLLM's
    disaggregated decode (PP=1) cannot run and the paper's space can (at a 200 ms decode SLO:
    at 60 ms an L4 holding half the model is too slow for its 30 ms stage budget)."""
    r = rows("decode", decode_slo_ms=200)
    assert best_candidate(r, ("l4x1", "l4x1"), "vllm") is None
    cand = paper_candidate(r, ("l4x1", "l4x1"))
    assert cand is not None and cand.mode == "paper"
    assert len(cand.placement.stages) == 2  # a two-stage pipeline over the two nodes


def test_no_per_gpu_chain_inside_a_node():
    """general adds per-GPU TP=1 chains (two stages on one l4x2 node); paper never does."""
    r = rows("prefill")
    cand = paper_candidate(r, ("l4x2",))
    assert cand is not None
    assert cand.placement.stages == ((0,),)  # one stage: the node, at TP inside it
    assert [p[0] for p in cand.procs] == [0]
    general = best_candidate(r, ("l4x2",), "general")
    assert general is not None and general.throughput >= cand.throughput


@pytest.mark.parametrize("nodes", [("l4x1", "l4x1"), ("l4x1", "l40sx1"), ("l4x2", "l40sx1")])
def test_paper_throughput_is_the_placement_ilps(nodes):
    """The paper's ILP (SCIP oracle) bounds paper mode: with every stage paying its hop it is a
    lower bound; with no stage paying it (the last stage sends none) an upper bound."""
    r = rows("prefill")
    cand = paper_candidate(r, nodes)
    assert cand is not None
    stage_counts = range(1, len(nodes) + 1)
    hop = {s: r.rows_for(nodes, s) for s in stage_counts}
    no_hop = {s: r.rows_for(nodes, s, last=True) for s in stage_counts}
    low, high = place_ilp(hop, r.layers), place_ilp(no_hop, r.layers)
    assert low is not None and high is not None
    assert low.throughput * (1 - 1e-6) <= cand.throughput <= high.throughput * (1 + 1e-6)


def test_mode_option_accepts_paper():
    f = paper_fleet(library={"mode": "vllm"})
    assert f.with_mode("paper").library.mode == "paper"
    with pytest.raises(InputError, match="use vllm, general or paper"):
        f.with_mode("helix")


def stub_plan(instances: list[Any]) -> Any:
    """A plan with nothing short, unpaired or binding, for check_deployable's own checks."""
    return SimpleNamespace(
        binding=[],
        served_fraction=1.0,
        serves_any=lambda: True,
        jobs=[],
        below_target=lambda: [],
        unpaired=lambda: [],
        instances=instances,
    )


def test_the_program_refuses_paper_mode_and_says_why():
    import pulumi

    from coral_iac.program import check_deployable

    plan = stub_plan([])
    with pytest.raises(pulumi.RunError, match="mode is 'paper'.*stock vLLM runs one TP size"):
        check_deployable(plan, paper_fleet(), load_catalog())  # type: ignore[arg-type]


def test_the_program_refuses_nodes_only_the_stack_prices():
    """paper-helix-aggregated plans a100-40gbx1 nodes, which only its `prices` sell: the
    preview refuses the plan up front, naming every such node and the fix, instead of failing
    on the first instance it declares."""
    import pulumi

    from coral_iac.program import check_deployable

    fleet = paper_fleet(library={"mode": "vllm"})
    inst = SimpleNamespace(cloud="aws", region="us-east-2", nodes=["a100-40gbx1", "l4x1"])
    plan = stub_plan([inst])
    with pytest.raises(
        pulumi.RunError, match="no instance type sells a100-40gbx1 in aws:us-east-2:"
    ):
        check_deployable(plan, fleet, load_catalog())  # type: ignore[arg-type]
    inst.nodes = ["l4x1"]
    check_deployable(plan, fleet, load_catalog())  # type: ignore[arg-type]


def test_a_paper_plan_validates_and_prices_on_the_paper_market():
    from solver.plan.planner import plan_stack
    from solver.plan.validator import validate_plan

    f = paper_fleet()
    p = plan_stack("paper-test", f, perf().catalog, paper_libraries())
    p = validate_plan(p, f.plan_scope(), perf().catalog, perf().cards)
    assert p.mode == "paper" and p.served_fraction == 1 and p.instances
    l4 = f.market.l4_usd_per_gpu_hour
    per_gpu = {"l4": l4, "l40s": 2.2 * l4}
    for i in p.instances:
        nodes = [perf().catalog.node(n) for n in i.nodes]
        assert i.usd_per_hour == pytest.approx(sum(per_gpu[c.gpu_id] * c.gpu_count for c in nodes))


def test_an_unpaired_plan_names_the_setting_that_pairs_it():
    """Regression: under colocate_phases: false a plan could hold a model's prefill in one region
    and its decode in another; the program refused it only at preview, and the fix it named
    (restrict the regions) did not say which setting let the planner split them."""
    from coral_iac.deployable import deploy_problems

    fleet = paper_fleet(library={"mode": "vllm"}, allocation={"colocate_phases": False})
    plan = stub_plan([])
    plan.unpaired = lambda: [("phi-4", "aws", "us-east-2", ["prefill"])]
    (line,) = deploy_problems(
        plan, load_catalog(), fleet.library, fleet.allocation, fleet.attainment
    )
    assert "phi-4 has only prefill instances in aws:us-east-2" in line
    assert "colocate_phases: true" in line
    paired = paper_fleet(library={"mode": "vllm"}, allocation={"colocate_phases": True})
    (line,) = deploy_problems(
        plan, load_catalog(), paired.library, paired.allocation, paired.attainment
    )
    assert "colocate_phases" not in line
