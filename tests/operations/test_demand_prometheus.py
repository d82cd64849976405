"""The Prometheus demand source against a real Prometheus (Debian's package) on loopback.

The test serves vLLM-style counters that grow at known rates, Prometheus scrapes them every
half second, and the source must read back those rates (within 10%), times the headroom, raised to
the floors, with a model without samples falling back and an unknown model reported.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.demand_sources import demand_report
from solver.operations.demand_rules import DemandFile, load_demand_file
from solver.stack import load_stack
from tests import prometheus_server
from tests.conftest import REPO
from tests.prometheus_server import free_port

# tokens/s each series grows by: (metric, model, coral_phase label or None) -> rate
RATES = {
    ("vllm:prompt_tokens_total", "qwen3-32b", "prefill"): 300.0,
    ("vllm:generation_tokens_total", "qwen3-32b", "prefill"): 2.0,  # the 1st token, not demand
    ("vllm:prompt_tokens_total", "qwen3-32b", "decode"): 300.0,  # the same prompts again
    ("vllm:generation_tokens_total", "qwen3-32b", "decode"): 120.0,
    ("vllm:prompt_tokens_total", "llama3-8b", None): 50.0,  # served, but not in the stack
    ("vllm:generation_tokens_total", "llama3-8b", None): 5.0,
}
TOLERANCE = 0.10  # rate() over a 4 s window of 0.5 s scrapes, extrapolated at the edges
# vLLM's per-request token histograms: (metric, model, coral_phase) -> (upper bounds, requests/s
# at or below each, tokens/s summed). The decode node's prompts (the same requests, counted
# again) have another shape: the source must skip them.
HISTOGRAMS = {
    ("vllm:request_prompt_tokens", "qwen3-32b", "prefill"):
        ((500, 1000, 2000, "+Inf"), (4, 12, 18, 20), 20 * 900.0),
    ("vllm:request_generation_tokens", "qwen3-32b", "prefill"):
        ((1, 2, "+Inf"), (20, 20, 20), 20 * 1.0),
    ("vllm:request_prompt_tokens", "qwen3-32b", "decode"):
        ((500, 1000, 2000, "+Inf"), (0, 0, 0, 20), 20 * 5000.0),
    ("vllm:request_generation_tokens", "qwen3-32b", "decode"):
        ((100, 200, 500, "+Inf"), (6, 14, 20, 20), 20 * 150.0),
}  # fmt: skip


class Counters(BaseHTTPRequestHandler):
    start = time.monotonic()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        elapsed = time.monotonic() - self.start
        lines = []
        for metric in sorted({m for m, _, _ in RATES}):
            lines.append(f"# TYPE {metric.removesuffix('_total')} counter")
            for (name, model, phase), rate in RATES.items():
                if name == metric:
                    labels = f'model_name="{model}",engine="0"'
                    labels += f',coral_phase="{phase}"' if phase else ""
                    lines.append(f"{metric}{{{labels}}} {1000 + rate * elapsed:.3f}")
        for metric in sorted({m for m, _, _ in HISTOGRAMS}):
            lines.append(f"# TYPE {metric} histogram")
            for (name, model, phase), (bounds, counts, total) in HISTOGRAMS.items():
                if name != metric:
                    continue
                labels = f'model_name="{model}",engine="0",coral_phase="{phase}"'
                for le, count in zip(bounds, counts, strict=True):
                    lines.append(f'{metric}_bucket{{{labels},le="{le}"}} {count * elapsed:.3f}')
                lines.append(f"{metric}_count{{{labels}}} {counts[-1] * elapsed:.3f}")
                lines.append(f"{metric}_sum{{{labels}}} {total * elapsed:.3f}")
        body = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory) -> Iterator[str]:
    # Until every series is older than the 4 s window: 11 samples in 6 s.
    query = "min(count_over_time(vllm:prompt_tokens_total[6s]))"
    with prometheus_server.scraping(Counters, tmp_path_factory.mktemp("prom"), query, 11) as url:
        yield url


def stack_dir(tmp_path: Path, url: str) -> Path:
    """stacks/ with a `live` stack: staging's models, a prometheus source at the test server."""
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.staging.yaml").read_text())
    fleet = doc["config"]["coral:fleet"]
    fleet["demand_source"] = {
        "kind": "prometheus",
        "prometheus": {
            "url": url,
            "window": "4s",
            "headroom": 1.5,
            "model_floors": {
                "gpt-oss-20b": {"tokens_per_s": {"prefill": 700, "decode": 7}},
                "qwen3-32b": {"tokens_per_s": {"prefill": 0, "decode": 400}},
            },
        },
    }
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    (stacks / "Pulumi.live.yaml").write_text(yaml.safe_dump(doc))
    return stacks


