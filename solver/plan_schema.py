"""The plan: which template instances run where, what they cost, and how sure the solver is.

Written as `plan.json`; read back by `coral plan diff`, the validator, the Pulumi program and the
next re-plan (its instances are the running fleet, nu0). Instance keys are stable:
`<model>/<phase>/<cloud>:<region>/<template key>/<index>`, so unchanged demand changes nothing; a
spot instance's has its zone before the index: `.../<template key>/spot-<zone>/<index>`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from solver.serving.serving_template import ServingTemplate
from solver.types import BUCKET_SEP, FROZEN, LibPhase

if TYPE_CHECKING:
    from solver.catalog.offers import Catalog

# A claim of attainment at a target needs held-out requests enough for this many misses at the
# target's rate: with fewer, one request more or less moves the estimate past the target.
MIN_EXPECTED_MISSES = 10

Method = Literal["coral", "homo", "cauchy", "homo-paper", "cauchy-paper"]
"""homo/cauchy: today's stronger baselines; *-paper: the paper's, single-node replicas
(`solver.allocation.paper_baselines`)."""


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
    market: Literal["on-demand", "spot"] = Field(
        default="on-demand",
        description="How its nodes are rented: on-demand, or spot (the cloud may take them back).",
    )
    zone: str | None = Field(
        default=None,
        description="A spot instance's zone (its nodes all there, spread by the plan); None "
        "for on-demand, which any zone of the region may place.",
    )

    @model_serializer(mode="wrap")
    def _on_demand_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """An on-demand instance is written without `market` and `zone`: plans that use no spot
        read and hash as they did before spot existed."""
        out: dict[str, Any] = handler(self)
        if self.market == "on-demand" and self.zone is None:
            out.pop("market", None)
            out.pop("zone", None)
        return out

    @property
    def is_spot(self) -> bool:
        return self.market == "spot"


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


def lower_of(verified: float | None, replayed: float | None) -> float | None:
    """What a plan claims from its verified share and its whole-trace replay: the lower of the
    two (None without a verified share; the verified share without a replay)."""
    if verified is None or replayed is None:
        return verified
    return min(verified, replayed)


class ModelAttainment(BaseModel):
    """A model's SLO attainment: its target, what the planner measured on its planning
    workload, and what a simulation on a workload it never saw gives (`coral plan` verifies)."""

    model_config = FROZEN
    model: str
    target: float = Field(description="Share of requests that must meet both SLOs.")
    workload: str = Field(description="What it is judged on: a trace or a generated shape.")
    planned: float | None = Field(description="Attainment on the planning workload.")
    verified: float | None = Field(
        description="Attainment on the verification workload (another seed or trace window); "
        "None when verification is off."
    )
    verified_requests: int = 0
    verified_minutes: float = 0.0
    replayed: float | None = Field(
        default=None,
        description="Attainment on the whole real trace the workload comes from (planning's "
        "requests included), at the model's demand; None for a generated workload.",
    )
    headroom: dict[str, float] = Field(
        default_factory=dict,
        description="phase -> the closed loop's correction of the capacity model (1 = none).",
    )
    cause: str = Field(default="", description="Why it falls short, when it does.")
    under_preemption: float | None = Field(
        default=None,
        description="Attainment on the verification workload with the plan's spot instances "
        "taken back as the market's preemption model says (outages sampled with a fixed seed, "
        "each replacement serving again after the stack's boot_minutes; requests cut are "
        "retried on another instance). A report beside `verified`, not what the plan is judged "
        "by. None when the model runs no spot instance or verification is off.",
    )

    shed: float | None = Field(
        default=None,
        description="Share of the verification workload's requests (at the whole demand) the "
        "gateway's admission control sheds with a 429: the part of the demand a scarce plan "
        "does not serve, and bursts above the capacity of a plan that serves it all. `verified` "
        "and `replayed` are the admitted requests' attainment.",
    )
    held_out_lower: float | None = Field(
        default=None,
        description="One-sided 95% lower confidence bound of `verified` (batch means over the "
        "held-out requests in arrival order).",
    )
    spike: float | None = Field(
        default=None,
        description="Admitted requests' attainment with the verification workload at "
        "SPIKE_LOAD (1.5) x the demand, behind the same admission control.",
    )
    spike_shed: float | None = Field(
        default=None, description="Share of that spike's requests the gateway sheds."
    )
    slower: dict[str, float] = Field(
        default_factory=dict,
        description="Attainment of the admitted requests on the verification workload at the "
        "demand if every engine step took longer than modelled, by factor ('1.2', '1.5'): how "
        "much performance-model error the plan survives.",
    )
    capped: int = Field(
        default=0,
        description="Held-out requests (of `verified_requests` plus those shed) whose lengths "
        "the model's context cut: the prompt to max_context - 1 tokens, the output to what the "
        "context leaves. Written only when some were.",
    )

    @property
    def margin(self) -> float | None:
        """How far the claim (`judged`) stands above the held-out estimate's lower bound: the
        part of the claim the held-out sample cannot vouch for."""
        if self.judged is None or self.held_out_lower is None:
            return None
        return self.judged - self.held_out_lower

    @property
    def needed_requests(self) -> int:
        """Held-out requests a claim at the target needs: enough for MIN_EXPECTED_MISSES misses
        at the target's rate (a 99% claim from 300 requests rests on three misses)."""
        if self.target >= 1:
            return 0
        return math.ceil(MIN_EXPECTED_MISSES / (1 - self.target) - 1e-9)

    @property
    def unsupported(self) -> str:
        """Why the held-out sample cannot support a claim at the target ('' when it can)."""
        if self.verified is None or self.verified_requests >= self.needed_requests:
            return ""
        return (
            f"its held-out sample ({self.verified_requests} requests) is too small to support "
            f"a {100 * self.target:g}% target: that needs at least {self.needed_requests}; raise "
            "coral:fleet.attainment.verify_minutes"
        )

    @model_serializer(mode="wrap")
    def _no_spot_as_before(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A row without `under_preemption` is written without the key: plans that use no spot
        read and hash as they did before spot existed."""
        out: dict[str, Any] = handler(self)
        if self.under_preemption is None:
            out.pop("under_preemption", None)
        if not self.capped:
            out.pop("capped", None)
        return out

    @property
    def judged(self) -> float | None:
        """What the plan is judged by: the verified share, or the whole trace's when that is
        lower (a held-out window that looks better than the hour does not count)."""
        return lower_of(self.verified, self.replayed)

    @property
    def short_by(self) -> float:
        """Points below the target (`judged`; 0 when it meets it)."""
        judged = self.judged
        return max(0.0, self.target - judged) if judged is not None else 0.0

    @property
    def replay_gap(self) -> float:
        """How far the whole trace's attainment is from the verified one (0 without both)."""
        if self.verified is None or self.replayed is None:
            return 0.0
        return abs(self.replayed - self.verified)


class LengthBucket(BaseModel):
    """One length bucket of a routed model: its requests get instances of their own."""

    model_config = FROZEN
    name: str = Field(description="<model>@b<i>: the plan's model name for its instances.")
    min_prompt_tokens: float = Field(ge=0, description="Prompts longer than this ...")
    max_prompt_tokens: float | None = Field(description="... and at most this (None: any).")
    min_body_bytes: int = Field(ge=0, description="The gateway's Content-Length bounds ...")
    max_body_bytes: int | None = Field(description="... (tokens x bytes_per_token).")
    share: float = Field(gt=0, le=1, description="Share of the model's planning requests.")
    mean_prompt_tokens: float = Field(gt=0)
    mean_output_tokens: float = Field(gt=0)
    target: float = Field(description="SLO attainment target of the bucket (shared budget).")


class RoutingDecision(BaseModel):
    """Whether a model with `length_routing` is served by length buckets, and why: both plans'
    cost and verified attainment."""

    model_config = FROZEN
    model: str
    routed: bool
    reason: str
    one_pool_usd_per_hour: float | None
    routed_usd_per_hour: float | None
    one_pool_verified: float | None
    routed_verified: float | None
    buckets: list[LengthBucket]


class Plan(BaseModel):
    model_config = FROZEN
    format: Literal[1] = 1
    stack: str
    method: Method
    mode: str
    served_fraction: float = Field(
        ge=0, le=1, description="The least fraction of any model's demand served (1: all of it)."
    )
    served_fractions: dict[str, float] = Field(
        default_factory=dict,
        description="Per model (a length bucket by its name): the fraction of its demand "
        "served. Under scarcity max-min fair, then the most served (docs/allocation.md).",
    )
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
    capacity_factors: dict[str, float] = Field(
        default_factory=dict,
        description="<model>/<phase>/<template key> -> capacity at the SLO attainment target / "
        "the template's throughput; each instance's `throughput` is the template's times this.",
    )
    attainment: list[ModelAttainment] = Field(
        default_factory=list,
        description="Per model: SLO attainment target, planned, verified; a routed model has "
        "a row per length bucket (<model>@b<i>) and one for the whole model.",
    )
    routing: list[RoutingDecision] = Field(
        default_factory=list, description="Length routing, per model that asks for it."
    )
    closed_loop_stop: str = Field(
        default="",
        description="Why the SLO closed loop stopped, in words ('' where none ran).",
    )

    def fraction_of(self, model: str) -> float:
        """The fraction of `model`'s demand the plan serves (`served_fraction` for a model it
        does not list)."""
        return self.served_fractions.get(model, self.served_fraction)

    def short_models(self) -> dict[str, float]:
        """Models served less than in full, with their fractions."""
        return {m: f for m, f in sorted(self.served_fractions.items()) if f < 1}

    def serves_any(self) -> bool:
        """Whether the plan serves some of some model's demand."""
        if self.served_fractions:
            return max(self.served_fractions.values()) > 0
        return self.served_fraction > 0

    def short_words(self) -> str:
        """The models served less than in full, e.g. 'llama2-70b 0.0%, phi-4 62.5%'."""
        short = self.short_models() or (
            {"every model": self.served_fraction} if self.served_fraction < 1 else {}
        )
        return ", ".join(f"{m} {f:.1%}" for m, f in short.items())

    def gpus(self, catalog: Catalog) -> int:
        """GPUs the plan rents: every node of every instance, by its config's GPU count."""
        return sum(catalog.node(n).gpu_count for i in self.instances for n in i.nodes)

    def below_target(self) -> list[ModelAttainment]:
        """Models whose verified attainment is below their target, or whose held-out sample is
        too small to support it (`ModelAttainment.unsupported`); a routed model is judged as
        a whole: its buckets share its miss budget."""
        return [
            a
            for a in self.attainment
            if (a.short_by > 0 or a.unsupported) and BUCKET_SEP not in a.model
        ]

    def buckets(self) -> dict[str, LengthBucket]:
        """Bucket name -> bucket, for every routed model."""
        return {b.name: b for d in self.routing if d.routed for b in d.buckets}

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
            k = (i.model, i.phase, i.cloud, i.region, market_template(i.template, i.zone))
            out[k] = out.get(k, 0) + 1
        return out


def market_template(template: str, zone: str | None) -> str:
    """A template key as the running fleet counts it: a spot zone's instances apart from the
    on-demand ones (`<template key>/spot-<zone>`)."""
    return template if zone is None else f"{template}/spot-{zone}"


def instance_key(
    model: str, phase: str, cloud: str, region: str, template: str, i: int, zone: str | None = None
) -> str:
    """An instance's stable key; a spot instance's names its zone (`spot-<zone>`)."""
    return f"{model}/{phase}/{cloud}:{region}/{market_template(template, zone)}/{i}"


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
