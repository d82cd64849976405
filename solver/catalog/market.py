"""What a stack can rent: price and availability per (region, node config), GPU pools, and
where the catalog sells the node as spot, its spot terms (price, zones, preemption model).

Built by the stack's market source (`coral:fleet.market`, `MarketSource`): the catalog's offers
in the stack's regions with the stack's overrides applied, or the paper's Table 1 model. No
solver imports: the allocator and the plan validator both read it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from solver.catalog.market_settings import MarketKind
from solver.catalog.offers import Catalog, Offer
from solver.catalog.paper_market import paper_node_configs, paper_slots
from solver.catalog.preemption import Preemption, offer_preemption
from solver.errors import InputError, unknown_value
from solver.stack import MarketScope

RegionId = tuple[str, str]  # (cloud, region)
Slot = tuple[RegionId, str]  # ((cloud, region), node config)


def region_name(region: RegionId) -> str:
    return f"{region[0]}:{region[1]}"


@dataclass(frozen=True)
class SpotTerms:
    """Renting one slot's node as spot: its price, the zones that sell it, how often it is
    taken back."""

    usd_per_hour: float
    zones: tuple[str, ...]
    preemption: Preemption


@dataclass(frozen=True)
class Market:
    """Prices ($/hour) and availability (nodes) per slot; GPU pools per (region, GPU type)."""

    price: dict[Slot, float]
    available: dict[Slot, int]
    gpu_pools: dict[tuple[RegionId, str], int]
    gpu_of: dict[str, tuple[str, int]]  # node config -> (GPU type, GPUs per node)
    spot: dict[Slot, SpotTerms] = field(default_factory=dict)  # the slots sold as spot

    @property
    def regions(self) -> list[RegionId]:
        return sorted({r for r, _ in self.price})

    def as_rows(self) -> list[tuple[str, str, float, int]]:
        """(region, node config, $/hour, available) per slot, sorted: for hashes and tables."""
        return [
            (region_name(r), n, self.price[(r, n)], self.available[(r, n)])
            for r, n in sorted(self.price)
        ]

    def template_price(self, region: RegionId, nodes: list[str]) -> float | None:
        """$/hour of one instance of `nodes` in `region`; None if the region lacks a node."""
        total = 0.0
        for n in nodes:
            if (region, n) not in self.price or self.available.get((region, n), 0) <= 0:
                return None
            total += self.price[(region, n)]
        return total


class MarketSource(ABC):
    """Where a stack's market comes from (`coral:fleet.market.kind`); one frozen instance per
    kind (`market_source`). Apart from the library mode (`solver.modes`): paper-helix plans in
    the paper's template space on the catalog market."""

    kind: ClassVar[MarketKind]

    @abstractmethod
    def build(self, scope: MarketScope, catalog: Catalog) -> Market:
        """The stack's market (its regions checked first by `build_market`)."""

    @abstractmethod
    def node_configs(self, scope: MarketScope, catalog: Catalog) -> tuple[list[str], list[str]]:
        """(node configs sold in some region of the stack, listed ones sold in none), in the
        stack's order: the enumeration's node list (`available_node_configs`)."""


@dataclass(frozen=True)
class CatalogMarket(MarketSource):
    """The catalog's offers in the stack's regions and node configs, then its overrides."""

    kind: ClassVar[MarketKind] = "catalog"

    def build(self, scope: MarketScope, catalog: Catalog) -> Market:
        """Offers, then the stack's prices and availability overrides.

        Raises:
            InputError: an availability override for a node no offer or price override prices.
        """
        regions = {(r.cloud, r.region) for r in scope.regions}
        wanted = set(scope.node_configs)
        price: dict[Slot, float] = {}
        available: dict[Slot, int] = {}
        spot: dict[Slot, SpotTerms] = {}
        for o in catalog.offers:
            slot: Slot = ((o.cloud, o.region), o.node)
            if slot[0] in regions and o.node in wanted:
                price[slot] = o.price_usd_per_hour
                available[slot] = o.availability
                if o.spot_price_usd_per_hour is not None:
                    spot[slot] = SpotTerms(
                        o.spot_price_usd_per_hour, tuple(o.spot_zones), _preemption(o, scope)
                    )
        for p in scope.prices:
            price[((p.cloud, p.region), p.node)] = p.usd_per_hour
        for i, a in enumerate(scope.availability):
            slot = ((str(a.cloud), a.region), a.node)
            if slot not in price:
                raise InputError(
                    f"coral:fleet.availability[{i}]",
                    f"no offer prices {a.node} in {a.cloud}:{a.region}",
                    "add a matching entry under coral:fleet.prices, or remove this override",
                )
            available[slot] = a.count
        for slot in price:
            available.setdefault(slot, 0)
        pools: dict[tuple[RegionId, str], int] = {
            ((p.cloud, p.region), p.gpu): p.gpus for p in scope.gpu_pools
        }
        gpu_of = {n: (catalog.node(n).gpu_id, catalog.node(n).gpu_count) for n in wanted}
        return Market(
            dict(sorted(price.items())),
            dict(sorted(available.items())),
            pools,
            gpu_of,
            dict(sorted(spot.items())),
        )

    def node_configs(self, scope: MarketScope, catalog: Catalog) -> tuple[list[str], list[str]]:
        """A node the stack prices itself (`coral:fleet.prices`) in one of its regions is sold
        there, as `build` prices it: paper-helix's a100-40gbx1, l4x2 and t4x2, which AWS does
        not sell, are Helix's cluster."""
        regions = {(r.cloud, r.region) for r in scope.regions}
        sold = {o.node for o in catalog.offers if (o.cloud, o.region) in regions}
        sold |= {p.node for p in scope.prices if (p.cloud, p.region) in regions}
        return [n for n in scope.node_configs if n in sold], [
            n for n in scope.node_configs if n not in sold
        ]


