"""The gateway's configuration, pure (no Pulumi, no cloud calls): what the HAProxy VM of
`coral_iac/gateway.py` runs and loads (docs/gateway.md).

- `gateway_upstreams(plan, addresses, states)`: one upstream per serving instance with an API
  (an aggregated head's vLLM server, a decode head's vllm-router), weighted by its serving
  template's throughput, with its state (ready, starting or draining);
- `render_haproxy_config` renders `templates/gateway/haproxy.cfg.j2`, and `parameter_value`
  packs it for SSM Parameter Store;
- `render_gateway_user_data` renders the VM's cloud-init, which holds no plan, so a plan change
  never replaces the VM;
- `replicas_up` reads the health report the VM publishes (which replicas pass HAProxy's
  `/health` checks), from which the next run knows which new replicas are ready;
- `gateway_region`: where the gateway runs.

HAProxy 2.6 is Debian 12's package, the one the tests run.
"""

from __future__ import annotations

import base64
import gzip
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Literal, cast

from jinja2 import Environment
from pydantic import BaseModel, Field, ValidationError

from coral_iac.bootstrap import TEMPLATES, slug, template_environment
from coral_iac.deploy_settings import GatewaySettings
from solver.errors import InputError
from solver.operations.reconfiguration import IMAGE_SEP
from solver.plan_schema import Instance, LengthBucket, Plan, template_ref
from solver.simulation.admission import (
    AdmissionLimit,
    admission_limits,
    capacity_rps,
    request_rates,
)
from solver.stack import ModelSpec, Region
from solver.types import BUCKET_SEP, FROZEN, base_model

UpstreamState = Literal["ready", "starting", "draining"]
STATES: tuple[str, ...] = ("ready", "starting", "draining")
# HAProxy's largest server weight (configuration.txt of HAProxy 2.6, "weight <weight>").
WEIGHT_MAX = 256
# SSM Parameter Store: 4 KB per standard value, 8 KB per advanced one (AWS Systems Manager User
# Guide, "Managing parameter tiers", read 2026-11). Intelligent-Tiering picks advanced when needed.
PARAMETER_LIMIT_CHARS = 8192
POLL_SECONDS = 30
# The API key as HAProxy compares it ("Bearer <key>"), written by coral-gateway-sync from the
# secret manager: never in the SSM parameter or the user-data.
API_KEY_FILE = "/etc/haproxy/coral-api-keys"
# deploy.gateway.tls_secret, as coral-gateway-sync writes it: certificate, chain, private key.
TLS_FILE = "/etc/haproxy/tls/gateway.pem"
# HAProxy's statistics (CSV), on loopback only: coral-gateway-health reads them.
STATS_PORT = 8404
STATE_DIR = "/var/lib/coral-gateway"  # the last health report published, to publish changes only
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # safe in a path, an ACL, a backend


class Upstream(BaseModel):
    """One serving instance behind the gateway: an HAProxy server of its model's backend."""

    model_config = FROZEN
    key: str = Field(description="The plan instance's stable replica key.")
    model: str
    server: str = Field(description="HAProxy server name (the key made name-safe).")
    address: str = Field(description="host:port of the head's API (vLLM or vllm-router).")
    throughput: float = Field(gt=0, description="The serving template's throughput.")
    unit: str = Field(description="tokens/s (decode) or requests/s (aggregated).")
    weight: int = Field(ge=0, le=WEIGHT_MAX, description="0 unless ready.")
    state: UpstreamState


class Backend(BaseModel):
    """The upstreams of one model, or of one of its length buckets: requests whose body is at
    most `max_body_bytes` long (None: any length) go here."""

    model_config = FROZEN
    name: str
    max_body_bytes: int | None
    upstreams: list[Upstream] = Field(min_length=1)
    limit: AdmissionLimit | None = Field(
        default=None, description="What it admits (None: every request)."
    )


class Route(BaseModel):
    """One model: its path prefix and its backends (one, or one per length bucket, shortest
    first: HAProxy takes the first whose Content-Length bound the request meets)."""

    model_config = FROZEN
    model: str
    backends: list[Backend] = Field(min_length=1)


