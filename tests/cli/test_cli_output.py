"""Output for people and for CI: `coral catalog models`, tables that fit the terminal (or
COLUMNS) without cutting an id, the closed loop's and the solver's lines."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.cli.console import FittedTable, wrapping_table
from solver.catalog.model_cards import load_model_cards
from tests.conftest import REPO

runner = CliRunner()


def test_catalog_models_lists_every_model_id_with_its_context():
    r = runner.invoke(app, ["catalog", "models", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    cards = load_model_cards()
    assert [row["id"] for row in rows] == sorted(cards)
    phi = next(row for row in rows if row["id"] == "phi-4")
    assert phi["context"] == cards["phi-4"].max_context
    assert phi["layers"] == cards["phi-4"].layers and phi["source"] == cards["phi-4"].hf_repo
    table = runner.invoke(app, ["catalog", "models"])
    assert table.exit_code == 0 and "qwen3-235b-a22b" in table.stdout


def test_a_narrow_table_wraps_identifiers_instead_of_cutting_them():
    regions = ["ap-northeast-2", "europe-west4", "us-central1"]
    rows = [[r, "a100-40gbx8", "p4d.24xlarge", "30.410"] for r in regions]
    columns = [("region", "left"), ("node", "left"), ("instance type", "left"), ("$/h", "right")]
    for width in (56, 36):  # as a table (each column at its longest word), then as lines
        buffer = io.StringIO()
        Console(file=buffer, width=width).print(wrapping_table("offers", columns, rows))
        text = buffer.getvalue()
        assert "…" not in text and "..." not in text
        assert max(len(line) for line in text.splitlines()) <= width
        for word in [*regions, "a100-40gbx8", "p4d.24xlarge", "30.410"]:
            assert word in text, (width, word, text)
    assert "instance type: p4d.24xlarge" in text  # the narrower one, as lines


CORAL = Path(sys.executable).with_name("coral")


@pytest.fixture(scope="module")
def paper_core_at_80(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], dict]:
    """`coral plan --stack paper-core` as a CI log gets it: stdout a pipe, COLUMNS=80."""
    tmp = tmp_path_factory.mktemp("paper-core")
    plan = tmp / "plan.json"
    command = ["plan", "--stack", "paper-core", "--library", str(tmp / "lib"), "--out", str(plan)]
    r = subprocess.run(
        [str(CORAL), *command],
        cwd=REPO,
        env=dict(os.environ, COLUMNS="80"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    return r, json.loads(plan.read_text())


def test_plan_tables_at_80_columns_keep_every_id_whole(paper_core_at_80) -> None:
    r, plan = paper_core_at_80
    assert "…" not in r.stdout + r.stderr
    assert max(len(line) for line in r.stdout.splitlines()) <= 80
    ids = {i["model"] for i in plan["instances"]}
    ids |= {f"{i['cloud']}:{i['region']}" for i in plan["instances"]}
    ids |= {f"{i['template']}:" for i in plan["instances"]}  # "<template>: <count>"
    ids |= {a["model"] for a in plan["attainment"]}
    ids |= {word for a in plan["attainment"] for word in a["workload"].split()}
    cut = [i for i in sorted(ids) if i not in r.stdout]
    assert not cut, f"cut over lines: {cut}\n{r.stdout}"


def test_closed_loop_lines_name_the_cost_of_the_plan_printed(paper_core_at_80) -> None:
    """Each closed loop says which round's plan it keeps and its cost; the last line names the
    printed plan's cost, which is one of those."""
    r, plan = paper_core_at_80
    cost = f"{plan['hourly_cost_usd']:,.2f} $/h"
    assert f"Plan paper-core (coral, mode vllm): {cost}our" in r.stdout
    assert f"SLO closed loop ended at {cost}: {plan['closed_loop_stop']}" in r.stderr
    stops = re.findall(
        r"stopped after round \d+(?:, keeping round \d+'s plan)? \((.*?)\)", r.stderr
    )
    assert len(stops) == r.stderr.count("stopped after round") >= 1, r.stderr
    assert cost in stops, (cost, stops)


def test_the_solver_objective_is_split_into_cost_and_start_up_penalty(paper_core_at_80) -> None:
    r, plan = paper_core_at_80
    found = re.search(
        r"objective ([0-9,.]+) = ([0-9,.]+) \$/h \+ ([0-9,.]+) start-up penalty", r.stderr
    )
    assert found, r.stderr
    objective, cost, penalty = (float(x.replace(",", "")) for x in found.groups())
    assert objective == round(plan["solver"]["objective"], 2)
    assert cost == round(plan["hourly_cost_usd"], 2)
    assert round(cost + penalty, 2) == objective
    assert abs(penalty - plan["startup_penalty_usd_per_hour"]) <= 0.011


def test_a_table_too_wide_for_its_words_prints_each_row_as_lines() -> None:
    table = FittedTable(title="plan")
    for header in ("model", "templates (region: count)", "throughput / demand", "$/hour"):
        table.add_column(header)
    table.add_row("qwen3-235b-a22b@b1", "gcp:northamerica-northeast1 h100x8*2: 1", "1 / 2", "9")
    buffer = io.StringIO()
    Console(file=buffer, width=30).print(table)
    text = buffer.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 30
    assert "qwen3-235b-a22b@b1\n" in text
    assert "gcp:northamerica-northeast1" in text and "h100x8*2: 1" in text
    assert "throughput / demand: 1 / 2" in text


def _commands(group: Any, path: list[str]) -> list[list[str]]:
    """Every command path under a click group (the group itself included)."""
    found = [path]
    for name, sub in sorted(getattr(group, "commands", {}).items()):
        found += _commands(sub, [*path, name])
    return found


def test_every_help_fits_80_columns_without_cutting() -> None:
    for path in _commands(typer.main.get_command(app), []):
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert r.exit_code == 0, (path, r.output)
        assert "…" not in r.output, (path, r.output)
