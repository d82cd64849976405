"""The paper's baselines (Sec. 5), run on the same templates, market and demand as Coral.

- Homo: every replica on one node config (several nodes of it at most). Per model, in stack
  order and in isolation from the other models, it greedily picks the node config with the best
  throughput per dollar for both phases, then buys the most cost-efficient (region, template) of
  that config until demand is met. When availability runs out it falls back to the next best
  config. It reports unmet demand.
- Cauchy-like: disaggregated, so prefill and decode may use different node configs, but each
  phase's replicas are homogeneous. It uses Coral's allocation ILP restricted to those
  templates, so one prefill replica may feed several decode replicas and costs are optimised
  jointly.
"""

from __future__ import annotations

import math

from solver.allocation.problem import Column, Solution
from solver.catalog.market import Market, RegionId
from solver.stack import FleetConfig
from solver.types import Job


def homogeneous(col: Column) -> bool:
    return len(col.usage) == 1


def cauchy_columns(columns: list[Column]) -> list[Column]:
    return [c for c in columns if homogeneous(c)]


def homo_solution(
    fleet: FleetConfig, market: Market, demand: dict[Job, float], columns: list[Column]
) -> Solution:
    """Greedy Homo allocation (see module doc), at the largest uniform fraction of demand it can
    fully serve: like the paper, demand is scaled down until the method meets it (bisection)."""
    full = _homo_greedy(fleet, market, demand, columns)
    if full.fraction >= 1:
        return full
    lo, hi, best = 0.0, 1.0, None
    for _ in range(30):
        mid = (lo + hi) / 2
        scaled = {j: d * mid for j, d in demand.items()}
        trial = _homo_greedy(fleet, market, scaled, columns)
        if trial.fraction >= 1:
            lo, best = mid, trial
        else:
            hi = mid
    if best is None:
        return full
    # Floor, not round: the reported fraction must never exceed what the counts serve.
    return Solution(best.counts, math.floor(lo * 10_000) / 10_000, None, full.binding)


def _homo_greedy(
    fleet: FleetConfig, market: Market, demand: dict[Job, float], columns: list[Column]
) -> Solution:
    """One greedy pass; availability is consumed model by model, in stack order."""
    left: dict[tuple[RegionId, str], int] = dict(market.available)
    pools = dict(market.gpu_pools)
    counts: dict[int, int] = {}
    served: dict[Job, float] = {}
    homo = [(i, c) for i, c in enumerate(columns) if homogeneous(c)]
    for model in fleet.models:
        jobs = sorted(j for j in demand if j[0] == model and demand[j] > 0)
        by_config: dict[str, dict[Job, list[tuple[int, Column]]]] = {}
        for i, c in homo:
            if c.job in jobs:
                by_config.setdefault(c.usage[0][0], {}).setdefault(c.job, []).append((i, c))

        order = sorted(
            by_config, key=lambda cfg: (_cost_estimate(by_config[cfg], jobs, demand), cfg)
        )
        for job in jobs:
            need = demand[job]
            for cfg in order:
                options = sorted(
                    by_config[cfg].get(job, []),
                    key=lambda ic: (ic[1].price / ic[1].template.throughput, ic[0]),
                )
                for i, c in options:
                    if need <= 1e-9:
                        break
                    n = min(
                        math.ceil(need / c.template.throughput - 1e-9),
                        _instances_left(c, left, pools, market),
                    )
                    if n > 0:
                        counts[i] = counts.get(i, 0) + n
                        need -= n * c.template.throughput
                        for node, k in c.usage:
                            left[(c.region, node)] -= n * k
                            pool = (c.region, market.gpu_of[node][0])
                            if pool in pools:
                                pools[pool] -= n * k * market.gpu_of[node][1]
            served[job] = min(1.0, 1 - max(need, 0.0) / demand[job])
    fraction = min(served.values(), default=1.0)
    binding = [
        f"{m} {ph}: {100 * f:.1f}% of demand served; its homogeneous shapes ran out of nodes"
        for (m, ph), f in sorted(served.items())
        if f < 1 - 1e-9
    ]
    return Solution(counts, fraction, None, binding)


def _cost_estimate(
    per_job: dict[Job, list[tuple[int, Column]]], jobs: list[Job], demand: dict[Job, float]
) -> float:
    """$/hour to serve every phase of a model on one node config at its best efficiency."""
    if any(j not in per_job for j in jobs):
        return math.inf  # this config cannot serve every phase
    return sum(
        demand[j] * min(c.price / c.template.throughput for _, c in per_job[j]) for j in jobs
    )


def _instances_left(
    col: Column,
    left: dict[tuple[RegionId, str], int],
    pools: dict[tuple[RegionId, str], int],
    market: Market,
) -> int:
    n = min(left[(col.region, node)] // k for node, k in col.usage)
    for node, k in col.usage:
        pool = (col.region, market.gpu_of[node][0])
        if pool in pools:
            n = min(n, pools[pool] // (k * market.gpu_of[node][1]))
    return max(0, n)
