"""Paper-mode decode pipelines are coupled (#19 item 5): one micro-batch size at every stage, so
the stage with the least KV caps them all, and the library's throughput is what the simulator's
instance model sustains (the uncoupled per-stage T̂ promised about 1.5x that on Helix's GPUs)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from solver.serving.candidates import RowSource
from solver.serving.enumeration import to_template
from solver.serving.instance_model import InstanceModel
from solver.serving.library import input_hashes
from solver.serving.paper_mode import paper_candidate
from solver.serving.serving_template import ServingTemplate
from solver.stack import FleetConfig
from tests.allocation_helpers import perf

# Helix's Sec. 6.6 set-up (stacks/Pulumi.paper-helix.yaml), a few of its node configs.
HELIX: dict[str, Any] = {
    "models": {
        "llama2-70b": {
            "slo_ms": {"prefill": 2090, "decode": 730},
            "mean_prompt_tokens": 1020,
            "mean_output_tokens": 129,
            "demand": {"requests_per_s": 4},
        }
    },
    "regions": [{"cloud": "aws", "region": "us-east-2"}],
    "node_configs": ["l4x1", "t4x4", "a100-40gbx1"],
    "library": {"n_max": 4, "rho": 12, "mode": "paper"},
}
MIXED = [("l4x1", "t4x4", "t4x4", "t4x4"), ("a100-40gbx1", "t4x4", "t4x4", "t4x4")]


@cache
def fleet() -> FleetConfig:
    return FleetConfig.model_validate(HELIX)


@cache
def rows(phase: str = "decode") -> RowSource:
    spec = fleet().models["llama2-70b"]
    return RowSource(perf(), "llama2-70b", phase, spec, list(HELIX["node_configs"]))  # type: ignore[arg-type]


def template(nodes: tuple[str, ...], coupled: bool) -> ServingTemplate:
    cand = paper_candidate(rows(), nodes, coupled=coupled)
    assert cand is not None and cand.mode == "paper"
    return to_template(rows(), cand)


def simulated_capacity(t: ServingTemplate) -> float:
    """The simulator's decode rate at its best running count: the instance model's round time
    for `running` sequences (S micro-batches of running / S), within the SLO batch cap and the
    smallest stage's KV (every request's whole context held)."""
    spec = fleet().models["llama2-70b"]
    inst = InstanceModel.serving(perf(), t, spec)
    per_request = spec.mean_prompt_tokens + spec.mean_output_tokens
    top = min(inst.max_running, int(inst.kv_capacity // per_request))
    return max(n * 1e3 / inst.decode_round_ms(n) for n in range(1, top + 1))


@pytest.mark.parametrize("nodes", MIXED)
def test_a_mixed_pipeline_never_gets_more_than_the_uncoupled(nodes):
    coupled, loose = template(nodes, True), template(nodes, False)
    assert len(coupled.stages) > 1
    assert coupled.throughput <= loose.throughput


def test_where_the_small_kv_stage_binds_the_coupled_pipeline_gets_less():
    """One A100-40GB beside T4x4s: its KV caps every stage's micro-batch. (Beside an L4, under
    the current calibration, coupled and uncoupled come out within 0.1% of each other.)"""
    coupled, loose = template(MIXED[1], True), template(MIXED[1], False)
    assert coupled.throughput < 0.99 * loose.throughput


def test_one_node_type_loses_only_the_period_grid():
    """Identical stages pick the same batch anyway: coupling changes little (< 4%)."""
    nodes = ("t4x4", "t4x4", "t4x4")
    coupled, loose = template(nodes, True), template(nodes, False)
    assert 0.96 * loose.throughput <= coupled.throughput <= loose.throughput


@pytest.mark.parametrize("nodes", MIXED)
def test_the_coupled_library_throughput_is_what_the_simulator_sustains(nodes):
    coupled, loose = template(nodes, True), template(nodes, False)
    assert simulated_capacity(coupled) == pytest.approx(coupled.throughput, rel=0.05)
    # What the coupling fixes: the loose stages, sized apart, sustain 91% of their T̂ here.
    assert simulated_capacity(loose) < 0.95 * loose.throughput


def test_prefill_is_not_coupled():
    """A prefill micro-batch is one pass of tokens: its stages were never sized apart."""
    coupled = paper_candidate(rows("prefill"), MIXED[0])
    loose = paper_candidate(rows("prefill"), MIXED[0], coupled=False)
    assert coupled is not None and loose is not None
    assert coupled.placement == loose.placement


def test_paper_decode_libraries_record_the_coupled_search():
    """A paper-mode decode library built before the coupling is stale (rebuilt by coral plan);
    prefill and other modes' libraries are untouched."""
    f = fleet()
    assert "placement" in input_hashes(perf(), f.library_scope(), "llama2-70b", "decode")
    assert "placement" not in input_hashes(perf(), f.library_scope(), "llama2-70b", "prefill")
    general = f.with_mode("general")
    assert "placement" not in input_hashes(perf(), general.library_scope(), "llama2-70b", "decode")
