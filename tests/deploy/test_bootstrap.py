"""Rendered node bootstrap: golden files, cloud-init schema, shellcheck, vLLM's argument list.

Golden files live in tests/golden/bootstrap/<case>/; `CORAL_ACCEPT=1 scripts/test` rewrites them.
cloud-init and shellcheck are Debian tools that `scripts/test` installs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from coral_iac.bootstrap import (
    MASTER_ADDR_VAR,
    node_boots,
    render_start_script,
    render_user_data,
)
from coral_iac.engine_args import (
    EngineSettings,
    NodeBoot,
    RouterSpec,
    instance_engine,
    precision_group_bf16,
    vllm_argv,
)
from solver.catalog.model_cards import load_model_cards
from solver.errors import InputError
from solver.plan_schema import Instance
from solver.serving.serving_template import ServingTemplate, Stage, StageMember
from tests.conftest import REPO
from tests.factories import data_parallel_template
from tests.vllm_cli import check_replica

GOLDEN = REPO / "tests" / "golden" / "bootstrap"
CARDS = load_model_cards()
HEAD_IP = "10.0.7.21"
API_KEY_SECRET = "coral/api-key"
LAYERS = {m: card.layers for m, card in CARDS.items()}
HF = {m: card.hf_repo for m, card in CARDS.items()}


def template(model, phase, nodes, stages):
    """stages: [(layers, node, gpus, tp)] in pipeline order."""
    return ServingTemplate(
        key="+".join(nodes),
        model=model,
        phase=phase,
        mode="vllm",
        nodes=nodes,
        stages=[
            Stage(layers=j, members=[StageMember(node=n, gpus=g, tp=tp)]) for j, n, g, tp in stages
        ],
        throughput=100.0,
        unit="requests/s" if phase == "aggregated" else "tokens/s",
        stage_budget_ms=[100.0],
    )


def engine_for(model: str, pair: bool, bf16=(True,), seqs=256, tokens=8192) -> EngineSettings:
    return instance_engine(
        card=CARDS[model],
        max_model_len=8192,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        bf16=list(bf16),
        pair=pair,
        gpu_memory_utilization=0.9,
    )


def boots_for(
    t: ServingTemplate,
    disaggregated: bool,
    cloud="aws",
    region="us-east-2",
    api_port=8000,
    api_key_secret=None,
    market="on-demand",
    **kw,
) -> list[NodeBoot]:
    return node_boots(
        template=t,
        layers=LAYERS[t.model],
        cloud=cloud,
        region=region,
        stack="golden",
        replica_key=f"{t.model}/{t.phase}/{cloud}:{region}/{t.key}/0",
        hf_repo=HF[t.model],
        disaggregated=disaggregated,
        engine=engine_for(t.model, disaggregated, **kw),
        api_port=api_port,
        hf_token_secret="coral/hf-token",
        api_key_secret=api_key_secret,
        market=market,
    )


def cases() -> dict[str, list[NodeBoot]]:
    single = template("phi-4", "aggregated", ["l40sx1"], [(40, 0, [0], 1)])
    mixed = template(  # one process per GPU: l4x4's four GPUs, then the l40sx1
        "qwen3-32b",
        "aggregated",
        ["l40sx1", "l4x4"],
        [(10, 1, [0], 1), (10, 1, [1], 1), (10, 1, [2], 1), (10, 1, [3], 1), (24, 0, [0], 1)],
    )
    uniform = template(
        "llama3.1-70b",
        "aggregated",
        ["l4x4", "l4x4"],
        [(40, 0, [0, 1, 2, 3], 4), (40, 1, [0, 1, 2, 3], 4)],
    )
    prefill = template(
        "qwen3-32b", "prefill", ["l40sx1", "l40sx1"], [(30, 0, [0], 1), (34, 1, [0], 1)]
    )
    decode = template("qwen3-32b", "decode", ["l40sx4"], [(64, 0, [0, 1, 2, 3], 4)])
    router = RouterSpec(
        prefill_urls=[f"http://{HEAD_IP}:8100"], decode_urls=["http://127.0.0.1:8200"]
    )
    pd_decode = [
        b.model_copy(update={"router": router})
        for b in boots_for(decode, True, seqs=96, tokens=8192)
    ]
    return {
        "single-node": boots_for(single, False),
        "mixed-node-sizes-per-gpu": boots_for(mixed, False),
        "uniform-tp-multi-node": boots_for(uniform, False, cloud="gcp", region="us-central1"),
        "disaggregated-prefill": boots_for(prefill, True, seqs=96, tokens=8192),
        "disaggregated-decode": pd_decode,
        # deploy.api_key_secret: every vLLM server requires the key, the router forwards it
        "api-key-disaggregated-prefill": boots_for(
            prefill, True, seqs=96, tokens=8192, api_key_secret=API_KEY_SECRET
        ),
        "api-key-disaggregated-decode": [
            b.model_copy(update={"router": router})
            for b in boots_for(decode, True, seqs=96, tokens=8192, api_key_secret=API_KEY_SECRET)
        ],
        "api-key-uniform-tp-multi-node": boots_for(
            uniform, False, cloud="gcp", region="us-central1", api_key_secret=API_KEY_SECRET
        ),
        # spot: every node adds the interruption handler (the head closes its API port)
        "spot-single-node": boots_for(single, False, market="spot"),
        "spot-uniform-tp-multi-node": boots_for(
            uniform, False, cloud="gcp", region="us-central1", market="spot"
        ),
    }


def rendered(boot: NodeBoot) -> str:
    return render_user_data(boot, "" if boot.is_head else HEAD_IP)


@pytest.mark.parametrize("case", sorted(cases()))
def test_user_data_matches_golden(case):
    for boot in cases()[case]:
        path = GOLDEN / case / f"node{boot.node_index}.yaml"
        text = rendered(boot)
        if os.environ.get("CORAL_ACCEPT") == "1":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        assert path.exists(), f"no golden file {path}; run with CORAL_ACCEPT=1 to create it"
        assert text == path.read_text(encoding="utf-8"), (
            f"{path} differs (CORAL_ACCEPT=1 to accept)"
        )


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: scripts/test installs it (apt-get install {name})"
    return path


@pytest.mark.parametrize("case", sorted(cases()))
def test_user_data_passes_cloud_init_schema(case, tmp_path):
    cloud_init = _tool("cloud-init")
    for boot in cases()[case]:
        f = tmp_path / f"node{boot.node_index}.yaml"
        f.write_text(rendered(boot), encoding="utf-8")
        r = subprocess.run(
            [cloud_init, "schema", "--config-file", str(f)], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("case", sorted(cases()))
def test_rendered_scripts_pass_shellcheck(case, tmp_path):
    shellcheck = _tool("shellcheck")
    for boot in cases()[case]:
        doc = yaml.safe_load(rendered(boot))
        scripts = [w for w in doc["write_files"] if w["path"].startswith("/usr/local/bin/")]
        assert len(scripts) == (3 if boot.is_spot else 2)  # spot: coral-node-interruption
        for w in scripts:
            f = tmp_path / w["path"].rsplit("/", 1)[1]
            f.write_text(w["content"], encoding="utf-8")
            r = subprocess.run([shellcheck, "--shell=bash", str(f)], capture_output=True, text=True)
            assert r.returncode == 0, f"{case} {w['path']}:\n{r.stdout}"


@pytest.mark.parametrize("case", sorted(cases()))
def test_vllm_command_lines_parse_for_the_pinned_version(case):
    boots = cases()[case]
    argvs = [vllm_argv(b, p, HEAD_IP) for b in boots for p in b.processes]
    check_replica(argvs, boots[0].layer_partition, LAYERS[boots[0].model])
    for b in boots:  # the rendered script carries exactly these arguments, quoted for bash
        assert MASTER_ADDR_VAR in rendered(b) or b.nnodes == 1


def test_user_data_holds_no_secret(monkeypatch):
    """The token is fetched at boot from the secret manager; nothing secret is rendered."""
    monkeypatch.setenv("HF_TOKEN", "hf_THIS_MUST_NOT_LEAK")
    for boots in cases().values():
        for b in boots:
            text = rendered(b)
            # HF_TOKEN only from the secret manager at boot, held in a shell variable
            assert "hf_THIS_MUST_NOT_LEAK" not in text and "HF_TOKEN=" not in text.replace(
                'HF_TOKEN="${token}"', ""
            )
            assert 'token="$(hf_token)"' in text
            assert (
                "secretsmanager get-secret-value" in text
                or "gcloud secrets versions access" in text
            )


def test_head_is_the_node_hosting_rank_zero():
    boots = cases()["mixed-node-sizes-per-gpu"]
    head = [b for b in boots if b.is_head]
    assert len(head) == 1 and head[0].node_index == 1  # the l4x4 node hosts stages 0-3
    assert [p.rank for p in head[0].processes] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("stages", "disaggregated", "phase", "message"),
    [
        ([(32, 0, [0], 1), (32, 1, [0], 1)], True, "decode", "PP=1"),
        ([(32, 0, [0], 1), (30, 1, [0], 1)], False, "aggregated", "layer split"),
        ([(32, 0, [0, 1], 2), (32, 1, [0], 1)], False, "aggregated", "TP sizes"),
    ],
)
def test_unrunnable_templates_fail_before_boot(stages, disaggregated, phase, message):
    t = template("qwen3-32b", phase, ["l40sx4", "l40sx1"], stages)
    with pytest.raises(InputError, match=message):
        boots_for(t, disaggregated)


def test_data_parallel_stage_is_rejected():
    with pytest.raises(InputError, match="data parallel"):
        boots_for(data_parallel_template("qwen3-32b", 64), True)


@pytest.mark.parametrize("api_port", [8000, 8100, 8200, 29501, 5600])
def test_ports_on_a_decode_node_never_collide(api_port):
    """A decode node binds vLLM's HTTP port, the router's API port, NIXL's side channel and (as a
    head) torch.distributed's master port: all distinct whatever deploy.api_port is."""
    boot = boots_for(
        template("qwen3-32b", "decode", ["l40sx4"], [(64, 0, [0, 1, 2, 3], 4)]),
        True,
        api_port=api_port,
    )[0]
    ports = boot.ports
    bound = [ports.api, ports.decode_http, ports.prefill_http, ports.master, ports.nixl]
    assert len(set(bound)) == len(bound) and ports.api == api_port
    argv = vllm_argv(boot, boot.processes[0], HEAD_IP)
    assert argv[argv.index("--port") + 1] == str(ports.decode_http) != str(api_port)


