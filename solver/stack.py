"""Stack config (`stacks/Pulumi.<stack>.yaml`, key `coral:fleet`): one schema for every stack.

Parsed once into frozen pydantic models; errors name the key path (`coral:fleet.models.phi-4.
slo_ms.prefill`) and the fix. Sections: models (SLOs, request shape, demand, serving mode),
regions, node_configs, library (N_max, rho, library mode), availability / gpu_pools / prices
(overrides of the catalog), allocation (boot time and re-plan interval, which give K; budget;
solver settings), demand_source.

The `deploy` section of the same object belongs to the Pulumi program: the solver leaves it to
`coral_iac.deploy_settings`, which validates it (the solver knows nothing of images or ports).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, model_validator

from solver.catalog.market_settings import MarketSettings
from solver.catalog.user_models import UserModelCard, resolve_entry
from solver.errors import InputError, unknown_value
from solver.io import parse_model, read_yaml
from solver.modes import LIBRARY_MODES, LibraryMode, library_mode
from solver.types import BUCKET_SEP, FROZEN, LibPhase, Mode

FLEET_KEY = "coral:fleet"

# Upper bounds on the numbers that reach the allocation ILP. Each is far above any real fleet
# (so a value above it is a typo, such as an exponent too many) and far below what breaks the
# arithmetic: demand of 1e30 leaves the solver with infinite coefficients, 1e308 overflows.
# The largest public LLM services serve about 1e5-1e6 requests/s and 1e9 tokens/s worldwide
# (Google reported over 1.3 quadrillion tokens a month across its products on Alphabet's
# October 2025 earnings call: about 5e8 tokens/s).
MAX_REQUESTS_PER_S = 1e7
MAX_TOKENS_PER_S = 1e10
MAX_MEAN_TOKENS = 1e7  # no model reads a longer context (the longest, Llama 4 Scout's, is 10M)
MAX_SLO_MS = 3_600_000  # an hour
MAX_NODES = 1_000_000  # nodes of one config (or GPUs of one type) in one region
MAX_NODE_USD_PER_HOUR = 10_000  # 100x the dearest GPU node (AWS p5.48xlarge, 98.32 $/h in 2024)
MAX_BUDGET_USD_PER_HOUR = 1e9


class Slo(BaseModel):
    model_config = FROZEN
    prefill: float = Field(
        gt=0, le=MAX_SLO_MS, description="Prefill latency SLO, ms (TTFT-like); at most an hour."
    )
    decode: float = Field(
        gt=0,
        le=MAX_SLO_MS,
        description="Decode latency SLO, ms per output token; at most an hour.",
    )


Serving = Literal["disaggregated", "aggregated"]


class PhaseTokens(BaseModel):
    model_config = FROZEN
    prefill: float = Field(
        ge=0,
        le=MAX_TOKENS_PER_S,
        description="Prompt tokens/s to prefill; at most 1e10, 20 times what the largest "
        "public LLM services process worldwide.",
    )
    decode: float = Field(
        ge=0,
        le=MAX_TOKENS_PER_S,
        description="Output tokens/s to generate; at most 1e10, 20 times what the largest "
        "public LLM services process worldwide.",
    )


class Demand(BaseModel):
    """A model's demand: requests/s (phases follow from the mean lengths) or tokens/s per phase."""

    model_config = FROZEN
    requests_per_s: float | None = Field(
        default=None,
        ge=0,
        le=MAX_REQUESTS_PER_S,
        description="Requests/s to serve; at most 1e7, ten times what the largest public LLM "
        "services serve worldwide.",
    )
    tokens_per_s: PhaseTokens | None = Field(default=None, description="Or tokens/s per phase.")

    @model_validator(mode="after")
    def _exactly_one(self) -> Demand:
        if (self.requests_per_s is None) == (self.tokens_per_s is None):
            raise ValueError("give exactly one of requests_per_s or tokens_per_s")
        return self


class LengthRouting(BaseModel):
    """Route a model's requests by prompt length (Mélange's request-size buckets): each bucket
    gets its own instances, planned for its own lengths (solver/plan/length_routing.py)."""

    model_config = FROZEN
    split_quantiles: list[float] = Field(
        min_length=1,
        max_length=3,
        description="Cut the prompt lengths at these quantiles of the planning workload, e.g. "
        "[0.5] (two buckets at the median) or [0.9].",
    )
    mode: Literal["auto", "always"] = Field(
        default="auto",
        description="auto: plan with and without the buckets and keep the cheaper of the two "
        "that meets the target; always: route whatever it costs.",
    )
    bytes_per_token: float = Field(
        default=4.0,
        gt=0,
        le=64,
        description="The gateway routes on the request's Content-Length: a bucket's bound in "
        "tokens times this (about 4 bytes of English text per token).",
    )

    @model_validator(mode="after")
    def _increasing(self) -> LengthRouting:
        q = self.split_quantiles
        if any(not 0 < x < 1 for x in q) or any(a >= b for a, b in zip(q, q[1:], strict=False)):
            raise ValueError(f"split_quantiles must increase strictly inside (0, 1), got {q}")
        return self


