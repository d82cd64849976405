"""Length-aware routing: a model's requests split by prompt length into buckets, each served by
instances of its own (Mélange's request-size buckets; docs/slo-attainment.md).

A model with `length_routing: {split_quantiles: [q, ...]}` is planned twice: as one pool, and
as buckets cut at those quantiles of its planning workload's prompt lengths. A bucket is a model
of its own to the rest of the planner, named `<model>@b<i>`: its demand is the model's requests/s
times its share (or each phase's tokens/s times the bucket's share of those tokens), its mean
lengths are its requests' means, scaled so the buckets' share-weighted means are the model's
(its template library is built for them), and its workload is the model's stream thinned to its prompts (`LengthSlice`), so every
request keeps the length and arrival time it has in the one pool.

- **Shared miss budget.** The model's target holds for all its requests together, so after a
  first routed plan with every bucket at the target, the longest bucket gets what the shorter
  ones leave: (target - sum of their share x planned attainment) / its share, at least 0.5 and
  at most the target, and the plan is made again.
- **Decision** (`mode: auto`): the buckets are kept for a model when its routed plan meets the
  target on the verification workload (request-weighted over the buckets) and costs less than
  its one pool; `mode: always` keeps them whatever they cost. Models decided differently from
  the routed plan are planned once more, so the final plan is one solve of one fleet.
- **Gateway.** Each bucket's bounds in tokens times `bytes_per_token` are its Content-Length
  bounds: HAProxy sends a request to the bucket its body size falls in
  (`coral_iac.gateway_config`), without reading the body.

`fleet_for_plan` rebuilds the fleet a plan was solved for from the plan alone (its buckets), for
the validator, the simulator and the Pulumi program.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from solver.errors import InputError
from solver.plan_schema import LengthBucket, ModelAttainment, Plan, RoutingDecision, lower_of
from solver.simulation.workload import model_trace, request_rate
from solver.stack import Demand, FleetConfig, LengthSlice, ModelSpec, PhaseTokens
from solver.types import BUCKET_SEP

MIN_BUCKET_TARGET = 0.5  # the longest bucket's target under the shared miss budget, at least

PlanOnce = Callable[[FleetConfig], Plan]


def routed_models(fleet: FleetConfig) -> list[str]:
    """Models that ask for length routing and have demand to route."""
    return sorted(
        m for m, s in fleet.models.items() if s.length_routing is not None and request_rate(s) > 0
    )


def make_buckets(fleet: FleetConfig, model: str, root: Path | None = None) -> list[LengthBucket]:
    """The model's buckets, cut at its `split_quantiles` of the planning workload's prompt
    lengths (the verification workload is never read), each at the model's target.

    Raises:
        InputError: a cut leaves a bucket empty (many prompts of one length).
    """
    spec = fleet.models[model]
    routing = spec.length_routing
    assert routing is not None
    index = sorted(fleet.models).index(model)
    trace = model_trace(spec, index, "plan", 3_600.0, root)
    prompts = trace.prompt.astype(np.float64)
    cuts = [float(np.floor(np.quantile(prompts, q))) for q in routing.split_quantiles]
    edges: list[tuple[float, float | None]] = list(zip([0.0, *cuts], [*cuts, None], strict=True))
    cut = []
    for i, (lo, hi) in enumerate(edges):
        keep = (prompts > lo) & (prompts <= hi if hi is not None else True)
        if not keep.any():
            raise InputError(
                f"coral:fleet.models.{model}.length_routing.split_quantiles",
                f"the cut at {lo:g} tokens leaves bucket {i} without requests "
                f"(prompt lengths of the planning workload: {len(prompts)} requests)",
                "use fewer or further-apart quantiles",
            )
        cut.append((lo, hi, float(keep.mean()), prompts[keep].mean(), trace.output[keep].mean()))
    # The buckets' means, weighted by their shares, are the stack's means (the planning window's
    # differ by a few percent), so the buckets' token demand adds up to the model's exactly.
    prompt_k = spec.mean_prompt_tokens / sum(share * p for _, _, share, p, _ in cut)
    output_k = spec.mean_output_tokens / sum(share * o for _, _, share, _, o in cut)
    bpt = routing.bytes_per_token
    return [
        LengthBucket(
            name=f"{model}{BUCKET_SEP}b{i}",
            min_prompt_tokens=lo,
            max_prompt_tokens=hi,
            min_body_bytes=int(lo * bpt),
            max_body_bytes=int(hi * bpt) if hi is not None else None,
            share=round(share, 6),
            mean_prompt_tokens=round(float(p * prompt_k), 3),
            mean_output_tokens=round(float(o * output_k), 3),
            target=spec.slo_attainment,
        )
        for i, (lo, hi, share, p, o) in enumerate(cut)
    ]


def bucket_spec(spec: ModelSpec, bucket: LengthBucket) -> ModelSpec:
    """A bucket as a model of its own: its share of the demand, its lengths, its requests."""
    tokens = spec.demand.tokens_per_s if spec.demand is not None else None
    if tokens is None:
        demand = Demand(requests_per_s=request_rate(spec) * bucket.share)
    else:  # each phase's tokens/s in proportion to the bucket's share of the model's tokens
        p = bucket.share * bucket.mean_prompt_tokens / spec.mean_prompt_tokens
        o = bucket.share * bucket.mean_output_tokens / spec.mean_output_tokens
        demand = Demand(
            tokens_per_s=PhaseTokens(prefill=tokens.prefill * p, decode=tokens.decode * o)
        )
    return spec.model_copy(
        update={
            "demand": demand,
            "mean_prompt_tokens": bucket.mean_prompt_tokens,
            "mean_output_tokens": bucket.mean_output_tokens,
            "slo_attainment": bucket.target,
            "length_routing": None,
            "length_slice": LengthSlice(
                min_prompt_tokens=bucket.min_prompt_tokens,
                max_prompt_tokens=bucket.max_prompt_tokens,
                share=bucket.share,
                base_prompt_tokens=spec.mean_prompt_tokens,
                base_output_tokens=spec.mean_output_tokens,
            ),
        }
    )


def expand(fleet: FleetConfig, buckets: dict[str, list[LengthBucket]]) -> FleetConfig:
    """The fleet with each model of `buckets` replaced by its buckets."""
    return fleet.model_copy(update={"models": expanded(fleet.models, buckets)})


def expanded(
    models: Mapping[str, ModelSpec], buckets: dict[str, list[LengthBucket]]
) -> dict[str, ModelSpec]:
    """The models (by name, sorted) with each model of `buckets` replaced by its buckets."""
    out: dict[str, ModelSpec] = {}
    for name, spec in models.items():
        if name in buckets:
            out.update({b.name: bucket_spec(spec, b) for b in buckets[name]})
        else:
            out[name] = spec
    return dict(sorted(out.items()))


def fleet_for_plan(fleet: FleetConfig, plan: Plan) -> FleetConfig:
    """The fleet `plan` was solved for: the stack's, with its routed models' buckets.

    Raises:
        InputError: the plan routes a model the stack does not serve.
    """
    models = models_for_plan(fleet.models, plan)
    return fleet if models is fleet.models else fleet.model_copy(update={"models": models})


def models_for_plan(models: Mapping[str, ModelSpec], plan: Plan) -> Mapping[str, ModelSpec]:
    """The models `plan` was solved for: the stack's (`models`, by name), each routed model
    replaced by its buckets (`models` itself when the plan routes none).

    Raises:
        InputError: the plan routes a model the stack does not serve.
    """
    routed = {d.model: d.buckets for d in plan.routing if d.routed}
    unknown = sorted(set(routed) - set(models))
    if unknown:
        raise InputError(
            "plan.routing",
            f"routes {', '.join(unknown)}, which the stack does not serve",
            "plan again with this stack (coral plan --stack ...)",
        )
    return expanded(models, routed) if routed else models


def share_miss_budget(buckets: list[LengthBucket], plan: Plan, target: float) -> list[LengthBucket]:
    """The longest bucket's target relaxed by what the shorter buckets' planned attainment
    leaves of the model's miss budget (module doc)."""
    planned = {a.model: a.planned for a in plan.attainment}
    shorter = buckets[:-1]
    if any(planned.get(b.name) is None for b in shorter):
        return buckets
    met = sum(b.share * float(planned[b.name] or 0.0) for b in shorter)
    last = buckets[-1]
    relaxed = (target - met) / last.share
    relaxed = float(np.floor(min(target, max(MIN_BUCKET_TARGET, relaxed)) * 1000) / 1000)
    return [*shorter, last.model_copy(update={"target": relaxed})]


