"""Fuzzed stacks and demand sources: a valid stack mutated (nested aliases, huge and non-finite
numbers, wrong types, unknown names in every list, empty files), a mutated demand file and any
Prometheus answer end in a resolved fleet or one clean `CoralError`, never another exception,
and quickly; a few mutations that must fail go through `coral plan` for real and exit 1 with
one message, no traceback and no plan written."""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer.main
import typer.testing
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.demand_sources import demand_report, refresh_file, resolve_demand
from solver.catalog.model_cards import load_model_cards
from solver.catalog.offers import load_catalog
from solver.errors import CoralError
from solver.stack import load_stack
from tests.conftest import REPO

STACK = "fuzz"
FILE = f"Pulumi.{STACK}.yaml"
DEMAND = f"demand/{STACK}.yaml"
SLOT = {"cloud": "aws", "region": "us-east-2", "node": "l4x1"}
PHI = "phi-4"
SECONDS = 5.0  # per example; a valid or refused stack takes milliseconds


def base_doc() -> dict[str, Any]:
    """The dev stack with one entry in every list the fuzzer aims at."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    fleet = doc["config"]["coral:fleet"]
    fleet["availability"] = [SLOT | {"count": 8}]
    fleet["gpu_pools"] = [{"cloud": "aws", "region": "us-east-2", "gpu": "l4", "gpus": 16}]
    fleet["prices"] = [SLOT | {"usd_per_hour": 0.8, "source": "fuzz quote"}]
    return doc


BASE = base_doc()
BASE_DEMAND = "source: fuzz\ndemand:\n  phi-4: {requests_per_s: 2}\n"
# Numbers that reach the ILP (path inside coral:fleet); every one has an upper bound but rho.
NUMBERS: list[tuple[str | int, ...]] = [
    ("models", PHI, "slo_ms", "prefill"),
    ("models", PHI, "slo_ms", "decode"),
    ("models", PHI, "mean_prompt_tokens"),
    ("models", PHI, "mean_output_tokens"),
    ("models", PHI, "demand", "requests_per_s"),
    ("models", PHI, "slo_attainment"),
    ("models", PHI, "priority"),
    ("library", "n_max"),
    ("availability", 0, "count"),
    ("gpu_pools", 0, "gpus"),
    ("prices", 0, "usd_per_hour"),
    ("allocation", "budget_usd_per_hour"),
    ("allocation", "boot_minutes"),
    ("allocation", "adjustment_interval_minutes"),
    ("allocation", "target_utilization"),
    ("allocation", "time_limit_s"),
    ("allocation", "relative_gap"),
    ("allocation", "threads"),
]
ABSURD = [1e308, 1e30, -1e30, 10**30, -(10**30), math.inf, -math.inf, math.nan, "1e400", "NaN"]
SECTIONS: list[tuple[str | int, ...]] = [
    *NUMBERS,
    ("models",),
    ("models", PHI),
    ("models", PHI, "demand"),
    ("models", PHI, "serving"),
    ("regions",),
    ("regions", 0),
    ("regions", 0, "cloud"),
    ("node_configs",),
    ("node_configs", 0),
    ("availability",),
    ("gpu_pools", 0),
    ("gpu_pools", 0, "gpu"),
    ("prices", 0, "source"),
    ("library",),
    ("allocation",),
    ("demand_source",),
    ("demand_source", "kind"),
    ("description",),
]
NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=12)


@dataclass(frozen=True)
class Mutation:
    kind: str
    stack: str  # the stack file's text
    demand: str = BASE_DEMAND  # the demand file's text (read when demand_source is file)
    must_fail: bool = False
    expected: str = ""  # what the message must name when it fails


def text_of(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def fleet_of(doc: dict[str, Any]) -> dict[str, Any]:
    fleet: dict[str, Any] = doc["config"]["coral:fleet"]
    return fleet


def set_at(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    node: Any = fleet_of(doc)
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def key_path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def laughs(depth: int, width: int, indent: str = "") -> str:
    """Anchors of `width` aliases of the anchor before, `depth` levels (width**depth nodes)."""
    lines = [f"{indent}l0: &l0 [{', '.join(['x'] * width)}]"]
    for i in range(1, depth):
        lines.append(f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


@st.composite
def alias_bomb(draw: st.DrawFn) -> Mutation:
    width = draw(st.integers(2, 12))
    depth = math.ceil(math.log(10**6) / math.log(width)) + draw(st.integers(0, 3))
    where = draw(st.sampled_from(["top", "fleet", "demand"]))
    if where == "demand":
        bomb = BASE_DEMAND + laughs(depth, width)
        return Mutation("alias bomb in the demand file", with_file_source(), bomb, True, "aliases")
    base = text_of(BASE)
    if where == "top":
        return Mutation(
            "alias bomb", base + laughs(depth, width), must_fail=True, expected="aliases"
        )
    bomb = "    x-bomb:\n" + laughs(depth, width, indent="      ")
    stack = base.replace("    models:\n", bomb + "    models:\n", 1)
    return Mutation("alias bomb in the fleet", stack, must_fail=True, expected="aliases")


@st.composite
def alias_cycle(draw: st.DrawFn) -> Mutation:
    cycle = draw(st.sampled_from(["x: &x [*x]\n", "x: &x {a: {b: [1, *x]}}\n"]))
    return Mutation("alias cycle", text_of(BASE) + cycle, must_fail=True, expected="alias")


@st.composite
def absurd_number(draw: st.DrawFn) -> Mutation:
    path = draw(st.sampled_from(NUMBERS))
    value = draw(st.sampled_from(ABSURD))
    doc = copy.deepcopy(BASE)
    set_at(doc, path, value)
    return Mutation("absurd number", text_of(doc), must_fail=True, expected=key_path(path))


UNREADABLE = ["!!int abc", "!!float x", "2026-13-01", "9" * 5000, "0x" + "f" * 5000, "!!set {a}"]
HOLE = "fuzz-hole"


@st.composite
def unreadable_scalar(draw: st.DrawFn) -> Mutation:
    """A scalar YAML itself cannot construct, or one too large to print, where a number goes."""
    raw = draw(st.sampled_from(UNREADABLE))
    if draw(st.booleans()):
        demand = f"source: fuzz\nretrieved_utc: {raw}\ndemand:\n  phi-4: {{requests_per_s: 2}}\n"
        return Mutation("unreadable date", with_file_source(), demand, True, "retrieved_utc")
    path = draw(st.sampled_from(NUMBERS))
    doc = copy.deepcopy(BASE)
    set_at(doc, path, HOLE)
    stack = text_of(doc).replace(HOLE, raw)
    return Mutation("unreadable scalar", stack, must_fail=True, expected=key_path(path))


@st.composite
def any_number(draw: st.DrawFn) -> Mutation:
    path = draw(st.sampled_from([*NUMBERS, ("library", "rho")]))
    value = draw(
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.just(0))
    )
    doc = copy.deepcopy(BASE)
    set_at(doc, path, value)
    return Mutation("any number", text_of(doc))


@st.composite
def wrong_type(draw: st.DrawFn) -> Mutation:
    path = draw(st.sampled_from(SECTIONS))
    value = draw(st.sampled_from([True, "abc", "", [1], [], {"a": 1}, {}, None, 0, -1]))
    doc = copy.deepcopy(BASE)
    set_at(doc, path, value)
    return Mutation("wrong type", text_of(doc))


@st.composite
def unknown_name(draw: st.DrawFn) -> Mutation:
    """A name in one of the stack's lists that nothing declares (the catalog, or the stack)."""
    doc = copy.deepcopy(BASE)
    fleet = fleet_of(doc)
    catalog = load_catalog()
    what = draw(
        st.sampled_from(
            ["model", "region", "node", "pool gpu", "pool region"]
            + ["availability node", "availability region", "price node", "price region"]
        )
    )
    name = draw(NAME)
    if what == "model":
        assume(name not in load_model_cards())
        fleet["models"] = {name: fleet["models"][PHI]}
        return Mutation("unknown model", text_of(doc), must_fail=True, expected=f"models.{name}")
    if what == "region":
        assume(name != "us-east-2")
        fleet["regions"][0]["region"] = name
        return Mutation("unknown region", text_of(doc), must_fail=True, expected="region")
    if what == "node":
        node = f"{name}x{draw(st.sampled_from([1, 2, 8]))}"
        assume(node not in catalog.node_configs and node not in fleet["node_configs"])
        i = draw(st.integers(0, len(fleet["node_configs"]) - 1))
        fleet["node_configs"][i] = node
        return Mutation("unknown node config", text_of(doc), must_fail=True, expected="node")
    if what == "pool gpu":
        assume(name not in catalog.gpus)
        fleet["gpu_pools"][0]["gpu"] = name
        return Mutation("unknown GPU", text_of(doc), must_fail=True, expected="gpu_pools[0].gpu")
    section, key = what.replace("pool", "gpu_pools").replace("price", "prices").split()
    if key == "node":
        assume(name not in fleet["node_configs"])
    else:
        assume(name != "us-east-2")
    fleet[section][0]["region" if key == "region" else "node"] = name
    return Mutation(
        f"unknown name in {section}", text_of(doc), must_fail=True, expected=f"{section}[0]"
    )


