"""The gateway: upstreams and weights from the plan, rendered HAProxy configuration and cloud-init
(golden files, `haproxy -c`, `cloud-init schema`, shellcheck), and the Pulumi program's gateway
under mocks. Golden files live in tests/golden/gateway/; `CORAL_ACCEPT=1` rewrites them.
The real-proxy loopback test is tests/deploy/test_gateway_live.py.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.gateway_config import (
    TLS_FILE,
    WEIGHT_MAX,
    gateway_limits,
    gateway_upstreams,
    health_parameter_name,
    parameter_name,
    parameter_value,
    render_gateway_user_data,
    render_haproxy_config,
)
from coral_iac.preview import _ip
from solver.errors import InputError
from solver.plan_schema import Instance, Plan, instance_key, template_ref
from solver.serving.serving_template import ServingTemplate, Stage, StageMember
from solver.stack import ModelSpec
from tests.conftest import REPO
from tests.deploy.test_program import stacks_with
from tests.factories import PHI4_SPEC

GOLDEN = REPO / "tests" / "golden" / "gateway"

# (model, phase, serving template key, node, throughput, replicas)
AGGREGATED = [
    ("phi-4", "aggregated", "l40sx1", "l40sx1", 2.0, 2),
    ("phi-4", "aggregated", "l4x1*2", "l4x1", 1.0, 1),
    ("qwen3-32b", "aggregated", "l40sx4", "l40sx4", 1.5, 2),
]
DISAGGREGATED = [
    ("llama3.1-70b", "prefill", "h100x8", "h100x8", 40000.0, 2),
    ("llama3.1-70b", "decode", "h100x8", "h100x8", 3000.0, 2),
    ("llama3.1-70b", "decode", "a100-80gbx8", "a100-80gbx8", 1900.0, 1),
]
def _template(model: str, phase: str, key: str, node: str, throughput: float) -> ServingTemplate:
    gpus = int(node.rsplit("x", 1)[1])
    return ServingTemplate(
        key=key,
        model=model,
        phase=phase,
        mode="vllm",
        nodes=[node],
        stages=[Stage(layers=40, members=[StageMember(node=0, gpus=list(range(gpus)), tp=gpus)])],
        throughput=throughput,
        unit="requests/s" if phase == "aggregated" else "tokens/s",
        stage_budget_ms=[100.0],
    )


def make_plan(rows: list[tuple[str, str, str, str, float, int]], region: str = "us-east-2") -> Plan:
    """A plan holding `replicas` instances of each row's template, in one aws region."""
    templates, instances = {}, []
    for model, phase, key, node, throughput, replicas in rows:
        templates[template_ref(model, phase, key)] = _template(model, phase, key, node, throughput)
        for i in range(replicas):
            instances.append(
                Instance(
                    key=instance_key(model, phase, "aws", region, key, i),
                    model=model,
                    phase=phase,
                    cloud="aws",
                    region=region,
                    template=key,
                    index=i,
                    nodes=[node],
                    usd_per_hour=1.0,
                    throughput=throughput,
                )
            )
    return Plan(
        stack="golden",
        method="coral",
        mode="vllm",
        served_fraction=1.0,
        hourly_cost_usd=float(len(instances)),
        startup_penalty_usd_per_hour=0.0,
        cost_by_model={},
        jobs=[],
        instances=instances,
        templates=templates,
        binding=[],
        solver=None,
        input_hashes={},
    )


def serving_keys(plan: Plan) -> list[str]:
    """Keys of the instances the gateway routes to (aggregated heads, decode routers)."""
    return sorted(i.key for i in plan.instances if i.phase in ("aggregated", "decode"))


def addresses(plan: Plan, port: int = 8000) -> dict[str, str]:
    """Deterministic private addresses, one per serving instance."""
    return {k: f"10.0.{n}.{10 + n}:{port}" for n, k in enumerate(serving_keys(plan))}


def spec(requests_per_s: float) -> ModelSpec:
    """A model at PHI4_SPEC's SLOs and lengths with this demand."""
    return ModelSpec.model_validate({**PHI4_SPEC, "demand": {"requests_per_s": requests_per_s}})


