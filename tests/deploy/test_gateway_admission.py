"""Admission control on the real proxy: Debian's HAProxy 2.6 with the configuration rendered from a
plan, in front of a loopback stand-in replica that serves at a known rate, driven by a bounded
open-loop load generator at twice the admitted rate.

Asserted: the admitted requests' latency stays at the uncongested level (the same load without
admission control collapses it: the control run); the excess gets 429 with `Retry-After` and an
OpenAI-style error within 50 ms; every request gets an answer; the admitted rate is the plan's,
and the simulator's `admit` admits as many of the same arrivals; a new plan loaded by a graceful
reload (the master process stays, as `coral-gateway-sync` reloads it) moves the limit.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from coral_iac.gateway_config import gateway_limits, gateway_upstreams, render_haproxy_config
from solver.simulation.admission import AdmissionLimit, admit
from solver.stack import ModelSpec
from tests.deploy.test_gateway import make_plan, serving_keys
from tests.deploy.test_gateway_live import _free_port, _wait_until_listening
from tests.factories import PHI4_SPEC

SERVICE_S = 0.1  # each request holds one of the replica's slots this long
SLOTS = 3  # so the replica serves at most 30 requests/s
PLANNED_RPS = 20.0  # the plan's capacity at the target: what the gateway admits
OFFERED_RPS = 2 * PLANNED_RPS
SECONDS = 6.0  # of load per run: 240 requests at 40/s
SHED_MS = 50.0  # a shed request's answer, at most
PERIOD_S = 1  # the counting period of these runs
SPEC = ModelSpec.model_validate({**PHI4_SPEC, "demand": {"requests_per_s": 5.0}})


class SlowReplica(ThreadingHTTPServer):
    """A replica that serves SLOTS requests at once, each for SERVICE_S: a known capacity
    (SLOTS / SERVICE_S requests/s) and a queue of its own beyond it, as a vLLM engine has."""

    daemon_threads = True
    request_queue_size = 512

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.slots = threading.Semaphore(SLOTS)
        self.served = 0
        self.lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        """HAProxy resets a health check's connection once it has the status: not an error."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: SlowReplica

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._reply(200, b"")  # /health

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.slots:
            time.sleep(SERVICE_S)
        with self.server.lock:
            self.server.served += 1
        self._reply(200, b'{"choices":[{"index":0,"text":"ok"}]}')


@dataclass
class Answer:
    sent_s: float  # since the run began
    status: int
    latency_ms: float
    retry_after: str | None
    body: bytes


PHI4_BODY = {"model": "phi-4", "prompt": "hi", "max_tokens": 1}


def _one(port: int, t0: float, at: float, body: dict[str, Any]) -> Answer:
    time.sleep(max(0.0, t0 + at - time.monotonic()))
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        path = f"/{body['model']}/v1/completions"
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return Answer(
            start - t0, r.status, (time.monotonic() - start) * 1e3, r.getheader("Retry-After"), data
        )
    finally:
        conn.close()


def drive(
    port: int, rate: float, seconds: float, body: dict[str, Any] = PHI4_BODY
) -> tuple[np.ndarray, list[Answer]]:
    """Open-loop load: completions (`body`, routed by its model's path prefix) at `rate` per
    second (evenly spaced) for `seconds`, each on its own connection, whatever the answers;
    bounded in count and time."""
    arrivals = np.arange(0.0, seconds, 1.0 / rate)
    t0 = time.monotonic() + 0.2
    with ThreadPoolExecutor(max_workers=len(arrivals)) as pool:
        answers = list(pool.map(lambda at: _one(port, t0, at, body), arrivals))
    return arrivals, answers


