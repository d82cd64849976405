"""A plan validator that trusts nothing the solver did (and imports no solver).

It recomputes, from the stack, the catalog and the model cards alone:

- availability per (region, node config) and per GPU pool;
- the price of every instance, and the plan's total and per-model costs;
- each (model, phase)'s demand, from the stack (never the plan's own figures), that every job
  of the stack is in the plan, and demand cover: every job gets at least the served fraction x
  demand / `allocation.target_utilization` (the planner's capacity rule), where the served
  fraction may be no more than what the instances deliver, and an instance delivers its
  template's throughput times the plan's capacity factor for it (in (0, 1]: capacity at the SLO
  attainment target never exceeds the template's throughput);
- colocated prefill and decode (`allocation.colocate_phases`) and the budget, for every method;
- that every template belongs to its model and phase, serves every layer once, and was built
  for the stack's current SLO;
- that instance keys are unique and follow the stable scheme;
- spot instances (`allocation.spot`): their spot price and zone from the market, their
  throughput net of the expected downtime, each job's spot share and that losing any one
  zone's spot instances leaves `zone_loss_serves` of its need served;
- length routing: buckets only for models that ask for it, covering every prompt length once,
  shares adding up to 1 (each bucket is then checked as a model of its own).

Every plan the CLI writes and every plan in the tests passes through `validate_plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from solver.catalog.market import Market, build_market
from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import Catalog
from solver.errors import CoralError
from solver.plan.demand import capacity_needed, stack_demand
from solver.plan.length_routing import models_for_plan
from solver.plan_schema import Instance, JobResult, Plan, instance_key, template_ref
from solver.serving.serving_template import ServingTemplate
from solver.stack import AllocationSettings, ModelSpec, PlanScope
from solver.types import Job, base_model, per_model

TOL = 1e-6
Slot = tuple[tuple[str, str], str]


class InvalidPlan(CoralError):
    """The plan breaks at least one rule; `problems` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid plan:\n  " + "\n  ".join(problems))


@dataclass
class _Tally:
    """What the plan's instances add up to, recomputed from the market."""

    used: dict[Slot, int] = field(default_factory=dict)
    total: float = 0.0
    usd: dict[Job, float] = field(default_factory=dict)
    supply: dict[Job, float] = field(default_factory=dict)
    count: dict[Job, int] = field(default_factory=dict)
    full: dict[Job, float] = field(default_factory=dict)  # throughput while up (spot: no downtime)
    spot_full: dict[Job, float] = field(default_factory=dict)
    zones: dict[tuple[Job, str, str], float] = field(default_factory=dict)  # (job, region, zone)


def plan_problems(
    plan: Plan,
    scope: PlanScope,
    catalog: Catalog,
    cards: dict[str, ModelCard],
    library: Mapping[str, ServingTemplate] | None = None,
) -> list[str]:
    """Every rule the plan breaks (empty when it is valid).

    Args:
        plan: the plan to check; only its instances and templates are taken as facts.
        scope: the stack the plan is for (`FleetConfig.plan_scope`: its models' demand and
            SLOs, the allocation settings, the market with its overrides).
        catalog: offers, for prices and availability.
        cards: model cards, for layer counts.
        library: the serving templates the plan may use, by template ref (`template_ref`);
            when given, each of the plan's templates must be the library's, throughput and
            placement included, so a plan cannot claim more than its templates deliver.

    Returns:
        One line per broken rule, naming the instance, job or slot and the numbers.

    Raises:
        InputError: the stack itself has no usable demand for a model.
    """
    problems: list[str] = _routing_problems(plan, scope.models)
    if problems:
        return problems
    models = models_for_plan(scope.models, plan)  # a routed model's buckets are models too
    market = build_market(scope.market, catalog)
    tally = _Tally()
    keys: set[str] = set()
    for inst in plan.instances:
        problems.extend(_instance_problems(inst, plan, market, scope.allocation, keys, tally))
    for ref, t in sorted(plan.templates.items()):
        problems.extend(_template_problems(ref, t, models, cards))
        if library is not None and library.get(ref) != t:
            known = library.get(ref)
            problems.append(
                f"template {ref}: not in the library"
                if known is None
                else f"template {ref}: claims {t.throughput:g} {t.unit}, the library's "
                f"{known.throughput:g} (or another placement)"
            )
    problems.extend(_capacity_problems(market, tally.used))
    if abs(tally.total - plan.hourly_cost_usd) > 1e-3:
        problems.append(
            f"hourly cost: recomputed {tally.total:.4f} $/h, the plan says {plan.hourly_cost_usd}"
        )
    demand = stack_demand(models)
    problems.extend(_demand_problems(plan, scope.allocation, demand, tally))
    problems.extend(_spot_problems(plan, scope.allocation, demand, tally))
    if scope.allocation.colocate_phases:
        demanded = {job for job, d in demand.items() if d > 0}
        paired = {m for m, ph in demanded if ph == "prefill" and (m, "decode") in demanded}
        for model, cloud, where, seen in plan.unpaired(paired):
            problems.append(f"{model}: only {'/'.join(seen)} in {cloud}:{where}")
    budget = scope.allocation.budget_usd_per_hour
    if budget is not None and tally.total > budget + 1e-6:
        problems.append(
            f"hourly cost {tally.total:.2f} exceeds the budget {budget} ({plan.method})"
        )
    return problems


