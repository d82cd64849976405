"""The Pulumi program: plan the stack's fleet, then declare every node that serves it.

`__main__.py` calls `run()`. The steps:

1. Read `coral:fleet` from the stack config, with each model's demand from the stack's demand
   source (config, demand file or Prometheus: `coral_iac/demand_sources.py`), as `coral plan`
   does.
2. Read the previous plan and fleet state from the stack's own last outputs (a
   `StackReference` to itself). Pulumi's state is what this program last declared, so nu0 is
   exactly the running fleet as Pulumi knows it (`pulumi refresh` reconciles drift). Querying
   the clouds for tagged instances would need credentials in preview and per-cloud listing
   code, for no gain.
3. Load the template library from `.coral/library/<stack>`. A missing library is built; a stale
   one is an error unless `deploy.rebuild_library` is set.
4. Plan with nu0 = the previous plan, as `coral plan` does (`plan_with_library`: SLO capacity,
   allocation with the budget less the gateway's $/hour, closed loop, verification), and
   validate the plan.
5. Check the plan is deployable (vllm mode, budget, prefill/decode pairs per region).
6. Work out each instance's state (`solver/operations/reconfiguration.py`): new ones start,
   instances leaving the plan keep serving (retiring) until their replacements have booted,
   then drain for `deploy.drain_minutes` before a run deletes them.
7. Declare the gateway (`coral_iac/gateway.py`), every instance of the plan and every leaving
   one, and the gateway's HAProxy configuration (new requests to ready and retiring instances
   only); export costs, the plan, the fleet state, the endpoints and the gateway's URLs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime.sync_await import _sync_await

from coral_iac.bootstrap import node_boots, slug
from coral_iac.components import ServingInstance, ServingInstanceArgs
from coral_iac.cost_report import cost_diff_table
from coral_iac.demand_sources import resolve_demand
from coral_iac.deploy_settings import DeploySettings, parse_deploy
from coral_iac.deployable import deploy_problems, unverified_placements
from coral_iac.engine_args import instance_engine, precision_group_bf16
from coral_iac.exposure import exposure_warnings
from coral_iac.gateway import Gateway, GatewayArgs, published_health
from coral_iac.gateway_config import gateway_region, health_parameter_name, replicas_up
from coral_iac.gateway_cost import allocation_after_gateway, gateway_cost
from coral_iac.infra import Infra, InfraArgs, Region, gcp_node_zones, spot_zone
from coral_iac.model_files import card_disk_gb
from coral_iac.project import LIBRARY_FOLDER, STACKS_FOLDER
from solver.catalog.offers import Catalog, Offer
from solver.errors import CoralError
from solver.operations.reconfiguration import (
    FRONTED,
    FleetState,
    rollout_images,
    router_peers,
    transition,
)
from solver.performance.default_model import load_perf_model
from solver.performance.perf_model import PerfModel
from solver.plan.length_routing import fleet_for_plan
from solver.plan.planner import plan_with_library
from solver.plan_schema import Instance, Plan, template_ref
from solver.serving.instance_model import InstanceModel
from solver.stack import FLEET_KEY, FleetConfig, parse_fleet
from solver.types import base_model


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class ProgramOptions:
    """What the program takes from its caller rather than from the stack config.

    `pulumi up` runs with the defaults (`__main__.py`); `coral preview` and the tests pass
    their own, e.g. a library folder elsewhere, a stale library rebuilt as `coral plan` does,
    or a fake clock for consecutive deploys.
    """

    # Relative paths are from the project root, where Pulumi runs the program.
    stacks_dir: Path = STACKS_FOLDER
    library_root: Path = LIBRARY_FOLDER  # one library folder per stack below it
    library: Path | None = None  # this stack's library folder instead of <library_root>/<stack>
    rebuild_stale: bool = False  # `pulumi up`: only with coral:fleet.deploy.rebuild_library
    clock: Callable[[], datetime] = utc_now

    def library_dir(self, stack: str) -> Path:
        return self.library or self.library_root / stack


def read_stack_config(stacks_dir: Path = STACKS_FOLDER) -> tuple[FleetConfig, DeploySettings]:
    """`coral:fleet` from the stack config: the solver's part and the program's `deploy` part
    (a model card's `config` path starts at `stacks_dir`, as for the CLI)."""
    config = {FLEET_KEY: pulumi.Config("coral").require_object("fleet")}
    return parse_fleet(config, "stack config", stacks_dir), parse_deploy(config, "stack config")


def previous_outputs(stack: str) -> tuple[Plan | None, FleetState | None, dict[str, str]]:
    """The plan, fleet state and images this stack last deployed, from its own `plan`,
    `fleet_state` and `images` outputs (None, None and {} on a new stack)."""
    ref = pulumi.StackReference(
        f"{pulumi.get_organization()}/{pulumi.get_project()}/{stack}",
        opts=pulumi.ResourceOptions(retain_on_delete=True),
    )

    def text(name: str) -> str | None:
        # Top-level program code is synchronous, and the SDK reads another stack's outputs only
        # asynchronously (`get_output_details`) or as an Output (which would put all planning
        # inside an apply). No public sync wait exists, so this is the one private SDK name we
        # use: `_sync_await`, with which the SDK's own synchronous invokes wait.
        details = _sync_await(ref.get_output_details(name))
        value = details.value if details.value is not None else details.secret_value
        return str(value) if value else None

    plan, state, images = text("plan"), text("fleet_state"), text("images")
    return (
        Plan.model_validate_json(plan) if plan else None,
        FleetState.model_validate_json(state) if state else None,
        {str(k): str(v) for k, v in json.loads(images).items()} if images else {},
    )


def declared_plan(plan: Plan, state: FleetState) -> Plan:
    """The plan with the instances leaving it (retiring, draining) added back: what this run
    declares. Their templates come from the state, so they are declared as they were."""
    templates = dict(plan.templates)
    for m in state.members.values():
        ref = template_ref(m.instance.model, m.instance.phase, m.instance.template)
        templates.setdefault(ref, m.template)
    return plan.model_copy(
        update={
            "instances": [m.instance for m in state.members.values()],
            "templates": templates,
        }
    )


def make_plan(
    stack: str,
    fleet: FleetConfig,
    deploy: DeploySettings,
    perf: PerfModel,
    previous: Plan | None,
    options: ProgramOptions,
) -> Plan:
    return plan_with_library(
        stack,
        fleet,
        perf,
        options.library_dir(stack),
        previous,
        # One process: the Pulumi language host runs gRPC threads, and a fork beside them
        # skips gRPC's fork handlers (a warning in the preview, a hang where they are on).
        # `coral plan` builds the library and caches the capacity model in worker processes
        # first, and the plan is the same either way.
        workers=1,
        rebuild_stale=deploy.rebuild_library or options.rebuild_stale,
        root=options.stacks_dir.parent,
    )


def check_deployable(plan: Plan, fleet: FleetConfig, catalog: Catalog) -> None:
    """Fail the preview (not a node at boot) when the plan cannot run as declared."""
    problems = deploy_problems(plan, catalog, fleet.library, fleet.allocation, fleet.attainment)
    if problems:
        raise pulumi.RunError("Coral cannot deploy this plan:\n  " + "\n  ".join(problems))


def declare(
    plan: Plan,
    fleet: FleetConfig,
    deploy: DeploySettings,
    perf: PerfModel,
    stack: str,
    states: Mapping[str, str] | None = None,
    peers: Mapping[str, list[str]] | None = None,
    images: Mapping[str, str] | None = None,
    infra: Infra | None = None,
    node_images: Mapping[str, str | None] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every serving instance of the plan and the gateway; returns the endpoints per model and
    the gateway's outputs (none when `deploy.gateway.enabled` is false).

    `states` (instance key -> starting, ready, retiring or draining) sets what the gateway
    sends each instance: no new requests to draining ones. `peers` (decode instance key ->
    prefill instance keys) sets whom each decode router sends prompts to; by default every
    prefill instance of its model in its region. `images`: the AMIs the stack last deployed
    with (`Infra.aws_image`); the outputs get the ones in use as `images`. `infra`: the run's
    shared resources when the caller already made some (a provider), else new ones.
    `node_images`: instance key -> the boot image its nodes keep (`FleetState` members; None
    or absent: its region's)."""
    if infra is None:
        infra = _infra(fleet, deploy, stack, images)
    upstreams: dict[str, pulumi.Output[str]] = {}
    endpoints: dict[str, list[pulumi.Output[str]]] = {}
    prefill_heads: dict[str, pulumi.Output[str]] = {}  # prefill instance key -> head IP
    batch_caps: dict[str, InstanceModel] = {}
    # Prefill before decode: a decode node's router needs the prefill heads' addresses.
    order = sorted(plan.instances, key=lambda i: (i.phase == "decode", i.key))
    gateway = _gateway(fleet, deploy, stack, infra)  # before any group: endpoint groups admit it
    _check_router_key(plan, deploy, gateway is not None)
    for inst in order:
        ref = template_ref(inst.model, inst.phase, inst.template)
        template = plan.templates[ref]
        spec = fleet.models[inst.model]
        card = perf.card(inst.model)
        # Cap vLLM's batches at the SLO-feasible sizes the library assumed (as simulated);
        # replicas of one template share them.
        if ref not in batch_caps:
            batch_caps[ref] = InstanceModel.serving(perf, template, spec)
        sizes = batch_caps[ref]
        boots = node_boots(
            engine=instance_engine(
                card=card,
                max_model_len=deploy.max_model_len,
                max_num_seqs=sizes.max_running,
                max_num_batched_tokens=sizes.max_batched_tokens,
                bf16=precision_group_bf16(plan, inst, perf.catalog),
                pair=spec.serving == "disaggregated",
                gpu_memory_utilization=deploy.gpu_memory_utilization,
            ),
            template=template,
            layers=card.layers,
            cloud=inst.cloud,  # type: ignore[arg-type]
            region=inst.region,
            stack=stack,
            replica_key=inst.key,
            hf_repo=card.hf_repo,
            disaggregated=spec.serving == "disaggregated",
            api_port=deploy.api_port,
            hf_token_secret=deploy.hf_token_secret,
            # Behind a gateway the key is checked there alone (docs/gateway.md, "API key"); the
            # nodes' identity may read it exactly when they check it.
            api_key_secret=deploy.api_key_secret if infra.nodes_read_api_key else None,
            market=inst.market,
        )
        region = infra.region(inst.cloud, inst.region)
        public = inst.phase in ("decode", "aggregated")  # routers and aggregated heads
        # With an API key, an endpoint that checks none (vllm-router, or any replica behind the
        # gateway) is open to the gateway alone.
        clients = not deploy.api_key_secret or (
            gateway is None and spec.serving != "disaggregated"
        )
        group = (
            infra.aws_group(region, inst.model, _has_endpoint(plan, inst), clients)
            if inst.cloud == "aws"
            else infra.gcp_tag(region, inst.model, _has_endpoint(plan, inst), clients)
        )
        offers = [_offer(perf, inst, n) for n in template.nodes]
        subnet, zones = _placement(infra, region, inst, offers, deploy)
        if zones is not None and len(set(zones)) > 1:
            pulumi.log.warn(
                f"{inst.key}: no zone of gcp:{inst.region} sells "
                f"{', '.join(sorted({o.instance_type for o in offers}))} together, so its nodes "
                f"run in {', '.join(sorted(set(zones)))}: pipeline traffic crosses zones "
                "(inter-zone egress is billed, and adds latency)"
            )
        router_ips = (
            [prefill_heads[k] for k in (peers or {}).get(inst.key) or router_peers(plan, inst)]
            if inst.phase == "decode"
            else None
        )
        component = ServingInstance(
            slug(inst.key),
            ServingInstanceArgs(
                stack=stack,
                replica_key=inst.key,
                model=inst.model,
                phase=inst.phase,
                template=inst.template,
                offers=offers,
                boots=boots,
                region=region,
                identity=infra.identity,
                group=group,
                # The files `hf download` fetches (coral_iac/data/model_files.yaml), the venv
                # and the stack's headroom.
                disk_gb=card_disk_gb(base_model(inst.model), card, deploy.disk_headroom_gb),
                router_prefill_ips=router_ips,
                subnet_id=subnet,
                gcp_zones=zones,
                image=(node_images or {}).get(inst.key),
                spot=inst.is_spot,
            ),
        )
        if inst.phase == "prefill":
            prefill_heads[inst.key] = component.head_private_ip
        if public:
            endpoints.setdefault(inst.model, []).append(
                component.head_public_ip.apply(lambda ip: f"http://{ip}:{deploy.api_port}/v1")
            )
        if public and gateway is not None:
            local = gateway.same_network(inst.cloud, inst.region)
            ip = component.head_private_ip if local else component.head_public_ip
            upstreams[inst.key] = ip.apply(lambda a: f"{a}:{deploy.api_port}")
    outputs: dict[str, Any] = {}
    if gateway is not None:
        try:
            by_model = gateway.publish(
                plan,
                upstreams,
                _gateway_states(plan, states or {}),
                fleet.models,
                fleet.attainment_scope().room,
            )
        except CoralError as e:
            raise pulumi.RunError(str(e)) from None
        outputs = {"gateway": gateway.url, "gateway_endpoints": by_model}
    outputs["images"] = infra.finish()
    return {m: pulumi.Output.all(*urls) for m, urls in sorted(endpoints.items())}, outputs


def _placement(
    infra: Infra, region: Region, inst: Instance, offers: list[Offer], deploy: DeploySettings
) -> tuple[pulumi.Output[str] | None, list[str] | None]:
    """Where a replica's nodes run: on AWS its subnet, on GCP each node's zone (the other is
    None). A spot replica runs where the plan priced it, every node in its zone (`spot_zone`;
    `deploy.gcp_zones` does not move it); an on-demand one in the first AWS zone that offers
    all its types (`Infra.aws_node_subnet`), or the GCP zones of `gcp_node_zones`.

    Raises:
        pulumi.RunError: no zone can take the replica (the message names the fix).
    """
    types = [o.instance_type for o in offers]
    try:
        zone = spot_zone(inst.key, inst.zone, offers) if inst.is_spot else None
        if inst.cloud == "aws":
            if zone is not None:
                return infra.aws_spot_subnet(region, zone, types), None
            return infra.aws_node_subnet(region, types), None
        if zone is not None:
            return None, [zone] * len(offers)
        return None, gcp_node_zones(inst.region, offers, deploy.gcp_zones.get(inst.region))
    except CoralError as e:
        raise pulumi.RunError(str(e)) from None


def _check_router_key(plan: Plan, deploy: DeploySettings, has_gateway: bool) -> None:
    """With `deploy.api_key_secret`, a disaggregated model's endpoint is its decode node's
    vllm-router, which cannot require the key (docs/gateway.md, "API key"): only the gateway
    may reach it, so such a plan needs the gateway."""
    routed = sorted({i.model for i in plan.instances if i.phase == "decode"})
    if deploy.api_key_secret and routed and not has_gateway:
        raise pulumi.RunError(
            "coral:fleet.deploy.api_key_secret: "
            f"{', '.join(routed)} serve disaggregated behind vllm-router, which cannot require "
            "the key, and the stack has no gateway to check it. Enable coral:fleet.deploy."
            "gateway (with an aws region), or set the models' serving: aggregated"
        )


def _gateway_states(plan: Plan, states: Mapping[str, str]) -> dict[str, str]:
    """The gateway's view of its upstreams (aggregated and decode instances). A retiring one
    still takes new requests, like a ready one. So does a starting one: HAProxy's `/health`
    checks keep requests off it until vLLM is up, so new capacity serves as soon as it has
    booted rather than at the next run (the state machine still does not count it)."""
    fronted = {i.key for i in plan.instances if i.phase in ("aggregated", "decode")}
    return {
        k: "draining" if v == "draining" else "ready" for k, v in states.items() if k in fronted
    }


def target_images(fleet: FleetConfig, deploy: DeploySettings, infra: Infra) -> dict[str, str]:
    """Region ("aws:us-east-2") -> the image new replicas boot with: an AWS region's recorded
    AMI (or, on a first deploy or with `deploy.refresh_images`, the SSM parameter's current
    value); a GCP region's `deploy.gcp_image`."""
    out: dict[str, str] = {}
    for r in fleet.regions:
        if r.cloud == "aws":
            provider = infra.aws_provider(r.region)
            out[f"aws:{r.region}"] = infra.aws_image(
                r.region, deploy.aws_ami_parameter, provider
            )
        else:
            out[f"gcp:{r.region}"] = deploy.gcp_image
    return out


def _replicas_up(
    previous: FleetState | None,
    fleet: FleetConfig,
    deploy: DeploySettings,
    stack: str,
    infra: Infra,
    now: datetime,
) -> frozenset[str] | None:
    """The previous members whose heads pass the gateway's health checks, from the report
    the gateway VM publishes; None when there is no report to go by (no gateway, a first
    deploy, nothing published yet): readiness then falls back to `allocation.boot_minutes`."""
    waiting = [
        m
        for m in (previous.members.values() if previous is not None else [])
        if m.state == "starting" and m.instance.phase in FRONTED
    ]
    region = gateway_region(fleet.regions, deploy.gateway) if deploy.gateway.enabled else None
    if not waiting or region is None:
        return None
    report = published_health(stack, infra.aws_provider(region))
    if report is None:
        pulumi.log.warn(
            f"no health report from the gateway ({health_parameter_name(stack)} in {region}): "
            "starting replicas count as ready allocation.boot_minutes after they were declared. "
            "Check that the gateway VM runs coral-gateway-sync"
        )
        return None
    up = replicas_up(report, [m.instance.key for m in waiting])
    boot_s = fleet.allocation.boot_minutes * 60
    for m in waiting:
        waited = (now - m.declared_at).total_seconds()
        if m.instance.key not in up and waited > 3 * boot_s:
            pulumi.log.warn(
                f"{m.instance.key} has been starting for {waited / 60:.0f} min, over 3 x "
                f"allocation.boot_minutes, and its head still fails the gateway's /health "
                "check; the capacity it replaces keeps serving (and costing) until it passes. "
                "Look at the node's console (coral-node-start) or raise boot_minutes"
            )
    return up


def _gateway(
    fleet: FleetConfig, deploy: DeploySettings, stack: str, infra: Infra
) -> Gateway | None:
    settings = deploy.gateway
    if not settings.enabled:
        return None
    region = gateway_region(fleet.regions, settings)
    if region is None:
        pulumi.log.warn(
            "no gateway: it runs on aws and the fleet has no aws region. Set coral:fleet.deploy."
            "gateway.region to an aws region, or deploy.gateway.enabled: false to silence this"
        )
        return None
    infra.nodes_read_api_key = False  # the gateway checks the key (docs/gateway.md, "API key")
    network = infra.region(settings.cloud, region)
    gateway = Gateway(
        "gateway",
        GatewayArgs(
            stack,
            settings,
            network,
            infra.aws_image(f"gateway:{region}", settings.ami_parameter, network.provider),
            deploy.api_port,
            list(deploy.api_cidrs),
            deploy.api_key_secret,
        ),
    )
    infra.gateway = gateway.peer
    return gateway


def _infra(
    fleet: FleetConfig, deploy: DeploySettings, stack: str, images: Mapping[str, str] | None
) -> Infra:
    """The run's shared resources (`images`: the AMIs the stack last deployed with)."""
    order = [(r.cloud, r.region) for r in fleet.regions]
    return Infra("infra", InfraArgs(stack, deploy, order, dict(images or {})))


def _has_endpoint(plan: Plan, inst: Instance) -> bool:
    return any(
        i.model == inst.model and i.region == inst.region and i.phase in ("decode", "aggregated")
        for i in plan.instances
    )


def _offer(perf: PerfModel, inst: Instance, node: str) -> Any:
    offer = perf.catalog.offer_in(node, inst.cloud, inst.region)
    if offer is not None:
        return offer
    raise pulumi.RunError(  # check_deployable refuses such a plan first
        f"{inst.key}: no instance type sells {node} in {inst.cloud}:{inst.region} (a price "
        "override without a catalog offer cannot be deployed); add the offer to the catalog"
    )


def serving_fleet(fleet: FleetConfig, plan: Plan, previous: Plan | None) -> FleetConfig:
    """The fleet every declared instance belongs to: the stack's, with the length buckets of
    this plan and of the previous one (whose bucket instances may still be draining)."""
    out = fleet_for_plan(fleet, plan)
    if previous is not None and previous.routing:
        kept = [d for d in previous.routing if d.model in fleet.models]
        old = fleet_for_plan(fleet, previous.model_copy(update={"routing": kept}))
        extra = {m: s for m, s in old.models.items() if m not in out.models}
        out = out.model_copy(update={"models": {**out.models, **extra}})
    return out


def _without_removed_models(state: FleetState, fleet: FleetConfig) -> FleetState:
    """Instances of a model the stack no longer serves are deleted now: it has no demand, so
    no capacity to keep (and its settings are gone)."""
    gone = sorted(
        {base_model(m.instance.model) for m in state.members.values()} - set(fleet.models)
    )
    if not gone:
        return state
    pulumi.log.warn(
        f"{', '.join(gone)} left coral:fleet.models: their instances are deleted in this run"
    )
    kept = {
        k: m for k, m in state.members.items() if base_model(m.instance.model) in fleet.models
    }
    return state.model_copy(update={"members": kept})


def run(options: ProgramOptions | None = None) -> dict[str, Any]:
    """The program `__main__.py` runs; returns what it exports (as `pulumi.export` gets it)."""
    options = options or ProgramOptions()
    stack = pulumi.get_stack()
    try:
        fleet, deploy = read_stack_config(options.stacks_dir)
        fleet = resolve_demand(fleet, stack, options.stacks_dir, warn=pulumi.log.warn)
        previous, previous_state, images = previous_outputs(stack)
        perf = load_perf_model(cards=fleet.model_cards, corrections=fleet.step_corrections())
        # The plan knows nothing of the gateway: the allocation gets the budget less its $/hour.
        gateway_usd = gateway_cost(fleet.regions, deploy)
        allocation = allocation_after_gateway(fleet.allocation, gateway_usd)
        allocated = fleet.model_copy(update={"allocation": allocation})
        plan = make_plan(stack, allocated, deploy, perf, previous, options)
    except CoralError as e:
        raise pulumi.RunError(str(e)) from None
    check_deployable(plan, fleet, perf.catalog)
    for line in unverified_placements(plan):
        pulumi.log.warn(line)
    if previous_state is None and previous is not None:  # a stack deployed before states
        previous_state = transition(None, previous, datetime.min.replace(tzinfo=UTC), 0)
    infra = _infra(fleet, deploy, stack, images)
    now = options.clock()
    # New images roll out replica by replica through the states (reconfiguration module doc).
    target = target_images(fleet, deploy, infra)
    # What a replica declared before images were kept per replica runs: AWS, the stack's
    # recorded AMI; GCP (never recorded), the image the stack names now.
    recorded = {k: v for k, v in target.items() if k.startswith("gcp:")}
    recorded |= {f"aws:{k}": v for k, v in images.items() if ":" not in k}
    rolling, boot_images = rollout_images(
        plan, previous_state, target, recorded, deploy.image_rollout_share
    )
    state = transition(
        previous_state,
        rolling,
        now,
        fleet.allocation.boot_minutes * 60,  # the boot time K is derived from
        deploy.drain_minutes * 60,
        up=_replicas_up(previous_state, fleet, deploy, stack, infra, now),
        images=boot_images,
    )
    state = _without_removed_models(state, fleet)
    pulumi.log.info(cost_diff_table(previous, plan, state, gateway_usd))
    if gateway_usd is not None and gateway_usd.unpriced:
        pulumi.log.warn(gateway_usd.summary())
    for line in exposure_warnings(deploy):
        pulumi.log.warn(line)
    if plan.served_fraction < 1:
        pulumi.log.warn(
            f"scarce: the plan serves part of the demand ({plan.short_words()}). "
            + " ".join(f"Limited by: {line}." for line in plan.binding)
        )
    states = {key: m.state for key, m in state.members.items()}
    peers = {key: m.peers for key, m in state.members.items() if m.peers}
    endpoints, gateway = declare(
        declared_plan(plan, state),
        serving_fleet(fleet, plan, previous),
        deploy,
        perf,
        stack,
        states,
        peers,
        images,
        infra,
        {key: m.image for key, m in state.members.items()},
    )
    by_region: dict[str, dict[str, int]] = {}
    for i in plan.instances:
        where = by_region.setdefault(f"{i.cloud}:{i.region}", {})
        where[f"{i.model}/{i.phase}/{i.template}"] = (
            where.get(f"{i.model}/{i.phase}/{i.template}", 0) + 1
        )
    extra_usd = gateway_usd.usd_per_hour if gateway_usd is not None else 0.0
    outputs: dict[str, Any] = {
        "hourly_cost_usd": plan.hourly_cost_usd + extra_usd,  # GPU nodes + the gateway
        "gateway_hourly_cost_usd": extra_usd,  # its priced part
        "gateway_cost": gateway_usd.model_dump(mode="json") if gateway_usd else None,
        "cost_by_model": plan.cost_by_model,
        "served_fraction": plan.served_fraction,
        "served_fractions": plan.served_fractions,
        "instances_by_region": by_region,
        "endpoints": endpoints,
        **gateway,  # gateway, gateway_endpoints, images
        "plan": json.dumps(plan.model_dump(mode="json"), sort_keys=True),
        "declared_hourly_cost_usd": state.hourly_cost_usd() + extra_usd,
        "instances_by_state": state.by_state(),
        "fleet_state": state.model_dump_json(),
    }
    for name, value in outputs.items():
        pulumi.export(name, value)
    return outputs