class LengthSlice(BaseModel):
    """The requests of one length bucket: set by the planner on a bucket's spec, never in a
    stack file."""

    model_config = FROZEN
    min_prompt_tokens: float = Field(ge=0, description="Prompts longer than this ...")
    max_prompt_tokens: float | None = Field(description="... and at most this (None: no bound).")
    share: float = Field(gt=0, le=1, description="The bucket's share of the model's requests.")
    base_prompt_tokens: float = Field(gt=0, description="The whole model's mean prompt length.")
    base_output_tokens: float = Field(gt=0, description="The whole model's mean output length.")


class MeasuredLengths(BaseModel):
    """A model's request lengths as its fleet served them (`coral demand refresh` from vLLM's
    prompt and generation token histograms): the means exactly, and the sigma of the lognormal
    that makes the histograms' buckets most likely. Generated requests are drawn from it in
    place of the named `workload` shape."""

    model_config = FROZEN
    mean_prompt_tokens: float = Field(gt=0, le=MAX_MEAN_TOKENS)
    mean_output_tokens: float = Field(gt=0, le=MAX_MEAN_TOKENS)
    prompt_sigma: float = Field(ge=0, le=3)
    output_sigma: float = Field(ge=0, le=3)
    requests: int = Field(ge=0, description="Finished requests the histograms held.")
    source: str = Field(min_length=1, description="What measured them, and when.")


class ModelSpec(BaseModel):
    """One served model: its SLOs, the mean request shape of its workload, and its demand."""

    model_config = FROZEN
    slo_ms: Slo
    mean_prompt_tokens: float = Field(
        gt=0, le=MAX_MEAN_TOKENS, description="Mean prompt length of its workload, tokens."
    )
    mean_output_tokens: float = Field(
        gt=0, le=MAX_MEAN_TOKENS, description="Mean output length of its workload, tokens."
    )
    workload: str = Field(default="", description="Trace the lengths come from, with source.")
    demand: Demand | None = Field(default=None, description="Needed by `coral plan`.")
    serving: Serving = Field(
        default="disaggregated",
        description="disaggregated: prefill and decode replicas (the paper's default); "
        "aggregated: one replica serves both phases (capacity in requests/s).",
    )
    slo_attainment: float = Field(
        default=0.9,
        ge=0.5,
        le=0.999,
        description="Share of requests that must meet both the TTFT and the TPOT SLO. The "
        "planner buys capacity for it and `coral plan` verifies it by simulation "
        "(docs/slo-attainment.md).",
    )
    workload_trace: str | None = Field(
        default=None,
        description="A request trace the plan is judged on: a packaged one (azure-conv-2023, "
        "azure-code-2023) or a CSV in the project (timestamp,prompt,output). Its time is "
        "scaled to the demand and its lengths to the mean lengths above. Default: generated "
        "requests shaped like `workload`.",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="Under scarcity (demand the availability or budget cannot meet), models of "
        "a higher priority are served first; within a priority the least served fraction is "
        "made as large as it can be, then the total. Equal (0) by default; -1000 to 1000.",
    )
    length_routing: LengthRouting | None = Field(
        default=None,
        description="Route requests by prompt length to buckets of their own instances "
        "(docs/slo-attainment.md, length-aware routing). Default: one pool.",
    )
    length_slice: LengthSlice | None = Field(
        default=None, description="Set by the planner on a length bucket; not for stack files."
    )
    measured_lengths: MeasuredLengths | None = Field(
        default=None,
        description="Set from the demand source (a refreshed demand file or Prometheus): the "
        "lengths the fleet served, in place of the means above and the workload's shape; not "
        "for stack files.",
    )

    @model_validator(mode="after")
    def _demand_in_bounds(self) -> ModelSpec:
        if self.demand is not None and (problem := demand_bound_problem(self, self.demand)):
            raise ValueError(f"demand: {problem}")
        return self

    def phase_demand(self) -> dict[LibPhase, float]:
        """Demand per library phase: tokens/s for prefill/decode, requests/s for aggregated.

        Raises:
            ValueError: no demand, or tokens/s given for an aggregated model.
        """
        if self.demand is None:
            raise ValueError("no demand")
        d = self.demand
        if self.serving == "aggregated":
            if d.requests_per_s is None:
                raise ValueError("an aggregated model needs demand.requests_per_s")
            return {"aggregated": d.requests_per_s}
        if d.tokens_per_s is not None:
            return {"prefill": d.tokens_per_s.prefill, "decode": d.tokens_per_s.decode}
        assert d.requests_per_s is not None
        return {
            "prefill": d.requests_per_s * self.mean_prompt_tokens,
            "decode": d.requests_per_s * self.mean_output_tokens,
        }

    @property
    def decode_context_tokens(self) -> float:
        """Mean context during decode: the prompt plus half the output."""
        return self.mean_prompt_tokens + self.mean_output_tokens / 2


