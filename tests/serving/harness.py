"""Boot rendered nodes for real on this machine: the rendered start and drain scripts run as
written, with vLLM on CPU (`.vllm-cpu-venv`, scripts/vllm_cpu_env) and a tiny model made here.

What a cloud node has that this machine lacks is replaced by local stand-ins, each listed here:

- `LOCAL_PATHS`: /opt/coral and /etc/coral live under a folder per node, so two nodes share a host;
- the instance metadata service answers on loopback (`Metadata`), with the node's IP 127.0.0.1;
- the cloud's secret manager is an `aws` / `gcloud` on PATH printing the test's secrets
  (`fake_cli`);
- the runtime is already installed (the venv's programs are linked in, and node.env's
  CORAL_VLLM_VERSION is the CPU build's version, so `ensure_runtime` finds it);
- the Hugging Face Hub is the tiny model's folder: the venv's `hf` is `fake_hf`, which "downloads"
  from it what the script asks for (and logs the file names), so `fetch_weights` runs as written;
  like `hf download` it writes each file under a temporary name and renames it, and skips a file
  the local folder already holds;
- the nodes of a prefill/decode pair share one models folder (`models_dir`): on the cloud each
  has /opt/coral/models/<model>, and the NIXL handshake compares that path; they share the setup
  lock beside it too, as a node's processes share theirs, so that one fetches the weights while
  the other waits (two fetches into one folder race on the index they rewrite);
- `CPU_ENV`: what vLLM on CPU needs in each process's environment;
- `share_host`: two nodes on one host cannot both bind the NIXL side-channel port, so a second
  prefill/decode node's is moved (each node announces its own; the peer learns it in-band).

No `vllm serve` flag differs from the rendered command line unless `CPU_FLAGS` lists it with the
reason; `cpu_argv` applies them and `differing_flags` is what the test checks against that list.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.conftest import REPO

CPU_VENV = REPO / ".vllm-cpu-venv"
CPU_VERSION = "0.32.0+cpu"  # what `vllm --version` prints in .vllm-cpu-venv (scripts/vllm_cpu_env)
LOCAL_PATHS = ("/opt/coral", "/etc/coral")
START = "/usr/local/bin/coral-node-start"
# Flags replaced on CPU: flag -> (value on CPU, why). Empty: every rendered flag runs as is.
CPU_FLAGS: dict[str, tuple[str, str]] = {}
# Per process, on CPU only (../vLLM's CPU worker): which core its OpenMP threads bind to (the
# default binding fails with two CPU workers on one host), and the KV cache in GiB (else
# --gpu-memory-utilization is read as a share of RAM).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Metadata:
    """The cloud's instance metadata on loopback: AWS IMDSv2 (token, then local-ipv4) and GCP's
    network-interfaces/0/ip, all answering 127.0.0.1."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, body: str) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def do_PUT(self) -> None:  # noqa: N802 (http.server's name)
                self._answer("local-token")

            def do_GET(self) -> None:  # noqa: N802
                ok = self.headers.get("X-aws-ec2-metadata-token") == "local-token" or (
                    self.headers.get("Metadata-Flavor") == "Google"
                )
                if not ok:
                    self.send_response(401)
                    self.end_headers()
                    return
                self._answer("127.0.0.1")

            def log_message(self, *_args: object) -> None:
                pass

        self.server, self.url = serve_on_loopback(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_on_loopback(
    handler: type[http.server.BaseHTTPRequestHandler],
) -> tuple[http.server.ThreadingHTTPServer, str]:
    """`handler` served on a free loopback port in a daemon thread: the server and its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def fake_cli(bin_dir: Path, secrets: dict[str, str]) -> None:
    """`aws secretsmanager get-secret-value ... --secret-id ID ...` and `gcloud secrets versions
    access latest --secret=ID` printing `secrets[ID]` (exit 1 for an unknown one)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "secrets.json").write_text(json.dumps(secrets))
    script = f"""#!/usr/bin/env python3
import json, sys
secrets = json.load(open({str(bin_dir / "secrets.json")!r}))
args = sys.argv[1:]
sid = None
for i, a in enumerate(args):
    if a == "--secret-id":
        sid = args[i + 1]
    elif a.startswith("--secret="):
        sid = a.split("=", 1)[1]
if sid not in secrets:
    sys.exit(1)
print(secrets[sid])
"""
    for name in ("aws", "gcloud"):
        path = bin_dir / name
        path.write_text(script)
        path.chmod(0o755)


