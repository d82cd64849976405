"""`deploy.api_key_secret` (#18 item 6): the gateway (HAProxy) and aggregated vLLM servers
require the API key, read from the secret manager at boot, never carried in user-data or in the
gateway's SSM parameter."""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import yaml

from coral_iac.gateway import (
    API_KEY_FILE,
    gateway_upstreams,
    render_gateway_user_data,
    render_haproxy_config,
)
from tests.conftest import REPO
from tests.unit.test_gateway import make_plan, serving_keys
from tests.unit.test_gateway_live import FakeVllm, _free_port, _wait_until_listening

SECRET = "coral/api-key"


def keyed_stack(tmp_path: Path, serving: str = "aggregated") -> Path:
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    fleet = doc["config"]["coral:fleet"]
    fleet["models"]["phi-4"]["serving"] = serving
    fleet["deploy"] = {"api_key_secret": SECRET, "api_cidrs": ["203.0.113.0/24"]}
    folder = tmp_path / "stacks"
    folder.mkdir(exist_ok=True)
    (folder / "Pulumi.keyed.yaml").write_text(yaml.safe_dump(doc))
    return folder


def _policy_resources(result, name: str) -> list[str]:
    (policy,) = [r for r in result.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == name]
    statements = json.loads(policy.inputs["policy"])["Statement"]
    found: list[str] = []
    for s in statements:
        found += s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]
    return found


def test_program_wires_the_key_by_name_only(tmp_path, preview):
    result = preview("keyed", keyed_stack(tmp_path))
    nodes = [
        r
        for r in result.of_type("aws:ec2/instance:Instance")
        if "coral:replica" in r.inputs["tags"]
    ]
    assert nodes and all(r.inputs["tags"]["coral:phase"] == "aggregated" for r in nodes)
    for node in nodes:
        text = node.inputs["userData"]
        assert f"CORAL_API_KEY_SECRET={SECRET}\n" in text
        assert 'VLLM_API_KEY="$(api_key)"' in text and "export VLLM_API_KEY" in text
        assert '--secret-id "${CORAL_API_KEY_SECRET}"' in text
    node_arns = _policy_resources(result, "node-read-hf-token")
    assert f"arn:aws:secretsmanager:*:*:secret:{SECRET}-*" in node_arns
    (gateway_vm,) = [
        r
        for r in result.of_type("aws:ec2/instance:Instance")
        if r.inputs["tags"].get("coral:role") == "gateway"
    ]
    assert f"--secret-id {SECRET} " in gateway_vm.inputs["userData"]
    assert any(SECRET in arn for arn in _policy_resources(result, "gateway-read-config"))
    (parameter,) = result.of_type("aws:ssm/parameter:Parameter")
    config = gzip.decompress(base64.b64decode(parameter.inputs["insecureValue"])).decode()
    assert f"-f {API_KEY_FILE}" in config and "Bearer" not in config.split("# deploy.")[0]


def test_without_a_key_nothing_changes(tmp_path, preview):
    result = preview("dev", REPO / "stacks")
    for r in result.of_type("aws:ec2/instance:Instance"):
        assert "API_KEY" not in r.inputs["userData"]
        assert "secretsmanager" not in r.inputs["userData"] or "hf-token" in r.inputs["userData"]
    (parameter,) = result.of_type("aws:ssm/parameter:Parameter")
    config = gzip.decompress(base64.b64decode(parameter.inputs["insecureValue"])).decode()
    assert API_KEY_FILE not in config
    assert _policy_resources(result, "node-read-hf-token") == [
        "arn:aws:secretsmanager:*:*:secret:coral/hf-token-*"
    ]


def test_disaggregated_nodes_get_no_vllm_key(tmp_path, preview):
    """vllm-router's handling of a key is not verified here: P/D nodes do not require one (the
    gateway still does), rather than risk the router's calls to them failing."""
    result = preview("keyed", keyed_stack(tmp_path, "disaggregated"))
    nodes = [
        r
        for r in result.of_type("aws:ec2/instance:Instance")
        if "coral:replica" in r.inputs["tags"]
    ]
    assert {r.inputs["tags"]["coral:phase"] for r in nodes} == {"prefill", "decode"}
    assert all("VLLM_API_KEY" not in r.inputs["userData"] for r in nodes)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_rendered_scripts_with_a_key_pass_shellcheck(tmp_path, preview):
    result = preview("keyed", keyed_stack(tmp_path))
    scripts = []
    for r in result.of_type("aws:ec2/instance:Instance"):
        doc = yaml.safe_load(r.inputs["userData"])
        for f in doc["write_files"]:
            if f["path"].startswith("/usr/local/bin/"):
                scripts.append(f["content"])
    sync = yaml.safe_load(render_gateway_user_data("keyed", "us-east-2", SECRET))
    (synced,) = [f["content"] for f in sync["write_files"] if f["path"].startswith("/usr/local")]
    assert synced in scripts and "secretsmanager get-secret-value" in synced  # the gateway VM's
    assert len(scripts) >= 3
    for i, text in enumerate(scripts):
        path = tmp_path / f"script{i}.sh"
        path.write_text(text)
        run = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert run.returncode == 0, run.stdout


def test_haproxy_requires_the_key(tmp_path):
    """Debian's HAProxy 2.6 with the rendered check: no key or a wrong one gets 401 and reaches
    no replica; the right one is routed."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed: scripts/test installs it (scripts/debian_tools)"
    plan = make_plan([("phi-4", "aggregated", "l40sx1", "l40sx1", 2.0, 1)])
    (key,) = serving_keys(plan)
    backend = FakeVllm("phi-4")
    threading.Thread(target=backend.serve_forever, args=(0.05,), daemon=True).start()
    port = _free_port()
    config = render_haproxy_config(
        gateway_upstreams(plan, {key: backend.address}), "live", port, 100, api_key=True
    )
    keys = tmp_path / "coral-api-keys"
    keys.write_text("Bearer s3cret-key\n")  # as coral-gateway-sync writes it
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(config.replace(API_KEY_FILE, str(keys)), encoding="utf-8")
    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=log)
    try:
        _wait_until_listening(port, proc)
        statuses = {}
        for name, header in [
            ("none", None),
            ("wrong", "Bearer nope"),
            ("prefix", "Bearer s3cret"),
            ("right", "Bearer s3cret-key"),
        ]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            headers = {"Content-Type": "application/json"}
            if header:
                headers["Authorization"] = header
            body = json.dumps({"model": "phi-4", "prompt": "hi", "max_tokens": 1})
            conn.request("POST", "/phi-4/v1/completions", body, headers)
            response = conn.getresponse()
            response.read()
            statuses[name] = response.status
            conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        backend.kill()
    assert statuses == {"none": 401, "wrong": 401, "prefix": 401, "right": 200}
    assert len(backend.served) == 1


def test_a_world_open_api_with_a_key_names_the_secret():
    from coral_iac.deploy_settings import DeploySettings
    from coral_iac.exposure import exposure_warnings

    (line,) = exposure_warnings(DeploySettings(api_cidrs=["0.0.0.0/0"], api_key_secret=SECRET))
    assert "whole internet" in line and f"API key in secret '{SECRET}'" in line
    with pytest.raises(ValueError, match="api_key_secret"):
        DeploySettings(api_key_secret="")