def demand_bound_problem(spec: ModelSpec, demand: Demand) -> str | None:
    """Why `demand`, in the model's own units, is above the demand bounds; None if it is not.

    A disaggregated model's requests/s become tokens/s per phase (times its mean lengths), an
    aggregated model's tokens/s become requests/s (over them, the larger of the two), as
    `solver.operations.demand_rules.phase_figures` converts them: each must stay within
    `MAX_TOKENS_PER_S` or `MAX_REQUESTS_PER_S` like a figure written in those units.
    """
    rps, tokens = demand.requests_per_s, demand.tokens_per_s
    if rps is not None and spec.serving != "aggregated":
        for phase, mean in (
            ("prompt", spec.mean_prompt_tokens),
            ("output", spec.mean_output_tokens),
        ):
            if rps * mean > MAX_TOKENS_PER_S:
                return (
                    f"{rps:g} requests/s x {mean:g} mean {phase} tokens = {rps * mean:.3g} "
                    f"{phase} tokens/s, above the {MAX_TOKENS_PER_S:.0e} tokens/s a demand may be"
                )
    if tokens is not None and spec.serving == "aggregated":
        per_s = max(
            tokens.prefill / spec.mean_prompt_tokens, tokens.decode / spec.mean_output_tokens
        )
        if per_s > MAX_REQUESTS_PER_S:
            return (
                f"its tokens/s over the mean request make {per_s:.3g} requests/s (the model is "
                f"aggregated), above the {MAX_REQUESTS_PER_S:.0e} requests/s a demand may be"
            )
    return None


class LibrarySettings(BaseModel):
    """Serving-template enumeration settings (paper defaults)."""

    model_config = FROZEN
    n_max: int = Field(default=6, ge=1, le=8, description="Most nodes in one serving template.")
    rho: float = Field(default=12, gt=1, description="Most total GPU memory, x model weights.")
    mode: Mode = Field(default="vllm", description="Runtime capability: vllm, general or paper.")
    mixing: bool = Field(
        default=True,
        description="Templates may mix GPU types; false keeps one GPU type per template (node "
        "configs of one GPU with different counts still combine), to see what heterogeneity "
        "buys on this stack.",
    )

    @property
    def strategy(self) -> LibraryMode:
        """What `mode` does, as an object the stages call (`solver.modes`): chosen here only,
        from the name the stack gives (checked when the stack is parsed)."""
        return LIBRARY_MODES[self.mode]


class Region(BaseModel):
    model_config = FROZEN
    cloud: Literal["aws", "gcp"]
    region: str


class NodeAvailability(BaseModel):
    """How many nodes of one config one region can give us (overrides the catalog's)."""

    model_config = FROZEN
    cloud: Literal["aws", "gcp"]
    region: str
    node: str
    count: int = Field(ge=0, le=MAX_NODES, description="Nodes; at most a million.")


class GpuPool(BaseModel):
    """GPUs of one type one region can give us, shared by every node config of that GPU."""

    model_config = FROZEN
    cloud: Literal["aws", "gcp"]
    region: str
    gpu: str = Field(description="GPU type id (`coral catalog show`), e.g. l4.")
    gpus: int = Field(ge=0, le=MAX_NODES, description="GPUs; at most a million.")


class PriceOverride(BaseModel):
    """A negotiated or changed price; like every outside number it carries its source."""

    model_config = FROZEN
    cloud: Literal["aws", "gcp"]
    region: str
    node: str
    usd_per_hour: float = Field(
        gt=0,
        le=MAX_NODE_USD_PER_HOUR,
        description="$/hour of one node; at most 10,000 (the dearest cloud GPU nodes rent for "
        "about 100 $/hour).",
    )
    source: str = Field(min_length=1, description="Where the price comes from, and when.")


class PreemptionOverride(BaseModel):
    """The stack's own preemption model for spot capacity: for one cloud, or one region of it,
    or one node config there (the most specific match wins), in place of the shipped one
    (`solver/data/spot/preemption.yaml`, partly assumed). Like every outside number it carries
    its source."""

    model_config = FROZEN
    cloud: Literal["aws", "gcp"]
    region: str | None = Field(default=None, description="Only this region (default: all).")
    node: str | None = Field(default=None, description="Only this node config (default: all).")
    rate_per_hour: float = Field(
        ge=0, le=1, description="Preemptions per instance-hour, e.g. 0.01: one in 100 hours."
    )
    zone_correlation: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Chance that a preemption in a zone takes every spot instance of that node "
        "config in the zone at once (default: the shipped assumption).",
    )
    source: str = Field(min_length=1, description="Where the rate comes from, and when.")

    def matches(self, cloud: str, region: str, node: str) -> bool:
        return cloud == self.cloud and self.region in (None, region) and self.node in (None, node)

    @property
    def specificity(self) -> int:
        return (self.region is not None) + (self.node is not None)


