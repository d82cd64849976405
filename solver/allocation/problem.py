"""The allocation problem as data: one column per (serving template, region), the demand per
(model, phase), the market, and the running plan nu0; and what a solve gives back."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from solver.catalog.market import Market, RegionId
from solver.plan_schema import SolverReport, market_template
from solver.serving.serving_template import ServingTemplate
from solver.stack import AllocationSettings, SpotSettings
from solver.types import BUCKET_SEP, Job

RunningKey = tuple[str, str, str, str, str]  # (model, phase, cloud, region, template key)


@dataclass(frozen=True)
class Column:
    """One choice of the ILP: a template of one (model, phase) in one region, on-demand or
    (with `zone`) as spot instances in one zone of the region.

    A spot column's template throughput is what an instance gives on average, net of the
    time it is down after a preemption while its replacement boots (`spot_columns`);
    `nominal` is its throughput while up."""

    job: Job
    region: RegionId
    template: ServingTemplate
    price: float
    usage: tuple[tuple[str, int], ...]  # node config -> nodes per instance
    zone: str | None = None  # spot: the zone its instances run in; None: on-demand
    nominal: float = 0.0  # spot: the template's throughput while up

    @property
    def is_spot(self) -> bool:
        return self.zone is not None

    @property
    def full_throughput(self) -> float:
        """An instance's throughput while it runs (a spot column's before its downtime)."""
        return self.nominal if self.zone is not None else self.template.throughput

    @property
    def running_key(self) -> RunningKey:
        key = market_template(self.template.key, self.zone)
        return (*self.job, self.region[0], self.region[1], key)


@dataclass(frozen=True)
class Problem:
    demand: dict[Job, float]
    columns: list[Column]
    market: Market
    settings: AllocationSettings
    running: dict[RunningKey, int] = field(default_factory=dict)  # nu0
    # Under scarcity, higher-priority models are served first (model -> priority, default 0).
    priorities: dict[str, int] = field(default_factory=dict)
    # Each (model, phase) on one node config (Cauchy's phase-homogeneous replicas, the paper's
    # cauchy-paper baseline): `constraints.add_one_config`.
    one_config_per_job: bool = False


@dataclass(frozen=True)
class Solution:
    counts: dict[int, int]  # column index -> instances
    fractions: dict[str, float]  # model -> served fraction of its demand (1 when served in full)
    report: SolverReport | None  # None for the greedy baseline
    binding: list[str]
    columns: tuple[int, int] = (0, 0)  # (before, after) reduction, summed over the solves

    @property
    def fraction(self) -> float:
        """The least served fraction of any model (1 when every model is served in full)."""
        return min(self.fractions.values(), default=1.0)


def scaled_demand(demand: dict[Job, float], fractions: dict[str, float]) -> dict[Job, float]:
    """Each job's demand times its model's fraction (0 for a model without one)."""
    return {job: d * fractions.get(job[0], 0.0) for job, d in demand.items()}


def priority_tiers(models: list[str], priorities: dict[str, int]) -> list[frozenset[str]]:
    """`models` grouped by priority (default 0), highest first. A length bucket
    (``<model>@b<i>``) takes its model's priority."""
    by: dict[int, set[str]] = {}
    for m in models:  # a bucket is keyed by its own name in a routed fleet, else its model's
        by.setdefault(priorities.get(m, priorities.get(m.split(BUCKET_SEP)[0], 0)), set()).add(m)
    return [frozenset(by[p]) for p in sorted(by, reverse=True)]


def make_columns(
    templates: dict[Job, list[ServingTemplate]],
    market: Market,
    demand: dict[Job, float],
    spot: SpotRules | None = None,
) -> list[Column]:
    """Every (template, region) pair whose region sells all of the template's nodes, and with
    `spot` (the stack allows spot) its spot columns after each (`spot_columns`).

    The price is `Market.template_price`'s (the same sum, in the same order); the region's
    prices are looked up once per region rather than once per (template, region, node).
    """
    sellers = {region: _selling(market, region) for region in market.regions}
    columns = []
    for job in sorted(demand):
        if demand[job] <= 0:
            continue
        for t in templates.get(job, []):
            kinds = set(t.nodes)
            usage: tuple[tuple[str, int], ...] | None = None
            for region, prices in sellers.items():
                if not kinds <= prices.keys():
                    continue
                price = 0.0
                for n in t.nodes:
                    price += prices[n]
                usage = usage or tuple(sorted(Counter(t.nodes).items()))
                columns.append(Column(job, region, t, price, usage))
                if spot is not None:
                    columns.extend(spot_columns(columns[-1], market, spot))
    return columns


@dataclass(frozen=True)
class SpotRules:
    """What spot columns are made with: the stack's spot settings and the hours a replacement
    needs to boot (`allocation.boot_minutes`)."""

    settings: SpotSettings
    boot_hours: float


def spot_columns(col: Column, market: Market, spot: SpotRules) -> list[Column]:
    """`col`'s template as spot instances, one column per zone that sells every node of it as
    spot (the first `zones_per_region` by name); none when a node has no spot price there.

    Price: the sum of the nodes' spot prices. Throughput: the template's times the share of
    time an instance serves, 1 / (1 + lambda B), with lambda the sum of its nodes' preemption
    rates per hour (any node lost takes the instance down) and B the boot hours a
    replacement takes: an instance alternates up (mean 1 / lambda) and down (B).
    """
    terms = [market.spot.get((col.region, n)) for n in col.template.nodes]
    if any(t is None for t in terms):
        return []
    sold = [t for t in terms if t is not None]
    zones = sorted(set.intersection(*(set(t.zones) for t in sold)))
    rate = sum(t.preemption.rate_per_hour for t in sold)
    serving = 1.0 / (1.0 + rate * spot.boot_hours)
    price = 0.0
    for t in sold:
        price += t.usd_per_hour
    template = col.template.model_copy(update={"throughput": col.template.throughput * serving})
    return [
        Column(col.job, col.region, template, price, col.usage, zone, col.template.throughput)
        for zone in zones[: spot.settings.zones_per_region]
    ]


def _selling(market: Market, region: RegionId) -> dict[str, float]:
    """Node config -> $/hour of the nodes `region` has available (`template_price`'s rule)."""
    return {
        n: p
        for (r, n), p in market.price.items()
        if r == region and market.available.get((r, n), 0) > 0
    }


def upper_bound(col: Column, market: Market, demand: float) -> int:
    """Most instances worth buying: what availability allows, and no more than demand needs."""
    by_avail = min(market.available[(col.region, n)] // c for n, c in col.usage)
    by_pool = min(
        (
            market.gpu_pools[(col.region, market.gpu_of[n][0])] // (c * market.gpu_of[n][1])
            for n, c in col.usage
            if (col.region, market.gpu_of[n][0]) in market.gpu_pools
        ),
        default=by_avail,
    )
    return max(0, min(by_avail, by_pool, math.ceil(demand / col.template.throughput - 1e-9)))
