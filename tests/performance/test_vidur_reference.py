"""The latency model against Vidur's profiles and the engine's properties on real templates.

Per-step times are checked against the sum of Vidur's own operator timings for Llama-2-70B at
TP 2 on A100-80GB (`solver/data/calibration/vidur-sim/`, what Vidur's predictor is trained on),
without running Vidur; `scripts/bench_vidur` runs Vidur itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from solver.evaluation.reference import (
    FIXED,
    Case,
    highest_rate,
    instance_template,
    plan_capacity,
    requests,
    simulate_ours,
)
from solver.evaluation.vidur_bench import PREFILL_REQUESTS
from solver.evaluation.vidur_bench import cases as vidur_cases
from solver.performance.kernel_fit import calibrate_kernels, load_profiled_layer
from solver.serving.instance_model import CHUNK_TPOT_FACTOR, MIN_CHUNK_TOKENS, InstanceModel
from solver.stack import Slo
from tests.allocation_helpers import perf

MODEL, NODE = "llama2-70b", "a100-80gbx2"
SLO = Slo(prefill=1500, decode=80)


@pytest.fixture(scope="module")
def profiled():
    return load_profiled_layer()


@pytest.mark.parametrize("tokens", [512, 1024, 2048, 3072, 4096])
def test_prefill_layer_time_is_within_10_percent_of_vidurs_profiles(profiled, tokens):
    ours = perf().layer_time(MODEL, NODE, "prefill", tokens, tokens).ms
    assert ours == pytest.approx(profiled.prefill_ms(tokens), rel=0.10)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("context", [512, 1024, 2048, 4096])
def test_decode_layer_time_is_within_10_percent_of_vidurs_profiles(profiled, batch, context):
    """Batches of 96-192 sit at the GEMM roofline's corner: a plain max(memory, compute) read
    up to 19% under there; the smooth roofline is within 6%."""
    ours = perf().layer_time(MODEL, NODE, "decode", batch, context).ms
    assert ours == pytest.approx(profiled.decode_ms(batch, context), rel=0.10)


def test_kernel_fits_hold_on_their_rows():
    fit = calibrate_kernels()
    assert fit.attention_prefill.median_abs_rel_error < 0.10
    assert fit.attention_decode.median_abs_rel_error < 0.10
    assert all(e.median_abs_rel_error < 0.10 for e in fit.elementwise.values())


def test_attention_is_no_longer_nearly_free(profiled):
    """Regression: prefill attention of 1024 tokens was 0.038 ms per layer against Vidur's
    0.225 ms; decode attention at batch 1 was 0.001 ms against 0.017 ms."""
    _, parts = perf().layer_breakdown(MODEL, NODE, "prefill", 1024, 1024)
    assert parts is not None and parts.attention_ms > 0.15
    _, parts = perf().layer_breakdown(MODEL, NODE, "decode", 1, 1024)
    assert parts is not None and parts.attention_ms > 0.015
    assert parts.elementwise_ms > 0


def test_kv_capacity_counts_the_memory_the_gpu_reports():
    """Regression: 80 GB was taken as 80e9 bytes (10,905 KV tokens for Llama-2-70B on two
    A100-80GB); the GPU reports 81,920 MiB. Vidur, which reserves less, holds 53,248."""
    p = perf()
    card, cfg = p.card(MODEL), p.catalog.node(NODE)
    assert cfg.gpu.memory_bytes == cfg.gpu.memory_mib * 2**20 > cfg.gpu.memory_gb * 1e9
    assert 10_905 < p.kv_capacity_tokens(card, cfg, 2, card.layers) < 53_248


def _instance(nodes: tuple[str, ...], phase: str) -> tuple[Case, InstanceModel]:
    case = Case(MODEL, nodes, phase, SLO, 1024, 256, FIXED)  # type: ignore[arg-type]
    template = instance_template(perf(), case)
    return case, InstanceModel.serving(perf(), template, case.spec())


@pytest.mark.parametrize("nodes", [(NODE,), (NODE, NODE)])
def test_rendered_batch_caps_respect_the_kv_cache_and_the_slo(nodes):
    """Regression: --max-num-seqs was sized from the TPOT budget alone (308 on PP1, where the
    KV cache holds about 37 requests at the mean context)."""
    case, agg = _instance(nodes, "aggregated")
    assert agg.max_running * case.spec().decode_context_tokens <= agg.kv_capacity
    assert agg.decode_round_ms(agg.max_running) <= SLO.decode
    _, pre = _instance(nodes, "prefill")
    # An aggregated step shares its chunk with decodes, so it takes a smaller chunk than a
    # prefill-only instance's SLO-feasible batch; both at least fit the running sequences.
    assert agg.max_running <= agg.max_batched_tokens < pre.max_batched_tokens
    assert pre.max_batched_tokens >= pre.max_running


def _tpot_ttft(nodes: tuple[str, ...], rate: float, prompt: float) -> tuple[float, float]:
    case = Case(MODEL, nodes, "aggregated", SLO, prompt, 128, FIXED)
    template = instance_template(perf(), case)
    out = simulate_ours(perf(), template, case, requests(case, rate, 150, seed=3))
    return float(np.median(out.tpot_s)), float(np.median(out.ttft_s))


def test_latency_rises_with_load_and_with_prompt_length():
    light, heavy = _tpot_ttft((NODE,), 0.1, 1024), _tpot_ttft((NODE,), 0.8, 1024)
    assert heavy[0] > light[0] and heavy[1] > light[1]
    short, long_ = _tpot_ttft((NODE,), 0.4, 512), _tpot_ttft((NODE,), 0.4, 2048)
    assert long_[0] > short[0] and long_[1] > short[1]


def test_pipeline_depth_adds_its_stages_to_every_token_under_interference():
    """At the same load, a token on two stages of 40 layers waits for both: TPOT is not halved
    by the second node (it was, when decode resumed after the first stage)."""
    pp1, pp2 = _tpot_ttft((NODE,), 0.4, 1024), _tpot_ttft((NODE, NODE), 0.4, 1024)
    assert pp2[0] > 0.8 * pp1[0]


def _attainment_at(case: Case, rate: float, chunk: int) -> float:
    """Our engine's attainment (the capacity model's own criterion for the phase) on 400
    requests at `rate`, with the instance's chunk replaced by `chunk`."""
    req = requests(case, rate, 400, seed=11)
    out = simulate_ours(perf(), instance_template(perf(), case), case, req, chunk)
    return out.attainment(case.judged[0])