Backend = Literal["cp-sat", "scip", "highs"]


class SpotSettings(BaseModel):
    """Whether plans may rent spot (preemptible) nodes, and the rules that keep a plan serving
    when the cloud takes them back (docs/allocation.md, "Spot capacity")."""

    model_config = FROZEN
    enabled: bool = Field(
        default=False,
        description="Let plans rent spot nodes where the catalog sells them (off: on-demand only).",
    )
    max_share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Most of each (model, phase)'s throughput that spot instances may give, "
        "from 0 to 1.",
    )
    zone_loss_serves: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Share of each (model, phase)'s demand the plan still serves with every "
        "spot instance of any one zone gone (while replacements boot): 1 buys the spare "
        "capacity for a whole zone's loss, 0 allows putting all spot in one zone.",
    )
    zones_per_region: int = Field(
        default=3,
        ge=1,
        le=8,
        description="Spot zones the plan may use per region, the first by name of those that "
        "sell a template's nodes (more zones: more columns, slower solves).",
    )


class AllocationSettings(BaseModel):
    """Online allocation ILP settings."""

    model_config = FROZEN
    boot_minutes: float = Field(
        default=20,
        gt=0,
        le=1440,
        description="Time a new instance needs to serve (boot, weights, CUDA graphs). It sets "
        "the start-up penalty K = boot_minutes / adjustment_interval_minutes, and the Pulumi "
        "program counts an instance ready only this long after it was first declared; until "
        "then the instances it replaces keep serving (docs/deploy.md, safe reconfiguration). "
        "At most a day (1440).",
    )
    adjustment_interval_minutes: float = Field(
        default=60,
        ge=1,
        le=10_080,
        description="How often the fleet is re-planned (the paper's 60 min); with boot_minutes "
        "it sets K. The paper's K = 0.1 is boot_minutes 6 over 60 (Sec. 6.1). From 1 minute "
        "to a week (10080).",
    )
    add_only: bool = Field(
        default=False,
        description="A re-plan keeps every running instance (nu >= nu0 for each running "
        "(model, phase, region, template)) and only adds: no churn, at a possibly higher cost.",
    )
    target_utilization: float = Field(
        default=1.0,
        ge=0.01,
        le=1,
        description="Room above the demand: the plan buys capacity for demand / this and the "
        "SLO closed loop meets the attainment targets at that load, so a lasting spike up to "
        "it holds them (0.67: 1.5x the demand). 1.0: sized for the demand itself. A served "
        "fraction below 1 is of demand / this. At least 0.01 (100 times the demand).",
    )
    budget_usd_per_hour: float | None = Field(
        default=None,
        gt=0,
        le=MAX_BUDGET_USD_PER_HOUR,
        description="Most the fleet may cost, $/hour (none: no limit); at most 1e9.",
    )
    colocate_phases: bool = Field(
        default=True,
        description="A disaggregated model's prefill and decode instances share regions (KV "
        "moves over the private network). The paper does not require it; deployments do.",
    )
    backend: Backend = Field(
        default="scip", description="SCIP: fastest of the three here (docs/allocation.md)."
    )
    time_limit_s: float = Field(
        default=60, gt=0, le=86_400, description="Per solve; a day at most."
    )
    relative_gap: float = Field(default=0.01, ge=0, lt=1)
    threads: int = Field(
        default=2, ge=1, le=1024, description="CP-SAT workers (SCIP and HiGHS use 1)."
    )
    spot: SpotSettings = Field(default_factory=SpotSettings)

    @model_validator(mode="before")
    @classmethod
    def _k_is_derived(cls, data: Any) -> Any:
        if isinstance(data, dict) and "startup_penalty_k" in data:
            raise ValueError(
                "startup_penalty_k is no longer set directly: K = boot_minutes / "
                "adjustment_interval_minutes (defaults 20 and 60); set those instead "
                "(the paper's K = 0.1: boot_minutes: 6, adjustment_interval_minutes: 60)"
            )
        return data

    @property
    def startup_penalty_k(self) -> float:
        """K = start-up time / adjustment interval: a new instance pays K x its $/hour."""
        return self.boot_minutes / self.adjustment_interval_minutes


class AttainmentSettings(BaseModel):
    """How `coral plan` sizes capacity for the models' SLO attainment targets and checks it."""

    model_config = FROZEN
    rounds: int = Field(
        default=6,
        ge=0,
        le=10,
        description="Closed-loop re-plans at most: simulate the plan on the planning workload "
        "and raise the headroom of each (model, phase) that falls short. 0: the capacity "
        "model alone.",
    )
    planning_minutes: float = Field(
        default=30,
        gt=0,
        le=240,
        description="Simulated minutes per closed-loop round (as long as the verification: "
        "shorter windows see fewer of the rare long queues and read high).",
    )
    verify_minutes: float = Field(
        default=30,
        ge=0,
        le=240,
        description="Simulated minutes of the verification, on a seed (or trace window) the "
        "planner never used; 0 skips it (the plan then has no verified attainment).",
    )
    latency_margin: float = Field(
        default=1.0,
        ge=1.0,
        le=3.0,
        description="Plan to the attainment targets as if every engine step took this many "
        "times as long as the performance model says: the closed loop and the verification "
        "simulate at that slowdown, so the plan survives a model that optimistic. 1.0: the "
        "model as it is.",
    )
    accept_below_target: bool = Field(
        default=False,
        description="Let the Pulumi program deploy a plan whose verified attainment is below "
        "a model's target (it refuses by default).",
    )


