"""Where a replica's GCP nodes run (`coral_iac.infra.gcp_node_zones`), on the packaged
catalog's offers and their recorded zones."""

from __future__ import annotations

import pytest

from coral_iac.infra import gcp_node_zones
from solver.catalog.offers import load_catalog
from solver.errors import InputError

CATALOG = load_catalog()


def offer(node: str, region: str):
    found = CATALOG.offer_in(node, "gcp", region)
    assert found is not None and found.zones, f"no offer with zones for {node} in {region}"
    return found


def test_every_gcp_offer_records_zones_of_its_own_region():
    gcp = [o for o in CATALOG.offers if o.cloud == "gcp"]
    assert gcp
    for o in gcp:
        assert o.zones == sorted(set(o.zones)), o.instance_type
        assert all(z.rsplit("-", 1)[0] == o.region for z in o.zones), o


def test_one_zone_for_a_replica_where_one_sells_every_node():
    h100 = offer("h100x8", "europe-west4")
    assert gcp_node_zones("europe-west4", [h100, h100]) == ["europe-west4-b"] * 2
    l4, t4 = offer("l4x1", "us-central1"), offer("t4x1", "us-central1")
    assert gcp_node_zones("us-central1", [l4, t4]) == ["us-central1-a"] * 2


def test_a_mixed_replica_no_zone_sells_whole_spans_zones():
    a100, h100 = offer("a100-80gbx8", "europe-west4"), offer("h100x8", "europe-west4")
    assert not set(a100.zones) & set(h100.zones)
    zones = gcp_node_zones("europe-west4", [a100, h100])
    assert zones == ["europe-west4-a", "europe-west4-b"]
    assert all(z in o.zones for z, o in zip(zones, [a100, h100], strict=True))


def test_a_chosen_zone_is_kept_where_it_sells_and_refused_where_it_does_not():
    a100, h100 = offer("a100-80gbx1", "europe-west4"), offer("h100x8", "europe-west4")
    assert gcp_node_zones("europe-west4", [a100], "europe-west4-a") == ["europe-west4-a"]
    with pytest.raises(InputError, match=r"gcp_zones\.europe-west4.*europe-west4-b, europe-west4-c"):
        gcp_node_zones("europe-west4", [h100], "europe-west4-a")


def test_offers_without_recorded_zones_keep_the_default_zone():
    bare = offer("l4x1", "us-central1").model_copy(update={"zones": []})
    assert gcp_node_zones("us-central1", [bare]) == ["us-central1-a"]
    h100 = offer("h100x8", "us-central1")
    assert gcp_node_zones("us-central1", [bare, h100]) == ["us-central1-a"] * 2
