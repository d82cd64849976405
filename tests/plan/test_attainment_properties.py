"""The capacity-at-target model's invariants (`solver/capacity/slo_capacity.py`), on random templates
and workloads: a factor lies in [0, 0.98]; a higher attainment target, a burstier arrival
process or (with no fixed cost per pass) longer prompts never raise it. The plan's cost follows (a smaller capacity for every
template can only raise the optimum): `tests/plan/test_attainment.py` checks that on a stack."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from solver.capacity.slo_capacity import MAX_UTILIZATION, capacity_factors
from solver.serving.serving_template import ServingTemplate, Stage, StageMember
from solver.simulation.workload import Workload
from solver.stack import Slo


def template(phase: str, throughput: float, stages: int, budget_ms: float) -> ServingTemplate:
    return ServingTemplate(
        key=f"l4x1*{stages}",
        model="m",
        phase=phase,  # type: ignore[arg-type]
        mode="vllm",
        nodes=["l4x1"] * stages,
        stages=[
            Stage(layers=4, members=[StageMember(node=i, gpus=[0], tp=1)]) for i in range(stages)
        ],
        throughput=throughput,
        unit="requests/s" if phase == "aggregated" else "tokens/s",
        stage_budget_ms=[budget_ms],
    )


templates = st.lists(
    st.tuples(
        st.floats(50, 50_000),  # throughput
        st.integers(1, 8),  # stages
        st.floats(0.05, 1.0),  # stage budget as a share of the TTFT SLO / stages
    ),
    min_size=1,
    max_size=6,
)


def workload(sigma: float, scv: float, mean: float = 1_000.0) -> Workload:
    q = (np.arange(200) + 0.5) / 200
    from statistics import NormalDist

    z = np.array([NormalDist().inv_cdf(float(x)) for x in q])
    lengths = np.exp(np.log(mean) - sigma**2 / 2 + sigma * z)
    return Workload(lengths, lengths / 5, scv)


@dataclass(frozen=True)
class LinearInstance:
    """An instance stand-in: every stage takes `fixed_ms` (1 ms) + per_token_ms per token of
    its micro-batch, plus 0.001 ms per decode sequence per 100 context tokens."""

    stages: tuple[int, ...]
    per_token_ms: float
    max_batched_tokens: int = 512
    max_running: int = 64
    fixed_ms: float = 1.0

    def batch_stage_ms(
        self, tokens: int, decode_seqs: int, decode_context: float, prefill_pairs: float
    ) -> list[float]:
        ms = self.fixed_ms + self.per_token_ms * tokens + 1e-5 * decode_seqs * decode_context
        return [ms] * len(self.stages)

    def prefill_ms(self, tokens: int) -> tuple[float, float]:
        ms = self.fixed_ms + self.per_token_ms * tokens
        return len(self.stages) * ms, ms

    def prompt_alone_ms(self, length: int, chunk: int) -> float:
        rounds = -(-length // chunk)
        return (rounds * self.fixed_ms + self.per_token_ms * length) * len(self.stages)


def instance(t: ServingTemplate, fixed_ms: float = 1.0) -> LinearInstance:
    # Per-token time from T̂: a faster template's steps are shorter. A prefill instance
    # prefills at T̂ (its stage budget's batch is its chunk); an aggregated one at twice T̂.
    stages = tuple(range(len(t.stages)))
    if t.phase == "prefill":
        per_token = 1e3 / t.throughput
        chunk = max(64, int((t.stage_budget_ms[0] - fixed_ms) / per_token))
        return LinearInstance(stages, per_token, max_batched_tokens=chunk, fixed_ms=fixed_ms)
    return LinearInstance(stages, 1e3 / (t.throughput * 2_000), fixed_ms=fixed_ms)


def factors(phase, specs, slo, wl, target, fixed_ms: float = 1.0):
    ts = [template(phase, thr, s, slo.prefill * b / s) for thr, s, b in specs]
    return capacity_factors(ts, slo, wl, target, lambda t: instance(t, fixed_ms))


phases = st.sampled_from(["prefill", "decode", "aggregated"])
slos = st.builds(Slo, prefill=st.floats(200, 3_000), decode=st.floats(10, 200))


@settings(max_examples=60, deadline=None)
@given(phases, templates, slos, st.floats(0, 1.5), st.floats(1, 20), st.floats(0.5, 0.99))
def test_factors_are_bounded(phase, specs, slo, sigma, scv, target):
    f = factors(phase, specs, slo, workload(sigma, scv), target)
    assert f.shape == (len(specs),)
    assert np.all((f >= 0) & (f <= MAX_UTILIZATION))


@settings(max_examples=60, deadline=None)
@given(
    phases,
    templates,
    slos,
    st.floats(0, 1.5),
    st.floats(1, 20),
    st.floats(0.5, 0.98),
    st.floats(0.001, 0.2),
)
def test_a_higher_target_never_raises_a_factor(phase, specs, slo, sigma, scv, target, more):
    wl = workload(sigma, scv)
    low = factors(phase, specs, slo, wl, target)
    high = factors(phase, specs, slo, wl, min(0.999, target + more))
    assert np.all(high <= low + 1e-6)


@settings(max_examples=60, deadline=None)
@given(
    phases,
    templates,
    slos,
    st.floats(0, 1.5),
    st.floats(1, 10),
    st.floats(0, 10),
    st.floats(0.5, 0.99),
)
def test_burstier_arrivals_never_raise_a_factor(phase, specs, slo, sigma, scv, more, target):
    calm = factors(phase, specs, slo, workload(sigma, scv), target)
    bursty = factors(phase, specs, slo, workload(sigma, scv + more), target)
    assert np.all(bursty <= calm + 1e-6)


@example(specs=[(27151.0, 1, 1.0)], slo=Slo(prefill=2992.0, decode=10.0), sigma=0.0, scv=1.0,
         longer=2.0, target=0.5)  # fmt: skip
@settings(max_examples=60, deadline=None)
@given(
    templates, slos, st.floats(0, 1.5), st.floats(1, 10), st.floats(1.0, 3.0), st.floats(0.5, 0.99)
)
def test_longer_prompts_never_raise_a_prefill_factor(specs, slo, sigma, scv, longer, target):
    """With no fixed cost per pass. A pass's fixed cost spread over a longer prompt does raise
    the tokens/s an instance serves (it is real: vLLM's per-step overhead), and with it the
    factor, by up to that cost's share of a pass: Hypothesis found 0.5330 against 0.5319 for
    2,000-token against 1,000-token prompts with 1 ms of a 38 ms pass fixed."""
    short = factors("prefill", specs, slo, workload(sigma, scv), target, fixed_ms=0.0)
    long = factors(
        "prefill", specs, slo, workload(sigma, scv, 1_000.0 * longer), target, fixed_ms=0.0
    )
    assert np.all(long <= short + 1e-6)
