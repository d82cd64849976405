"""The real proxy: Debian's HAProxy 2.6 on loopback, with the configuration rendered from a plan,
in front of small HTTP servers that answer like vLLM's OpenAI server.

Asserted: each model's requests reach only that model's replicas; the split across replicas
follows the weights within WEIGHT_TOLERANCE; a replica failing GET /health stops receiving
requests; draining and starting replicas receive none; a replica refusing connections costs no
request (retried on another); with a TLS secret, the rendered sync installs the certificate
(refusing one HAProxy cannot load) and HAProxy serves HTTPS only. A few seconds; HAProxy is a
subprocess, not the system service.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from coral_iac.gateway_config import (
    API_KEY_FILE,
    TLS_FILE,
    gateway_upstreams,
    parameter_value,
    render_gateway_user_data,
    render_haproxy_config,
    render_health_script,
    server_name,
)
from tests.deploy.test_gateway import _files, make_plan, self_signed, serving_keys

WEIGHT_TOLERANCE = 0.05  # |observed share - weight share| for 300 requests over 2 replicas
FALL = 3  # HAProxy's `fall`: failed checks before a server is marked DOWN
# phi-4: two l40sx1 replicas (2.0 requests/s each: weight 256), one l4x1*2 (1.0: weight 128);
# the second l40sx1 replica is draining. qwen3-32b: two replicas of equal weight.
ROWS = [
    ("phi-4", "aggregated", "l40sx1", "l40sx1", 2.0, 2),
    ("phi-4", "aggregated", "l4x1*2", "l4x1", 1.0, 1),
    ("qwen3-32b", "aggregated", "l40sx4", "l40sx4", 1.5, 2),
    ("qwen3-32b", "aggregated", "l4x4", "l4x4", 1.5, 1),  # starting
]


class FakeVllm(ThreadingHTTPServer):
    """One replica: /health, /v1/models, /v1/completions, /v1/chat/completions like vLLM's."""

    daemon_threads = True

    def __init__(self, model: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.model, self.healthy = model, True
        self.served: list[str] = []  # model field of every request served (not /health)
        self.authorization: list[str | None] = []  # the Authorization header of each of them
        self.failed_checks = 0
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def kill(self) -> None:
        """Die like a crashed vLLM: refuse new connections, reset the open ones."""
        self.shutdown()
        self.server_close()
        with self.lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by its handler

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """HAProxy resets a health check's connection once it has the status: not an error."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's uvicorn server
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed ACK
    server: FakeVllm

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def _reply(self, status: int, body: dict[str, Any] | None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        s = self.server
        if self.path == "/health":  # vLLM: 200 with an empty body while the engine is alive
            with s.lock:
                s.failed_checks += 0 if s.healthy else 1
            self._reply(200 if s.healthy else 503, None)
        elif self.path == "/v1/models":
            with s.lock:
                s.served.append(s.model)
            card = {"id": s.model, "object": "model", "owned_by": "vllm", "root": s.model}
            self._reply(200, {"object": "list", "data": [card]})
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._reply(404, {"detail": "Not Found"})
            return
        if body.get("model") != s.model:  # vLLM's answer to a model it does not serve
            message = f"The model `{body.get('model')}` does not exist."
            error = {"message": message, "type": "NotFoundError", "param": None, "code": 404}
            self._reply(404, {"error": error})
            return
        with s.lock:
            s.served.append(body["model"])
            s.authorization.append(self.headers.get("Authorization"))
        chat = self.path.endswith("chat/completions")
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
        self._reply(
            200,
            {
                "id": "cmpl-coral",
                "object": "chat.completion" if chat else "text_completion",
                "created": 0,
                "model": s.model,
                "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            },
        )


def one_replica() -> tuple[Any, str, FakeVllm]:
    """A plan of one phi-4 replica, its key, and a FakeVllm serving it."""
    plan = make_plan([("phi-4", "aggregated", "l40sx1", "l40sx1", 2.0, 1)])
    (key,) = serving_keys(plan)
    backend = FakeVllm("phi-4")
    threading.Thread(target=backend.serve_forever, args=(0.05,), daemon=True).start()
    return plan, key, backend


def install_stand_in(bin_dir: Path) -> None:
    """An `install` in `bin_dir` that drops the owner flags (they need root)."""
    (bin_dir / "install").write_text(
        "#!/bin/sh\nargs=''\nwhile [ $# -gt 0 ]; do\n"
        '  case "$1" in -o|-g) shift 2 ;; *) args="$args $1"; shift ;; esac\n'
        f"done\nexec {shutil.which('install')} $args\n"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def fleet(
    tmp_path: Path, interval_ms: int, states: dict[int, str], stats_port: int | None = None
) -> Iterator[tuple[int, dict[str, FakeVllm]]]:
    """HAProxy with the rendered configuration in front of one FakeVllm per serving instance;
    its statistics on `stats_port` (a free port by default)."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed: scripts/test installs it (scripts/debian_tools)"
    plan = make_plan(ROWS)
    keys = serving_keys(plan)
    backends = {k: FakeVllm(k.split("/")[0]) for k in keys}
    for b in backends.values():
        threading.Thread(target=b.serve_forever, args=(0.05,), daemon=True).start()
    port = _free_port()
    upstreams = gateway_upstreams(
        plan, {k: b.address for k, b in backends.items()}, {keys[i]: s for i, s in states.items()}
    )
    cfg = tmp_path / "haproxy.cfg"
    config = render_haproxy_config(
        upstreams, "live", port, interval_ms, stats_port=stats_port or _free_port()
    )
    cfg.write_text(config, encoding="utf-8")
    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=log)
    try:
        _wait_until_listening(port, proc)
        yield port, backends
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        for b in backends.values():
            b.kill()


