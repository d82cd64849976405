"""Safe reconfiguration over sequences of demand changes, with real plans of the small fleet.

At every run, every (model, phase) keeps serving capacity (ready + retiring) of at least the
smaller of its served demand and what served it before the run; new instances serve only once
booted; draining ones get no traffic and are gone the run after.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.operations.reconfiguration import (
    FleetState,
    member_id,
    plan_key,
    rollout_images,
    router_peers,
    served_demand,
    transition,
)
from solver.plan.planner import plan_stack
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf

START = datetime(2026, 11, 1, tzinfo=UTC)
BOOT = timedelta(minutes=15)


def plan_for(scales: dict[str, float], previous=None):
    models = {
        m: spec | {"demand": {"requests_per_s": spec["demand"]["requests_per_s"] * scales[m]}}
        for m, spec in SMALL_FLEET["models"].items()
    }
    return plan_stack("test", fleet(models=models), perf().catalog, libraries(), previous)


def scale_for(model: str, phase: str, template: str, instances: float) -> float:
    """Demand scale of `model` at which its `phase` demand is `instances` x the throughput of
    `template` in its library, read from the current performance model (not a bare number)."""
    (t,) = [t for t in libraries()[(model, phase)].templates if t.key == template]
    spec = SMALL_FLEET["models"][model]
    per_request = spec["mean_prompt_tokens" if phase == "prefill" else "mean_output_tokens"]
    return float(instances * t.throughput / per_request / spec["demand"]["requests_per_s"])


def run(steps: list[tuple[dict[str, float], timedelta]]):
    """Plan and transition once per (demand scales, time since the last run)."""
    now, plan, state = START, None, None
    out = []
    for scales, gap in steps:
        now += gap
        plan = plan_for(scales, plan)
        state = transition(state, plan, now, BOOT.total_seconds())
        out.append((plan, state))
    return out


def ids(plan) -> set[str]:
    """The member ids of a plan's instances."""
    return {member_id(i.key, router_peers(plan, i)) for i in plan.instances}


def check(history: list[tuple[object, FleetState]]) -> None:
    before: dict[tuple[str, str], float] = {}
    previous: FleetState | None = None
    for plan, state in history:
        serving = state.capacity()
        for job, demand in served_demand(plan).items():  # type: ignore[arg-type]
            floor = min(demand, before.get(job, 0.0))
            assert serving.get(job, 0.0) >= floor - 1e-9, (job, serving, demand, before)
        keys = ids(plan)
        for key, m in state.members.items():
            assert (key in keys) == (m.state in ("starting", "ready"))
            if previous is not None and key in previous.members:
                # nothing that was draining comes back as serving unless the plan wants it
                if previous.members[key].state == "draining":
                    assert key in keys
        if previous is not None:
            for key, m in previous.members.items():
                if m.state == "draining" and key not in keys:
                    assert key not in state.members  # deleted one run after it drained
        before, previous = serving, state


scale = st.sampled_from([0.5, 1.0, 1.5, 2.5])
gap = st.sampled_from([timedelta(minutes=5), timedelta(minutes=30)])


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.lists(st.tuples(scale, scale, gap), min_size=2, max_size=4))
def test_capacity_never_drops_below_demand(steps):
    history = run([({"phi-4": a, "gpt-oss-20b": b}, g) for a, b, g in steps])
    check(history)


def test_up_down_and_shift_between_models():
    """Up, down, and demand moving from one model to the other, runs 30 min apart.

    phi-4's levels are read from its l40sx1 prefill template, so "up" needs a second prefill
    instance whatever the model's throughputs are, and "down" fits in one (surplus to drain).
    """
    half = timedelta(minutes=30)
    up = scale_for("phi-4", "prefill", "l40sx1", 1.5)
    down = scale_for("phi-4", "prefill", "l40sx1", 0.5)
    history = run(
        [
            ({"phi-4": 1.0, "gpt-oss-20b": 1.0}, half),
            ({"phi-4": up, "gpt-oss-20b": 1.0}, half),  # up
            ({"phi-4": up, "gpt-oss-20b": 1.0}, half),  # starting ones become ready
            ({"phi-4": down, "gpt-oss-20b": 1.0}, half),  # down: surplus drains
            ({"phi-4": down, "gpt-oss-20b": 1.0}, half),  # drained ones are deleted
            ({"phi-4": down, "gpt-oss-20b": 2.5}, half),  # shift to the other model
        ]
    )
    check(history)
    prefills = [
        sum(i.model == "phi-4" and i.phase == "prefill" for i in p.instances) for p, _ in history
    ]
    assert prefills[1] >= 2 and prefills[3] == 1  # the levels did what they are read for
    states = [s.by_state() for _, s in history]
    assert states[0]["starting"] and not states[0]["ready"]  # a new fleet boots first
    assert states[1]["starting"] and states[1]["ready"]  # scale-up: old serve, new boot
    assert not states[2]["starting"]
    assert states[3]["draining"] and not states[3]["starting"]  # scale-down: no boot wait
    assert not states[4]["draining"] and not states[4]["retiring"]
    assert history[4][1].members.keys() == ids(history[4][0])


def test_a_replacement_keeps_the_old_instance_serving_until_it_has_booted():
    """A plan that swaps instances keeps the old ones retiring while the new ones start."""
    first = plan_for({"phi-4": 1.0, "gpt-oss-20b": 1.0})
    state = transition(None, first, START, BOOT.total_seconds())
    state = transition(state, first, START + timedelta(hours=1), BOOT.total_seconds())
    assert set(state.by_state()["ready"]) == set(state.members)
    # The same demand served by other instances (the old ones are not in the new plan).
    swapped = first.model_copy(
        update={
            "instances": [
                i.model_copy(update={"key": i.key + "-new", "index": i.index + 100})
                for i in first.instances
            ]
        }
    )
    later = START + timedelta(hours=2)
    state2 = transition(state, swapped, later, BOOT.total_seconds())
    by = state2.by_state()
    assert len(by["starting"]) == len(first.instances)
    assert set(by["retiring"]) == ids(first)
    assert state2.capacity() == pytest.approx(state.capacity())
    state3 = transition(state2, swapped, later + BOOT, BOOT.total_seconds())
    assert set(state3.by_state()["draining"]) == ids(first)
    state4 = transition(state3, swapped, later + 2 * BOOT, BOOT.total_seconds())
    assert set(state4.members) == ids(swapped)
    assert state4.hourly_cost_usd() == pytest.approx(swapped.hourly_cost_usd)


def test_new_prefill_peers_make_a_new_decode_node_and_keep_the_old_pair_serving():
    """Adding a prefill instance changes the decode routers' peer lists: each decode instance
    becomes a new node (starting) while the old one, and the prefill instances it sends to,
    keep serving; a draining instance is deleted only after `drain_s`."""
    first = plan_for({"phi-4": 1.0, "gpt-oss-20b": 1.0})
    state = transition(None, first, START, BOOT.total_seconds())
    state = transition(state, first, START + timedelta(hours=1), BOOT.total_seconds())
    prefill = next(i for i in first.instances if i.phase == "prefill")
    extra = prefill.model_copy(update={"key": prefill.key + "-extra", "index": 99})
    bigger = first.model_copy(update={"instances": [*first.instances, extra]})
    t = START + timedelta(hours=2)
    state2 = transition(state, bigger, t, BOOT.total_seconds(), drain_s=600)
    by = state2.by_state()
    decode_of_model = [
        k
        for k, m in state.members.items()
        if m.instance.phase == "decode"
        and m.instance.model == prefill.model
        and m.instance.region == prefill.region
    ]
    assert decode_of_model and set(decode_of_model) <= set(by["retiring"])
    assert extra.key in by["starting"]
    assert sum(1 for k in by["starting"] if "~" in k) == len(decode_of_model)
    assert state2.capacity() == pytest.approx(state.capacity())
    # Booted: the old decode nodes drain; not deleted before drain_s has passed.
    state3 = transition(state2, bigger, t + BOOT, BOOT.total_seconds(), drain_s=600)
    assert set(decode_of_model) <= set(state3.by_state()["draining"])
    state4 = transition(
        state3, bigger, t + BOOT + timedelta(seconds=300), BOOT.total_seconds(), drain_s=600
    )
    assert set(decode_of_model) <= set(state4.by_state()["draining"])
    state5 = transition(
        state4, bigger, t + BOOT + timedelta(seconds=600), BOOT.total_seconds(), drain_s=600
    )
    assert not set(decode_of_model) & set(state5.members)
    assert set(state5.members) == ids(bigger)


def test_a_leaving_prefill_instance_serves_while_an_old_router_still_uses_it():
    first = plan_for({"phi-4": 1.0, "gpt-oss-20b": 1.0})
    prefill = next(i for i in first.instances if i.phase == "prefill")
    extra = prefill.model_copy(update={"key": prefill.key + "-extra", "index": 99})
    two = first.model_copy(update={"instances": [*first.instances, extra]})
    state = transition(None, two, START, BOOT.total_seconds())
    state = transition(state, two, START + timedelta(hours=1), BOOT.total_seconds())
    state2 = transition(state, first, START + timedelta(hours=2), BOOT.total_seconds())
    # The old decode routers retire while their replacements boot, and still use `extra`.
    assert state2.members[extra.key].state == "retiring"
    state3 = transition(state2, first, START + timedelta(hours=3), BOOT.total_seconds())
    assert state3.members[extra.key].state == "draining"  # no serving router uses it now


