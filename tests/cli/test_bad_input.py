"""Bad input never crashes and never loses data (issue #18): one test per reported case."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.cli.console import PlainProgress
from coral_iac.cli.deploy import check_render_folder, write_folder
from coral_iac.demand_sources import checked_url, demand_file_path
from coral_iac.project import confined, project_root, stacks_dir
from solver.catalog.market import build_market
from solver.catalog.model_cards import load_model_cards
from solver.catalog.offers import load_catalog
from solver.errors import InputError
from solver.io import parse_yaml, read_yaml, write_atomic
from solver.stack import parse_fleet
from solver.validation import check_fleet, check_stack_name
from tests.conftest import REPO

runner = CliRunner()
DEV = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
SECRET = "-----BEGIN PRIVATE KEY----- MIIEvQIBADANBgkqhkiG9w0BAQEFAASC"


def fleet(**changes):
    """The dev stack's fleet with top-level keys replaced."""
    obj = DEV["config"]["coral:fleet"] | changes
    return parse_fleet({"coral:fleet": obj}, "Pulumi.test.yaml")


def project(tmp_path: Path, stack: dict | None = None, name: str = "dev") -> Path:
    """A Coral project in tmp_path holding one stack."""
    (tmp_path / "stacks").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "Pulumi.yaml", tmp_path / "Pulumi.yaml")
    text = yaml.safe_dump(stack or DEV, sort_keys=False)
    (tmp_path / "stacks" / f"Pulumi.{name}.yaml").write_text(text)
    return tmp_path


# --- files: duplicate keys, encodings, booleans, non-finite numbers -------------------------


def test_a_key_given_twice_is_an_error_naming_its_path_and_lines():
    text = "models:\n  phi-4:\n    mean_prompt_tokens: 10\n    mean_prompt_tokens: 20\n"
    with pytest.raises(InputError, match=r"models\.phi-4\.mean_prompt_tokens: key .* twice") as e:
        parse_yaml(text, "s.yaml")
    assert "lines 3 and 4" in str(e.value)
    assert parse_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  d: 2\n", "s.yaml")["c"] == {"b": 1, "d": 2}


def test_a_model_listed_twice_is_an_error(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("models:\n  phi-4: {mean_prompt_tokens: 1}\n  phi-4: {mean_prompt_tokens: 2}\n")
    with pytest.raises(InputError, match=r"models\.phi-4: key 'phi-4' given twice"):
        read_yaml(path)


def test_a_non_utf8_file_is_an_input_error_naming_the_byte(tmp_path):
    path = tmp_path / "Pulumi.dev.yaml"
    path.write_bytes("description: Caf\u00e9\n".encode("latin-1"))
    with pytest.raises(InputError, match=r"not UTF-8 text \(byte 0xe9 at offset 16\)"):
        read_yaml(path)


def test_a_yaml_syntax_error_quotes_no_line_of_the_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(f"key: [{SECRET}\n")
    with pytest.raises(InputError, match="line 2, column 1") as e:
        read_yaml(path)
    assert "PRIVATE" not in str(e.value)


@pytest.mark.parametrize("value", [True, False, "yes"])
def test_a_boolean_budget_is_not_one_dollar(value):
    raw = yaml.safe_load(f"budget_usd_per_hour: {str(value).lower()}")["budget_usd_per_hour"]
    allocation = DEV["config"]["coral:fleet"]["allocation"] | {"budget_usd_per_hour": raw}
    with pytest.raises(InputError, match=r"allocation\.budget_usd_per_hour: expected a number"):
        fleet(allocation=allocation)


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "'inf'", "'NaN'"])
def test_a_non_finite_demand_is_an_input_error(value):
    models = {"phi-4": DEV["config"]["coral:fleet"]["models"]["phi-4"] | {"demand": {}}}
    models["phi-4"]["demand"] = {"requests_per_s": yaml.safe_load(value)}
    with pytest.raises(
        InputError, match=r"models\.phi-4\.demand\.requests_per_s: must be a finite"
    ):
        fleet(models=models)


def test_a_misspelt_key_suggests_the_right_one():
    with pytest.raises(InputError, match="unknown key 'node_config'") as e:
        parse_fleet({"coral:fleet": DEV["config"]["coral:fleet"] | {"node_config": []}}, "s")
    assert "Did you mean 'node_configs'" in str(e.value)


