"""The paper's Helix comparison (Sec. 6.6) in paper mode, with and without coupled decode
pipelines (#19 item 5).

`paper-helix` (Helix's 42-node, 64-GPU cluster as the only availability, Llama-2-70B, SLOs
2090 / 730 ms, AWS us-east-2 prices, 4 req/s) in the paper's template space
(`library.mode: paper`), planned through `coral plan`'s path (`plan_with_library`: libraries,
the SLO attainment loop, verification, validation). The market stays the stack's AWS prices, as
in the paper's Helix run (Table 1 has no V100 or T4). Each plan's templates are then driven
alone past their capacity in the simulator (`capacity_check`: simulated / library throughput).

`coupled=False` plans with the paper's uncoupled per-stage T̂ (each decode stage at its own
batch), `coupled=True` with one micro-batch size at every stage of a decode pipeline
(`solver.templates.placement_search.place_coupled`), the default of paper mode.

Run: .venv/bin/python scripts/paper_helix.py [--workers 1] [--duration 1200]   (prints JSON)
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from math import inf
from pathlib import Path
from typing import Any, cast

import solver.templates.executors as executors
import solver.templates.library as library_module
import solver.templates.paper_mode as paper_mode
from solver.catalog.market import build_market
from solver.catalog.offers import Catalog
from solver.performance.default_model import load_perf_model
from solver.performance.perf_model import PerfModel
from solver.plan.demand import stack_demand
from solver.plan.planner import libraries_for, plan_stack, plan_with_library
from solver.plan.validator import validate_plan
from solver.simulation.simulator import capacity_check, simulate
from solver.simulation.workload import model_trace
from solver.stack import FleetConfig, load_stack

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".coral" / "paper_helix"
STACK = "paper-helix"
MODEL = "llama2-70b"
LOADS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)  # x the plan's served load
# Paper Sec. 6.6: Coral vs Helix's own (simulated) numbers on this cluster.
PAPER = {"cost_vs_helix": -0.21, "throughput_vs_helix": 0.26}


@contextmanager
def uncoupled() -> Iterator[None]:
    """Paper mode with the uncoupled per-stage T̂ (in this process: build with one worker)."""
    original = paper_mode.paper_candidate
    paper_mode.paper_candidate = functools.partial(original, coupled=False)  # type: ignore[assignment]
    try:
        yield
    finally:
        paper_mode.paper_candidate = original  # type: ignore[assignment]


@contextmanager
def priced_nodes() -> Iterator[None]:
    """What-if: the library also places the node configs only the stack's `prices` sell.

    `available_node_configs` keeps the configs a catalog offer sells in the fleet's regions, so
    a100-40gbx1, l4x2 and t4x2 (priced in `paper-helix` from per-GPU prices) never reach the
    library, although the market prices them and the availability lists them: no template can
    use the cluster's A100s. (In this process: build with one worker.)
    """
    saved = (library_module.available_node_configs, executors.available_node_configs)

    def with_priced(fleet: FleetConfig, catalog: Catalog) -> tuple[list[str], list[str]]:
        sold, unsold = saved[0](fleet, catalog)
        priced = {p.node for p in fleet.prices}
        return [n for n in fleet.node_configs if n in sold or n in priced], [
            n for n in unsold if n not in priced
        ]

    library_module.available_node_configs = with_priced
    executors.available_node_configs = with_priced
    try:
        yield
    finally:
        library_module.available_node_configs, executors.available_node_configs = saved


def helix_fleet() -> FleetConfig:
    """`paper-helix` in paper mode (the committed stack is general mode)."""
    return load_stack(ROOT / "stacks", STACK).with_mode("paper")


def cluster_usd_per_hour(fleet: FleetConfig, perf: PerfModel) -> float:
    """Every node of the cluster at the stack's prices: what Helix's one pipeline rents."""
    market = build_market(fleet, perf.catalog)
    return sum(
        a.count * market.price[((str(a.cloud), a.region), a.node)] for a in fleet.availability
    )


def helix_eval(
    coupled: bool = True, workers: int = 1, duration_s: float = 1200.0, priced: bool = False
) -> dict[str, Any]:
    """Plan `paper-helix` in paper mode and check it in the simulator.

    Planned as the paper plans (`plan_stack`: demand against each template's library
    throughput, no SLO attainment loop), validated, then: each template alone past its capacity
    (`capacity_check`), and the whole plan on a generated trace at the load it serves (its
    served fraction x 4 req/s) for SLO attainment and median TTFT / TPOT. `slo_loop` is what
    `coral plan`'s path (`plan_with_library`, target 0.9) gives for the same fleet.

    Returns the plan's $/hour (and over the whole cluster's), GPUs, served fraction, planned
    throughput per phase, layout, capacity per template and per phase, and the simulation.
    """
    perf, fleet = load_perf_model(), helix_fleet()
    folder = CACHE / (("coupled" if coupled else "uncoupled") + ("-priced" if priced else ""))
    t0 = time.perf_counter()
    with nullcontext() if coupled else uncoupled(), priced_nodes() if priced else nullcontext():
        libs = libraries_for(
            perf, fleet, list(stack_demand(fleet)), folder,
            workers=workers if coupled and not priced else 1,
            stack=STACK,
        )  # fmt: skip
        loop = plan_with_library(STACK, fleet, perf, folder, workers=1, root=ROOT)
    build_s = time.perf_counter() - t0
    plan = validate_plan(
        plan_stack(STACK, fleet, perf.catalog, libs), fleet, perf.catalog, perf.cards
    )
    rows = capacity_check(plan, fleet, perf, duration_s=duration_s)
    spec = fleet.models[MODEL]
    trace = model_trace(spec, 0, "verify", duration_s, ROOT, plan.served_fraction)
    sim = simulate(plan, fleet, perf, {MODEL: trace}, duration_s).summary()
    sweep = []  # the paper holds Coral to Helix's median latencies: the load where both hold
    for load in LOADS:
        t = model_trace(spec, 0, "verify", duration_s, ROOT, plan.served_fraction * load)
        r = simulate(plan, fleet, perf, {MODEL: t}, duration_s).summary()
        ok = (r["ttft_p50_ms"] or inf) <= spec.slo_ms.prefill and (
            r["tpot_p50_ms"] or inf
        ) <= spec.slo_ms.decode
        sweep.append(
            {
                "requests_per_s": round(
                    plan.served_fraction * load * (spec.demand.requests_per_s or 0.0), 3
                ),
                "ttft_p50_ms": r["ttft_p50_ms"],
                "tpot_p50_ms": r["tpot_p50_ms"],
                "slo_attainment": r["slo_attainment"],
                "medians_within_slo": ok,
            }
        )
    cluster = cluster_usd_per_hour(fleet, perf)
    per_request = {"prefill": spec.mean_prompt_tokens, "decode": spec.mean_output_tokens}
    jobs = {
        j.phase: {
            "demand": round(j.demand, 1),
            "planned": round(j.throughput, 1),
            "unit": j.unit,
            "requests_per_s": round(j.throughput / per_request.get(j.phase, 1.0), 3),
            "instances": j.instances,
        }
        for j in plan.jobs
    }
    counts: dict[tuple[str, str], int] = {}
    for i in plan.instances:
        counts[(i.phase, i.template)] = counts.get((i.phase, i.template), 0) + 1
    by_phase: dict[str, dict[str, float]] = {}
    for r in rows:
        k = counts[(str(r["phase"]), str(r["template"]))]
        acc = by_phase.setdefault(str(r["phase"]), {"library": 0.0, "simulated": 0.0})
        acc["library"] += k * float(cast(float, r["library"]))
        acc["simulated"] += k * float(cast(float, r["simulated"]))
    for acc in by_phase.values():
        acc["ratio"] = round(acc["simulated"] / acc["library"], 3)
        acc["library"], acc["simulated"] = round(acc["library"], 1), round(acc["simulated"], 1)
    return {
        "coupled": coupled,
        "priced_nodes_placed": priced,
        "libraries_seconds": round(build_s, 1),
        "templates": {p: len(lib.templates) for (_, p), lib in sorted(libs.items())},
        "usd_per_hour": round(plan.hourly_cost_usd, 2),
        "cluster_usd_per_hour": round(cluster, 2),
        "cost_over_cluster": round(plan.hourly_cost_usd / cluster, 3),
        "gpus": plan.gpus(perf.catalog),
        "served_fraction": round(plan.served_fraction, 4),
        "served_requests_per_s": round(
            plan.served_fraction * (spec.demand.requests_per_s or 0.0), 3
        ),
        "jobs": jobs,
        "layout": sorted(f"{i.phase}: {i.template}" for i in plan.instances),
        "binding": plan.binding,
        "capacity": rows,
        "capacity_by_phase": by_phase,
        "simulated_at_served_load": {k: v for k, v in sim.items() if k != "by_model"},
        "load_sweep": sweep,
        "max_requests_per_s_medians_within_slo": max(
            (r["requests_per_s"] for r in sweep if r["medians_within_slo"]), default=0.0
        ),
        "slo_loop": {
            "usd_per_hour": round(loop.hourly_cost_usd, 2),
            "served_fraction": round(loop.served_fraction, 4),
            "binding": loop.binding,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--duration", type=float, default=1200.0)
    args = ap.parse_args()
    out = {
        "stack": STACK,
        "mode": "paper",
        "paper": PAPER,
        "uncoupled": helix_eval(False, args.workers, args.duration),
        "coupled": helix_eval(True, args.workers, args.duration),
        "uncoupled_priced_nodes": helix_eval(False, args.workers, args.duration, priced=True),
        "coupled_priced_nodes": helix_eval(True, args.workers, args.duration, priced=True),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
