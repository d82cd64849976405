"""Safe reconfiguration: which instances a run declares, and in which state.

A plan says what should run. Going there from what runs now must never drop the capacity that
traffic needs: a new instance serves only after it has booted (minutes: image, weights, CUDA
graphs), and an instance that leaves the plan may still carry traffic its replacement cannot
take yet. So each run (`pulumi up`) declares the plan's instances plus the ones leaving it, each
in one of four states:

| state | in the plan | gets new requests | next run |
|---|---|---|---|
| `starting` | yes | no (booting) | `ready` once `boot_s` has passed since it was declared |
| `ready` | yes | yes | stays `ready` |
| `retiring` | no | yes: its (model, phase) needs it until `starting` ones are ready | `retiring` or `draining` |
| `draining` | no | no: in-flight requests finish | deleted (its node's stop step drains first) |

An instance leaving the plan becomes `retiring` only while the plan's `ready` capacity of its
(model, phase) is below the demand the plan serves; the largest leaving instances are kept
first, just enough to cover it. Otherwise it goes straight to `draining`. A `draining` instance
is deleted at the next run, so it receives no new requests for one whole interval before its
node is stopped. An instance that comes back into the plan before it is deleted is `ready`
again (it never stopped).

Serving capacity (what the gateway spreads new requests over) is `ready` + `retiring`. Over any
sequence of runs, the capacity of every (model, phase) never falls below the smaller of its
demand and its capacity before the run (tests/property/test_reconfigure_properties.py).

The state is pure data (`FleetState`): the Pulumi program exports it and reads it back on the
next run, like the plan.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from solver.plan import Instance, Plan, template_ref
from solver.template import ServingTemplate

FROZEN = ConfigDict(frozen=True, extra="forbid")
State = Literal["starting", "ready", "retiring", "draining"]
SERVING: frozenset[str] = frozenset({"ready", "retiring"})
Job = tuple[str, str]


class Member(BaseModel):
    """One declared instance: what it is, its template (to declare it unchanged while it
    leaves), its state, and when it was first declared (UTC)."""

    model_config = FROZEN
    instance: Instance
    template: ServingTemplate
    state: State
    declared_at: datetime = Field(description="First run that declared it (UTC).")


class FleetState(BaseModel):
    model_config = FROZEN
    format: Literal[1] = 1
    members: dict[str, Member] = Field(description="Instance key -> member, keys sorted.")

    def capacity(self, states: frozenset[str] = SERVING) -> dict[Job, float]:
        """(model, phase) -> throughput of the members in `states` (default: serving)."""
        out: dict[Job, float] = {}
        for m in self.members.values():
            if m.state in states:
                job = (m.instance.model, m.instance.phase)
                out[job] = out.get(job, 0.0) + m.instance.throughput
        return out

    def by_state(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {s: [] for s in ("starting", "ready", "retiring", "draining")}
        for key, m in self.members.items():
            out[m.state].append(key)
        return out

    def hourly_cost_usd(self) -> float:
        """What every declared instance costs, the leaving ones included."""
        return round(sum(m.instance.usd_per_hour for m in self.members.values()), 4)


def served_demand(plan: Plan) -> dict[Job, float]:
    """(model, phase) -> the demand the plan serves (its served fraction of the demand)."""
    return {(j.model, j.phase): j.demand * plan.served_fraction for j in plan.jobs}


def transition(
    previous: FleetState | None, plan: Plan, now: datetime, boot_s: float
) -> FleetState:
    """The members a run declares for `plan`, given the previous run's state (see module doc)."""
    before = previous.members if previous is not None else {}
    members: dict[str, Member] = {}
    for inst in plan.instances:
        old = before.get(inst.key)
        declared = old.declared_at if old is not None else now
        booted = old is not None and (now - declared).total_seconds() >= boot_s
        members[inst.key] = Member(
            instance=inst,
            template=plan.templates[template_ref(inst.model, inst.phase, inst.template)],
            state="ready" if booted or (old is not None and old.state in SERVING) else "starting",
            declared_at=declared,
        )
    ready = FleetState(members=members).capacity(frozenset({"ready"}))
    demand = served_demand(plan)
    leaving = sorted(
        (m for key, m in before.items() if key not in members and m.state != "draining"),
        key=lambda m: (-m.instance.throughput, m.instance.key),
    )
    kept = dict(ready)
    for m in leaving:
        job = (m.instance.model, m.instance.phase)
        needed = kept.get(job, 0.0) < demand.get(job, 0.0)
        # A leaving instance that never finished booting carries no traffic: nothing to keep.
        serving = m.state in SERVING or (now - m.declared_at).total_seconds() >= boot_s
        state: State = "retiring" if needed and serving else "draining"
        if state == "retiring":
            kept[job] = kept.get(job, 0.0) + m.instance.throughput
        members[m.instance.key] = m.model_copy(update={"state": state})
    return FleetState(members=dict(sorted(members.items())))
