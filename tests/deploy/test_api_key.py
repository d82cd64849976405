"""`deploy.api_key_secret`: behind the gateway, HAProxy alone checks the key (any of the
secret's lines, so a new key needs no restart) and strips it; the replicas, which then check
none, are open to the gateway alone and may not read the secret. Without a gateway, every vLLM
server (aggregated) requires the key itself, read from the secret manager at boot, never
carried in user-data or in the gateway's SSM parameter; a P/D pair's vllm-router, which cannot
require it, needs the gateway."""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pulumi
import pytest
import yaml

from coral_iac.bootstrap import render_user_data
from coral_iac.gateway_config import (
    API_KEY_FILE,
    gateway_upstreams,
    parameter_value,
    render_gateway_user_data,
    render_haproxy_config,
)
from tests.conftest import REPO
from tests.deploy.test_gateway import _files
from tests.deploy.test_gateway_live import (
    _free_port,
    _wait_until_listening,
    install_stand_in,
    one_replica,
)

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


def _replicas(result) -> list:
    return [
        r
        for r in result.of_type("aws:ec2/instance:Instance")
        if "coral:replica" in r.inputs["tags"]
    ]


def test_behind_the_gateway_only_the_gateway_reads_and_checks_the_key(tmp_path, preview):
    result = preview("keyed", keyed_stack(tmp_path))
    nodes = _replicas(result)
    assert nodes and all(r.inputs["tags"]["coral:phase"] == "aggregated" for r in nodes)
    for node in nodes:
        assert "API_KEY" not in node.inputs["userData"] and SECRET not in node.inputs["userData"]
    # Least privilege: the nodes may read the Hugging Face token only.
    assert _policy_resources(result, "node-read-hf-token") == [
        "arn:aws:secretsmanager:*:*:secret:coral/hf-token-??????"
    ]
    (gateway_vm,) = [
        r
        for r in result.of_type("aws:ec2/instance:Instance")
        if r.inputs["tags"].get("coral:role") == "gateway"
    ]
    assert f"--secret-id {SECRET} " in gateway_vm.inputs["userData"]
    assert any(SECRET in arn for arn in _policy_resources(result, "gateway-read-config"))
    (parameter,) = [
        r for r in result.of_type("aws:ssm/parameter:Parameter") if r.name == "gateway-config"
    ]
    config = gzip.decompress(base64.b64decode(parameter.inputs["insecureValue"])).decode()
    assert f"-f {API_KEY_FILE}" in config and "Bearer" not in config.split("# deploy.")[0]
    assert "http-request del-header authorization" in config
    # Clients reach the replicas through the gateway only: they check no key.
    assert {r["description"] for r in _api_rules(result, "phi-4")} == {"Coral gateway"}


def test_without_a_gateway_vllm_checks_the_key_itself(tmp_path, preview):
    stacks = keyed_stack(tmp_path)
    path = stacks / "Pulumi.keyed.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["config"]["coral:fleet"]["deploy"]["gateway"] = {"enabled": False}
    path.write_text(yaml.safe_dump(doc))
    result = preview("keyed", stacks)
    for node in _replicas(result):
        text = node.inputs["userData"]
        assert f"CORAL_API_KEY_SECRET={SECRET}\n" in text
        assert 'VLLM_API_KEY="$(api_key)"' in text and "export VLLM_API_KEY" in text
        assert '--secret-id "${CORAL_API_KEY_SECRET}"' in text
    node_arns = _policy_resources(result, "node-read-hf-token")
    # Secrets Manager's six-character suffix exactly: not another secret sharing the prefix
    assert f"arn:aws:secretsmanager:*:*:secret:{SECRET}-??????" in node_arns
    assert {r["description"] for r in _api_rules(result, "phi-4")} == {"OpenAI-compatible API"}


def test_without_a_key_nothing_changes(tmp_path, preview):
    result = preview("dev", REPO / "stacks")
    for r in result.of_type("aws:ec2/instance:Instance"):
        assert "API_KEY" not in r.inputs["userData"]
        assert "secretsmanager" not in r.inputs["userData"] or "hf-token" in r.inputs["userData"]
    (parameter,) = [
        r for r in result.of_type("aws:ssm/parameter:Parameter") if r.name == "gateway-config"
    ]
    config = gzip.decompress(base64.b64decode(parameter.inputs["insecureValue"])).decode()
    assert API_KEY_FILE not in config
    assert _policy_resources(result, "node-read-hf-token") == [
        "arn:aws:secretsmanager:*:*:secret:coral/hf-token-??????"
    ]


