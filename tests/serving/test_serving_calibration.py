"""Calibration proved on real parts: a rendered node booted with vLLM on CPU (a tiny model) behind
the gateway's rendered HAProxy configuration, scraped by a real Prometheus (Debian's package)
with the `coral_replica` label a fleet's scrape adds, driven by a bounded open-loop load
(Poisson arrivals, at half what the replica serves) on loopback. `coral calibrate`'s reader
and fit (`read_replica_metrics`, `calibrate`, `pool`) then bring the project's prediction of
that replica within 15% of vLLM's own p50 TTFT and TPOT (and means). Run by
scripts/test_serving (marker `serving`; a few minutes with the boot).

The CPU is a GPU type of its own here, `cpu` (`cpu_perf_model`): this machine's cores as a
test-only catalog entry with nominal figures, never in the shipped catalog; its efficiency
factors are the T4's (any measured chip would do: the fit is what corrects them).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from coral_iac.bootstrap import render_user_data
from coral_iac.fleet_metrics import read_replica_metrics
from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import Catalog, GpuType, load_catalog
from solver.catalog.user_models import card_fields
from solver.operations.step_calibration import (
    Histogram,
    ReplicaFacts,
    ReplicaFit,
    calibrate,
    pool,
)
from solver.performance.default_model import load_perf_model
from solver.performance.perf_model import PerfModel
from solver.serving.instance_model import InstanceModel
from solver.serving.serving_template import ServingTemplate, Stage, StageMember
from solver.stack import PrometheusSource
from tests import prometheus_server
from tests.deploy.test_bootstrap import LAYERS, boots_for, template
from tests.deploy.test_gateway_admission import Answer, _one
from tests.serving import harness
from tests.serving.harness import Metadata, call, fake_cli, free_port, lay_out
from tests.serving.test_real_serving import BOOT_S, TINY_LAYERS, make_tiny
from tests.serving.test_serving_admission import MODEL, capacity_rps, gateway

pytestmark = pytest.mark.serving
SEQS = 16  # --max-num-seqs of the rendered node
TOKENS = 8192  # its --max-num-batched-tokens (tests/deploy/test_bootstrap.engine_for's default)
PROMPT = " ".join(["the plan serves every model at its target"] * 12)
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
LOAD_S = 90.0
KEY = f"{MODEL}/aggregated/aws:us-east-2/l40sx1/0"  # the rendered node's coral:replica

# A test-only GPU type: one CPU core as vLLM's CPU backend uses it. Nominal, not measured: the
# calibration is what makes it right.
CPU = GpuType(
    name="one x86 core under vLLM's CPU backend (test-only)",
    memory_gb=8.0, memory_mib=8192,  # nominal: the KV cache vLLM holds is 1 GiB (harness.CPU_ENV)
    memory_bandwidth_gb_s=10.0, dense_tflops=0.05, bf16=False,
    source="test-only nominal figures for one core (not a datasheet): coral calibrate fits them",
    retrieved=dt.date(2026, 12, 7),
)  # fmt: skip


def cpu_perf_model(card: ModelCard) -> PerfModel:
    """The shipped performance model with the `cpu` GPU type added and `card` among the models."""
    shipped = load_perf_model()
    catalog = load_catalog()
    catalog = Catalog(gpus=catalog.gpus | {"cpu": CPU}, offers=catalog.offers)
    cal = shipped.calibration
    calibration = replace(
        cal,
        gpus=cal.gpus | {"cpu": cal.gpus["t4"]},
        kernels=cal.kernels | {"cpu": cal.kernels["t4"]},
        origin=cal.origin | {"cpu": "the T4's factors (test-only)"},
    )
    return PerfModel(catalog=catalog, cards=shipped.cards | {"tiny": card},
                     calibration=calibration)  # fmt: skip


def tiny_card(model_dir: Path) -> ModelCard:
    cfg = json.loads((model_dir / "config.json").read_text())
    fields = card_fields(cfg, str(model_dir / "config.json"))
    return ModelCard(display_name="tiny", hf_repo="local/tiny", max_context=2048,
                     source="tests/serving/tiny_model.py", retrieved=dt.date(2026, 12, 7),
                     **{k: v for k, v in fields.items() if k != "max_context"})  # fmt: skip


def cpu_replica(perf: PerfModel) -> ReplicaFacts:
    t = ServingTemplate(
        key="cpux1", model="tiny", phase="aggregated", mode="vllm", nodes=["cpux1"],
        stages=[Stage(layers=TINY_LAYERS, members=[StageMember(node=0, gpus=[0], tp=1)])],
        throughput=1.0, unit="requests/s", stage_budget_ms=[1.0],
    )  # fmt: skip
    inst = InstanceModel(perf, t, 600.0, 100.0)
    inst.max_running, inst.max_batched_tokens = SEQS, TOKENS  # as the rendered node runs
    return ReplicaFacts(KEY, "tiny", "aggregated", ("cpu",), inst)


def poisson_load(port: int, rate: float, seconds: float, seed: int = 0) -> list[Answer]:
    """Open-loop completions at Poisson arrivals of `rate` per second for `seconds` (bounded)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, int(rate * seconds * 2) + 10)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < seconds]
    t0 = time.monotonic() + 0.2
    with ThreadPoolExecutor(max_workers=len(arrivals)) as pool_:
        return list(pool_.map(lambda at: _one(port, t0, float(at), BODY), arrivals))