def test_rates_headroom_floors_and_fallbacks_from_a_real_prometheus(prometheus, tmp_path):
    stacks = stack_dir(tmp_path, prometheus)
    report = demand_report(load_stack(stacks, "live"), "live", stacks)
    by_model = {m.model: m for m in report.models}
    qwen = by_model["qwen3-32b"].demand.tokens_per_s
    assert qwen is not None
    # Prompts counted off prefill nodes only, output off decode nodes only: 300 and 120 tok/s.
    assert qwen.prefill == pytest.approx(300 * 1.5, rel=TOLERANCE)
    assert qwen.decode == 400  # 120 x 1.5 = 180 is below the floor of 400
    assert by_model["qwen3-32b"].origin == "prometheus+floor"
    assert "vllm:prompt_tokens_total" in by_model["qwen3-32b"].detail
    # No samples for gpt-oss-20b and no config demand: its floor, with a warning naming it.
    oss = by_model["gpt-oss-20b"]
    assert oss.origin == "floor" and oss.demand.tokens_per_s is not None
    assert (oss.demand.tokens_per_s.prefill, oss.demand.tokens_per_s.decode) == (700, 7)
    assert any("gpt-oss-20b" in w for w in report.warnings)
    # Served but not in the stack: reported, not planned.
    assert report.unknown_models == ["llama3-8b"]
    assert any("llama3-8b" in w for w in report.warnings)


def test_refresh_writes_the_demand_file_that_show_then_reads(prometheus, tmp_path, monkeypatch):
    stacks = stack_dir(tmp_path, prometheus)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    r = runner.invoke(app, ["demand", "refresh", "--stack", "live", "--write"])
    assert r.exit_code == 0, r.output
    text = (stacks / "demand" / "live.yaml").read_text()
    assert text.startswith("# Demand for stack live, written by `coral demand refresh` at ")
    assert "# Query: sum by (model_name) (rate(vllm:prompt_tokens_total" in text
    doc = load_demand_file(stacks / "demand" / "live.yaml")
    assert isinstance(doc, DemandFile) and doc.retrieved_utc is not None
    assert prometheus in doc.source and set(doc.demand) == {"gpt-oss-20b", "qwen3-32b"}
    # The lengths served, prompts off the prefill nodes, outputs off the decode nodes: the means
    # exactly (sum over count), a spread fitted to the buckets; none for a model without samples.
    assert set(doc.lengths) == {"qwen3-32b"}
    lengths = doc.lengths["qwen3-32b"]
    assert (lengths.mean_prompt_tokens, lengths.mean_output_tokens) == (900, 150)
    assert 0.3 < lengths.prompt_sigma < 1.5 and 0.3 < lengths.output_sigma < 1.5
    assert lengths.requests >= 50 and prometheus in lengths.source
    assert "# Lengths measured for 1 of 2 models (qwen3-32b)" in text
    # What `coral plan` reads back: the measured means and spreads in place of the config's.
    fleet = load_stack(stacks, "live")
    report = demand_report(fleet.model_copy(update={"demand_source": fleet.demand_source.model_copy(
        update={"kind": "file"})}), "live", stacks)  # fmt: skip
    spec = report.apply(fleet.models)["qwen3-32b"]
    assert (spec.mean_prompt_tokens, spec.mean_output_tokens) == (900, 150)
    assert spec.measured_lengths == lengths
    # Prometheus gone: `show` falls back to the file only when the stack says so.
    dead = f"http://127.0.0.1:{free_port()}"
    r = runner.invoke(app, ["demand", "show", "--stack", "live", "--prometheus", dead])
    assert r.exit_code == 1
    assert f"cannot reach Prometheus at {dead}/api/v1/query" in " ".join(r.output.split())
