"""A fuzzed `coral plan`: mutated copies of a small valid stack (a key deleted or misspelt, a
wrong type, a non-finite number, a key given twice, an unknown region, model or node config, a
non-UTF-8 byte) all exit 1 with one message naming the key path, no traceback, and leave an
existing `--out` plan byte for byte as it was (issue #18)."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer.main
import typer.testing
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coral_iac.cli.app import app
from solver.catalog.model_cards import load_model_cards
from solver.catalog.offers import load_catalog
from tests.conftest import REPO

STACK = "fuzz"
FILE = f"Pulumi.{STACK}.yaml"
BASE: dict[str, Any] = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
FLEET = ("config", "coral:fleet")
MODEL = "phi-4"
REQUIRED = [  # deleting any of these must be an error naming it
    ("models",),
    ("regions",),
    ("node_configs",),
    ("models", MODEL, "slo_ms"),
    ("models", MODEL, "slo_ms", "prefill"),
    ("models", MODEL, "slo_ms", "decode"),
    ("models", MODEL, "mean_prompt_tokens"),
    ("models", MODEL, "mean_output_tokens"),
    ("regions", 0, "cloud"),
    ("regions", 0, "region"),
]
NUMBERS = [
    ("models", MODEL, "slo_ms", "prefill"),
    ("models", MODEL, "slo_ms", "decode"),
    ("models", MODEL, "mean_prompt_tokens"),
    ("models", MODEL, "mean_output_tokens"),
    ("models", MODEL, "demand", "requests_per_s"),
    ("library", "n_max"),
    ("library", "rho"),
    ("allocation", "budget_usd_per_hour"),
]
KEYS = [  # keys a typo may hit, at each level of the fleet
    *[(k,) for k in ("models", "regions", "node_configs", "library", "allocation", "description")],
    *[("models", MODEL, k) for k in ("slo_ms", "mean_prompt_tokens", "demand", "workload")],
    ("models", MODEL, "slo_ms", "decode"),
    ("library", "n_max"),
    ("allocation", "budget_usd_per_hour"),
    ("regions", 0, "region"),
    ("demand_source", "kind"),
]
runner = CliRunner()


def key_path(path: tuple[str | int, ...]) -> str:
    """How errors write a path: `regions[0].region`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def fleet_of(doc: dict[str, Any]) -> dict[str, Any]:
    fleet: dict[str, Any] = doc[FLEET[0]][FLEET[1]]
    return fleet


