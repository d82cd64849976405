"""Output for people and for CI (issue #18): `coral catalog models`, tables that wrap."""

from __future__ import annotations

import io
import json
import re

from rich.console import Console
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.cli.console import wrapping_table
from solver.catalog.model_cards import load_model_cards

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
    buffer = io.StringIO()
    Console(file=buffer, width=36).print(wrapping_table("offers", columns, rows))
    text = buffer.getvalue()
    assert "…" not in text and "..." not in text
    assert max(len(line) for line in text.splitlines()) <= 36
    first_column = "".join(
        m.group(1).strip() for m in re.finditer(r"^│ ([^│]*)│", text, re.MULTILINE)
    )
    assert first_column == "".join(regions)  # every region whole, if over two lines