DemandKind = Literal["config", "file", "prometheus"]


class PrometheusSource(BaseModel):
    """Live demand: rates of vLLM's own token counters, from Prometheus's HTTP API."""

    model_config = FROZEN
    url: str = Field(pattern=r"^https?://\S+$", description="Prometheus base URL.")
    window: str = Field(
        default="1h",
        pattern=r"^[1-9][0-9]*(s|m|h|d|w)$",
        description="rate() range, a Prometheus duration (e.g. 1h).",
    )
    headroom: float = Field(
        default=1.2, ge=1, le=10, description="Measured tokens/s times this (1 to 10)."
    )
    floor: Demand | None = Field(
        default=None, description="Least demand of every model (also when it has no samples)."
    )
    model_floors: dict[str, Demand] = Field(
        default_factory=dict, description="Least demand per model; overrides `floor`."
    )
    timeout_s: float = Field(default=10, gt=0, le=120, description="Per HTTP request.")
    model_label: str = Field(
        default="model_name",
        pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$",
        description="Label naming the model on vLLM's metrics (vLLM: model_name).",
    )
    phase_label: str = Field(
        default="coral_phase",
        pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$",
        description="Scrape label carrying a node's coral:phase tag: prompt tokens are counted "
        "off decode nodes and output tokens off prefill nodes (no double counting). Series "
        "without it all count.",
    )
    on_unreachable: Literal["fail", "file"] = Field(
        default="fail",
        description="Prometheus down: fail, or use the stack's demand file with a warning.",
    )


class DemandSource(BaseModel):
    """Where `coral plan` and the program take each model's demand from."""

    model_config = FROZEN
    kind: DemandKind = Field(
        default="config",
        description="config: models.<m>.demand; file: the stack's demand file; prometheus: "
        "live rates (`coral demand refresh` writes them to the demand file).",
    )
    file: str | None = Field(
        default=None,
        description="Demand file, relative to the stacks folder (default demand/<stack>.yaml).",
    )
    prometheus: PrometheusSource | None = None

    @model_validator(mode="after")
    def _settings_match_kind(self) -> DemandSource:
        if self.kind == "prometheus" and self.prometheus is None:
            raise ValueError("kind prometheus needs a `prometheus: {url: ...}` block")
        if self.kind != "prometheus" and self.prometheus is not None:
            raise ValueError(f"a `prometheus` block needs kind prometheus, not {self.kind}")
        if self.kind == "config" and self.file is not None:
            raise ValueError("`file` needs kind file or prometheus, not config")
        return self


@dataclass(frozen=True)
class MarketScope:
    """What the market stage reads of a stack (`FleetConfig.market_scope`): where it may rent
    (`regions`), what (`node_configs`), the stack's own counts, GPU pools and prices, and which
    market (`market`). The rest of the stack never reaches the market."""

    regions: tuple[Region, ...]
    node_configs: tuple[str, ...]
    availability: tuple[NodeAvailability, ...]
    gpu_pools: tuple[GpuPool, ...]
    prices: tuple[PriceOverride, ...]
    market: MarketSettings
    preemption: tuple[PreemptionOverride, ...]


@dataclass(frozen=True)
class LibraryScope:
    """What the template library stage reads of a stack (`FleetConfig.library_scope`): the
    models' specs by name, the library settings, and the market (for the node configs sold)."""

    models: Mapping[str, ModelSpec]
    library: LibrarySettings
    market: MarketScope


@dataclass(frozen=True)
class AttainmentScope:
    """What the closed loop and its verification read of a stack
    (`FleetConfig.attainment_scope`): the models' specs by name (SLOs, targets, workloads)
    and the attainment settings (rounds, simulated minutes); and the minutes a replacement
    needs to boot, for verifying a plan's spot instances under a zone's loss (None: verified
    without it); and the room bought above the demand (`room`: 1 / `allocation.
    target_utilization`): the closed loop meets the targets at room x the demand it serves and
    the gateway admits that much of a scarce model; the verification stays at the demand)."""

    models: Mapping[str, ModelSpec]
    attainment: AttainmentSettings
    boot_minutes: float | None = None
    room: float = 1.0


@dataclass(frozen=True)
class PlanScope:
    """What checking a plan against its stack reads (`FleetConfig.plan_scope`): the models'
    specs by name (demand, SLOs, routing), the allocation settings and the market."""

    models: Mapping[str, ModelSpec]
    allocation: AllocationSettings
    market: MarketScope