def _weighted(
    plan: Plan, buckets: list[LengthBucket]
) -> tuple[float | None, float | None, float | None]:
    """(planned, verified, replayed) attainment of a routed model as a whole: planned by share,
    verified by the requests each bucket's verification saw, replayed (the whole trace) by
    share; None where a bucket lacks it."""
    rows = {a.model: a for a in plan.attainment}
    mine = [rows[b.name] for b in buckets if b.name in rows]
    planned = (
        sum(b.share * float(rows[b.name].planned or 0.0) for b in buckets if b.name in rows)
        if mine and all(a.planned is not None for a in mine)
        else None
    )
    n = sum(a.verified_requests for a in mine)
    verified = (
        sum(float(a.verified or 0.0) * a.verified_requests for a in mine) / n
        if n and all(a.verified is not None for a in mine)
        else None
    )
    shares = sum(b.share for b in buckets if b.name in rows)
    replayed = (
        sum(b.share * float(rows[b.name].replayed or 0.0) for b in buckets if b.name in rows)
        / shares
        if mine and shares > 0 and all(a.replayed is not None for a in mine)
        else None
    )
    return planned, verified, replayed


def _cost(plan: Plan, names: list[str]) -> float:
    return round(sum(sum(plan.cost_by_model.get(n, {}).values()) for n in names), 4)


