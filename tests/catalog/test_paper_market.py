"""The paper market (Table 1) prices every node shape linearly in its GPU count, sells every
listed size (shapes no cloud sells included) in ample numbers, and leaves the catalog market as
it was."""

from __future__ import annotations

from typing import Any

import pytest

from solver.catalog.market import build_market
from solver.catalog.market_settings import L4_USD_PER_GPU_HOUR
from solver.catalog.offers import load_catalog
from solver.catalog.paper_market import RELATIVE_COST
from solver.errors import InputError
from solver.serving.enumeration import available_node_configs
from solver.stack import FleetConfig

SIZES = (1, 2, 4, 8)
NODES = [f"{g}x{n}" for g in RELATIVE_COST for n in SIZES]
AWS, GCP = ("aws", "us-east-2"), ("gcp", "us-central1")
MODELS = {
    "phi-4": {
        "slo_ms": {"prefill": 1200, "decode": 60},
        "mean_prompt_tokens": 1020,
        "mean_output_tokens": 129,
    }
}


def fleet(**changes: Any) -> FleetConfig:
    base: dict[str, Any] = {
        "models": MODELS,
        "regions": [{"cloud": "aws", "region": AWS[1]}, {"cloud": "gcp", "region": GCP[1]}],
        "node_configs": NODES,
        "market": "paper",
    }
    return FleetConfig.model_validate(base | changes)


def test_every_shape_is_priced_linearly_at_table_1():
    market = build_market(fleet().market_scope(), load_catalog())
    for gpu, rel in RELATIVE_COST.items():
        for n in SIZES:
            assert market.price[(AWS, f"{gpu}x{n}")] == pytest.approx(n * rel * 0.8048)
            per_gpu = market.price[(AWS, f"{gpu}x{n}")] / n
            assert per_gpu == pytest.approx(market.price[(AWS, f"{gpu}x1")])
    # h100x2 is sold by no cloud on demand, yet the paper market has it, in ample numbers.
    assert market.available[(AWS, "h100x2")] == 1000
    assert market.price[(AWS, "h100x1")] / market.price[(AWS, "l4x1")] == pytest.approx(7.6)


def test_gcp_sells_what_table_1_marks_and_the_enumeration_sees_every_size():
    market = build_market(fleet().market_scope(), load_catalog())
    gcp = {n for (r, n) in market.price if r == GCP}
    assert gcp == {n for n in NODES if not n.startswith(("l40s", "a10g"))}
    sold, unsold = available_node_configs(fleet().market_scope(), load_catalog())
    assert sold == NODES and unsold == []
    catalog_sold, _ = available_node_configs(fleet(market="catalog").market_scope(), load_catalog())
    assert "h100x2" not in catalog_sold  # the real catalog has no on-demand h100x2


def test_scale_source_and_overrides():
    f = fleet(
        market={"kind": "paper", "l4_usd_per_gpu_hour": 2.0, "source": "a stated quote"},
        availability=[{"cloud": "aws", "region": AWS[1], "node": "l4x8", "count": 3}],
        gpu_pools=[{"cloud": "aws", "region": AWS[1], "gpu": "l4", "gpus": 16}],
    )
    market = build_market(f.market_scope(), load_catalog())
    assert market.price[(AWS, "a100-80gbx4")] == pytest.approx(4 * 3.5 * 2.0)
    assert market.available[(AWS, "l4x8")] == 3 and market.available[(AWS, "l4x4")] == 1000
    assert market.gpu_pools[(AWS, "l4")] == 16
    assert f.market.source == "a stated quote"
    assert "0.8048" in fleet().market.source and L4_USD_PER_GPU_HOUR == 0.8048


def test_override_of_a_slot_the_paper_market_does_not_sell_names_the_key():
    bad = fleet(availability=[{"cloud": "gcp", "region": GCP[1], "node": "l40sx1", "count": 2}])
    with pytest.raises(InputError, match=r"availability\[0\].*GCP offers no L40S"):
        build_market(bad.market_scope(), load_catalog())


def test_catalog_market_is_unchanged_by_default():
    f = FleetConfig.model_validate(
        {
            "models": MODELS,
            "regions": [{"cloud": "aws", "region": AWS[1]}],
            "node_configs": ["l4x1", "l4x4"],
        }
    )
    assert f.market.kind == "catalog"
    market = build_market(f.market_scope(), load_catalog())
    assert market.price[(AWS, "l4x1")] == pytest.approx(0.8048)
    assert market.available[(AWS, "l4x1")] == 16  # the catalog's own availability
