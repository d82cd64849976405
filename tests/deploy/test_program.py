"""The Pulumi program under Pulumi's own mocks (real SDK and provider types, no CLI or cloud)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pulumi
import pytest
import yaml

from solver.operations.reconfiguration import member_id, router_peers
from solver.performance.default_model import load_perf_model
from tests.conftest import REPO

PERF = load_perf_model()



def stacks_with(tmp_path: Path, name: str, base: str = "dev", **fleet_changes) -> Path:
    """A stacks folder holding `base` under `name`, with top-level coral:fleet keys replaced."""
    doc = yaml.safe_load((REPO / "stacks" / f"Pulumi.{base}.yaml").read_text())
    fleet = doc["config"]["coral:fleet"]
    for key, value in fleet_changes.items():
        fleet[key] = value
    folder = tmp_path / "stacks"
    folder.mkdir(exist_ok=True)
    (folder / f"Pulumi.{name}.yaml").write_text(yaml.safe_dump(doc))
    return folder


def nodes_of(result):
    return result.of_type("aws:ec2/instance:Instance") + result.of_type(
        "gcp:compute/instance:Instance"
    )


def test_every_planned_node_is_declared_as_specified(tmp_path, preview):
    result = preview("dev", REPO / "stacks")
    plan = result.plan
    expected = sum(len(i.nodes) for i in plan.instances)
    aws_nodes = [  # GPU nodes; the gateway VM is tested in test_gateway.py
        n
        for n in result.of_type("aws:ec2/instance:Instance")
        if "coral:replica" in n.inputs["tags"]
    ]
    assert len(aws_nodes) == expected > 0
    providers = {r.name: r for r in result.of_type("pulumi:providers:aws")}
    assert {p.inputs["region"] for p in providers.values()} == {"us-east-2"}
    by_replica = {}
    for node in aws_nodes:
        tags = node.inputs["tags"]
        by_replica.setdefault(tags["coral:replica"], []).append(node)
        assert {"coral:stack", "coral:model", "coral:phase", "coral:template", "coral:node"} <= set(
            tags
        )
        assert tags["coral:stack"] == "dev"
        assert node.inputs["ami"] == "ami-0mock0dlami0gpu"  # from the per-region SSM lookup
        assert node.inputs["metadataOptions"]["httpTokens"] == "required"  # IMDSv2
        disk = node.inputs["rootBlockDevice"]
        assert disk["encrypted"] is True
        weights = PERF.card(tags["coral:model"]).weight_bytes / 1e9
        assert disk["volumeSize"] >= weights
        assert node.provider and "aws-us-east-2" in node.provider
        assert node.inputs["userData"].startswith("#cloud-config")
        # vLLM's batches are capped at the SLO-feasible sizes the plan assumed
        cap = "--max-num-seqs" if tags["coral:phase"] == "decode" else "--max-num-batched-tokens"
        assert cap in node.inputs["userData"]
    for inst in plan.instances:
        # a decode node's id carries its router's prefill peers (solver/reconfigure.py)
        declared = by_replica[member_id(inst.key, router_peers(plan, inst))]
        assert sorted(n.inputs["instanceType"] for n in declared) == sorted(
            next(o for o in PERF.catalog.offers_for(n) if o.region == inst.region).instance_type
            for n in inst.nodes
        )
    ssm = result.outputs["hourly_cost_usd"]  # the nodes and the gateway's priced items
    assert ssm == pytest.approx(plan.hourly_cost_usd + result.outputs["gateway_hourly_cost_usd"])
    assert set(result.outputs["endpoints"]) == {"phi-4"}


def test_nothing_is_open_to_the_world_but_the_api_port(tmp_path, preview):
    stacks = stacks_with(
        tmp_path, "open", deploy={"api_cidrs": ["203.0.113.0/24"], "api_port": 8443}
    )
    result = preview("open", stacks)
    groups = result.of_type("aws:ec2/securityGroup:SecurityGroup")
    assert groups
    for g in groups:
        for rule in g.inputs.get("ingress", []):
            if rule.get("cidrBlocks"):
                assert rule["fromPort"] == rule["toPort"] == 8443 and rule["protocol"] == "tcp"
                assert rule["cidrBlocks"] == ["203.0.113.0/24"]
            else:  # only the model's own nodes, or the gateway on the API port
                assert rule.get("self") is True or (
                    rule["securityGroups"] == ["gateway-sg-id"] and rule["fromPort"] == 8443
                )
        assert not any(r.get("fromPort") == 22 for r in g.inputs.get("ingress", []))


def test_gcp_nodes_and_firewalls(tmp_path, preview):
    stacks = stacks_with(
        tmp_path,
        "g",
        regions=[{"cloud": "gcp", "region": "us-central1"}],
        node_configs=["l4x1", "l4x4", "a100-80gbx1"],
        deploy={"api_cidrs": ["198.51.100.0/24"]},
        allocation={"budget_usd_per_hour": 40},  # GCP prices; capacity at the SLO target
    )
    result = preview("g", stacks)
    nodes = result.of_type("gcp:compute/instance:Instance")
    assert len(nodes) == sum(len(i.nodes) for i in result.plan.instances) > 0
    for n in nodes:
        assert n.inputs["scheduling"]["onHostMaintenance"] == "TERMINATE"
        assert n.inputs["metadata"]["user-data"].startswith("#cloud-config")
        assert n.inputs["bootDisk"]["initializeParams"]["image"].startswith(
            "projects/deeplearning-platform-release/global/images/family/"
        )
        assert len(n.inputs["name"]) <= 63
        assert "CORAL_HF_TOKEN_SECRET=coral-hf-token" in n.inputs["metadata"]["user-data"]
    (member,) = result.of_type("gcp:secretmanager/secretIamMember:SecretIamMember")
    assert member.inputs["secretId"] == "coral-hf-token"  # the same secret the nodes read
    for fw in result.of_type("gcp:compute/firewall:Firewall"):
        if fw.inputs.get("sourceRanges"):
            assert fw.inputs["sourceRanges"] == ["198.51.100.0/24"]
            assert fw.inputs["allows"] == [{"protocol": "tcp", "ports": ["8000"]}]
        else:
            assert fw.inputs["sourceTags"] == fw.inputs["targetTags"]


def test_user_data_never_holds_the_token(tmp_path, monkeypatch, preview):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET_VALUE_1234")
    pulumi.runtime.set_all_config({"coral:hfToken": "hf_SECRET_VALUE_1234"}, ["coral:hfToken"])
    result = preview("dev", REPO / "stacks")
    for n in nodes_of(result):
        assert "hf_SECRET_VALUE_1234" not in json.dumps(n.inputs)


def declared(result) -> dict:
    """(type, name) -> inputs of every resource but the stack's reference to itself."""
    return {
        (r.type, r.name): r.inputs
        for r in result.resources
        if r.type != "pulumi:pulumi:StackReference"
    }


