"""Demand sources without a server: the schema, the file and rate rules, the HTTP client's
errors (faked responses, and a closed port on loopback), the demand file's bytes (golden file
tests/golden/demand/live.yaml; CORAL_ACCEPT=1 rewrites it), the CLI."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.demand_sources import (
    PrometheusUnreachable,
    demand_report,
    query_vector,
    refresh_file,
    resolve_demand,
)
from solver.errors import InputError
from solver.operations.demand_rules import (
    DemandFile,
    MeasuredRates,
    demand_file_text,
    file_demand,
    rate_query,
    rates_demand,
)
from solver.stack import Demand, FleetConfig, PrometheusSource, load_stack, parse_fleet
from tests.conftest import REPO

runner = CliRunner()
STACKS = REPO / "stacks"


def fleet_with(base: str = "staging", **changes: object) -> FleetConfig:
    doc = yaml.safe_load((STACKS / f"Pulumi.{base}.yaml").read_text())["config"]
    doc["coral:fleet"].update(changes)
    return parse_fleet(doc, f"Pulumi.{base}.yaml")


def prom(**settings: object) -> dict[str, object]:
    return {"kind": "prometheus", "prometheus": {"url": "http://127.0.0.1:9", **settings}}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"kind": "prometheus"}, "kind prometheus needs a `prometheus: {url: ...}` block"),
        ({"kind": "file", "prometheus": {"url": "http://x"}}, "needs kind prometheus"),
        ({"kind": "config", "file": "d.yaml"}, "`file` needs kind file or prometheus"),
        (prom(headroom=0.9), "demand_source.prometheus.headroom"),
        (prom(window="1 hour"), "demand_source.prometheus.window"),
        (prom(model_label='model"}'), "demand_source.prometheus.model_label"),
        (prom(url="prometheus:9090"), "demand_source.prometheus.url"),
        (prom(model_floors={"phi-5": {"requests_per_s": 1}}), "model phi-5 is not in models"),
    ],
    ids=[
        "no-block",
        "block-without-kind",
        "file-with-config",
        "headroom-below-1",
        "bad-window",
        "label-injection",
        "url-without-scheme",
        "floor-unknown-model",
    ],
)
def test_bad_demand_source_names_the_field(source, message):
    with pytest.raises(InputError, match="coral:fleet") as e:
        fleet_with(demand_source=source)
    assert message in str(e.value)


def test_staging_reads_its_demand_file():
    fleet = load_stack(STACKS, "staging")
    report = demand_report(fleet, "staging", STACKS)
    assert [(m.model, m.origin) for m in report.models] == [
        ("gpt-oss-20b", "file"),
        ("qwen3-32b", "file"),
    ]
    applied = report.apply(fleet.models)
    assert applied["qwen3-32b"].phase_demand() == {"prefill": 480.0, "decode": 200.0}
    assert report.warnings == [] and report.unknown_models == []


def test_file_missing_a_model_falls_back_to_config_and_reports_extras():
    fleet = fleet_with(
        models={
            **fleet_with().model_dump(mode="json", exclude_none=True)["models"],
            "phi-4": {
                "slo_ms": {"prefill": 1200, "decode": 60},
                "mean_prompt_tokens": 1020,
                "mean_output_tokens": 129,
                "demand": {"requests_per_s": 1},
            },
        }
    )
    doc = DemandFile(
        source="test",
        demand={
            "qwen3-32b": Demand(requests_per_s=1),
            "gpt-oss-20b": Demand(requests_per_s=1),
            "llama3-8b": Demand(requests_per_s=3),
        },
    )
    report = file_demand(fleet.models, doc, "d.yaml")
    assert {m.model: m.origin for m in report.models}["phi-4"] == "config"
    assert report.unknown_models == ["llama3-8b"]
    assert any("phi-4" in w for w in report.warnings)
    assert any("llama3-8b" in w and "does not serve" in w for w in report.warnings)


def test_file_missing_a_model_without_config_demand_is_an_error_naming_both():
    doc = DemandFile(source="test", demand={"qwen3-32b": Demand(requests_per_s=1)})
    with pytest.raises(InputError, match="models.gpt-oss-20b.demand") as e:
        file_demand(fleet_with().models, doc, "stacks/demand/x.yaml")
    assert "stacks/demand/x.yaml has no entry for it" in str(e.value)


def test_missing_demand_file_says_how_to_create_it(tmp_path):
    (tmp_path / "Pulumi.staging.yaml").write_text((STACKS / "Pulumi.staging.yaml").read_text())
    with pytest.raises(InputError, match="no demand file") as e:
        demand_report(load_stack(tmp_path, "staging"), "staging", tmp_path)
    assert "demand/staging.yaml" in str(e.value) and "coral demand refresh" in str(e.value)


def rates(prompt: dict[str, float], generation: dict[str, float]) -> MeasuredRates:
    return MeasuredRates(
        prompt_tokens_per_s=prompt, generation_tokens_per_s=generation, queries=["q"]
    )


def test_rates_times_headroom_raised_to_floors_per_phase():
    settings = PrometheusSource(
        url="http://x",
        headroom=2,
        floor=Demand(tokens_per_s={"prefill": 100, "decode": 100}),
        model_floors={"gpt-oss-20b": Demand(requests_per_s=1)},  # 1500 / 13 tok/s
    )
    fleet = fleet_with()
    report = rates_demand(
        fleet.models, rates({"qwen3-32b": 400, "gpt-oss-20b": 10}, {"qwen3-32b": 30}), settings
    )
    got = {m.model: (m.demand.tokens_per_s, m.origin) for m in report.models}
    qwen, origin = got["qwen3-32b"]
    assert (qwen.prefill, qwen.decode, origin) == (800, 100, "prometheus+floor")
    oss, origin = got["gpt-oss-20b"]
    assert (oss.prefill, oss.decode, origin) == (1500, 13, "prometheus+floor")
    assert report.warnings == []


def test_unmeasured_model_uses_config_demand_then_floor_else_fails():
    fleet = fleet_with()
    settings = PrometheusSource(url="http://x", floor=Demand(requests_per_s=0.5))
    report = rates_demand(fleet.models, rates({"qwen3-32b": 10}, {"qwen3-32b": 1}), settings)
    oss = next(m for m in report.models if m.model == "gpt-oss-20b")
    assert oss.origin == "floor" and oss.demand.tokens_per_s.prefill == 750
    assert "Prometheus has no samples for gpt-oss-20b: using its floor demand" in report.warnings
    with pytest.raises(InputError, match="models.gpt-oss-20b.demand: no demand"):
        rates_demand(fleet.models, rates({"qwen3-32b": 10}, {}), PrometheusSource(url="http://x"))


def test_aggregated_model_gets_requests_per_s_from_tokens():
    fleet = fleet_with()
    spec = fleet.models["qwen3-32b"].model_copy(update={"serving": "aggregated"})
    fleet = fleet.model_copy(update={"models": {"qwen3-32b": spec}})
    report = rates_demand(
        fleet.models,
        rates({"qwen3-32b": 600}, {"qwen3-32b": 500}),
        PrometheusSource(url="http://x", headroom=1),
    )
    # max(600 / 600 mean prompt, 500 / 250 mean output) = 2 requests/s
    assert report.models[0].demand == Demand(requests_per_s=2)


def test_rate_query_skips_the_phase_that_repeats_the_count():
    s = PrometheusSource(url="http://x", window="30m")
    assert rate_query("vllm:prompt_tokens_total", s, "decode") == (
        'sum by (model_name) (rate(vllm:prompt_tokens_total{coral_phase!="decode"}[30m]))'
    )


def client(status: int, body: object) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query" and "query" in request.url.params
        return httpx.Response(status, json=body)

    return httpx.Client(transport=httpx.MockTransport(answer))


SETTINGS = PrometheusSource(url="http://prom.test:9090/")


def test_query_vector_sums_samples_per_model():
    body = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {"metric": {"model_name": "a"}, "value": [1, "1.5"]},
                {"metric": {"model_name": "a"}, "value": [1, "2"]},
                {"metric": {}, "value": [1, "9"]},
            ],
        },
    }
    assert query_vector(SETTINGS, "q", client(200, body)) == {"a": 3.5}


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (500, {}, "answered HTTP 500"),
        (400, {"status": "error", "errorType": "bad_data", "error": "parse error"}, "parse error"),
        (200, {"status": "success", "data": {"resultType": "matrix"}}, "expected a vector"),
    ],
    ids=["server-error", "promql-error", "not-a-vector"],
)
def test_query_errors_name_the_url(status, body, message):
    with pytest.raises(InputError, match=message) as e:
        query_vector(SETTINGS, "q", client(status, body))
    assert "coral:fleet.demand_source.prometheus.url" in str(e.value)
    if message != "expected a vector":
        assert "http://prom.test:9090/api/v1/query" in str(e.value)


def closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_server_down_is_a_clear_error_naming_the_url():
    url = closed_port_url()
    with pytest.raises(
        PrometheusUnreachable, match=f"cannot reach Prometheus at {url}/api/v1/query"
    ):
        query_vector(PrometheusSource(url=url, timeout_s=2), "q")


def stacks_with_prometheus(tmp_path: Path, on_unreachable: str) -> Path:
    doc = yaml.safe_load((STACKS / "Pulumi.staging.yaml").read_text())
    doc["config"]["coral:fleet"]["demand_source"] = prom(
        url=closed_port_url(),
        on_unreachable=on_unreachable,
        model_floors={"qwen3-32b": {"requests_per_s": 2}},
    )
    (tmp_path / "Pulumi.live.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "demand").mkdir()
    (tmp_path / "demand" / "live.yaml").write_text((STACKS / "demand" / "staging.yaml").read_text())
    return tmp_path


def test_unreachable_prometheus_falls_back_to_the_file_with_floors_only_when_asked(tmp_path):
    stacks = stacks_with_prometheus(tmp_path, "file")
    warnings: list[str] = []
    fleet = resolve_demand(load_stack(stacks, "live"), "live", stacks, warnings.append)
    # The file says 0.8 requests/s; the floor of 2 holds.
    assert fleet.models["qwen3-32b"].phase_demand() == {"prefill": 1200, "decode": 500}
    assert fleet.models["gpt-oss-20b"].phase_demand() == {"prefill": 2000, "decode": 20}
    assert "cannot reach Prometheus" in warnings[0] and "demand/live.yaml" in warnings[0]
    strict = tmp_path / "strict"
    strict.mkdir()
    stacks = stacks_with_prometheus(strict, "fail")
    with pytest.raises(PrometheusUnreachable):
        resolve_demand(load_stack(stacks, "live"), "live", stacks)


def test_demand_file_bytes_are_deterministic_golden_and_read_back():
    body = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": {"model_name": "qwen3-32b"}, "value": [1, "100"]}],
        },
    }
    fleet = fleet_with(demand_source=prom(floor={"requests_per_s": 0.1}))
    when = dt.datetime(2026, 11, 29, 12, 0, 0, 123, tzinfo=dt.UTC)
    texts = []
    for _ in range(2):
        doc, header, _ = refresh_file(fleet, "live", None, client(200, body), when)
        texts.append(demand_file_text(doc, header))
    assert texts[0] == texts[1]
    golden = REPO / "tests" / "golden" / "demand" / "live.yaml"
    if os.environ.get("CORAL_ACCEPT") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(texts[0], encoding="utf-8")
    assert golden.exists(), f"no golden file {golden}; run with CORAL_ACCEPT=1 to create it"
    assert texts[0] == golden.read_text(encoding="utf-8"), f"{golden} differs (CORAL_ACCEPT=1)"
    assert (
        "# Demand for stack live, written by `coral demand refresh` at 2026-11-29T12:00:00Z."
        in texts[0]
    )
    parsed = DemandFile.model_validate(yaml.safe_load(texts[0]))
    assert parsed.retrieved_utc == when.replace(microsecond=0)
    assert list(parsed.demand) == ["gpt-oss-20b", "qwen3-32b"]


def test_cli_show_json_and_refresh_of_a_config_stack(monkeypatch):
    monkeypatch.chdir(REPO)
    r = runner.invoke(app, ["demand", "show", "--stack", "staging", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kind"] == "file"
    qwen = next(m for m in data["models"] if m["model"] == "qwen3-32b")
    assert qwen["phase_demand"] == {"prefill": 480.0, "decode": 200.0}
    assert qwen["detail"] == "stacks/demand/staging.yaml"
    r = runner.invoke(app, ["demand", "refresh", "--stack", "dev"])
    assert r.exit_code == 0 and "nothing to refresh" in r.output
    r = runner.invoke(app, ["demand", "show", "--stack", "stagin"])
    assert r.exit_code == 1 and "staging" in r.output


def test_demand_file_tokens_for_an_aggregated_model_become_requests_per_s():
    """The planner needs requests/s for an aggregated model, whatever unit the file used."""
    from solver.plan.planner import stack_demand
    from solver.stack import PhaseTokens

    fleet = fleet_with()
    spec = fleet.models["qwen3-32b"].model_copy(update={"serving": "aggregated"})
    fleet = fleet.model_copy(update={"models": {"qwen3-32b": spec}})
    doc = DemandFile(
        source="test",
        demand={"qwen3-32b": Demand(tokens_per_s=PhaseTokens(prefill=600, decode=500))},
    )
    report = file_demand(fleet.models, doc, "d.yaml")
    assert report.models[0].demand == Demand(requests_per_s=2)
    assert stack_demand(report.apply(fleet.models)) == {("qwen3-32b", "aggregated"): 2}


def test_prometheus_url_override_from_option_then_environment(monkeypatch):
    from coral_iac.demand_sources import URL_ENV, with_prometheus_url

    settings = PrometheusSource(url="http://config:9090")
    monkeypatch.delenv(URL_ENV, raising=False)
    assert with_prometheus_url(settings, None).url == "http://config:9090"
    monkeypatch.setenv(URL_ENV, "http://env:9090")
    assert with_prometheus_url(settings, None).url == "http://env:9090"
    assert with_prometheus_url(settings, "http://option:9090").url == "http://option:9090"


def test_measured_lengths_replace_the_named_shape_in_planning():
    """A model its fleet was measured serving at fixed lengths (sigma 0) plans on exactly
    those, where its named shape (Azure Conversation) spreads them; the plan says where its
    workload came from."""
    from solver.plan.attainment import _generated
    from solver.simulation.workload import planning_workload
    from solver.stack import MeasuredLengths

    spec = fleet_with().models["qwen3-32b"]
    measured = MeasuredLengths(mean_prompt_tokens=700, mean_output_tokens=90, prompt_sigma=0,
                               output_sigma=0, requests=500, source="Prometheus http://p")  # fmt: skip
    doc = DemandFile(source="test", demand={"qwen3-32b": Demand(requests_per_s=1)},
                     lengths={"qwen3-32b": measured})  # fmt: skip
    report = file_demand({"qwen3-32b": spec}, doc, "demand.yaml")
    applied = report.apply({"qwen3-32b": spec})["qwen3-32b"]
    named = planning_workload(spec, 0)
    fixed = planning_workload(applied, 0)
    assert named.prompts.min() < 0.5 * named.prompts.max()  # the named shape spreads them
    assert fixed.prompts == pytest.approx(700.0) and fixed.outputs == pytest.approx(90.0)
    assert "measured lengths: prompt mean 700 sigma 0" in _generated(applied)
    assert "Prometheus http://p" in _generated(applied)
    assert _generated(spec).startswith("generated, not a trace (")