def test_calibrate_brings_the_prediction_of_a_real_replica_within_15_percent(tmp_path):
    tiny = make_tiny(tmp_path / "tiny")
    perf = cpu_perf_model(tiny_card(tiny))
    port = free_port()
    t = template(MODEL, "aggregated", ["l40sx1"], [(LAYERS[MODEL], 0, [0], 1)])
    (boot,) = boots_for(t, False, api_port=port, seqs=SEQS)
    meta = Metadata()
    bin_dir = tmp_path / "bin"
    fake_cli(bin_dir, {"coral/hf-token": "unused"})
    node = lay_out(render_user_data(boot, ""), tmp_path / "n0", meta, tiny, TINY_LAYERS, 0)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "node.log"
    procs: list[subprocess.Popen[bytes]] = []
    cores = os.sched_getaffinity(0)
    prometheus = None
    try:
        # The replica on core 0; the gateway, Prometheus and the load on the others (as in
        # test_serving_admission: a shared core starves the gateway's accepts).
        procs.append(harness.start(node, "0", bin_dir, log, cores={0}))
        try:
            harness.wait_healthy(url, procs, BOOT_S)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text()[-3000:]}") from None
        for _ in range(3):  # warm up the compiled graphs
            assert call("POST", f"{url}/v1/completions", BODY)[0] == 200
        os.sched_setaffinity(0, (cores - {0}) or {0})
        capacity = capacity_rps(url, clients=2 * SEQS, seconds=15.0, body=BODY)
        assert capacity > 0.5, f"the replica served {capacity:.2f} completions/s"
        rate = 0.5 * capacity
        # Labelled as a fleet's scrape labels a node from its coral:replica tag.
        static = [{"targets": [f"127.0.0.1:{port}"], "labels": {"coral_replica": KEY}}]
        prometheus, prom_url, _ = prometheus_server.start(tmp_path, static, "1s")
        time.sleep(3.0)  # a few scrapes before the load: increase() starts from them
        with gateway(tmp_path, url.removeprefix("http://"), None) as gw:
            started = time.monotonic()
            answers = poisson_load(gw, rate, LOAD_S)
            time.sleep(2.5)  # the last answers' histograms scraped
            window = f"{int(round(time.monotonic() - started))}s"
        assert {a.status for a in answers} == {200}
        measured, _ = read_replica_metrics(PrometheusSource(url=prom_url), [KEY], window)
    finally:
        os.sched_setaffinity(0, cores)
        if prometheus is not None:
            prometheus_server.stop(prometheus)
        for p in procs:
            harness.stop(p)
        meta.close()
    # What Prometheus gave, kept beside the test's other files for a look afterwards.
    (tmp_path / "measured.json").write_text(json.dumps(
        {k: {n: vars(h) for n, h in vars(m).items() if isinstance(h, Histogram)}
         for k, m in measured.items()}, default=list))  # fmt: skip
    (result,) = calibrate([cpu_replica(perf)], measured, lambda m: 2048)
    summary = (
        f"capacity {capacity:.2f}/s, load {rate:.2f}/s for {LOAD_S:.0f} s ({len(answers)} "
        f"requests), window {window}: {result}"
    )
    print(summary)
    assert isinstance(result, ReplicaFit), summary
    assert result.requests >= 0.8 * len(answers), summary
    for q in result.quantiles:  # mean, p50, p90
        assert q.predicted[1] == pytest.approx(q.measured[1], rel=0.15), (q.metric, summary)
        assert q.predicted[0] == pytest.approx(q.measured[0], rel=0.15), (q.metric, summary)
    # One factor for all its steps, or its prompt steps and decode-only steps apart.
    corrections = pool([result])[0]
    assert {(c.gpu, c.model) for c in corrections} == {("cpu", "tiny")}
    assert sorted(c.phase for c in corrections) in (["aggregated"], ["decode", "prefill"])