def test_engine_settings_follow_the_card_and_the_gpus():
    llama1 = engine_for("llama1-30b", False)
    assert llama1.max_model_len == 2048  # the card's max_context, below deploy's 8192
    assert engine_for("llama2-70b", False).max_model_len == 4096
    small = engine_for("phi-4", False, seqs=512, tokens=128)
    assert small.max_num_batched_tokens == 512  # raised to max_num_seqs, as vLLM requires
    mixed = engine_for("qwen3-32b", True, bf16=(True, False))
    assert (mixed.dtype, mixed.attention_backend) == ("float16", "TRITON_ATTN")
    assert engine_for("qwen3-32b", True).attention_backend == "FLASH_ATTN"
    assert engine_for("qwen3-32b", False).attention_backend is None
    big, small_model = engine_for("llama3.1-70b", False), engine_for("phi-4", False)
    assert big.distributed_timeout_s > small_model.distributed_timeout_s > 600


def test_engine_settings_refuse_batched_tokens_below_sequences():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineSettings.model_validate(
            engine_for("phi-4", False).model_dump() | {"max_num_seqs": 9000}
        )


def test_every_shell_value_in_node_env_is_quoted():
    """A stack or model name with shell metacharacters cannot break out of node.env."""
    boot = cases()["single-node"][0].model_copy(update={"stack": "a b;$(reboot)"})
    env = yaml.safe_load(rendered(boot))["write_files"][0]["content"]
    assert "CORAL_STACK='a b;$(reboot)'" in env
    for line in env.splitlines():
        key, _, value = line.partition("=")
        assert (
            value == ""
            or value.startswith("'")
            or all(c.isalnum() or c in "-_./:,=@" for c in value)
        ), line