def _instance_problems(
    inst: Instance,
    plan: Plan,
    market: Market,
    allocation: AllocationSettings,
    keys: set[str],
    tally: _Tally,
) -> list[str]:
    """One instance's key, template and price; adds what it uses and delivers to `tally`."""
    out = []
    region = (inst.cloud, inst.region)
    ref = template_ref(inst.model, inst.phase, inst.template)
    want = instance_key(inst.model, inst.phase, *region, inst.template, inst.index, inst.zone)
    if inst.key != want or inst.key in keys:
        out.append(f"instance key {inst.key}: duplicate or not {want}")
    keys.add(inst.key)
    t = plan.templates.get(ref)
    if t is None:
        return [*out, f"{inst.key}: template {ref} is not in the plan"]
    if t.model != inst.model or t.phase != inst.phase or sorted(t.nodes) != sorted(inst.nodes):
        out.append(f"{inst.key}: template {ref} is for {t.model} {t.phase} {t.nodes}")
    price, rate = 0.0, 0.0
    for n in inst.nodes:
        tally.used[(region, n)] = tally.used.get((region, n), 0) + 1
        spot = market.spot.get((region, n))
        if (region, n) not in market.price:
            out.append(f"{inst.key}: {n} is not sold in {inst.cloud}:{inst.region}")
        elif not inst.is_spot:
            price += market.price[(region, n)]
        elif spot is None or inst.zone not in spot.zones:
            out.append(f"{inst.key}: {n} is not sold as spot in {inst.cloud}:{inst.zone}")
        else:
            price += spot.usd_per_hour
            rate += spot.preemption.rate_per_hour
    if inst.is_spot != (inst.zone is not None):
        out.append(f"{inst.key}: a spot instance needs a zone, an on-demand one has none")
    if inst.is_spot and not allocation.spot.enabled:
        out.append(f"{inst.key}: spot, but the stack's allocation.spot.enabled is false")
    if abs(price - inst.usd_per_hour) > 1e-4:
        out.append(f"{inst.key}: costs {price:.4f} $/h, the plan says {inst.usd_per_hour}")
    factor = plan.capacity_factors.get(ref, 1.0)
    if not 0 < factor <= 1:
        out.append(f"{inst.key}: capacity factor {factor} is not in (0, 1]")
    full = t.throughput * factor
    # A spot instance serves 1 / (1 + lambda B) of the time: down B hours after each of its
    # lambda preemptions an hour while a replacement boots.
    capacity = full / (1.0 + rate * allocation.boot_minutes / 60)
    if abs(inst.throughput - capacity) > TOL * max(1.0, capacity):
        out.append(
            f"{inst.key}: throughput {inst.throughput} != template {t.throughput} x capacity "
            f"factor {factor:g}" + (f" x time up {capacity / full:.6f}" if inst.is_spot else "")
        )
    job = (inst.model, inst.phase)
    tally.total += price
    tally.usd[job] = tally.usd.get(job, 0.0) + price
    tally.supply[job] = tally.supply.get(job, 0.0) + capacity
    tally.count[job] = tally.count.get(job, 0) + 1
    tally.full[job] = tally.full.get(job, 0.0) + full
    if inst.is_spot and inst.zone is not None:
        tally.spot_full[job] = tally.spot_full.get(job, 0.0) + full
        where = (job, inst.region, inst.zone)
        tally.zones[where] = tally.zones.get(where, 0.0) + capacity
    return out


