"""One serving instance on the same request streams in our simulator, our capacity model and an
outside reference (Vidur): the set-up `scripts/bench_vidur` compares.

A `Case` names the model, the nodes of each pipeline stage, the phase (aggregated, or
prefill-only: every request ends at its first token), the SLOs and the request lengths. From it:

- `instance_template`: the serving template our library would build for those nodes;
- `requests`: Poisson arrivals at a rate, lengths fixed or lognormal (the "Azure Conversation"
  shape), one seed, so every tool sees the same requests;
- `simulate_ours`: our event-driven engine (`solver.simulation.simulator`) on them;
- `plan_capacity`: what a plan buys the instance for, T̂ x the capacity factor at the target;
- `highest_rate`: the highest rate at which a tool keeps the target share of requests within
  both SLOs (bisection on the rate; attainment falls with load).

Vidur runs in its own virtual environment (`scripts/vidur_env`); `solver/evaluation/vidur_runner.py`
is the program it runs there, and this module only reads and writes the files between them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from solver.capacity.slo_capacity import PhaseTarget, capacity_factors, prefill_budget_ms
from solver.performance.perf_model import PerfModel
from solver.serving.enumeration import RowSource, to_template, vllm_per_node
from solver.serving.instance_model import InstanceModel
from solver.serving.serving_template import ServingTemplate
from solver.simulation.simulator import engine_pass
from solver.simulation.traces import WorkloadShape, generate_trace
from solver.simulation.workload import Workload
from solver.stack import MAX_SLO_MS, ModelSpec, Slo
from solver.types import LibPhase

FIXED = WorkloadShape(1.0, 0.0, 0.0)  # Poisson arrivals, every request at the means
CONVERSATION = WorkloadShape(1.0, 0.9, 0.9)  # our "Azure Conversation" shape (lognormal)
MAX_TOKENS = 4096  # Vidur's profiles stop at 4096 tokens (prompt + output must fit its model)


@dataclass(frozen=True)
class Case:
    """One instance under one workload."""

    model: str
    nodes: tuple[str, ...]  # one node per pipeline stage
    phase: LibPhase  # "aggregated" or "prefill"
    slo: Slo
    prompt: float
    output: float
    shape: WorkloadShape
    target: float = 0.9

    @property
    def judged(self) -> tuple[Slo, float]:
        """The SLOs and the share of requests that must meet them, as the capacity model asks
        of this phase: an aggregated instance the model's own; a prefill-only one its share of
        the target within the TTFT budget it leaves to decode (its TPOT is not its own)."""
        if self.phase != "prefill":
            return self.slo, self.target
        # No TPOT of its own: the longest the stack schema allows, which no request reaches.
        budget = Slo(prefill=prefill_budget_ms(self.slo), decode=MAX_SLO_MS)
        return budget, PhaseTarget.of("prefill", self.target).share

    @property
    def label(self) -> str:
        lengths = "fixed" if self.shape.prompt_sigma == 0 else "lognormal"
        return f"PP{len(self.nodes)} {self.phase} {lengths}"

    def spec(self) -> ModelSpec:
        return ModelSpec(
            slo_ms=self.slo,
            mean_prompt_tokens=self.prompt,
            mean_output_tokens=1.0 if self.phase == "prefill" else self.output,
            slo_attainment=self.target,
        )


@dataclass(frozen=True)
class Requests:
    arrival_s: np.ndarray
    prompt: np.ndarray
    output: np.ndarray


@dataclass(frozen=True)
class Outcome:
    """Per-request latencies of one run (seconds; inf where a request never finished)."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    completed_s: np.ndarray

    def attainment(self, slo: Slo) -> float:
        ok = (
            np.isfinite(self.completed_s)
            & (self.ttft_s * 1e3 <= slo.prefill)
            & (self.tpot_s * 1e3 <= slo.decode)
        )
        return float(ok.mean()) if len(ok) else 1.0

    def summary(self, requests: Requests, slo: Slo) -> dict[str, float | None]:
        def pct(x: np.ndarray, q: float) -> float | None:
            finite = x[np.isfinite(x)]
            return round(float(np.percentile(finite, q)) * 1e3, 2) if len(finite) else None

        done = np.isfinite(self.completed_s)
        span = float(np.max(self.completed_s[done]) - requests.arrival_s[0]) if done.any() else 0
        return {
            "ttft_p50_ms": pct(self.ttft_s, 50),
            "ttft_p90_ms": pct(self.ttft_s, 90),
            "tpot_p50_ms": pct(self.tpot_s[requests.output > 1], 50),
            "tpot_p90_ms": pct(self.tpot_s[requests.output > 1], 90),
            "throughput_req_s": round(float(done.sum()) / span, 3) if span > 0 else None,
            "attainment": round(self.attainment(slo), 4),
        }


