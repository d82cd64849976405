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
The setting itself is `solver.catalog.market_settings`; `solver.catalog.market.build_market`
builds the paper market from the slots priced here.
"""

from __future__ import annotations

from solver.catalog.offers import Catalog
from solver.stack import MarketScope

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


def paper_price(gpu: str, gpus: int, l4_usd_per_gpu_hour: float) -> float:
    """$/hour of a node of `gpus` GPUs of type `gpu`: linear in the GPU count.

    Raises:
        KeyError: a GPU type Table 1 does not price (callers skip those).
    """
    return gpus * RELATIVE_COST[gpu] * l4_usd_per_gpu_hour


def paper_slots(scope: MarketScope, catalog: Catalog) -> dict[tuple[tuple[str, str], str], float]:
    """((cloud, region), node config) -> $/hour for every slot the paper market sells."""
    settings = scope.market
    out: dict[tuple[tuple[str, str], str], float] = {}
    for r in scope.regions:
        for n in scope.node_configs:
            cfg = catalog.node(n)
            if cfg.gpu_id in OFFERED_BY.get(r.cloud, frozenset()):
                out[((r.cloud, r.region), n)] = paper_price(
                    cfg.gpu_id, cfg.gpu_count, settings.l4_usd_per_gpu_hour
                )
    return dict(sorted(out.items()))


def paper_node_configs(scope: MarketScope, catalog: Catalog) -> tuple[list[str], list[str]]:
    """(node configs the paper market sells in some region of the stack, listed ones it does
    not), in the stack's order: the enumeration's node list under `market: paper`."""
    sold = {n for _, n in paper_slots(scope, catalog)}
    return [n for n in scope.node_configs if n in sold], [
        n for n in scope.node_configs if n not in sold
    ]
