"""The paper's Helix comparison (Sec. 6.6) in paper mode, with and without coupled decode.

`paper-helix` (Helix's 42-node, 64-GPU cluster as the only availability, Llama-2-70B, SLOs
2090 / 730 ms, AWS us-east-2 prices, 4 req/s) in the paper's template space
(`library.mode: paper`), planned as the paper plans (`plan_stack` at library throughput) and
through `coral plan`'s path (`plan_with_library`: libraries, the SLO attainment loop,
verification, validation). The market stays the stack's AWS prices, as in the paper's Helix run
(Table 1 has no V100 or T4). Each plan's templates are then driven alone past their capacity in
the simulator (`capacity_check`: simulated / library throughput).

Two placement strategies for the paper-mode libraries (`Placement`):

- coupled (the default of paper mode, `build_libraries`): one micro-batch size at every stage
  of a decode pipeline (`solver.serving.placement_search.place_coupled`);
- uncoupled (`uncoupled_placement`): the paper's per-stage T̂, each decode stage at its own
  batch. Its libraries are placed in this process over the same multisets and pruned and
  hashed alike (`place_library`), in their own cache folder.

The nodes a stack prices only through its own `prices` (paper-helix's a100-40gbx1, l4x2, t4x2)
are placed like any other (`available_node_configs` counts them).

`coral bench helix` runs `run` and prints its JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from math import inf
from pathlib import Path
from typing import Any, cast

from solver.catalog.market import build_market
from solver.errors import InputError
from solver.evaluation.paper_results import paper_results
from solver.performance.perf_model import PerfModel
from solver.plan.demand import stack_demand
from solver.plan.planner import libraries_for, plan_stack, plan_with_library
from solver.plan.validator import validate_plan
from solver.serving.candidates import Candidate, RowSource
from solver.serving.enumeration import available_node_configs, enumerate_multisets, to_template
from solver.serving.library import Library, input_hashes, load_library, save_library
from solver.serving.library_format import LibraryStats
from solver.serving.paper_mode import paper_candidate
from solver.serving.pruning import prune_dominated
from solver.simulation.simulator import capacity_check, simulate
from solver.simulation.workload import model_trace
from solver.stack import FleetConfig, load_stack
from solver.types import Job

STACK = "paper-helix"
MODEL = "llama2-70b"
LOADS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)  # x the plan's served load

# How one node multiset is placed: its best candidate, or None when nothing fits the budgets.
Placement = Callable[[RowSource, tuple[str, ...]], Candidate | None]


def uncoupled_placement(rows: RowSource, nodes: tuple[str, ...]) -> Candidate | None:
    """Paper mode with the paper's uncoupled per-stage T̂ (each decode stage at its own batch)."""
    return paper_candidate(rows, nodes, coupled=False)


def place_library(perf: PerfModel, fleet: FleetConfig, job: Job, place: Placement) -> Library:
    """One job's library with the placement strategy `place`, in this process: the multisets
    `build_libraries` enumerates, pruned as it prunes, with the same input hashes (so
    `libraries_for` and `plan_with_library` load it from its folder)."""
    t0 = time.perf_counter()
    model, phase = job
    settings = fleet.library
    nodes, _ = available_node_configs(fleet.market_scope(), perf.catalog)
    weight = perf.card(model).weight_bytes
    multisets = list(
        enumerate_multisets(
            nodes, settings.n_max, settings.rho, weight, perf.catalog, settings.mixing
        )
    )
    rows = RowSource(perf, model, phase, fleet.models[model], nodes)
    found = [c for ms in multisets if (c := place(rows, ms)) is not None]
    kept, dominated = prune_dominated(found)
    slo = fleet.models[model].slo_ms
    slo_ms = (
        {"prefill": slo.prefill, "decode": slo.decode}
        if phase == "aggregated"
        else {phase: getattr(slo, phase)}
    )
    return Library(
        model=model,
        phase=phase,
        mode=settings.mode,
        slo_ms=slo_ms,
        input_hashes=input_hashes(perf, fleet.library_scope(), model, phase),
        node_configs=nodes,
        stats=LibraryStats(
            enumerated=len(multisets),
            feasible=len(found),
            dominated=dominated,
            kept=len(kept),
            build_seconds=round(time.perf_counter() - t0, 3),
        ),
        templates=sorted((to_template(rows, c) for c in kept), key=lambda t: t.key),
    )


def placed_libraries(
    perf: PerfModel, fleet: FleetConfig, folder: Path, place: Placement
) -> dict[Job, Library]:
    """The stack's libraries from `folder`, each missing or stale one placed with `place` and
    saved there first."""
    libs = {}
    for job in stack_demand(fleet.models):
        try:
            libs[job] = load_library(folder, perf, fleet.library_scope(), *job)
        except InputError:  # missing, unreadable or stale
            libs[job] = place_library(perf, fleet, job, place)
            save_library(libs[job], folder, STACK)
    return libs


