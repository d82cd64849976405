"""Safe reconfiguration through the Pulumi program (mocks), over consecutive runs.

Demand goes up, down, and shifts between two models; runs are 30 minutes apart (boot time 20
minutes). At every run, for every (model, phase): the serving capacity (ready + retiring) is at
least the smaller of the served demand and the capacity before the run; an instance is deleted
only after one run in `draining`; the gateway gives new requests to ready and retiring
instances only.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
from datetime import UTC, datetime, timedelta

import yaml

from coral_iac.bootstrap import slug
from coral_iac.gateway_config import server_name
from solver.operations.reconfiguration import FRONTED, SERVING, FleetState, served_demand
from tests.conftest import REPO

T0 = datetime(2026, 11, 1, tzinfo=UTC)
GPT = {
    "slo_ms": {"prefill": 900, "decode": 30},
    "mean_prompt_tokens": 1500,
    "mean_output_tokens": 13,
    "workload": "Azure Code",
}



def stacks_for(tmp_path, phi: float, gpt: float):
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    fleet = doc["config"]["coral:fleet"]
    fleet["models"]["phi-4"]["demand"] = {"requests_per_s": phi}
    fleet["models"]["gpt-oss-20b"] = GPT | {"demand": {"requests_per_s": gpt}}
    fleet["allocation"] = {"budget_usd_per_hour": 100}
    folder = tmp_path / "stacks"
    folder.mkdir(exist_ok=True)
    (folder / "Pulumi.dev.yaml").write_text(yaml.safe_dump(doc))
    return folder


def gateway_servers(result) -> dict[str, str]:
    """HAProxy server name -> its line, from the configuration parameter the program set."""
    (param,) = [
        r for r in result.of_type("aws:ssm/parameter:Parameter") if r.name == "gateway-config"
    ]
    config = gzip.decompress(base64.b64decode(param.inputs["insecureValue"])).decode()
    return {
        m.group(1): line
        for line in config.splitlines()
        if (m := re.match(r"\s*server (\S+) ", line))
    }


def test_capacity_holds_over_up_down_and_shift(tmp_path, preview):
    # up (a bigger template replaces a smaller one: it retires while the new one boots),
    # settle, down, settle, shift to the other model, settle, settled
    steps = [(1.0, 1.0), (6.0, 1.0), (6.0, 1.0), (0.5, 1.0), (0.5, 1.0)]
    steps += [(0.5, 10.0), (0.5, 10.0), (0.5, 10.0)]
    outputs, previous, previous_nodes = None, None, {}
    seen = set()
    for n, (phi, gpt) in enumerate(steps):
        result = preview(
            "dev",
            stacks_for(tmp_path, phi, gpt),
            previous_outputs=outputs,
            now=T0 + n * timedelta(minutes=30),
        )
        state = FleetState.model_validate_json(result.outputs["fleet_state"])
        serving = state.capacity()
        # The capacity before the run, on this run's yardstick: a member that is still declared
        # counts what this plan's capacity model says of it now (the closed loop re-estimates
        # every instance's capacity at each run; a re-estimate is not a member lost).
        before = {}
        if previous is not None:
            for key, m in previous.members.items():
                if m.state in SERVING:
                    now = state.members.get(key)
                    job = (m.instance.model, m.instance.phase)
                    before[job] = before.get(job, 0.0) + (now or m).instance.throughput
        for job, demand in served_demand(result.plan).items():
            assert serving.get(job, 0.0) >= min(demand, before.get(job, 0.0)) - 1e-9, (n, job)
        # Every GPU node belongs to a declared member; a member disappears only after draining.
        replicas = {
            r.inputs["tags"]["coral:replica"]
            for r in result.of_type("aws:ec2/instance:Instance")
            if "coral:replica" in r.inputs.get("tags", {})
        }
        assert replicas == set(state.members)
        if previous is not None:
            for key in previous.members.keys() - state.members.keys():
                assert previous.members[key].state == "draining", (n, key)
        # The gateway: no new requests to draining instances; the others by weight (a starting
        # one once its health checks pass).
        servers = gateway_servers(result)
        for key, m in state.members.items():
            if m.instance.phase not in ("aggregated", "decode"):
                continue
            line = servers[server_name(key)]
            assert "disabled" not in line, line
            assert (" weight 0" in line) == (m.state == "draining"), line
        # A node that keeps serving is never replaced: its boot configuration is unchanged.
        nodes = {
            r.name: r.inputs["userData"]
            for r in result.of_type("aws:ec2/instance:Instance")
            if "coral:replica" in r.inputs.get("tags", {})
        }
        for key in state.members:
            if previous is not None and key in previous.members:
                for name, data in nodes.items():
                    if name.rsplit(".n", 1)[0] == slug(key):  # its nodes: <id>.n<index>
                        assert previous_nodes[name] == data, (n, name)
        seen |= {m.state for m in state.members.values()}
        outputs, previous, previous_nodes = result.outputs, state, nodes
    # The sequence exercised every state, and the last run settled.
    assert seen == {"starting", "ready", "retiring", "draining"}
    assert set(previous.by_state()["ready"]) == set(previous.members)


def test_a_model_removed_from_the_stack_is_deleted_not_a_crash(tmp_path, preview):
    first = preview("dev", stacks_for(tmp_path, 1.0, 1.0), now=T0)
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    folder = tmp_path / "only-phi"
    folder.mkdir()
    (folder / "Pulumi.dev.yaml").write_text(yaml.safe_dump(doc))
    later = preview(
        "dev", folder, previous_outputs=first.outputs, now=T0 + timedelta(hours=1)
    )
    state = FleetState.model_validate_json(later.outputs["fleet_state"])
    assert {m.instance.model for m in state.members.values()} == {"phi-4"}
    assert not any("gpt-oss-20b" in r.name for r in later.of_type("aws:ec2/instance:Instance"))


def report(state: FleetState, *keys: str) -> str:
    """The gateway's health report listing `keys` (member ids) as passing."""
    return json.dumps({"up": sorted(server_name(k) for k in keys)})


