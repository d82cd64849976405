"""`unverified_placements`: what an accepted plan deploys that has never been seen to serve, and
that `coral plan` and the Pulumi program warn about."""

from __future__ import annotations

from coral_iac.deployable import unverified_placements
from solver.plan_schema import template_ref
from tests.deploy.test_bootstrap import template
from tests.deploy.test_gateway import make_plan

ROWS = [
    ("llama3.1-70b", "prefill", "l40sx1", "l40sx1", 4000.0, 2),
    ("llama3.1-70b", "decode", "l40sx1", "l40sx1", 900.0, 1),
]


def test_a_plan_of_single_stage_prefills_has_nothing_unverified():
    assert unverified_placements(make_plan(ROWS)) == []


def test_pipeline_split_prefills_are_named_with_what_avoids_them():
    plan = make_plan(ROWS)
    ref = template_ref("llama3.1-70b", "prefill", "l40sx1")
    split = template("llama3.1-70b", "prefill", ["l40sx1", "l40sx1"],
                     [(20, 0, [0], 1), (60, 1, [0], 1)]).model_copy(update={"key": "l40sx1"})  # fmt: skip
    plan = plan.model_copy(update={"templates": plan.templates | {ref: split}})
    (line,) = unverified_placements(plan)
    assert line.startswith("2 prefill instance(s) of llama3.1-70b split their layers")
    assert "serving: aggregated" in line and "Not verified here" in line
    # A pipeline-split decode or aggregated instance is not what failed: no line for it.
    dref = template_ref("llama3.1-70b", "decode", "l40sx1")
    dsplit = split.model_copy(update={"phase": "decode"})
    plan = make_plan(ROWS)
    assert (
        unverified_placements(
            plan.model_copy(update={"templates": plan.templates | {dref: dsplit}})
        )
        == []
    )