# The golden plans' models: phi-4 and qwen3-32b served in full (their gateway admits their
# capacity at the target), llama3.1-70b scarce (it admits its served share of the demand).
GOLDEN_MODELS = {"phi-4": spec(3.0), "qwen3-32b": spec(2.0), "llama3.1-70b": spec(60.0)}


def golden_cases() -> dict[str, str]:
    agg = make_plan(AGGREGATED)
    dis = make_plan(DISAGGREGATED).model_copy(
        update={"served_fraction": 0.5, "served_fractions": {"llama3.1-70b": 0.5}}
    )
    dis_keys = serving_keys(dis)
    # A transition: one decode replica leaving the plan, one new and still loading.
    states = {dis_keys[0]: "draining", dis_keys[-1]: "starting"}
    return {
        "aggregated/haproxy.cfg": render_haproxy_config(
            gateway_upstreams(agg, addresses(agg)),
            "golden",
            8000,
            2000,
            limits=gateway_limits(agg, GOLDEN_MODELS),
        ),
        "disaggregated/haproxy.cfg": render_haproxy_config(
            gateway_upstreams(dis, addresses(dis), states),
            "golden",
            8000,
            2000,
            limits=gateway_limits(dis, GOLDEN_MODELS, states),
        ),
        "cloud-config.yaml": render_gateway_user_data("golden", "us-east-2", 8000),
        "tls/haproxy.cfg": render_haproxy_config(
            gateway_upstreams(agg, addresses(agg)), "golden", 8443, 2000, api_key=True, tls=True
        ),
        "tls/cloud-config.yaml": render_gateway_user_data(
            "golden", "us-east-2", 8443, "coral/api-key", "coral/gateway-tls"
        ),
    }


@pytest.mark.parametrize("case", sorted(golden_cases()))
def test_rendering_matches_golden(case):
    path = GOLDEN / case
    text = golden_cases()[case]
    if os.environ.get("CORAL_ACCEPT") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden file {path}; run with CORAL_ACCEPT=1 to create it"
    assert text == path.read_text(encoding="utf-8"), f"{path} differs (CORAL_ACCEPT=1 to accept)"


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: scripts/test installs it (scripts/debian_tools {name})"
    return path