def _start_script(user_data: str) -> str:
    doc = yaml.safe_load(user_data)
    (script,) = [f["content"] for f in doc["write_files"] if f["path"].endswith("node-start")]
    return str(script)


def _api_rules(result, model: str) -> list[dict]:
    """Ingress rules on the API port of a model's endpoint security group."""
    (group,) = [
        r
        for r in result.of_type("aws:ec2/securityGroup:SecurityGroup")
        if r.inputs.get("tags", {}).get("coral:model") == model
    ]
    return [rule for rule in group.inputs["ingress"] if rule.get("fromPort") == 8000]


def test_disaggregated_nodes_behind_the_gateway_hold_no_key(tmp_path, preview):
    """Prefill and decode servers and the decode node's vllm-router hold no key behind the
    gateway; the router's port is open to the gateway only."""
    result = preview("keyed", keyed_stack(tmp_path, "disaggregated"))
    nodes = _replicas(result)
    assert {r.inputs["tags"]["coral:phase"] for r in nodes} == {"prefill", "decode"}
    for node in nodes:
        assert "API_KEY" not in node.inputs["userData"]
    assert any(
        "vllm-router " in _start_script(r.inputs["userData"])
        for r in nodes
        if r.inputs["tags"]["coral:phase"] == "decode"
    )
    (rule,) = _api_rules(result, "phi-4")  # no api_cidrs rule: vllm-router checks no key
    assert rule["description"] == "Coral gateway" and not rule.get("cidrBlocks")


def test_a_keyed_disaggregated_stack_without_a_gateway_is_refused(tmp_path, preview):
    stacks = keyed_stack(tmp_path, "disaggregated")
    path = stacks / "Pulumi.keyed.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["config"]["coral:fleet"]["deploy"]["gateway"] = {"enabled": False}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(pulumi.RunError, match="api_key_secret: phi-4 .* cannot require the key"):
        preview("keyed", stacks)
    doc["config"]["coral:fleet"]["models"]["phi-4"]["serving"] = "aggregated"
    path.write_text(yaml.safe_dump(doc))
    assert preview("keyed", stacks).of_type("aws:ec2/instance:Instance")


VLLM_PYTHON = REPO / ".vllm-venv" / "bin" / "python"
ROUTER = REPO / ".vllm-venv" / "bin" / "vllm-router"


def _wait_http(port: int, proc: subprocess.Popen, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited at start"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{what} did not answer /health within {timeout} s")


