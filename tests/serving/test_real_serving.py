"""Rendered nodes serve for real: their start scripts boot vLLM (on CPU, a tiny model) and the
replica answers completions. Run by scripts/test_serving (marker `serving`; minutes per boot).

The stand-ins for what a cloud node has and this machine lacks are listed in `harness`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from coral_iac.bootstrap import render_user_data
from coral_iac.components import router_spec
from coral_iac.gateway_config import (
    API_KEY_FILE,
    gateway_upstreams,
    render_haproxy_config,
    render_health_script,
    server_name,
)
from tests.deploy.test_bootstrap import HEAD_IP, LAYERS, boots_for, template
from tests.deploy.test_gateway import make_plan, serving_keys
from tests.deploy.test_gateway_live import _wait_until_listening
from tests.serving import harness
from tests.serving.harness import CPU_FLAGS, Metadata, call, fake_cli, free_port, lay_out

pytestmark = pytest.mark.serving
REPO = Path(__file__).resolve().parents[2]
KEY = "test-api-key-7f3a"
TINY_LAYERS = 4
BOOT_S = 900  # a boot takes 1-3 minutes here, longer with a cold compile cache on a busy machine
WARM_UP_S = 500  # a prefill/decode pair's warm-up: past the decode's 480 s registration timeout


def make_tiny(folder: Path, architecture: str = "llama", layers: int = TINY_LAYERS) -> Path:
    """A tiny model of `architecture` (tiny_model.py's ARCHITECTURES) made under `folder`."""
    assert harness.CPU_VENV.exists(), "run scripts/vllm_cpu_env (scripts/test_serving does)"
    out = folder / "model"
    corpus = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    subprocess.run(
        [str(harness.CPU_VENV / "bin/python"), str(REPO / "tests/serving/tiny_model.py"),
         str(out), "--architecture", architecture, "--layers", str(layers),
         "--corpus", *map(str, corpus)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def log_tails(logs: dict[str, Path], lines: int = 15) -> str:
    """The last `lines` lines of each process's log, for a failure message."""
    return "\n".join(
        f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        for name, path in logs.items() if path.exists()
    )  # fmt: skip


def running_argv(pid: int) -> list[str]:
    """The argv of the `vllm serve` process under the start script `pid` (its process group)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != os.getpgid(pid):
                continue
            argv = (entry / "cmdline").read_bytes().decode().split("\0")[:-1]
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        if "serve" in argv and any(a.endswith("/vllm") for a in argv[:2]):
            return argv[argv.index("serve") + 1 :]
    return []


def expected_argv(rendered: list[str]) -> list[str]:
    """The rendered argv as the script expands it here, with CPU_FLAGS applied."""
    out = [a.replace("${MASTER_ADDR}", "127.0.0.1") for a in rendered]
    for flag, (value, _why) in CPU_FLAGS.items():
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


@contextmanager
def gateway(tmp_path: Path, model: str, head: str) -> Iterator[tuple[int, int, str]]:
    """The gateway's rendered HAProxy configuration, with the API key, for a plan of one
    replica of `model` whose head answers at `head` (host:port), run by the real HAProxy;
    yields (its API port, its statistics port, the replica's key)."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed: scripts/test_serving installs it"
    plan = make_plan([(model, "aggregated", "l40sx1*2", "l40sx1", 1.0, 1)])
    (key,) = serving_keys(plan)
    port, stats = free_port(), free_port()
    config = render_haproxy_config(
        gateway_upstreams(plan, {key: head}), "serving", port, 500, True, stats_port=stats
    )
    keys = tmp_path / "gateway-keys"
    keys.write_text(f"Bearer {KEY}\n")  # as coral-gateway-sync writes it
    cfg = tmp_path / "gateway.cfg"
    cfg.write_text(config.replace(API_KEY_FILE, str(keys)))
    with (tmp_path / "gateway.log").open("w") as log:
        proc = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=log)
    try:
        _wait_until_listening(port, proc)
        yield port, stats, key
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def published_health(tmp_path: Path, stats: int) -> list[str]:
    """Run the rendered coral-gateway-health against the gateway's statistics until it
    publishes (a stand-in `aws` records the call; 30 s at most); the replicas it reports up."""
    bin_dir, state = tmp_path / "health-bin", tmp_path / "health-state"
    bin_dir.mkdir(exist_ok=True)
    state.mkdir(exist_ok=True)
    calls = tmp_path / "health-calls"
    (bin_dir / "aws").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\n')
    (bin_dir / "aws").chmod(0o755)
    script = tmp_path / "coral-gateway-health"
    script.write_text(render_health_script("serving", "us-east-2", stats, str(state)))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        subprocess.run(["bash", str(script)], env=env, check=True, capture_output=True)
        lines = calls.read_text().splitlines() if calls.exists() else []
        if lines and json.loads(lines[-1].split("--value ", 1)[1])["up"]:
            return list(json.loads(lines[-1].split("--value ", 1)[1])["up"])
        time.sleep(0.5)
    return []


def test_a_two_node_replica_with_an_uneven_split_serves_through_its_head(tiny_model, tmp_path):
    """llama3.1-70b on two l40sx1 nodes, 20 + 60 layers (1 + 3 on the tiny model), rendered as
    behind a keyed gateway (the replica holds no key; the gateway checks it and removes it):
    both nodes run their rendered start script, each fetching only its stage's weight shards;
    the head serves completions, through the gateway only with the key; the drain script waits
    for a request in flight; after the head dies the headless rank leaves (exit 1) and both
    come back and serve again."""
    port = free_port()
    t = template("llama3.1-70b", "aggregated", ["l40sx1", "l40sx1"],
                 [(20, 0, [0], 1), (60, 1, [0], 1)])  # fmt: skip
    boots = boots_for(t, False, api_port=port)  # behind the gateway: no key on the replica
    meta = Metadata()
    bin_dir = tmp_path / "bin"
    fake_cli(bin_dir, {"coral/hf-token": "unused"})
    head = lay_out(render_user_data(boots[0], ""), tmp_path / "n0", meta, tiny_model,
                   TINY_LAYERS, cpu_core=0)  # fmt: skip
    rank = lay_out(render_user_data(boots[1], HEAD_IP), tmp_path / "n1", meta, tiny_model,
                   TINY_LAYERS, cpu_core=1 % (os.cpu_count() or 1))  # fmt: skip
    assert head.env["CORAL_LAYER_PARTITION"] == rank.env["CORAL_LAYER_PARTITION"] == "1,3"
    url = f"http://127.0.0.1:{port}"
    logs = {n: tmp_path / f"{n}.log" for n in ("head", "rank")}
    procs = []
    try:
        procs.append(harness.start(rank, "0", bin_dir, logs["rank"]))
        procs.append(harness.start(head, "0", bin_dir, logs["head"]))
        harness.wait_healthy(url, procs, BOOT_S)
        # Each node fetched only the shards holding its layers (1 and 3 of the tiny model's 4,
        # in 7 shards: layer 0 in shards 2-3, layers 1-3 in 3-5 and 7), and vLLM loaded them.
        def downloaded(node: harness.Node) -> set[str]:
            return set((node.root / "downloaded.txt").read_text().split())

        shards = {f"model-0000{k}-of-00007.safetensors" for k in range(1, 8)}
        assert downloaded(head) & shards == shards - {f"model-0000{k}-of-00007.safetensors"
                                                       for k in (4, 5)}  # fmt: skip
        assert downloaded(rank) & shards == shards - {"model-00002-of-00007.safetensors"}
        assert {"config.json", "tokenizer.json"} <= downloaded(head) & downloaded(rank)
        # Each process runs exactly its rendered flags (CPU_FLAGS lists any that differ).
        assert running_argv(procs[1].pid) == expected_argv(head.argvs[0])
        assert running_argv(procs[0].pid) == expected_argv(rank.argvs[0])

        body = {"model": "llama3.1-70b", "prompt": "The plan", "max_tokens": 8, "temperature": 0}
        assert call("GET", f"{url}/health")[0] == 200
        status, text = call("POST", f"{url}/v1/completions", body)
        assert status == 200 and '"text"' in text, text

        # Through the gateway: the key checked there, the same greedy completion, and the
        # health report lists the replica once HAProxy's checks of the real /health pass.
        with gateway(tmp_path, "llama3.1-70b", f"127.0.0.1:{port}") as (gw, stats, key):
            routed = f"http://127.0.0.1:{gw}/llama3.1-70b/v1/completions"
            assert call("POST", routed, body)[0] == 401
            assert call("POST", routed, body, key="wrong")[0] == 401
            status, via = call("POST", routed, body, key=KEY)
            assert status == 200, via
            assert json.loads(via)["choices"][0]["text"] == json.loads(text)["choices"][0]["text"]
            assert published_health(tmp_path, stats) == [server_name(key)]

        # The drain waits for a request in flight, then returns.
        long = body | {"max_tokens": 400, "ignore_eos": True}
        done: dict[str, object] = {}
        thread = threading.Thread(
            target=lambda: done.update(r=call("POST", f"{url}/v1/completions", long, key=KEY))
        )
        thread.start()
        time.sleep(1.0)
        env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
        subprocess.run(["bash", str(head.drain_script()), "0"], check=True, env=env, timeout=200)
        assert "r" in done and done["r"][0] == 200, "the drain returned with a request in flight"  # type: ignore[index]
        thread.join()

        # The head dies: systemd restarts it (Restart=on-failure, RestartSec=10); the headless
        # rank sees it gone and exits 1 so that it restarts into the head's new engine.
        harness.stop(procs[1], sig=9)
        time.sleep(10)
        procs[1] = harness.start(head, "0", bin_dir, logs["head"])
        procs[0].wait(timeout=240)
        assert procs[0].returncode == 1, logs["rank"].read_text()[-2000:]
        time.sleep(10)
        procs[0] = harness.start(rank, "0", bin_dir, logs["rank"])
        harness.wait_healthy(url, procs, BOOT_S)
        status, text = call("POST", f"{url}/v1/completions", body, key=KEY)
        assert status == 200, text
    finally:
        for p in procs:
            harness.stop(p)
        meta.close()


def test_a_prefill_decode_pair_serves_through_its_router_and_the_gateway(tiny_model, tmp_path):
    """llama3.1-70b as one prefill and one decode instance (one l40sx1 node each, KV over
    NIXL), rendered as behind a keyed gateway (no key on the nodes): each node runs its
    rendered start script; the decode node's router, rendered with the prefill head's address
    as the program renders it, serves completions whose prompts the prefill instance computed;
    the gateway in front of the router checks the key and serves the same greedy text."""
    api = free_port()
    prefill_t = template("llama3.1-70b", "prefill", ["l40sx1"], [(80, 0, [0], 1)])
    decode_t = template("llama3.1-70b", "decode", ["l40sx1"], [(80, 0, [0], 1)])
    (prefill_boot,) = boots_for(prefill_t, True, api_port=api)  # behind the gateway: no key
    (decode_boot,) = boots_for(decode_t, True, api_port=api)
    decode_boot = decode_boot.model_copy(
        update={"router": router_spec(["127.0.0.1"], decode_boot.ports)}
    )
    meta = Metadata()
    bin_dir = tmp_path / "bin"
    fake_cli(bin_dir, {"coral/hf-token": "unused"})
    models = tmp_path / "models"
    prefill = lay_out(render_user_data(prefill_boot, ""), tmp_path / "p", meta, tiny_model,
                      TINY_LAYERS, cpu_core=0, models_dir=models)  # fmt: skip
    decode = lay_out(render_user_data(decode_boot, ""), tmp_path / "d", meta, tiny_model,
                     TINY_LAYERS, cpu_core=1 % (os.cpu_count() or 1), models_dir=models)  # fmt: skip
    harness.share_host(decode, free_port())
    prefill_url = f"http://127.0.0.1:{prefill_boot.ports.prefill_http}"
    decode_url = f"http://127.0.0.1:{decode_boot.ports.decode_http}"
    router_url = f"http://127.0.0.1:{api}"
    logs = {n: tmp_path / f"{n}.log" for n in ("prefill", "decode", "router")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(harness.start(prefill, "0", bin_dir, logs["prefill"]))
        procs.append(harness.start(decode, "0", bin_dir, logs["decode"]))
        harness.wait_healthy(prefill_url, procs, BOOT_S)
        harness.wait_healthy(decode_url, procs, BOOT_S)
        assert running_argv(procs[0].pid) == expected_argv(prefill.argvs[0])
        assert running_argv(procs[1].pid) == expected_argv(decode.argvs[0])
        # The router starts once a prefill answers /health (else it exits for systemd to retry).
        procs.append(harness.start(decode, "router", bin_dir, logs["router"]))
        harness.wait_healthy(router_url, procs, 120)

        body = {"model": "llama3.1-70b", "prompt": "The plan", "max_tokens": 8, "temperature": 0}
        # A fresh pair's first requests can hang in vLLM's NIXL transfer (upstream issue
        # vllm-project/vllm#53095): on this busy CPU the decode's handshake with the prefill
        # can finish only after the prefill's 30 s KV lease has expired, and a stranded request
        # waits out the decode's 480 s registration timeout. Warm up until one answers (or that
        # timeout has passed), then require answers.
        warm_up = time.monotonic()
        while time.monotonic() - warm_up < WARM_UP_S:
            if call("POST", f"{router_url}/v1/completions", body, timeout=90)[0] == 200:
                break
        status, text = call("POST", f"{router_url}/v1/completions", body, timeout=120)
        # Random weights may pick tokens that decode to nothing: count them instead.
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] > 0, (
            f"{text} after {time.monotonic() - warm_up:.0f} s\n{log_tails(logs)}"
        )
        metrics = call("GET", f"{prefill_url}/metrics")[1]
        prompts = [line for line in metrics.splitlines()
                   if line.startswith("vllm:prompt_tokens_total")]  # fmt: skip
        assert prompts and float(prompts[0].rsplit(" ", 1)[1]) > 0, "the prefill computed nothing"

        with gateway(tmp_path, "llama3.1-70b", f"127.0.0.1:{api}") as (gw, stats, key):
            routed = f"http://127.0.0.1:{gw}/llama3.1-70b/v1/completions"
            assert call("POST", routed, body)[0] == 401
            status, via = call("POST", routed, body, key=KEY, timeout=120)
            assert status == 200, via
            assert json.loads(via)["choices"][0]["text"] == json.loads(text)["choices"][0]["text"]
            assert published_health(tmp_path, stats) == [server_name(key)]
    finally:
        for p in procs:
            harness.stop(p)
        meta.close()


# The model cards' other architectures (their config.json's model_type); Llama is above.
CARD_ARCHITECTURES = {
    "phi-4": "phi3",
    "qwen3-32b": "qwen3",
    "qwen3-235b-a22b": "qwen3_moe",
    "gpt-oss-20b": "gpt_oss",
}


@pytest.mark.parametrize("model", sorted(CARD_ARCHITECTURES))
def test_each_card_architecture_serves_from_its_rendered_node(model, tmp_path):
    """A one-node replica of the card, rendered as for any aggregated instance (the card's
    engine flags, the API key), boots on a tiny model of the card's architecture and serves a
    completion with exactly its rendered flags."""
    tiny = make_tiny(tmp_path / "tiny", CARD_ARCHITECTURES[model], layers=2)
    port = free_port()
    t = template(model, "aggregated", ["l40sx1"], [(LAYERS[model], 0, [0], 1)])
    (boot,) = boots_for(t, False, api_port=port, api_key_secret="coral/api-key")
    meta = Metadata()
    bin_dir = tmp_path / "bin"
    fake_cli(bin_dir, {"coral/api-key": KEY, "coral/hf-token": "unused"})
    node = lay_out(render_user_data(boot, ""), tmp_path / "n0", meta, tiny, 2, cpu_core=0)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "node.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(harness.start(node, "0", bin_dir, log))
        try:
            harness.wait_healthy(url, procs, BOOT_S)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text()[-3000:]}") from None
        assert running_argv(procs[0].pid) == expected_argv(node.argvs[0])
        # Random weights may pick the end-of-sequence token early (they did on CI's CPUs):
        # ignore it, so the count below is the rendered engine's, not the weights' luck.
        body = {"model": model, "prompt": "The plan", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        assert call("POST", f"{url}/v1/completions", body)[0] == 401
        status, text = call("POST", f"{url}/v1/completions", body, key=KEY)
        # Random weights may pick tokens that decode to nothing: count them instead.
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 8, text
    finally:
        for p in procs:
            harness.stop(p)
        meta.close()
