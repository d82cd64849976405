"""Admission control in front of a real replica: a rendered one-node node booted with vLLM on CPU
(a tiny model), behind the gateway's rendered HAProxy configuration with the plan's limit, driven
by a bounded open-loop load at three times the admitted rate, more than the replica serves. Run
by scripts/test_serving (marker `serving`; a few minutes with the boot).

Asserted: every request gets an answer (200 or 429); the gateway admits the plan's rate, as many
as the simulator's rule (`admit`) admits of the same requests; the admitted completions take the
replica the time they take at the rate it admitted alone (continuous batching makes that more
than an idle replica's), while the same load without admission control makes them wait; the 429s
come at once. The replica's time is vLLM's own (its end-to-end latency histogram,
`vllm:e2e_request_latency_seconds`), so the load generator's handling of the 429s on the same
machine does not blur what the gateway protects.
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
from prometheus_client.parser import text_string_to_metric_families

from coral_iac.bootstrap import render_user_data
from coral_iac.gateway_config import gateway_upstreams, render_haproxy_config
from solver.simulation.admission import AdmissionLimit, admit
from tests.deploy.test_bootstrap import LAYERS, boots_for, template
from tests.deploy.test_gateway import make_plan, serving_keys
from tests.deploy.test_gateway_admission import Answer, drive
from tests.deploy.test_gateway_live import _wait_until_listening
from tests.serving import harness
from tests.serving.harness import Metadata, call, fake_cli, free_port, lay_out
from tests.serving.test_real_serving import BOOT_S, TINY_LAYERS, make_tiny

pytestmark = pytest.mark.serving
MODEL = "llama3.1-70b"
BODY = {"model": MODEL, "prompt": "The plan", "max_tokens": 512, "temperature": 0,
        "ignore_eos": True}  # fmt: skip
PERIOD_S = 5  # counted over 5 s so that a load of tens of seconds reaches the steady state
LOAD_S = 30.0
SEQS = 8


def capacity_rps(
    url: str, clients: int = 4 * SEQS, seconds: float = 20.0, body: dict | None = None
) -> float:
    """Completions (of `body`, default BODY) per second the replica serves with `clients` back
    to back, more than its batch cap (its capacity)."""
    body = BODY if body is None else body
    done: list[float] = []
    stop = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < stop:
            if call("POST", f"{url}/v1/completions", body)[0] == 200:
                done.append(time.monotonic())

    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    return len(done) / seconds


def replica_seconds(url: str) -> tuple[float, int]:
    """vLLM's own end-to-end latency histogram at `url`: (sum in seconds, count) over its
    label sets, so the difference of two readings is what the requests between them took."""
    status, text = call("GET", f"{url}/metrics")
    assert status == 200, text
    total, count = 0.0, 0
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:e2e_request_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += int(sample.value)
    return total, count


@contextmanager
def replica_mean_ms(url: str) -> Iterator[list[float]]:
    """The mean end-to-end latency vLLM records at `url` for the requests finished inside the
    block (ms), appended to the yielded list on exit."""
    out: list[float] = []
    before = replica_seconds(url)
    yield out
    time.sleep(0.5)  # the last answers' histogram updates
    after = replica_seconds(url)
    assert after[1] > before[1], "the replica recorded no request"
    out.append(1000.0 * (after[0] - before[0]) / (after[1] - before[1]))


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
    # Behind the gateway: no key on the replica. A batch cap of 8 sequences makes its capacity
    # the replica's own: a tiny model on CPU batches 256 at almost the cost of 8, a rate the
    # load generator on the other core could not offer.
    (boot,) = boots_for(t, False, api_port=port, seqs=SEQS)
    meta = Metadata()
    bin_dir = tmp_path / "bin"
    fake_cli(bin_dir, {"coral/hf-token": "unused"})
    node = lay_out(render_user_data(boot, ""), tmp_path / "n0", meta, tiny, TINY_LAYERS, 0)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "node.log"
    procs: list[subprocess.Popen[bytes]] = []
    cores = os.sched_getaffinity(0)
    try:
        # The whole replica (API server, engine core, worker) on core 0 and the load generator
        # with the gateway on the others: vLLM's engine core polls its worker, and on a shared
        # core it starved the gateway's accepts for seconds.
        procs.append(harness.start(node, "0", bin_dir, log, cores={0}))
        try:
            harness.wait_healthy(url, procs, BOOT_S)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text()[-3000:]}") from None
        for _ in range(3):  # warm up the compiled graphs
            assert call("POST", f"{url}/v1/completions", BODY)[0] == 200
        others = (os.sched_getaffinity(0) - {0}) or {0}
        os.sched_setaffinity(0, others)
        capacity = capacity_rps(url)
        assert capacity > 0.5, f"the replica served {capacity:.2f} completions/s"
        # The plan admits half of what the replica serves; the load is three times that.
        admitted = 0.5 * capacity
        count = max(1, int(admitted * PERIOD_S))
        limit = AdmissionLimit(
            model=MODEL, requests_per_s=admitted, basis="capacity at target",
            period_s=PERIOD_S, count=count,
        )  # fmt: skip
        offered = 3 * count / PERIOD_S
        with gateway(tmp_path, f"127.0.0.1:{port}", limit) as gw:
            drive(gw, count / PERIOD_S, 5.0, BODY)  # the window's history, as in production
            with replica_mean_ms(url) as gated_replica:
                _, gated = drive(gw, offered, LOAD_S, BODY)
        ok = int(sum(a.status == 200 for a in gated))
        time.sleep(2)
        with gateway(tmp_path, f"127.0.0.1:{port}", None) as gw:
            # The uncongested level: the rate the gateway admitted, alone, nothing to shed.
            with replica_mean_ms(url) as calm_replica:
                _, calm = drive(gw, max(ok, 1) / LOAD_S, LOAD_S, BODY)
        time.sleep(2)
        with gateway(tmp_path, f"127.0.0.1:{port}", None) as gw:
            with replica_mean_ms(url) as flooded_replica:
                _, flooded = drive(gw, offered, LOAD_S, BODY)
    finally:
        os.sched_setaffinity(0, cores)
        for p in procs:
            harness.stop(p)
        meta.close()
    summary = (
        f"capacity {capacity:.2f}/s, admitted {count}/{PERIOD_S}s ({ok} in {LOAD_S:.0f} s), "
        f"offered {offered:.2f}/s; replica mean calm {calm_replica[0]:.0f} ms, gated "
        f"{gated_replica[0]:.0f} ms, flooded {flooded_replica[0]:.0f} ms; at the client p50 calm "
        f"{np.median(latencies(calm)):.0f} ms, gated {np.median(latencies(gated)):.0f} ms, "
        f"flooded {np.median(latencies(flooded)):.0f} ms"
    )
    print(summary)
    assert {a.status for a in calm} == {200}, summary
    assert {a.status for a in gated} <= {200, 429} and {a.status for a in flooded} == {200}
    # The gateway admits the plan's rate (the window's first period may admit its whole count).
    assert ok <= count * (LOAD_S / PERIOD_S + 1), summary
    assert ok >= count * (LOAD_S / PERIOD_S - 1), summary
    # ... and the simulator's rule admits as many of the same requests (10%).
    simulated = int(admit(np.sort([a.sent_s for a in gated]), limit).sum())
    assert abs(simulated - ok) <= 0.1 * ok, f"{summary}; the simulator admits {simulated}"
    # Admitted completions take the replica what the admitted rate alone takes; without
    # admission control the same load queues them.
    assert gated_replica[0] <= 1.5 * calm_replica[0], summary
    assert flooded_replica[0] >= 3.0 * gated_replica[0], summary
    # The excess is answered at once.
    assert float(np.percentile(latencies(gated, 429), 99)) <= 50.0, summary
