"""The paper comparison (`solver/evaluation/`, `coral bench paper`): the granularity relaxation
never costs more than whole instances (and less when an instance is partly idle), and the table
builder runs a tiny stack end to end in both variants and reports ratios that follow from the
plans' own numbers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

import solver.evaluation.paper_comparison as pe
from solver.catalog.market import Market, build_market
from solver.evaluation.relaxation import fractional_cost, lp_relaxation, relaxed_cost
from solver.evaluation.scenarios import (
    Planned,
    Scenario,
    scale_demand,
    scenario,
    scenario_fleet,
)
from solver.plan.planner import plan_stack
from solver.plan_schema import template_ref
from solver.stack import load_stack
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf, rps_needing

ROOT = Path(__file__).resolve().parents[2]
R = ("aws", "r")


def one_job_market(avail_x: int) -> tuple[Market, dict[Any, list[Any]]]:
    """One prefill job; node x: 1 $/h, 100 units; node y: 2 $/h, 100 units."""
    market = Market(
        price={(R, "x"): 1.0, (R, "y"): 2.0},
        available={(R, "x"): avail_x, (R, "y"): 50},
        gpu_pools={},
        gpu_of={"x": ("gx", 1), "y": ("gy", 1)},
    )
    templates = {
        ("phi-4", "prefill"): [
            SimpleNamespace(key="x", nodes=["x"], throughput=100.0),
            SimpleNamespace(key="y", nodes=["y"], throughput=100.0),
        ]
    }
    return market, templates


def test_lp_relaxation_buys_fractions_and_respects_availability():
    f = fleet(models={"phi-4": SMALL_FLEET["models"]["phi-4"]})
    u = f.allocation.target_utilization
    demand = {("phi-4", "prefill"): 150.0 * u}  # capacity needed: 150 units

    def lp(market: Market, templates: dict[Any, list[Any]], fraction: float) -> float | None:
        return lp_relaxation(f, market, templates, fraction, demand=demand)

    market, templates = one_job_market(avail_x=50)
    assert lp(market, templates, 1.0) == pytest.approx(1.5)  # 1.5 x; ILP: 2
    market, templates = one_job_market(avail_x=1)
    assert lp(market, templates, 1.0) == pytest.approx(2.0)  # 1 x + 0.5 y
    assert lp(market, templates, 0.5) == pytest.approx(0.75)
    market, templates = one_job_market(avail_x=0)
    market.available[(R, "y")] = 1
    assert lp(market, templates, 1.0) is None  # 100 units < 150
    market, templates = one_job_market(avail_x=50)
    assert lp(market, {}, 1.0) is None  # no template serves the job


def test_relaxed_cost_is_at_most_the_whole_instance_cost():
    """On the small real stack: a demand of 1.5 instances of phi-4's l40sx1 prefill leaves an
    instance half idle; both relaxations cost less than the plan, and never more."""
    rps = rps_needing("phi-4", "prefill", "l40sx1", 1.5)
    models = SMALL_FLEET["models"] | {
        "phi-4": SMALL_FLEET["models"]["phi-4"] | {"demand": {"requests_per_s": rps}}
    }
    f = fleet(models=models)
    libs = libraries()
    factors = {template_ref(*job, t.key): 1.0 for job, lib in libs.items() for t in lib.templates}
    for method in ("coral", "cauchy", "homo"):
        plan = plan_stack("small", f, perf().catalog, libs, None, method, factors)
        planned = Planned(plan, factors, libs, 0.0)
        relaxed = relaxed_cost(planned, f, perf(), method)
        frac = fractional_cost(plan, f)
        assert 0 < relaxed <= frac + 1e-9 <= plan.hourly_cost_usd + 1e-9, method
        assert relaxed < plan.hourly_cost_usd - 1e-6, method


def write_tiny_stack(folder: Path) -> None:
    """One model, two node configs, one region; a short closed loop and verification."""
    doc = {
        "config": {
            "coral:fleet": {
                "description": "paper_eval test",
                "models": {"phi-4": SMALL_FLEET["models"]["phi-4"]},
                "regions": [{"cloud": "aws", "region": "us-east-2"}],
                "node_configs": ["l4x1", "l40sx1"],
                "library": {"n_max": 2, "rho": 12, "mode": "vllm"},
                "allocation": {"colocate_phases": False},
                "attainment": {"rounds": 1, "planning_minutes": 2, "verify_minutes": 2},
            }
        }
    }
    (folder / "Pulumi.tiny.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")


def test_table_builder_on_a_tiny_stack(tmp_path: Path):
    write_tiny_stack(tmp_path)
    claim = {"cost": 1.62, "goodput": None, "text": "1.62x cheaper"}
    sc = Scenario("tiny", "core", "tiny", paper={"homo": claim})
    result = {"commit": "test", "date": "today", "workers": 1, "seconds": 0.0}
    result["scenarios"] = {
        "tiny": pe.run_scenario(sc, ["paper", "ours"], perf(), 1, tmp_path, tmp_path / "cache")
    }
    variants = result["scenarios"]["tiny"]["variants"]
    assert variants["paper"]["mode"] == "paper" and variants["paper"]["market"] == "paper"
    assert variants["ours"]["mode"] == "vllm"
    assert set(variants["paper"]["methods"]) == {"coral", "homo-paper", "cauchy-paper"}
    for var in variants.values():
        for row in var["methods"].values():
            assert row["relaxed_usd_per_hour"] <= row["usd_per_hour"] + 1e-9
            assert row["gpus"] == sum(row["gpus_by_type"].values()) > 0
    cmp = pe.compare(result)["tiny"]
    paper, ours = variants["paper"]["methods"], variants["ours"]["methods"]
    assert cmp["homo"]["paper"]["cost"] == pytest.approx(
        paper["homo-paper"]["usd_per_hour"] / paper["coral"]["usd_per_hour"]
    )
    assert cmp["cauchy"]["ours"]["cost_relaxed"] == pytest.approx(
        ours["cauchy"]["relaxed_usd_per_hour"] / ours["coral"]["relaxed_usd_per_hour"]
    )
    for var in variants.values():  # the decomposition is exact on real plans too
        ms = var["methods"]
        for row in ms.values():
            d = pe.decompose(ms["coral"], row)
            assert d is not None
            assert d["template"] * d["slo"] * d["whole"] == pytest.approx(
                row["usd_per_hour"] / ms["coral"]["usd_per_hour"]
            )
    text = pe.markdown(result)
    assert "| tiny | homo | 1.62x cheaper |" in text
    assert f"{cmp['homo']['ours']['cost']:.2f}x" in text


def test_by_phase_ratios_compose_to_the_total_and_skip_scarce_rows():
    """The by-phase table: each phase's baseline/Coral ratio, which weighted by Coral's phase
    shares gives the total; a scenario where a method serves less than all is left out."""

    def row(prefill: float, decode: float, served: float = 1.0) -> dict[str, Any]:
        return {
            "cost_by_phase": {"prefill": prefill, "decode": decode},
            "usd_per_hour": prefill + decode,
            "served_fraction": served,
        }

    result = {
        "scenarios": {
            "a": {"variants": {"ours": {"methods": {"coral": row(6, 4), "homo": row(12, 2)}}}},
            "b": {"variants": {"ours": {"methods": {"coral": row(6, 4), "homo": row(1, 1, 0.5)}}}},
        }
    }
    lines = [x for x in pe.by_phase(result) if x.startswith("| a |") or x.startswith("| b |")]
    assert lines == ["| a | ours | 40% | homo | 2.00x | 0.50x | 1.40x |"]


def test_decomposition_multiplies_to_the_ratio_and_names_each_part():
    """template x SLO discount x whole instances = the baseline's $/h over Coral's, each part a
    quotient of costs over the same needs; rows serving less than all have no decomposition."""

    def job(usd: float, lib: float, cap: float, need: float) -> dict[str, float]:
        return {"usd_per_hour": usd, "library_throughput": lib, "capacity": cap, "need": need}

    coral = {
        "served_fraction": 1.0,
        "jobs": {"m/prefill": job(10, 1000, 500, 400), "m/decode": job(5, 100, 80, 80)},
    }
    base = {
        "served_fraction": 1.0,
        "jobs": {"m/prefill": job(40, 2000, 500, 400), "m/decode": job(5, 100, 80, 80)},
    }
    pre = pe.decompose(coral, base, "prefill")
    # $/T̂ doubles (40/2000 vs 10/1000), T̂ per capacity doubles (4 vs 2), need/capacity same.
    assert pre == pytest.approx({"cost": 4.0, "template": 2.0, "slo": 2.0, "whole": 1.0})
    total = pe.decompose(coral, base)
    assert total["cost"] == pytest.approx(45 / 15)
    assert total["template"] * total["slo"] * total["whole"] == pytest.approx(total["cost"])
    assert pe.decompose(coral, {**base, "served_fraction": 0.5}) is None
    lines = pe.factor_table(
        {"scenarios": {"s": {"variants": {"v": {"methods": {"coral": coral, "homo": base}}}}}}
    )
    assert "| s | v | homo | prefill | 4.00x | 2.00x | 2.00x | 1.00x |" in lines


def test_scarce_pools_cover_every_gpu_the_paper_market_sells():
    """The paper market sells H100/A100 in every region; a scarce stack's pools list only what
    the real catalog sells. In the paper variant the unlisted (region, GPU) pairs get 0 GPUs,
    so the scarce plan cannot buy outside the pools (it used to plan as the default one)."""
    cat = perf().catalog
    sc = scenario("extended/scarce")
    committed = load_stack(ROOT / "stacks", sc.stack)
    fleet = scenario_fleet(sc, "paper", ROOT / "stacks", cat)
    pools = {(p.cloud, p.region, p.gpu): p.gpus for p in fleet.gpu_pools}
    for p in committed.gpu_pools:
        assert pools[(p.cloud, p.region, p.gpu)] == p.gpus
    assert pools[("aws", "ap-northeast-2", "h100")] == 0
    assert pools[("aws", "us-east-2", "a100-80gb")] == 0
    market = build_market(fleet.market_scope(), cat)
    sold = {(r, market.gpu_of[n][0]) for r, n in market.price}
    assert sold <= set(market.gpu_pools)
    default = scenario("extended/default")
    assert not scenario_fleet(default, "paper", ROOT / "stacks", cat).gpu_pools


def test_demand_scale_multiplies_every_model_and_is_named_in_the_header():
    cat = perf().catalog
    sc = scenario("extended/default")
    fleet = scenario_fleet(sc, "paper", ROOT / "stacks", cat)
    assert scale_demand(fleet, 1.0) is fleet
    tripled = scale_demand(fleet, 3.0)
    for m, spec in fleet.models.items():
        assert tripled.models[m].demand.requests_per_s == pytest.approx(
            3 * spec.demand.requests_per_s
        )
    run = {"commit": "c", "date": "d", "seconds": 1.0, "workers": 2, "demand_scale": 3.0}
    assert "demand x3" in pe.runs_text(run)
    assert "demand x" not in pe.runs_text(run | {"demand_scale": 1.0})
