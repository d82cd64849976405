"""Generated lengths: capped only at the model's context, counted where the cap bites, and one
distribution for the capacity model's sample and the simulated requests."""

from __future__ import annotations

import numpy as np
import pytest

from solver.errors import InputError
from solver.simulation.traces import (
    SHAPES,
    LengthDistribution,
    cap_lengths,
    cap_note,
    generate_trace,
)
from solver.simulation.workload import model_trace, planning_workload
from solver.stack import ModelSpec

CONVERSATION = SHAPES["Azure Conversation (lognormal)"]
LONG_PROMPT, LONG_OUTPUT = 12_035, 343  # a long-context workload's declared means


def test_long_prompts_are_not_cut_at_an_arbitrary_length() -> None:
    """Without a context nothing is capped: the requests keep the declared mean and their tail
    (a 32,768-token cap made 12,035 tokens 10,886 on average, with no request longer)."""
    t = generate_trace(20, 2_000, LONG_PROMPT, LONG_OUTPUT, shape=CONVERSATION, seed=4)
    assert t.capped == 0
    assert abs(t.prompt.mean() / LONG_PROMPT - 1) < 0.03
    assert (t.prompt > 32_768).mean() > 0.05


def test_a_context_caps_each_request_as_vllm_serves_it_and_counts_them() -> None:
    context = 16_384
    free = generate_trace(20, 2_000, LONG_PROMPT, LONG_OUTPUT, shape=CONVERSATION, seed=4)
    t = generate_trace(
        20, 2_000, LONG_PROMPT, LONG_OUTPUT, shape=CONVERSATION, seed=4, max_context=context
    )
    assert np.array_equal(t.arrival_s, free.arrival_s)  # the same requests, only cut
    assert int((t.prompt + t.output).max()) <= context
    assert int(t.prompt.max()) == context - 1 and int(t.output.min()) >= 1
    cut = (free.prompt + free.output) > context
    assert t.capped == int(cut.sum()) > 0
    assert np.array_equal(t.prompt[~cut], free.prompt[~cut])  # a request that fits is as drawn
    note = cap_note(t.capped, len(t), context)
    assert note is not None and "16,384-token context" in note and f"{t.capped:,} of" in note


def test_a_recorded_request_longer_than_the_context_is_capped_too() -> None:
    prompt, output, capped = cap_lengths(np.array([10, 4_000, 5_000]), np.array([5, 200, 9]), 4_096)
    assert prompt.tolist() == [10, 4_000, 4_095]
    assert output.tolist() == [5, 96, 1]
    assert capped == 2
    spec = ModelSpec.model_validate(
        {
            "slo_ms": {"prefill": 2_000, "decode": 100},
            "mean_prompt_tokens": 3_000,
            "mean_output_tokens": 129,
            "workload": "Azure Conversation",
            "demand": {"requests_per_s": 2},
        }
    )
    free = model_trace(spec, 0, "verify", 1_800)
    t = model_trace(spec, 0, "verify", 1_800, max_context=4_096)
    assert t.capped == int(((free.prompt + free.output) > 4_096).sum()) > 0
    assert int((t.prompt + t.output).max()) <= 4_096


@pytest.mark.parametrize("context", [None, 16_384, 4_096])
def test_the_capacity_models_sample_is_the_requests_distribution(context: int | None) -> None:
    """`quantiles` (what the capacity model plans with) and `sample` (what the closed loop and
    the verification simulate) describe one distribution, also where the cap bites: at each
    planning quantile the share of 200,000 drawn requests below it is that quantile's
    probability, and the capped share is the sampled one, both within sampling noise."""
    lengths = LengthDistribution.of(LONG_PROMPT, LONG_OUTPUT, CONVERSATION, context)
    prompt, output, capped = lengths.sample(np.random.default_rng(7), 200_000)
    q = (np.arange(400) + 0.5) / 400
    at_prompt, at_output = lengths.quantiles(q)
    for drawn, quantile in ((prompt, at_prompt), (output, at_output)):
        # Whole tokens: a quantile between two integers splits the tie.
        below = (np.searchsorted(np.sort(drawn), quantile, side="left") + np.searchsorted(
            np.sort(drawn), quantile, side="right")) / 2 / len(drawn)  # fmt: skip
        # Off the atoms the cap makes (a capped prompt at context - 1, an output at 1 token).
        inside = (quantile > 1.5) & (quantile < (context or np.inf) - 1.5)
        assert inside.sum() > 50
        assert np.max(np.abs(below[inside] - q[inside])) < 0.01
    assert abs(lengths.capped_share() - capped / 200_000) < 0.004
    if context is None:
        assert capped == 0 and lengths.capped_share() == 0.0
    else:
        assert capped > 0


def test_planning_and_verification_cap_at_the_same_context() -> None:
    spec = ModelSpec.model_validate(
        {
            "slo_ms": {"prefill": 20_000, "decode": 100},
            "mean_prompt_tokens": LONG_PROMPT,
            "mean_output_tokens": LONG_OUTPUT,
            "workload": "Azure Conversation (lognormal)",
            "demand": {"requests_per_s": 2},
        }
    )
    plan = planning_workload(spec, 0, max_context=16_384)
    held_out = model_trace(spec, 0, "verify", 3_600, max_context=16_384)
    assert plan.prompts.max() <= 16_383 and held_out.prompt.max() <= 16_383
    assert abs(plan.capped_share - held_out.capped / len(held_out)) < 0.02
    assert abs(plan.prompts.mean() / held_out.prompt.mean() - 1) < 0.03
    assert planning_workload(spec, 0).capped_share == 0.0


def test_a_context_without_room_for_one_token_is_refused() -> None:
    with pytest.raises(InputError, match="max_context"):
        LengthDistribution(100, 10, 0.9, 0.9, max_context=1)