def test_a_field_error_quotes_no_long_value():
    models = {"phi-4": DEV["config"]["coral:fleet"]["models"]["phi-4"] | {"workload": 1}}
    models["phi-4"]["slo_ms"] = SECRET
    with pytest.raises(InputError, match=r"models\.phi-4\.slo_ms") as e:
        fleet(models=models)
    assert "PRIVATE" not in str(e.value)


# --- stack names, regions, availability, context -------------------------------------------


@pytest.mark.parametrize(
    ("name", "problem"),
    [("x" * 300, "300 characters"), ("../prod", "'/'"), ("a b", "' '"), ("", "empty")],
)
def test_stack_names_are_what_pulumi_accepts(name, problem):
    with pytest.raises(InputError, match=problem):
        check_stack_name(name)
    assert check_stack_name("paper-core.v2_b") == "paper-core.v2_b"


def test_a_300_character_stack_name_is_an_error_not_a_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(project(tmp_path))
    r = runner.invoke(app, ["demand", "show", "--stack", "x" * 300])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    assert "--stack: stack name of 300 characters" in r.output


@pytest.mark.parametrize(
    ("regions", "problem", "suggestion"),
    [
        ([{"cloud": "aws", "region": "us-east-9"}], "unknown aws region 'us-east-9'", "us-east-2"),
        ([{"cloud": "gcp", "region": "us-east-2"}], "is a region of aws", "us-central1"),
        (
            [{"cloud": "aws", "region": "us-east-2"}, {"cloud": "gcp", "region": "us-centrl1"}],
            r"regions\[1\]\.region: unknown gcp region 'us-centrl1'",
            "us-central1",
        ),
    ],
)
def test_unknown_or_misspelt_regions_are_errors_with_a_guess(regions, problem, suggestion):
    with pytest.raises(InputError, match=problem) as e:
        build_market(fleet(regions=regions).market_scope(), load_catalog())
    assert e.value.suggestions[0] == suggestion


def test_a_region_the_stack_prices_itself_is_known():
    price = {
        "cloud": "aws",
        "region": "eu-north-1",
        "node": "l4x1",
        "usd_per_hour": 1.0,
        "source": "test quote",
    }
    count = {"cloud": "aws", "region": "eu-north-1", "node": "l4x1", "count": 2}
    f = fleet(
        regions=[{"cloud": "aws", "region": "eu-north-1"}], prices=[price], availability=[count]
    )
    market = build_market(f.market_scope(), load_catalog())
    assert market.price[(("aws", "eu-north-1"), "l4x1")] == 1.0


def test_availability_zero_everywhere_is_an_error_not_an_empty_plan():
    zero = [
        {"cloud": "aws", "region": "us-east-2", "node": n, "count": 0}
        for n in DEV["config"]["coral:fleet"]["node_configs"]
    ]
    cat, cards = load_catalog(), load_model_cards()
    with pytest.raises(InputError, match="availability: no node config .* is available in any"):
        check_fleet(fleet(availability=zero), cat, cards)
    check_fleet(fleet(availability=zero[1:]), cat, cards)  # one slot left: fine
    # A market may still be all zero: a simulated epoch scales availability to 0 on purpose.
    assert not any(build_market(fleet(availability=zero).market_scope(), cat).available.values())


def test_a_mean_request_above_the_context_is_an_error():
    models = {
        "phi-4": DEV["config"]["coral:fleet"]["models"]["phi-4"] | {"mean_prompt_tokens": 1e7}
    }
    with pytest.raises(InputError, match=r"models\.phi-4\.mean_prompt_tokens: .* context of"):
        check_fleet(fleet(models=models), load_catalog(), load_model_cards())


def test_an_unknown_node_config_names_its_index():
    with pytest.raises(InputError, match=r"node_configs\[1\]: unknown node config 'l40x1'"):
        check_fleet(fleet(node_configs=["l4x1", "l40x1"]), load_catalog(), load_model_cards())


# --- project root and confined paths --------------------------------------------------------


def test_the_project_root_is_found_from_a_subfolder(tmp_path, monkeypatch):
    root = project(tmp_path)
    deep = root / "docs" / "deeper"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert project_root() == root.resolve()
    assert stacks_dir() == Path("../../stacks")
    r = runner.invoke(app, ["demand", "show", "--stack", "dev", "--json"])
    assert r.exit_code == 0, r.output
    assert '"kind": "config"' in r.stdout


