"""Spot capacity in the catalog: each offer's spot price comes from its source's rows by the
importer's rules (solver/data/spot/ holds those rows), each spot offer has a preemption model
(the AWS Spot Instance Advisor's bucket, else a stated assumption), and a stack overrides it."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from coral_iac.cli.app import app
from solver.catalog.market import build_market
from solver.catalog.offers import Offer, load_catalog
from solver.catalog.preemption import HOURS_PER_MONTH, load_preemption, offer_preemption
from solver.catalog.skypilot_import import import_vms_rows, spot_fields, spot_prices
from solver.errors import InputError
from solver.stack import FleetConfig
from tests.conftest import REPO
from tests.factories import PHI4_SPEC

SPOT = REPO / "solver" / "data" / "spot"
HEADER = "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,Region,AvailabilityZone"


def rows_of(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def parse(lines: list[str]) -> list[dict[str, str]]:
    return list(csv.DictReader([HEADER, *lines]))


def test_a_zone_counts_only_with_a_real_discount_and_the_dearest_zone_prices_the_offer():
    rows = parse(
        [
            "g6e.xlarge,L40S,1,4,32,1.861,0.5499,us-east-2,use2-az1",
            "g6e.xlarge,L40S,1,4,32,1.861,0.5299,us-east-2,use2-az3",
            "g6e.xlarge,L40S,1,4,32,1.861,1.861,us-east-2,use2-az2",  # = on-demand: none
            "g6e.xlarge,L40S,1,4,32,1.861,,us-east-2,use2-az4",  # empty: none
            "g6e.xlarge,L40S,1,4,32,1.861,0.1861,us-east-2,use2-az5",  # a tenth: placeholder
        ]
    )
    zones = spot_prices(rows, "aws")[("us-east-2", "g6e.xlarge")]
    assert zones == {"use2-az1": 0.5499, "use2-az3": 0.5299}
    assert spot_fields(zones, 1.861) == {
        "spot_price_usd_per_hour": 0.5499,
        "spot_zones": ["use2-az1", "use2-az3"],
    }
    # Only zones below the offer's own on-demand price count (a region's cheapest zone's).
    assert spot_fields(zones, 0.54) == {
        "spot_price_usd_per_hour": 0.5299,
        "spot_zones": ["use2-az3"],
    }
    assert spot_fields({}, 1.861) == {"spot_price_usd_per_hour": None, "spot_zones": []}


def test_gcp_spot_adds_the_host_and_the_gpu_of_one_zone():
    rows = parse(
        [
            "n1-standard-4,,,4,15,0.19,0.04,us-central1,us-central1-a",
            "n1-standard-4,,,4,15,0.19,0.05,us-central1,us-central1-b",
            ",T4,1,,,0.35,0.14,us-central1,us-central1-a",
            # us-central1-b has no T4 row: no spot T4 there
            "g2-standard-4,,,4,16,0.5,0.2,us-central1,us-central1-c",
            ",L4,1,,,0.2,0.08,us-central1,us-central1-c",
        ]
    )
    spots = spot_prices(rows, "gcp")
    assert spots[("us-central1", "n1-standard-4+1xT4")] == {"us-central1-a": pytest.approx(0.18)}
    assert spots[("us-central1", "g2-standard-4")] == {"us-central1-c": pytest.approx(0.28)}


def test_every_shipped_spot_price_is_what_its_source_rows_give():
    """offers.yaml against the SkyPilot rows it was read from (solver/data/spot/skypilot-*.csv),
    by the importer's rules; offers priced from elsewhere (GCP A2/A3) carry no spot price."""
    spots = {c: spot_prices(rows_of(SPOT / f"skypilot-{c}-vms-gpu.csv"), c) for c in ("aws", "gcp")}
    catalog = load_catalog()
    for o in catalog.offers:
        zones = spots[o.cloud].get((o.region, o.instance_type), {})
        if not o.source.startswith("skypilot-org/skypilot-catalog"):
            zones = {}
        want = spot_fields(zones, o.price_usd_per_hour)
        got = {"spot_price_usd_per_hour": o.spot_price_usd_per_hour, "spot_zones": o.spot_zones}
        assert got == want, (o.cloud, o.region, o.instance_type)
    with_spot = [o for o in catalog.offers if o.spot_price_usd_per_hour is not None]
    assert len(with_spot) >= 80
    # Read off the rows by hand: g6e.xlarge in us-east-2 is 0.5499, 0.5458 and 0.5299 a zone.
    (g6e,) = [o for o in with_spot if (o.region, o.instance_type) == ("us-east-2", "g6e.xlarge")]
    assert (g6e.spot_price_usd_per_hour, g6e.spot_zones) == (
        0.5499,
        ["use2-az1", "use2-az2", "use2-az3"],
    )