def instance_template(perf: PerfModel, case: Case) -> ServingTemplate:
    """The template our library builds for the case's nodes in vLLM mode with one stage per
    node, all its GPUs in tensor parallel (what Vidur models: TP within a node, PP across).

    Raises:
        ValueError: the nodes cannot hold the model within the SLO budgets.
    """
    rows = RowSource(perf, case.model, case.phase, case.spec(), node_names=sorted(set(case.nodes)))
    cand = vllm_per_node(rows, case.nodes)
    if cand is None:
        raise ValueError(f"{case.nodes} cannot serve {case.model} within the SLO budgets")
    return to_template(rows, cand)


def requests(case: Case, rate: float, n: int, seed: int = 0) -> Requests:
    """About n Poisson requests at `rate` req/s, lengths per the case's shape (prompt + output
    at most MAX_TOKENS, as Vidur's profiles allow)."""
    t = generate_trace(rate, n / rate, case.prompt, case.spec().mean_output_tokens, seed=seed,
                       max_context=MAX_TOKENS, shape=case.shape)  # fmt: skip
    prompt, output = t.prompt, t.output
    if case.phase == "prefill":  # each request ends at its first token
        output = np.ones_like(prompt)
    return Requests(t.arrival_s, prompt, output)


def simulate_ours(
    perf: PerfModel, template: ServingTemplate, case: Case, req: Requests, chunk: int | None = None
) -> Outcome:
    """Our engine on the requests, with the batch caps `coral render` passes to vLLM (or
    another `chunk`, to compare)."""
    inst = InstanceModel.serving(perf, template, case.spec())
    first, finish, _ = engine_pass(
        inst,
        req.arrival_s,
        req.prompt,
        req.output,
        chunk or inst.max_batched_tokens,
        inst.max_running,
    )
    ttft = first - req.arrival_s
    with np.errstate(invalid="ignore"):
        tpot = np.where(req.output > 1, (finish - first) / np.maximum(req.output - 1, 1), 0.0)
    return Outcome(ttft, tpot, finish)


def plan_capacity(perf: PerfModel, template: ServingTemplate, case: Case) -> float:
    """Requests/s the plan counts the instance for: T̂ x the capacity factor at the target,
    in requests (prefill T̂ is in prompt tokens/s)."""
    sample = requests(case, 1.0, 4000, seed=12345)
    workload = Workload(np.sort(sample.prompt), np.sort(sample.output), 1.0)
    spec = case.spec()
    factor = float(
        capacity_factors(
            [template], case.slo, workload, case.target,
            lambda t: InstanceModel.serving(perf, t, spec),
        )[0]
    )  # fmt: skip
    per_request = case.prompt if case.phase == "prefill" else 1.0
    return template.throughput * factor / per_request


def highest_rate(
    attainment_at: Callable[[float], float],
    target: float,
    lo: float = 0.02,
    hi: float = 64.0,
    steps: int = 12,
) -> float:
    """Highest rate (req/s) with attainment >= target, by geometric bisection in [lo, hi];
    0 when even `lo` misses, `hi` when `hi` meets it."""
    if attainment_at(lo) < target:
        return 0.0
    if attainment_at(hi) >= target:
        return hi
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if attainment_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo
