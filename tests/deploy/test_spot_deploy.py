"""Spot instances as the Pulumi program declares them, and their nodes' interruption handler.

- Under Pulumi's mocks, a hand-made plan (the planner is replaced: no library is built) with
  on-demand and spot instances on AWS and GCP: spot nodes are spot capacity in their plan's
  zone, on-demand nodes are declared exactly as without spot.
- The rendered `coral-node-interruption` run as written against a fake metadata service on
  loopback, with `iptables`, `systemctl`, `sleep` and the drain script as stand-ins that log
  what they are asked, in order, to one events file.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from pathlib import Path

import pulumi
import pytest
import yaml

import coral_iac.preview
import coral_iac.program
from coral_iac.bootstrap import interruption_ports, render_user_data, vllm_units
from coral_iac.components import gcp_label
from coral_iac.engine_args import NodeBoot, RouterSpec
from solver.plan_schema import Instance, Plan, instance_key, template_ref
from tests.conftest import REPO
from tests.deploy.test_bootstrap import HEAD_IP, boots_for, cases, template
from tests.deploy.test_program import nodes_of, stacks_with
from tests.serving.harness import serve_on_loopback

REGIONS = [{"cloud": "aws", "region": "us-east-2"}, {"cloud": "gcp", "region": "us-central1"}]
PHI4 = {
    "slo_ms": {"prefill": 1200, "decode": 60},
    "mean_prompt_tokens": 1020,
    "mean_output_tokens": 129,
    "serving": "aggregated",
    "demand": {"requests_per_s": 1},
}
L4X1 = template("phi-4", "aggregated", ["l4x1"], [(40, 0, [0], 1)])
PRICE = {"aws": 0.8048, "gcp": 0.70683}  # about the catalog's l4x1: only the $/hour shown


def instance(cloud: str, region: str, zone: str | None = None) -> Instance:
    """phi-4 on one l4x1 node; spot in `zone` when one is given (as the planner writes it)."""
    inst = Instance(
        key=instance_key("phi-4", "aggregated", cloud, region, "l4x1", 0),
        model="phi-4",
        phase="aggregated",
        cloud=cloud,
        region=region,
        template="l4x1",
        index=0,
        nodes=["l4x1"],
        usd_per_hour=PRICE[cloud],
        throughput=1.0,
    )
    if zone is None:
        return inst
    key = instance_key("phi-4", "aggregated", cloud, region, "l4x1", 0, zone=zone)
    return inst.model_copy(update={"market": "spot", "zone": zone, "key": key})


def plan_of(instances: list[Instance]) -> Plan:
    cost = sum(i.usd_per_hour for i in instances)
    return Plan(
        stack="spot",
        method="coral",
        mode="vllm",
        served_fraction=1.0,
        hourly_cost_usd=cost,
        startup_penalty_usd_per_hour=0.0,
        cost_by_model={"phi-4": {"aggregated": cost}},
        jobs=[],
        instances=instances,
        templates={template_ref("phi-4", "aggregated", "l4x1"): L4X1},
        binding=[],
        solver=None,
        input_hashes={},
    )


@pytest.fixture
def declare_plan(tmp_path, monkeypatch, preview):
    """Runs the program under mocks on a stack with us-east-2 and us-central1, with `plan` in
    place of what the planner would make."""
    stacks = stacks_with(
        tmp_path, "spot", regions=REGIONS, node_configs=["l4x1"], models={"phi-4": PHI4}
    )

    def run(plan: Plan, not_offered: set[tuple[str, str]] | None = None):
        monkeypatch.setattr(coral_iac.program, "make_plan", lambda *_args, **_kw: plan)
        return preview("spot", stacks, not_offered=not_offered)

    return run


AWS_SPOT, GCP_SPOT = (
    instance("aws", "us-east-2", "use2-az3"),
    instance("gcp", "us-central1", "us-central1-b"),
)
AWS_ON_DEMAND, GCP_ON_DEMAND = instance("aws", "us-east-2"), instance("gcp", "us-central1")


def by_replica(result) -> dict[str, dict]:
    """Replica key -> its one node's inputs (a GCP node's key as its label spells it)."""
    out = {}
    for n in nodes_of(result):
        if "tags" in n.inputs and "coral:replica" in n.inputs["tags"]:
            out[n.inputs["tags"]["coral:replica"]] = n.inputs
        elif "labels" in n.inputs:
            out[n.inputs["labels"]["coral-replica"]] = n.inputs
    return out


def gcp_key(inst: Instance) -> str:
    return gcp_label(inst.key)


def test_spot_nodes_are_spot_capacity_in_their_zone_and_on_demand_ones_unchanged(declare_plan):
    result = declare_plan(plan_of([AWS_ON_DEMAND, AWS_SPOT, GCP_ON_DEMAND, GCP_SPOT]))
    nodes = by_replica(result)
    subnets = {f"{s.name}-id": s.inputs for s in result.of_type("aws:ec2/subnet:Subnet")}

    aws_spot = nodes[AWS_SPOT.key]
    assert aws_spot["instanceMarketOptions"] == {
        "marketType": "spot",
        "spotOptions": {
            "instanceInterruptionBehavior": "terminate",
            "spotInstanceType": "one-time",
        },
    }
    assert aws_spot["tags"]["coral:market"] == "spot"
    assert aws_spot["metadataOptions"]["httpTokens"] == "required"  # the rest as on-demand
    assert aws_spot["rootBlockDevice"]["encrypted"] is True
    subnet = subnets[aws_spot["subnetId"]]
    assert subnet["availabilityZoneId"] == "use2-az3" and "availabilityZone" not in subnet
    assert subnet["cidrBlock"] == "10.0.160.0/20"  # slot 7 + 3: past the zone-letter subnets
    assert "/usr/local/bin/coral-node-interruption" in aws_spot["userData"]

    gcp_spot = nodes[gcp_key(GCP_SPOT)]
    assert gcp_spot["scheduling"] == {
        "provisioningModel": "SPOT",
        "preemptible": True,
        "automaticRestart": False,
        "onHostMaintenance": "TERMINATE",
        "instanceTerminationAction": "DELETE",
    }
    assert gcp_spot["zone"] == "us-central1-b"  # the plan's, not the first that sells l4x1
    assert gcp_spot["labels"]["coral-market"] == "spot"
    assert "/usr/local/bin/coral-node-interruption" in gcp_spot["metadata"]["user-data"]

    aws_od, gcp_od = nodes[AWS_ON_DEMAND.key], nodes[gcp_key(GCP_ON_DEMAND)]
    assert "instanceMarketOptions" not in aws_od and "coral:market" not in aws_od["tags"]
    assert subnets[aws_od["subnetId"]]["availabilityZone"] == "us-east-2a"
    assert subnets[aws_od["subnetId"]]["cidrBlock"] == "10.0.16.0/20"
    assert gcp_od["scheduling"] == {"onHostMaintenance": "TERMINATE", "automaticRestart": True}
    assert gcp_od["zone"] == "us-central1-a" and "coral-market" not in gcp_od["labels"]
    for od in (aws_od["userData"], gcp_od["metadata"]["user-data"]):
        assert "coral-node-interruption" not in od and "coral-interruption" not in od

    # The on-demand nodes' inputs are those of the same plan without its spot instances.
    alone = by_replica(declare_plan(plan_of([AWS_ON_DEMAND, GCP_ON_DEMAND])))
    assert alone == {k: v for k, v in nodes.items() if k in alone}


@pytest.mark.parametrize(
    ("spot", "message"),
    [
        (instance("aws", "us-east-2", "use1-az4"), "use1-az4: .*no spot price for g6.xlarge"),
        (instance("gcp", "us-central1", "us-central1-f"), "no spot price for g2-standard-4"),
        (instance("gcp", "us-central1").model_copy(update={"market": "spot"}), "with no zone"),
    ],
)
def test_a_spot_zone_the_catalog_does_not_price_fails_the_preview(declare_plan, spot, message):
    with pytest.raises(pulumi.RunError, match=message):
        declare_plan(plan_of([spot]))


def test_a_spot_zone_the_account_lacks_or_that_does_not_sell_fails_the_preview(
    declare_plan, monkeypatch
):
    """EC2 has the last word on a catalog's spot zone: its zone IDs in the region, and its
    instance type offerings there (use2-az3 is us-east-2b in the mocked account)."""
    offer = r"use2-az3 of aws:us-east-2 \(us-east-2b in this account\) does not offer g6.xlarge"
    with pytest.raises(pulumi.RunError, match=offer):
        declare_plan(plan_of([AWS_SPOT]), not_offered={("g6.xlarge", "us-east-2b")})
    monkeypatch.setattr(coral_iac.preview, "_zone_id_prefix", lambda region: "other")
    ids = r"use2-az3 is not an availability zone of aws:us-east-2 \(its zone IDs: other-az1, "
    with pytest.raises(pulumi.RunError, match=ids):
        declare_plan(plan_of([AWS_SPOT]))


# ------------------------------------------------------------ the interruption handler

NOTICE = '{"action": "terminate", "time": "2026-11-01T00:02:00Z"}'
TOKEN = "imds-session-token"


class FakeMetadata:
    """A spot node's metadata service on loopback. AWS: IMDSv2, a token from PUT
    /latest/api/token, required on GET /latest/meta-data/spot/instance-action, which answers
    404, then (after `quiet` polls) 200 with a notice. GCP: GET
    /computeMetadata/v1/instance/preempted with Metadata-Flavor: Google, FALSE then TRUE. Each
    poll's answer goes to the events file before it is sent."""

    def __init__(self, cloud: str, quiet: int | None, events: Path) -> None:
        self.puts = self.polls = 0
        lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, status: int, body: str = "") -> None:
                self.send_response(status)
                self.end_headers()
                self.wfile.write(body.encode())

            def _poll(self) -> bool:
                with lock:
                    outer.polls += 1
                    notice = quiet is not None and outer.polls > quiet
                    with events.open("a") as f:
                        f.write("metadata notice\n" if notice else "metadata none\n")
                return notice

            def do_PUT(self) -> None:  # noqa: N802 (http.server's name)
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if cloud != "aws" or self.path != "/latest/api/token" or not ttl:
                    return self._send(400)
                outer.puts += 1
                self._send(200, TOKEN)

            def do_GET(self) -> None:  # noqa: N802
                if cloud == "aws":
                    if self.path != "/latest/meta-data/spot/instance-action":
                        return self._send(404)
                    if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                        return self._send(401)
                    return self._send(200, NOTICE) if self._poll() else self._send(404)
                if self.path != "/computeMetadata/v1/instance/preempted":
                    return self._send(404)
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403)
                self._send(200, "TRUE" if self._poll() else "FALSE")

            def log_message(self, *_args: object) -> None:
                pass

        self.server, self.url = serve_on_loopback(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def stand_ins(folder: Path, events: Path) -> tuple[Path, Path]:
    """`iptables`, `systemctl` and `sleep` on a PATH folder, and the drain script, each
    appending its argv to `events` (the drain also its CORAL_DRAIN_SECONDS). `sleep` returns
    at once; its TERM_AFTER-th call sends SIGTERM to its caller, as systemd stopping the
    handler would."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    scripts = {
        bin_dir / "iptables": f'echo "iptables $*" >> {events}',
        bin_dir / "systemctl": f'echo "systemctl $*" >> {events}',
        bin_dir / "sleep": f"""echo "sleep $*" >> {events}
if [ -n "${{TERM_AFTER:-}}" ] && [ "$(grep -c '^sleep' {events})" -ge "${{TERM_AFTER}}" ]; then
  kill -TERM "${{PPID}}"
fi""",
        folder / "coral-node-drain": (
            f'echo "drain $* CORAL_DRAIN_SECONDS=${{CORAL_DRAIN_SECONDS:-unset}}" >> {events}'
        ),
    }
    for path, body in scripts.items():
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return bin_dir, folder / "coral-node-drain"


def run_handler(
    boot: NodeBoot, tmp_path: Path, quiet: int | None, term_after: int = 20
) -> tuple[subprocess.CompletedProcess[str], list[str], FakeMetadata]:
    """The node's rendered handler, run until it exits (stopped at the latest by SIGTERM at
    its `term_after`-th sleep): its stderr, the events in order, and the metadata service it
    asked."""
    events = tmp_path / "events"
    events.touch()
    bin_dir, drain = stand_ins(tmp_path, events)
    files = yaml.safe_load(render_user_data(boot, "" if boot.is_head else HEAD_IP))["write_files"]
    (script,) = [
        w["content"] for w in files if w["path"] == "/usr/local/bin/coral-node-interruption"
    ]
    metadata = FakeMetadata(boot.cloud, quiet, events)
    try:
        for base in ("http://169.254.169.254", "http://metadata.google.internal"):
            script = script.replace(base, metadata.url)  # as tests/serving/harness.py does
        script = script.replace("/usr/local/bin/coral-node-drain", str(drain))
        env = os.environ | {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "TERM_AFTER": str(term_after),
        }
        r = subprocess.run(
            ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60
        )
    finally:
        metadata.close()
    return r, events.read_text().splitlines(), metadata


def spot(boots: list[NodeBoot]) -> list[NodeBoot]:
    return [b.model_copy(update={"market": "spot"}) for b in boots]


def handler_cases() -> dict[str, tuple[NodeBoot, int, int, list[str]]]:
    """Case -> (spot head node, the port it closes, its drain deadline, its units)."""
    (aggregated,) = spot(cases()["single-node"])
    prefill, _ = spot(cases()["disaggregated-prefill"])
    prefill = prefill.model_copy(update={"cloud": "gcp", "region": "us-central1"})
    router = RouterSpec(
        prefill_urls=[f"http://{HEAD_IP}:8100"], decode_urls=["http://127.0.0.1:8200"]
    )
    decode = template("qwen3-32b", "decode", ["l40sx4"], [(64, 0, [0, 1, 2, 3], 4)])
    (decode_head,) = [  # api_port 8443: the router's port, apart from decode vLLM's 8200
        b.model_copy(update={"router": router})
        for b in boots_for(decode, True, api_port=8443, seqs=96, market="spot")
    ]
    return {
        "aws-aggregated": (aggregated, 8000, 90, ["coral-vllm@0.service"]),
        "gcp-prefill": (prefill, 8100, 20, ["coral-vllm@0.service"]),
        "aws-decode-router": (
            decode_head,
            8443,
            90,
            ["coral-vllm@0.service", "coral-vllm@router.service"],
        ),
    }


def reject_rule(port: int) -> str:
    return (
        f"iptables -w 5 -I INPUT ! -i lo -p tcp --dport {port} -m conntrack --ctstate NEW "
        "-j REJECT --reject-with tcp-reset"
    )


@pytest.mark.parametrize("case", sorted(handler_cases()))
def test_the_handler_acts_once_on_the_notice(tmp_path, case):
    """No step before the notice; then the reject rule for the node's port, the drain with the
    cloud's shorter deadline and the units stopped, in that order, once, and the handler
    exits (it asks no more)."""
    boot, port, drain_s, units = handler_cases()[case]
    r, events, metadata = run_handler(boot, tmp_path, quiet=3)
    assert r.returncode == 0, r.stderr
    first = events.index("metadata notice")
    assert events[:first] == ["metadata none", "sleep 5"] * 3, events
    assert events[first + 1 :] == [
        reject_rule(port),
        f"drain 0 CORAL_DRAIN_SECONDS={drain_s}",
        f"systemctl stop {' '.join(units)}",
    ], events
    assert metadata.polls == 4
    if boot.cloud == "aws":  # IMDSv2: a token for every poll (a GET without one gets 401)
        assert metadata.puts == metadata.polls
    assert "coral-node-interruption: notice: " in r.stderr
    assert (NOTICE if boot.cloud == "aws" else "instance/preempted is TRUE") in r.stderr


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_no_notice_no_action(tmp_path, cloud):
    """With no notice the handler only polls; stopped by systemd (a shutdown, a reboot) it
    asks once more, finds none and exits without touching the node."""
    (boot,) = spot(cases()["single-node"])
    boot = boot.model_copy(update={"cloud": cloud})
    r, events, metadata = run_handler(boot, tmp_path, quiet=None, term_after=4)
    assert r.returncode == 0, r.stderr
    assert events == ["metadata none", "sleep 5"] * 4 + ["metadata none"], events
    assert "stopped with no interruption notice" in r.stderr
    assert metadata.polls == 5


def test_a_shutdown_on_the_notice_still_takes_the_node_out(tmp_path):
    """GCE's preemption is also an ACPI soft-off, so systemd may stop the handler between two
    polls: it asks once more on SIGTERM and, with the notice there, acts once."""
    boot, port, drain_s, units = handler_cases()["gcp-prefill"]
    r, events, _ = run_handler(boot, tmp_path, quiet=2, term_after=2)
    assert r.returncode == 0, r.stderr
    assert events == ["metadata none", "sleep 5", "metadata none", "sleep 5", "metadata notice",
                      reject_rule(port), f"drain 0 CORAL_DRAIN_SECONDS={drain_s}",
                      f"systemctl stop {' '.join(units)}"], events  # fmt: skip


def test_a_node_without_the_api_closes_no_port():
    """A pipeline's other nodes serve no HTTP: their ranks talk to the head until the end."""
    head, other = spot(cases()["uniform-tp-multi-node"])
    assert interruption_ports(head) == [8000] and interruption_ports(other) == []
    assert vllm_units(other) == ["coral-vllm@0.service"]
    script = render_user_data(other, HEAD_IP)
    assert "iptables" not in script.split("coral-node-interruption\n", 1)[1].split("act() {")[0]
    assert "no port to close" in script


