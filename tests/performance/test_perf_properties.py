"""Invariants of the performance model (Hypothesis): monotone in load, GPUs, and memory fit."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

MODELS = [
    "llama1-30b",
    "llama2-70b",
    "llama3.1-70b",
    "phi-4",
    "qwen3-32b",
    "qwen3-235b-a22b",
    "gpt-oss-20b",
    "gpt-oss-120b",
]
GPUS = ["h100", "a100-80gb", "a100-40gb", "l40s", "l4", "a10g", "t4", "v100"]
COUNTS = [1, 2, 4, 8]
PHASES = ["prefill", "decode"]
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


@SETTINGS
@given(
    model=st.sampled_from(MODELS),
    gpu=st.sampled_from(GPUS),
    count=st.sampled_from(COUNTS),
    phase=st.sampled_from(PHASES),
    size=st.integers(1, 20000),
    extra=st.integers(1, 5000),
    ctx=st.integers(16, 32000),
)
def test_layer_time_grows_with_batch_and_tokens(perf, model, gpu, count, phase, size, extra, ctx):
    node = f"{gpu}x{count}"
    small = perf.layer_time(model, node, phase, size, ctx).ms
    large = perf.layer_time(model, node, phase, size + extra, ctx).ms
    assert large >= small


@SETTINGS
@given(
    model=st.sampled_from(MODELS),
    gpu=st.sampled_from(GPUS),
    count=st.sampled_from(COUNTS),
    phase=st.sampled_from(PHASES),
    size=st.integers(1, 4096),
    ctx=st.integers(16, 32000),
    more=st.integers(1, 32000),
)
def test_layer_time_grows_with_context(perf, model, gpu, count, phase, size, ctx, more):
    node = f"{gpu}x{count}"
    assert (
        perf.layer_time(model, node, phase, size, ctx + more).ms
        >= perf.layer_time(model, node, phase, size, ctx).ms
    )


@SETTINGS
@given(
    model=st.sampled_from(MODELS),
    gpu=st.sampled_from(GPUS),
    phase=st.sampled_from(PHASES),
    size=st.integers(1, 20000),
    ctx=st.integers(16, 32000),
    i=st.integers(0, 2),
)
def test_more_gpus_per_node_never_slower(perf, model, gpu, phase, size, ctx, i):
    fewer, more = f"{gpu}x{COUNTS[i]}", f"{gpu}x{COUNTS[i + 1]}"
    assert (
        perf.layer_time(model, more, phase, size, ctx).ms
        <= perf.layer_time(model, fewer, phase, size, ctx).ms
    )


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    model=st.sampled_from(MODELS),
    gpu=st.sampled_from(GPUS),
    count=st.sampled_from(COUNTS),
    phase=st.sampled_from(PHASES),
    budget=st.floats(5, 3000),
)
def test_layer_counts_that_do_not_fit_have_no_entry(perf, model, gpu, count, phase, budget):
    node = f"{gpu}x{count}"
    entries = perf.profile_table(model, phase, budget, [node])
    card = perf.card(model)
    cfg = perf.catalog.node(node)
    for e in entries:
        # every entry fits: weights + a useful KV cache on the TP group it uses
        assert perf.kv_capacity_tokens(card, cfg, e.tp, e.layers) >= perf.settings.min_kv_tokens
        assert e.stage_ms <= budget + 1e-9
    limit = perf.max_layers(model, node)
    assert all(e.layers <= limit for e in entries)
    # throughput falls (weakly) as a node holds more layers
    tputs = [e.tokens_per_s for e in entries]
    assert all(a >= b - 1e-6 for a, b in zip(tputs, tputs[1:], strict=False))


@SETTINGS
@given(
    model=st.sampled_from(MODELS),
    gpu=st.sampled_from(GPUS),
    count=st.sampled_from(COUNTS),
    phase=st.sampled_from(PHASES),
    size=st.integers(1, 20000),
    ctx=st.integers(16, 32000),
)
def test_components_sum_to_the_layer_time(perf, model, gpu, count, phase, size, ctx):
    """The breakdown `coral profile explain` shows is the layer time, term by term: GEMMs,
    attention, all-reduce (zero exactly at TP 1) and the runtime's per-layer overhead."""
    lt, parts = perf.layer_breakdown(model, f"{gpu}x{count}", phase, size, ctx)
    assert parts is not None
    assert parts.ms == lt.ms
    assert min(parts.components().values()) >= 0
    assert (parts.comm_ms > 0) == (lt.tp > 1)