EMPTY_STACKS = [
    "",
    "# nothing yet\n",
    "---\n",
    "config:\n",
    "config:\n  coral:fleet:\n",
    "config: {coral:fleet: {}}\n",
    "[]\n",
    "config: coral:fleet\n",
]


@st.composite
def empty(draw: st.DrawFn) -> Mutation:
    which = draw(st.sampled_from(["file", "section", "demand file"]))
    if which == "file":
        return Mutation("empty stack", draw(st.sampled_from(EMPTY_STACKS)), must_fail=True)
    if which == "section":
        doc = copy.deepcopy(BASE)
        key = draw(st.sampled_from(["models", "regions", "node_configs"]))
        fleet_of(doc)[key] = draw(st.sampled_from([None, {}, []]))
        return Mutation("empty section", text_of(doc), must_fail=True, expected=key)
    demand = draw(st.sampled_from(["", "# refreshed later\n", "source: x\n", "demand:\n"]))
    return Mutation("empty demand file", with_file_source(), demand, must_fail=True)


def with_file_source() -> str:
    doc = copy.deepcopy(BASE)
    fleet_of(doc)["demand_source"] = {"kind": "file"}
    return text_of(doc)


@st.composite
def demand_file(draw: st.DrawFn) -> Mutation:
    """A demand file with any figure: huge, non-finite, of the wrong type, or for a model the
    stack does not serve (a warning, not an error)."""
    model = draw(st.sampled_from([PHI, PHI, "llama2-70b", "no-such-model"]))
    figure = draw(
        st.one_of(
            st.sampled_from(ABSURD),
            st.floats(allow_nan=True, allow_infinity=True),
            st.sampled_from([True, "abc", None, [1], {"a": 1}]),
        )
    )
    field = draw(st.sampled_from(["requests_per_s", "tokens_per_s"]))
    if field == "tokens_per_s":
        figure = {"prefill": figure, "decode": 1}
    doc = {"source": "fuzz", "demand": {model: {field: figure}}}
    absurd = any(figure is a or figure == a for a in ABSURD)  # `is`: nan != nan
    return Mutation("demand file", with_file_source(), text_of(doc), model == PHI and absurd)


