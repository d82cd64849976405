"""The plan validator recomputes demand from the stack: a plan cannot lower its own demand, drop
a job, claim more than its instances serve, ignore the target utilization or the budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from solver.plan.demand import capacity_needed, stack_demand
from solver.plan.planner import plan_stack
from solver.plan.validator import InvalidPlan, plan_problems, served_fractions, validate_plan
from solver.plan_schema import Instance, Plan
from solver.types import Job
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf, rps_needing


def with_rps(phi: float, gpt: float, **more: Any):
    models = {
        "phi-4": SMALL_FLEET["models"]["phi-4"] | {"demand": {"requests_per_s": phi}},
        "gpt-oss-20b": SMALL_FLEET["models"]["gpt-oss-20b"] | {"demand": {"requests_per_s": gpt}},
    }
    return fleet(models=models, **more)


def solve(f, method: str = "coral") -> Plan:
    p = plan_stack("test", f, perf().catalog, libraries(), method=method)  # type: ignore[arg-type]
    return validate_plan(p, f.plan_scope(), perf().catalog, perf().cards)


def forge(plan: Plan, keep: Callable[[Instance], bool], demand: dict[Job, float | None]) -> Plan:
    """The plan with only the instances `keep` accepts, its jobs' demand replaced from `demand`
    (None removes the job), and every total recomputed so it agrees with itself."""
    data = plan.model_dump()
    data["instances"] = [i for i in data["instances"] if keep(Instance.model_validate(i))]
    data["hourly_cost_usd"] = round(sum(i["usd_per_hour"] for i in data["instances"]), 4)
    data["jobs"], data["cost_by_model"] = [], {}
    for job in plan.jobs:
        key = (job.model, job.phase)
        if key in demand and demand[key] is None:
            continue
        mine = [i for i in data["instances"] if (i["model"], i["phase"]) == key]
        usd = round(sum(i["usd_per_hour"] for i in mine), 4)
        data["cost_by_model"].setdefault(job.model, {})[job.phase] = usd
        data["jobs"].append(
            job.model_dump()
            | {"demand": demand.get(key, job.demand), "instances": len(mine), "usd_per_hour": usd}
            | {"throughput": sum(i["throughput"] for i in mine)}
        )
    return Plan.model_validate(data)


def others(problems: list[str], *about: str) -> list[str]:
    """The problems that name none of `about`."""
    return [p for p in problems if not any(a in p for a in about)]


def test_a_plan_that_lowers_its_own_demand_is_rejected_with_the_job_and_numbers():
    """One phi-4 decode instance dropped, and the plan's phi-4 decode demand lowered to what is
    left: every figure in the plan agrees with every other, but not with the stack. phi-4 decode
    needs 1.5 l40sx1 instances (its only template), so the plan buys two."""
    f = with_rps(rps_needing("phi-4", "decode", "l40sx1", 1.5), 4)
    plan = solve(f)
    decode = [i for i in plan.instances if (i.model, i.phase) == ("phi-4", "decode")]
    assert len(decode) >= 2
    dropped = decode[-1].key
    left = sum(i.throughput for i in decode[:-1])
    stack = stack_demand(f.models)[("phi-4", "decode")]
    assert left < stack
    forged = forge(plan, lambda i: i.key != dropped, {("phi-4", "decode"): left})
    with pytest.raises(InvalidPlan) as exc:
        validate_plan(forged, f.plan_scope(), perf().catalog, perf().cards)
    text = str(exc.value)
    assert (
        f"phi-4 decode: the plan says {left:.1f} tokens/s demanded, the stack {stack:.1f}" in text
    )
    assert f"phi-4 decode: {left:.1f} tokens/s delivered, 1.0000 x {stack:.1f} demanded" in text
    assert "served fraction: the plan says 1.0000, its instances serve" in text
    # the forgery agrees with itself: only the demand the stack sets gives it away
    problems = plan_problems(forged, f.plan_scope(), perf().catalog, perf().cards)
    assert others(problems, "phi-4 decode", "served fraction") == []


def test_a_plan_that_drops_a_job_is_rejected_with_the_job_and_numbers():
    """gpt-oss-20b's decode job and its instances removed: colocation aside, nothing else
    in the plan gives it away."""
    f = with_rps(3, 4, allocation={"colocate_phases": False})
    plan = solve(f)
    forged = forge(
        plan,
        lambda i: (i.model, i.phase) != ("gpt-oss-20b", "decode"),
        {("gpt-oss-20b", "decode"): None},
    )
    assert {(j.model, j.phase) for j in forged.jobs} == set(stack_demand(f.models)) - {
        ("gpt-oss-20b", "decode")
    }
    stack = stack_demand(f.models)[("gpt-oss-20b", "decode")]
    with pytest.raises(InvalidPlan) as exc:
        validate_plan(forged, f.plan_scope(), perf().catalog, perf().cards)
    text = str(exc.value)
    assert (
        f"gpt-oss-20b decode: the stack demands {stack:.1f} tokens/s; the plan has no such job"
        in text
    )
    assert f"gpt-oss-20b decode: 0.0 tokens/s delivered, 1.0000 x {stack:.1f} demanded" in text
    assert others(exc.value.problems, "gpt-oss-20b decode", "served fraction") == []


def test_a_plan_claiming_more_than_its_instances_serve_is_rejected():
    avail = [
        {"cloud": "aws", "region": r, "node": n, "count": 1}
        for r in ("us-east-2", "ap-northeast-2")
        for n in SMALL_FLEET["node_configs"]
    ]
    # phi-4 decode needs 2.6 l40sx1 instances, its only template, and two l40sx1 are available
    f = with_rps(rps_needing("phi-4", "decode", "l40sx1", 2.6), 8, availability=avail)
    plan = solve(f)
    assert 0 < plan.served_fraction < 1
    actual = min(served_fractions(f.allocation, stack_demand(f.models), _supply(plan)).values())
    assert actual >= plan.served_fraction
    claimed = Plan.model_validate(
        plan.model_dump() | {"served_fraction": 1.0, "served_fractions": {}}
    )
    with pytest.raises(
        InvalidPlan,
        match=rf"served fraction: the plan says 1\.0000, its instances serve {actual:.4f}",
    ):
        validate_plan(claimed, f.plan_scope(), perf().catalog, perf().cards)


def test_coverage_applies_the_target_utilization_like_the_planner():
    """Capacity = demand / target_utilization: a plan bought for u = 1 is short at u = 0.5."""
    f = with_rps(3, 4)
    half = with_rps(3, 4, allocation={"target_utilization": 0.5})
    plan = solve(f)
    short = [
        job
        for job, need in capacity_needed(half.allocation, stack_demand(half.models)).items()
        if _supply(plan).get(job, 0.0) < need
    ]
    assert short
    with pytest.raises(InvalidPlan, match=r"/ 0\.5 target utilization = [\d.]+ needed"):
        validate_plan(plan, half.plan_scope(), perf().catalog, perf().cards)
    roomy = solve(half)  # the planner's own plan for u = 0.5 passes
    assert roomy.hourly_cost_usd > plan.hourly_cost_usd


def test_the_budget_binds_every_method_homo_included():
    f = with_rps(3, 4)
    homo = solve(f, "homo")
    tight = with_rps(3, 4, allocation={"budget_usd_per_hour": homo.hourly_cost_usd - 0.5})
    with pytest.raises(InvalidPlan, match=r"exceeds the budget .* \(homo\)"):
        validate_plan(homo, tight.plan_scope(), perf().catalog, perf().cards)


def test_a_job_the_stack_lacks_is_rejected():
    f = with_rps(3, 4)
    plan = solve(f)
    only_phi = fleet(
        models={"phi-4": SMALL_FLEET["models"]["phi-4"] | {"demand": {"requests_per_s": 3}}}
    )
    with pytest.raises(
        InvalidPlan, match=r"gpt-oss-20b decode: in the plan's jobs but not in the stack"
    ):
        validate_plan(plan, only_phi.plan_scope(), perf().catalog, perf().cards)


def _supply(plan: Plan) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for i in plan.instances:
        out[(i.model, i.phase)] = out.get((i.model, i.phase), 0.0) + i.throughput
    return out


def test_a_template_whose_throughput_the_plan_made_up_is_rejected_against_the_library():
    """The plan claims phi-4's decode template serves 6x what the library says, and drops the
    instances it no longer needs, every total consistent: only the library check catches it."""
    from solver.plan_schema import template_ref

    f = with_rps(rps_needing("phi-4", "decode", "l40sx1", 2.6), 0.5)
    plan = solve(f)
    library = {
        template_ref(m, ph, t.key): t for (m, ph), lib in libraries().items() for t in lib.templates
    }
    ref = template_ref("phi-4", "decode", "l40sx1")
    fake = plan.templates[ref].model_copy(update={"throughput": plan.templates[ref].throughput * 6})
    data = plan.model_dump()
    data["templates"][ref] = fake.model_dump()
    first = next(i for i in plan.instances if i.model == "phi-4" and i.phase == "decode")
    for inst in data["instances"]:
        if (inst["model"], inst["phase"]) == ("phi-4", "decode"):
            inst["throughput"] = fake.throughput
    forged = forge(
        Plan.model_validate(data),
        lambda i: (i.model, i.phase) != ("phi-4", "decode") or i.key == first.key,
        {},
    )
    catalog, cards = perf().catalog, perf().cards
    assert others(plan_problems(forged, f.plan_scope(), catalog, cards), "phi-4") == []
    assert (
        plan_problems(forged, f.plan_scope(), catalog, cards) == []
    )  # self-consistent without the library
    problems = plan_problems(forged, f.plan_scope(), catalog, cards, library)
    assert any(ref in p and "the library's" in p for p in problems), problems
    assert plan_problems(plan, f.plan_scope(), catalog, cards, library) == []