def test_outside_a_project_the_error_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["demand", "show", "--stack", "dev"])
    assert r.exit_code == 1
    assert "no stacks folder" in r.output and "Pulumi.yaml" in r.output


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_a_demand_file_outside_the_project_is_refused_unread(tmp_path, monkeypatch, where):
    secret = tmp_path / "outside" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text(SECRET + "\n")
    root = project(tmp_path / "proj")
    file = {"absolute": str(secret), "dotdot": "../../outside/id_rsa", "symlink": "key.yaml"}
    if where == "symlink":
        (root / "stacks" / "key.yaml").symlink_to(secret)
    stack = yaml.safe_load(yaml.safe_dump(DEV))
    stack["config"]["coral:fleet"]["demand_source"] = {"kind": "file", "file": file[where]}
    project(root, stack)
    monkeypatch.chdir(root)
    r = runner.invoke(app, ["demand", "show", "--stack", "dev"])
    assert r.exit_code == 1
    assert "demand_source.file" in r.output and "outside the project" in r.output
    assert "PRIVATE" not in r.output


def test_a_demand_file_inside_the_project_is_never_quoted(tmp_path, monkeypatch):
    root = project(tmp_path)
    stack = yaml.safe_load(yaml.safe_dump(DEV))
    stack["config"]["coral:fleet"]["demand_source"] = {"kind": "file", "file": "key.txt"}
    project(root, stack)
    (root / "stacks" / "key.txt").write_text(SECRET + "\n")
    monkeypatch.chdir(root)
    r = runner.invoke(app, ["demand", "show", "--stack", "dev"])
    assert r.exit_code == 1 and "key.txt" in r.output
    assert "PRIVATE" not in r.output and "MIIE" not in r.output


def test_confined_allows_the_inside_and_an_explicit_outside(tmp_path):
    inside = tmp_path / "a" / "b.yaml"
    assert confined(inside, "--x", tmp_path) == inside
    assert confined(Path("/etc/passwd"), "--x", tmp_path, allow_outside=True)
    with pytest.raises(InputError, match="--x: /etc/passwd is outside the project"):
        confined(Path("/etc/passwd"), "--x", tmp_path)


def test_the_default_demand_file_is_inside(tmp_path):
    root = project(tmp_path)
    path = demand_file_path(fleet(), "dev", root / "stacks")
    assert path == root / "stacks" / "demand" / "dev.yaml"


# --- URLs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["::bad::", "http://", "ftp://prom:9090", "http://[::1"])
def test_a_malformed_prometheus_url_is_an_input_error(url):
    with pytest.raises(InputError, match="CORAL_PROMETHEUS_URL: not an http"):
        checked_url(url, "CORAL_PROMETHEUS_URL")
    assert checked_url("http://prom.internal:9090", "x") == "http://prom.internal:9090"


def test_a_malformed_url_in_the_environment_exits_1(tmp_path, monkeypatch):
    stack = yaml.safe_load(yaml.safe_dump(DEV))
    stack["config"]["coral:fleet"]["demand_source"] = {
        "kind": "prometheus",
        "prometheus": {"url": "http://127.0.0.1:9"},
    }
    monkeypatch.chdir(project(tmp_path, stack))
    monkeypatch.setenv("CORAL_PROMETHEUS_URL", "::bad::")
    r = runner.invoke(app, ["demand", "show", "--stack", "dev"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    assert "CORAL_PROMETHEUS_URL: not an http(s) URL" in r.output


# --- writing files --------------------------------------------------------------------------


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "plan.json"
    write_atomic(path, "old\n")
    write_atomic(path, b"new\n")
    assert path.read_bytes() == b"new\n"
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())

    def fail(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(InputError, match="No space left"):
        write_atomic(path, "half")
    assert path.read_bytes() == b"new\n"
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temporary left


def test_write_atomic_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "plan.json"
    write_atomic(path, "old\n")
    path.chmod(0o600)  # kept private by its owner
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and oct(path.stat().st_mode & 0o777) == oct(0o600)


def test_write_atomic_never_replaces_a_read_only_file(tmp_path):
    """Every writer (`coral plan --out`, `coral catalog import-skypilot --out`, `coral demand
    refresh --write`, the caches) goes through it; root included (no write bit for anyone)."""
    path = tmp_path / "offers.yaml"
    write_atomic(path, "mine\n")
    path.chmod(0o444)
    with pytest.raises(InputError, match="is read-only"):
        write_atomic(path, "new\n")
    assert path.read_text() == "mine\n" and oct(path.stat().st_mode & 0o777) == oct(0o444)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_write_atomic_into_a_folder_or_unwritable_place_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="is a folder"):
        write_atomic(tmp_path, "x")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="cannot write here"):
        write_atomic(tmp_path / "file" / "plan.json", "x")