@contextmanager
def gateway(
    tmp_path: Path, planned_rps: float, admission: bool = True
) -> Iterator[tuple[int, Path, subprocess.Popen[bytes], SlowReplica]]:
    """HAProxy (master-worker, as Debian's unit runs it) with the configuration of a one-replica
    plan whose capacity at the target is `planned_rps`, in front of a SlowReplica."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed: scripts/test installs it (scripts/debian_tools)"
    replica = SlowReplica()
    threading.Thread(target=replica.serve_forever, args=(0.05,), daemon=True).start()
    port = _free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(config(replica, port, planned_rps, admission), encoding="utf-8")
    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen([haproxy, "-W", "-db", "-f", str(cfg)], stdout=log, stderr=log)
    try:
        _wait_until_listening(port, proc)
        yield port, cfg, proc, replica
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        replica.shutdown()
        replica.server_close()


def limit_of(planned_rps: float) -> AdmissionLimit:
    """The plan's limit, counted per second instead of per minute so that seconds of load
    reach the steady state (HAProxy enforces any period alike; the period's choice is
    tests/simulation/test_admission.py's)."""
    plan = make_plan([("phi-4", "aggregated", "l40sx1", "l40sx1", planned_rps, 1)])
    limit = gateway_limits(plan, {"phi-4": SPEC})["phi-4"]
    per_s = limit.requests_per_s * PERIOD_S
    return limit.model_copy(update={"period_s": PERIOD_S, "count": int(per_s)})


def config(replica: SlowReplica, port: int, planned_rps: float, admission: bool = True) -> str:
    plan = make_plan([("phi-4", "aggregated", "l40sx1", "l40sx1", planned_rps, 1)])
    (key,) = serving_keys(plan)
    limits = {"phi-4": limit_of(planned_rps)} if admission else None
    upstreams = gateway_upstreams(plan, {key: replica.address})
    return render_haproxy_config(
        upstreams, "live", port, 2000, stats_port=_free_port(), limits=limits
    )


def test_the_gateway_sheds_the_excess_and_keeps_admitted_latency(tmp_path):
    with gateway(tmp_path, PLANNED_RPS) as (port, _, _, replica):
        _, calm = drive(port, 5.0, 2.0)  # uncongested: well inside the admitted rate
        assert {a.status for a in calm} == {200}
        calm_p50 = float(np.median([a.latency_ms for a in calm]))
        served_before = replica.served
        arrivals, answers = drive(port, OFFERED_RPS, SECONDS)
    # Nothing dropped without an answer: every request got 200 or 429.
    assert len(answers) == len(arrivals)
    assert {a.status for a in answers} <= {200, 429}, {a.status for a in answers}
    ok = [a for a in answers if a.status == 200]
    shed = [a for a in answers if a.status == 429]
    # The admitted rate is the plan's (a sliding window: within 15% over the run) ...
    limit = limit_of(PLANNED_RPS)
    assert abs(len(ok) / SECONDS - limit.admitted_per_s) <= 0.15 * limit.admitted_per_s, len(ok)
    # ... and the simulator's rule admits as many of the same arrivals (10%).
    simulated = int(admit(arrivals, limit).sum())
    assert abs(simulated - len(ok)) <= 0.1 * len(ok), (simulated, len(ok))
    # The admitted requests are served as if uncongested.
    p50 = float(np.median([a.latency_ms for a in ok]))
    p95 = float(np.percentile([a.latency_ms for a in ok], 95))
    assert p50 <= 1.5 * calm_p50, (p50, calm_p50)
    assert p95 <= 3 * calm_p50, (p95, calm_p50)
    # The excess is answered at once, with when to come back and an OpenAI-style error.
    assert np.percentile([a.latency_ms for a in shed], 99) <= SHED_MS
    assert {a.retry_after for a in shed} == {str(limit.retry_after_s)}
    error = json.loads(shed[0].body)["error"]
    assert error["code"] == "rate_limit_exceeded" and "phi-4 is over the rate its plan admits" in error["message"]
    assert replica.served - served_before == len(ok)


def test_without_admission_control_the_same_load_collapses_latency(tmp_path):
    """The control run: the offered load is more than the replica serves, so the test above
    measures admission control, not an idle replica."""
    with gateway(tmp_path, PLANNED_RPS, admission=False) as (port, _, _, _):
        _, calm = drive(port, 5.0, 2.0)
        calm_p50 = float(np.median([a.latency_ms for a in calm]))
        _, answers = drive(port, OFFERED_RPS, SECONDS)
    assert {a.status for a in answers} == {200}
    p95 = float(np.percentile([a.latency_ms for a in answers], 95))
    assert p95 > 5 * calm_p50, (p95, calm_p50)


def test_a_new_plan_moves_the_limit_with_a_graceful_reload(tmp_path):
    with gateway(tmp_path, PLANNED_RPS) as (port, cfg, proc, replica):
        _, before = drive(port, OFFERED_RPS, 3.0)
        # The plan now gives phi-4 half the capacity: the sync installs the new configuration
        # and reloads the master (SIGUSR2, as Debian's unit does); the master stays.
        cfg.write_text(config(replica, port, PLANNED_RPS / 2), encoding="utf-8")
        os.kill(proc.pid, signal.SIGUSR2)
        time.sleep(1.0)
        assert proc.poll() is None
        _, after = drive(port, OFFERED_RPS, 6.0)
    admitted_before = sum(a.status == 200 for a in before) / 3.0
    admitted_after = sum(a.status == 200 for a in after) / 6.0
    assert {a.status for a in before + after} <= {200, 429}
    assert abs(admitted_before - PLANNED_RPS) <= 0.2 * PLANNED_RPS, admitted_before
    assert abs(admitted_after - PLANNED_RPS / 2) <= 0.2 * PLANNED_RPS / 2, admitted_after
