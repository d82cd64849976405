"""A small real stack for allocation tests: two models, two regions, four node configs.

Its libraries are built once per test session (a few seconds) with the real performance model.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from solver.performance.default_model import load_perf_model
from solver.performance.perf_model import PerfModel
from solver.plan.demand import stack_demand
from solver.serving.library import Library, build_libraries
from solver.stack import FleetConfig

SMALL_FLEET: dict[str, Any] = {
    "description": "allocation tests",
    "models": {
        "phi-4": {
            "slo_ms": {"prefill": 1200, "decode": 60},
            "mean_prompt_tokens": 1020,
            "mean_output_tokens": 129,
            "demand": {"requests_per_s": 2},
        },
        "gpt-oss-20b": {
            "slo_ms": {"prefill": 900, "decode": 30},
            "mean_prompt_tokens": 1500,
            "mean_output_tokens": 13,
            "demand": {"requests_per_s": 3},
        },
    },
    "regions": [
        {"cloud": "aws", "region": "us-east-2"},
        {"cloud": "aws", "region": "ap-northeast-2"},
    ],
    "node_configs": ["l4x1", "l40sx1", "a10gx1", "l4x4"],
    "library": {"n_max": 3, "rho": 12, "mode": "vllm"},
    "allocation": {"relative_gap": 0.0, "time_limit_s": 30},
}


def fleet(**changes: Any) -> FleetConfig:
    """The small fleet with top-level keys replaced (plain dicts, validated like a stack)."""
    return FleetConfig.model_validate(SMALL_FLEET | changes)


@cache
def perf() -> PerfModel:
    return load_perf_model()


@cache
def libraries() -> dict[tuple[str, str], Library]:
    f = fleet()
    libs = build_libraries(perf(), f.library_scope(), list(stack_demand(f.models)))  # type: ignore[arg-type]
    return {(lib.model, lib.phase): lib for lib in libs}


def rps_needing(model: str, phase: str, template: str, instances: float) -> float:
    """Requests/s of `model` at which its `phase` demand is `instances` x the throughput of
    `template` (a key of that job's library), read from the current performance model.

    Tests pin demand this way rather than as a bare number, so a recalibrated model keeps the
    plan they were written for (how many instances a job needs) instead of silently changing it.
    """
    (t,) = [t for t in libraries()[(model, phase)].templates if t.key == template]
    spec = SMALL_FLEET["models"][model]
    per_request = spec["mean_prompt_tokens" if phase == "prefill" else "mean_output_tokens"]
    return float(instances * t.throughput / per_request)