class StepCorrection(BaseModel):
    """One measured step-time correction: the running fleet's steps of `model` on `gpu` took
    `factor` x the performance model's time (`coral calibrate`, docs/fleet-calibration.md)."""

    model_config = FROZEN
    gpu: str = Field(description="GPU type (catalog id), e.g. l4.")
    model: str = Field(description="A model of this stack.")
    phase: Literal["prefill", "decode", "aggregated"] = Field(
        description="The replicas' phase: prefill and decode scale those steps; aggregated "
        "scales all the model's steps."
    )
    factor: float = Field(ge=0.2, le=5, description="Measured step time / modelled (0.2 to 5).")
    low: float = Field(gt=0, description="95% interval, low end.")
    high: float = Field(gt=0, description="95% interval, high end.")
    requests: int = Field(ge=0, description="Finished requests the fit read.")
    replicas: list[str] = Field(default_factory=list, description="The replicas it pooled.")
    measured_utc: dt.datetime | None = Field(default=None, description="When (UTC).")


class FleetCalibration(BaseModel):
    """Step-time corrections measured on the running fleet, with where and when from."""

    model_config = FROZEN
    source: str = Field(description="What measured them, e.g. the Prometheus URL and query.")
    window: str = Field(pattern=r"^[1-9][0-9]*(s|m|h|d|w)$", description="The window read.")
    measured_utc: dt.datetime = Field(description="When (UTC).")
    corrections: list[StepCorrection] = Field(default_factory=list)


class FleetConfig(BaseModel):
    """The `coral:fleet` object of a stack."""

    model_config = FROZEN
    description: str = ""
    models: dict[str, ModelSpec] = Field(min_length=1)
    model_cards: dict[str, UserModelCard] = Field(
        default_factory=dict,
        description="Your own models' cards, from their config.json (docs/models.md).",
    )
    regions: list[Region] = Field(min_length=1)
    node_configs: list[str] = Field(min_length=1, description="Node configs the fleet may rent.")
    library: LibrarySettings = Field(default_factory=LibrarySettings)
    availability: list[NodeAvailability] = Field(default_factory=list)
    gpu_pools: list[GpuPool] = Field(default_factory=list)
    prices: list[PriceOverride] = Field(default_factory=list)
    preemption: list[PreemptionOverride] = Field(
        default_factory=list,
        description="Your own preemption model for spot capacity, in place of the shipped "
        "one (solver/data/spot/preemption.yaml), per cloud, region or node config.",
    )
    market: MarketSettings = Field(
        default_factory=MarketSettings,
        description="catalog (offers + overrides) or paper (Table 1 prices; paper_market.py).",
    )
    allocation: AllocationSettings = Field(default_factory=AllocationSettings)
    attainment: AttainmentSettings = Field(default_factory=AttainmentSettings)
    demand_source: DemandSource = Field(
        default_factory=DemandSource, description="Where demand comes from (docs/operations.md)."
    )
    calibration: FleetCalibration | None = Field(
        default=None,
        description="Step-time corrections measured on the running fleet (`coral calibrate "
        "--write`, docs/fleet-calibration.md); plans and engine settings use them.",
    )

    def step_corrections(self) -> dict[tuple[str, str, str], float]:
        """(GPU type, model, phase) -> factor, for `load_perf_model(corrections=...)`."""
        if self.calibration is None:
            return {}
        return {(c.gpu, c.model, c.phase): c.factor for c in self.calibration.corrections}

    def market_scope(self) -> MarketScope:
        """The part of this fleet the market stage reads."""
        return MarketScope(
            tuple(self.regions),
            tuple(self.node_configs),
            tuple(self.availability),
            tuple(self.gpu_pools),
            tuple(self.prices),
            self.market,
            tuple(self.preemption),
        )

    def library_scope(self) -> LibraryScope:
        """The part of this fleet the template library stage reads."""
        return LibraryScope(self.models, self.library, self.market_scope())

    def attainment_scope(self) -> AttainmentScope:
        """The part of this fleet the closed loop and the verification read."""
        return AttainmentScope(
            self.models,
            self.attainment,
            self.allocation.boot_minutes,
            1.0 / self.allocation.target_utilization,
        )

    def plan_scope(self) -> PlanScope:
        """The part of this fleet a plan is checked against."""
        return PlanScope(self.models, self.allocation, self.market_scope())

    def with_mode(self, mode: str) -> FleetConfig:
        """This fleet with another library mode (e.g. from a `--mode` option).

        Raises:
            InputError: an unknown mode.
        """
        name = library_mode(mode, "--mode").name
        return self.model_copy(update={"library": self.library.model_copy(update={"mode": name})})

    def with_latency_margin(self, margin: float) -> FleetConfig:
        """This fleet planned as if every engine step took `margin` x as long (`coral plan
        --margin`).

        Raises:
            InputError: a margin outside 1 to 3.
        """
        if not (math.isfinite(margin) and 1.0 <= margin <= 3.0):
            raise InputError("--margin", f"must be from 1 to 3, got {margin}", "e.g. --margin 1.2")
        attainment = self.attainment.model_copy(update={"latency_margin": margin})
        return self.model_copy(update={"attainment": attainment})

    def with_target_utilization(self, u: float | None) -> FleetConfig:
        """This fleet buying capacity for demand / u (None: unchanged), e.g. from an option."""
        if u is None:
            return self
        if not 0.01 <= u <= 1:  # also refuses nan
            raise InputError("--target-utilization", f"must be in [0.01, 1], got {u}", "e.g. 0.7")
        allocation = self.allocation.model_copy(update={"target_utilization": u})
        return self.model_copy(update={"allocation": allocation})

    @model_validator(mode="after")
    def _lists_name_declared_things(self) -> FleetConfig:
        # Here, so that every FleetConfig is checked. It raises an InputError, not a ValueError:
        # pydantic passes that through with its key path and the closest names.
        check_lists(self)
        return self


