"""Inputs past any real fleet are clear errors: alias bombs, absurd or non-finite numbers, bad
Prometheus answers, passwords in URLs, unknown names in the stack's lists, empty files."""

from __future__ import annotations

import copy
import re
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.demand_sources import (
    UNREACHABLE_FIX,
    checked_url,
    demand_report,
    query_vector,
    refresh_file,
)
from solver.catalog.model_cards import load_model_cards
from solver.catalog.offers import load_catalog
from solver.errors import InputError, mask_credentials
from solver.io import MAX_ALIAS_NODES, load_yaml_model, parse_yaml
from solver.operations.demand_rules import DemandFile
from solver.stack import (
    MAX_REQUESTS_PER_S,
    MAX_TOKENS_PER_S,
    FleetConfig,
    PrometheusSource,
    load_stack,
    parse_fleet,
)
from solver.validation import check_fleet
from tests.conftest import REPO

runner = CliRunner()
DEV: dict[str, Any] = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
FLEET: dict[str, Any] = DEV["config"]["coral:fleet"]
PHI = FLEET["models"]["phi-4"]
SECRET = "hunter2"
URL = f"http://bob:{SECRET}@prom.internal:9090"


def fleet(**changes: Any) -> FleetConfig:
    """The dev stack's fleet with top-level keys replaced."""
    return parse_fleet({"coral:fleet": copy.deepcopy(FLEET) | changes}, "Pulumi.test.yaml")


def phi(**changes: Any) -> dict[str, Any]:
    """`models` with phi-4's spec changed."""
    return {"phi-4": PHI | changes}


def project(tmp_path: Path, stack: dict[str, Any] | str, name: str = "dev") -> Path:
    """A Coral project in tmp_path holding one stack (a mapping, or the file's text)."""
    (tmp_path / "stacks" / "demand").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "Pulumi.yaml", tmp_path / "Pulumi.yaml")
    text = stack if isinstance(stack, str) else yaml.safe_dump(stack, sort_keys=False)
    (tmp_path / "stacks" / f"Pulumi.{name}.yaml").write_text(text)
    return tmp_path


def with_fleet(**changes: Any) -> dict[str, Any]:
    """The dev stack document with `coral:fleet` keys replaced."""
    doc = copy.deepcopy(DEV)
    doc["config"]["coral:fleet"].update(changes)
    return doc