def fake_hf(path: Path, source: Path, log: Path) -> None:
    """`hf download REPO [FILE ...] [--include P] [--exclude P] --local-dir DIR`: copies the named
    files, or those the patterns select, from `source`; appends each name to `log`."""
    path.write_text(f"""#!/usr/bin/env python3
import fnmatch, os, shutil, sys
args, files, inc, exc, local = sys.argv[3:], [], [], [], None
i = 0
while i < len(args):
    if args[i] in ("--include", "--exclude", "--local-dir"):
        {{"--include": inc, "--exclude": exc}}.get(args[i], []).append(args[i + 1])
        local = args[i + 1] if args[i] == "--local-dir" else local
        i += 2
    else:
        files.append(args[i])
        i += 1
src = {str(source)!r}
chosen = files or [n for n in sorted(os.listdir(src))
                   if any(fnmatch.fnmatch(n, p) for p in inc)
                   and not any(fnmatch.fnmatch(n, p) for p in exc)]
os.makedirs(local, exist_ok=True)
with open({str(log)!r}, "a") as out:
    for name in chosen:
        source, target = os.path.join(src, name), os.path.join(local, name)
        if not (os.path.exists(target) and os.path.getsize(target) == os.path.getsize(source)):
            part = f"{{target}}.{{os.getpid()}}.incomplete"  # nodes sharing the folder race
            shutil.copy(source, part)
            os.replace(part, target)
        out.write(name + "\\n")
""")
    path.chmod(0o755)


@dataclass
class Node:
    """One rendered node laid out under `root`, ready to run its processes."""

    root: Path
    files: dict[str, str]  # rendered path -> content (after the local substitutions)
    env: dict[str, str]  # node.env
    argvs: list[list[str]]  # each process's rendered `vllm serve` argv (before CPU_FLAGS)
    cpu_core: int  # the core its vLLM processes' OpenMP threads bind to
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start_script(self) -> Path:
        return self.root / "usr/local/bin/coral-node-start"

    def drain_script(self) -> Path:
        return self.root / "usr/local/bin/coral-node-drain"

    def files_port(self, variable: str) -> int:
        """The port the rendered start script exports as `variable`."""
        found = re.search(rf"^export {variable}=(\d+)$", self.files[START], re.M)
        assert found, f"no {variable} in the rendered start script"
        return int(found.group(1))