T0 = datetime(2026, 11, 1, tzinfo=UTC)


def test_second_run_with_previous_outputs_changes_nothing(preview):
    """A rerun changes nothing, before the new fleet has booted and after (starting
    instances already get requests once their health checks pass)."""
    stacks = REPO / "stacks"
    first = preview("dev", stacks, now=T0)
    second = preview("dev", stacks, previous_outputs=first.outputs, now=T0)
    assert declared(first) == declared(second)
    assert len(first.resources) == len(second.resources)
    assert set(second.outputs["instances_by_state"]["starting"]) == {
        member_id(i.key, router_peers(first.plan, i)) for i in first.plan.instances
    }
    booted = T0 + timedelta(hours=1)
    third = preview("dev", stacks, previous_outputs=second.outputs, now=booted)
    assert declared(third) == declared(second)
    assert set(third.outputs["instances_by_state"]["ready"]) == set(
        second.outputs["instances_by_state"]["starting"]
    )


def test_demand_increase_only_adds_resources(tmp_path, preview):
    """With `allocation.add_only`, a demand increase (1.5x what the first plan's prefill serves,
    read from the plan) declares new resources and leaves every existing one as it was. Without
    it a re-plan may replace instances (docs/allocation.md), so the option is what is tested."""
    first = preview("dev", REPO / "stacks")
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    fleet = doc["config"]["coral:fleet"]
    models, allocation = fleet["models"], fleet["allocation"]
    prefill = [i for i in first.plan.instances if i.model == "phi-4" and i.phase == "prefill"]
    served = sum(i.throughput for i in prefill) / models["phi-4"]["mean_prompt_tokens"]
    models["phi-4"]["demand"] = {"requests_per_s": 1.5 * served}
    stacks = stacks_with(tmp_path, "dev", models=models, allocation=allocation | {"add_only": True})
    more = preview("dev", stacks, previous=first.plan)
    before = {
        (r.type, r.name): r.inputs
        for r in first.resources
        if r.type != "pulumi:pulumi:StackReference"
    }
    after = {
        (r.type, r.name): r.inputs
        for r in more.resources
        if r.type != "pulumi:pulumi:StackReference"
    }
    assert set(before) < set(after)
    for key, inputs in before.items():
        if key == ("aws:ssm/parameter:Parameter", "gateway-config"):
            continue  # the gateway's configuration gains the new upstreams (test_gateway.py)
        assert after[key] == inputs, f"{key} changed"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"library": {"n_max": 4, "rho": 12, "mode": "general"}}, "only 'vllm' placements"),
        ({"allocation": {"budget_usd_per_hour": 1}}, "exceeds the budget"),
        ({"deploy": {"api_cidrs": ["not-a-cidr"]}}, "api_cidrs"),
        ({"node_configs": ["l4x1"]}, "serves none of the demand"),
    ],
)
def test_bad_config_or_unrunnable_plan_fails_the_preview(tmp_path, changes, message, preview):
    name = f"bad-{abs(hash(json.dumps(changes, sort_keys=True))) % 10**8}"
    stacks = stacks_with(tmp_path, name, **changes)
    with pytest.raises(Exception, match=message):
        preview(name, stacks)