def _spot_problems(
    plan: Plan, allocation: AllocationSettings, demand: dict[Job, float], tally: _Tally
) -> list[str]:
    """The spot share of each job's throughput (while up), and that losing every spot
    instance of one zone leaves `zone_loss_serves` of the job's need served."""
    rules, out = allocation.spot, []
    needed = capacity_needed(allocation, demand)
    for job, spot in sorted(tally.spot_full.items()):
        if spot > rules.max_share * tally.full[job] * (1 + TOL) + TOL:
            out.append(
                f"{job[0]} {job[1]}: spot gives {spot / tally.full[job]:.1%} of its throughput, "
                f"more than allocation.spot.max_share {rules.max_share:g}"
            )
    for (job, region, zone), lost in sorted(tally.zones.items()):
        need = needed.get(job, 0.0) * plan.fraction_of(job[0]) * rules.zone_loss_serves
        left = tally.supply.get(job, 0.0) - lost
        if left < need * (1 - TOL) - TOL:
            out.append(
                f"{job[0]} {job[1]}: without its spot instances in {region} {zone} it delivers "
                f"{left:.1f}, below allocation.spot.zone_loss_serves x need = {need:.1f}"
            )
    return out


def _capacity_problems(market: Market, used: dict[Slot, int]) -> list[str]:
    """Nodes used over availability per (region, node config), and GPUs over each pool."""
    out = []
    for slot, count in sorted(used.items()):
        if count > market.available.get(slot, 0):
            out.append(
                f"{slot[0][0]}:{slot[0][1]} {slot[1]}: {count} nodes used, "
                f"{market.available.get(slot, 0)} available"
            )
    for (region, gpu), limit in sorted(market.gpu_pools.items()):
        gpus = sum(
            n * market.gpu_of[node][1]
            for (r, node), n in used.items()
            if r == region and node in market.gpu_of and market.gpu_of[node][0] == gpu
        )
        if gpus > limit:
            out.append(f"{region[0]}:{region[1]} {gpu} pool: {gpus} GPUs used, {limit} available")
    return out


def served_fractions(
    allocation: AllocationSettings, demand: dict[Job, float], supply: dict[Job, float]
) -> dict[str, float]:
    """Per model, the largest fraction of each of its jobs' capacity need that `supply`
    delivers.

    Args:
        allocation: the stack's allocation settings (its target utilization).
        demand: (model, phase) -> demand from the stack.
        supply: (model, phase) -> throughput the instances deliver.

    Returns:
        model -> min over its jobs with demand of supply / (demand / target utilization), at
        most 1.
    """
    needed = capacity_needed(allocation, demand)
    return per_model({job: supply.get(job, 0.0) / n for job, n in needed.items() if n > 0})


def _demand_problems(
    plan: Plan, allocation: AllocationSettings, demand: dict[Job, float], tally: _Tally
) -> list[str]:
    """Every stack job in the plan with the stack's demand, covered at the served fraction."""
    out = []
    recorded = {(j.model, j.phase): j for j in plan.jobs}
    needed = capacity_needed(allocation, demand)
    u = allocation.target_utilization
    for job, d in sorted(demand.items()):
        phi = plan.fraction_of(job[0])
        unit = "requests/s" if job[1] == "aggregated" else "tokens/s"
        rec, supply = recorded.get(job), tally.supply.get(job, 0.0)
        name = f"{job[0]} {job[1]}"
        if rec is None:
            out.append(f"{name}: the stack demands {d:.1f} {unit}; the plan has no such job")
        elif abs(rec.demand - d) > TOL * max(1.0, d):
            out.append(f"{name}: the plan says {rec.demand:.1f} {unit} demanded, the stack {d:.1f}")
        if supply < needed[job] * phi * (1 - TOL) - TOL:
            out.append(
                f"{name}: {supply:.1f} {unit} delivered, {phi:.4f} x {d:.1f} demanded "
                f"/ {u:g} target utilization = {needed[job] * phi:.1f} needed"
            )
        if rec is not None:
            out.extend(_job_record_problems(plan, rec, tally))
    actual = served_fractions(allocation, demand, tally.supply)
    for model, served in sorted(actual.items()):
        said = plan.fraction_of(model)
        if said > served + TOL:
            out.append(
                f"{model} served fraction: the plan says {said:.4f}, its instances serve "
                f"{served:.4f}"
            )
    if plan.served_fraction > min(actual.values(), default=1.0) + TOL:
        out.append(
            f"served fraction: the plan says {plan.served_fraction:.4f}, its instances serve "
            f"{min(actual.values(), default=1.0):.4f}"
        )
    for job in sorted(set(recorded) - set(demand)):
        out.append(f"{job[0]} {job[1]}: in the plan's jobs but not in the stack")
    for job in sorted(set(tally.count) - set(demand)):
        out.append(f"{job[0]} {job[1]}: {tally.count[job]} instances for a job the stack lacks")
    return out


