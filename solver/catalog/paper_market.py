"""The paper's market (Table 1): relative GPU prices, every node size at a linear price.

A stack chooses it with `market: paper` (or `market: {kind: paper, l4_usd_per_gpu_hour: ...,
source: ...}`) under `coral:fleet`. Then, in every region of the stack:

- a node of g GPUs of type G costs g x relative_cost(G) x the L4 price per GPU-hour (Table 1:
  H100 7.6, A100 3.5, L40S 2.2, A10G 1.2, L4 1.0); one price for every region, as the paper gives
  one relative cost per GPU, not per region;
- every node config the stack lists is sold (1/2/4/8 GPUs alike, shapes no cloud sells included),
  except the GPUs Table 1 marks as not offered by the region's provider (GCP: no L40S, no A10G);
- availability is ample (`nodes_per_slot`, default 1000 nodes), unless the stack's
  `availability` overrides or `gpu_pools` say otherwise (the scarce scenarios use them).

Price overrides (`prices`) do not apply: the paper market is a fixed model, not a catalog.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator

from solver.types import FROZEN

if TYPE_CHECKING:  # runtime imports are local: solver.stack imports this module
    from solver.catalog.market import Market
    from solver.catalog.offers import Catalog
    from solver.stack import FleetConfig

# Table 1 "Rel. cost": mean hourly price normalised to L4 (paper Sec. 3), keyed by our GPU ids.
RELATIVE_COST: dict[str, float] = {
    "h100": 7.6,
    "a100-80gb": 3.5,
    "l40s": 2.2,
    "a10g": 1.2,
    "l4": 1.0,
}
# Table 1's provider columns: which GPUs each cloud offers (AWS all five; GCP no L40S, no A10G).
OFFERED_BY: dict[str, frozenset[str]] = {
    "aws": frozenset(RELATIVE_COST),
    "gcp": frozenset({"h100", "a100-80gb", "l4"}),
}
L4_USD_PER_GPU_HOUR = 0.8048
L4_SOURCE = (
    "AWS g6.xlarge (1x L4) on-demand, us-east-2: 0.8048 $/hour, skypilot-org/skypilot-catalog "
    "catalogs/v8/aws/vms.csv @e385a0d348eda9cefd9806423e7725944dc249e4 (solver/data/offers.yaml, "
    "retrieved 2026-11-29); the paper gives relative prices only"
)
AMPLE_NODES = 1000


class MarketSettings(BaseModel):
    """Which market a stack rents from: the catalog's offers, or the paper's Table 1 model."""

    model_config = FROZEN
    kind: Literal["catalog", "paper"] = Field(
        default="catalog",
        description="catalog: solver/data/offers.yaml plus the stack's overrides; paper: Table 1.",
    )
    l4_usd_per_gpu_hour: float = Field(
        default=L4_USD_PER_GPU_HOUR,
        gt=0,
        le=100,
        description="paper: $ per L4 GPU-hour (scale; at most 100, over 100x Table 1's).",
    )
    source: str = Field(default=L4_SOURCE, min_length=1, description="Where the L4 price is from.")
    nodes_per_slot: int = Field(
        default=AMPLE_NODES,
        ge=0,
        le=1_000_000,
        description="paper: nodes of each config per region (at most a million).",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        """`market: paper` is short for `market: {kind: paper}`."""
        return {"kind": value} if isinstance(value, str) else value


def paper_price(gpu: str, gpus: int, l4_usd_per_gpu_hour: float) -> float:
    """$/hour of a node of `gpus` GPUs of type `gpu`: linear in the GPU count.

    Raises:
        KeyError: a GPU type Table 1 does not price (callers skip those).
    """
    return gpus * RELATIVE_COST[gpu] * l4_usd_per_gpu_hour


def paper_slots(fleet: FleetConfig, catalog: Catalog) -> dict[tuple[tuple[str, str], str], float]:
    """((cloud, region), node config) -> $/hour for every slot the paper market sells."""
    settings = fleet.market
    out: dict[tuple[tuple[str, str], str], float] = {}
    for r in fleet.regions:
        for n in fleet.node_configs:
            cfg = catalog.node(n)
            if cfg.gpu_id in OFFERED_BY.get(r.cloud, frozenset()):
                out[((r.cloud, r.region), n)] = paper_price(
                    cfg.gpu_id, cfg.gpu_count, settings.l4_usd_per_gpu_hour
                )
    return dict(sorted(out.items()))


def paper_node_configs(fleet: FleetConfig, catalog: Catalog) -> tuple[list[str], list[str]]:
    """(node configs the paper market sells in some region of the fleet, listed ones it does
    not), in the fleet's order: the enumeration's node list under `market: paper`."""
    sold = {n for _, n in paper_slots(fleet, catalog)}
    return [n for n in fleet.node_configs if n in sold], [
        n for n in fleet.node_configs if n not in sold
    ]


def build_paper_market(fleet: FleetConfig, catalog: Catalog) -> Market:
    """The paper market of a stack (see module doc).

    Raises:
        InputError: an availability override for a slot the paper market does not sell (a GPU
            Table 1 does not price, or one the region's provider does not offer).
    """
    from solver.catalog.market import Market
    from solver.errors import InputError

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