T = TypeVar("T")


def check_lists(fleet: FleetConfig) -> None:
    """Each list of the fleet names things once, and only things the fleet declares: the
    overrides' regions are in `regions`, their nodes in `node_configs`, the demand floors'
    models in `models` (GPU types are checked against the catalog in
    `solver.validation.check_gpu_pools`); and each model's demand floor is within the demand
    bounds. Run by `FleetConfig` itself.

    Raises:
        InputError: naming the key path, with the closest declared names.
    """
    regions = [f"{r.cloud}:{r.region}" for r in fleet.regions]
    _once("node_configs", fleet.node_configs, str)
    _once("regions", fleet.regions, lambda r: f"{r.cloud}:{r.region}")
    overrides: list[tuple[str, Sequence[NodeAvailability | PriceOverride]]] = [
        ("availability", fleet.availability),
        ("prices", fleet.prices),
    ]
    for key, items in overrides:
        for i, item in enumerate(items):
            where = f"{FLEET_KEY}.{key}[{i}]"
            _declared(f"{where}.region", f"{item.cloud}:{item.region}", regions, "regions")
            _declared(f"{where}.node", item.node, fleet.node_configs, "node_configs")
        _once(key, items, lambda x: f"{x.cloud}:{x.region} {x.node}")
    for i, o in enumerate(fleet.preemption):
        where = f"{FLEET_KEY}.preemption[{i}]"
        if o.region is not None:
            _declared(f"{where}.region", f"{o.cloud}:{o.region}", regions, "regions")
        if o.node is not None:
            _declared(f"{where}.node", o.node, fleet.node_configs, "node_configs")
    _once("preemption", fleet.preemption, lambda o: f"{o.cloud}:{o.region} {o.node}")
    for i, pool in enumerate(fleet.gpu_pools):
        region = f"{pool.cloud}:{pool.region}"
        _declared(f"{FLEET_KEY}.gpu_pools[{i}].region", region, regions, "regions")
    _once("gpu_pools", fleet.gpu_pools, lambda p: f"{p.cloud}:{p.region} {p.gpu}")
    prom = fleet.demand_source.prometheus
    for model in prom.model_floors if prom else {}:
        where = f"{FLEET_KEY}.demand_source.prometheus.model_floors.{model}"
        _declared(where, model, list(fleet.models), "models")
    if fleet.calibration is not None:
        for i, c in enumerate(fleet.calibration.corrections):
            where = f"{FLEET_KEY}.calibration.corrections[{i}]"
            _declared(f"{where}.model", c.model, list(fleet.models), "models")
        _once("calibration.corrections", fleet.calibration.corrections,
              lambda c: f"{c.gpu} {c.model} {c.phase}")  # fmt: skip
    _check_floors(fleet)


def _check_floors(fleet: FleetConfig) -> None:
    """Each model's Prometheus floor, in the model's units, is within the demand bounds."""
    prom = fleet.demand_source.prometheus
    if prom is None:
        return
    for model, spec in fleet.models.items():
        key = f"model_floors.{model}" if model in prom.model_floors else "floor"
        floor = prom.model_floors.get(model, prom.floor)
        if floor is not None and (problem := demand_bound_problem(spec, floor)):
            raise InputError(
                f"{FLEET_KEY}.demand_source.prometheus.{key}",
                f"for {model}: {problem}",
                "lower the floor",
            )


_KIND = {"regions": "region", "node_configs": "node", "models": "model"}


def _declared(field: str, name: str, declared: list[str], key: str) -> None:
    if name in declared:
        return
    close = unknown_value(field, name, declared, _KIND[key]).suggestions
    raise InputError(
        field,
        f"{_KIND[key]} {name} is not in {key}",
        f"use one of {key} ({', '.join(declared)}), or add it to {key}",
        close,
    )


