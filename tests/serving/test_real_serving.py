"""Rendered nodes serve for real: their start scripts boot vLLM (on CPU, a tiny model) and the
replica answers completions. Run by scripts/test_serving (marker `serving`; minutes per boot).

The stand-ins for what a cloud node has and this machine lacks are listed in `harness`."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from coral_iac.bootstrap import render_user_data
from tests.serving import harness
from tests.serving.harness import CPU_FLAGS, Metadata, call, fake_cli, free_port, lay_out
from tests.unit.test_bootstrap import HEAD_IP, boots_for, template

pytestmark = pytest.mark.serving
REPO = Path(__file__).resolve().parents[2]
KEY = "test-api-key-7f3a"
TINY_LAYERS = 4
BOOT_S = 900  # a boot takes 1-3 minutes here, longer with a cold compile cache on a busy machine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    import subprocess

    assert harness.CPU_VENV.exists(), "run scripts/vllm_cpu_env (scripts/test_serving does)"
    out = tmp_path_factory.mktemp("tiny") / "model"
    corpus = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    subprocess.run(
        [str(harness.CPU_VENV / "bin/python"), str(REPO / "tests/serving/tiny_model.py"),
         str(out), "--layers", str(TINY_LAYERS), "--corpus", *map(str, corpus)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


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


def test_a_two_node_replica_with_an_uneven_split_serves_through_its_head(tiny_model, tmp_path):
    """llama3.1-70b on two l40sx1 nodes, 20 + 60 layers (1 + 3 on the tiny model), API key on:
    both nodes run their rendered start script, each fetching only its stage's weight shards;
    the head serves completions, /v1 needs the key,
    /health does not; the drain script waits for a request in flight; after the head dies the
    headless rank leaves (exit 1) and both come back and serve again."""
    port = free_port()
    t = template("llama3.1-70b", "aggregated", ["l40sx1", "l40sx1"],
                 [(20, 0, [0], 1), (60, 1, [0], 1)])  # fmt: skip
    boots = boots_for(t, False, api_port=port, api_key_secret="coral/api-key")
    meta = Metadata()
    bin_dir = tmp_path / "bin"
    fake_cli(bin_dir, {"coral/api-key": KEY, "coral/hf-token": "unused"})
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
        assert call("POST", f"{url}/v1/completions", body)[0] == 401
        assert call("POST", f"{url}/v1/completions", body, key="wrong")[0] == 401
        status, text = call("POST", f"{url}/v1/completions", body, key=KEY)
        assert status == 200 and '"text"' in text, text

        # The drain waits for a request in flight, then returns.
        long = body | {"max_tokens": 400, "ignore_eos": True}
        done: dict[str, object] = {}
        thread = threading.Thread(
            target=lambda: done.update(r=call("POST", f"{url}/v1/completions", long, key=KEY))
        )
        thread.start()
        time.sleep(1.0)
        env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
        import subprocess

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