def test_the_importer_writes_the_spot_fields():
    catalog = load_catalog()
    rows = rows_of(SPOT / "skypilot-aws-vms-gpu.csv")
    source = "skypilot-org/skypilot-catalog catalogs/v8/aws/vms.csv"
    imported = import_vms_rows(rows, "aws", catalog, source, load_preemption().retrieved)
    by_key = {(o.region, o.instance_type): o for o in imported}
    shipped = catalog.offer_in("l40sx1", "aws", "us-east-2")
    assert shipped is not None
    new = by_key[("us-east-2", "g6e.xlarge")]
    assert new.spot_price_usd_per_hour == shipped.spot_price_usd_per_hour
    assert new.spot_zones == shipped.spot_zones
    assert by_key[("us-east-2", "p5.4xlarge")].spot_price_usd_per_hour is None  # no SpotPrice


def test_a_spot_price_must_be_below_on_demand_and_name_its_zones():
    offer = load_catalog().offers[0].model_dump()
    with pytest.raises(ValidationError, match="below the on-demand price"):
        Offer.model_validate(offer | {"spot_price_usd_per_hour": 1e4, "spot_zones": ["a"]})
    with pytest.raises(ValidationError, match="needs spot_zones"):
        Offer.model_validate(offer | {"spot_price_usd_per_hour": 0.01, "spot_zones": []})


def share_per_month(rate_per_hour: float) -> float:
    return -math.expm1(-rate_per_hour * HOURS_PER_MONTH)


def test_the_advisor_buckets_order_the_rates_and_the_rest_is_assumed():
    catalog = load_catalog()
    by_key = {(o.region, o.instance_type): o for o in catalog.offers}
    rare = offer_preemption(by_key[("ap-northeast-2", "g4dn.metal")])  # "<5%"
    often = offer_preemption(by_key[("us-west-2", "g4dn.metal")])  # ">20%"
    assert share_per_month(rare.rate_per_hour) == pytest.approx(0.05)
    assert rare.rate_per_hour < often.rate_per_hour
    assert "Spot Instance Advisor" in rare.source and "<5%" in rare.source
    missing = offer_preemption(by_key[("us-east-1", "p5.4xlarge")])  # not in the advisor's data
    gcp = offer_preemption(by_key[("us-central1", "n1-standard-4+1xT4")])
    for assumed in (missing, gcp):
        assert assumed.source.startswith("assumed")
        assert share_per_month(assumed.rate_per_hour) == pytest.approx(
            load_preemption().assumed.monthly_interruption
        )


def stack(**changes: Any) -> FleetConfig:
    base: dict[str, Any] = {
        "models": {"phi-4": PHI4_SPEC},
        "regions": [
            {"cloud": "aws", "region": "us-east-2"},
            {"cloud": "aws", "region": "us-west-2"},
        ],
        "node_configs": ["l40sx1", "l4x1"],
    }
    return FleetConfig.model_validate(base | changes)


def test_the_stack_overrides_the_preemption_model_most_specific_first():
    overrides = [
        {"cloud": "aws", "rate_per_hour": 0.01, "source": "our own spot history, 2026-11"},
        {
            "cloud": "aws",
            "region": "us-east-2",
            "node": "l40sx1",
            "rate_per_hour": 0.002,
            "zone_correlation": 0.9,
            "source": "our own spot history, 2026-11",
        },
    ]
    market = build_market(stack(preemption=overrides).market_scope(), load_catalog())
    east, west = ("aws", "us-east-2"), ("aws", "us-west-2")
    own = market.spot[(east, "l40sx1")].preemption
    assert (own.rate_per_hour, own.zone_correlation) == (0.002, 0.9)
    assert own.source.startswith("stack:")
    cloud_wide = market.spot[(west, "l40sx1")].preemption
    assert cloud_wide.rate_per_hour == 0.01
    assert cloud_wide.zone_correlation == load_preemption().assumed.zone_correlation
    shipped = build_market(stack().market_scope(), load_catalog())
    assert shipped.spot[(east, "l4x1")].preemption.source.startswith("AWS EC2 Spot")
    assert shipped.spot[(east, "l40sx1")].usd_per_hour == 0.5499
    assert shipped.price == market.price  # spot changes no on-demand price


def test_an_override_names_only_declared_regions_and_nodes():
    bad = [{"cloud": "aws", "region": "eu-west-1", "rate_per_hour": 0.01, "source": "x"}]
    with pytest.raises(InputError, match=r"preemption\[0\]\.region"):
        stack(preemption=bad)
    bad = [{"cloud": "aws", "node": "h100x8", "rate_per_hour": 0.01, "source": "x"}]
    with pytest.raises(InputError, match=r"preemption\[0\]\.node"):
        stack(preemption=bad)


def test_catalog_show_lists_spot_prices_and_their_preemption():
    r = CliRunner().invoke(app, ["catalog", "show", "--json", "--region", "us-east-1"])
    assert r.exit_code == 0, r.output
    rows = {row["instance_type"]: row for row in json.loads(r.stdout)}
    assert rows["g6e.xlarge"]["spot_price_usd_per_hour"] < rows["g6e.xlarge"]["price_usd_per_hour"]
    assert rows["g6e.xlarge"]["spot_preemption"]["rate_per_hour"] > 0
    assert rows["p5.4xlarge"]["spot_price_usd_per_hour"] is None
    assert rows["p5.4xlarge"]["spot_preemption"] is None