def _call(port: int, path: str, key: str | None, body: dict | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST" if body else "GET", path, json.dumps(body) if body else None, headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status


def _log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_router_forwards_the_key_to_vllms_own_check(tmp_path):
    """The pinned vllm-router in front of a prefill and a decode server guarded by vLLM 0.33.0's
    own middleware, each started as the rendered start script starts it (the key in the
    environment variable the script sets, the rendered argv): completions and chat through the
    router reach both with the key, a server refuses a call without it, a router holding the
    wrong key gets no answer, and the router itself serves a client that sends no key (why
    only the gateway may reach it)."""
    from coral_iac.bootstrap import VLLM_ROUTER_VERSION
    from coral_iac.engine_args import RouterSpec, router_argv, vllm_argv
    from tests.deploy.test_bootstrap import cases

    assert VLLM_PYTHON.exists() and ROUTER.exists(), "scripts/vllm_env creates .vllm-venv"
    version = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == VLLM_ROUTER_VERSION  # the router the nodes install
    key = "s3cret-key"
    prefill, decode = cases()["disaggregated-prefill"][0], cases()["disaggregated-decode"][0]
    keyed = {"api_key_secret": SECRET}
    script = _start_script(render_user_data(decode.model_copy(update=keyed), ""))
    (router_env,) = re.findall(r'(\w+)="\$\{VLLM_API_KEY\}" \\\n\s*\S+/vllm-router ', script)
    worker_env = re.findall(r"^export (VLLM_API_KEY)$", script, re.M)
    assert worker_env == ["VLLM_API_KEY"]
    env = os.environ | {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    ports = {name: _free_port() for name in ("prefill", "decode", "router", "wrong")}
    logs = {name: tmp_path / f"{name}.log" for name in ("prefill", "decode")}
    procs: list[subprocess.Popen] = []
    out = (tmp_path / "processes.log").open("w")
    try:
        for name, boot in (("prefill", prefill), ("decode", decode)):
            argv = vllm_argv(boot, boot.processes[0], "")
            argv[argv.index("--port") + 1] = str(ports[name])
            procs.append(
                subprocess.Popen(
                    [str(VLLM_PYTHON), str(REPO / "tests" / "vllm_pd_worker.py"),
                     str(ports[name]), str(logs[name]), json.dumps(argv)],
                    env=env | {"VLLM_API_KEY": key}, stdout=out, stderr=out,
                )
            )  # fmt: skip
        for name, proc in zip(("prefill", "decode"), procs, strict=True):
            _wait_http(ports[name], proc, name)
        spec = RouterSpec(
            prefill_urls=[f"http://127.0.0.1:{ports['prefill']}"],
            decode_urls=[f"http://127.0.0.1:{ports['decode']}"],
        )
        for name, held in (("router", key), ("wrong", "nope")):
            argv = router_argv(spec, ports[name]) + ["--prefill", spec.prefill_urls[0]]
            argv[argv.index("--host") + 1] = "127.0.0.1"
            argv += ["--prometheus-port", str(_free_port())]
            procs.append(
                subprocess.Popen(
                    [str(ROUTER), *argv], env=env | {router_env: held}, stdout=out, stderr=out
                )
            )
        _wait_http(ports["router"], procs[2], "vllm-router")
        _wait_http(ports["wrong"], procs[3], "vllm-router (wrong key)")

        direct = {
            "no key": _call(ports["decode"], "/v1/models", None),
            "wrong key": _call(ports["decode"], "/v1/models", "nope"),
            "key": _call(ports["decode"], "/v1/models", key),
            "health": _call(ports["prefill"], "/health", None),
            "metrics": _call(ports["prefill"], "/metrics", None),  # the drain script reads it
        }
        completion = {"model": "qwen3-32b", "prompt": "hi", "max_tokens": 4}
        chat = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}
        before = {name: len(_log(path)) for name, path in logs.items()}
        routed = {
            "completion": _call(ports["router"], "/v1/completions", None, completion),
            "chat": _call(ports["router"], "/v1/chat/completions", "anything", chat),
        }
        seen = {name: _log(path)[before[name] :] for name, path in logs.items()}
        models = {  # passed on with the client's own header
            "no key": _call(ports["router"], "/v1/models", None),
            "key": _call(ports["router"], "/v1/models", key),
        }
        wrong = _call(ports["wrong"], "/v1/completions", key, completion)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        out.close()
    assert direct == {"no key": 401, "wrong key": 401, "key": 200, "health": 200, "metrics": 200}
    assert routed == {"completion": 200, "chat": 200}  # no client key needed at the router
    for name in ("prefill", "decode"):
        posts = [e for e in seen[name] if e["method"] == "POST"]
        assert [e["path"] for e in posts] == ["/v1/completions", "/v1/chat/completions"], name
        assert {e["auth"] for e in posts} == {f"Bearer {key}"}, name
    assert wrong != 200  # the servers, not the router, refuse a wrong key
    assert models == {"no key": 401, "key": 200}  # docs/gateway.md, "API key"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_rendered_scripts_with_a_key_pass_shellcheck(tmp_path, preview):
    result = preview("keyed", keyed_stack(tmp_path))
    scripts = []
    for r in result.of_type("aws:ec2/instance:Instance"):
        doc = yaml.safe_load(r.inputs["userData"])
        for f in doc["write_files"]:
            if f["path"].startswith("/usr/local/bin/"):
                scripts.append(f["content"])
    sync = yaml.safe_load(render_gateway_user_data("keyed", "us-east-2", 8000, SECRET))
    (synced,) = [
        f["content"] for f in sync["write_files"] if f["path"] == "/usr/local/bin/coral-gateway-sync"
    ]
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
    plan, key, backend = one_replica()
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


def test_a_new_key_is_accepted_before_the_old_one_goes_without_a_restart(tmp_path):
    """Key rotation through the rendered coral-gateway-sync (stand-ins for `aws`, for install's
    owner flags, and for systemctl, which reloads the real HAProxy master as Debian's unit does,
    with SIGUSR2): the secret gains the new key on a second line, then loses the old one. A
    client on the new key is never refused once the gateway took it, none on the old key
    before it was removed, and no replica ever sees a key (HAProxy strips it)."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed: scripts/test installs it (scripts/debian_tools)"
    plan, key, backend = one_replica()
    port = _free_port()
    live, keys = tmp_path / "haproxy.cfg", tmp_path / "coral-api-keys"

    def local(text: str) -> str:
        return text.replace("/etc/haproxy/haproxy.cfg", str(live)).replace(API_KEY_FILE, str(keys))

    config = local(
        render_haproxy_config(
            gateway_upstreams(plan, {key: backend.address}), "live", port, 100, api_key=True
        )
    )
    files = _files(render_gateway_user_data("live", "us-east-2", port, SECRET))
    sync = tmp_path / "sync"
    sync.write_text(local(files["/usr/local/bin/coral-gateway-sync"]))
    secret, pidfile, bin_dir = tmp_path / "secret", tmp_path / "haproxy.pid", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(
        f'#!/bin/sh\ncase "$*" in\n  *{SECRET}*) cat {secret} ;;\n'
        f"  *get-parameter*) echo {parameter_value(config)} ;;\nesac\n"
    )
    (bin_dir / "systemctl").write_text(
        f'#!/bin/sh\ncase "$*" in\n  reload-or-restart*) [ ! -f {pidfile} ] || kill -USR2 "$(cat {pidfile})" ;;\n'
        "esac\n"
    )
    install_stand_in(bin_dir)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/bin"}

    def sync_with(text: str) -> None:
        secret.write_text(text)
        r = subprocess.run(["bash", str(sync)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    def status(k: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        body = json.dumps({"model": "phi-4", "prompt": "hi", "max_tokens": 1})
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {k}"}
        conn.request("POST", "/phi-4/v1/completions", body, headers)
        response = conn.getresponse()
        response.read()
        conn.close()
        return response.status

    def settle(k: str, want: int) -> list[int]:
        """Statuses for key `k` until the reload is in (at most 5 s)."""
        seen = [status(k)]
        deadline = time.monotonic() + 5
        while seen[-1] != want and time.monotonic() < deadline:
            time.sleep(0.05)
            seen.append(status(k))
        return seen

    sync_with("old-key")
    assert keys.read_text() == "Bearer old-key\n"
    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen(
        [haproxy, "-W", "-db", "-p", str(pidfile), "-f", str(live)], stdout=log, stderr=log
    )
    try:
        _wait_until_listening(port, proc)
        assert (status("old-key"), status("new-key")) == (200, 401)
        sync_with("old-key\n  new-key \r\n\n")  # a second line, any whitespace around it
        assert keys.read_text() == "Bearer old-key\nBearer new-key\n"
        assert settle("new-key", 200)[-1] == 200
        assert status("old-key") == 200  # both keys while clients move
        sync_with("new-key\n")
        before = settle("old-key", 401)
        assert before[-1] == 401 and set(before) <= {200, 401}
        assert [status("new-key") for _ in range(5)] == [200] * 5
        assert proc.poll() is None  # reloaded, never restarted
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        backend.kill()
    assert backend.authorization and set(backend.authorization) == {None}


def test_a_world_open_api_with_a_key_names_the_secret():
    from coral_iac.deploy_settings import DeploySettings
    from coral_iac.exposure import exposure_warnings

    (line,) = exposure_warnings(DeploySettings(api_cidrs=["0.0.0.0/0"], api_key_secret=SECRET))
    assert "whole internet" in line and f"API key in secret '{SECRET}'" in line
    assert "plain HTTP" in line and "gateway.tls_secret" in line
    (https,) = exposure_warnings(
        DeploySettings(
            api_cidrs=["0.0.0.0/0"], api_key_secret=SECRET, gateway={"tls_secret": "coral/tls"}
        )
    )
    assert "plain HTTP" not in https and f"API key in secret '{SECRET}'" in https
    with pytest.raises(ValueError, match="api_key_secret"):
        DeploySettings(api_key_secret="")
