"""Why a plan serves less than all demand: the constraints at their limit, in words a user can
act on (each line names the `coral:fleet` key to raise). Notation: `constraints`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog

from solver.allocation.constraints import FRACTION_STEPS, Row, Slot
from solver.allocation.problem import Column, Problem
from solver.catalog.market import Market, RegionId, region_name
from solver.types import Job


@dataclass(frozen=True)
class MostServed:
    """The solved most-served model: its counts nu, its rows, phi, and phi without the budget."""

    counts: dict[int, int]
    slot_rows: dict[Slot, Row]
    pool_rows: dict[tuple[RegionId, str], Row]
    phi_steps: int
    unbudgeted_steps: int | None  # None: the stack sets no budget


def binding(problem: Problem, solved: MostServed, whole: Problem | None = None) -> list[str]:
    """Constraints at their limit in the most-served solution of `problem`, each as an
    actionable line; jobs short even alone are judged on `whole` (default `problem`), the
    problem before columns that could never serve were dropped."""
    out = [
        *_full_slots(problem, solved),
        *_full_pools(solved),
        *_budget(problem, solved),
        *_short_alone(whole or problem),
    ]
    return out or [_no_common_instance(problem)]


def _full_slots(problem: Problem, solved: MostServed) -> list[str]:
    """(r, c) with sum_t U[c,t] nu[r,t] = A[r,c] > 0, with the jobs using its nodes."""
    users: dict[Slot, dict[Job, int]] = {}
    for i, n in solved.counts.items():
        c = problem.columns[i]
        for node, k in c.usage if n else ():
            per = users.setdefault((c.region, node), {})
            per[c.job] = per.get(c.job, 0) + n * k
    out = []
    for (region, node), (expr, limit) in solved.slot_rows.items():
        if limit > 0 and expr.solution_value() >= limit - 1e-6:
            who = ", ".join(
                f"{m} {ph} {k}" for (m, ph), k in sorted(users.get((region, node), {}).items())
            )
            out.append(
                f"{region_name(region)} {node}: all {limit} available nodes are in use ({who}); "
                f"raise its count under coral:fleet.availability, or allow another region or node config"
            )
    return out


def _full_pools(solved: MostServed) -> list[str]:
    """(r, g) with its pool P[r,g] > 0 all in use."""
    return [
        f"{region_name(region)} {gpu} GPU pool: all {limit} GPUs are in use; "
        f"raise it under coral:fleet.gpu_pools"
        for (region, gpu), (expr, limit) in solved.pool_rows.items()
        if limit > 0 and expr.solution_value() >= limit - 1e-6
    ]


def _budget(problem: Problem, solved: MostServed) -> list[str]:
    """The budget, when lifting it serves more. Integer instances rarely spend a budget
    exactly, so this compares phi with the most-served phi without the budget."""
    budget = problem.settings.budget_usd_per_hour
    if budget is None or solved.unbudgeted_steps is None:
        return []
    if solved.unbudgeted_steps <= solved.phi_steps:
        return []
    return [
        f"budget: {budget} $/hour serves {solved.phi_steps / FRACTION_STEPS:.1%} "
        f"of demand, without it {solved.unbudgeted_steps / FRACTION_STEPS:.1%}; "
        f"raise coral:fleet.allocation.budget_usd_per_hour"
    ]


def _short_alone(problem: Problem) -> list[str]:
    """Jobs m whose columns cannot reach D[m] even with every node to themselves: the most
    throughput its columns reach sharing the region's available nodes and GPU pools among
    themselves alone (`_alone_throughput`, an LP: an upper bound on what it can be served)."""
    cols, market = problem.columns, problem.market
    out = []
    for job in sorted(problem.demand):
        d = problem.demand[job]
        mine = [c for c in cols if c.job == job]
        if d <= 0:
            continue
        if not mine:
            out.append(
                f"{job[0]} {job[1]}: no serving template fits any region's node configs; "
                f"add larger node configs or regions, or relax its SLO"
            )
            continue
        alone = _alone_throughput(mine, market)
        if alone >= d * (1 - 1e-9):
            continue
        short = sorted(
            {
                f"{n} in {region_name(c.region)} ({market.available[(c.region, n)]})"
                for c in mine
                for n, _ in c.usage
            }
        )
        out.append(
            f"{job[0]} {job[1]}: even with every available node to itself (no other model or "
            f"phase on any) it could get at most {100 * alone / d:.0f}% of its demand; its "
            f"templates use {', '.join(short[:6])}{' ...' if len(short) > 6 else ''} (available "
            f"nodes in brackets): raise those under coral:fleet.availability or gpu_pools"
        )
    return out


def _alone_throughput(cols: list[Column], market: Market) -> float:
    """The most throughput `cols` (one job's) reach on the available nodes and GPU pools of
    their regions, fractional instances allowed: each node config and pool shared among the
    job's own columns, not counted once per column."""
    rows: dict[tuple[object, ...], dict[int, float]] = {}
    limits: dict[tuple[object, ...], float] = {}
    for k, c in enumerate(cols):
        for n, count in c.usage:
            key: tuple[object, ...] = ("node", c.region, n)
            rows.setdefault(key, {})[k] = rows.get(key, {}).get(k, 0.0) + count
            limits[key] = market.available[(c.region, n)]
            gpu, per_node = market.gpu_of[n]
            if (c.region, gpu) in market.gpu_pools:
                pool: tuple[object, ...] = ("pool", c.region, gpu)
                rows.setdefault(pool, {})[k] = rows.get(pool, {}).get(k, 0.0) + count * per_node
                limits[pool] = market.gpu_pools[(c.region, gpu)]
    a = np.zeros((len(rows), len(cols)))
    for r, key in enumerate(rows):
        for k, v in rows[key].items():
            a[r, k] = v
    b = np.array([limits[key] for key in rows])
    gain = -np.array([c.template.throughput for c in cols])
    result = linprog(gain, A_ub=a, b_ub=b, bounds=(0, None), method="highs")
    return float(-result.fun) if result.status == 0 else 0.0


def _no_common_instance(problem: Problem) -> str:
    """phi = 0 with nothing saturated: the jobs cannot all get one instance at once."""
    jobs = sorted(j for j, d in problem.demand.items() if d > 0)
    options = "; ".join(
        f"{m} {ph}: "
        + ", ".join(sorted({n for c in problem.columns if c.job == (m, ph) for n, _ in c.usage}))
        for m, ph in jobs
    )
    return (
        f"the available nodes cannot give all {len(jobs)} (model, phase) pairs one instance "
        f"each at the same time. Node configs each can use: {options}. Raise their availability"
    )
