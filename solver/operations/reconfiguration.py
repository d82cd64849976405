"""Safe reconfiguration: which instances a run declares, and in which state.

A plan says what should run. Going there from what runs now must never drop the capacity that
traffic needs: a new instance serves only after it has booted (minutes: image, weights, CUDA
graphs), and an instance that leaves the plan may still carry traffic its replacement cannot
take yet. So each run (`pulumi up`) declares the plan's instances plus the ones leaving it, each
in one of four states:

| state | in the plan | gets new requests | next run |
|---|---|---|---|
| `starting` | yes | no (booting) | `ready` once its head passes the gateway's health check, else (no report) once `boot_s` has passed since it was declared |
| `ready` | yes | yes | stays `ready` |
| `retiring` | no | yes: its (model, phase) needs it until `starting` ones are ready | `retiring` or `draining` |
| `draining` | no | no: in-flight requests finish | deleted once `drain_s` has passed since it began draining (its node's stop step drains first) |

A decode instance of a disaggregated model starts its vllm-router with its prefill peers'
addresses, which are part of its boot configuration. So when its region's prefill instances
change, it is a new node: its member id is the instance key plus a digest of the peers, the new
one starts, and the old one leaves like any other instance. A prefill instance leaving the plan
stays `retiring` while a serving decode router still sends to it.

An instance leaving the plan becomes `retiring` only while the plan's `ready` capacity of its
(model, phase) is below the demand the plan serves; the largest leaving instances are kept
first, just enough to cover it. Otherwise it goes straight to `draining`. A `draining` instance
is deleted at the next run, so it receives no new requests for one whole interval before its
node is stopped. An instance that comes back into the plan before it is deleted is `ready`
again (it never stopped).

Serving capacity (what the gateway spreads new requests over) is `ready` + `retiring`. Over any
sequence of runs, the capacity of every (model, phase) never falls below the smaller of its
demand and its capacity before the run (tests/operations/test_reconfigure_properties.py).

Readiness comes from health where it can be seen: the gateway health-checks every aggregated
and decode head and publishes which pass (`up`, member ids). With such a report, one of those
members is ready only once its head passes, however long it takes: a slow boot (a large model's
weights) keeps the old capacity serving instead of draining it early. Without a report (no
gateway, nothing published yet) and for prefill members, which the gateway does not front,
readiness falls back to time: `boot_s` after the member was first declared.

A new boot image (an AWS region's AMI, a GCP image) rolls out through the same states
(`rollout_images`): a replica on an older image gets a successor on the new one, under another
member id, and leaves like any instance that leaves the plan, once the successor serves. At most
a share of each (model, phase)'s replicas (`deploy.image_rollout_share`) is replaced at a time;
the next ones start when those successors are ready. A decode replica whose prefill peers were
replaced gets a new router, as for any change of its peers.

The state is pure data (`FleetState`): the Pulumi program exports it and reads it back on the
next run, like the plan.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from solver.io import digest
from solver.plan_schema import Instance, Plan, template_ref
from solver.serving.serving_template import ServingTemplate
from solver.types import FROZEN, Job

State = Literal["starting", "ready", "retiring", "draining"]
SERVING: frozenset[str] = frozenset({"ready", "retiring"})
FRONTED: frozenset[str] = frozenset({"aggregated", "decode"})  # phases the gateway checks


class Member(BaseModel):
    """One declared instance: what it is, its template (to declare it unchanged while it
    leaves), its state, when it was first declared and when it entered its state (UTC), and,
    for a decode instance, the prefill instances its router sends prompts to."""

    model_config = FROZEN
    instance: Instance
    template: ServingTemplate
    state: State
    declared_at: datetime = Field(description="First run that declared it (UTC).")
    since: datetime = Field(description="When it entered its current state (UTC).")
    peers: list[str] = Field(
        default_factory=list, description="Decode: prefill instance keys its router uses."
    )
    image: str | None = Field(
        default=None,
        description="The boot image its nodes were declared with (None: its region's recorded "
        "image, for members declared before images were kept per member).",
    )


class FleetState(BaseModel):
    model_config = FROZEN
    format: Literal[1] = 1
    members: dict[str, Member] = Field(
        description="Member id (the instance key, plus ~<peers digest> for a decode instance "
        "of a disaggregated model) -> member, sorted."
    )

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
    """(model, phase) -> the demand the plan serves (its model's served fraction of it)."""
    return {(j.model, j.phase): j.demand * plan.fraction_of(j.model) for j in plan.jobs}


def router_peers(plan: Plan, inst: Instance) -> list[str]:
    """A decode instance's prefill peers: the plan's prefill instances of its model in its
    region (its vllm-router is started with their addresses). Empty for other phases."""
    if inst.phase != "decode":
        return []
    return sorted(
        i.key
        for i in plan.instances
        if i.phase == "prefill"
        and (i.model, i.cloud, i.region) == (inst.model, inst.cloud, inst.region)
    )


def member_id(key: str, peers: list[str]) -> str:
    """A decode instance with other prefill peers is another node (its router's list is in its
    boot configuration), so it gets another id and replaces the old one safely."""
    return f"{key}~{digest(peers)[:8]}" if peers else key


IMAGE_SEP = "^"  # "<plan key>^<image digest>": a replica's successor on a new boot image


def plan_key(member: str) -> str:
    """The plan instance key a member id stands for (its peers and image suffixes removed)."""
    return member.split("~", 1)[0].split(IMAGE_SEP, 1)[0]


def image_key(key: str, image: str) -> str:
    """The instance key of `key`'s successor on boot image `image`."""
    return f"{plan_key(key)}{IMAGE_SEP}{digest(image)[:8]}"


def _without_peers(m: Member) -> str:
    """A member's instance key as the plan names it this run: its id less a peers digest."""
    return m.instance.key.split("~", 1)[0]


def region_of(inst: Instance) -> str:
    return f"{inst.cloud}:{inst.region}"


def rollout_images(
    plan: Plan,
    previous: FleetState | None,
    target: Mapping[str, str],
    recorded: Mapping[str, str],
    share: float,
) -> tuple[Plan, dict[str, str]]:
    """The plan with each instance keyed by the replica that serves it this run, and the boot
    image of each (see the module doc).

    Args:
        plan: the plan this run deploys.
        previous: the previous run's state (None on a first deploy).
        target: region ("aws:us-east-2") -> the image new replicas boot with.
        recorded: region -> the image the previous run recorded (what a member without an
            image of its own runs).
        share: the most of a (model, phase)'s instances replaced at a time (at least one).

    Returns:
        The plan for `transition` (keys of successors end in ^<image digest>) and instance
        key -> image for every instance of it (regions without a target are left out).
    """
    members = previous.members if previous is not None else {}

    def image(m: Member) -> str | None:
        return m.image or recorded.get(region_of(m.instance))

    by_key: dict[str, list[Member]] = {}
    for mid, m in sorted(members.items()):
        by_key.setdefault(plan_key(mid), []).append(m)
    jobs: dict[Job, list[Instance]] = {}
    for inst in plan.instances:
        jobs.setdefault((inst.model, inst.phase), []).append(inst)
    keys: dict[str, str] = {}
    images: dict[str, str] = {}
    for _, instances in sorted(jobs.items()):
        # Per instance: its replicas on the target image, and the serving ones on another.
        split: dict[str, tuple[list[Member], list[Member]]] = {}
        for inst in instances:
            want, own = target.get(region_of(inst)), by_key.get(inst.key, [])
            split[inst.key] = (
                [m for m in own if want is not None and image(m) == want],
                [m for m in own if want is not None and image(m) != want and m.state != "draining"],
            )
        # Replacements under way (an old replica and its successor both declared) count
        # against the share; the next ones start once those are done.
        budget = max(1, math.floor(share * len(instances)))
        budget -= sum(1 for on_target, old in split.values() if on_target and old)
        for inst in sorted(instances, key=lambda i: i.key):
            want, own = target.get(region_of(inst)), by_key.get(inst.key, [])
            on_target, serving_old = split[inst.key]
            if want is None:
                keys[inst.key] = inst.key
                continue
            if on_target:
                key, img = _without_peers(on_target[0]), want
            elif serving_old and budget <= 0:
                old = serving_old[0]
                key, img = _without_peers(old), image(old) or want
            elif own:  # a successor (an old replica serves, or one drains under the plain key)
                key, img = image_key(inst.key, want), want
                budget -= 1 if serving_old else 0
            else:
                key, img = inst.key, want
            keys[inst.key], images[key] = key, img
    instances = [i.model_copy(update={"key": keys[i.key]}) for i in plan.instances]
    return plan.model_copy(update={"instances": instances}), images


def transition(
    previous: FleetState | None,
    plan: Plan,
    now: datetime,
    boot_s: float,
    drain_s: float = 0,
    up: Collection[str] | None = None,
    images: Mapping[str, str] | None = None,
) -> FleetState:
    """The members a run declares for `plan`, given the previous run's state (see module doc).

    `up`: the member ids whose heads pass the gateway's health check, when the gateway has
    published a report; None without one (readiness then falls back to `boot_s`). `images`:
    instance key -> its boot image (`rollout_images`), recorded on its member."""
    images = images or {}
    before = previous.members if previous is not None else {}

    def booted(m: Member) -> bool:
        if up is not None and m.instance.phase in FRONTED:
            return m.instance.key in up
        return (now - m.declared_at).total_seconds() >= boot_s

    members: dict[str, Member] = {}
    for inst in plan.instances:
        peers = router_peers(plan, inst)
        mid = member_id(inst.key, peers)
        old = before.get(mid)
        declared = old.declared_at if old is not None else now
        state: State = (
            "ready" if old is not None and (old.state in SERVING or booted(old)) else "starting"
        )
        members[mid] = Member(
            instance=inst.model_copy(update={"key": mid}),
            template=plan.templates[template_ref(inst.model, inst.phase, inst.template)],
            state=state,
            declared_at=declared,
            since=old.since if old is not None and old.state == state else now,
            peers=peers,
            image=images.get(inst.key, old.image if old is not None else None),
        )
    ready = FleetState(members=members).capacity(frozenset({"ready"}))
    demand = served_demand(plan)
    leaving = sorted(
        (m for key, m in before.items() if key not in members),
        key=lambda m: (-m.instance.throughput, m.instance.key),
    )
    kept = dict(ready)
    for m in leaving:
        if m.state == "draining":
            if (now - m.since).total_seconds() < drain_s:
                members[m.instance.key] = m  # still finishing what it has in flight
            continue  # drained: deleted
        job = (m.instance.model, m.instance.phase)
        needed = kept.get(job, 0.0) < demand.get(job, 0.0)
        # A leaving instance that never finished booting carries no traffic: nothing to keep.
        serving = m.state in SERVING or booted(m)
        state = "retiring" if needed and serving else "draining"
        if state == "retiring":
            kept[job] = kept.get(job, 0.0) + m.instance.throughput
        members[m.instance.key] = _enter(m, state, now)
    # A prefill instance stays serving while a serving decode router still sends to it.
    used = {p for m in members.values() if m.state in SERVING for p in m.peers}
    for key, m in list(members.items()):
        if m.instance.phase == "prefill" and m.state == "draining" and key in used:
            members[key] = _enter(m, "retiring", now)
    return FleetState(members=dict(sorted(members.items())))


def _enter(m: Member, state: State, now: datetime) -> Member:
    return m if m.state == state else m.model_copy(update={"state": state, "since": now})
