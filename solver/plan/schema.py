"""The plan's types, kept importable here for code and docs that name this module (such as
`solver/evaluation/stack_costs.py` and docs/allocation.md). They live in `solver.plan_schema`:
`solver.allocation` and `solver.simulation`, below `solver.plan`, use them too. New code imports
`solver.plan_schema`."""

from solver.plan_schema import (
    Instance,
    JobResult,
    LengthBucket,
    Method,
    ModelAttainment,
    Plan,
    RoutingDecision,
    SolverReport,
    diff_plans,
    instance_key,
    template_ref,
)

__all__ = [
    "Instance",
    "JobResult",
    "LengthBucket",
    "Method",
    "ModelAttainment",
    "Plan",
    "RoutingDecision",
    "SolverReport",
    "diff_plans",
    "instance_key",
    "template_ref",
]