STACKS = st.one_of(
    unreadable_scalar(),
    alias_bomb(),
    alias_cycle(),
    absurd_number(),
    any_number(),
    wrong_type(),
    unknown_name(),
    empty(),
    demand_file(),
)
MUST_FAIL = st.one_of(
    alias_bomb(), alias_cycle(), absurd_number(), unknown_name(), empty(), unreadable_scalar()
)


def write_project(root: Path, mutation: Mutation) -> None:
    (root / "stacks" / FILE).write_text(mutation.stack)
    (root / "stacks" / DEMAND).write_text(mutation.demand)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project with the valid stack and its demand file."""
    root = tmp_path_factory.mktemp("fuzz-inputs")
    shutil.copy(REPO / "Pulumi.yaml", root / "Pulumi.yaml")
    (root / "stacks" / "demand").mkdir(parents=True)
    write_project(root, Mutation("base", text_of(BASE)))
    return root


def resolve(root: Path, mutation: Mutation) -> CoralError | None:
    """What `coral plan` does before it plans: load the stack, check it, resolve its demand."""
    write_project(root, mutation)
    start = time.perf_counter()
    try:
        stacks = root / "stacks"
        resolve_demand(load_stack(stacks, STACK), STACK, stacks, warn=lambda _line: None)
    except CoralError as e:
        return e
    finally:
        assert time.perf_counter() - start < SECONDS, mutation.kind
    return None


def fuzz(examples: int) -> Any:
    """Hypothesis settings of every test here: reproducible, no per-example deadline (the
    bound is asserted), and a function-scoped project reused across examples on purpose."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def test_the_base_stack_and_its_file_source_resolve(project: Path) -> None:
    """The control: the unmutated stack is valid, with either demand source."""
    assert resolve(project, Mutation("base", text_of(BASE))) is None
    assert resolve(project, Mutation("file source", with_file_source())) is None


