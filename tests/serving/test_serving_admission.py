"""Admission control in front of a real replica: a rendered one-node node booted with vLLM on CPU
(a tiny model), behind the gateway's rendered HAProxy configuration with the plan's limit, driven
by a bounded open-loop load at twice the admitted rate, which is more than the replica serves.
Run by scripts/test_serving (marker `serving`; a few minutes with the boot).

Asserted: every request gets an answer (200 or 429); the gateway admits the plan's rate; the
admitted completions keep the latency they have at the admitted rate alone (continuous batching
makes that more than an idle replica's), while the same load without admission control makes
them wait; the 429s come at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from coral_iac.bootstrap import render_user_data
from coral_iac.gateway_config import gateway_upstreams, render_haproxy_config
from solver.simulation.admission import AdmissionLimit
from tests.deploy.test_bootstrap import LAYERS, boots_for, template
from tests.deploy.test_gateway import make_plan, serving_keys
from tests.deploy.test_gateway_admission import Answer, drive
from tests.deploy.test_gateway_live import _wait_until_listening
from tests.serving import harness
from tests.serving.harness import Metadata, call, fake_cli, free_port, lay_out
from tests.serving.test_real_serving import BOOT_S, TINY_LAYERS, make_tiny

pytestmark = pytest.mark.serving
MODEL = "llama3.1-70b"
BODY = {"model": MODEL, "prompt": "The plan", "max_tokens": 128, "temperature": 0,
        "ignore_eos": True}  # fmt: skip
PERIOD_S = 5  # counted over 5 s so that a load of tens of seconds reaches the steady state
LOAD_S = 30.0


def capacity_rps(url: str, clients: int = 32, seconds: float = 10.0) -> float:
    """Completions per second the replica serves with `clients` back to back (its capacity)."""
    done: list[float] = []
    stop = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < stop:
            if call("POST", f"{url}/v1/completions", BODY)[0] == 200:
                done.append(time.monotonic())

    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    return len(done) / seconds


@contextmanager
def gateway(tmp_path: Path, head: str, limit: AdmissionLimit | None) -> Iterator[int]:
    """The real HAProxy with the rendered configuration of a one-replica plan of MODEL whose
    head answers at `head`, admitting `limit` (None: every request)."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed: scripts/test_serving installs it"
    plan = make_plan([(MODEL, "aggregated", "l40sx1", "l40sx1", 1.0, 1)])
    (key,) = serving_keys(plan)
    port = free_port()
    config = render_haproxy_config(
        gateway_upstreams(plan, {key: head}), "serving", port, 500, stats_port=free_port(),
        limits={MODEL: limit} if limit is not None else None,
    )  # fmt: skip
    cfg = tmp_path / f"gateway-{port}.cfg"
    cfg.write_text(config)
    with (tmp_path / f"gateway-{port}.log").open("w") as log:
        proc = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=log)
    try:
        _wait_until_listening(port, proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def latencies(answers: list[Answer], status: int = 200) -> np.ndarray:
    return np.array([a.latency_ms for a in answers if a.status == status])


def test_the_gateway_sheds_what_a_real_replica_cannot_serve(tmp_path):
    tiny = make_tiny(tmp_path / "tiny")
    port = free_port()
    t = template(MODEL, "aggregated", ["l40sx1"], [(LAYERS[MODEL], 0, [0], 1)])
    (boot,) = boots_for(t, False, api_port=port)  # behind the gateway: no key on the replica
    meta = Metadata()
    bin_dir = tmp_path / "bin"
    fake_cli(bin_dir, {"coral/hf-token": "unused"})
    node = lay_out(render_user_data(boot, ""), tmp_path / "n0", meta, tiny, TINY_LAYERS, 0)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "node.log"
    procs: list[subprocess.Popen[bytes]] = []
    cores = os.sched_getaffinity(0)
    try:
        procs.append(harness.start(node, "0", bin_dir, log))
        try:
            harness.wait_healthy(url, procs, BOOT_S)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text()[-3000:]}") from None
        for _ in range(3):  # warm up the compiled graphs
            assert call("POST", f"{url}/v1/completions", BODY)[0] == 200
        # vLLM's threads are bound to core 0; the load generator and its answers keep to the
        # others, so the 429s it handles do not slow the replica it measures.
        others = (os.sched_getaffinity(0) - {0}) or {0}
        os.sched_setaffinity(0, others)
        capacity = capacity_rps(url)
        assert capacity > 0.5, f"the replica served {capacity:.2f} completions/s"
        # The plan admits 60% of what the replica serves; the load is twice that.
        admitted = 0.6 * capacity
        count = max(1, int(admitted * PERIOD_S))
        limit = AdmissionLimit(
            model=MODEL, requests_per_s=admitted, basis="capacity at target",
            period_s=PERIOD_S, count=count,
        )  # fmt: skip
        offered = 2 * count / PERIOD_S
        with gateway(tmp_path, f"127.0.0.1:{port}", None) as gw:
            # The uncongested level: the admitted rate alone, nothing to shed.
            _, calm = drive(gw, count / PERIOD_S, 15.0, BODY)
        time.sleep(2)
        with gateway(tmp_path, f"127.0.0.1:{port}", limit) as gw:
            drive(gw, count / PERIOD_S, 5.0, BODY)  # the window's history, as in production
            _, gated = drive(gw, offered, LOAD_S, BODY)
        time.sleep(2)
        with gateway(tmp_path, f"127.0.0.1:{port}", None) as gw:
            _, flooded = drive(gw, offered, LOAD_S, BODY)
    finally:
        os.sched_setaffinity(0, cores)
        for p in procs:
            harness.stop(p)
        meta.close()
    summary = (
        f"capacity {capacity:.2f}/s, admitted {count}/{PERIOD_S}s, offered {offered:.2f}/s; "
        f"calm p50 {np.median(latencies(calm)):.0f} ms, gated p50 "
        f"{np.median(latencies(gated)):.0f} p90 {np.percentile(latencies(gated), 90):.0f} ms, "
        f"flooded p50 {np.median(latencies(flooded)):.0f} ms"
    )
    print(summary)
    assert {a.status for a in calm} == {200}, summary
    assert {a.status for a in gated} <= {200, 429} and {a.status for a in flooded} == {200}
    ok = int(sum(a.status == 200 for a in gated))
    # The gateway admits the plan's rate (the window's first period may admit its whole count).
    assert ok <= count * (LOAD_S / PERIOD_S + 1), summary
    assert ok >= count * (LOAD_S / PERIOD_S - 1), summary
    # Admitted completions keep an uncongested replica's latency; without admission control
    # the same load queues them.
    calm_p50 = float(np.median(latencies(calm)))
    gated_p50 = float(np.median(latencies(gated)))
    assert gated_p50 <= 1.5 * calm_p50, summary
    assert float(np.median(latencies(flooded))) >= 3.0 * gated_p50, summary
    # The excess is answered at once.
    assert float(np.percentile(latencies(gated, 429), 99)) <= 50.0, summary