def run_with_images(steps: list[tuple[dict[str, float], str, timedelta]], share: float):
    """`run`, each step with a boot image for every region, rolled out by `rollout_images`;
    the images the previous step's replicas run count as recorded."""
    now, plan, state = START, None, None
    out = []
    for scales, image, gap in steps:
        now += gap
        plan = plan_for(scales, plan)
        regions = sorted({f"{i.cloud}:{i.region}" for i in plan.instances})
        target = dict.fromkeys(regions, image)
        rolling, images = rollout_images(plan, state, target, {}, share)
        state = transition(state, rolling, now, BOOT.total_seconds(), images=images)
        out.append((plan, image, state))
    return out


def upgrading(state: FleetState, image: str) -> dict[tuple[str, str], int]:
    """(model, phase) -> replicas being replaced: a successor on `image` declared beside an
    older replica of the same instance."""
    by_key: dict[str, set[str | None]] = {}
    for key, m in state.members.items():
        by_key.setdefault(plan_key(key), set()).add(m.image)
    out: dict[tuple[str, str], int] = {}
    for key, m in state.members.items():
        if m.image == image and m.state == "starting" and by_key[plan_key(key)] - {image}:
            job = (m.instance.model, m.instance.phase)
            out[job] = out.get(job, 0) + 1
    return out


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(scale, scale, st.sampled_from(["ami-a", "ami-b", "ami-c"]), gap),
             min_size=2, max_size=4),
    st.sampled_from([0.25, 0.5, 1.0]),
)  # fmt: skip
def test_images_roll_out_without_dropping_capacity(steps, share):
    """Whatever the demands and images: serving capacity never falls below the smaller of
    demand and what served before; at most `share` of a (model, phase)'s replicas (at least
    one) are being replaced at once; and after some runs on one image, every replica runs it
    and nothing else is declared."""
    last = steps[-1][2]
    settle = [({"phi-4": 1.0, "gpt-oss-20b": 1.0}, last, timedelta(minutes=30))] * 8
    history = run_with_images([({"phi-4": a, "gpt-oss-20b": b}, im, g) for a, b, im, g in steps]
                              + settle, share)  # fmt: skip
    before: dict[tuple[str, str], float] = {}
    for plan, image, state in history:
        serving = state.capacity()
        for job, demand in served_demand(plan).items():
            assert serving.get(job, 0.0) >= min(demand, before.get(job, 0.0)) - 1e-9
        for job, n in upgrading(state, image).items():
            replicas = sum((i.model, i.phase) == job for i in plan.instances)
            assert n <= max(1, int(share * replicas)), (job, n, replicas)
        before = serving
    plan, _, state = history[-1]
    assert {m.image for m in state.members.values()} == {last}
    assert set(state.by_state()["ready"]) == set(state.members)
    assert len(state.members) == len(plan.instances)


def test_a_new_image_replaces_a_quarter_of_the_replicas_at_a_time():
    """Four phi-4 prefill replicas on ami-a, then ami-b with share 0.25: one successor boots
    per run while the other three and the one it replaces keep serving; four waves later all
    four run ami-b."""
    four = scale_for("phi-4", "prefill", "l40sx1", 3.9)
    half = timedelta(minutes=30)
    steps = [({"phi-4": four, "gpt-oss-20b": 1.0}, "ami-a", half)] * 2
    steps += [({"phi-4": four, "gpt-oss-20b": 1.0}, "ami-b", half)] * 10
    history = run_with_images(steps, 0.25)
    plan = history[-1][0]
    job = ("phi-4", "prefill")
    n = sum((i.model, i.phase) == job for i in plan.instances)
    assert n >= 4
    waves = [upgrading(state, image).get(job, 0) for _, image, state in history]
    assert waves[:2] == [0, 0] and max(waves) == 1  # one at a time
    assert sum(w > 0 for w in waves) >= n  # a wave per replica
    check_capacity = [s.capacity().get(job, 0.0) for _, _, s in history]
    assert min(check_capacity[1:]) >= check_capacity[1] - 1e-9
    final = history[-1][2]
    on_b = [m for m in final.members.values() if m.instance.model == "phi-4"]
    assert {m.image for m in on_b} == {"ami-b"} and len(final.members) == len(plan.instances)
