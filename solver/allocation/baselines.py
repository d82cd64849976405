"""The paper's baselines (Sec. 5), run on the same templates, market and demand as Coral.

- Homo: every replica on one node config (several nodes of it at most). Per model, in stack
  order and in isolation from the other models, it greedily picks the node config with the best
  throughput per dollar for both phases, then buys the most cost-efficient (region, template) of
  that config until demand is met. When availability runs out it falls back to the next best
  config. It respects every constraint Coral's allocation does:
  - availability per (region, node config) and GPU pools: consumed as it buys;
  - `colocate_phases`: a disaggregated model buys region by region, opening a region only with
    room for at least one prefill and one decode instance there (regions already open are
    filled first, so an extra partner instance is bought only when no open region has room);
  - the budget: spent as it buys, like availability, so a config whose next instance the
    budget cannot pay for gives way to the next best one;
  - demand it cannot meet: each model's demand is scaled down by the rule
    Coral's ILP follows (max-min fair across models, then the most it can; `scale_fairly`)
    until Homo serves all of it within the budget, and the plan's `binding` says which of
    availability, GPU pools, colocation or the budget stopped it. (The paper scales every
    model alike, so one model it cannot serve left it serving nothing.)
- Cauchy-like: disaggregated, so prefill and decode may use different node configs, but each
  phase's replicas are homogeneous. It uses Coral's allocation ILP restricted to those
  templates, so one prefill replica may feed several decode replicas, costs are optimised
  jointly, and every constraint of the ILP holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from solver.allocation.problem import Column, Solution, priority_tiers, scaled_demand
from solver.catalog.market import Market, RegionId, region_name
from solver.stack import AllocationSettings, ModelSpec
from solver.types import Job, per_model

EPS = 1e-9
Options = list[tuple[int, Column]]  # (column index, column)
ByConfig = dict[str, dict[Job, Options]]  # node config -> job -> its homogeneous columns


def homogeneous(col: Column) -> bool:
    """Whether every node of the column's template is of one node config."""
    return len(col.usage) == 1


def cauchy_columns(columns: list[Column]) -> list[Column]:
    """Cauchy-like's columns: the single-node-config templates, for Coral's own ILP."""
    return [c for c in columns if homogeneous(c)]


def homo_solution(
    models: Mapping[str, ModelSpec],
    allocation: AllocationSettings,
    market: Market,
    demand: dict[Job, float],
    columns: list[Column],
) -> Solution:
    """Greedy Homo allocation (see module doc) at the largest fractions of each model's demand
    it can fully serve within the budget, chosen by Coral's rule (`scale_fairly`).

    Args:
        models: the stack's models (their order and priorities).
        allocation: the stack's allocation settings (`colocate_phases`, the budget).
        market: prices, availability and GPU pools.
        demand: capacity to buy per (model, phase), at a served fraction of 1.
        columns: every (template, region) column; Homo uses the homogeneous ones.

    Returns:
        Instance counts per column, the served fraction per model (floored to 0.01%, never
        above what the counts serve) and, when one is below 1, the binding constraints in words.
    """
    budget = allocation.budget_usd_per_hour
    full = _homo_greedy(models, allocation, market, demand, columns)
    if full.fraction >= 1 and _within(full, columns, budget):
        return full
    # Under a budget the greedy spends it as it buys, like availability: a config whose next
    # instance the budget cannot pay for gives way to the next one (a pair of the most
    # efficient config may cost more than the whole budget where a cheaper config fits).
    fractions, best = scale_fairly(
        lambda d: _homo_greedy(models, allocation, market, d, columns, budget),
        demand,
        lambda s: s.fraction >= 1 and _within(s, columns, budget),
        priorities(models),
    )
    if min(fractions.values(), default=1.0) >= 1:  # a cheaper config serves it all in budget
        return best
    binding = list(full.binding)
    if budget is not None and not _within(full, columns, budget):
        binding.append(
            f"budget: {budget} $/hour lets Homo serve {min(fractions.values()):.1%} of a model's "
            f"demand at least; it needs {_cost(full, columns):.2f} $/hour to serve "
            f"{full.fraction:.1%}; raise coral:fleet.allocation.budget_usd_per_hour"
        )
    return Solution(best.counts, fractions, None, binding)


