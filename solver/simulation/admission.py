"""Admission control: how many requests per second each model (each length bucket of a routed
model) may send into its replicas, and which requests of a stream that rule admits.

One rule for the gateway and the simulator, so the plan is verified on the fleet it deploys:

- `admission_limits(plan, models)`: per model of the plan, the admitted rate. When the plan
  serves only part of a model's demand (scarcity), its served share of the demand; otherwise its
  planned capacity at the SLO attainment target (`capacity_rps`: the instances' capacities, which
  do not depend on the stated demand), or the demand's own busy minutes where those bring more
  (`demand_peak`: the PEAK_QUANTILE of its planning workload's requests per minute, at the
  demand). The capacity model sizes the instances for the workload's bursts at its mean rate,
  so a model served in full admits the bursts it was sized for and sheds only traffic above
  them; a scarce model's window is always full, so it admits its share and no more. HAProxy
  counts whole requests per period, so the rate becomes `count` requests per minute
  (`PERIOD_S`), rounded down (never above the rate).
- `admit(arrival_s, limit)`: the requests of a stream that limit admits, by HAProxy's own rule:
  its stick table keeps a sliding-window count of admitted requests (`gpc0_rate(<period>)`,
  estimated as the current period's count plus the previous period's, weighted by the part of
  it still inside the window; HAProxy 2.6 `src/freq_ctr.c`, `freq_ctr_total`), and a request is
  answered 429 (and not counted) while that estimate has reached `count`.

What a client sees on a shed request, how to size for spikes: docs/gateway.md ("Admission
control"), docs/slo-attainment.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from solver.plan_schema import Plan
from solver.stack import ModelSpec
from solver.types import BUCKET_SEP, FROZEN, base_model

# HAProxy's counting period: the admitted rate is a mean over a minute. The capacity model sizes
# a template for its workload's bursts at that mean rate (`Workload.arrival_scv`), so bursts
# inside the minute are the replicas' to absorb, not the gateway's to shed: on the committed
# spot stack (the Azure conversation trace at 20 requests/s, capacity 25.6) a 1 s window shed
# 6.8% of the requests at the demand the plan serves, 10 s 2.5%, 60 s 1.2%.
PERIOD_S = 60
# A model served in full admits at least this quantile of its demand's own requests per period:
# without it, a plan whose capacity sits just above a bursty demand shed its bursts in ordinary
# traffic (the Azure code trace's busy minutes: 54% of staging's gpt-oss-20b requests at its
# demand, which the replicas serve within the SLOs 99.8% of the time without the gateway).
PEAK_QUANTILE = 0.99
# The planning workload `demand_peak` counts over: four hours, or the trace's planning window.
PEAK_WINDOW_S = 4 * 3_600.0
Basis = Literal["served share", "capacity at target", "demand's busy minutes"]


class AdmissionLimit(BaseModel):
    """What the gateway admits into one model's (or length bucket's) replicas."""

    model_config = FROZEN
    model: str = Field(description="The plan's model name (a length bucket's: <model>@b<i>).")
    requests_per_s: float = Field(ge=0, description="The rate the plan gives it.")
    basis: Basis = Field(
        description="served share: the plan serves part of the demand (scarcity); capacity "
        "at target: the instances' capacity at the SLO attainment target; demand's busy "
        "minutes: a model served in full whose demand brings more in its busy minutes "
        "(PEAK_QUANTILE of its requests per period) than its capacity."
    )
    period_s: int = Field(gt=0, description="HAProxy's counting period.")
    count: int = Field(ge=0, description="Requests admitted per period (rate x period, down).")

    @property
    def admitted_per_s(self) -> float:
        """The rate HAProxy enforces: count / period (at most `requests_per_s`)."""
        return self.count / self.period_s

    @property
    def retry_after_s(self) -> int:
        """What a shed request's `Retry-After` says: about when the window has room for one more
        (one period's share of a request), in whole seconds, at least 1."""
        return max(1, math.ceil(self.period_s / max(1, self.count)))


def request_rates(plan: Plan, models: Mapping[str, ModelSpec]) -> dict[str, float]:
    """Demand in requests/s per model of the plan: the spec's (`models` by the plan's model
    name, length buckets included when given), else a bucket's share of its model's."""
    from solver.simulation.workload import request_rate  # workload imports this stage's peers

    buckets = plan.buckets()
    out: dict[str, float] = {}
    for name in sorted({i.model for i in plan.instances} | set(plan.served_fractions)):
        if name in models:
            out[name] = request_rate(models[name])
        elif name in buckets and base_model(name) in models:
            out[name] = request_rate(models[base_model(name)]) * buckets[name].share
    return out


def _mean_lengths(plan: Plan, models: Mapping[str, ModelSpec], name: str) -> tuple[float, float]:
    if name in models:
        return models[name].mean_prompt_tokens, models[name].mean_output_tokens
    b = plan.buckets()[name]
    return b.mean_prompt_tokens, b.mean_output_tokens


def capacity_rps(plan: Plan, models: Mapping[str, ModelSpec]) -> dict[str, float]:
    """Per model of the plan: the requests/s its instances serve at the SLO attainment target
    (each instance's `throughput` is its template's capacity at the target). Aggregated: the sum;
    disaggregated: the lesser of the prefill instances' prompt tokens/s over the mean prompt and
    the decode instances' output tokens/s over the mean output (a model with one phase only
    serves nothing). Independent of the stated demand."""
    by_phase: dict[str, dict[str, float]] = {}
    for i in plan.instances:
        by_phase.setdefault(i.model, {}).setdefault(i.phase, 0.0)
        by_phase[i.model][i.phase] += i.throughput
    out: dict[str, float] = {}
    for name, phases in sorted(by_phase.items()):
        if name not in models and name not in plan.buckets():
            continue
        prompt, output = _mean_lengths(plan, models, name)
        if "aggregated" in phases:
            out[name] = phases["aggregated"]
        else:
            out[name] = min(phases.get("prefill", 0.0) / prompt, phases.get("decode", 0.0) / output)
    return out


def demand_peak(
    models: Mapping[str, ModelSpec], name: str, root: Path | None = None, period_s: int = PERIOD_S
) -> int:
    """The PEAK_QUANTILE of model `name`'s requests per `period_s` at its demand, over its
    planning workload (the trace's planning window, or its generated requests; the verification
    window is never read); 0 for a model not in `models`. `root`: the project folder a
    relative `workload_trace` is read from."""
    if name not in models:
        return 0
    index = sorted(models).index(name)
    return _peak(models[name].model_dump_json(), index, str(root) if root else None, period_s)


@cache
def _peak(spec_json: str, index: int, root: str | None, period_s: int) -> int:
    from solver.simulation.workload import model_trace  # workload imports this stage's peers

    spec = ModelSpec.model_validate_json(spec_json)
    trace = model_trace(spec, index, "plan", PEAK_WINDOW_S, Path(root) if root else None)
    if len(trace) == 0:
        return 0
    counts = np.bincount((trace.arrival_s // period_s).astype(np.int64))
    return math.ceil(float(np.quantile(counts[:-1] if len(counts) > 1 else counts, PEAK_QUANTILE)))


def admission_limits(
    plan: Plan, models: Mapping[str, ModelSpec], root: Path | None = None, room: float = 1.0
) -> dict[str, AdmissionLimit]:
    """Per model of the plan with instances (length buckets apart): what the gateway admits.

    A model served in part admits its served share of its demand (`plan.fraction_of(m)` x
    `room` below 1; `room`: 1 / `allocation.target_utilization`, as the plan was sized for:
    its served fraction is of room x the demand); one served in full admits its capacity at the
    target (at least its demand: rounding a plan's instances up gives it room, which a spike may
    use), or its demand's busy minutes where they bring more (`demand_peak`). `models`: the
    specs by the plan's model name (length buckets' may be left out: a bucket's share of its
    model is in the plan); `root`: the project folder (for a CSV `workload_trace`)."""
    rates = request_rates(plan, models)
    capacity = capacity_rps(plan, models)
    out: dict[str, AdmissionLimit] = {}
    for name, cap in capacity.items():
        share = plan.fraction_of(name) * room
        basis: Basis
        if share < 1:
            rate, basis = share * rates.get(name, 0.0), "served share"
        else:
            rate, basis = max(cap, rates.get(name, 0.0)), "capacity at target"
            peak = demand_peak(models, name, root) / PERIOD_S
            if peak > rate:
                rate, basis = peak, "demand's busy minutes"
        out[name] = AdmissionLimit(
            model=name,
            requests_per_s=round(rate, 6),
            basis=basis,
            period_s=PERIOD_S,
            # At least one request per period where anything is admitted at all.
            count=max(1, math.floor(rate * PERIOD_S + 1e-9)) if rate > 0 else 0,
        )
    return out


def admit(arrival_s: np.ndarray, limit: AdmissionLimit) -> np.ndarray:
    """Which of a stream's requests (arrival times in seconds, non-decreasing) `limit` admits:
    HAProxy's sliding-window estimate of admitted requests in the last period (the current
    period's count plus the previous one's times the share of it still in the window, windows
    from t = 0) must be below `count`; a request it sheds is not counted."""
    n = len(arrival_s)
    admitted = np.zeros(n, dtype=bool)
    if limit.count <= 0 or n == 0:
        return admitted
    period = float(limit.period_s)
    window = -1
    curr = prev = 0
    for k, t in enumerate(arrival_s.tolist()):
        w = int(t // period)
        if w != window:
            prev = curr if w == window + 1 else 0
            curr, window = 0, w
        left = 1.0 - (t - w * period) / period  # the previous period's share still in the window
        if curr + math.floor(prev * left) < limit.count:
            admitted[k] = True
            curr += 1
    return admitted


def is_bucket(name: str) -> bool:
    return BUCKET_SEP in name
