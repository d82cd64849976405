"""How often spot capacity is taken back: each spot offer's preemption model.

`solver/data/spot/preemption.yaml` holds, per AWS (region, instance type), the EC2 Spot Instance
Advisor's "frequency of interruption" bucket, with the file's sources and its assumptions (GCP
publishes no rate; the advisor lacks some types; no source gives how preemptions in one zone go
together). A bucket's upper bound p (the share of instances taken back in a month) becomes a rate
per hour, -ln(1 - p) / 730, as if lifetimes were exponential. A stack overrides any of it
(`coral:fleet.preemption`, applied by the market).
"""

from __future__ import annotations

import datetime as dt
import math
from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from solver.catalog.offers import Offer
from solver.io import load_yaml_model
from solver.types import FROZEN

PREEMPTION_PATH = Path(__file__).resolve().parents[1] / "data" / "spot" / "preemption.yaml"
HOURS_PER_MONTH = 730.0  # 8,760 hours a year over 12 months

Bucket = Literal["<5%", "5-10%", "10-15%", "15-20%", ">20%"]


class Preemption(BaseModel):
    """One spot offer's preemption model."""

    model_config = FROZEN
    rate_per_hour: float = Field(ge=0, description="Preemptions per instance-hour.")
    zone_correlation: float = Field(
        ge=0,
        le=1,
        description="Chance that a preemption in a zone takes every spot instance of that node "
        "config in the zone at once.",
    )
    source: str = Field(description="Where the rate comes from, or that it is assumed.")


class AwsBucket(BaseModel):
    model_config = FROZEN
    region: str = Field(min_length=1)
    instance_type: str = Field(min_length=1)
    interruption: Bucket


class Assumed(BaseModel):
    model_config = FROZEN
    monthly_interruption: float = Field(gt=0, lt=1)
    zone_correlation: float = Field(ge=0, le=1)


class PreemptionFile(BaseModel):
    """`solver/data/spot/preemption.yaml`."""

    model_config = FROZEN
    schema_version: Literal[1]
    retrieved: dt.date
    interruption_bounds: dict[Bucket, float]
    assumed: Assumed
    aws_source: str = Field(min_length=1)
    aws: list[AwsBucket]

    @model_validator(mode="after")
    def _every_bucket_bounded(self) -> PreemptionFile:
        missing = sorted(set(Bucket.__args__) - set(self.interruption_bounds))  # type: ignore[attr-defined]
        if missing:
            raise ValueError(f"interruption_bounds: no bound for {missing}")
        if any(not 0 < p < 1 for p in self.interruption_bounds.values()):
            raise ValueError("interruption_bounds: each is a share of a month, in (0, 1)")
        return self


def rate_per_hour(monthly_interruption: float) -> float:
    """The preemption rate per hour at which a share `monthly_interruption` of instances is taken
    back within a month (exponential lifetimes)."""
    return -math.log1p(-monthly_interruption) / HOURS_PER_MONTH


@cache
def load_preemption(path: Path = PREEMPTION_PATH) -> PreemptionFile:
    """The shipped preemption data (read once).

    Raises:
        InputError: the file is missing or does not match `PreemptionFile`.
    """
    return load_yaml_model(PreemptionFile, path)


def offer_preemption(offer: Offer, data: PreemptionFile | None = None) -> Preemption:
    """The preemption model of `offer`'s spot capacity: the advisor's bucket for an AWS type and
    region it lists, else the file's assumption."""
    data = data or load_preemption()
    correlation = data.assumed.zone_correlation
    if offer.cloud == "aws":
        for b in data.aws:
            if (b.region, b.instance_type) == (offer.region, offer.instance_type):
                p = data.interruption_bounds[b.interruption]
                return Preemption(
                    rate_per_hour=rate_per_hour(p),
                    zone_correlation=correlation,
                    source=f"{data.aws_source}: {b.interruption} a month (bound {p:g}); "
                    "zone correlation assumed",
                )
    p = data.assumed.monthly_interruption
    return Preemption(
        rate_per_hour=rate_per_hour(p),
        zone_correlation=correlation,
        source=f"assumed: {p:g} of instances a month, no published rate for {offer.cloud} "
        f"{offer.instance_type} in {offer.region}; zone correlation assumed",
    )
