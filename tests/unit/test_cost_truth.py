"""Cost truth (#18 item 6): the gateway's VM and address in the $/hour, the budget and the cost
diff, priced only from sourced data; warnings for an API port open to no one or to everyone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pulumi
import pytest
import yaml
from typer.testing import CliRunner

from coral_iac import gateway_cost as gc
from coral_iac.cli.app import app
from coral_iac.cost_report import cost_diff_table
from coral_iac.deploy_settings import DeploySettings
from coral_iac.exposure import exposure_warnings, world_open
from coral_iac.gateway_cost import (
    GatewayPrices,
    fleet_for_allocation,
    gateway_cost,
    load_gateway_prices,
)
from solver.errors import InputError
from solver.plan.schema import Plan
from solver.stack import parse_fleet
from tests.conftest import REPO

DEV = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
PRICED = {
    "schema_version": 1,
    "instances": [
        {
            "cloud": "aws",
            "instance_type": "c7i.large",
            "region": "us-east-2",
            "usd_per_hour": 0.25,
            "source": "test table",
            "retrieved": "2026-12-01",
        }
    ],
    "addresses": [
        {
            "cloud": "aws",
            "kind": "elastic-ip",
            "usd_per_hour": 0.01,
            "source": "test table (every region)",
            "retrieved": "2026-12-01",
        },
        {
            "cloud": "aws",
            "kind": "elastic-ip",
            "region": "us-east-2",
            "usd_per_hour": 0.02,
            "source": "test table (us-east-2)",
            "retrieved": "2026-12-01",
        },
    ],
}


def dev_fleet(**changes):
    fleet = DEV["config"]["coral:fleet"] | changes
    return parse_fleet({"coral:fleet": fleet}, "test")


def priced_file(tmp_path: Path, doc: dict = PRICED) -> Path:
    path = tmp_path / "gateway_prices.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_committed_prices_carry_sources_and_invent_nothing():
    """Every committed price has its source and date; the Elastic IP (AWS's public IPv4
    charge) is priced, c7i.large is not (no source at hand), so the gateway counts the address
    alone and says what it leaves out."""
    prices = load_gateway_prices()
    assert prices.instances == []
    assert all(a.source and a.retrieved for a in prices.addresses)
    assert [(a.cloud, a.kind, a.usd_per_hour) for a in prices.addresses] == [
        ("aws", "elastic-ip", 0.005)
    ]
    assert {(u.cloud, u.item) for u in prices.unpriced} == {("aws", "c7i.large")}
    cost = gateway_cost(dev_fleet(), DeploySettings(), prices)
    assert cost is not None and cost.usd_per_hour == pytest.approx(0.005)
    assert [i.name for i in cost.unpriced] == ["c7i.large VM"]
    assert "cloud.md" in cost.unpriced[0].note
    assert "left out of the totals" in cost.summary()


def test_gateway_cost_sums_vm_and_regional_address():
    prices = GatewayPrices.model_validate(PRICED)
    cost = gateway_cost(dev_fleet(), DeploySettings(), prices)
    assert cost is not None and not cost.unpriced
    assert cost.usd_per_hour == pytest.approx(0.27)  # the us-east-2 address row beats the global
    assert "test table (us-east-2), read 2026-12-01" in cost.items[1].note
    other = DeploySettings.model_validate({"gateway": {"region": "eu-west-1"}})
    elsewhere = gateway_cost(dev_fleet(), other, prices)
    assert elsewhere is not None
    assert elsewhere.usd_per_hour == pytest.approx(0.01)  # the VM is not priced there
    assert [i.name for i in elsewhere.unpriced] == ["c7i.large VM"]
    off = DeploySettings.model_validate({"gateway": {"enabled": False}})
    assert gateway_cost(dev_fleet(), off, prices) is None


def test_price_file_rejects_a_price_without_its_source(tmp_path):
    doc = PRICED | {"addresses": [dict(PRICED["addresses"][0], source="")]}
    with pytest.raises(InputError, match=r"addresses\[0\]\.source"):
        load_gateway_prices(priced_file(tmp_path, doc))


def test_budget_for_the_allocation_leaves_out_the_gateway():
    cost = gateway_cost(dev_fleet(), DeploySettings(), GatewayPrices.model_validate(PRICED))
    fleet = fleet_for_allocation(dev_fleet(), cost)
    assert fleet.allocation.budget_usd_per_hour == pytest.approx(10 - 0.27)
    unbudgeted = dev_fleet(allocation={})
    assert fleet_for_allocation(unbudgeted, cost) is unbudgeted
    with pytest.raises(InputError, match=r"budget_usd_per_hour.*does not cover the gateway"):
        fleet_for_allocation(dev_fleet(allocation={"budget_usd_per_hour": 0.2}), cost)


def test_cost_diff_has_a_gateway_line_in_its_total(preview):
    plan: Plan = preview("dev", REPO / "stacks").plan
    cost = gateway_cost(dev_fleet(), DeploySettings(), GatewayPrices.model_validate(PRICED))
    text = cost_diff_table(None, plan, None, cost)
    assert f"Coral plan: {plan.hourly_cost_usd + 0.27:,.2f} $/hour" in text
    gateway_row = next(line for line in text.splitlines() if "gateway" in line and "│" in line)
    assert "0.27" in gateway_row
    again = cost_diff_table(plan, plan, None, cost)  # a running stack: no change
    assert "(+0.00)" in again
    unpriced = gateway_cost(dev_fleet(), DeploySettings(), load_gateway_prices())
    text = cost_diff_table(None, plan, None, unpriced)
    assert "unpriced" in text and f"Coral plan: {plan.hourly_cost_usd + 0.005:,.2f} $/hour" in text


def stacks_with(tmp_path: Path, name: str, allocation=None, deploy=None) -> Path:
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    fleet = doc["config"]["coral:fleet"]
    if allocation is not None:
        fleet["allocation"] = allocation
    if deploy is not None:
        fleet["deploy"] = deploy
    folder = tmp_path / "stacks"
    folder.mkdir(exist_ok=True)
    (folder / f"Pulumi.{name}.yaml").write_text(yaml.safe_dump(doc))
    return folder


def test_program_counts_the_gateway_in_cost_and_budget(tmp_path, preview, monkeypatch):
    plain = preview("dev", REPO / "stacks")
    nodes = plain.plan.hourly_cost_usd
    monkeypatch.setattr(gc, "PRICES", priced_file(tmp_path))
    result = preview("dev", REPO / "stacks")
    assert result.outputs["gateway_hourly_cost_usd"] == pytest.approx(0.27)
    assert result.outputs["hourly_cost_usd"] == pytest.approx(nodes + 0.27)
    assert result.outputs["declared_hourly_cost_usd"] == pytest.approx(nodes + 0.27)
    assert result.outputs["gateway_cost"]["items"][0]["usd_per_hour"] == 0.25
    # A budget the GPU nodes fit alone, but not with the gateway, is refused at preview.
    tight = stacks_with(tmp_path, "tight", allocation={"budget_usd_per_hour": nodes + 0.1})
    with pytest.raises(pulumi.RunError, match="exceeds the budget"):
        preview("tight", tight)
    monkeypatch.setattr(gc, "PRICES", REPO / "coral_iac" / "data" / "gateway_prices.yaml")
    assert preview("tight", tight).outputs["hourly_cost_usd"] == pytest.approx(nodes + 0.005)


@pytest.mark.parametrize(
    ("cidrs", "expected"),
    [
        ([], "is empty: the API port is open to no one"),
        (["0.0.0.0/0"], "whole internet with no API key"),
        (["0.0.0.0/1", "128.0.0.0/1"], "whole internet with no API key"),
        (["203.0.113.0/24"], None),
        (["0.0.0.0/1"], None),
    ],
)
def test_exposure_warnings(cidrs, expected):
    lines = exposure_warnings(DeploySettings(api_cidrs=cidrs))
    if expected is None:
        assert lines == [] and not world_open(cidrs)
    else:
        assert (
            len(lines) == 1 and expected in lines[0] and "coral:fleet.deploy.api_cidrs" in lines[0]
        )


def test_preview_cli_warns_about_reach(tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "Pulumi.yaml", project / "Pulumi.yaml")
    stacks_with(project, "open", deploy={"api_cidrs": ["0.0.0.0/0"]})
    stacks_with(project, "closed", deploy={"api_cidrs": []})
    monkeypatch.chdir(project)
    library = ["--library", str(tmp_path / "library")]
    runner = CliRunner()
    r = runner.invoke(app, ["preview", "--stack", "open", *library])
    assert r.exit_code == 0, r.output
    assert "whole internet" in r.stderr and "unreachable" not in r.stdout
    assert "gateway" in r.stdout and "unpriced" in r.stdout
    r = runner.invoke(app, ["preview", "--stack", "closed", *library])
    assert r.exit_code == 0, r.output
    assert "api_cidrs is empty" in r.stderr
    assert "unreachable: api_cidrs is empty" in r.stdout