@dataclass(frozen=True)
class PaperMarket(MarketSource):
    """The paper's Table 1 model (`solver.catalog.paper_market`)."""

    kind: ClassVar[MarketKind] = "paper"

    def build(self, scope: MarketScope, catalog: Catalog) -> Market:
        """Table 1's slots at ample availability, then the stack's availability overrides
        (price overrides do not apply).

        Raises:
            InputError: an availability override for a slot the paper market does not sell (a GPU
                Table 1 does not price, or one the region's provider does not offer).
        """
        price = paper_slots(scope, catalog)
        available = dict.fromkeys(price, scope.market.nodes_per_slot)
        for i, a in enumerate(scope.availability):
            slot = ((str(a.cloud), a.region), a.node)
            if slot not in price:
                raise InputError(
                    f"coral:fleet.availability[{i}]",
                    f"the paper market (coral:fleet.market: paper) does not sell {a.node} in "
                    f"{a.cloud}:{a.region} (Table 1 prices H100, A100, L40S, A10G and L4; GCP "
                    "offers no L40S or A10G)",
                    "remove this override, or use market: catalog",
                )
            available[slot] = a.count
        pools: dict[tuple[tuple[str, str], str], int] = {
            ((p.cloud, p.region), p.gpu): p.gpus for p in scope.gpu_pools
        }
        gpu_of = {
            n: (catalog.node(n).gpu_id, catalog.node(n).gpu_count) for n in set(scope.node_configs)
        }
        return Market(price, available, pools, gpu_of)

    def node_configs(self, scope: MarketScope, catalog: Catalog) -> tuple[list[str], list[str]]:
        return paper_node_configs(scope, catalog)


# One source per `MarketSettings.kind` (tests/templates/test_modes.py checks it).
MARKET_SOURCES: dict[str, MarketSource] = {m.kind: m for m in (CatalogMarket(), PaperMarket())}


def market_source(scope: MarketScope) -> MarketSource:
    """The stack's market source, chosen here only from `coral:fleet.market.kind` (checked when
    the stack is parsed)."""
    return MARKET_SOURCES[scope.market.kind]


def build_market(scope: MarketScope, catalog: Catalog) -> Market:
    """The stack's market: its regions checked, then built by its source (`market_source`): the
    catalog's offers in its regions and node configs with its overrides, or the paper's.

    Raises:
        InputError: a region no offer or price override sells in (with the closest known
            ones), or an availability override for a node the market does not price.
    """
    check_regions(scope, catalog)
    return market_source(scope).build(scope, catalog)


def check_regions(scope: MarketScope, catalog: Catalog) -> None:
    """Every region of the stack is one the catalog sells in for its cloud, or one the stack
    prices itself (`prices`); a misspelt one would otherwise be silently empty.

    Raises:
        InputError: naming `coral:fleet.regions[i].region`, with the closest known regions and,
            when the region belongs to the other cloud, the cloud to set.
    """
    priced = {(p.cloud, p.region) for p in scope.prices}
    sold = set(catalog.regions)
    for i, r in enumerate(scope.regions):
        if (r.cloud, r.region) in sold or (r.cloud, r.region) in priced:
            continue
        field = f"coral:fleet.regions[{i}].region"
        known = [name for cloud, name in sold if cloud == r.cloud]
        guess = unknown_value(field, r.region, known, f"{r.cloud} region")
        problem = guess.problem + " (the catalog sells no node config there)"
        other = sorted(cloud for cloud, name in sold if name == r.region and cloud != r.cloud)
        if other:
            problem += f"; {r.region} is a region of {other[0]}"
        fix = (f"set cloud: {other[0]}, or " if other else "") + guess.fix
        raise InputError(
            field, problem, fix + " (or price it under coral:fleet.prices)", guess.suggestions
        )


def check_something_available(market: Market, scope: MarketScope) -> None:
    """At least one (region, node config) of the stack has a node to rent. A check of the
    stack as written (`solver.validation.check_fleet`), not of every market: a simulated epoch
    may scale availability to 0 on purpose.

    Raises:
        InputError: every slot has availability 0, so any plan would have no instance.
    """
    if any(market.available[slot] > 0 for slot in market.price):
        return
    regions = ", ".join(f"{r.cloud}:{r.region}" for r in scope.regions)
    offered = "; ".join(f"{region_name(r)} {n}" for r, n in market.price) or "none"
    raise InputError(
        "coral:fleet.availability",
        f"no node config of node_configs ({', '.join(scope.node_configs)}) is available in any "
        f"region of the stack ({regions}); offered slots, all with 0 nodes: {offered}",
        "raise a count under coral:fleet.availability, or add regions or node_configs the "
        "catalog offers (`coral catalog show`)",
    )


def _preemption(offer: Offer, scope: MarketScope) -> Preemption:
    """The offer's preemption model: the stack's most specific matching override
    (`coral:fleet.preemption`), else the shipped one (`offer_preemption`)."""
    shipped = offer_preemption(offer)
    matching = [o for o in scope.preemption if o.matches(offer.cloud, offer.region, offer.node)]
    if not matching:
        return shipped
    own = max(matching, key=lambda o: o.specificity)
    correlation = own.zone_correlation
    return Preemption(
        rate_per_hour=own.rate_per_hour,
        zone_correlation=shipped.zone_correlation if correlation is None else correlation,
        source=f"stack: {own.source}",
    )
