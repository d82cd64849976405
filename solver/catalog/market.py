"""What a stack can rent: price and availability per (region, node config), and GPU pools.

Built from the catalog's offers in the stack's regions, with the stack's overrides applied. No
solver imports: the allocator and the plan validator both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.catalog.offers import Catalog
from solver.errors import InputError
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
        InputError: an availability override for a node no offer or price override prices.
    """
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