def lay_out(
    user_data: str,
    root: Path,
    metadata: Metadata,
    model_dir: Path,
    layers: int,
    cpu_core: int,
    models_dir: Path | None = None,
) -> Node:
    """Write one node's rendered files under `root` with the stand-ins of the module doc; the
    layer partition rescaled to the tiny model's `layers` (VLLM_PP_LAYER_PARTITION);
    /opt/coral/models at `models_dir` when given (shared by the nodes of a pair, with the setup
    lock)."""
    doc = yaml.safe_load(user_data)
    files = {w["path"]: w["content"] for w in doc["write_files"]}
    out: dict[str, str] = {}
    for path, content in files.items():
        if models_dir is not None:
            content = content.replace("/opt/coral/models", str(models_dir))
            content = content.replace("/opt/coral/setup.lock", f"{models_dir}.setup.lock")
        for local in LOCAL_PATHS:
            content = content.replace(local, f"{root}{local}")
        content = content.replace("http://169.254.169.254", metadata.url)
        content = content.replace("http://metadata.google.internal", metadata.url)
        out[path] = content
    if models_dir is not None:
        assert f"{models_dir}.setup.lock" in out[START], "the start script's setup lock moved"
    env = dict(
        shlex.split(line)[0].split("=", 1) for line in out["/etc/coral/node.env"].splitlines()
        if "=" in line and not line.startswith("#")
    )  # fmt: skip
    rendered_partition = [int(x) for x in env["CORAL_LAYER_PARTITION"].split(",")]
    env["CORAL_LAYER_PARTITION"] = ",".join(map(str, rescale(rendered_partition, layers)))
    env["CORAL_VLLM_VERSION"] = CPU_VERSION
    if env.get("CORAL_MASTER_ADDR"):
        env["CORAL_MASTER_ADDR"] = "127.0.0.1"
    out["/etc/coral/node.env"] = "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items())
    for path, content in out.items():
        target = root / path.lstrip("/")
        if path.startswith(LOCAL_PATHS):
            target = Path(f"{root}{path}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        if path.startswith("/usr/local/bin/"):
            target.chmod(0o755)
    venv_bin = Path(f"{root}/opt/coral/venv/bin")
    venv_bin.mkdir(parents=True, exist_ok=True)
    for program in (CPU_VENV / "bin").iterdir():
        if program.name != "hf":
            (venv_bin / program.name).symlink_to(program)
    fake_hf(venv_bin / "hf", model_dir, root / "downloaded.txt")
    Path(env["CORAL_MODEL_DIR"]).parent.mkdir(parents=True, exist_ok=True)
    argvs = [shlex.split(line) for line in re.findall(r"^\s*args=\((.*)\)\s*$", out[
        "/usr/local/bin/coral-node-start"], re.M)]  # fmt: skip
    return Node(root, out, env, argvs, cpu_core)


def share_host(node: Node, nixl_port: int) -> None:
    """Move `node`'s NIXL side-channel port to `nixl_port` (module doc: two nodes, one host)."""
    script = node.start_script()
    text = script.read_text()
    rendered = f"VLLM_NIXL_SIDE_CHANNEL_PORT={node.files_port('VLLM_NIXL_SIDE_CHANNEL_PORT')}"
    assert rendered in text, "the start script no longer sets VLLM_NIXL_SIDE_CHANNEL_PORT"
    script.write_text(text.replace(rendered, f"VLLM_NIXL_SIDE_CHANNEL_PORT={nixl_port}"))


def rescale(partition: list[int], layers: int) -> list[int]:
    """A rendered layer split scaled to `layers`, every stage at least one layer, order kept
    (80 layers as 20,60 on 4 layers: 1,3)."""
    total = sum(partition)
    raw = [max(1, round(p * layers / total)) for p in partition]
    while sum(raw) > layers:
        raw[raw.index(max(raw))] -= 1
    while sum(raw) < layers:
        raw[raw.index(min(raw))] += 1
    return raw


def start(
    node: Node, index: str, bin_dir: Path, log: Path, cores: set[int] | None = None
) -> subprocess.Popen[bytes]:
    """Run the node's rendered start script for process `index`, as systemd's unit would;
    with `cores`, every process of it (API server, engine, worker) runs on those cores only."""
    env = os.environ | CPU_ENV | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "VLLM_CPU_OMP_THREADS_BIND": str(node.cpu_core),
    }
    with log.open("ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            ["bash", str(node.start_script()), index],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped as a unit
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
    node.procs[index] = proc
    return proc


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, wait_s: float = 30) -> None:
    """Signal the process group; SIGKILL it when it outlives `wait_s`."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # never raise here: the other nodes must stop too
            print(f"process group {proc.pid} outlived SIGKILL by 30 s")


def call(
    method: str, url: str, body: dict | None = None, key: str | None = None, timeout: float = 60
) -> tuple[int, str]:
    """(status, body text) of one request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e)


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> float:
    """Seconds until GET url/health answers 200; fails when a process exits first or time
    runs out."""
    begin = time.monotonic()
    while time.monotonic() - begin < timeout_s:
        if call("GET", f"{url}/health", timeout=5)[0] == 200:
            return time.monotonic() - begin
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"exited before serving: {dead}"
        time.sleep(2)
    raise AssertionError(f"{url} not healthy after {timeout_s:.0f} s")
