"""Capacity at the SLO attainment target: the load one template instance can take while the
target share of its requests still meets the SLOs, as a factor of its library throughput T̂.

T̂ is what an instance delivers with every batch as full as the latency budget allows and every
prompt at the mean length; bought at exactly demand / T̂, queues grow and long prompts miss.
This model charges each template for both, per request length, in closed form (so it is cheap
for the 20,000-template libraries and monotone by construction: a higher target or a burstier
workload never raises a factor). The closed loop in `solver.plan.attainment` then measures the
plan in the simulator and corrects what the formulas miss.

The miss budget 1 - target is split: 70% to TTFT at prefill, 30% to decode (admission waits
count towards TTFT; disaggregated decode keeps TPOT within its SLO by its batch cap).

**Prefill** (a prefill-only instance as vLLM runs it, `engine_model.prefill_attainment`): every
step takes up to C tokens (the instance's --max-num-batched-tokens), so under load each prompt
rides in a full chunk with others'. A prompt meets its TTFT when its wait and its passes fit in
the SLO less a reserve of one decode round and a tenth of the TTFT SLO for decode's admission
(`prefill_budget_ms`). A template whose longest prompts cannot meet it even at no load gets
less (or no) capacity: this is what makes a faster prefill worth more than its T̂.

**Decode** (throughput T tokens/s at TPOT SLO D ms): c = T D sequences run at once; a request
holds one for its output length x D. Admission waits follow Erlang C (M/M/c) scaled by
(ca2 + 1) / 2 (Allen-Cunneen), with an exponential tail; the budget is a tenth of the TTFT SLO.

**Aggregated** (one replica serves both phases; vLLM's chunked prefill,
`engine_model.aggregated_meets`): the engine on the template's own instance, at its chunk and
--max-num-seqs: prefill chunks stall the decodes of their micro-batch and every micro-batch
behind it, and a second pipeline stage adds its time to every token. The factor is the highest
rate meeting the target over T̂.

Each factor is at most 0.98 (bisection on the load); 0 when even a trickle misses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from solver.serving.engine_model import (
    PrefillEngine,
    aggregated_capacity,
    highest_each,
    prefill_capacity,
)
from solver.serving.instance_model import InstanceModel
from solver.serving.serving_template import ServingTemplate
from solver.simulation.workload import Workload
from solver.stack import Slo

CAPACITY_MODEL_VERSION = 7  # raise when a formula changes: cached factors are recomputed
PREFILL_SHARE = 0.7  # of the miss budget 1 - target
ADMISSION_SHARE = 0.1  # of the TTFT SLO, left for decode's admission wait
MAX_UTILIZATION = 0.98
BISECTION_STEPS = 20  # 0.98 / 2^20: a millionth of T-hat
SAMPLE = 64  # lengths the engine models average over (quantiles of the workload)


@dataclass(frozen=True)
class PhaseTarget:
    """The share of a phase's requests that must meet its part of the SLO."""

    share: float

    @staticmethod
    def of(phase: str, target: float) -> PhaseTarget:
        miss = 1.0 - target
        if phase == "prefill":
            return PhaseTarget(1.0 - PREFILL_SHARE * miss)
        if phase == "decode":
            return PhaseTarget(1.0 - (1.0 - PREFILL_SHARE) * miss)
        return PhaseTarget(target)


def capacity_factors(
    templates: list[ServingTemplate],
    slo: Slo,
    workload: Workload,
    target: float,
    instance: Callable[[ServingTemplate], InstanceModel] | None = None,
) -> np.ndarray:
    """Capacity at the target / T̂ for each template of one (model, phase).

    Args:
        templates: one job's library templates (same model and phase).
        slo: the model's TTFT (prefill) and TPOT (decode) SLOs, ms.
        workload: the planning workload's length samples and arrival variability.
        target: the model's attainment target (share of requests meeting both SLOs).
        instance: each template's instance as it serves (aggregated and prefill templates
            need it).

    Returns:
        One factor in [0, MAX_UTILIZATION] per template, in order.

    Raises:
        ValueError: aggregated or prefill templates without `instance`.
    """
    if not templates:
        return np.zeros(0)
    phase = templates[0].phase
    if phase == "aggregated":
        if instance is None:
            raise ValueError("aggregated templates need their instance model")
        return np.array(
            [_aggregated_factor(instance(t), t, slo, workload, target) for t in templates]
        )
    share = PhaseTarget.of(phase, target).share
    thr = np.array([t.throughput for t in templates], dtype=np.float64)
    if phase == "decode":
        return highest_each(
            lambda rho: _decode_attainment(rho, thr, slo, workload) >= share,
            len(thr),
            MAX_UTILIZATION,
            BISECTION_STEPS,
        )
    if instance is None:
        raise ValueError("prefill templates need their instance model")
    lengths = _quantiles(workload.prompts)
    budget = prefill_budget_ms(slo)
    engine = PrefillEngine.stack(
        [
            PrefillEngine.of(inst, [inst.max_batched_tokens], lengths)
            for inst in map(instance, templates)
        ]
    )
    tokens_s = prefill_capacity(engine, lengths, workload.arrival_scv, budget, share)
    return np.minimum(MAX_UTILIZATION, tokens_s / thr)


def prefill_budget_ms(slo: Slo) -> float:
    """The TTFT a disaggregated prefill may take: the SLO less one decode round for the first
    token and a tenth of the SLO for decode's admission."""
    return slo.prefill - slo.decode - ADMISSION_SHARE * slo.prefill


def _quantiles(values: np.ndarray) -> np.ndarray:
    q = (np.arange(SAMPLE) + 0.5) / SAMPLE
    return np.asarray(np.quantile(values, q), dtype=np.float64)


def _aggregated_factor(
    inst: InstanceModel, template: ServingTemplate, slo: Slo, workload: Workload, target: float
) -> float:
    """Capacity / T̂ of one aggregated template: the highest rate the model of its engine meets
    the target at; 0 when even a trickle misses."""
    rate = aggregated_capacity(
        inst,
        _quantiles(workload.prompts),
        _quantiles(workload.outputs),
        workload.arrival_scv,
        (slo.prefill, slo.decode),
        target,
        inst.max_batched_tokens,
        inst.max_running,
        template.throughput * MAX_UTILIZATION,
    )
    return rate / template.throughput


def _decode_attainment(
    rho: np.ndarray, thr: np.ndarray, slo: Slo, workload: Workload
) -> np.ndarray:
    slots = np.maximum(1.0, np.floor(thr * slo.decode / 1e3))
    hold_ms = float(workload.outputs.mean()) * slo.decode
    offered = rho * slots
    p_wait = _erlang_c(slots, offered)
    rate = (slots - offered) / hold_ms / ((workload.arrival_scv + 1.0) / 2)
    budget = ADMISSION_SHARE * slo.prefill
    return np.asarray(1.0 - p_wait * np.exp(-rate * budget), dtype=np.float64)


def _erlang_c(servers: np.ndarray, offered: np.ndarray) -> np.ndarray:
    """Probability of waiting in M/M/c (vectorised): Erlang B = Poisson pmf(c) / cdf(c) at the
    offered load, then C = c B / (c - a (1 - B))."""
    # scipy.stats takes about 0.8 s to import, and nothing else a plan imports loads it.
    from scipy.stats import poisson

    c = servers
    b = poisson.pmf(c, offered) / np.maximum(poisson.cdf(c, offered), 1e-300)
    denom = c - offered * (1 - b)
    return np.asarray(np.clip(c * b / np.maximum(denom, 1e-12), 0.0, 1.0), dtype=np.float64)