def test_a_v100_instance_is_refused_with_the_wheels_cuda_reason(perf):
    inst = Instance(
        key="phi-4/aggregated/aws:us-east-2/v100x1/0",
        model="phi-4",
        phase="aggregated",
        cloud="aws",
        region="us-east-2",
        template="v100x1",
        index=0,
        nodes=["v100x1"],
        usd_per_hour=3.06,
        throughput=1.0,
    )
    with pytest.raises(InputError, match="(?s)no kernels for v100.*sm_70.*remove v100x1"):
        precision_group_bf16(None, inst, perf.catalog)
    ok = inst.model_copy(update={"nodes": ["t4x1"]})
    assert precision_group_bf16(None, ok, perf.catalog) == [False]


def _fetch_uv_program(script: str) -> str:
    return script.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]


@pytest.mark.parametrize("tampered", [False, True])
def test_uv_comes_from_its_wheel_without_pip_or_venv(tmp_path, tampered):
    """Ubuntu 24.04 images have neither pip nor python3-venv: the start script fetches uv's
    wheel from the index's JSON API with python3's standard library, checks its sha256 and
    unpacks the binary (a local index on loopback stands in for PyPI)."""
    import hashlib
    import http.server
    import io
    import platform
    import threading
    import zipfile

    version, arch = "0.13.9", platform.machine()
    name = f"uv-{version}-py3-none-manylinux_2_17_{arch}.manylinux2014_{arch}.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"uv-{version}.data/scripts/uv", "#!/bin/sh\necho uv-stand-in\n")
    wheel = buf.getvalue()
    digest = hashlib.sha256(b"other bytes" if tampered else wheel).hexdigest()
    listing = json.dumps(
        {"files": [{"filename": name, "url": f"../../files/{name}", "hashes": {"sha256": digest}}]}
    ).encode()

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = listing if self.path == "/simple/uv/" else wheel
            ok = self.path in ("/simple/uv/", f"/files/{name}")
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(body if ok else b"")

        def log_message(self, *_args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (single,) = cases()["single-node"]
        program = _fetch_uv_program(render_start_script(single))
        index = f"http://127.0.0.1:{server.server_address[1]}/simple"
        r = subprocess.run(["python3", "-", version, str(tmp_path / "bin"), index],
                           input=program, capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    if tampered:
        assert r.returncode != 0 and "does not match the index's sha256" in r.stderr
        assert not (tmp_path / "bin" / "uv").exists()
    else:
        assert r.returncode == 0, r.stderr
        out = subprocess.run([str(tmp_path / "bin" / "uv")], capture_output=True, text=True)
        assert out.stdout.strip() == "uv-stand-in"


def _stage_shards_program(script: str) -> str:
    return script.split("stage_shards() {", 1)[1].split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]


def test_each_node_downloads_only_the_shards_of_its_stages(tmp_path):
    """Regression: every node downloaded the whole repository (qwen3-235b: 470 GB per node,
    about 80 minutes). The start script now picks the shards holding its stages' layers from the
    index's weight_map (plus the ones with embeddings, norm and LM head)."""
    (prefill0, prefill1) = cases()["disaggregated-prefill"]  # qwen3-32b: 30 + 34 layers
    index = {"weight_map": {"model.embed_tokens.weight": "s0.safetensors", "lm_head.weight":
             "s9.safetensors", "model.norm.weight": "s9.safetensors"}}  # fmt: skip
    for layer in range(64):  # 8 layers per shard: s1 .. s8
        index["weight_map"][f"model.layers.{layer}.mlp.up_proj.weight"] = f"s{1 + layer // 8}.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    def shards(boot) -> list[str]:
        program = _stage_shards_program(render_start_script(boot))
        r = subprocess.run(["python3", "-", "list", str(tmp_path), boot.layer_partition,
                            ",".join(str(p.rank) for p in boot.processes)],
                           input=program, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert prefill0.layer_partition == "30,34"
    # layers 0-29 are in s1-s4 (s4: 24-31); 30-63 in s4-s8
    assert shards(prefill0) == ["s0.safetensors", "s1.safetensors", "s2.safetensors",
                                "s3.safetensors", "s4.safetensors", "s9.safetensors"]  # fmt: skip
    assert shards(prefill1) == ["s0.safetensors", "s4.safetensors", "s5.safetensors",
                                "s6.safetensors", "s7.safetensors", "s8.safetensors",
                                "s9.safetensors"]  # fmt: skip
    (tmp_path / "model.safetensors.index.json").unlink()  # one shard, no index
    assert shards(prefill0) == ["model.safetensors"]


def test_the_index_keeps_only_the_shards_a_node_downloaded(tmp_path):
    """vLLM refuses an index naming missing files ("Weight files referenced in index but
    missing", found by the real-serving test): after the download the index is pruned."""
    (boot, _) = cases()["disaggregated-prefill"]
    index = {"metadata": {}, "weight_map": {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "s1.safetensors").write_bytes(b"")
    program = _stage_shards_program(render_start_script(boot))
    r = subprocess.run(["python3", "-", "prune", str(tmp_path), boot.layer_partition, "0"],
                       input=program, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    pruned = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert pruned == {"metadata": {}, "weight_map": {"a.weight": "s1.safetensors"}}


def _shell_function(script: str, name: str) -> str:
    """One function of a rendered script, from its `name() {` line to its closing brace."""
    start = script.index(f"\n{name}() {{\n") + 1
    return script[start : script.index("\n}\n", start) + 3]


@pytest.mark.parametrize(
    ("health", "restarted_after"),
    [
        ("up down up down down up up up up up", None),  # a busy prefill misses polls: no restart
        ("up up down down down", 4),  # gone for 3 polls: the router restarts without it
    ],
)
def test_the_router_restarts_only_when_its_prefills_stay_changed(tmp_path, health, restarted_after):
    """Regression: the router restarted when one /health poll of a busy prefill timed out, which
    cut its requests in flight (the real-serving test's pair, on a loaded CPU). The decode node's
    watch restarts it only once the set of healthy prefills has differed for 3 polls in a row.
    `curl` answers the prefill's /health from `health` (the first answer is the start's check),
    `sleep` is instant and ends the run after the schedule."""
    (boot,) = cases()["disaggregated-decode"]
    script = render_start_script(boot)
    router = tmp_path / "vllm-router"
    router.write_text("#!/bin/sh\nexec sleep 600\n")
    router.chmod(0o755)
    (tmp_path / "calls").touch()
    functions = _shell_function(script, "healthy_prefills") + _shell_function(script, "serve_router")
    program = f"""
answers=({health})
polls=0
curl() {{  # runs in healthy_prefills' subshell: the count of answers lives in a file
  local calls
  calls="$(wc -l < {tmp_path / "calls"})"
  echo >> {tmp_path / "calls"}
  [ "${{answers[calls]:-up}}" = up ]
}}
sleep() {{
  polls=$((polls + 1))
  echo "poll ${{polls}}" >&2
  if [ "${{polls}}" -gt {len(health.split())} ]; then kill "${{pid}}"; fi
}}
{functions.replace("/opt/coral/venv/bin/vllm-router", str(router))}
serve_router
"""
    r = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    polls = [line for line in r.stderr.splitlines() if line.startswith("poll ")]
    if restarted_after is None:
        assert "restarting the router" not in r.stderr, r.stderr
        assert r.returncode != 1 and len(polls) == len(health.split()) + 1, r.stderr
    else:
        assert r.returncode == 1 and "healthy prefills changed" in r.stderr, r.stderr
        assert len(polls) == restarted_after, r.stderr