def test_a_stale_library_is_refused_unless_rebuild_is_asked(tmp_path, preview):
    preview("stale", stacks_with(tmp_path, "stale"))
    changed = stacks_with(tmp_path, "stale", node_configs=["l4x1", "l4x4", "l40sx1"])
    with pytest.raises(Exception, match="stale library: input.* changed.*node_configs"):
        preview("stale", changed)
    rebuilt = stacks_with(
        tmp_path, "stale", node_configs=["l4x1", "l4x4", "l40sx1"], deploy={"rebuild_library": True}
    )
    assert preview("stale", rebuilt).plan.served_fraction == 1


def test_region_networks_do_not_renumber_when_the_plan_uses_fewer_regions(tmp_path, preview):
    """A region's CIDR comes from its place in coral:fleet.regions, not from the plan."""
    two = [{"cloud": "aws", "region": "us-west-2"}, {"cloud": "aws", "region": "us-east-2"}]
    nodes = ["l4x1", "l4x4", "a10gx1", "a10gx4", "l40sx1"]  # dev's node configs
    none_west = [{"cloud": "aws", "region": "us-west-2", "node": n, "count": 0} for n in nodes]
    stacks = stacks_with(tmp_path, "dev", regions=two, availability=none_west)
    result = preview("dev", stacks)
    assert {i.region for i in result.plan.instances} == {"us-east-2"}
    vpcs = {v.name: v.inputs["cidrBlock"] for v in result.of_type("aws:ec2/vpc:Vpc")}
    assert vpcs["vpc-us-east-2"] == "10.1.0.0/16"  # its place in the list, not in the plan


def test_gcp_names_hold_only_what_gcp_allows():
    """Regression: firewall names were built from model ids, and GCP refuses the "." of
    llama3.1-70b. Ids GCP accepts keep their names (no resource is replaced)."""
    from coral_iac.infra import gcp_name

    ok = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    for model in ("llama3.1-70b", "qwen3-235b-a22b", "phi-4", "gpt-oss-20b@b1", "Some.Model_X"):
        assert ok.match(f"fw-{gcp_name(model)}-us-central1-internal"), model
    assert gcp_name("phi-4") == "phi-4" and gcp_name("gpt-oss-20b@b1") == "gpt-oss-20b-b1"
    assert gcp_name("llama3.1-70b") != gcp_name("llama3-1-70b")  # never one name for two ids


