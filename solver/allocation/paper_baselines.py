"""The paper's baselines as the paper defines them (Sec. 5), beside today's stronger variants.

Both use single-node replicas only: a template of one node (its GPUs at TP inside the node), never
a chain of several nodes, as the paper's "2xL40S or 4xL4" (core) and "one 8xA100 or 8xH100 node
per replica" (extended) describe. Labelled `homo-paper` and `cauchy-paper` in plans.

- homo-paper: per model, in stack order and in isolation from the other models, greedily buys the
  most cost-efficient homogeneous single-node replica (`solver.allocation.baselines`'s Homo
  greedy on the single-node columns: best throughput per dollar for the model, falling back to
  the next node config only when availability runs out).
- cauchy-paper: disaggregated with phase-homogeneous replicas: each (model, phase) ranks the
  single-node configs by its own cost efficiency ($/hour per unit of throughput, cheapest
  region) and buys from the best until its demand is met (falling back only when availability
  runs out), so prefill and decode pick their node configs independently and one prefill replica
  feeds several decode replicas (the counts are free per phase). Cauchy's cost-efficiency model
  replaces Coral's ILP: no joint cost optimisation across models or phases.

Under scarcity both scale each model's demand down by Coral's rule (max-min fair across models,
then the most they can; `baselines.scale_fairly`) until they serve all of it within the budget
and availability; the paper scales every model alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from solver.allocation.baselines import (
    EPS,
    Options,
    _buy,
    _by_efficiency,
    _shortage,
    _Stock,
    homo_solution,
    priorities,
    scale_fairly,
)
from solver.allocation.problem import Column, Solution, per_model
from solver.catalog.market import Market
from solver.errors import InputError
from solver.stack import FleetConfig
from solver.types import Job

PaperBaseline = Literal["homo-paper", "cauchy-paper"]
Greedy = Callable[[FleetConfig, Market, dict[Job, float], list[Column]], Solution]


def single_node(col: Column) -> bool:
    """Whether the column's template is one node (no chain of nodes)."""
    return len(col.usage) == 1 and col.usage[0][1] == 1


def single_node_columns(columns: list[Column]) -> list[Column]:
    """The columns of single-node templates: the only replicas the paper's baselines run."""
    return [c for c in columns if single_node(c)]


def paper_baseline(
    method: PaperBaseline,
    fleet: FleetConfig,
    market: Market,
    demand: dict[Job, float],
    columns: list[Column],
) -> tuple[list[Column], Solution]:
    """Run one of the paper's baselines on the single-node columns.

    Args:
        method: homo-paper or cauchy-paper.
        fleet: the stack (model order, colocation, budget).
        market: prices, availability and GPU pools.
        demand: capacity to buy per (model, phase) at a served fraction of 1.
        columns: every (template, region) column.

    Returns:
        The single-node columns, and the solution whose counts index into them.

    Raises:
        InputError: cauchy-paper with `allocation.colocate_phases` true (the paper's Cauchy
            places each phase on its own; it does not pair them per region).
    """
    cols = single_node_columns(columns)
    if method == "homo-paper":
        return cols, homo_solution(fleet, market, demand, cols)
    if fleet.allocation.colocate_phases and any(ph == "decode" for _, ph in demand):
        raise InputError(
            "coral:fleet.allocation.colocate_phases",
            "the cauchy-paper baseline picks each phase's node config and regions on its own, "
            "so it cannot keep a model's prefill and decode in one region",
            "set colocate_phases: false (the paper's formulation), or use --baseline cauchy",
        )
    return cols, scaled_to_fit(_cauchy_greedy, fleet, market, demand, cols)


def scaled_to_fit(
    greedy: Greedy,
    fleet: FleetConfig,
    market: Market,
    demand: dict[Job, float],
    columns: list[Column],
) -> Solution:
    """`greedy` at the largest fractions of each model's demand it fully serves within the
    budget, chosen by Coral's rule (`scale_fairly`).

    Returns:
        The greedy's counts at those fractions (floored to 0.01%), and the unscaled pass's
        binding constraints when a fraction is below 1.
    """
    budget = fleet.allocation.budget_usd_per_hour

    def fits(s: Solution) -> bool:
        cost = sum(n * columns[i].price for i, n in s.counts.items())
        return s.fraction >= 1 and (budget is None or cost <= budget + 1e-6)

    full = greedy(fleet, market, demand, columns)
    if fits(full):
        return full
    fractions, best = scale_fairly(
        lambda d: greedy(fleet, market, d, columns), demand, fits, priorities(fleet)
    )
    binding = list(full.binding)
    if budget is not None:
        binding.append(
            f"budget: {budget} $/hour (or availability) lets the baseline serve "
            f"{min(fractions.values()):.1%} of a model's demand at least; raise "
            "coral:fleet.allocation.budget_usd_per_hour or availability"
        )
    return Solution(best.counts, fractions, None, binding)


def _cauchy_greedy(
    fleet: FleetConfig, market: Market, demand: dict[Job, float], columns: list[Column]
) -> Solution:
    """One pass: models in stack order, each phase on its most cost-efficient node config."""
    stock = _Stock(market, dict(market.available), dict(market.gpu_pools))
    served: dict[Job, float] = {}
    need = {j: d for j, d in demand.items() if d > 0}
    for model in fleet.models:
        for job in sorted(j for j in need if j[0] == model):
            options = [(i, c) for i, c in enumerate(columns) if c.job == job]
            for _cfg, per_cfg in sorted(_by_config(options).items(), key=_efficiency):
                _buy(stock, _by_efficiency(per_cfg), job, need)
            served[job] = min(1.0, 1 - max(need[job], 0.0) / demand[job])
    binding = [
        _shortage(job, f, stock, [c for c in columns if c.job == job]).replace(
            "Homo serves", "cauchy-paper serves"
        )
        for job, f in sorted(served.items())
        if f < 1 - EPS
    ]
    return Solution(dict(stock.counts), per_model(served), None, binding)


def _by_config(options: Options) -> dict[str, Options]:
    out: dict[str, Options] = {}
    for i, c in options:
        out.setdefault(c.usage[0][0], []).append((i, c))
    return out


def _efficiency(item: tuple[str, Options]) -> tuple[float, str]:
    """A node config's best $/hour per unit throughput over regions (config id on ties)."""
    cfg, options = item
    return min(c.price / c.template.throughput for _, c in options), cfg