@pytest.mark.parametrize("nodes", [(NODE,), (NODE, NODE)])
def test_a_prefill_only_chunk_is_the_one_that_serves_most(nodes):
    """Regression: a prefill-only instance ran with the largest batch within the TTFT SLO as its
    chunk (4,160 tokens on PP 2), so under load every prompt waited for a whole pipeline of
    4,160 tokens; the engine serves more with the chunk the search picks (the simulator
    measured 3.0 against 4.7 req/s on PP 2): its highest rate meeting the target is at least
    the largest chunk's."""
    case, inst = _instance(nodes, "prefill")
    assert inst.max_batched_tokens < inst.max_prefill_tokens
    def limit(chunk: int) -> float:
        return highest_rate(lambda r: _attainment_at(case, r, chunk), case.judged[1], 0.2, 8.0, 8)

    assert limit(inst.max_batched_tokens) >= limit(inst.max_prefill_tokens)


def test_an_aggregated_chunk_is_chosen_for_the_slo():
    """Regression: an aggregated chunk was the largest whose step stays within twice the TPOT
    SLO (384 tokens here), though a smaller one serves more (fewer decodes stall behind each
    chunk): the search takes the smaller one, and our engine agrees at the rule's limit."""
    case, inst = _instance((NODE, NODE), "aggregated")
    rule = max(
        x
        for x in range(MIN_CHUNK_TOKENS, inst.max_prefill_tokens + 1, 64)
        if inst.prefill_ms(x)[0] <= CHUNK_TPOT_FACTOR * SLO.decode
    )
    assert MIN_CHUNK_TOKENS <= inst.max_batched_tokens < rule
    assert _attainment_at(case, 1.0, inst.max_batched_tokens) > _attainment_at(case, 1.0, rule)


@pytest.mark.parametrize("case", vidur_cases(), ids=lambda c: c.label)
def test_plan_capacity_is_what_our_engine_serves(case):
    """The plan's capacity for the instance (T̂ x factor) is never more than 10% above the rate
    our engine serves at the target, nor 25% below it: at capacity / 1.1 the engine meets the
    target, at capacity x 1.25 it misses. (Regression: 4.15 req/s on PP 2 aggregated, where
    the engine met the SLOs up to 1.40 and Vidur up to 0.57; the prefill-only capacity ignored
    the chunk the engine runs.)"""
    template = instance_template(perf(), case)
    capacity = plan_capacity(perf(), template, case)
    slo, target = case.judged
    n = 400 if case.phase == "aggregated" else 2000

    def attainment(rate: float) -> float:
        out = simulate_ours(perf(), template, case, requests(case, rate, n, seed=5))
        return out.attainment(slo)

    assert attainment(capacity / 1.1) >= target - 0.01
    assert attainment(capacity * 1.25) < target


def test_a_prefill_only_limit_is_measured_on_enough_requests():
    """Regression: the bench ran 600 requests per rate, and with lognormal prompts the
    prefill-only limit moved by a factor of 2 from one seed to another (it rests on the few
    long prompts near the budget), so no comparison with Vidur could be read from it. At the
    bench's prefill request count two streams agree within 15%."""
    case = next(c for c in vidur_cases() if c.label == "PP1 prefill lognormal")
    template = instance_template(perf(), case)
    slo, share = case.judged

    def limit(seed: int) -> float:
        def attainment(rate: float) -> float:
            req = requests(case, rate, PREFILL_REQUESTS, seed=seed)
            return simulate_ours(perf(), template, case, req).attainment(slo)

        return highest_rate(attainment, share, lo=0.05, hi=2.0, steps=6)

    a, b = limit(1), limit(3)
    assert 0 < a and 0 < b
    assert max(a, b) / min(a, b) < 1.15