def priorities(models: Mapping[str, ModelSpec]) -> dict[str, int]:
    """Each model's `priority` in the stack, in the stack's order."""
    return {m: spec.priority for m, spec in models.items()}


FAIR_STEPS = 14  # bisection steps of a baseline's common fraction: to 1/16384
RAISE = 0.005  # a model is held at the common fraction when 0.5% more no longer fits


def scale_fairly(
    run: Callable[[dict[Job, float]], Solution],
    demand: dict[Job, float],
    fits: Callable[[Solution], bool],
    priorities: dict[str, int],
) -> tuple[dict[str, float], Solution]:
    """A greedy baseline judged by Coral's rule: the fraction of each model's demand it serves
    in full (`fits`), max-min fair within each priority tier (highest first), then as much
    more as it can. Progressive filling: the largest common fraction of the tier's models not
    yet held (bisection), then the ones that cannot take `RAISE` more alone are held there and
    the rest go on from it. A model no fraction of which fits stays at 0 and buys nothing; when
    no common fraction fits although each model alone may, the model whose absence lets the
    others share the most stays at 0 instead of all of them.

    Returns:
        The fraction per model (floored to 0.01%) and the greedy's run at those fractions.
    """
    models = sorted({j[0] for j, d in demand.items() if d > 0})

    def at(fractions: dict[str, float]) -> Solution:
        return run(scaled_demand(demand, fractions))

    def ok(held: dict[str, float], active: set[str], t: float, raised: str | None = None) -> bool:
        """Whether the greedy serves `held`, the `active` models at `t` (`raised` at t + RAISE)."""
        trial = held | dict.fromkeys(active, t)
        if raised is not None:
            trial[raised] = min(1.0, t + RAISE)
        return fits(at(trial))

    def common(held: dict[str, float], active: set[str], lo: float) -> float:
        """The largest fraction (from `lo`, floored to 0.01%) all `active` models fit at."""
        if ok(held, active, 1.0):
            return 1.0
        hi = 1.0
        for _ in range(FAIR_STEPS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(held, active, mid) else (lo, mid)
        return math.floor(lo * 10_000) / 10_000

    held: dict[str, float] = {}
    for tier in priority_tiers(models, priorities):
        active, lo = set(tier), 0.0
        while active:
            t = common(held, active, lo)
            if t <= 0 and len(active) > 1:
                # No common fraction fits although each model alone may: whole instances of
                # some crowd out another (on paper-extended-scarce one instance each of four
                # models takes the GPU pools llama3.1-70b needs). Leave out the model whose
                # absence lets the others share the most; it stays at 0.
                # When no single absence is enough (only one of three fits at a time), one
                # goes anyway and the rest try again.
                rest = {m: common(held | {m: 0.0}, active - {m}, 0.0) for m in sorted(active)}
                out = max(rest, key=lambda m: rest[m])
                if rest[out] > 0 or len(active) > 2:
                    held[out] = 0.0
                    active.discard(out)
                    continue
            stuck = {m for m in active if t >= 1 or not ok(held, active, t, m)} or set(active)
            held |= dict.fromkeys(stuck, t)
            active -= stuck
            lo = t
    return held, at(held)


def _cost(solution: Solution, columns: list[Column]) -> float:
    return sum(n * columns[i].price for i, n in solution.counts.items())


def _within(solution: Solution, columns: list[Column], budget: float | None) -> bool:
    return budget is None or _cost(solution, columns) <= budget + 1e-6


@dataclass
class _Stock:
    """What is left to buy from (nodes per slot, GPUs per pool) and what was bought."""

    market: Market
    left: dict[tuple[RegionId, str], int]
    pools: dict[tuple[RegionId, str], int]
    budget: float = math.inf  # $/hour left to spend
    counts: dict[int, int] = field(default_factory=dict)
    skipped: dict[str, list[str]] = field(default_factory=dict)  # model -> sites not opened

    def room(self, col: Column) -> int:
        """How many more instances of `col` fit in the nodes and GPU pools left."""
        n = min(self.left[(col.region, node)] // k for node, k in col.usage)
        for node, k in col.usage:
            gpu, per_node = self.market.gpu_of[node]
            if (col.region, gpu) in self.pools:
                n = min(n, self.pools[(col.region, gpu)] // (k * per_node))
        if col.price > 0 and math.isfinite(self.budget):
            n = min(n, math.floor((self.budget + 1e-6) / col.price))
        return max(0, n)

    def take(self, i: int, col: Column, n: int) -> None:
        """Buy `n` instances of column `i` (n may be negative to give them back)."""
        self.counts[i] = self.counts.get(i, 0) + n
        if not self.counts[i]:
            del self.counts[i]
        self.budget -= n * col.price
        for node, k in col.usage:
            self.left[(col.region, node)] -= n * k
            gpu, per_node = self.market.gpu_of[node]
            if (col.region, gpu) in self.pools:
                self.pools[(col.region, gpu)] -= n * k * per_node


def _homo_greedy(
    models: Mapping[str, ModelSpec],
    allocation: AllocationSettings,
    market: Market,
    demand: dict[Job, float],
    columns: list[Column],
    budget: float | None = None,
) -> Solution:
    """One greedy pass; availability (and `budget`, $/hour) is consumed model by model, in
    stack order."""
    stock = _Stock(
        market,
        dict(market.available),
        dict(market.gpu_pools),
        math.inf if budget is None else budget,
    )
    homo = [(i, c) for i, c in enumerate(columns) if homogeneous(c)]
    served: dict[Job, float] = {}
    for model in models:
        jobs = sorted(j for j in demand if j[0] == model and demand[j] > 0)
        by_config: ByConfig = {}
        for i, c in homo:
            if c.job in jobs:
                by_config.setdefault(c.usage[0][0], {}).setdefault(c.job, []).append((i, c))
        order = sorted(
            by_config, key=lambda cfg: (_cost_estimate(by_config[cfg], jobs, demand), cfg)
        )
        need = {j: demand[j] for j in jobs}
        if allocation.colocate_phases and {ph for _, ph in jobs} >= {"prefill", "decode"}:
            _buy_colocated(stock, by_config, order, jobs, need, demand)
        else:
            for job in jobs:
                for cfg in order:
                    _buy(stock, _by_efficiency(by_config[cfg].get(job, [])), job, need)
        for job in jobs:
            served[job] = min(1.0, 1 - max(need[job], 0.0) / demand[job])
    binding = [
        _shortage(job, f, stock, [c for _, c in homo if c.job == job])
        for job, f in sorted(served.items())
        if f < 1 - EPS
    ]
    return Solution(dict(stock.counts), per_model(served), None, binding)


def _by_efficiency(options: Options) -> Options:
    """Cheapest $/hour per unit of throughput first; column index breaks ties."""
    return sorted(options, key=lambda ic: (ic[1].price / ic[1].template.throughput, ic[0]))


def _buy(stock: _Stock, options: Options, job: Job, need: dict[Job, float]) -> None:
    """Buy `job`'s remaining need from `options`, in their order, as far as stock allows."""
    for i, c in options:
        if need[job] <= EPS:
            return
        n = min(math.ceil(need[job] / c.template.throughput - EPS), stock.room(c))
        if n > 0:
            stock.take(i, c, n)
            need[job] -= n * c.template.throughput


def _buy_colocated(
    stock: _Stock,
    by_config: ByConfig,
    order: list[str],
    jobs: list[Job],
    need: dict[Job, float],
    demand: dict[Job, float],
) -> None:
    """A disaggregated model under `colocate_phases`: buy site by site, (node config, region)
    in the config order, each config's regions cheapest first.

    A region opens with one instance of each phase there. Three passes, each only if the
    earlier ones left demand: regions open on the site's own config while every phase still
    needs capacity; then a phase without room on it may open on the next config in order with
    room in that region; then regions open for one phase's remainder, with one partner
    instance of the other (bought only for colocation).
    """
    sites = _sites(by_config, order, jobs, demand)
    opened: set[RegionId] = set()
    for fallback, partner in ((False, False), (True, False), (True, True)):
        for (_cfg, region), here in sites.items():
            if all(need[j] <= EPS for j in jobs):
                return
            if region not in opened:
                if not partner and any(need[j] <= EPS for j in jobs):
                    continue
                others = order if fallback else []
                options = {
                    j: here.get(j, []) + [o for c in others for o in sites[(c, region)].get(j, [])]
                    for j in jobs
                }
                if not _open(stock, options, jobs, need):
                    if partner:
                        stock.skipped.setdefault(jobs[0][0], []).append(region_name(region))
                    continue
                opened.add(region)
            for job in jobs:
                _buy(stock, here.get(job, []), job, need)


def _sites(
    by_config: ByConfig, order: list[str], jobs: list[Job], demand: dict[Job, float]
) -> dict[tuple[str, RegionId], dict[Job, Options]]:
    """(node config, region) -> each phase's options there, most efficient first.

    Keys come in config order, and per config the cheapest regions for both phases first
    (regions where that config cannot serve both phases last); every pair is a key.
    """
    regions = sorted({c.region for per in by_config.values() for o in per.values() for _, c in o})
    out: dict[tuple[str, RegionId], dict[Job, Options]] = {}
    for cfg in order:
        here: dict[RegionId, dict[Job, Options]] = {r: {} for r in regions}
        for job, options in by_config[cfg].items():
            for i, c in _by_efficiency(options):
                here[c.region].setdefault(job, []).append((i, c))
        for r in sorted(regions, key=lambda r: (_cost_estimate(here[r], jobs, demand), r)):
            out[(cfg, r)] = here[r]
    return out


def _open(stock: _Stock, here: dict[Job, Options], jobs: list[Job], need: dict[Job, float]) -> bool:
    """Buy one instance of every phase in a region (the first of its options with room), or
    nothing when one phase has no room there."""
    bought: list[tuple[int, Column]] = []
    for job in jobs:
        pick = next(((i, c) for i, c in here.get(job, []) if stock.room(c) > 0), None)
        if pick is None:
            for i, c in bought:
                stock.take(i, c, -1)
            return False
        stock.take(*pick, 1)
        bought.append(pick)
    for _, c in bought:
        need[c.job] -= c.template.throughput
    return True


def _cost_estimate(per_job: dict[Job, Options], jobs: list[Job], demand: dict[Job, float]) -> float:
    """$/hour to serve every phase of a model on one node config at its best efficiency."""
    if any(j not in per_job for j in jobs):
        return math.inf  # this config cannot serve every phase
    return sum(
        demand[j] * min(c.price / c.template.throughput for _, c in per_job[j]) for j in jobs
    )


def _shortage(job: Job, served: float, stock: _Stock, cols: list[Column]) -> str:
    """Why Homo serves only part of a job: the nodes, pools and colocation that stopped it."""
    text = f"{job[0]} {job[1]}: Homo serves {100 * served:.1f}% of its demand"
    if not cols:
        return f"{text}; no single-node-config template of it is sold in the stack's regions"
    full, pools = _exhausted(stock, cols)
    if full:
        more = " ..." if len(full) > 6 else ""
        text += (
            f"; no room for one more of its one-config instances at {', '.join(full[:6])}"
            f"{more}: raise those under coral:fleet.availability"
        )
    if pools:
        text += f"; GPU pools short at {', '.join(pools)}: raise them under coral:fleet.gpu_pools"
    skipped = stock.skipped.get(job[0], [])
    if skipped:
        text += (
            f"; colocate_phases needs its prefill and decode in one region, and "
            f"{', '.join(sorted(set(skipped))[:6])} had room for only one of them "
            f"(or set coral:fleet.allocation.colocate_phases: false)"
        )
    return text


def _exhausted(stock: _Stock, cols: list[Column]) -> tuple[list[str], list[str]]:
    """The (region, node config) slots and GPU pools where none of `cols` fits any more."""
    market = stock.market
    nodes: dict[tuple[RegionId, str], int] = {}  # slot -> fewest nodes an instance needs there
    gpus: dict[tuple[RegionId, str], int] = {}  # pool -> fewest GPUs an instance needs there
    for c in cols:
        for node, k in c.usage:
            gpu, per_node = market.gpu_of[node]
            nodes[(c.region, node)] = min(nodes.get((c.region, node), k), k)
            if (c.region, gpu) in stock.pools:
                gpus[(c.region, gpu)] = min(gpus.get((c.region, gpu), k * per_node), k * per_node)
    full = [
        f"{region_name(slot[0])} {slot[1]} ({stock.left[slot]} of {market.available[slot]} "
        f"nodes left)"
        for slot, k in sorted(nodes.items())
        if stock.left[slot] < k
    ]
    pools = [
        f"{region_name(pool[0])} {pool[1]} ({stock.pools[pool]} of {market.gpu_pools[pool]} "
        f"GPUs left)"
        for pool, g in sorted(gpus.items())
        if stock.pools[pool] < g
    ]
    return full, pools
