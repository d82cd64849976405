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

**Aggregated** (one replica serves both phases; vLLM's chunked prefill): a model of the engine
on the template's own instance (its stage times, chunk C = --max-num-batched-tokens and
--max-num-seqs). A request gets a token once per pass of its micro-batch through all S stages.
At rate lambda, b = lambda O TPOT sequences decode (Little), b / S per micro-batch. A prompt of L
tokens prefills in ceil(L / room) rounds, room = C - b / S, and while it does its micro-batch is
heavy (its stage time with the prompt's piece), which holds every micro-batch behind it. A
decoding request's passes are heavy for a share f = lambda E[rounds] TPOT of them, so
TPOT = S light + f S (heavy - light) = S light / (1 - lambda E[rounds] S (heavy - light)),
with light and heavy at b / S decodes (a fixed point in b). The rate is
feasible when the target share of requests meet both SLOs: TPOT per output length (while a
request of O tokens decodes, Poisson(lambda (O - 1) TPOT) prompts arrive, each making a run of
its rounds heavy: short outputs are the ones one long prompt pushes over) times TTFT per
prompt length, which is in time after half a light pass to join, a wait behind the prompts in
progress (Kingman's mean, at the busy share lambda E[rounds] S heavy of the time, with an
exponential tail) and its own rounds, each as heavy as its own piece. So prefill stalls decoding,
and a second pipeline stage adds its time to every token.

Each factor is the largest utilization rho in (0, 0.98] that meets the phase's share (bisection);
0 when none does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from solver.simulation.workload import Workload
from solver.stack import Slo
from solver.templates.instance_model import InstanceModel
from solver.templates.serving_template import ServingTemplate

CAPACITY_MODEL_VERSION = 3  # raise when a formula changes: cached factors are recomputed
PREFILL_SHARE = 0.7  # of the miss budget 1 - target
ADMISSION_SHARE = 0.1  # of the TTFT SLO, left for decode's admission wait
MAX_UTILIZATION = 0.98
BISECTION_STEPS = 20  # 0.98 / 2^20: a millionth of T-hat
FIXED_POINT_STEPS = 60  # aggregated: iterations of the step-time fixed point (damped)
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
        instance: each template's instance as it serves (aggregated templates need it).

    Returns:
        One factor in [0, MAX_UTILIZATION] per template, in order.

    Raises:
        ValueError: aggregated templates without `instance`.
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
        return _bisect(lambda rho: _decode_attainment(rho, thr, slo, workload), share, len(thr))
    stages = np.array([len(t.stages) for t in templates], dtype=np.float64)
    period = np.array([max(t.stage_budget_ms or [slo.prefill]) for t in templates])
    return _bisect(
        lambda rho: _prefill_attainment(rho, thr, stages, period, slo, workload),
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
) -> np.ndarray:
    lengths = _quantiles(workload.prompts)[None, :]  # (1, SAMPLE)
    mean = float(workload.prompts.mean())
    cs2 = float(workload.prompts.var()) / mean**2
    r = rho[:, None]
    service_ms = mean / thr[:, None] * 1e3
    batch = (thr * period_ms / 1e3)[:, None]
    alone = (stages * period_ms)[:, None] * np.minimum(lengths, batch) / batch + np.maximum(
        0.0, lengths - batch
    ) / thr[:, None] * 1e3
    reserve = slo.decode + ADMISSION_SHARE * slo.prefill
    slack = slo.prefill - reserve - alone
    # The engine fills every step with what has arrived (chunked prefill), so the wait is the
    # queue's alone: Kingman's residual already counts the step in progress.
    wait = r / (1 - r) * (workload.arrival_scv + cs2) / 2 * service_ms
    tail = r * np.exp(-r * np.maximum(slack, 0.0) / np.maximum(wait, 1e-9))
    met = np.where(slack >= 0, 1.0 - tail, 0.0)
    return np.asarray(met.mean(axis=1), dtype=np.float64)


def _aggregated_factor(
    inst: InstanceModel, template: ServingTemplate, slo: Slo, workload: Workload, target: float
) -> float:
    """Capacity / T̂ of one aggregated template: the highest rate the model of its engine meets
    the target at (bisection on the rate; 0 when even a trickle misses)."""
    lengths, outputs = _quantiles(workload.prompts), _quantiles(workload.outputs)
    mean_prompt, mean_output = float(workload.prompts.mean()), float(workload.outputs.mean())
    cs2 = float(workload.prompts.var()) / mean_prompt**2
    context = mean_prompt + mean_output / 2
    s = len(inst.stages)
    chunk, seqs = inst.max_batched_tokens, inst.max_running

    def stage_s(tokens: float, decodes: float, prefill: float) -> float:
        pairs = prefill * (mean_prompt + prefill) / 2
        times = inst.batch_stage_ms(max(1, math.ceil(tokens)), math.ceil(decodes), context, pairs)
        return max(times) / 1e3

    def meets(rate: float) -> bool:
        tpot = s * stage_s(1, 1, 0)
        for _ in range(FIXED_POINT_STEPS):
            decoding = rate * mean_output * tpot  # Little: each decodes for output x TPOT
            per_batch = decoding / s
            room = chunk - per_batch
            if decoding > seqs or room < 1:
                return False  # more sequences than --max-num-seqs or the KV cache admit
            rounds = np.ceil(lengths / room)
            piece = float(lengths.mean() / rounds.mean())  # prompt tokens per prefill round
            light = stage_s(per_batch, per_batch, 0)
            heavy = stage_s(per_batch + piece, per_batch, piece)
            busy = rate * float(rounds.mean()) * s * heavy  # share of time a prompt prefills
            if busy >= 1:
                return False  # prompts arrive faster than the chunk beside decodes takes them
            # A token's pass is heavy for the share rate x rounds x TPOT of passes: solved.
            stall = rate * float(rounds.mean()) * s * (heavy - light)
            if stall >= 1:
                return False
            nxt = s * light / (1 - stall)
            if abs(nxt - tpot) < 1e-7:
                break
            tpot = (tpot + nxt) / 2
        # While a request of O tokens decodes, Poisson(rate (O - 1) TPOT) prompts arrive and
        # each makes E[rounds] of its passes heavy (in a run): its TPOT is met while at most
        # (SLO - S light) (O - 1) / (S (heavy - light)) passes are heavy. Short outputs are
        # the ones a single prompt can push over.
        steps = np.maximum(outputs - 1, 1)
        allowed = (slo.decode / 1e3 - s * light) * steps / (s * max(heavy - light, 1e-12))
        met_tpot = _compound_poisson_cdf(allowed, rate * steps * tpot, rounds)
        tpot_met = float(np.where(outputs > 1, met_tpot, 1.0).mean())
        # TTFT: half a light pass to join, a wait behind the prompts in progress (Kingman's
        # mean; it waits at all with probability `busy`, then exponentially), its own rounds,
        # each as heavy as its own piece.
        wait = busy / (1 - busy) * (workload.arrival_scv + cs2) / 2 * float(rounds.mean()) * s * heavy
        own = np.array(
            [stage_s(per_batch + x / r, per_batch, x / r) for x, r in zip(lengths, rounds, strict=True)]
        )
        slack = slo.prefill / 1e3 - s * light / 2 - rounds * s * own
        late = busy * np.exp(-busy * np.maximum(slack, 0.0) / max(wait, 1e-12))
        ttft_met = float(np.where(slack >= 0, 1.0 - late, 0.0).mean())
        return ttft_met * tpot_met >= target

    lo, hi = 0.0, template.throughput * MAX_UTILIZATION
    if meets(hi):
        return MAX_UTILIZATION
    if not meets(template.throughput * 1e-3):
        return 0.0
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo / template.throughput


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


def _compound_poisson_cdf(limit: np.ndarray, mean: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """P(sum of N sizes <= limit), N ~ Poisson(mean), sizes drawn from the sample `sizes`: per
    N exactly for N = 0 and by a normal approximation of the sum for N >= 1 (vectorised over
    the limit/mean pairs)."""
    from scipy.special import ndtr
    from scipy.stats import poisson

    m, v = float(sizes.mean()), float(sizes.var())
    top = int(np.ceil(mean.max() + 8 * np.sqrt(mean.max()) + 8))
    n = np.arange(top + 1)[None, :]
    weight = poisson.pmf(n, mean[:, None])
    spread = np.sqrt(np.maximum(n * v, 1e-12))
    within = np.where(n == 0, 1.0, ndtr((limit[:, None] + 0.5 - n * m) / spread))
    out = (weight * within).sum(axis=1)
    return np.asarray(np.where(limit < 0, 0.0, np.clip(out, 0.0, 1.0)), dtype=np.float64)


def _erlang_c(servers: np.ndarray, offered: np.ndarray) -> np.ndarray:
    """Probability of waiting in M/M/c (vectorised): Erlang B = Poisson pmf(c) / cdf(c) at the
    offered load, then C = c B / (c - a (1 - B))."""
    from scipy.stats import poisson

    c = servers
    b = poisson.pmf(c, offered) / np.maximum(poisson.cdf(c, offered), 1e-300)
    denom = c - offered * (1 - b)
    return np.asarray(np.clip(c * b / np.maximum(denom, 1e-12), 0.0, 1.0), dtype=np.float64)
