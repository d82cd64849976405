"""Which market a stack rents from (`coral:fleet.market`): the catalog's offers, or the paper's
Table 1 model (`solver.catalog.paper_market`). Beside `market`, below the stack config that holds
it: `solver.stack` imports this module, and `market` builds from that stack."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from solver.types import FROZEN

L4_USD_PER_GPU_HOUR = 0.8048
L4_SOURCE = (
    "AWS g6.xlarge (1x L4) on-demand, us-east-2: 0.8048 $/hour, skypilot-org/skypilot-catalog "
    "catalogs/v8/aws/vms.csv @e385a0d348eda9cefd9806423e7725944dc249e4 (solver/data/offers.yaml, "
    "retrieved 2026-11-29); the paper gives relative prices only"
)
AMPLE_NODES = 1000

MarketKind = Literal["catalog", "paper"]
"""Where a stack's market comes from; its behaviour is a `solver.catalog.market.MarketSource`."""


class MarketSettings(BaseModel):
    """Which market a stack rents from: the catalog's offers, or the paper's Table 1 model."""

    model_config = FROZEN
    kind: MarketKind = Field(
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
