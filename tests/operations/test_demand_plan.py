"""`coral plan --stack staging` plans for the demand `coral demand show` reports (the file's)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from coral_iac.cli.app import app
from tests.conftest import REPO

runner = CliRunner()


def test_plan_and_demand_show_agree_on_staging(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    shown = runner.invoke(app, ["demand", "show", "--stack", "staging", "--json"])
    assert shown.exit_code == 0, shown.output
    want = {
        (m["model"], phase): value
        for m in json.loads(shown.stdout)["models"]
        for phase, value in m["phase_demand"].items()
    }
    plan = runner.invoke(
        app, ["plan", "--stack", "staging", "--library", str(tmp_path / "lib"), "--json"]
    )
    assert plan.exit_code == 0, plan.output
    got: dict[tuple[str, str], float] = {}
    for j in json.loads(plan.stdout)["jobs"]:  # gpt-oss-20b's length buckets add up to it
        key = (j["model"].split("@")[0], j["phase"])
        got[key] = got.get(key, 0.0) + j["demand"]
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4), key
    assert want[("qwen3-32b", "prefill")] == 480.0  # 0.8 requests/s in stacks/demand/staging.yaml