@fuzz(400)
@given(mutation=STACKS)
def test_a_mutated_stack_resolves_or_is_one_clean_error(project: Path, mutation: Mutation) -> None:
    error = resolve(project, mutation)
    if error is None:
        assert not mutation.must_fail, f"{mutation.kind} was accepted:\n{mutation.stack[:2000]}"
        return
    message = str(error)
    assert message.strip() and "Traceback" not in message
    assert mutation.expected in message, (mutation.kind, message)


JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
VALUE = st.one_of(
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e308", "-1", "abc", "", "1e9", "12.5"]),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    JSON,
)


@st.composite
def prometheus_body(draw: st.DrawFn) -> tuple[int, Any]:
    """A status and JSON body: a vector of samples with any values, or anything else."""
    status = draw(st.sampled_from([200, 200, 200, 400, 422, 503]))
    if draw(st.booleans()):
        return status, draw(JSON)
    samples: list[Any] = [
        {"metric": {"model_name": draw(st.sampled_from([PHI, "other", ""]))}, "value": [1, value]}
        for value in draw(st.lists(VALUE, max_size=3))
    ]
    if draw(st.booleans()):
        samples.append(draw(JSON))
    data = {"resultType": draw(st.sampled_from(["vector", "vector", "matrix"])), "result": samples}
    return status, {"status": draw(st.sampled_from(["success", "error"])), "data": data}


def prometheus_stack(root: Path) -> None:
    doc = copy.deepcopy(BASE)
    url = "http://fuzz:secret@prometheus.invalid:9090"
    fleet_of(doc)["demand_source"] = {"kind": "prometheus", "prometheus": {"url": url}}
    write_project(root, Mutation("prometheus", text_of(doc)))


@fuzz(200)
@given(answer=prometheus_body())
def test_any_prometheus_answer_is_demand_or_one_clean_error(
    project: Path, answer: tuple[int, Any]
) -> None:
    status, body = answer

    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=json.dumps(body, allow_nan=True).encode())

    prometheus_stack(project)
    fleet = load_stack(project / "stacks", STACK)
    for read in (
        lambda c: demand_report(fleet, STACK, project / "stacks", client=c),
        lambda c: refresh_file(fleet, STACK, client=c),
    ):
        start = time.perf_counter()
        try:
            read(httpx.Client(transport=httpx.MockTransport(reply)))
        except CoralError as e:
            assert "secret" not in str(e) and "Traceback" not in str(e)
        assert time.perf_counter() - start < SECONDS


runner = CliRunner()


@pytest.fixture(scope="module")
def cli(project: Path) -> Iterator[Path]:
    """The project as the working folder, with the typer command built once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)
        command = typer.main.get_command(app)
        mp.setattr(typer.testing, "_get_command", lambda _app: command)
        yield project


@fuzz(40)
@given(mutation=MUST_FAIL)
def test_plan_on_a_bad_stack_exits_1_with_one_message(cli: Path, mutation: Mutation) -> None:
    write_project(cli, mutation)
    out = cli / "plan.json"
    start = time.perf_counter()
    result = runner.invoke(app, ["plan", "--stack", STACK, "--out", str(out)])
    assert time.perf_counter() - start < SECONDS, mutation.kind
    assert result.exit_code == 1, (mutation.kind, result.output)
    assert isinstance(result.exception, SystemExit), (mutation.kind, result.exception)
    text = result.output.strip()
    assert text.startswith("Error:") and "Traceback" not in text, text
    assert "\n\n" not in text, text  # one paragraph: the problem, the fix, the guesses
    assert mutation.expected in text, (mutation.kind, text)
    assert not out.exists()
