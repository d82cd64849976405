"""`coral calibrate`'s Prometheus reader against a real Prometheus (Debian's package) on loopback.

A test server serves a recorded exposition of two replicas (`recorded_fleet`) as counters that
are zero for Prometheus's first two scrapes, grow to the recording over two seconds and then
hold; Prometheus scrapes it every half second. What `read_replica_metrics` reads through `increase()` per replica and bucket must
be the recording's histograms: the same share in every bucket, and counts within the few
percent `increase()` extrapolates at the window's end.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.cli.plan import load_plan
from coral_iac.fleet_metrics import metrics_from_exposition, read_replica_metrics
from solver.operations.step_calibration import replica_facts
from solver.performance.default_model import load_perf_model
from solver.stack import PrometheusSource, load_stack
from tests import prometheus_server
from tests.conftest import REPO
from tests.operations.recorded_fleet import record

GROW_S = 2.0


def growing(text: str, fraction: float) -> str:
    """The exposition with every sample times `fraction` (a fleet that has served that much)."""
    lines = []
    for family in text_string_to_metric_families(text):
        lines.append(f"# TYPE {family.name} {family.type}")
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            lines.append(f"{s.name}{{{labels}}} {s.value * fraction:.6f}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> tuple[str, list[str], Path]:
    """A recorded exposition of dev's two replicas, their keys and the plan."""
    root = tmp_path_factory.mktemp("plan")
    shutil.copy(REPO / "Pulumi.yaml", root / "Pulumi.yaml")
    (root / "stacks").mkdir()
    shutil.copy(REPO / "stacks" / "Pulumi.dev.yaml", root / "stacks")
    plan_file = root / "plan.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        r = CliRunner().invoke(app, ["plan", "--stack", "dev", "--out", str(plan_file),
                                     "--library", str(root / "lib")])  # fmt: skip
        assert r.exit_code == 0, r.output
    perf = load_perf_model()
    fleet = load_stack(REPO / "stacks", "dev")
    facts = replica_facts(load_plan(plan_file), fleet.models, perf, perf)
    text = record(facts, {f.replica: 0.5 for f in facts}, 600, 1.5, 16384)
    return text, [f.replica for f in facts], plan_file


@pytest.fixture(scope="module")
def prometheus(recording, tmp_path_factory) -> Iterator[str]:
    text = recording[0]
    scrapes: list[float] = []  # when Prometheus scraped; the growth starts at its third scrape

    class Recorded(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            scrapes.append(time.monotonic())
            start = scrapes[2] if len(scrapes) > 2 else float("inf")
            fraction = min(1.0, max(0.0, (time.monotonic() - start) / GROW_S))
            body = growing(text, fraction).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    # Until the counters have held at the recording for two seconds.
    query = "min(count_over_time(vllm:request_prompt_tokens_count[8s]))"
    with prometheus_server.scraping(Recorded, tmp_path_factory.mktemp("prom"), query, 14) as url:
        yield url


def test_histograms_read_through_prometheus_are_the_recorded_ones(recording, prometheus):
    text, keys, _ = recording
    recorded = metrics_from_exposition(text, keys, "10m")
    read, queries = read_replica_metrics(PrometheusSource(url=prometheus), keys, "30s")
    assert set(read) == set(recorded) == set(keys)
    assert any("increase(vllm:time_to_first_token_seconds_bucket" in q for q in queries)
    for key in keys:
        for name in ("ttft", "tpot", "prompt_tokens", "generation_tokens"):
            want, got = getattr(recorded[key], name), getattr(read[key], name)
            assert got.upper == want.upper, (key, name)
            assert got.count == pytest.approx(want.count, rel=0.08)
            shares = np.array(got.cumulative) / got.count
            assert shares == pytest.approx(np.array(want.cumulative) / want.count, abs=0.01)
            assert got.mean == pytest.approx(want.mean, rel=0.01)


def test_calibrate_reads_prometheus_through_the_cli(recording, prometheus, tmp_path, monkeypatch):
    """The same command on Prometheus: it names the source and reads every replica (a 30 s
    window of a recording of 10 minutes is a far higher rate than served, so the fit itself is
    not asked to hold here)."""
    _, keys, plan = recording
    shutil.copy(REPO / "Pulumi.yaml", tmp_path / "Pulumi.yaml")
    (tmp_path / "stacks").mkdir()
    shutil.copy(REPO / "stacks" / "Pulumi.dev.yaml", tmp_path / "stacks")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["calibrate", "--stack", "dev", "--plan", str(plan),
                                 "--prometheus", prometheus, "--window", "30s", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    import json

    data = json.loads(r.stdout)
    assert data["source"] == f"Prometheus {prometheus}, increase() over 30s"
    assert sorted(row["replica"] for row in data["replicas"]) == sorted(keys)
    assert all(row["requests"] > 200 for row in data["replicas"])