def test_nodes_keep_the_image_the_stack_first_deployed(tmp_path, preview):
    """Regression: the AMI was read from SSM's "latest" parameter on every run, so a new DLAMI
    release (every 1-2 weeks) changed `ami` and replaced every node and the gateway at once. It
    is now resolved once per region, recorded in the `images` output and on each replica, and
    kept; an explicit upgrade rolls out through the reconfiguration states: each replica gets a
    successor on the new image and keeps serving, on its own image, until that one is ready."""
    first = preview("dev", REPO / "stacks")
    images = json.loads(first.outputs["images"])
    assert images == {"us-east-2": "ami-0mock0dlami0gpu", "gateway:us-east-2": "ami-0mock0dlami0gpu"}
    # The same fleet deployed when SSM named an older image.
    old = {k: v.replace("ami-0mock0dlami0gpu", "ami-0old") if k in ("images", "fleet_state") else v
           for k, v in first.outputs.items()}  # fmt: skip
    later = datetime.now(UTC) + timedelta(hours=1)  # the first run's replicas have booted
    again = preview("dev", REPO / "stacks", previous_outputs=old, now=later)
    gpu_nodes = [n for n in again.of_type("aws:ec2/instance:Instance") if "coral:replica" in n.inputs["tags"]]
    assert {n.inputs["ami"] for n in gpu_nodes} == {"ami-0old"}  # not SSM's newer one
    assert json.loads(again.outputs["images"])["us-east-2"] == "ami-0old"
    replicas = {n.inputs["tags"]["coral:replica"] for n in gpu_nodes}
    assert replicas == {n.inputs["tags"]["coral:replica"] for n in nodes_of(first)
                        if "coral:replica" in n.inputs["tags"]}  # no successor  # fmt: skip

    stacks = stacks_with(tmp_path, "dev", deploy={"refresh_images": True})
    upgraded = preview("dev", stacks, previous_outputs=old, now=later)
    nodes = [n for n in upgraded.of_type("aws:ec2/instance:Instance") if "coral:replica" in n.inputs["tags"]]
    by_ami: dict[str, set[str]] = {}
    for n in nodes:
        by_ami.setdefault(n.inputs["ami"], set()).add(n.inputs["tags"]["coral:replica"])
    # Every replica keeps its node (same inputs), and gets a successor on the new image.
    assert by_ami["ami-0old"] == replicas
    assert len(by_ami["ami-0mock0dlami0gpu"]) == len(by_ami["ami-0old"])
    states = upgraded.outputs["instances_by_state"]
    assert sorted(states["starting"]) == sorted(by_ami["ami-0mock0dlami0gpu"])
    assert sorted(states["retiring"]) == sorted(by_ami["ami-0old"])  # serving until replaced
    assert all("^" in r for r in by_ami["ami-0mock0dlami0gpu"])
    # Once the successors have booted, the old replicas drain, then go: all on the new image.
    done = upgraded
    for hours in (2, 4):
        done = preview("dev", stacks, previous_outputs=done.outputs, now=later + timedelta(hours=hours))
    states = done.outputs["instances_by_state"]
    assert sorted(states["ready"]) == sorted(by_ami["ami-0mock0dlami0gpu"])
    assert states["retiring"] == states["draining"] == states["starting"] == []
    assert {n.inputs["ami"] for n in nodes_of(done) if "coral:replica" in n.inputs["tags"]} == {
        "ami-0mock0dlami0gpu"
    }