@pytest.mark.parametrize("case", ["aggregated/haproxy.cfg", "disaggregated/haproxy.cfg"])
def test_haproxy_accepts_the_rendered_configuration(case, tmp_path):
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(golden_cases()[case], encoding="utf-8")
    r = subprocess.run([_tool("haproxy"), "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[WARNING]" not in r.stderr + r.stdout, r.stderr  # no setting HAProxy ignores


def test_haproxy_refuses_a_broken_configuration(tmp_path):
    """The check above can fail: a config HAProxy cannot parse exits non-zero."""
    cfg = tmp_path / "haproxy.cfg"
    text = golden_cases()["aggregated/haproxy.cfg"].replace("balance roundrobin", "balance nope")
    cfg.write_text(text, encoding="utf-8")
    r = subprocess.run([_tool("haproxy"), "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert r.returncode != 0


def self_signed(tmp_path, name: str = "gateway") -> tuple[str, str]:
    """A fresh self-signed certificate for 127.0.0.1: (the PEM bundle HAProxy loads, the
    certificate alone, for a client to trust)."""
    key, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.crt"
    subprocess.run(
        [_tool("openssl"), "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert.read_text() + key.read_text(), cert.read_text()


def test_haproxy_accepts_the_tls_configuration_with_a_certificate_and_only_with_one(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("Bearer k\n")
    pem = tmp_path / "gateway.pem"
    config = golden_cases()["tls/haproxy.cfg"].replace(TLS_FILE, str(pem))
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(config.replace("/etc/haproxy/coral-api-keys", str(keys)), encoding="utf-8")

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [_tool("haproxy"), "-c", "-f", str(cfg)], capture_output=True, text=True
        )

    assert check().returncode != 0  # no certificate yet
    pem.write_text(self_signed(tmp_path)[0])
    r = check()
    assert r.returncode == 0 and "[WARNING]" not in r.stderr + r.stdout, r.stdout + r.stderr
    assert f"bind :8443 ssl crt {TLS_FILE} ssl-min-ver TLSv1.2" in golden_cases()["tls/haproxy.cfg"]


@pytest.mark.parametrize("case", ["cloud-config.yaml", "tls/cloud-config.yaml"])
def test_gateway_user_data_passes_cloud_init_schema_and_shellcheck(tmp_path, case):
    text = golden_cases()[case]
    f = tmp_path / "gateway.yaml"
    f.write_text(text, encoding="utf-8")
    r = subprocess.run(
        [_tool("cloud-init"), "schema", "--config-file", str(f)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = yaml.safe_load(text)
    scripts = {
        w["path"].rsplit("/", 1)[1]: w["content"]
        for w in doc["write_files"]
        if w["path"].startswith("/usr/local/bin/")
    }
    assert set(scripts) == {"coral-gateway-sync", "coral-gateway-health"}
    for name, content in scripts.items():
        s = tmp_path / name
        s.write_text(content, encoding="utf-8")
        r = subprocess.run([_tool("shellcheck"), str(s)], capture_output=True, text=True)
        assert r.returncode == 0, name + r.stdout
    assert {"haproxy", "awscli", "curl"} <= set(doc["packages"])
    assert parameter_name("golden") in scripts["coral-gateway-sync"]
    assert health_parameter_name("golden") in scripts["coral-gateway-health"]
    # The service that syncs also reports health, right after each sync.
    (unit,) = [w for w in doc["write_files"] if w["path"].endswith("coral-gateway-sync.service")]
    assert unit["content"].index("coral-gateway-sync\n") < unit["content"].index(
        "ExecStart=/usr/local/bin/coral-gateway-health"
    )


def test_weights_follow_template_throughput_and_only_ready_upstreams_get_any():
    plan = make_plan(AGGREGATED)
    keys = serving_keys(plan)
    draining = next(k for k in keys if "/l40sx1/1" in k)
    ups = {u.key: u for u in gateway_upstreams(plan, addresses(plan), {draining: "draining"})}
    phi = [u for u in ups.values() if u.model == "phi-4"]
    by_template = {u.key.split("/")[3]: u.weight for u in phi if u.state == "ready"}
    assert by_template == {"l40sx1": WEIGHT_MAX, "l4x1*2": WEIGHT_MAX // 2}  # 2.0 vs 1.0
    assert ups[draining].weight == 0 and ups[draining].state == "draining"
    qwen = [u for u in ups.values() if u.model == "qwen3-32b"]
    assert [u.weight for u in qwen] == [WEIGHT_MAX, WEIGHT_MAX]  # peak per model
    assert len(set(u.server for u in ups.values())) == len(ups)  # unique server names


def test_disaggregated_models_route_to_decode_routers_only():
    plan = make_plan(DISAGGREGATED)
    ups = gateway_upstreams(plan, addresses(plan))
    assert {u.key.split("/")[1] for u in ups} == {"decode"}
    assert sorted(u.weight for u in ups) == [round(WEIGHT_MAX * 1900 / 3000), 256, 256]
    assert {u.unit for u in ups} == {"tokens/s"}


@pytest.mark.parametrize(
    ("states", "message"),
    [
        ({"phi-4/aggregated/aws:us-east-2/l40sx1/9": "draining"}, "not aggregated or decode"),
        ({"phi-4/aggregated/aws:us-east-2/l40sx1/0": "paused"}, "unknown state 'paused'"),
    ],
    ids=["unknown_replica", "unknown_state"],
)
def test_bad_states_are_refused_with_the_fix(states, message):
    plan = make_plan(AGGREGATED)
    with pytest.raises(InputError, match=message):
        gateway_upstreams(plan, addresses(plan), states)


def test_a_missing_address_is_refused():
    plan = make_plan(AGGREGATED)
    partial = dict(list(addresses(plan).items())[1:])
    with pytest.raises(InputError, match="no address for"):
        gateway_upstreams(plan, partial)


def test_same_inputs_same_bytes_and_the_parameter_round_trips():
    first, second = golden_cases(), golden_cases()
    assert first == second
    config = first["aggregated/haproxy.cfg"]
    packed = parameter_value(config)
    assert packed == parameter_value(config)  # gzip without a timestamp
    assert gzip.decompress(base64.b64decode(packed)).decode() == config


def test_a_configuration_too_large_for_ssm_is_refused():
    rows = [  # 720 upstreams: about twice what one parameter holds
        (f"m{i}", "aggregated", f"t{j}", "l4x1", 1.0 + j, 1) for i in range(8) for j in range(90)
    ]
    plan = make_plan(rows)
    config = render_haproxy_config(gateway_upstreams(plan, addresses(plan)), "big", 8000, 2000)
    with pytest.raises(InputError, match="over SSM's 8192"):
        parameter_value(config)


def test_the_configuration_renders_without_pulumi():
    """`coral_iac.gateway_config` (and the vLLM argv of `coral_iac.engine_args`) load no cloud
    SDK: the Pulumi component is `coral_iac.gateway` alone."""
    code = (
        "import sys, coral_iac.gateway_config, coral_iac.engine_args\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pulumi', 'pulumi_aws'))\n"
        "print(bad); raise SystemExit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------- the program, under mocks



def config_of(result) -> str:
    (param,) = [
        r for r in result.of_type("aws:ssm/parameter:Parameter") if r.name == "gateway-config"
    ]
    return gzip.decompress(base64.b64decode(param.inputs["insecureValue"])).decode()


def gateway_vm(result):
    (vm,) = [
        r
        for r in result.of_type("aws:ec2/instance:Instance")
        if r.inputs["tags"].get("coral:role") == "gateway"
    ]
    return vm


def test_haproxy_accepts_the_configuration_the_program_declares(tmp_path, preview):
    """Regression: a decode replica's id carries its peers' digest after "~", which HAProxy
    refuses in a server name, so the dev stack's gateway never loaded its configuration (the
    sync checks it with `haproxy -c` first). Also with successors on a new boot image ("^")."""
    first = preview("dev", REPO / "stacks")
    stacks = stacks_with(tmp_path, "dev", deploy={"refresh_images": True})
    old = {k: v.replace("ami-0mock0dlami0gpu", "ami-0old") if k in ("images", "fleet_state") else v
           for k, v in first.outputs.items()}  # fmt: skip
    later = datetime.now(UTC) + timedelta(hours=1)
    rolling = preview("dev", stacks, previous_outputs=old, now=later)
    keys = tmp_path / "keys"
    keys.write_text("Bearer k\n")
    for result in (first, rolling):
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(config_of(result).replace("/etc/haproxy/coral-api-keys", str(keys)))
        r = subprocess.run([_tool("haproxy"), "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert r.returncode == 0 and "[WARNING]" not in r.stdout + r.stderr, r.stdout + r.stderr
    servers = [line.split()[1] for line in config_of(rolling).splitlines()
               if line.strip().startswith("server ")]  # fmt: skip
    assert len(servers) == len(set(servers)) >= 2  # the old decode replica and its successor


def test_program_declares_a_locked_down_gateway(tmp_path, preview):
    stacks = stacks_with(tmp_path, "gw", deploy={"api_cidrs": ["203.0.113.0/24"]})
    result = preview("gw", stacks)
    vm = gateway_vm(result)
    assert vm.inputs["metadataOptions"]["httpTokens"] == "required"
    assert vm.inputs["rootBlockDevice"]["encrypted"] is True
    assert vm.inputs["instanceType"] == "c7i.large"
    assert "hf-token" not in vm.inputs["userData"] and "10.0." not in vm.inputs["userData"]
    groups = {g.name: g for g in result.of_type("aws:ec2/securityGroup:SecurityGroup")}
    (api,) = groups["gateway-sg"].inputs["ingress"]
    assert (api["fromPort"], api["toPort"], api["cidrBlocks"]) == (8000, 8000, ["203.0.113.0/24"])
    ingress = groups["sg-phi-4-us-east-2"].inputs["ingress"]
    admitted = [r for r in ingress if r.get("securityGroups")]
    assert admitted == [
        {
            "protocol": "tcp",
            "fromPort": 8000,
            "toPort": 8000,
            "securityGroups": ["gateway-sg-id"],
            "description": "Coral gateway",
        }
    ]
    (policy,) = [p for p in result.of_type("aws:iam/rolePolicy:RolePolicy") if "gateway" in p.name]
    read, write = json.loads(policy.inputs["policy"])["Statement"]
    assert (read["Action"], write["Action"]) == ("ssm:GetParameter", "ssm:PutParameter")
    assert read["Resource"] == "arn:aws:ssm:us-east-2:*:parameter/coral/gw/gateway/haproxy.cfg"
    assert write["Resource"] == "arn:aws:ssm:us-east-2:*:parameter/coral/gw/gateway/health"
    # Upstreams: each decode head's router on its private address (same VPC).
    decode_heads = [
        n
        for n in result.of_type("aws:ec2/instance:Instance")
        if n.inputs["tags"].get("coral:phase") == "decode"
    ]
    config = config_of(result)
    for head in decode_heads:  # the mocks' private address of each head
        assert f" {_ip('10.0', head.name)}:8000 weight " in config
    assert config.count("    server ") == len(decode_heads) > 0
    eip = result.of_type("aws:ec2/eip:Eip")[0]
    assert eip.inputs["domain"] == "vpc"
    assert result.outputs["gateway"].startswith("http://198.51.")
    assert result.outputs["gateway_endpoints"] == {"phi-4": result.outputs["gateway"] + "/phi-4/v1"}


def test_a_tls_secret_makes_the_gateway_https_and_only_that_secret_readable(tmp_path, preview):
    stacks = stacks_with(
        tmp_path,
        "tls",
        deploy={
            "api_cidrs": ["203.0.113.0/24"],
            "api_key_secret": "coral/api-key",
            "gateway": {"tls_secret": "coral/gateway-tls"},
        },
    )
    result = preview("tls", stacks)
    assert result.outputs["gateway"].startswith("https://198.51.")
    assert result.outputs["gateway_endpoints"]["phi-4"].startswith("https://")
    (policy,) = [p for p in result.of_type("aws:iam/rolePolicy:RolePolicy") if "gateway" in p.name]
    (secrets,) = [
        s
        for s in json.loads(policy.inputs["policy"])["Statement"]
        if s["Action"] == "secretsmanager:GetSecretValue"
    ]
    assert secrets["Resource"] == [
        "arn:aws:secretsmanager:us-east-2:*:secret:coral/api-key-??????",
        "arn:aws:secretsmanager:us-east-2:*:secret:coral/gateway-tls-??????",
    ]
    user_data = gateway_vm(result).inputs["userData"]
    assert "--secret-id coral/gateway-tls" in user_data and "BEGIN" in user_data
    assert f"ssl crt {TLS_FILE}" in config_of(result)


@pytest.mark.parametrize("name", ["", "has space", "quote'd"])
def test_a_bad_tls_secret_name_is_refused_naming_the_field(tmp_path, name, preview):
    stacks = stacks_with(tmp_path, "badtls", deploy={"gateway": {"tls_secret": name}})
    with pytest.raises(Exception, match="tls_secret"):
        preview("badtls", stacks)


def declared(result) -> dict:
    return {
        (r.type, r.name): r.inputs
        for r in result.resources
        if r.type != "pulumi:pulumi:StackReference"
    }


def test_a_plan_change_updates_only_the_configuration_parameter(tmp_path, preview):
    """A plan that adds instances (demand 1.5x what the first plan's prefill serves, read from
    the plan; add-only, so the re-plan cannot meet it by swapping instances) changes the gateway
    configuration parameter in place and nothing else of the gateway."""
    first = preview("dev", REPO / "stacks")
    fleet = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())["config"][
        "coral:fleet"
    ]
    models, phi4 = fleet["models"], fleet["models"]["phi-4"]
    as_committed = ModelSpec.model_validate(phi4)
    prefill = [i for i in first.plan.instances if i.model == "phi-4" and i.phase == "prefill"]
    served = sum(i.throughput for i in prefill) / phi4["mean_prompt_tokens"]
    phi4["demand"] = {"requests_per_s": 1.5 * served}
    allocation = fleet["allocation"] | {"add_only": True}
    stacks = stacks_with(tmp_path, "dev", models=models, allocation=allocation)
    more = preview("dev", stacks, previous=first.plan)
    assert len(more.plan.instances) > len(first.plan.instances)
    before, after = declared(first), declared(more)
    gateway_keys = [k for k in before if "gateway" in k[1]]
    # component, group, role, policy, profile, VM, EIP, configuration and health parameters
    assert len(gateway_keys) == 9
    changed = [k for k in gateway_keys if after[k] != before[k]]
    assert changed == [("aws:ssm/parameter:Parameter", "gateway-config")]  # updated in place
    assert after[changed[0]]["name"] == before[changed[0]]["name"]
    assert config_of(more).count("    server ") > config_of(first).count("    server ")
    assert more.outputs["gateway"] == first.outputs["gateway"]
    # The admission limit moves with the plan, in the same parameter: what the solver's rule
    # gives the plan (the program's declared limit, computed here from the plan).
    def limit(result) -> int:
        (line,) = [ln for ln in config_of(result).splitlines() if "sc0_gpc0_rate ge" in ln]
        return int(line.rsplit("sc0_gpc0_rate ge ", 1)[1].split()[0])

    def planned(result, spec: ModelSpec) -> int:
        return gateway_limits(result.plan, {"phi-4": spec})["phi-4"].count

    assert limit(first) == planned(first, as_committed)
    # The new plan's, and more while the replicas it replaces still serve (retiring: ready).
    assert limit(more) >= planned(more, ModelSpec.model_validate(phi4))
    assert limit(more) > limit(first)


def test_remote_replicas_are_reached_by_public_address_and_admit_only_the_gateway(tmp_path, preview):
    stacks = stacks_with(
        tmp_path,
        "remote",
        regions=[{"cloud": "gcp", "region": "us-central1"}],
        node_configs=["l4x1", "l4x4", "a100-80gbx1"],
        deploy={"gateway": {"region": "us-east-1", "instance_type": "c7i.xlarge"}},
        allocation={"budget_usd_per_hour": 40},  # GCP prices at the SLO attainment target
    )
    result = preview("remote", stacks)
    assert gateway_vm(result).inputs["instanceType"] == "c7i.xlarge"
    (provider,) = [p for p in result.of_type("pulumi:providers:aws")]
    assert provider.inputs["region"] == "us-east-1"
    eip = _ip("198.51", "gateway-ip")
    rules = [f for f in result.of_type("gcp:compute/firewall:Firewall") if "gateway" in f.name]
    assert rules and all(f.inputs["sourceRanges"] == [f"{eip}/32"] for f in rules)
    assert all(f.inputs["allows"] == [{"protocol": "tcp", "ports": ["8000"]}] for f in rules)
    config = config_of(result)
    heads = [
        n
        for n in result.of_type("gcp:compute/instance:Instance")
        if n.inputs["labels"]["coral-phase"] in ("decode", "aggregated")
        and n.inputs["labels"]["coral-node"] == "0"
    ]
    assert heads and all(f" {_ip('203.0', h.name)}:8000 " in config for h in heads)


def test_gateway_can_be_turned_off_and_a_gcp_only_fleet_gets_none_by_default(tmp_path, preview):
    off = preview("off", stacks_with(tmp_path, "off", deploy={"gateway": {"enabled": False}}))
    gcp = preview(
        "gcp",
        stacks_with(
            tmp_path,
            "gcp",
            regions=[{"cloud": "gcp", "region": "us-central1"}],
            node_configs=["l4x1", "l4x4", "a100-80gbx1"],
            allocation={"budget_usd_per_hour": 40},  # GCP prices at the SLO attainment target
        ),
    )
    for result in (off, gcp):
        assert not [r for r in result.resources if "gateway" in r.name]
        assert "gateway" not in result.outputs and result.outputs["endpoints"]


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ({"cloud": "gcp"}, "gateway.cloud"),
        ({"health_check_interval_ms": 10}, "health_check_interval_ms"),
        ({"instance_typ": "c7i.large"}, "instance_typ"),
    ],
    ids=["gcp_gateway", "interval_too_short", "misspelt_key"],
)
def test_bad_gateway_settings_name_the_field(tmp_path, gateway, message, preview):
    stacks = stacks_with(tmp_path, "badgw", deploy={"gateway": gateway})
    with pytest.raises(Exception, match=message):
        preview("badgw", stacks)


def test_coral_preview_shows_the_gateway_address_per_model(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(app, ["preview", "--stack", "dev"])
    assert r.exit_code == 0, r.output
    assert "Gateway (c7i.large): http://198.51." in r.stdout
    assert "phi-4: http://198.51." in r.stdout and ":8000/phi-4/v1" in r.stdout
    r = CliRunner().invoke(app, ["preview", "--stack", "dev", "--json"])
    outputs = json.loads(r.stdout)["outputs"]
    assert outputs["gateway_endpoints"]["phi-4"] == outputs["gateway"] + "/phi-4/v1"


def test_a_gateway_in_another_aws_region_keeps_the_fleets_networks(tmp_path, preview):
    stacks = stacks_with(tmp_path, "east1", deploy={"gateway": {"region": "us-east-1"}})
    result = preview("east1", stacks)
    vpcs = {v.name: v.inputs["cidrBlock"] for v in result.of_type("aws:ec2/vpc:Vpc")}
    # The fleet's region keeps the CIDR of its place in coral:fleet.regions; the gateway's
    # region, outside that list, gets the reserved 10.255.
    assert vpcs == {"vpc-us-east-2": "10.0.0.0/16", "vpc-us-east-1": "10.255.0.0/16"}
    groups = {g.name: g for g in result.of_type("aws:ec2/securityGroup:SecurityGroup")}
    (rule,) = [r for r in groups["sg-phi-4-us-east-2"].inputs["ingress"] if not r.get("self")]
    assert rule["cidrBlocks"] == [f"{_ip('198.51', 'gateway-ip')}/32"]  # its Elastic IP only
    assert (rule["fromPort"], rule["toPort"]) == (8000, 8000)
    decode_heads = [
        n
        for n in result.of_type("aws:ec2/instance:Instance")
        if n.inputs["tags"].get("coral:phase") == "decode"
    ]
    config = config_of(result)
    assert decode_heads and all(f" {_ip('198.51', h.name)}:8000 " in config for h in decode_heads)


def _files(user_data: str) -> dict[str, str]:
    return {w["path"]: w["content"] for w in yaml.safe_load(user_data)["write_files"]}


def test_haproxy_starts_unprivileged_before_the_first_sync(tmp_path):
    """Regression: HAProxy ran as User=haproxy with Debian's default configuration, whose
    `chroot /var/lib/haproxy` it cannot do unprivileged: it failed at boot. The gateway now
    writes a configuration of its own first; real HAProxy runs it and answers 503."""
    import socket
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg_text = _files(render_gateway_user_data("golden", "us-east-2", port))["/etc/haproxy/haproxy.cfg"]
    assert not {"chroot", "user", "daemon"} & {line.split()[0] for line in cfg_text.splitlines()
                                                if line.strip() and not line.startswith("#")}  # fmt: skip
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(cfg_text)
    check = subprocess.run([_tool("haproxy"), "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen([_tool("haproxy"), "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        status = 0
        for _ in range(50):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            except urllib.error.HTTPError as e:
                status = e.code
                break
            except OSError:
                time.sleep(0.1)
        assert status == 503
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("active", [True, False])
def test_the_sync_starts_a_stopped_haproxy_even_when_the_configuration_is_unchanged(
    tmp_path, active
):
    """Regression: the sync reloaded HAProxy only when the configuration changed, so an HAProxy
    that had failed stayed down at every later poll. The rendered script runs here with
    stand-ins for aws and systemctl on PATH and its paths under tmp_path."""
    config = golden_cases()["aggregated/haproxy.cfg"]
    live = tmp_path / "haproxy.cfg"
    live.write_text(config)
    script = _files(render_gateway_user_data("golden", "us-east-2", 8000))[
        "/usr/local/bin/coral-gateway-sync"
    ].replace("/etc/haproxy/haproxy.cfg", str(live))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(f"#!/bin/sh\necho {parameter_value(config)}\n")
    calls = tmp_path / "calls"
    (bin_dir / "systemctl").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        f'[ "$1" = is-active ] && exit {0 if active else 3}\nexit 0\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "sync").write_text(script)
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(tmp_path / "sync")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    done = calls.read_text().splitlines()
    if active:
        assert done == ["is-active --quiet haproxy.service"]
    else:
        assert done[-2:] == ["reset-failed haproxy.service", "reload-or-restart haproxy.service"]
        assert "HAProxy is not running" in r.stderr
