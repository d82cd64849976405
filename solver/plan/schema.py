"""The plan: which template instances run where, what they cost, and how sure the solver is.

Written as `plan.json`; read back by `coral plan diff`, the validator, the Pulumi program and the
next re-plan (its instances are the running fleet, nu0). Instance keys are stable:
`<model>/<phase>/<cloud>:<region>/<template key>/<index>`, so unchanged demand changes nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from solver.templates.serving_template import ServingTemplate
from solver.types import FROZEN, LibPhase

Method = Literal["coral", "homo", "cauchy"]


class Instance(BaseModel):
    """One serving instance: one template in one region, serving one replica."""

    model_config = FROZEN
    key: str = Field(description="<model>/<phase>/<cloud>:<region>/<template>/<index>")
    model: str
    phase: LibPhase
    cloud: str
    region: str
    template: str = Field(description="Template key, e.g. 'l40sx1*3+l4x1'.")
    index: int = Field(ge=0)
    nodes: list[str]
    usd_per_hour: float
    throughput: float


class JobResult(BaseModel):
    """Demand vs delivered throughput of one (model, phase)."""

    model_config = FROZEN
    model: str
    phase: LibPhase
    unit: Literal["tokens/s", "requests/s"]
    demand: float
    throughput: float
    usd_per_hour: float
    instances: int


class SolverReport(BaseModel):
    model_config = FROZEN
    backend: str
    status: str = Field(description="optimal, feasible (gap open), or infeasible.")
    objective: float = Field(description="$/hour incl. the start-up penalty.")
    best_bound: float | None = Field(description="None: the solver proved no bound.")
    gap: float | None = Field(
        description="(objective - bound) / objective; None: unknown (the solve stopped "
        "without a bound)."
    )
    solve_seconds: float = Field(description="Wall time of every solve of this plan.")
    time_limit_s: float
    relative_gap: float


class Plan(BaseModel):
    model_config = FROZEN
    format: Literal[1] = 1
    stack: str
    method: Method
    mode: str
    served_fraction: float = Field(ge=0, le=1, description="Uniform fraction of demand served.")
    hourly_cost_usd: float = Field(description="Provisioning $/hour of every instance.")
    startup_penalty_usd_per_hour: float = Field(description="K x price of new instances.")
    cost_by_model: dict[str, dict[str, float]] = Field(description="model -> phase -> $/hour.")
    jobs: list[JobResult]
    instances: list[Instance]
    templates: dict[str, ServingTemplate] = Field(
        description="<model>/<phase>/<template key> -> the template (stages, layer split)."
    )
    binding: list[str] = Field(description="Constraints that limit the plan, in words.")
    solver: SolverReport | None = Field(description="None for greedy baselines.")
    input_hashes: dict[str, str]

    def unpaired(self, models: set[str] | None = None) -> list[tuple[str, str, str, list[str]]]:
        """(model, cloud, region, phases) where a disaggregated model runs only prefill or only
        decode instances (of `models`, default all): pairs that cannot hand over KV there."""
        phases: dict[tuple[str, str, str], set[str]] = {}
        for i in self.instances:
            if i.phase in ("prefill", "decode") and (models is None or i.model in models):
                phases.setdefault((i.model, i.cloud, i.region), set()).add(i.phase)
        return [
            (model, cloud, region, sorted(seen))
            for (model, cloud, region), seen in sorted(phases.items())
            if seen != {"prefill", "decode"}
        ]

    def counts(self) -> dict[tuple[str, str, str, str, str], int]:
        """(model, phase, cloud, region, template) -> instances: the running fleet nu0."""
        out: dict[tuple[str, str, str, str, str], int] = {}
        for i in self.instances:
            k = (i.model, i.phase, i.cloud, i.region, i.template)
            out[k] = out.get(k, 0) + 1
        return out


def instance_key(model: str, phase: str, cloud: str, region: str, template: str, i: int) -> str:
    return f"{model}/{phase}/{cloud}:{region}/{template}/{i}"


def template_ref(model: str, phase: str, key: str) -> str:
    return f"{model}/{phase}/{key}"


def diff_plans(a: Plan, b: Plan) -> dict[str, Any]:
    """Instances added and removed (by stable key), and $/hour before and after per model."""
    ka = {i.key: i for i in a.instances}
    kb = {i.key: i for i in b.instances}
    added, removed = sorted(set(kb) - set(ka)), sorted(set(ka) - set(kb))
    models = sorted({i.model for i in a.instances} | {i.model for i in b.instances})
    by_model = {}
    for m in models:
        by_model[m] = {
            "added": sum(1 for k in added if kb[k].model == m),
            "removed": sum(1 for k in removed if ka[k].model == m),
            "before": round(sum(i.usd_per_hour for i in a.instances if i.model == m), 4),
            "after": round(sum(i.usd_per_hour for i in b.instances if i.model == m), 4),
        }
    return {
        "added": added,
        "removed": removed,
        "by_model": by_model,
        "hourly_cost_delta_usd": round(b.hourly_cost_usd - a.hourly_cost_usd, 4),
    }