def _once(key: str, items: Sequence[T], name: Callable[[T], str]) -> None:
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        if (n := name(item)) in first:
            raise InputError(
                f"{FLEET_KEY}.{key}[{i}]",
                f"{n} is given twice ({key}[{first[n]}] and {key}[{i}])",
                "keep one: a repeat is ignored or overrides the first without a word",
            )
        first[n] = i


DEPLOY_KEY = "deploy"  # the Pulumi program's section of `coral:fleet` (coral_iac.deploy_settings)


STACK_EXAMPLE = (
    f"write `config: {{{FLEET_KEY}: {{models: ..., regions: ..., node_configs: ...}}}}` "
    "(stacks/Pulumi.dev.yaml is a small example)"
)


def _kind(value: Any) -> str:
    """A YAML value's kind in words: `a list`, `a string`, `empty`."""
    if value is None:
        return "empty"
    names = {list: "a list", str: "a string", bool: "a boolean", int: "a number"}
    return names.get(type(value), "a number" if isinstance(value, float) else "not a mapping")


def fleet_object(config: Any, source: str) -> dict[str, Any]:
    """The `coral:fleet` object of a stack's `config` mapping.

    Raises:
        InputError: `config` is not a mapping, it has no `coral:fleet` key, or that is empty or
            not a mapping.
    """
    if not isinstance(config, dict):
        raise InputError(f"{source}: config", f"is {_kind(config)}, not a mapping", STACK_EXAMPLE)
    if FLEET_KEY not in config:
        raise InputError(
            f"{source}: config", f"no '{FLEET_KEY}' key", f"add a '{FLEET_KEY}' object"
        )
    obj = config[FLEET_KEY]
    if obj is None or obj == {}:
        raise InputError(
            f"{source}: {FLEET_KEY}",
            "is empty",
            "give it at least models, regions and node_configs (stacks/Pulumi.dev.yaml is a "
            "small example)",
        )
    if not isinstance(obj, dict):
        raise InputError(
            f"{source}: {FLEET_KEY}",
            f"is {_kind(obj)}, not a mapping",
            "give it keys: models, regions, node_configs, ...",
        )
    return obj


def parse_fleet(config: dict[str, Any], source: str, stacks_dir: Path | None = None) -> FleetConfig:
    """The solver's part of `coral:fleet`: everything but its `deploy` section.

    Args:
        config: the stack file's `config` mapping.
        source: the stack file, for error messages.
        stacks_dir: where `model_cards.<id>.config` paths start (default: the working folder).
    """
    obj = {k: v for k, v in fleet_object(config, source).items() if k != DEPLOY_KEY}
    if isinstance(obj.get("model_cards"), dict):
        obj["model_cards"] = {
            name: resolve_entry(entry, f"{source}: {FLEET_KEY}.model_cards.{name}", stacks_dir)
            for name, entry in obj["model_cards"].items()
        }
    for name, spec in (
        (obj.get("models") or {}).items() if isinstance(obj.get("models"), dict) else ()
    ):
        if BUCKET_SEP in str(name):
            raise InputError(
                f"{source}: {FLEET_KEY}.models.{name}",
                f"'{BUCKET_SEP}' is reserved for length buckets",
                "use the model id from `coral catalog models`",
            )
        if isinstance(spec, dict) and "length_slice" in spec:
            raise InputError(
                f"{source}: {FLEET_KEY}.models.{name}.length_slice",
                "is set by the planner, not in a stack file",
                "remove it; use length_routing: {split_quantiles: [...]}",
            )
    return parse_model(FleetConfig, obj, f"{source}: {FLEET_KEY}")


def stack_path(stacks_dir: Path, stack: str) -> Path:
    return stacks_dir / f"Pulumi.{stack}.yaml"


def load_stack(stacks_dir: Path, stack: str) -> FleetConfig:
    """Load `stacks/Pulumi.<stack>.yaml`; an unknown stack lists the known ones."""
    path = stack_path(stacks_dir, stack)
    if not path.exists():
        known = sorted(
            p.name[len("Pulumi.") : -len(".yaml")] for p in stacks_dir.glob("Pulumi.*.yaml")
        )
        raise unknown_value("--stack", stack, known, "stack")
    return parse_fleet(read_stack_config(path), str(path), stacks_dir)


def read_stack_config(path: Path) -> dict[str, Any]:
    """The `config` mapping of a stack file (`{}` when the file has no `config` key).

    Raises:
        InputError: as `read_yaml`; an empty file, or a file or `config` that is not a mapping.
    """
    doc = read_yaml(path)
    if doc is None:
        raise InputError(str(path), "the file is empty (no YAML, or only comments)", STACK_EXAMPLE)
    if not isinstance(doc, dict):
        raise InputError(str(path), f"is {_kind(doc)}, not a mapping", STACK_EXAMPLE)
    config = doc.get("config") or {}
    if not isinstance(config, dict):
        raise InputError(f"{path}: config", f"is {_kind(config)}, not a mapping", STACK_EXAMPLE)
    return config