def parent(doc: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    node: Any = fleet_of(doc)
    for part in path[:-1]:
        node = node[part]
    return node


@dataclass(frozen=True)
class Mutation:
    kind: str
    text: bytes  # the mutated stack file
    expected: str  # what the error must name


def as_file(doc: dict[str, Any]) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode()


@st.composite
def deleted(draw: st.DrawFn) -> Mutation:
    path = draw(st.sampled_from(REQUIRED))
    doc = copy.deepcopy(BASE)
    del parent(doc, path)[path[-1]]
    return Mutation("delete", as_file(doc), key_path(path))


@st.composite
def wrong_type(draw: st.DrawFn) -> Mutation:
    path = draw(st.sampled_from(NUMBERS))
    value = draw(st.sampled_from([True, False, "abc", "12 req", [1], {"a": 1}, ""]))
    doc = copy.deepcopy(BASE)
    parent(doc, path)[path[-1]] = value
    return Mutation("wrong type", as_file(doc), key_path(path))


@st.composite
def non_finite(draw: st.DrawFn) -> Mutation:
    path = draw(st.sampled_from(NUMBERS))
    value = draw(st.sampled_from([float("inf"), float("-inf"), float("nan"), "inf", "NaN"]))
    doc = copy.deepcopy(BASE)
    parent(doc, path)[path[-1]] = value
    return Mutation("non-finite", as_file(doc), key_path(path))


@st.composite
def misspelt_key(draw: st.DrawFn) -> Mutation:
    path = draw(st.sampled_from(KEYS))
    key = str(path[-1])
    i = draw(st.integers(0, len(key) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap", "replace"]))
    letter = draw(st.sampled_from("abcdefghijklmnopqrstuvwxyz_"))
    typo = {
        "drop": key[:i] + key[i + 1 :],
        "double": key[:i] + key[i] + key[i:],
        "swap": key[:i] + key[i + 1 : i + 2] + key[i : i + 1] + key[i + 2 :],
        "replace": key[:i] + letter + key[i + 1 :],
    }[how]
    doc = copy.deepcopy(BASE)
    mapping = parent(doc, path)
    assume(typo and typo not in mapping)
    doc_text = yaml.safe_dump(doc, sort_keys=False)
    mapping[typo] = mapping.pop(key)
    assert yaml.safe_dump(doc, sort_keys=False) != doc_text
    return Mutation("misspelt key", as_file(doc), key_path((*path[:-1], typo)))


@st.composite
def duplicate_key(draw: st.DrawFn) -> Mutation:
    lines = as_file(BASE).decode().splitlines(keepends=True)
    candidates = [
        i
        for i, line in enumerate(lines)
        if ": " in line and not line.lstrip().startswith("- ") and line.strip()[-1] != ":"
    ]
    i = draw(st.sampled_from(candidates))
    key = lines[i].strip().split(": ", 1)[0]
    value = draw(st.sampled_from(["same", "other"]))
    copy_line = lines[i] if value == "same" else lines[i].split(": ", 1)[0] + ": 7\n"
    mutated = [*lines[: i + 1], copy_line, *lines[i + 1 :]]
    return Mutation("duplicate key", "".join(mutated).encode(), f"key '{key}' given twice")


NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=14)


@st.composite
def unknown_id(draw: st.DrawFn) -> Mutation:
    doc = copy.deepcopy(BASE)
    fleet = fleet_of(doc)
    what = draw(st.sampled_from(["region", "other cloud", "model", "node"]))
    if what == "region":
        region = draw(NAME)
        assume(("aws", region) not in load_catalog().regions)
        fleet["regions"][0]["region"] = region
        return Mutation("unknown region", as_file(doc), "regions[0].region")
    if what == "other cloud":
        fleet["regions"][0]["cloud"] = "gcp"  # us-east-2 is an AWS region
        return Mutation("region of the other cloud", as_file(doc), "regions[0].region")
    if what == "model":
        model = draw(NAME)
        assume(model not in load_model_cards())
        fleet["models"] = {model: fleet["models"][MODEL]}
        return Mutation("unknown model", as_file(doc), f"models.{model}")
    gpu = draw(NAME.filter(lambda g: "x" not in g))
    assume(gpu not in load_catalog().gpus)
    i = draw(st.integers(0, len(fleet["node_configs"]) - 1))
    fleet["node_configs"][i] = f"{gpu}x{draw(st.sampled_from([1, 2, 4, 8]))}"
    assume(len(set(fleet["node_configs"])) == len(fleet["node_configs"]))
    return Mutation("unknown node config", as_file(doc), f"node_configs[{i}]")


@st.composite
def bad_encoding(draw: st.DrawFn) -> Mutation:
    text = as_file(BASE)
    at = draw(st.integers(0, len(text)))
    junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xe9", b"\x80abc", b"\xed\xa0\x80"]))
    return Mutation("bad encoding", text[:at] + junk + text[at:], FILE)


MUTATIONS = st.one_of(
    deleted(),
    wrong_type(),
    non_finite(),
    misspelt_key(),
    duplicate_key(),
    unknown_id(),
    bad_encoding(),
)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A project with the valid stack, its (tiny) library built once, and a plan at plan.json."""
    root = tmp_path_factory.mktemp("fuzz-project")
    shutil.copy(REPO / "Pulumi.yaml", root / "Pulumi.yaml")
    (root / "stacks").mkdir()
    (root / "stacks" / FILE).write_bytes(as_file(BASE))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        # Typer rebuilds the click command on every invoke (~0.1 s); build it once.
        command = typer.main.get_command(app)
        mp.setattr(typer.testing, "_get_command", lambda _app: command)
        built = runner.invoke(app, ["plan", "--stack", STACK, "--out", "plan.json"])
        assert built.exit_code == 0, built.output
        yield root


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mutation=MUTATIONS)
def test_a_mutated_stack_is_one_clear_error_and_keeps_the_plan(
    project: Path, mutation: Mutation
) -> None:
    plan = project / "plan.json"
    before = plan.read_bytes()
    (project / "stacks" / FILE).write_bytes(mutation.text)
    try:
        result = runner.invoke(app, ["plan", "--stack", STACK, "--out", "plan.json"])
    finally:
        (project / "stacks" / FILE).write_bytes(as_file(BASE))
    assert result.exit_code == 1, (mutation, result.output)
    assert isinstance(result.exception, SystemExit), (mutation, result.exception)
    assert "Traceback" not in result.output
    assert "Error:" in result.output
    assert mutation.expected in result.output, (mutation.kind, result.output)
    assert plan.read_bytes() == before


def test_the_unmutated_stack_plans(project: Path) -> None:
    """The control: the fuzzed stack itself is valid, so each error comes from its mutation."""
    result = runner.invoke(app, ["plan", "--stack", STACK, "--out", "again.json"])
    assert result.exit_code == 0, result.output
    assert (project / "again.json").stat().st_size > 0
