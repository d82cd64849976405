"""What a stack can rent: price and availability per (region, node config), and GPU pools.

Built from the catalog's offers in the stack's regions, with the stack's overrides applied. No
solver imports: the allocator and the plan validator both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.catalog.offers import Catalog
from solver.catalog.paper_market import paper_slots
from solver.errors import InputError, unknown_value
from solver.stack import FleetConfig

RegionId = tuple[str, str]  # (cloud, region)
Slot = tuple[RegionId, str]  # ((cloud, region), node config)


def region_name(region: RegionId) -> str:
    return f"{region[0]}:{region[1]}"


@dataclass(frozen=True)
class Market:
    """Prices ($/hour) and availability (nodes) per slot; GPU pools per (region, GPU type)."""

    price: dict[Slot, float]
    available: dict[Slot, int]
    gpu_pools: dict[tuple[RegionId, str], int]
    gpu_of: dict[str, tuple[str, int]]  # node config -> (GPU type, GPUs per node)

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


def build_market(fleet: FleetConfig, catalog: Catalog) -> Market:
    """The stack's market: catalog offers in its regions and node configs, then its overrides.

    Raises:
        InputError: a region no offer or price override sells in (with the closest known
            ones), or an availability override for a node no offer or price override prices.
    """
    check_regions(fleet, catalog)
    if fleet.market.kind == "paper":
        return build_paper_market(fleet, catalog)
    regions = {(r.cloud, r.region) for r in fleet.regions}
    wanted = set(fleet.node_configs)
    price: dict[Slot, float] = {}
    available: dict[Slot, int] = {}
    for o in catalog.offers:
        slot: Slot = ((o.cloud, o.region), o.node)
        if slot[0] in regions and o.node in wanted:
            price[slot] = o.price_usd_per_hour
            available[slot] = o.availability
    for p in fleet.prices:
        price[((p.cloud, p.region), p.node)] = p.usd_per_hour
    for i, a in enumerate(fleet.availability):
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
        ((p.cloud, p.region), p.gpu): p.gpus for p in fleet.gpu_pools
    }
    gpu_of = {n: (catalog.node(n).gpu_id, catalog.node(n).gpu_count) for n in wanted}
    return Market(dict(sorted(price.items())), dict(sorted(available.items())), pools, gpu_of)


def build_paper_market(fleet: FleetConfig, catalog: Catalog) -> Market:
    """The paper market of a stack (`solver.catalog.paper_market`).

    Raises:
        InputError: an availability override for a slot the paper market does not sell (a GPU
            Table 1 does not price, or one the region's provider does not offer).
    """
    price = paper_slots(fleet, catalog)
    available = dict.fromkeys(price, fleet.market.nodes_per_slot)
    for i, a in enumerate(fleet.availability):
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
        ((p.cloud, p.region), p.gpu): p.gpus for p in fleet.gpu_pools
    }
    gpu_of = {
        n: (catalog.node(n).gpu_id, catalog.node(n).gpu_count) for n in set(fleet.node_configs)
    }
    return Market(price, available, pools, gpu_of)


def check_regions(fleet: FleetConfig, catalog: Catalog) -> None:
    """Every region of the stack is one the catalog sells in for its cloud, or one the stack
    prices itself (`prices`); a misspelt one would otherwise be silently empty.

    Raises:
        InputError: naming `coral:fleet.regions[i].region`, with the closest known regions and,
            when the region belongs to the other cloud, the cloud to set.
    """
    priced = {(p.cloud, p.region) for p in fleet.prices}
    sold = set(catalog.regions)
    for i, r in enumerate(fleet.regions):
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


def check_something_available(market: Market, fleet: FleetConfig) -> None:
    """At least one (region, node config) of the stack has a node to rent. A check of the
    stack as written (`solver.validation.check_fleet`), not of every market: a simulated epoch
    may scale availability to 0 on purpose.

    Raises:
        InputError: every slot has availability 0, so any plan would have no instance.
    """
    if any(market.available[slot] > 0 for slot in market.price):
        return
    regions = ", ".join(f"{r.cloud}:{r.region}" for r in fleet.regions)
    offered = "; ".join(f"{region_name(r)} {n}" for r, n in market.price) or "none"
    raise InputError(
        "coral:fleet.availability",
        f"no node config of node_configs ({', '.join(fleet.node_configs)}) is available in any "
        f"region of the stack ({regions}); offered slots, all with 0 nodes: {offered}",
        "raise a count under coral:fleet.availability, or add regions or node_configs the "
        "catalog offers (`coral catalog show`)",
    )