def _penalty(plan: Plan, names: list[str], previous: Plan | None, k: float) -> float:
    """The start-up penalty of the instances of `names` the running fleet does not have: what
    switching between buckets and one pool costs on top of the $/hour (the allocation's K)."""
    if previous is None:  # a first plan: every instance is new either way
        return 0.0
    running = {i.key for i in previous.instances}
    return k * sum(
        i.usd_per_hour for i in plan.instances if i.model in names and i.key not in running
    )


def _claimed_of(plan: Plan, model: str) -> float | None:
    """The attainment a plan claims for a model (`ModelAttainment.judged`)."""
    return next((a.judged for a in plan.attainment if a.model == model), None)


def decide(
    model: str,
    fleet: FleetConfig,
    one: Plan,
    routed: Plan,
    buckets: list[LengthBucket],
    previous: Plan | None = None,
) -> RoutingDecision:
    """Route the model or not (module doc), with both plans' cost and attainment; with a
    running fleet (`previous`), each side's cost includes the start-up penalty of the instances
    it adds, so a running choice is kept unless the other saves more than switching costs."""
    spec = fleet.models[model]
    assert spec.length_routing is not None
    target = spec.slo_attainment
    names = [b.name for b in buckets]
    one_usd, routed_usd = _cost(one, [model]), _cost(routed, names)
    k = fleet.allocation.startup_penalty_k
    one_total = one_usd + _penalty(one, [model], previous, k)
    routed_total = routed_usd + _penalty(routed, names, previous, k)
    one_ok = (v1 := _claimed_of(one, model)) is None or v1 >= target
    v2 = lower_of(*_weighted(routed, buckets)[1:])
    served = min((routed.fraction_of(b) for b in names), default=1.0)
    routed_ok = (v2 is None or v2 >= target) and served >= one.fraction_of(model)
    if spec.length_routing.mode == "always":
        routed_it, reason = True, "length_routing.mode is always"
    elif routed_ok != one_ok:  # only one of the two meets the target
        routed_it = routed_ok
        reason = "only the buckets meet the target" if routed_ok else "the buckets miss the target"
    elif not routed_ok:  # neither does: the closer one
        routed_it = (v2 or 0.0) > (v1 or 0.0)
        reason = "neither meets the target; " + ("buckets" if routed_it else "one pool") + " closer"
    elif routed_total < one_total:
        saving = 100 * (one_usd - routed_usd) / one_usd if one_usd else 0.0
        routed_it, reason = True, f"buckets save {saving:.1f}% at the target"
    elif routed_usd < one_usd:
        saving = 100 * (one_usd - routed_usd) / one_usd
        routed_it = False
        reason = f"buckets would save {saving:.1f}%, less than replacing the running one pool costs"
    else:
        extra = 100 * (routed_usd - one_usd) / one_usd if one_usd else 0.0
        routed_it, reason = False, f"buckets cost {extra:.1f}% more than one pool"
    return RoutingDecision(
        model=model,
        routed=routed_it,
        reason=reason,
        one_pool_usd_per_hour=one_usd,
        routed_usd_per_hour=routed_usd,
        one_pool_verified=v1,
        routed_verified=round(v2, 4) if v2 is not None else None,
        buckets=buckets,
    )