def helix_fleet(stacks: Path) -> FleetConfig:
    """`paper-helix` (from the folder `stacks`) in paper mode (the committed stack is general
    mode)."""
    return load_stack(stacks, STACK).with_mode("paper")


def cluster_usd_per_hour(fleet: FleetConfig, perf: PerfModel) -> float:
    """Every node of the cluster at the stack's prices: what Helix's one pipeline rents."""
    market = build_market(fleet.market_scope(), perf.catalog)
    return sum(
        a.count * market.price[((str(a.cloud), a.region), a.node)] for a in fleet.availability
    )


def helix_eval(
    perf: PerfModel,
    root: Path,
    cache: Path,
    coupled: bool = True,
    workers: int = 1,
    duration_s: float = 1200.0,
) -> dict[str, Any]:
    """Plan `paper-helix` (from `root`/stacks) in paper mode and check it in the simulator.

    Planned as the paper plans (`plan_stack`: demand against each template's library
    throughput, no SLO attainment loop), validated, then: each template alone past its capacity
    (`capacity_check`), and the whole plan on a generated trace at the load it serves (its
    served fraction x 4 req/s) for SLO attainment and median TTFT / TPOT. `slo_loop` is what
    `coral plan`'s path (`plan_with_library`) gives for the same fleet. Libraries are cached
    under `cache`/coupled or `cache`/uncoupled-per-stage.

    Returns the plan's $/hour (and over the whole cluster's), GPUs, served fraction, planned
    throughput per phase, layout, capacity per template and per phase, and the simulation.
    """
    fleet = helix_fleet(root / "stacks")
    folder = cache / ("coupled" if coupled else "uncoupled-per-stage")
    t0 = time.perf_counter()
    if coupled:
        jobs = list(stack_demand(fleet.models))
        libs = libraries_for(perf, fleet, jobs, folder, workers=workers, stack=STACK)
    else:
        libs = placed_libraries(perf, fleet, folder, uncoupled_placement)
    loop = plan_with_library(STACK, fleet, perf, folder, workers=1, root=root)
    build_s = time.perf_counter() - t0
    plan = validate_plan(
        plan_stack(STACK, fleet, perf.catalog, libs), fleet.plan_scope(), perf.catalog, perf.cards
    )
    rows = capacity_check(plan, fleet.models, perf, duration_s=duration_s)
    spec = fleet.models[MODEL]
    rate = (spec.demand.requests_per_s or 0.0) if spec.demand is not None else 0.0
    context = perf.card(MODEL).max_context
    trace = model_trace(spec, 0, "verify", duration_s, root, plan.served_fraction, context)
    sim = simulate(plan, fleet.models, perf, {MODEL: trace}, duration_s).summary()
    sweep: list[
        dict[str, Any]
    ] = []  # the paper holds Coral to Helix's median latencies: the load where both hold
    for load in LOADS:
        t = model_trace(spec, 0, "verify", duration_s, root, plan.served_fraction * load, context)
        r = simulate(plan, fleet.models, perf, {MODEL: t}, duration_s).summary()
        ttft = cast(float | None, r["ttft_p50_ms"]) or inf
        tpot = cast(float | None, r["tpot_p50_ms"]) or inf
        ok = ttft <= spec.slo_ms.prefill and tpot <= spec.slo_ms.decode
        sweep.append(
            {
                "requests_per_s": round(plan.served_fraction * load * rate, 3),
                "ttft_p50_ms": r["ttft_p50_ms"],
                "tpot_p50_ms": r["tpot_p50_ms"],
                "slo_attainment": r["slo_attainment"],
                "medians_within_slo": ok,
            }
        )
    cluster = cluster_usd_per_hour(fleet, perf)
    per_request = {"prefill": spec.mean_prompt_tokens, "decode": spec.mean_output_tokens}
    jobs_out = {
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
        "libraries_seconds": round(build_s, 1),
        "templates": {p: len(lib.templates) for (_, p), lib in sorted(libs.items())},
        "usd_per_hour": round(plan.hourly_cost_usd, 2),
        "cluster_usd_per_hour": round(cluster, 2),
        "cost_over_cluster": round(plan.hourly_cost_usd / cluster, 3),
        "gpus": plan.gpus(perf.catalog),
        "served_fraction": round(plan.served_fraction, 4),
        "served_requests_per_s": round(plan.served_fraction * rate, 3),
        "jobs": jobs_out,
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


def run(
    perf: PerfModel, root: Path, cache: Path, workers: int = 1, duration_s: float = 1200.0
) -> dict[str, Any]:
    """Both placements (`helix_eval`), beside the paper's Sec. 6.6 numbers: helix.json."""
    helix = paper_results().helix
    return {
        "stack": STACK,
        "mode": "paper",
        "paper": {
            "cost_vs_helix": helix.cost_vs_helix.value,
            "throughput_vs_helix": helix.throughput_vs_helix.value,
        },
        "uncoupled": helix_eval(perf, root, cache, False, workers, duration_s),
        "coupled": helix_eval(perf, root, cache, True, workers, duration_s),
    }
