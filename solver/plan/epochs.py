"""Epochs as the paper runs them (Sec. 4): re-plan every adjustment interval, with the
start-up penalty against the running plan, while availability changes between epochs.

Each epoch plans with nu0 = the previous epoch's plan, under that epoch's availability (every
(region, node config) count scaled by the epoch's factor). Instances that are new in an epoch
serve only after `startup_s`; until then the epoch runs on the instances it kept. Each epoch is
simulated in those two parts with fresh traces at the stack's demand. Instances leaving the plan
are assumed drained at the epoch boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from solver.catalog.market import build_market
from solver.catalog.offers import Catalog
from solver.performance.perf_model import PerfModel
from solver.plan.planner import plan_stack
from solver.plan_schema import Plan, diff_plans
from solver.serving.library import Library
from solver.simulation.simulator import simulate
from solver.simulation.workload import model_contexts, stack_requests
from solver.stack import FleetConfig, NodeAvailability
from solver.types import Job


@dataclass(frozen=True)
class EpochResult:
    epoch: int
    availability_factor: float
    hourly_cost_usd: float
    startup_penalty_usd_per_hour: float
    served_fraction: float
    added: int
    removed: int
    goodput_tokens_per_s: float
    slo_attainment: float


def scaled_availability(fleet: FleetConfig, catalog: Catalog, factor: float) -> FleetConfig:
    """The stack with every (region, node config) availability scaled by `factor` (floored)."""
    market = build_market(fleet.market_scope(), catalog)
    overrides = [
        NodeAvailability.model_validate(
            {"cloud": r[0], "region": r[1], "node": n, "count": math.floor(count * factor)}
        )
        for (r, n), count in market.available.items()
    ]
    return fleet.model_copy(update={"availability": overrides})


def run_epochs(
    stack: str,
    fleet: FleetConfig,
    perf: PerfModel,
    libs: dict[Job, Library],
    factors: list[float],
    epoch_s: float = 360,
    startup_s: float = 360,
    seed: int = 0,
    cold_start: bool = False,
) -> list[EpochResult]:
    """Plan and simulate one epoch per availability factor. The first epoch's fleet is already
    serving when the run starts, unless `cold_start` (then it too waits `startup_s`)."""
    results = []
    previous: Plan | None = None
    contexts = model_contexts(fleet.models, perf.cards)
    for e, factor in enumerate(factors):
        epoch_fleet = scaled_availability(fleet, perf.catalog, factor)
        plan = plan_stack(stack, epoch_fleet, perf.catalog, libs, previous)
        diff = (
            diff_plans(previous, plan)
            if previous is not None
            else {"added": [i.key for i in plan.instances], "removed": []}
        )
        new = set(diff["added"]) if previous is not None or cold_start else set()
        warm = min(startup_s, epoch_s)
        parts = []
        if warm > 0 and new:
            kept = plan.model_copy(
                update={"instances": [i for i in plan.instances if i.key not in new]}
            )
            parts.append((kept, warm))
        parts.append((plan, epoch_s - warm if new else epoch_s))
        good = met = total = 0.0
        for k, (p, seconds) in enumerate(parts):
            if seconds <= 0:
                continue
            traces = stack_requests(
                fleet.models, seconds, seed=seed + 100 * e + 10 * k, max_contexts=contexts
            )
            result = simulate(p, fleet.models, perf, traces, seconds)
            for r in result.models.values():
                good += float(r.output[r.met].sum())
                met += float(r.met.sum())
                total += len(r.met)
        results.append(
            EpochResult(
                epoch=e,
                availability_factor=factor,
                hourly_cost_usd=plan.hourly_cost_usd,
                startup_penalty_usd_per_hour=plan.startup_penalty_usd_per_hour,
                served_fraction=plan.served_fraction,
                added=len(diff["added"]),
                removed=len(diff["removed"]),
                goodput_tokens_per_s=round(good / epoch_s, 3),  # SLO-meeting tokens/s
                slo_attainment=round(met / total, 4) if total else 1.0,
            )
        )
        previous = plan
    return results
