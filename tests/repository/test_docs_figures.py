"""The docs quote what the tools print: the `coral plan --stack dev` output in docs/output.md,
the dev figures in docs/allocation.md, and every column of every table `coral` prints is
explained in docs/output.md. `CORAL_ACCEPT=1` rewrites the quoted dev output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.cli.plan_output import routing_table
from solver.plan_schema import Plan
from tests.conftest import REPO

CORAL = Path(sys.executable).with_name("coral")
OUTPUT_MD = REPO / "docs" / "output.md"
ALLOCATION_MD = REPO / "docs" / "allocation.md"
BLOCK = re.compile(
    r"(<!-- output of `COLUMNS=80 coral plan --stack dev`.*?-->\n```text\n)(.*?)(```)", re.S
)
SECONDS = re.compile(r", [0-9.]+ s$", re.M)  # the solve's time varies run to run


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One library root for the module: `<root>/dev` is dev's library."""
    return tmp_path_factory.mktemp("libraries")


@pytest.fixture(scope="module")
def dev_run(library: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Plan]:
    """`COLUMNS=80 coral plan --stack dev` as a terminal shows it (the progress on stderr, the
    tables, then the rest of stderr), without its timing line, and the plan."""
    plan_file = tmp_path_factory.mktemp("dev") / "plan.json"
    command = [str(CORAL), "plan", "--stack", "dev", "--library", str(library / "dev")]
    env = dict(os.environ, COLUMNS="80")
    r = subprocess.run(
        [*command, "--out", str(plan_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    lines = [
        line
        for line in r.stderr.splitlines()
        if not line.startswith(("templates ", "Planned in ", "Wrote "))
    ]
    at = next(i for i, line in enumerate(lines) if line.startswith("Solver "))
    shown = "\n".join([*lines[:at], r.stdout.rstrip("\n"), *lines[at:]]) + "\n"
    return shown, Plan.model_validate_json(plan_file.read_text())


def test_the_dev_plan_in_the_docs_is_what_coral_prints(dev_run: tuple[str, Plan]) -> None:
    shown, _ = dev_run
    text = OUTPUT_MD.read_text(encoding="utf-8")
    match = BLOCK.search(text)
    assert match, "docs/output.md lost its quoted `coral plan --stack dev` block"
    if os.environ.get("CORAL_ACCEPT") == "1":
        text = text[: match.start(2)] + shown + text[match.end(2) :]
        OUTPUT_MD.write_text(text, encoding="utf-8")
        match = BLOCK.search(text)
        assert match
    quoted = match.group(2)
    assert SECONDS.sub(", N s", quoted) == SECONDS.sub(", N s", shown), (
        "docs/output.md quotes another `coral plan --stack dev` (CORAL_ACCEPT=1 to rewrite it)"
    )


def test_allocation_md_quotes_dev_as_the_tools_print_it(
    dev_run: tuple[str, Plan], library: Path
) -> None:
    """The re-planning table's dev row is what its command prints, and the cost it is compared
    with is `coral plan`'s."""
    _, plan = dev_run
    text = ALLOCATION_MD.read_text(encoding="utf-8")
    quoted = re.search(r"([0-9.]+) \$/h from `coral plan --stack dev`", text)
    assert quoted and float(quoted.group(1)) == round(plan.hourly_cost_usd, 2)
    r = subprocess.run(
        [sys.executable, "scripts/replan_churn.py", "dev", "--library-root", str(library)],
        cwd=REPO,
        env=dict(os.environ, COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    printed = next(line for line in r.stdout.splitlines() if re.match(r"\W*dev\W", line))
    row = next(line for line in text.splitlines() if line.startswith("| dev |"))

    def figures(line: str) -> list[tuple[float, float]]:
        """Each "$/h (served%)" cell: the cost and the served share."""
        pairs = re.findall(r"([0-9,]+\.[0-9]+) \(([0-9.]+)%\)", line)
        return [(float(c.replace(",", "")), float(s)) for c, s in pairs]

    assert figures(row) == figures(printed) and len(figures(row)) == 3, (row, printed)


def _project(root: Path) -> Path:
    """A scratch project holding the dev stack (commands write their caches inside it)."""
    shutil.copy(REPO / "Pulumi.yaml", root / "Pulumi.yaml")
    (root / "stacks").mkdir()
    shutil.copy(REPO / "stacks" / "Pulumi.dev.yaml", root / "stacks")
    return root


def test_every_table_column_is_explained_in_docs_output(tmp_path, monkeypatch) -> None:
    """Each command that prints a table runs once on dev; every column header it printed is
    in docs/output.md (as `header`)."""
    monkeypatch.chdir(_project(tmp_path))
    headers: dict[str, set[str]] = {}
    command: list[str] = []
    original = Console.print

    def record(self: Console, *objects: object, **kwargs: object) -> None:
        for o in objects:
            if isinstance(o, Table):
                key = " ".join(command[:2])
                headers.setdefault(key, set()).update(str(c.header) for c in o.columns)
        original(self, *objects, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Console, "print", record)
    plan = str(tmp_path / "plan.json")
    for command in (
        ["catalog", "show"],
        ["catalog", "models"],
        ["demand", "show", "--stack", "dev"],
        ["profile", "explain", "--model", "phi-4", "--node", "l4x1", "--phase", "decode"],
        ["profile", "table", "--model", "phi-4", "--phase", "decode", "--budget-ms", "50"],
        ["templates", "build", "--stack", "dev", "--out", str(tmp_path / "lib")],
        ["templates", "show", "--library", str(tmp_path / "lib"), "--model", "phi-4"]
        + ["--phase", "decode"],
        ["plan", "--stack", "dev", "--library", str(tmp_path / "lib"), "--out", plan],
        ["plan", "diff", plan, plan],
        ["simulate", "--stack", "dev", "--plan", plan],
        ["simulate", "--stack", "dev", "--plan", plan, "--capacity"],
        ["epochs", "--stack", "dev", "--library", str(tmp_path / "lib")],
        ["preview", "--stack", "dev", "--library", str(tmp_path / "lib")],
        ["bench", "--stack", "dev", "--mode", "vllm", "--out", str(tmp_path / "bench")],
    ):
        r = CliRunner().invoke(app, command)
        assert r.exit_code == 0, (command, r.output)
    # Length routing's table has no rows on dev, but its columns are those of any plan.
    routed = routing_table(Plan.model_validate(json.loads(Path(plan).read_text())))
    headers["plan routing"] = {str(c.header) for c in routed.columns}
    assert len(headers) == 14, sorted(headers)
    doc = OUTPUT_MD.read_text(encoding="utf-8")
    missing = {k: sorted(h for h in v if h and f"`{h}`" not in doc) for k, v in headers.items()}
    assert not any(missing.values()), missing
