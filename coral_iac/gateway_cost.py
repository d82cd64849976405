"""What the gateway adds to the fleet's $/hour: its VM and its static address, priced from
`coral_iac/data/gateway_prices.yaml` (each price with its source and date, none invented).

The solver's plan knows nothing of the gateway, so the program hands the allocation the budget
less the gateway's $/hour (`allocation_after_gateway`) and adds a "gateway" line to the cost diff.
An item without a sourced price is reported as unpriced, never counted as free silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from coral_iac.deploy_settings import DeploySettings
from coral_iac.gateway_config import gateway_region
from solver.errors import InputError
from solver.io import load_yaml_model
from solver.stack import AllocationSettings, Region
from solver.types import FROZEN

PRICES = Path(__file__).resolve().parent / "data" / "gateway_prices.yaml"
ADDRESS_KIND = {"aws": "elastic-ip"}  # what `Gateway` declares per cloud (aws.ec2.Eip)


class InstancePrice(BaseModel):
    """An on-demand VM price read from a named source."""

    model_config = FROZEN
    cloud: str
    instance_type: str = Field(min_length=1)
    region: str = Field(min_length=1)
    usd_per_hour: float = Field(gt=0)
    source: str = Field(min_length=1)
    retrieved: date


class AddressPrice(BaseModel):
    """A static public address's price (an Elastic IP), for every region unless `region`."""

    model_config = FROZEN
    cloud: str
    kind: str = Field(min_length=1)
    region: str | None = None
    usd_per_hour: float = Field(ge=0)
    source: str = Field(min_length=1)
    retrieved: date


class Unpriced(BaseModel):
    """An item no source at hand prices, and why."""

    model_config = FROZEN
    cloud: str
    item: str
    why: str = Field(min_length=1)
    retrieved: date


class GatewayPrices(BaseModel):
    """`gateway_prices.yaml`."""

    model_config = FROZEN
    schema_version: Literal[1]
    instances: list[InstancePrice] = Field(default_factory=list)
    addresses: list[AddressPrice] = Field(default_factory=list)
    unpriced: list[Unpriced] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_price_each(self) -> GatewayPrices:
        """Two prices for one item would make the total depend on row order."""
        seen: set[tuple[str, ...]] = set()
        keys = [("instances", (p.cloud, p.instance_type, p.region)) for p in self.instances] + [
            ("addresses", (p.cloud, p.kind, p.region or "*")) for p in self.addresses
        ]
        for where, key in keys:
            if key in seen:
                raise ValueError(f"{where}: {' '.join(key)} is priced twice; keep one row")
            seen.add(key)
        return self

    def instance(self, cloud: str, instance_type: str, region: str) -> InstancePrice | None:
        return next(
            (
                p
                for p in self.instances
                if (p.cloud, p.instance_type, p.region) == (cloud, instance_type, region)
            ),
            None,
        )

    def address(self, cloud: str, kind: str, region: str) -> AddressPrice | None:
        rows = [p for p in self.addresses if (p.cloud, p.kind) == (cloud, kind)]
        exact = [p for p in rows if p.region == region]
        found = exact or [p for p in rows if p.region is None]
        return found[0] if found else None

    def why_unpriced(self, cloud: str, item: str, region: str) -> str:
        """The listed reason, else which row is missing (never a silent 0)."""
        found = next((u for u in self.unpriced if (u.cloud, u.item) == (cloud, item)), None)
        if found:
            return found.why
        return f"no price for {cloud} {item} in {region} in {PRICES.name}"


def load_gateway_prices(path: Path | None = None) -> GatewayPrices:
    """Read the gateway price table (default: `PRICES`, read when called).

    Raises:
        InputError: a malformed file, naming the key.
    """
    return load_yaml_model(GatewayPrices, path or PRICES)


class CostItem(BaseModel):
    """One priced (or unpriced) part of the gateway."""

    model_config = FROZEN
    name: str
    usd_per_hour: float | None = Field(description="None: no sourced price.")
    note: str = Field(description="The price's source and date, or why it is unpriced.")


class GatewayCost(BaseModel):
    """The gateway's VM and address in one region, with their prices."""

    model_config = FROZEN
    cloud: str
    region: str
    instance_type: str
    items: list[CostItem]

    @property
    def usd_per_hour(self) -> float:
        """The priced part (unpriced items count 0: see `unpriced`)."""
        return sum(i.usd_per_hour or 0.0 for i in self.items)

    @property
    def unpriced(self) -> list[CostItem]:
        return [i for i in self.items if i.usd_per_hour is None]

    def summary(self) -> str:
        """Short lines for people (an 80-column console): what the gateway costs, and what the
        totals leave out."""
        what = f"Gateway {' + '.join(i.name for i in self.items)} in {self.cloud}:{self.region}"
        if not self.unpriced:
            return f"{what}:\n  {self.usd_per_hour:,.4f} $/hour, in the totals and the budget."
        missing = ", ".join(i.name for i in self.unpriced)
        return (
            f"{what}:\n  {self.usd_per_hour:,.4f} $/hour counted; unpriced, so left out of the "
            f"totals\n  and the budget: {missing} (no sourced price in\n  "
            f"coral_iac/data/{PRICES.name}; add one with its source and date)."
        )


def gateway_cost(
    regions: Sequence[Region], deploy: DeploySettings, prices: GatewayPrices | None = None
) -> GatewayCost | None:
    """The gateway's $/hour as `deploy.gateway` declares it; None without a gateway.

    Args:
        regions: the stack's regions (the gateway's default region is its first aws one).
        deploy: `coral:fleet.deploy`.
        prices: the price table (default `gateway_prices.yaml`).

    Returns:
        The VM and address with their prices, or None when the gateway is off or has no region.
    """
    settings = deploy.gateway
    region = gateway_region(regions, settings) if settings.enabled else None
    if region is None:
        return None
    prices = prices or load_gateway_prices()
    cloud, kind = settings.cloud, ADDRESS_KIND[settings.cloud]
    vm = prices.instance(cloud, settings.instance_type, region)
    address = prices.address(cloud, kind, region)
    items = [
        CostItem(
            name=f"{settings.instance_type} VM",
            usd_per_hour=vm.usd_per_hour if vm else None,
            note=f"{vm.source}, read {vm.retrieved}"
            if vm
            else prices.why_unpriced(cloud, settings.instance_type, region),
        ),
        CostItem(
            name=kind,
            usd_per_hour=address.usd_per_hour if address else None,
            note=f"{address.source}, read {address.retrieved}"
            if address
            else prices.why_unpriced(cloud, kind, region),
        ),
    ]
    return GatewayCost(
        cloud=cloud, region=region, instance_type=settings.instance_type, items=items
    )


def allocation_after_gateway(
    allocation: AllocationSettings, cost: GatewayCost | None
) -> AllocationSettings:
    """The allocation settings whose budget is what is left for GPU nodes once the gateway is
    paid (the same settings when there is no budget or no gateway cost).

    Raises:
        InputError: the budget does not even cover the gateway.
    """
    budget = allocation.budget_usd_per_hour
    if budget is None or cost is None or cost.usd_per_hour == 0:
        return allocation
    left = budget - cost.usd_per_hour
    if left <= 0:
        raise InputError(
            "coral:fleet.allocation.budget_usd_per_hour",
            f"{budget:g} $/hour does not cover the gateway's {cost.usd_per_hour:,.4f} $/hour",
            "raise the budget, or set coral:fleet.deploy.gateway.enabled: false",
        )
    return allocation.model_copy(update={"budget_usd_per_hour": left})