def gateway_upstreams(
    plan: Plan, addresses: Mapping[str, str], states: Mapping[str, str] | None = None
) -> list[Upstream]:
    """One upstream per aggregated or decode instance of `plan`, sorted by key.

    Weight = WEIGHT_MAX x throughput / the largest throughput among the model's ready
    upstreams, rounded, at least 1; 0 for starting and draining upstreams.

    Args:
        plan: every instance the gateway should know, draining ones included.
        addresses: replica key -> "host:port" of its head's API.
        states: replica key -> ready, starting or draining (default ready).

    Raises:
        InputError: an unknown state, a state or missing address for a key, or a model name
            unsafe in a path.
    """
    states = dict(states or {})
    serving = sorted(
        (i for i in plan.instances if i.phase in ("aggregated", "decode")), key=lambda i: i.key
    )
    _check_states(states, {i.key for i in serving})
    peak: dict[str, float] = {}
    rows: list[tuple[Instance, float, str, UpstreamState]] = []
    for inst in serving:
        if not MODEL_NAME.match(base_model(inst.model)):
            raise InputError(
                f"coral:fleet.models.{inst.model}",
                "the model name is unsafe in a URL path",
                "name models with letters, digits, '.', '_' and '-' only",
            )
        if inst.key not in addresses:
            raise InputError(
                "gateway addresses",
                f"no address for {inst.key}",
                "pass the head address of every aggregated and decode instance",
            )
        template = plan.templates[template_ref(inst.model, inst.phase, inst.template)]
        state = cast(UpstreamState, states.get(inst.key, "ready"))  # checked above
        rows.append((inst, template.throughput, template.unit, state))
        if state == "ready":
            peak[inst.model] = max(peak.get(inst.model, 0.0), template.throughput)
    return [
        Upstream(
            key=inst.key,
            model=inst.model,
            server=server_name(inst.key),
            address=addresses[inst.key],
            throughput=throughput,
            unit=unit,
            weight=_weight(throughput, peak[inst.model]) if state == "ready" else 0,
            state=state,
        )
        for inst, throughput, unit, state in rows
    ]


def server_name(key: str) -> str:
    """The HAProxy server name of a replica key (the same in the health report). HAProxy allows
    only letters, digits and ".-_:" there, so a decode replica's peers digest ("~") and a
    successor's image digest ("^") become ".p" and ".i"."""
    name = slug(key).replace(BUCKET_SEP, ".")
    return name.replace("~", ".p").replace(IMAGE_SEP, ".i")


class HealthReport(BaseModel):
    """What coral-gateway-health publishes: the servers whose last `/health` check passed."""

    up: list[str] = Field(description="HAProxy server names, sorted.")


def replicas_up(report: str, keys: Collection[str]) -> frozenset[str]:
    """The replica keys among `keys` whose server the health `report` (the parameter's JSON
    value) lists as passing.

    Raises:
        InputError: the report is not a health report.
    """
    try:
        up = set(HealthReport.model_validate_json(report).up)
    except ValidationError as e:
        raise InputError(
            "gateway health report",
            f"not a health report ({e.errors()[0]['msg']})",
            "it is written by coral-gateway-sync on the gateway VM; delete the parameter and "
            "the next poll writes it again",
        ) from None
    return frozenset(k for k in keys if server_name(k) in up)


def _check_states(states: Mapping[str, str], serving: set[str]) -> None:
    unknown = sorted(set(states) - serving)
    if unknown:
        raise InputError(
            "gateway states",
            f"{', '.join(unknown)} are not aggregated or decode instances of the plan",
            "pass a plan that still holds every replica the gateway routes to (draining ones too)",
        )
    for key, given in sorted(states.items()):
        if given not in STATES:
            raise InputError(
                f"gateway states[{key}]", f"unknown state '{given}'", "use " + ", ".join(STATES)
            )


def _weight(throughput: float, peak: float) -> int:
    """HAProxy's integer weight: proportional to throughput, the peak at WEIGHT_MAX, at least 1."""
    return max(1, round(WEIGHT_MAX * throughput / peak))


def _environment() -> Environment:
    env = template_environment(TEMPLATES / "gateway")
    env.filters["regex_escape"] = lambda name: name.replace(".", "\\.")  # MODEL_NAME-safe
    return env


