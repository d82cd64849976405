"""Every committed stack plans to the same cost and instances as its golden summary.

Speed work must not change what `coral plan` buys: each stack is planned through the CLI and its
summary (cost, served fractions, instances and GPUs per model and phase) compared with
tests/golden/plans/<stack>.json. `CORAL_ACCEPT=1` rewrites a summary, for a change meant to
change plans. The stacks that plan in seconds run by default; the large paper stacks (a minute
or more each on 2 cores) are marked `plans` and run by scripts/test_plans.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from coral_iac.cli.app import app
from tests.conftest import committed_library, committed_stacks

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "plans"
QUICK = ["dev", "dev-gcp", "paper-core", "paper-helix", "prod", "spot", "staging"]
LARGE = [
    "paper-core-scarce",
    "paper-extended",
    "paper-extended-large-heavy",
    "paper-extended-scarce",
    "paper-extended-small-heavy",
    "paper-helix-aggregated",
]


def summary(plan: dict[str, Any]) -> dict[str, Any]:
    """What a plan buys: its cost, the fraction of each model served, and per (model, phase)
    its instances and GPUs by type. Which region or node config holds a GPU is left out: the
    ILP stops within its relative gap, and plans of equal cost that swap equal-priced nodes
    between regions or node configs are ties it may break either way."""
    instances: Counter[str] = Counter()
    gpus: Counter[str] = Counter()
    for i in plan["instances"]:
        job = f"{i['model']}/{i['phase']}"
        instances[job] += 1
        for node in i["nodes"]:
            gpu, count = node.rsplit("x", 1)
            gpus[f"{job}/{gpu}"] += int(count)
    out = {
        "stack": plan["stack"],
        "hourly_cost_usd": plan["hourly_cost_usd"],
        "served_fractions": plan["served_fractions"],
        "instances": dict(sorted(instances.items())),
        "gpus": dict(sorted(gpus.items())),
    }
    spot = Counter(f"{i['model']}/{i['phase']}" for i in plan["instances"] if i.get("zone"))
    return out | ({"spot_instances": dict(sorted(spot.items()))} if spot else {})


def check_stack(stack: str, library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(
        app, ["plan", "--stack", stack, "--json", "--library", str(library / stack)]
    )
    assert result.exit_code in (0, 3), result.output
    text = json.dumps(summary(json.loads(result.stdout)), indent=1, sort_keys=True) + "\n"
    path = GOLDEN / f"{stack}.json"
    if os.environ.get("CORAL_ACCEPT") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden file {path}; run with CORAL_ACCEPT=1 to create it"
    assert text == path.read_text(encoding="utf-8"), f"{path} differs (CORAL_ACCEPT=1 to accept)"


def test_every_committed_stack_has_a_golden_plan() -> None:
    assert sorted(QUICK + LARGE) == committed_stacks()


@pytest.mark.parametrize("stack", QUICK)
def test_quick_stack_plans_as_before(stack, tmp_path_factory, monkeypatch) -> None:
    check_stack(stack, committed_library(stack).parent, monkeypatch)


@pytest.mark.plans
@pytest.mark.parametrize("stack", LARGE)
def test_large_stack_plans_as_before(stack, tmp_path_factory, monkeypatch) -> None:
    check_stack(stack, committed_library(stack).parent, monkeypatch)