def test_a_new_gcp_image_rolls_out_and_keeps_the_old_nodes_as_they_are(tmp_path, preview):
    """GCP: a new `deploy.gcp_image` boots successors on it; the running nodes keep theirs."""
    first = preview("dev-gcp", REPO / "stacks")
    old = {n.name: n.inputs["bootDisk"]["initializeParams"]["image"] for n in nodes_of(first)}
    new_image = "projects/p/global/images/new"
    deploy = {"gateway": {"enabled": False}, "gcp_image": new_image}
    stacks = stacks_with(tmp_path, "dev-gcp", base="dev-gcp", deploy=deploy)
    later = datetime.now(UTC) + timedelta(hours=1)
    upgraded = preview("dev-gcp", stacks, previous_outputs=first.outputs, now=later)
    images = {n.name: n.inputs["bootDisk"]["initializeParams"]["image"] for n in nodes_of(upgraded)}
    assert {u: images[u] for u in old} == old  # unchanged inputs: nothing replaced
    new = {u: i for u, i in images.items() if u not in old}
    assert new and set(new.values()) == {new_image}
    # A fleet declared before images were kept per replica is taken to run the image named now.
    legacy = json.loads(first.outputs["fleet_state"])
    for m in legacy["members"].values():
        m.pop("image")
    same = preview("dev-gcp", REPO / "stacks", now=later,
                   previous_outputs=first.outputs | {"fleet_state": json.dumps(legacy)})  # fmt: skip
    assert {n.name for n in nodes_of(same)} == set(old)


def test_nodes_launch_in_a_zone_that_offers_their_instance_types(tmp_path, preview):
    """Regression: one subnet per AWS region, in whichever zone AWS picked, so a launch failed
    with "not supported in your requested Availability Zone" where a planned type is not sold
    there. Each replica's nodes now go to a subnet in the first zone offering all its types."""
    from solver.catalog.offers import load_catalog

    catalog = load_catalog()
    plan = preview("dev", REPO / "stacks").plan
    types = {
        catalog.offer_in(n, i.cloud, i.region).instance_type for i in plan.instances for n in i.nodes
    }
    result = preview("dev", REPO / "stacks", not_offered={(t, "us-east-2a") for t in types})
    subnets = {r.name: r.inputs for r in result.of_type("aws:ec2/subnet:Subnet")}
    assert subnets["subnet-us-east-2b"]["availabilityZone"] == "us-east-2b"
    assert subnets["subnet-us-east-2b"]["cidrBlock"] == "10.0.32.0/20"
    assert "subnet-us-east-2a" not in subnets
    gpu_nodes = [n for n in result.of_type("aws:ec2/instance:Instance") if "coral:replica" in
                 n.inputs["tags"]]  # fmt: skip
    assert gpu_nodes and {n.inputs["subnetId"] for n in gpu_nodes} == {"subnet-us-east-2b-id"}
    everywhere = {(t, f"us-east-2{z}") for t in types for z in "abc"}
    with pytest.raises(pulumi.RunError, match="no availability zone of aws:us-east-2 offers"):
        preview("dev", REPO / "stacks", not_offered=everywhere)


def test_gcp_nodes_go_to_a_zone_that_sells_their_machine_type(tmp_path, preview):
    """Regression: every GCP node went to `<region>-a` (or deploy.gcp_zones), where
    europe-west4 sells no H100 (a3-highgpu-8g: zones b and c in the catalog). A node now goes
    to the first zone the catalog says sells its offer; a chosen zone that does not is refused
    naming the key."""
    stacks = stacks_with(
        tmp_path,
        "ew4",
        base="dev-gcp",
        regions=[{"cloud": "gcp", "region": "europe-west4"}],
        models={  # phi-4's 10 KV heads do not split over 8 GPUs
            "llama3.1-70b": {
                "slo_ms": {"prefill": 3000, "decode": 100},
                "mean_prompt_tokens": 1020,
                "mean_output_tokens": 129,
                "demand": {"requests_per_s": 1},
            }
        },
        node_configs=["h100x8"],
        library={"n_max": 8, "rho": 12, "mode": "vllm"},
        allocation={"budget_usd_per_hour": 1000},
    )
    result = preview("ew4", stacks)
    nodes = result.of_type("gcp:compute/instance:Instance")
    assert nodes and {n.inputs["machineType"] for n in nodes} == {"a3-highgpu-8g"}
    assert {n.inputs["zone"] for n in nodes} == {"europe-west4-b"}
    doc = yaml.safe_load((stacks / "Pulumi.ew4.yaml").read_text())
    doc["config"]["coral:fleet"]["deploy"]["gcp_zones"] = {"europe-west4": "europe-west4-a"}
    (stacks / "Pulumi.ew4.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(pulumi.RunError, match=r"gcp_zones\.europe-west4.*does not sell a3-highgpu"):
        preview("ew4", stacks)