def render_haproxy_config(
    upstreams: list[Upstream],
    stack: str,
    port: int,
    health_check_interval_ms: int,
    api_key: bool = False,
    buckets: Mapping[str, LengthBucket] | None = None,
    stats_port: int = STATS_PORT,
    tls: bool = False,
    limits: Mapping[str, AdmissionLimit] | None = None,
) -> str:
    """HAProxy's configuration: one route per model, one backend per model or per length
    bucket (`buckets`: the plan's, by name; `Plan.buckets()`), one server per upstream; with
    `api_key`, requests without the key in `API_KEY_FILE` get 401; with `tls`, the API port
    speaks HTTPS only, with the certificate in `TLS_FILE`. Its statistics answer on
    127.0.0.1:`stats_port` only. `limits` (`gateway_limits`): what each backend admits, by the
    plan's model name; the excess gets 429 with `Retry-After` (a backend without one admits
    every request).

    Raises:
        InputError: no upstream at all (nothing to route to), or an upstream of a length
            bucket the plan does not describe.
    """
    if not upstreams:
        raise InputError(
            "gateway", "the plan has no aggregated or decode instance", "plan some demand"
        )
    buckets = buckets or {}
    routes = []
    for model in sorted({base_model(u.model) for u in upstreams}):
        names = sorted({u.model for u in upstreams if base_model(u.model) == model})
        unknown = [n for n in names if n != model and n not in buckets]
        if unknown:
            raise InputError(
                "plan.routing",
                f"instances of {', '.join(unknown)} but no such length bucket in the plan",
                "plan again (coral plan) so the plan describes its buckets",
            )
        names.sort(key=lambda n: buckets[n].min_prompt_tokens if n in buckets else 0.0)
        backends = [
            Backend(
                name=f"model_{n.replace(BUCKET_SEP, ':')}",
                max_body_bytes=buckets[n].max_body_bytes if n in buckets else None,
                upstreams=[u for u in upstreams if u.model == n],
                limit=(limits or {}).get(n),
            )
            for n in names
        ]
        if backends[-1].max_body_bytes is not None:  # the longest bucket has no instance
            backends[-1] = backends[-1].model_copy(update={"max_body_bytes": None})
        routes.append(Route(model=model, backends=backends))
    return (
        _environment()
        .get_template("haproxy.cfg.j2")
        .render(
            stack=stack,
            port=port,
            health_check_interval_ms=health_check_interval_ms,
            routes=routes,
            api_key_file=API_KEY_FILE if api_key else None,
            stats_port=stats_port,
            tls_file=TLS_FILE if tls else None,
        )
    )


def gateway_limits(
    plan: Plan,
    models: Mapping[str, ModelSpec],
    states: Mapping[str, str] | None = None,
    root: Path | None = None,
    room: float = 1.0,
) -> dict[str, AdmissionLimit]:
    """What the gateway admits per backend: `admission_limits` (the solver's rule, the one the
    simulator verifies the plan with) over the instances that take requests, so a draining
    replica's capacity is not admitted (`states` as for `gateway_upstreams`; `root`: the
    project folder a CSV `workload_trace` is read from; `room`: 1 / the stack's
    `allocation.target_utilization`)."""
    states = states or {}
    serving = [i for i in plan.instances if states.get(i.key, "ready") != "draining"]
    return admission_limits(plan.model_copy(update={"instances": serving}), models, root, room)


class AdmissionRow(BaseModel):
    """One model's line of `coral plan`'s admission table: what the gateway admits, against
    its demand and its capacity (both in requests/s)."""

    model_config = FROZEN
    model: str
    demand_rps: float
    capacity_rps: float = Field(description="At the SLO attainment target, whatever the demand.")
    admitted_rps: float = Field(description="What HAProxy enforces (count / period).")
    basis: str
    count: int
    period_s: int
    retry_after_s: int