def _wait_until_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, "haproxy exited at start (see haproxy.log in tmp_path)"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise AssertionError("haproxy did not listen within 10 s")


def send(port: int, n: int, model: str, by: str = "path") -> list[int]:
    """n completions for `model`, routed by path prefix or by the body's model field."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    statuses = []
    for i in range(n):
        path = f"/{model}/v1/completions" if by == "path" else "/v1/chat/completions"
        body = {"model": model, "prompt": "hi", "max_tokens": 1}
        if by != "path":
            body = {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}]}
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        statuses.append(response.status)
    conn.close()
    return statuses


def counts(backends: dict[str, FakeVllm]) -> dict[str, int]:
    return {k: len(b.served) for k, b in backends.items()}


def test_routes_weights_health_and_drain(tmp_path):
    # serving_keys order: phi-4 l40sx1/0, l40sx1/1, l4x1*2/0, qwen3-32b l40sx4/0, /1, l4x4/0
    with fleet(tmp_path, 100, {1: "draining", 5: "starting"}) as (port, backends):
        keys = list(backends)
        big, draining, small, q0, q1, starting = keys
        # Routing: path prefix and JSON body, each model only on its own replicas.
        assert send(port, 300, "phi-4") == [200] * 300
        assert send(port, 60, "qwen3-32b", by="body") == [200] * 60
        seen = counts(backends)
        for k, b in backends.items():
            assert set(b.served) <= {b.model}, f"{k} served another model's request"
        assert seen[q0] + seen[q1] == 60 and seen[big] + seen[small] == 300
        # Weights: 256 vs 128, so the l40sx1 replica takes 2/3 of phi-4's requests.
        assert abs(seen[big] / 300 - 2 / 3) <= WEIGHT_TOLERANCE, seen
        assert abs(seen[q0] / 60 - 1 / 2) <= WEIGHT_TOLERANCE, seen
        assert seen[draining] == 0 and seen[starting] == 0
        # Health: the small replica fails GET /health; once HAProxy saw FALL failures (the
        # next check proves it handled them) it receives nothing more.
        backends[small].healthy = False
        deadline = time.monotonic() + 5
        while backends[small].failed_checks <= FALL and time.monotonic() < deadline:
            time.sleep(0.02)
        assert backends[small].failed_checks > FALL, "HAProxy stopped checking /health"
        before = counts(backends)
        assert send(port, 100, "phi-4") == [200] * 100
        after = counts(backends)
        assert after[small] == before[small] and after[big] == before[big] + 100
        assert after[draining] == 0 and after[starting] == 0
        # An unknown model is refused by the gateway itself.
        assert send(port, 1, "llama3.1-70b") == [404]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/qwen3-32b/v1/models")
        models = json.loads(conn.getresponse().read())
        conn.close()
        assert [m["id"] for m in models["data"]] == ["qwen3-32b"]


def test_a_replica_refusing_connections_costs_no_request(tmp_path):
    """Checks every 60 s: HAProxy cannot know yet, so only retry + redispatch save these."""
    with fleet(tmp_path, 60000, {}) as (port, backends):
        keys = list(backends)
        q0 = keys[3]  # one of qwen3-32b's three ready replicas
        assert send(port, 4, "qwen3-32b") == [200] * 4
        backends[q0].kill()  # connections to it are now refused
        before = counts(backends)
        assert send(port, 20, "qwen3-32b") == [200] * 20
        after = counts(backends)
        assert after[q0] == before[q0]
        assert sum(after.values()) == sum(before.values()) + 20  # all on the other replicas


@pytest.mark.parametrize("by", ["path", "body"])
def test_the_gateway_strips_the_prefix_and_keeps_the_body(tmp_path, by):
    with fleet(tmp_path, 1000, {}) as (port, backends):
        assert send(port, 3, "phi-4", by=by) == [200] * 3
        assert sum(len(b.served) for b in backends.values() if b.model == "phi-4") == 3


def test_the_health_report_lists_exactly_the_replicas_passing_their_checks(tmp_path):
    """The rendered coral-gateway-health against the real HAProxy's statistics, with a stand-in
    `aws` that records what would be published."""
    stats = _free_port()
    state = tmp_path / "state"
    state.mkdir()
    script = tmp_path / "coral-gateway-health"
    script.write_text(render_health_script("live", "us-east-2", stats, str(state)))
    script.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "aws-calls"
    (bin_dir / "aws").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\n')
    (bin_dir / "aws").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}

    def published() -> list[list[str]]:
        """The `up` list of every put-parameter call so far."""
        lines = calls.read_text().splitlines() if calls.exists() else []
        return [json.loads(line.split("--value ", 1)[1])["up"] for line in lines]

    with fleet(tmp_path, 100, {1: "draining"}, stats_port=stats) as (_, backends):
        keys = list(backends)
        sick = keys[2]
        backends[sick].healthy = False
        deadline = time.monotonic() + 5
        while backends[sick].failed_checks <= FALL and time.monotonic() < deadline:
            time.sleep(0.02)
        subprocess.run([str(script)], env=env, check=True, capture_output=True)
        # Every replica but the sick one, the draining one too (it still passes /health).
        assert published() == [sorted(server_name(k) for k in keys if k != sick)]
        # Unchanged: nothing published again.
        subprocess.run([str(script)], env=env, check=True, capture_output=True)
        assert len(published()) == 1
        # It recovers: after `rise` (2) passing checks it is listed again.
        backends[sick].healthy = True
        deadline = time.monotonic() + 5
        while len(published()) == 1 and time.monotonic() < deadline:
            subprocess.run([str(script)], env=env, check=True, capture_output=True)
            time.sleep(0.05)
        assert published()[-1] == sorted(server_name(k) for k in keys)


def test_the_sync_installs_the_certificate_and_the_gateway_serves_https_only(tmp_path):
    """The rendered coral-gateway-sync with stand-ins for aws (the secrets and the parameter),
    systemctl and install's owner flags, its paths under tmp_path; then the real HAProxy on what
    it installed."""
    plan, key, backend = one_replica()
    port = _free_port()
    paths = {
        "/etc/haproxy/haproxy.cfg": str(tmp_path / "haproxy.cfg"),
        API_KEY_FILE: str(tmp_path / "api-keys"),
        TLS_FILE: str(tmp_path / "tls" / "gateway.pem"),  # `install -D` makes the folder
    }

    def local(text: str) -> str:
        for real, here in paths.items():
            text = text.replace(real, here)
        return text

    config = local(
        render_haproxy_config(
            gateway_upstreams(plan, {key: backend.address}), "live", port, 100, True, tls=True
        )
    )
    sync = tmp_path / "sync"
    sync.write_text(
        local(
            _files(render_gateway_user_data("live", "us-east-2", port, "coral/key", "coral/tls"))[
                "/usr/local/bin/coral-gateway-sync"
            ]
        )
    )
    secret = tmp_path / "secret.pem"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "systemctl-calls"
    (bin_dir / "aws").write_text(
        '#!/bin/sh\ncase "$*" in\n'
        "  *coral/key*) echo s3cret ;;\n"
        f"  *coral/tls*) cat {secret} ;;\n"
        f"  *get-parameter*) echo {parameter_value(config)} ;;\n"
        "esac\n"
    )
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexit 0\n')
    install_stand_in(bin_dir)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/bin"}

    def run_sync() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(sync)], env=env, capture_output=True, text=True)

    first, trusted = self_signed(tmp_path, "first")
    other, _ = self_signed(tmp_path, "other")
    secret.write_text(first)
    r = run_sync()
    assert r.returncode == 0, r.stderr
    installed = Path(paths[TLS_FILE])
    assert installed.read_text() == first
    assert calls.read_text().splitlines()[-1] == "reload-or-restart haproxy.service"
    # A certificate with another certificate's key: refused, the one in use stays.
    secret.write_text(
        first.split("-----BEGIN PRIVATE KEY-----")[0]
        + other.split("-----END CERTIFICATE-----\n")[1]
    )
    r = run_sync()
    assert r.returncode != 0 and "refuses the certificate" in r.stderr
    assert installed.read_text() == first
    # Something that is not PEM at all: refused, named.
    secret.write_text("not a certificate")
    r = run_sync()
    assert r.returncode != 0 and "must hold PEM" in r.stderr

    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen(
        [shutil.which("haproxy") or "haproxy", "-db", "-f", paths["/etc/haproxy/haproxy.cfg"]],
        stdout=log,
        stderr=log,
    )
    try:
        _wait_until_listening(port, proc)
        context = ssl.create_default_context(cadata=trusted)
        body = json.dumps({"model": "phi-4", "prompt": "hi", "max_tokens": 1})
        headers = {"Content-Type": "application/json", "Authorization": "Bearer s3cret"}
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context)
        conn.request("POST", "/phi-4/v1/completions", body, headers)
        response = conn.getresponse()
        response.read()
        assert (response.status, conn.sock.version()) in {(200, "TLSv1.3"), (200, "TLSv1.2")}
        conn.close()
        # Plain HTTP on the same port gets no answer: the key never crosses in the clear.
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("POST", "/phi-4/v1/completions", body, headers)
            plain.getresponse().read()
        plain.close()
        # A client that does not trust the certificate is refused by its own TLS check.
        with pytest.raises(ssl.SSLCertVerificationError):
            strict = http.client.HTTPSConnection(
                "127.0.0.1", port, timeout=5, context=ssl.create_default_context()
            )
            strict.request("GET", "/health")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        backend.kill()
    assert len(backend.served) == 1