def plan_fails(root: Path, monkeypatch: pytest.MonkeyPatch, stack: str = "dev") -> str:
    """`coral plan` in `root`: exit 1, one message, no traceback, no plan written."""
    monkeypatch.chdir(root)
    r = runner.invoke(app, ["plan", "--stack", stack, "--out", "plan.json"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output and "Error:" in r.output
    assert not (root / "plan.json").exists()
    return " ".join(r.output.split())


# --- YAML aliases --------------------------------------------------------------------------


def laughs(depth: int) -> str:
    """The "billion laughs" document: each anchor is 9 aliases of the one before."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("depth", [6, 9, 30])
def test_nested_aliases_are_refused_at_once(depth):
    start = time.perf_counter()
    with pytest.raises(InputError, match=r"s\.yaml: l\d\[\d\]: aliases expand to more than") as e:
        parse_yaml(laughs(depth), "s.yaml")
    assert time.perf_counter() - start < 0.5
    assert "To fix: write the repeated values out" in str(e.value)


def test_an_alias_inside_its_own_anchor_is_refused():
    with pytest.raises(InputError, match=r"a\.b\[0\]: an alias refers to the node that contains"):
        parse_yaml("a: &a {b: [*a]}\n", "s.yaml")


def test_nesting_deeper_than_any_stack_is_refused():
    deep = "a: " + "[" * 150 + "]" * 150 + "\n"
    with pytest.raises(InputError, match=r"\.\.\.: nested more than 100 levels deep"):
        parse_yaml(deep, "s.yaml")
    # Aliases count at their full depth: 2 x 60 levels, each under 100 alone.
    twice = "a: &a " + "[" * 60 + "]" * 60 + "\nb: " + "[" * 60 + "*a" + "]" * 60 + "\n"
    with pytest.raises(InputError, match="nested more than 100 levels deep"):
        parse_yaml(twice, "s.yaml")


def test_aliases_below_the_bound_load():
    assert len(parse_yaml(laughs(4), "s.yaml")["l3"]) == 9  # 9**4 = 6,561 nodes
    assert MAX_ALIAS_NODES < 9**6


ALIASED = """\
config:
  coral:fleet:
    models:
      phi-4: &phi
        slo_ms: &slo {prefill: 1200, decode: 60}
        mean_prompt_tokens: 1020
        mean_output_tokens: 129
        demand: {requests_per_s: 1}
      qwen3-32b:
        <<: *phi
        slo_ms: *slo
    regions: [{cloud: aws, region: us-east-2}]
    node_configs: &nodes [l4x1, l40sx1]
    description: *slo
"""


def test_a_stack_with_a_few_aliases_loads(tmp_path):
    with pytest.raises(InputError, match="description: Input should be a valid string"):
        load_stack(project(tmp_path, ALIASED) / "stacks", "dev")
    root = project(tmp_path, ALIASED.replace("description: *slo", "description: aliased"))
    parsed = load_stack(root / "stacks", "dev")
    assert parsed.models["qwen3-32b"] == parsed.models["phi-4"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a:\n  b: !!int abc\n", r"a\.b \(line 2\): 'abc' is not a valid int"),
        ("retrieved_utc: 2026-11-31\n", r"retrieved_utc \(line 1\): .* not a valid timestamp"),
        (f"n: {'9' * 5000}\n", r"n \(line 1\): .* not a valid int \(more than 4300 digits\)"),
    ],
    ids=["bad-int", "no-such-day", "5000-digits"],
)
def test_a_value_yaml_cannot_read_is_an_error_naming_its_line(text, message):
    with pytest.raises(InputError, match=r"s\.yaml: " + message):
        parse_yaml(text, "s.yaml")


def test_an_integer_too_long_to_print_is_named_by_its_size():
    huge = parse_yaml(f"n: 0x{'f' * 5000}\n", "s.yaml")["n"]
    with pytest.raises(InputError, match=r"library\.n_max: .* \(got an integer of 20000 bits\)"):
        fleet(library={"n_max": huge})


def test_plan_refuses_an_alias_bomb_quickly(tmp_path, monkeypatch):
    bomb = (REPO / "stacks" / "Pulumi.dev.yaml").read_text() + laughs(9).replace("l", "x-l")
    start = time.perf_counter()
    out = plan_fails(project(tmp_path, bomb), monkeypatch)
    assert time.perf_counter() - start < 5
    assert "Pulumi.dev.yaml: x-l4[5]" in out and "aliases expand to more than 50,000 nodes" in out


# --- demand and other numbers that reach the ILP --------------------------------------------


@pytest.mark.parametrize("value", ["1e308", "1e30", "1.0e+8", 10_000_001])
def test_absurd_requests_per_s_is_an_error_naming_the_bound(value):
    with pytest.raises(InputError, match=r"models\.phi-4\.demand\.requests_per_s: .*10000000") as e:
        fleet(models=phi(demand={"requests_per_s": value}))
    assert "at most 1e7" in e.value.fix


@pytest.mark.parametrize("value", [".inf", ".nan", "'-inf'", "1e400"])
def test_non_finite_tokens_per_s_is_an_error(value):
    tokens = {"prefill": yaml.safe_load(value), "decode": 1}
    with pytest.raises(InputError, match=r"demand\.tokens_per_s\.prefill: must be a finite"):
        fleet(models=phi(demand={"tokens_per_s": tokens}))


def test_the_bounds_themselves_are_accepted():
    f = fleet(models=phi(demand={"tokens_per_s": {"prefill": 1e10, "decode": 1e10}}))
    assert f.models["phi-4"].phase_demand() == {"prefill": 1e10, "decode": 1e10}
    agg = phi(demand={"requests_per_s": MAX_REQUESTS_PER_S}, serving="aggregated")
    assert fleet(models=agg).models["phi-4"].phase_demand() == {"aggregated": 1e7}


def test_requests_per_s_that_make_too_many_tokens_per_s_are_an_error():
    with pytest.raises(InputError, match=r"models\.phi-4: .*1020 mean prompt tokens = 1\.02e\+10"):
        fleet(models=phi(demand={"requests_per_s": MAX_REQUESTS_PER_S}))


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"mean_prompt_tokens": 1e12}, r"models\.phi-4\.mean_prompt_tokens"),
        ({"slo_ms": {"prefill": 1e300, "decode": 60}}, r"models\.phi-4\.slo_ms\.prefill"),
        ({"priority": 10**40}, r"models\.phi-4\.priority"),
    ],
    ids=["mean-prompt", "slo", "priority"],
)
def test_absurd_model_numbers_are_errors(changes, where):
    with pytest.raises(InputError, match=where):
        fleet(models=phi(**changes))


SLOT = {"cloud": "aws", "region": "us-east-2", "node": "l4x1"}


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"availability": [SLOT | {"count": 10**30}]}, r"availability\[0\]\.count"),
        (
            {"gpu_pools": [{"cloud": "aws", "region": "us-east-2", "gpu": "l4", "gpus": 10**9}]},
            r"gpu_pools\[0\]\.gpus",
        ),
        (
            {"prices": [SLOT | {"usd_per_hour": 1e300, "source": "typo"}]},
            r"prices\[0\]\.usd_per_hour",
        ),
        ({"allocation": {"budget_usd_per_hour": 1e300}}, r"allocation\.budget_usd_per_hour"),
        ({"allocation": {"time_limit_s": 1e300}}, r"allocation\.time_limit_s"),
        ({"allocation": {"threads": 10**12}}, r"allocation\.threads"),
        ({"allocation": {"target_utilization": 1e-300}}, r"allocation\.target_utilization"),
        ({"allocation": {"adjustment_interval_minutes": 1e-300}}, "adjustment_interval_minutes"),
        ({"allocation": {"boot_minutes": 1e300}}, r"allocation\.boot_minutes"),
        (
            {"demand_source": {"kind": "prometheus", "prometheus": {"url": URL, "headroom": 1e9}}},
            r"prometheus\.headroom",
        ),
    ],
    ids=[
        "count",
        "gpus",
        "price",
        "budget",
        "time-limit",
        "threads",
        "utilization",
        "interval",
        "boot",
        "headroom",
    ],
)
def test_absurd_fleet_numbers_are_errors(changes, where):
    with pytest.raises(InputError, match=where):
        fleet(**changes)


def test_a_floor_too_high_for_an_aggregated_model_is_an_error():
    floor = {"tokens_per_s": {"prefill": 1e10, "decode": 0}}
    source = {"kind": "prometheus", "prometheus": {"url": URL, "floor": floor}}
    with pytest.raises(InputError, match=r"prometheus\.floor: for phi-4: .* requests/s"):
        fleet(models=phi(serving="aggregated", mean_prompt_tokens=100), demand_source=source)


def test_plan_refuses_1e308_requests_per_s_before_any_work(tmp_path, monkeypatch):
    stack = with_fleet(models=phi(demand={"requests_per_s": 1e308}))
    out = plan_fails(project(tmp_path, stack), monkeypatch)
    assert "models.phi-4.demand.requests_per_s: Input should be less than or equal to" in out
    assert "OverflowError" not in out and "time_limit_s" not in out


def file_stack(tmp_path: Path, demand_text: str, **model: Any) -> Path:
    stack = with_fleet(models=phi(**model), demand_source={"kind": "file"})
    root = project(tmp_path, stack)
    (root / "stacks" / "demand" / "dev.yaml").write_text(demand_text)
    return root


@pytest.mark.parametrize(
    ("figure", "message"),
    [
        ("{requests_per_s: 1e30}", r"demand\.phi-4\.requests_per_s: Input should be less than"),
        ("{requests_per_s: .nan}", r"demand\.phi-4\.requests_per_s: must be a finite number"),
        (
            "{tokens_per_s: {prefill: .inf, decode: 1}}",
            r"demand\.phi-4\.tokens_per_s\.prefill: must be a finite",
        ),
    ],
    ids=["huge", "nan", "inf"],
)
def test_a_demand_file_with_absurd_figures_is_an_error(tmp_path, figure, message):
    root = file_stack(tmp_path, f"source: test\ndemand:\n  phi-4: {figure}\n")
    with pytest.raises(InputError, match=r"stacks/demand/dev\.yaml: " + message):
        demand_report(load_stack(root / "stacks", "dev"), "dev", root / "stacks")


def test_demand_file_tokens_that_make_too_many_requests_are_an_error(tmp_path):
    text = "source: test\ndemand:\n  phi-4: {tokens_per_s: {prefill: 1e10, decode: 0}}\n"
    root = file_stack(tmp_path, text, serving="aggregated", mean_prompt_tokens=100)
    with pytest.raises(InputError, match=r"dev\.yaml: demand\.phi-4: .* 1e\+08 requests/s"):
        demand_report(load_stack(root / "stacks", "dev"), "dev", root / "stacks")


# --- Prometheus answers ------------------------------------------------------------------


def answering(*values: str) -> httpx.Client:
    """A Prometheus that answers every query with one sample of phi-4 per value."""

    def answer(request: httpx.Request) -> httpx.Response:
        result = [{"metric": {"model_name": "phi-4"}, "value": [1.0, v]} for v in values]
        data = {"resultType": "vector", "result": result}
        return httpx.Response(200, json={"status": "success", "data": data})

    return httpx.Client(transport=httpx.MockTransport(answer))


def prometheus_fleet(**settings: Any) -> FleetConfig:
    return fleet(demand_source={"kind": "prometheus", "prometheus": {"url": URL, **settings}})


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3", "lots"])
def test_a_non_finite_rate_names_the_model_and_query(value):
    with pytest.raises(InputError, match=re.escape(f"answered '{value}' tokens/s")) as e:
        demand_report(prometheus_fleet(), "dev", REPO / "stacks", client=answering(value))
    text = str(e.value)
    assert "for model phi-4 to `sum by (model_name) (rate(vllm:prompt_tokens_total" in text
    assert "prometheus.url" in text and SECRET not in text


def test_rates_that_overflow_the_demand_bound_are_an_error():
    with pytest.raises(InputError, match=r"measured inf tokens/s for phi-4 .* above the 1e\+10"):
        demand_report(
            prometheus_fleet(), "dev", REPO / "stacks", client=answering("1e308", "1e308")
        )
    with pytest.raises(InputError, match=r"measured 9e\+09 tokens/s .* x headroom 1\.2"):
        demand_report(prometheus_fleet(), "dev", REPO / "stacks", client=answering("9e9"))
    assert MAX_TOKENS_PER_S == 1e10


@pytest.mark.parametrize(
    "data",
    [
        {"resultType": "vector", "result": {"a": 1}},
        {"resultType": "vector", "result": ["x"]},
        {"resultType": "vector", "result": [{"metric": {"model_name": "phi-4"}}]},
        {"resultType": "vector", "result": [{"metric": {"model_name": 7}, "value": [1, "1"]}]},
        ["not", "a", "mapping"],
    ],
)
def test_a_malformed_answer_is_an_input_error(data):
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "success", "data": data})

    client = httpx.Client(transport=httpx.MockTransport(answer))
    with pytest.raises(InputError, match="prometheus.url: .*`q`"):
        query_vector(PrometheusSource(url=URL), "q", client)


# --- passwords in URLs --------------------------------------------------------------------


def test_every_error_masks_a_password_in_a_url():
    e = InputError(f"--x {URL}", f"cannot reach {URL}/api", f"try {URL}")
    assert (
        SECRET not in str(e) and e.problem == "cannot reach http://bob:***@prom.internal:9090/api"
    )
    assert mask_credentials("http://u:p@ss@h/x?y=a@b") == "http://u:***@h/x?y=a@b"
    assert mask_credentials("http://h:9090 and http://u@h") == "http://h:9090 and http://u@h"


def test_unreachable_prometheus_masks_the_password_and_gives_working_hints():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"refused {request.url}")

    client = httpx.Client(transport=httpx.MockTransport(refuse))
    with pytest.raises(
        InputError, match="cannot reach Prometheus at http://bob:\\*\\*\\*@prom"
    ) as e:
        demand_report(prometheus_fleet(), "dev", REPO / "stacks", client=client)
    assert SECRET not in str(e.value)
    assert e.value.fix == UNREACHABLE_FIX and "CORAL_PROMETHEUS_URL=URL" in UNREACHABLE_FIX
    # The hint names options the commands have: `coral plan` has no --prometheus.
    assert "pass --prometheus URL to `coral demand show` or `coral demand refresh`" in e.value.fix
    assert "--prometheus" not in runner.invoke(app, ["plan", "--help"]).output
    for command in ("show", "refresh"):
        assert "--prometheus" in runner.invoke(app, ["demand", command, "--help"]).output


def test_the_fallback_warning_masks_the_password(tmp_path):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    source = {"kind": "prometheus", "prometheus": {"url": URL, "on_unreachable": "file"}}
    root = project(tmp_path, with_fleet(demand_source=source))
    (root / "stacks" / "demand" / "dev.yaml").write_text(
        "source: test\ndemand:\n  phi-4: {requests_per_s: 2}\n"
    )
    client = httpx.Client(transport=httpx.MockTransport(refuse))
    report = demand_report(load_stack(root / "stacks", "dev"), "dev", root / "stacks", None, client)
    assert "http://bob:***@prom.internal:9090" in report.warnings[0]
    assert SECRET not in " ".join(report.warnings)


def test_refresh_writes_no_password_into_the_demand_file():
    doc, header, _ = refresh_file(prometheus_fleet(), "dev", client=answering("10"))
    assert "http://bob:***@prom.internal:9090" in doc.source
    assert SECRET not in doc.source + " ".join(header)


def test_a_malformed_url_with_a_password_is_quoted_masked():
    with pytest.raises(InputError, match="--prometheus: not an http") as e:
        checked_url(f"ftp://bob:{SECRET}@prom", "--prometheus")
    assert SECRET not in str(e.value)


# --- names in the stack's lists -------------------------------------------------------------


def pool(gpu: str, region: str = "us-east-2") -> dict[str, Any]:
    return {"cloud": "aws", "region": region, "gpu": gpu, "gpus": 4}


@pytest.mark.parametrize(
    ("gpu", "problem", "suggestion"),
    [
        ("l40", "unknown GPU type 'l40'", "l40s"),
        ("h200", "unknown GPU type 'h200'", "h100"),
    ],
)
def test_an_unknown_gpu_in_gpu_pools_is_an_error_with_a_guess(gpu, problem, suggestion):
    with pytest.raises(InputError, match=r"gpu_pools\[0\]\.gpu: " + problem) as e:
        check_fleet(fleet(gpu_pools=[pool(gpu)]), load_catalog(), load_model_cards())
    assert suggestion in e.value.suggestions


def test_a_pool_of_a_gpu_no_node_config_uses_is_an_error():
    with pytest.raises(InputError, match=r"gpu_pools\[0\]\.gpu: no node config .* has h100"):
        check_fleet(fleet(gpu_pools=[pool("h100")]), load_catalog(), load_model_cards())
    check_fleet(fleet(gpu_pools=[pool("l40s")]), load_catalog(), load_model_cards())


def test_plan_refuses_a_misspelt_gpu_pool(tmp_path, monkeypatch):
    out = plan_fails(project(tmp_path, with_fleet(gpu_pools=[pool("l40")])), monkeypatch)
    assert "coral:fleet.gpu_pools[0].gpu: unknown GPU type 'l40'" in out
    assert "Did you mean 'l40s'" in out


@pytest.mark.parametrize(
    ("changes", "message", "suggestion"),
    [
        (
            {"availability": [SLOT | {"region": "us-east-1", "count": 1}]},
            r"availability\[0\]\.region: region aws:us-east-1 is not in regions",
            "aws:us-east-2",
        ),
        (
            {"availability": [SLOT | {"node": "l4x2", "count": 1}]},
            r"availability\[0\]\.node: node l4x2 is not in node_configs",
            "l4x1",
        ),
        (
            {"prices": [SLOT | {"node": "a10gx2", "usd_per_hour": 1, "source": "q"}]},
            r"prices\[0\]\.node: node a10gx2 is not in node_configs",
            "a10gx1",
        ),
        (
            {"gpu_pools": [pool("l4", region="us-east-1")]},
            r"gpu_pools\[0\]\.region: region aws:us-east-1 is not in regions",
            "aws:us-east-2",
        ),
    ],
    ids=["availability-region", "availability-node", "prices-node", "pools-region"],
)
def test_overrides_name_the_stacks_own_regions_and_nodes(changes, message, suggestion):
    with pytest.raises(InputError, match=message) as e:
        fleet(**changes)
    assert suggestion in e.value.suggestions


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"node_configs": ["l4x1", "l4x4", "l4x1"]}, r"node_configs\[2\]: l4x1 is given twice"),
        (
            {"regions": [{"cloud": "aws", "region": "us-east-2"}] * 2},
            r"regions\[1\]: aws:us-east-2 is given twice",
        ),
        (
            {"availability": [SLOT | {"count": 1}, SLOT | {"count": 5}]},
            r"availability\[1\]: aws:us-east-2 l4x1 is given twice \(availability\[0\]",
        ),
        ({"gpu_pools": [pool("l4"), pool("l4")]}, r"gpu_pools\[1\]: aws:us-east-2 l4 is given"),
    ],
    ids=["node-configs", "regions", "availability", "pools"],
)
def test_a_list_naming_one_thing_twice_is_an_error(changes, message):
    with pytest.raises(InputError, match=message):
        fleet(**changes)


# --- empty files ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "# just a comment\n", "---\n"])
def test_an_empty_demand_file_says_so_and_what_it_holds(tmp_path, text):
    path = tmp_path / "dev.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match="dev.yaml: the file is empty") as e:
        load_yaml_model(DemandFile, path)
    assert e.value.fix == "write a mapping with the keys source, demand (optional: retrieved_utc, lengths)"
    assert "NoneType" not in str(e.value)


def test_plan_on_an_empty_demand_file_says_it_is_empty(tmp_path, monkeypatch):
    out = plan_fails(file_stack(tmp_path, ""), monkeypatch)
    assert "stacks/demand/dev.yaml: the file is empty" in out and "NoneType" not in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "Pulumi.dev.yaml: the file is empty"),
        ("# nothing yet\n", "Pulumi.dev.yaml: the file is empty"),
        ("- a\n", "Pulumi.dev.yaml: is a list, not a mapping"),
        ("config: coral:fleet\n", "Pulumi.dev.yaml: config: is a string, not a mapping"),
        ("config:\n  coral:fleet:\n", "Pulumi.dev.yaml: coral:fleet: is empty"),
        ("config:\n  coral:fleet: {}\n", "Pulumi.dev.yaml: coral:fleet: is empty"),
    ],
    ids=["empty", "comment", "list", "string-config", "null-fleet", "empty-fleet"],
)
def test_an_empty_or_shapeless_stack_file_says_what_to_write(tmp_path, monkeypatch, text, message):
    out = plan_fails(project(tmp_path, text), monkeypatch)
    assert message in out
    assert "stacks/Pulumi.dev.yaml is a small example" in out


@pytest.mark.parametrize(("text", "message"), [("", "the file is empty"), ("- a\n", "is a list")])
@pytest.mark.parametrize("command", [["preview"], ["render", "--out", "rendered"]])
def test_preview_and_render_refuse_a_stack_file_that_is_not_a_mapping(
    tmp_path, monkeypatch, text, message, command
):
    """As `coral plan` does: one message naming the file (they crashed on an AttributeError or
    Pulumi's 'Missing required configuration')."""
    monkeypatch.chdir(project(tmp_path, text))
    r = runner.invoke(app, [*command, "--stack", "dev"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output and message in r.output and "Pulumi.dev.yaml" in r.output
    assert not (tmp_path / "rendered").exists()
