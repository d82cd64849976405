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

**Prefill** (template with S stages, stage budget P ms, throughput T tokens/s): a full batch is
B = T P tokens and takes S P (the library sizes it to the TTFT SLO). A prompt of L tokens alone
takes l(L) = S P min(L, B) / B + max(0, L - B) / T (longer prompts are chunked). Waiting W
follows Kingman's G/G/1 approximation in token time, E[W] = rho / (1 - rho) (ca2 + cs2) / 2 E[s]
plus half a period, with an exponential tail P(W > w) = rho exp(-rho w / E[W]). A request meets
its TTFT when W <= SLO - l(L) - reserve, the reserve being one decode round and a tenth of the
TTFT SLO for decode's admission. A template whose longest prompts cannot meet it even at no load
gets less (or no) capacity: this is what makes a faster prefill worth more than its T̂.

**Decode** (throughput T tokens/s at TPOT SLO D ms): c = T D sequences run at once; a request
holds one for its output length x D. Admission waits follow Erlang C (M/M/c) scaled by
(ca2 + 1) / 2 (Allen-Cunneen), with an exponential tail; the budget is a tenth of the TTFT SLO.

**Aggregated**: prefill's formula with the service time of one request, 1 / T.

Each factor is the largest utilization rho in (0, 0.98] that meets the phase's share (bisection);
0 when none does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from solver.simulation.workload import Workload
from solver.stack import Slo
from solver.templates.serving_template import ServingTemplate

CAPACITY_MODEL_VERSION = 2  # raise when a formula changes: cached factors are recomputed
PREFILL_SHARE = 0.7  # of the miss budget 1 - target
ADMISSION_SHARE = 0.1  # of the TTFT SLO, left for decode's admission wait
MAX_UTILIZATION = 0.98
BISECTION_STEPS = 20  # 0.98 / 2^20: a millionth of T-hat
SAMPLE = 64  # prompt lengths the prefill formula averages over (quantiles of the workload)


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
    templates: list[ServingTemplate], slo: Slo, workload: Workload, target: float
) -> np.ndarray:
    """Capacity at the target / T̂ for each template of one (model, phase).

    Args:
        templates: one job's library templates (same model and phase).
        slo: the model's TTFT (prefill) and TPOT (decode) SLOs, ms.
        workload: the planning workload's length samples and arrival variability.
        target: the model's attainment target (share of requests meeting both SLOs).

    Returns:
        One factor in [0, MAX_UTILIZATION] per template, in order.
    """
    if not templates:
        return np.zeros(0)
    phase = templates[0].phase
    share = PhaseTarget.of(phase, target).share
    thr = np.array([t.throughput for t in templates], dtype=np.float64)
    if phase == "decode":
        return _bisect(lambda rho: _decode_attainment(rho, thr, slo, workload), share, len(thr))
    stages = np.array([len(t.stages) for t in templates], dtype=np.float64)
    period = np.array([max(t.stage_budget_ms or [slo.prefill]) for t in templates])
    return _bisect(
        lambda rho: _prefill_attainment(rho, thr, stages, period, slo, workload, phase),
        share,
        len(thr),
    )


def _bisect(f: Callable[[np.ndarray], np.ndarray], share: float, n: int) -> np.ndarray:
    """Largest rho per template with f(rho) >= share; the attainment f falls with rho."""
    lo, hi = np.zeros(n), np.full(n, MAX_UTILIZATION)
    ok_hi = f(hi) >= share
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        ok = f(mid) >= share
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
    feasible = f(np.full(n, 1e-4)) >= share
    return np.where(ok_hi, MAX_UTILIZATION, np.where(feasible, lo, 0.0))


def _quantiles(values: np.ndarray) -> np.ndarray:
    q = (np.arange(SAMPLE) + 0.5) / SAMPLE
    return np.asarray(np.quantile(values, q), dtype=np.float64)


def _prefill_attainment(
    rho: np.ndarray,
    thr: np.ndarray,
    stages: np.ndarray,
    period_ms: np.ndarray,
    slo: Slo,
    workload: Workload,
    phase: str,
) -> np.ndarray:
    lengths = _quantiles(workload.prompts)[None, :]  # (1, SAMPLE)
    mean = float(workload.prompts.mean())
    cs2 = float(workload.prompts.var()) / mean**2
    r = rho[:, None]
    if phase == "aggregated":  # T in requests/s; no per-length latency known
        service_ms = 1e3 / thr[:, None]
        alone = np.zeros_like(lengths)
        reserve = 0.0
    else:
        service_ms = mean / thr[:, None] * 1e3
        batch = (thr * period_ms / 1e3)[:, None]
        alone = (stages * period_ms)[:, None] * np.minimum(lengths, batch) / batch + np.maximum(
            0.0, lengths - batch
        ) / thr[:, None] * 1e3
        reserve = slo.decode + ADMISSION_SHARE * slo.prefill
    slack = slo.prefill - reserve - alone
    wait = r / (1 - r) * (workload.arrival_scv + cs2) / 2 * service_ms + r * period_ms[:, None] / 2
    tail = r * np.exp(-r * np.maximum(slack, 0.0) / np.maximum(wait, 1e-9))
    met = np.where(slack >= 0, 1.0 - tail, 0.0)
    return np.asarray(met.mean(axis=1), dtype=np.float64)


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
    from scipy.stats import poisson

    c = servers
    b = poisson.pmf(c, offered) / np.maximum(poisson.cdf(c, offered), 1e-300)
    denom = c - offered * (1 - b)
    return np.asarray(np.clip(c * b / np.maximum(denom, 1e-12), 0.0, 1.0), dtype=np.float64)
