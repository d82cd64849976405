"""A plan validator that trusts nothing the solver did (and imports no solver).

It recomputes, from the stack, the catalog and the model cards alone:

- availability per (region, node config) and per GPU pool;
- the price of every instance, and the plan's total and per-model costs;
- demand cover at the plan's served fraction;
- that every template belongs to its model and phase, serves every layer once, and was built
  for the stack's current SLO;
- that instance keys are unique and follow the stable scheme.

Every plan the CLI writes and every plan in the tests passes through `validate_plan`.
"""

from __future__ import annotations

from solver.catalog.market import build_market
from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import Catalog
from solver.errors import CoralError
from solver.plan.schema import Plan, instance_key, template_ref
from solver.stack import FleetConfig
from solver.templates.serving_template import ServingTemplate

TOL = 1e-6


class InvalidPlan(CoralError):
    """The plan breaks at least one rule; `problems` lists each one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid plan:\n  " + "\n  ".join(problems))


def plan_problems(
    plan: Plan, fleet: FleetConfig, catalog: Catalog, cards: dict[str, ModelCard]
) -> list[str]:
    """Every rule the plan breaks (empty when it is valid)."""
    problems: list[str] = []
    market = build_market(fleet, catalog)
    used: dict[tuple[tuple[str, str], str], int] = {}
    total = 0.0
    by_job: dict[tuple[str, str], list[float]] = {}
    keys = set()
    for inst in plan.instances:
        region = (inst.cloud, inst.region)
        ref = template_ref(inst.model, inst.phase, inst.template)
        want = instance_key(inst.model, inst.phase, *region, inst.template, inst.index)
        if inst.key != want or inst.key in keys:
            problems.append(f"instance key {inst.key}: duplicate or not {want}")
        keys.add(inst.key)
        t = plan.templates.get(ref)
        if t is None:
            problems.append(f"{inst.key}: template {ref} is not in the plan")
            continue
        if t.model != inst.model or t.phase != inst.phase or sorted(t.nodes) != sorted(inst.nodes):
            problems.append(f"{inst.key}: template {ref} is for {t.model} {t.phase} {t.nodes}")
        price = 0.0
        for n in inst.nodes:
            used[(region, n)] = used.get((region, n), 0) + 1
            if (region, n) not in market.price:
                problems.append(f"{inst.key}: {n} is not sold in {inst.cloud}:{inst.region}")
            else:
                price += market.price[(region, n)]
        if abs(price - inst.usd_per_hour) > 1e-4:
            problems.append(f"{inst.key}: costs {price:.4f} $/h, the plan says {inst.usd_per_hour}")
        if abs(inst.throughput - t.throughput) > TOL * max(1.0, t.throughput):
            problems.append(f"{inst.key}: throughput {inst.throughput} != template {t.throughput}")
        total += price
        by_job.setdefault((inst.model, inst.phase), []).extend([price, t.throughput])
    for ref, t in sorted(plan.templates.items()):
        problems.extend(_template_problems(ref, t, fleet, cards))
    for slot, count in sorted(used.items()):
        if count > market.available.get(slot, 0):
            problems.append(
                f"{slot[0][0]}:{slot[0][1]} {slot[1]}: {count} nodes used, "
                f"{market.available.get(slot, 0)} available"
            )
    for (region, gpu), limit in sorted(market.gpu_pools.items()):
        gpus = sum(
            n * market.gpu_of[node][1]
            for (r, node), n in used.items()
            if r == region and market.gpu_of[node][0] == gpu
        )
        if gpus > limit:
            problems.append(
                f"{region[0]}:{region[1]} {gpu} pool: {gpus} GPUs used, {limit} available"
            )
    if abs(total - plan.hourly_cost_usd) > 1e-3:
        problems.append(
            f"hourly cost: recomputed {total:.4f} $/h, the plan says {plan.hourly_cost_usd}"
        )
    for job in plan.jobs:
        values = by_job.get((job.model, job.phase), [])
        supply, usd = sum(values[1::2]), sum(values[0::2])
        if supply < job.demand * plan.served_fraction * (1 - 1e-6) - 1e-6:
            problems.append(
                f"{job.model} {job.phase}: {supply:.1f} {job.unit} delivered, "
                f"{plan.served_fraction:.4f} x {job.demand:.1f} demanded"
            )
        if abs(plan.cost_by_model.get(job.model, {}).get(job.phase, 0.0) - usd) > 1e-3:
            problems.append(f"{job.model} {job.phase}: cost_by_model does not match its instances")
    if fleet.allocation.colocate_phases:
        demanded = {(j.model, j.phase) for j in plan.jobs if j.demand > 0}
        paired = {m for m, ph in demanded if ph == "prefill" and (m, "decode") in demanded}
        for model, cloud, where, seen in plan.unpaired(paired):
            problems.append(f"{model}: only {'/'.join(seen)} in {cloud}:{where}")
    budget = fleet.allocation.budget_usd_per_hour
    if budget is not None and total > budget + 1e-6 and plan.method != "homo":
        problems.append(f"hourly cost {total:.2f} exceeds the budget {budget}")
    return problems


def _template_problems(
    ref: str, t: ServingTemplate, fleet: FleetConfig, cards: dict[str, ModelCard]
) -> list[str]:
    out = []
    spec = fleet.models.get(t.model)
    if spec is None:
        return [f"template {ref}: model {t.model} is not in the stack"]
    layers = sum(s.layers for s in t.stages)
    if t.model in cards and layers != cards[t.model].layers:
        out.append(f"template {ref}: {layers} layers placed, the model has {cards[t.model].layers}")
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
    plan: Plan, fleet: FleetConfig, catalog: Catalog, cards: dict[str, ModelCard]
) -> Plan:
    """Return the plan when valid.

    Raises:
        InvalidPlan: listing every broken rule.
    """
    problems = plan_problems(plan, fleet, catalog, cards)
    if problems:
        raise InvalidPlan(problems)
    return plan