def _job_record_problems(plan: Plan, rec: JobResult, tally: _Tally) -> list[str]:
    """A job's recorded throughput, cost and instance count against its instances."""
    job = (rec.model, rec.phase)
    supply, count = tally.supply.get(job, 0.0), tally.count.get(job, 0)
    out = []
    if abs(rec.throughput - supply) > TOL * max(1.0, supply) or rec.instances != count:
        out.append(
            f"{rec.model} {rec.phase}: the plan says {rec.instances} instances delivering "
            f"{rec.throughput:.1f}, its instances are {count} delivering {supply:.1f}"
        )
    usd = tally.usd.get(job, 0.0)
    if abs(plan.cost_by_model.get(rec.model, {}).get(rec.phase, 0.0) - usd) > 1e-3:
        out.append(f"{rec.model} {rec.phase}: cost_by_model does not match its instances")
    return out


def _routing_problems(plan: Plan, models: Mapping[str, ModelSpec]) -> list[str]:
    """Length routing: only models that ask for it, buckets that cover every prompt length
    once (contiguous from 0 to no bound), shares that add up to 1, and no instance of a routed
    model outside its buckets."""
    out = []
    routed = {d.model for d in plan.routing if d.routed}
    for d in plan.routing:
        spec = models.get(d.model)
        if spec is None or spec.length_routing is None:
            out.append(f"routing: {d.model} does not ask for length routing in the stack")
            continue
        if not d.routed:
            continue
        bs = d.buckets
        edges_ok = (
            bool(bs)
            and bs[0].min_prompt_tokens == 0
            and bs[-1].max_prompt_tokens is None
            and all(
                a.max_prompt_tokens == b.min_prompt_tokens for a, b in zip(bs, bs[1:], strict=False)
            )
        )
        if not edges_ok:
            out.append(f"routing: {d.model}'s buckets do not cover every prompt length once")
        if abs(sum(b.share for b in bs) - 1) > 1e-3:
            out.append(f"routing: {d.model}'s bucket shares add up to {sum(b.share for b in bs):g}")
        if any(base_model(b.name) != d.model for b in bs):
            out.append(f"routing: {d.model} has a bucket named for another model")
    for inst in plan.instances:
        if inst.model in routed:
            out.append(f"instance {inst.key}: {inst.model} is routed by length, not one pool")
    return out


def _template_problems(
    ref: str, t: ServingTemplate, models: Mapping[str, ModelSpec], cards: dict[str, ModelCard]
) -> list[str]:
    out = []
    spec = models.get(t.model)
    if spec is None:
        return [f"template {ref}: model {t.model} is not in the stack"]
    layers = sum(s.layers for s in t.stages)
    card = cards.get(base_model(t.model))
    if card is not None and layers != card.layers:
        out.append(f"template {ref}: {layers} layers placed, the model has {card.layers}")
    stages = len(t.stages)
    slo = {
        "prefill": [spec.slo_ms.prefill],
        "decode": [spec.slo_ms.decode],
        "aggregated": [spec.slo_ms.prefill, spec.slo_ms.decode],
    }[t.phase]
    if any(abs(b * stages - s) > 1e-6 for b, s in zip(t.stage_budget_ms, slo, strict=True)):
        out.append(f"template {ref}: built for stage budgets {t.stage_budget_ms}, SLO is {slo}")
    gpus = [(m.node, g) for s in t.stages for m in s.members for g in m.gpus]
    if len(gpus) != len(set(gpus)):
        out.append(f"template {ref}: a GPU serves two stages")
    return out


def validate_plan(
    plan: Plan,
    scope: PlanScope,
    catalog: Catalog,
    cards: dict[str, ModelCard],
    library: Mapping[str, ServingTemplate] | None = None,
) -> Plan:
    """Return the plan when valid.

    Args:
        plan: the plan to check.
        scope: the stack it is for (`FleetConfig.plan_scope`).
        catalog: offers, for prices and availability.
        cards: model cards, for layer counts.
        library: the serving templates the plan may use, by template ref (see `plan_problems`).

    Returns:
        The same plan.

    Raises:
        InvalidPlan: listing every broken rule.
        InputError: the stack itself has no usable demand for a model.
    """
    problems = plan_problems(plan, scope, catalog, cards, library)
    if problems:
        raise InvalidPlan(problems)
    return plan