def admission_rows(
    plan: Plan, models: Mapping[str, ModelSpec], root: Path | None = None, room: float = 1.0
) -> list[AdmissionRow]:
    """Per model of the plan (length buckets apart): its demand, its capacity and what the
    gateway admits (`gateway_limits`)."""
    limits = gateway_limits(plan, models, root=root, room=room)
    capacity = capacity_rps(plan, models)
    rates = request_rates(plan, models)
    return [
        AdmissionRow(
            model=name,
            demand_rps=round(rates.get(name, 0.0), 4),
            capacity_rps=round(capacity.get(name, 0.0), 4),
            admitted_rps=round(limit.admitted_per_s, 4),
            basis=limit.basis,
            count=limit.count,
            period_s=limit.period_s,
            retry_after_s=limit.retry_after_s,
        )
        for name, limit in sorted(limits.items())
    ]


# What protects the replicas where no gateway runs (docs/gateway.md, "Without a gateway").
NO_GATEWAY_ADMISSION = (
    "no gateway, so nothing sheds excess requests: each vLLM server runs at most "
    "--max-num-seqs requests at once and queues the rest without bound, so traffic above the "
    "plan (a scarce plan's unserved share, or a spike) delays every request. Put a rate limit "
    "in front of the replicas (deploy.gateway.enabled with an aws region does), or plan for "
    "the spike"
)


def parameter_value(config: str) -> str:
    """The configuration as the SSM parameter holds it: gzip (deterministic), then base64.

    Raises:
        InputError: larger than an SSM parameter can hold.
    """
    packed = base64.b64encode(gzip.compress(config.encode(), compresslevel=9, mtime=0)).decode()
    if len(packed) > PARAMETER_LIMIT_CHARS:
        raise InputError(
            "gateway",
            f"the HAProxy configuration packs to {len(packed)} characters, over SSM's "
            f"{PARAMETER_LIMIT_CHARS}",
            "serve fewer replicas per stack, or split the fleet into stacks",
        )
    return packed


def parameter_name(stack: str) -> str:
    return f"/coral/{stack}/gateway/haproxy.cfg"


def health_parameter_name(stack: str) -> str:
    """Where the gateway VM publishes its health report (`HealthReport`, JSON)."""
    return f"/coral/{stack}/gateway/health"


def render_health_script(
    stack: str, region: str, stats_port: int = STATS_PORT, state_dir: str = STATE_DIR
) -> str:
    """`coral-gateway-health`: reads HAProxy's statistics and publishes the servers whose last
    check passed to `health_parameter_name(stack)`, when that list changed."""
    return (
        _environment()
        .get_template("gateway-health.sh.j2")
        .render(
            stack=stack,
            region=region,
            parameter=health_parameter_name(stack),
            stats_port=stats_port,
            state_dir=state_dir,
        )
    )


def render_gateway_user_data(
    stack: str,
    region: str,
    port: int,
    api_key_secret: str | None = None,
    tls_secret: str | None = None,
) -> str:
    """The gateway VM's `#cloud-config`: HAProxy with a configuration that answers 503 on
    `port` until the first sync, and a timer that loads the plan's configuration (and from
    Secrets Manager the API key when `api_key_secret` names one, the TLS certificate when
    `tls_secret` does)."""
    env = _environment()
    values = {
        "stack": stack,
        "region": region,
        "parameter": parameter_name(stack),
        "poll_seconds": POLL_SECONDS,
        "api_key_secret": api_key_secret,
        "api_key_file": API_KEY_FILE,
        "tls_secret": tls_secret,
        "tls_file": TLS_FILE,
    }
    sync = env.get_template("gateway-sync.sh.j2").render(**values)
    initial = env.get_template("haproxy-initial.cfg.j2").render(stack=stack, port=port)
    return env.get_template("cloud-config.yaml.j2").render(
        sync_script=sync,
        health_script=render_health_script(stack, region),
        initial_config=initial,
        health_parameter=health_parameter_name(stack),
        **values,
    )


def gateway_region(regions: Sequence[Region], settings: GatewaySettings) -> str | None:
    """Where the gateway runs: `deploy.gateway.region`, else the stack's first aws region (of `regions`, `coral:fleet.regions`), else
    None (a GCP-only fleet without a gateway region: the program warns and declares none)."""
    if settings.region is not None:
        return settings.region
    return next((r.region for r in regions if r.cloud == settings.cloud), None)