@pytest.mark.parametrize("market", ["on-demand", "spot"])
def test_only_a_spot_nodes_drain_takes_a_shorter_deadline(tmp_path, market):
    """The handler lowers CORAL_DRAIN_SECONDS, which node.env sets: on a spot node the caller's
    value wins (0: the drain returns before asking vLLM anything); an on-demand node's drain
    keeps node.env's, as before spot existed (it asks /metrics, whose stand-in fails)."""
    (boot,) = cases()["single-node"]
    boot = boot.model_copy(update={"market": market})
    files = yaml.safe_load(render_user_data(boot, ""))["write_files"]
    (drain,) = [w["content"] for w in files if w["path"] == "/usr/local/bin/coral-node-drain"]
    env_file = tmp_path / "node.env"
    env_file.write_text("CORAL_IS_HEAD=1\nCORAL_HTTP_PORT=8000\nCORAL_DRAIN_SECONDS=120\n")
    (tmp_path / "curl").write_text(f"#!/bin/sh\necho curl >> {tmp_path / 'calls'}\nexit 7\n")
    (tmp_path / "curl").chmod(0o755)
    env = os.environ | {"PATH": f"{tmp_path}:{os.environ['PATH']}", "CORAL_DRAIN_SECONDS": "0"}
    script = drain.replace("/etc/coral/node.env", str(env_file))
    r = subprocess.run(
        ["bash", "-c", script, "drain", "0"], capture_output=True, text=True, env=env, timeout=30
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").exists() == (market == "on-demand")


def test_the_committed_on_demand_golden_files_have_no_handler():
    for path in (REPO / "tests" / "golden" / "bootstrap").glob("*/node*.yaml"):
        spot_case = path.parent.name.startswith("spot-")
        assert ("coral-node-interruption" in path.read_text()) == spot_case, path