def test_render_out_refuses_a_file_or_a_non_empty_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        check_render_folder(tmp_path / "file", replace=False)
    (tmp_path / "dir").mkdir()
    check_render_folder(tmp_path / "dir", replace=False)  # empty: fine
    (tmp_path / "dir" / "other-stack-node.yaml").write_text("x")
    with pytest.raises(InputError, match="(?s)not empty .* pass --replace"):
        check_render_folder(tmp_path / "dir", replace=False)
    check_render_folder(tmp_path / "dir", replace=True)


def test_write_folder_swaps_the_whole_folder(tmp_path):
    out = tmp_path / "render"
    out.mkdir()
    (out / "old-node.yaml").write_text("old")
    write_folder(out, {"a.yaml": "A", "b.yaml": "B"})
    assert sorted(p.name for p in out.iterdir()) == ["a.yaml", "b.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["render"]  # nothing left beside it


def test_render_into_a_file_exits_1_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "file").write_text("keep")
    r = runner.invoke(app, ["render", "--stack", "dev", "--out", str(tmp_path / "file")])
    assert r.exit_code == 1 and "is a file" in r.output
    assert (tmp_path / "file").read_text() == "keep"


def test_render_replaces_another_stacks_files_only_when_told(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "render"
    out.mkdir()
    (out / "other-stack-node.yaml").write_text("old")
    args = ["render", "--stack", "dev", "--out", str(out), "--library", str(tmp_path / "lib")]
    r = runner.invoke(app, args)
    assert r.exit_code == 1 and "--replace" in r.output
    r = runner.invoke(app, [*args, "--replace"])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in out.iterdir())
    assert "other-stack-node.yaml" not in names and names


# --- output for CI --------------------------------------------------------------------------


def test_plain_progress_prints_quarters_and_the_end(capsys):
    with PlainProgress() as bar:
        task = bar.add_task("templates phi-4 prefill", total=None)
        bar.update(task, completed=0, total=8)
        for done in range(1, 9):
            bar.update(task, completed=done)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "templates phi-4 prefill: 2/8 (25%)",
        "templates phi-4 prefill: 4/8 (50%)",
        "templates phi-4 prefill: 6/8 (75%)",
        "templates phi-4 prefill: 8/8 (100%)",
    ]


def test_preview_refuses_another_stacks_plan_as_previous(tmp_path, monkeypatch):
    monkeypatch.chdir(project(project(tmp_path), name="other"))
    planned = runner.invoke(app, ["plan", "--stack", "other", "--out", "other.json"])
    assert planned.exit_code == 0, planned.output
    r = runner.invoke(app, ["preview", "--stack", "dev", "--previous", "other.json"])
    assert r.exit_code == 1, r.output
    assert "--previous: other.json is a plan of stack 'other', not 'dev'" in r.output


def test_preview_reads_the_stack_file_as_strictly_as_plan(tmp_path, monkeypatch):
    root = project(tmp_path)
    path = root / "stacks" / "Pulumi.dev.yaml"
    path.write_bytes(path.read_bytes().replace(b"Development", b"D\xe9velopment"))
    monkeypatch.chdir(root)
    r = runner.invoke(app, ["preview", "--stack", "dev"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert "Pulumi.dev.yaml: not UTF-8 text" in r.output


def test_spot_allowed_where_nothing_sells_spot_names_the_setting():
    """p5.4xlarge (h100x1) has no spot price in us-east-2: a stack that allows spot on it alone
    would plan on-demand while saying spot."""
    allocation = {"budget_usd_per_hour": 10, "spot": {"enabled": True}}
    cat, cards = load_catalog(), load_model_cards()
    with pytest.raises(InputError, match=r"allocation\.spot\.enabled: no node config .* spot"):
        check_fleet(fleet(node_configs=["h100x1"], allocation=allocation), cat, cards)
    check_fleet(fleet(node_configs=["h100x1", "l4x1"], allocation=allocation), cat, cards)