def test_readiness_follows_the_gateways_health_report_not_the_clock(tmp_path, preview):
    # Settled at 1 request/s, then scaled up: the new replicas start, the old ones retire.
    settled = preview("dev", stacks_for(tmp_path, 1.0, 1.0), now=T0)
    settled = preview(
        "dev", stacks_for(tmp_path, 1.0, 1.0), previous_outputs=settled.outputs,
        now=T0 + timedelta(minutes=30),
    )
    up = preview(
        "dev", stacks_for(tmp_path, 6.0, 1.0), previous_outputs=settled.outputs,
        now=T0 + timedelta(hours=1),
    )
    state = FleetState.model_validate_json(up.outputs["fleet_state"])
    # The gateway checks the heads it fronts (aggregated, decode); a P/D model's prefill
    # replicas go by the clock, and the old ones serve while an old decode router uses them.
    new = {k for k in state.by_state()["starting"] if state.members[k].instance.phase in FRONTED}
    old = set(state.by_state()["retiring"])
    assert new and old
    # Two hours later (six boot times) no new head passes /health: nothing new is ready, and
    # the old capacity keeps serving rather than draining.
    later = T0 + timedelta(hours=3)
    waiting = preview(
        "dev", stacks_for(tmp_path, 6.0, 1.0), previous_outputs=up.outputs, now=later,
        health_report=report(state),
    )
    waited = FleetState.model_validate_json(waiting.outputs["fleet_state"])
    assert new <= set(waited.by_state()["starting"])
    assert set(waited.by_state()["retiring"]) == old
    # Once the gateway lists them, they are ready, and the old ones drain.
    passed = preview(
        "dev", stacks_for(tmp_path, 6.0, 1.0), previous_outputs=waiting.outputs,
        now=later + timedelta(minutes=1), health_report=report(waited, *new),
    )
    done = FleetState.model_validate_json(passed.outputs["fleet_state"])
    assert new <= set(done.by_state()["ready"])
    assert set(done.by_state()["draining"]) == old


def test_a_replica_that_passes_health_before_the_boot_time_is_ready_at_once(tmp_path, preview):
    first = preview("dev", stacks_for(tmp_path, 1.0, 1.0), now=T0)
    state = FleetState.model_validate_json(first.outputs["fleet_state"])
    fronted = [k for k, m in state.members.items() if m.instance.phase in ("aggregated", "decode")]
    assert fronted
    # Five minutes later, well within the 20-minute boot time.
    soon = preview(
        "dev", stacks_for(tmp_path, 1.0, 1.0), previous_outputs=first.outputs,
        now=T0 + timedelta(minutes=5), health_report=report(state, *fronted),
    )
    after = FleetState.model_validate_json(soon.outputs["fleet_state"])
    assert all(after.members[k].state == "ready" for k in fronted)
    # Without a report, the same run goes by the clock: still starting.
    blind = preview(
        "dev", stacks_for(tmp_path, 1.0, 1.0), previous_outputs=first.outputs,
        now=T0 + timedelta(minutes=5),
    )
    unseen = FleetState.model_validate_json(blind.outputs["fleet_state"])
    assert all(unseen.members[k].state == "starting" for k in fronted)


def test_the_health_parameter_is_declared_and_the_gateway_may_write_only_it(tmp_path, preview):
    result = preview("dev", stacks_for(tmp_path, 1.0, 1.0), now=T0)
    (health,) = [
        r for r in result.of_type("aws:ssm/parameter:Parameter") if r.name == "gateway-health"
    ]
    assert health.inputs["name"] == "/coral/dev/gateway/health"
    (policy,) = [
        r for r in result.of_type("aws:iam/rolePolicy:RolePolicy") if r.name.startswith("gateway")
    ]
    puts = [
        s["Resource"]
        for s in json.loads(policy.inputs["policy"])["Statement"]
        if s["Action"] == "ssm:PutParameter"
    ]
    assert puts == ["arn:aws:ssm:us-east-2:*:parameter/coral/dev/gateway/health"]
