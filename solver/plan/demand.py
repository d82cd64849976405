"""Demand per (model, phase) from a stack: one rule for the planner and the plan validator."""

from __future__ import annotations

from collections.abc import Mapping

from solver.errors import InputError
from solver.stack import AllocationSettings, ModelSpec
from solver.types import Job


def stack_demand(models: Mapping[str, ModelSpec]) -> dict[Job, float]:
    """(model, phase) -> demand: tokens/s for prefill and decode, requests/s for aggregated.

    Args:
        models: the stack's models (`coral:fleet.models`), by name.

    Returns:
        Each job's demand, in stack order of the models.

    Raises:
        InputError: a model without demand, or with a demand its serving mode cannot use.
    """
    out: dict[Job, float] = {}
    for model, spec in models.items():
        try:
            for phase, d in spec.phase_demand().items():
                out[(model, phase)] = d
        except ValueError as e:
            raise InputError(
                f"coral:fleet.models.{model}.demand",
                str(e),
                "add `demand: {requests_per_s: N}` (or tokens_per_s: {prefill, decode})",
            ) from e
    return out


def capacity_needed(allocation: AllocationSettings, demand: dict[Job, float]) -> dict[Job, float]:
    """Capacity to buy per job: demand over `allocation.target_utilization` (queueing headroom).

    Args:
        allocation: the stack's allocation settings (their `target_utilization`).
        demand: (model, phase) -> demand, as `stack_demand` gives it.

    Returns:
        (model, phase) -> throughput the plan must deliver at a served fraction of 1.
    """
    u = allocation.target_utilization
    return {job: d / u for job, d in demand.items()}