def whole_model_rows(plan: Plan, fleet: FleetConfig) -> list[ModelAttainment]:
    """The plan's attainment rows plus one per routed model as a whole (its target, its
    buckets' attainment weighted as in `_weighted`, their causes)."""
    rows = [
        a for a in plan.attainment if a.model not in {d.model for d in plan.routing if d.routed}
    ]
    by_name = {a.model: a for a in plan.attainment}
    for d in plan.routing:
        if not d.routed:
            continue
        spec = fleet.models[d.model]
        mine = [by_name[b.name] for b in d.buckets if b.name in by_name]
        planned, verified, replayed = _weighted(plan, d.buckets)
        claim = lower_of(verified, replayed)
        short = claim is not None and claim < spec.slo_attainment
        rows.append(
            ModelAttainment(
                model=d.model,
                target=spec.slo_attainment,
                workload=mine[0].workload if mine else "",
                planned=round(planned, 4) if planned is not None else None,
                verified=round(verified, 4) if verified is not None else None,
                replayed=round(replayed, 4) if replayed is not None else None,
                verified_requests=sum(a.verified_requests for a in mine),
                verified_minutes=max((a.verified_minutes for a in mine), default=0.0),
                cause="; ".join(f"{a.model}: {a.cause}" for a in mine if a.cause) if short else "",
            )
        )
    return sorted(rows, key=lambda a: a.model)


def _rank(
    plan: Plan, buckets: dict[str, list[LengthBucket]], fleet: FleetConfig
) -> tuple[bool, float, float]:
    """Order of two routed plans: every routed model at its target first, then the cheaper,
    then the one closer to its targets."""
    gaps = []
    for m, bs in buckets.items():
        verified = lower_of(*_weighted(plan, bs)[1:])
        gaps.append(fleet.models[m].slo_attainment - (verified if verified is not None else 1.0))
    worst = max(gaps, default=0.0)
    return (worst > 0, plan.hourly_cost_usd, worst)


def plan_routed(
    fleet: FleetConfig,
    plan_once: PlanOnce,
    root: Path | None = None,
    progress: Callable[[str], None] | None = None,
    previous: Plan | None = None,
) -> tuple[Plan, FleetConfig]:
    """Plan a fleet whose models may ask for length routing (module doc); returns the plan
    (with its routing decisions and whole-model attainment rows) and the fleet it was solved
    for. `plan_once(fleet)`: one closed-loop plan with verification; `progress`: a line per
    plan; `previous`: the running plan (switching costs its start-up penalty)."""
    say = progress or (lambda _line: None)
    asked = routed_models(fleet)
    if not asked:
        return plan_once(fleet), fleet
    say(f"length routing ({', '.join(asked)}): planning one pool per model")
    one = plan_once(fleet)
    buckets = {m: make_buckets(fleet, m, root) for m in asked}
    say("length routing: planning the length buckets")
    routed = plan_once(expand(fleet, buckets))
    relaxed = {
        m: share_miss_budget(bs, routed, fleet.models[m].slo_attainment)
        for m, bs in buckets.items()
    }
    if relaxed != buckets:
        say("length routing: the longest buckets take the miss budget the shorter ones leave")
        second = plan_once(expand(fleet, relaxed))
        # The closed loop is path-dependent: keep the relaxed plan only when it does better.
        if _rank(second, relaxed, fleet) < _rank(routed, buckets, fleet):
            buckets, routed = relaxed, second
    decisions = [decide(m, fleet, one, routed, buckets[m], previous) for m in asked]
    chosen = {d.model: d.buckets for d in decisions if d.routed}
    if len(chosen) == len(asked):
        final = routed
    elif not chosen:
        final = one
    else:
        say("length routing: planning the chosen mix of buckets and pools")
        final = plan_once(expand(fleet, chosen))
    auto = all(fleet.models[m].length_routing.mode == "auto" for m in chosen)  # type: ignore[union-attr]
    objective = final.hourly_cost_usd + final.startup_penalty_usd_per_hour
    if chosen and auto and objective > one.hourly_cost_usd + one.startup_penalty_usd_per_hour:
        why = (
            f"the plan with buckets costs {final.hourly_cost_usd:,.2f} $/h, one pool per model "
            f"{one.hourly_cost_usd:,.2f} $/h"
        )
        decisions = [d.model_copy(update={"routed": False, "reason": why}) for d in decisions]
        final = one
    final = final.model_copy(update={"routing": decisions})
    final = final.model_copy(update={"attainment": whole_model_rows(final, fleet)})
    return final, fleet_for_plan(fleet, final)
