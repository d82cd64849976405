"""The shipped catalog and the SkyPilot importer."""

from __future__ import annotations

import csv
import datetime as dt

import pytest

from solver.catalog.offers import load_catalog, split_node_id
from solver.catalog.skypilot_import import import_vms_rows
from solver.errors import InputError
from tests.conftest import FIXTURES

DAY = dt.date(2026, 11, 29)


def test_catalog_covers_required_regions_and_gpus():
    cat = load_catalog()
    regions = {r for _, r in cat.regions}
    assert {"us-east-1", "us-east-2", "us-west-2", "ap-northeast-2"} <= regions
    assert {"us-central1", "europe-west4"} <= regions
    sold = {"h100", "a100-80gb", "a100-40gb", "l40s", "l4", "a10g", "t4", "v100"}
    assert set(cat.gpus) == sold | {"a40"}  # the A40: a measured reference chip, sold by no offer
    assert not any(o.node.startswith("a40x") for o in cat.offers)
    for o in cat.offers:
        assert o.price_usd_per_hour > 0 and o.source and o.retrieved


def test_every_node_config_is_a_shape_some_offer_sells():
    cat = load_catalog()
    for node, cfg in cat.node_configs.items():
        assert cfg.sold and cat.offers_for(node)
    # AWS sells no 2-GPU L40S/L4/A10G instance: those shapes are declared unsold, not invented.
    aws_nodes = {o.node for o in cat.offers if o.cloud == "aws"}
    assert "l40sx2" not in aws_nodes
    assert any(u.node == "l40sx2" and u.cloud == "aws" for u in cat.unsold_shapes)


@pytest.mark.parametrize("bad", ["l4", "x4", "l4x0", "l4xtwo"])
def test_malformed_node_id(bad):
    with pytest.raises(InputError, match="malformed node id"):
        split_node_id(bad)


def test_unknown_gpu_suggests_close_node():
    with pytest.raises(InputError, match="Did you mean") as exc:
        load_catalog().node("l40x1")
    assert "l40sx1" in str(exc.value)


def test_malformed_offer_file_names_the_field(tmp_path):
    text = (FIXTURES.parent.parent / "solver" / "data" / "offers.yaml").read_text()
    bad = text.replace("price_usd_per_hour: ", "price_usd_per_hour: -", 1)
    path = tmp_path / "offers.yaml"
    path.write_text(bad)
    with pytest.raises(InputError, match=r"offers\[\d+\]\.price_usd_per_hour"):
        load_catalog(offers_path=path)


def _rows(name):
    with (FIXTURES / name).open(newline="") as f:
        return list(csv.DictReader(f))


def test_import_aws_takes_cheapest_instance_per_shape_and_drops_placeholders():
    offers = import_vms_rows(_rows("skypilot_aws_vms.csv"), "aws", load_catalog(), "fixture", DAY)
    by_key = {(o.region, o.node): o for o in offers}
    assert by_key[("us-east-2", "l4x1")].instance_type == "g6.xlarge"  # 0.8048 < 0.9776
    assert by_key[("us-east-2", "l4x1")].price_usd_per_hour == pytest.approx(0.8048)
    assert by_key[("us-east-2", "l4x4")].instance_type == "g6.12xlarge"
    assert ("ap-northeast-2", "l40sx1") not in by_key  # empty price
    assert ("ap-northeast-2", "a10gx1") not in by_key  # zero price
    assert not any(o.node.startswith("v100") for o in offers)  # V100-32GB is not our v100
    assert by_key[("eu-west-1", "t4x1")].availability == 16  # default for a new shape


def test_import_gcp_adds_gpu_rows_to_host_price():
    offers = import_vms_rows(_rows("skypilot_gcp_vms.csv"), "gcp", load_catalog(), "fixture", DAY)
    by_key = {(o.region, o.node): o for o in offers}
    a100 = by_key[("us-central1", "a100-40gbx1")]
    assert a100.instance_type == "a2-highgpu-1g"
    assert a100.price_usd_per_hour == pytest.approx(0.73948 + 2.93349)
    assert by_key[("us-central1", "l4x2")].price_usd_per_hour == pytest.approx(1.56 + 1.12)
    t4 = by_key[("us-central1", "t4x1")]
    assert t4.instance_type == "n1-standard-4+1xT4"
    assert t4.price_usd_per_hour == pytest.approx(0.379998 + 0.35)
    assert ("us-central1", "v100x1") not in by_key  # 700.0 placeholder dropped


def test_import_rejects_a_csv_without_skypilot_columns():
    with pytest.raises(InputError, match="missing columns"):
        import_vms_rows([{"foo": "1"}], "aws", load_catalog(), "bad.csv", DAY)
