"""Whether the Pulumi program will accept a plan: the checks it runs before declaring anything,
without Pulumi, so `coral plan` can say so when it writes the plan; and what in an accepted plan
has not been seen to serve (`unverified_placements`)."""

from __future__ import annotations

from solver.catalog.offers import Catalog
from solver.plan_schema import Plan, template_ref
from solver.stack import AllocationSettings, AttainmentSettings, LibrarySettings


def deploy_problems(
    plan: Plan,
    catalog: Catalog,
    library: LibrarySettings,
    allocation: AllocationSettings,
    attainment: AttainmentSettings,
) -> list[str]:
    """Why the Pulumi program would refuse `plan` for this stack (its `library`, `allocation`
    and `attainment` settings), one line each with the setting that changes it (empty: it
    deploys). `coral plan` reports the same list when it
    writes the plan, so a refusal is known before any preview."""
    problems: list[str] = []
    unsold = sorted(
        {
            (i.cloud, i.region, n)
            for i in plan.instances
            for n in i.nodes
            if catalog.offer_in(n, i.cloud, i.region) is None
        }
    )
    if unsold:
        problems.append(
            "no instance type sells "
            + ", ".join(f"{n} in {c}:{r}" for c, r, n in unsold)
            + ": a node priced only under coral:fleet.prices can be planned and simulated, not "
            "deployed; add the offer to the catalog, or remove the node from node_configs"
        )
    mode_problem = library.strategy.deploy_problem()  # paper, general: not on stock vLLM
    if mode_problem is not None:
        problems.append(mode_problem)
    budget = allocation.budget_usd_per_hour
    if budget is not None and any(line.startswith("budget") for line in plan.binding):
        problems.append(
            f"the plan exceeds the budget: {budget} $/hour serves only part of the demand "
            f"({plan.short_words()}); raise coral:allocation.budget_usd_per_hour or "
            "lower demand"
        )
    if not plan.serves_any() and plan.jobs:
        problems.append("the plan serves none of the demand: " + "; ".join(plan.binding))
    if not attainment.accept_below_target:
        for a in plan.below_target():
            if not a.short_by:  # at the target, on too few held-out requests to say so
                problems.append(
                    f"{a.model}'s claim of {100 * (a.judged or 0):.1f}% is not supported: "
                    f"{a.unsupported}, or set coral:attainment.accept_below_target: true to "
                    "deploy it anyway"
                )
                continue
            problems.append(
                f"{a.model} meets its SLOs for {100 * (a.judged or 0):.1f}% of requests in "
                f"simulation, below its target {100 * a.target:g}% ({a.cause}); raise "
                "coral:fleet.attainment.rounds, lower the model's slo_attainment, or set "
                "coral:attainment.accept_below_target: true to deploy it anyway"
            )
    for model, cloud, region, phases in plan.unpaired():
        problems.append(
            f"{model} has only {'/'.join(phases)} instances in {cloud}:{region}; a "
            "disaggregated pair needs both in one region (KV moves over the private "
            "network). "
            + (
                "Set coral:allocation.colocate_phases: true (the planner then pairs them), "
                if not allocation.colocate_phases
                else ""
            )
            + "restrict the model's regions, or set serving: aggregated"
        )
    return problems


def unverified_placements(plan: Plan) -> list[str]:
    """What the plan deploys that has never been seen to serve, one warning line each (empty
    when everything in it has). Not a refusal: the placement may work on GPUs; the line says
    what to check and how to avoid it.

    - A prefill instance whose layers are split over a pipeline (PP > 1): its KV hand-off to
      a PP = 1 decode (NixlPushConnector) served no request on vLLM-CPU, where the decode's
      NIXL handshake refused each prefill rank ("Number of KV layers must match between
      prefill and decode"), and vLLM 0.33's handshake has the same check (docs/deploy.md,
      "Not verified here").
    """
    split = [
        i
        for i in plan.instances
        if i.phase == "prefill"
        and len(plan.templates[template_ref(i.model, i.phase, i.template)].stages) > 1
    ]
    if not split:
        return []
    models = sorted({i.model for i in split})
    return [
        f"{len(split)} prefill instance(s) of {', '.join(models)} split their layers over a "
        "pipeline (PP > 1): a pipeline-split prefill handing KV to a decode has not been seen "
        "to serve (it failed on vLLM-CPU in the NIXL handshake; docs/deploy.md, 'Not verified "
        "here'). Boot one pair on GPUs before relying on it, or set the model's serving: "
        "aggregated"
    ]
