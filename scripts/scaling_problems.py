"""Generate allocation problems k times the size of a stack's (issue #20's scaling family).

A stack cannot name a model twice (models are model cards), so the family is generated at the
problem level, from a real stack's columns: scale k has k copies of every model (each copy's
demand the original's times a factor drawn in [0.5, 1.5]) and 3 + 3 (k - 1) regions (the stack's,
then copies of them whose node prices are the originals times a factor drawn in [0.85, 1.25]
per node config, with the same availability and GPU pools). Columns grow as k^2: scale 5 of
paper-extended has 5x its demand rows and 5x its regions (25x its columns). Same seed, same
problems.

Used by `scripts/bench_allocation.py --scaling`.
"""

from __future__ import annotations

import random
from dataclasses import replace

from solver.allocation.problem import Column, Problem
from solver.catalog.market import Market, RegionId
from solver.types import Job


def scaled_problem(base: Problem, k: int, seed: int = 0) -> Problem:
    """`base` with k copies of each model and k times its regions (module doc)."""
    rng = random.Random(seed)
    regions = sorted({c.region for c in base.columns})
    copies: dict[RegionId, tuple[RegionId, dict[str, float]]] = {r: (r, {}) for r in regions}
    nodes = sorted({n for c in base.columns for n, _ in c.usage})
    for copy in range(1, k):
        for r in regions:
            new = (r[0], f"{r[1]}-x{copy}")
            copies[new] = (r, {n: rng.uniform(0.85, 1.25) for n in nodes})
    market = _market(base.market, copies)
    demand: dict[Job, float] = {}
    columns: list[Column] = []
    for copy in range(k):
        factors = {m: 1.0 if copy == 0 else rng.uniform(0.5, 1.5) for m, _ in base.demand}
        for job, d in sorted(base.demand.items()):
            demand[_job(job, copy)] = d * factors[job[0]]
        for region, (origin, _) in copies.items():
            for c in base.columns:
                if c.region != origin:
                    continue
                price = (
                    c.price
                    if region == origin
                    else sum(market.price[(region, n)] * u for n, u in c.usage)
                )
                t = (
                    c.template
                    if copy == 0
                    else c.template.model_copy(update={"model": _job(c.job, copy)[0]})
                )
                columns.append(Column(_job(c.job, copy), region, t, price, c.usage))
    return replace(base, demand=demand, columns=columns, market=market, running={})


def _job(job: Job, copy: int) -> Job:
    return job if copy == 0 else (f"{job[0]}~{copy}", job[1])


def _market(base: Market, copies: dict[RegionId, tuple[RegionId, dict[str, float]]]) -> Market:
    price, available, pools = dict(base.price), dict(base.available), dict(base.gpu_pools)
    for region, (origin, scale) in copies.items():
        if region == origin:
            continue
        for (r, n), p in base.price.items():
            if r == origin:
                price[(region, n)] = p * scale.get(n, 1.0)
                available[(region, n)] = base.available[(r, n)]
        for (r, g), count in base.gpu_pools.items():
            if r == origin:
                pools[(region, g)] = count
    return Market(price, available, pools, base.gpu_of)
