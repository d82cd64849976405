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
from coral_iac.deploy_settings import DeploySettings, parse_deploy
from coral_iac.exposure import exposure_warnings, world_open
from coral_iac.gateway_config import gateway_region
from coral_iac.gateway_cost import (
    GatewayPrices,
    allocation_after_gateway,
    gateway_cost,
    load_gateway_prices,
)
from solver.errors import InputError
from solver.plan_schema import Plan
from solver.stack import parse_fleet
from tests.conftest import REPO, committed_stacks

STACKS = REPO / "stacks"
DEV = yaml.safe_load((STACKS / "Pulumi.dev.yaml").read_text())
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
    """Every committed price has its source and date, and the VM rows come from a named catalog
    file at a pinned commit (the one solver/data/offers.yaml prices the GPU nodes from)."""
    prices = load_gateway_prices()
    assert prices.instances and prices.addresses
    for row in [*prices.instances, *prices.addresses]:
        assert row.source and row.retrieved and row.usd_per_hour > 0
    for vm in prices.instances:
        assert "skypilot-catalog catalogs/v8/aws/vms.csv @" in vm.source
        assert vm.instance_type in vm.source
    offers_source = (REPO / "solver" / "data" / "offers.yaml").read_text()
    commit = prices.instances[0].source.split("@")[1].split()[0]
    assert commit in offers_source


@pytest.mark.parametrize("stack", committed_stacks())
def test_every_committed_stack_prices_its_whole_gateway(stack):
    """The gateway's VM and address are both priced wherever a committed stack puts it, so the
    $/hour, the budget and the cost diff count it in full (no '*' note)."""
    doc = yaml.safe_load((STACKS / f"Pulumi.{stack}.yaml").read_text())
    fleet, deploy = parse_fleet(doc["config"], stack), parse_deploy(doc["config"], stack)
    cost = gateway_cost(fleet.regions, deploy, load_gateway_prices())
    if cost is None:  # no gateway: switched off, or no aws region to put it in
        assert not deploy.gateway.enabled or gateway_region(fleet.regions, deploy.gateway) is None
        return
    prices = load_gateway_prices()
    vm = prices.instance("aws", deploy.gateway.instance_type, cost.region)
    address = prices.address("aws", "elastic-ip", cost.region)
    assert vm is not None and address is not None, f"{stack}: gateway in {cost.region}"
    assert not cost.unpriced
    assert cost.usd_per_hour == pytest.approx(vm.usd_per_hour + address.usd_per_hour)
    assert "in the totals and the budget" in cost.summary()
    assert vm.source in cost.items[0].note and str(vm.retrieved) in cost.items[0].note


def test_a_region_without_a_price_is_a_labelled_gap():
    """No silent 0: the VM is listed as unpriced (naming the region and the file), the cost
    diff marks the gateway row and says what the totals leave out."""
    elsewhere = DeploySettings.model_validate({"gateway": {"region": "eu-west-1"}})
    cost = gateway_cost(dev_fleet().regions, elsewhere, load_gateway_prices())
    assert cost is not None and [i.name for i in cost.unpriced] == ["c7i.large VM"]
    assert cost.unpriced[0].usd_per_hour is None
    assert "no price for aws c7i.large in eu-west-1 in gateway_prices.yaml" in (
        cost.unpriced[0].note
    )
    assert "left out of the totals" in cost.summary()
    address = load_gateway_prices().address("aws", "elastic-ip", "eu-west-1")
    assert address is not None and cost.usd_per_hour == pytest.approx(address.usd_per_hour)


def test_price_file_rejects_two_prices_for_one_item(tmp_path):
    doc = PRICED | {"instances": PRICED["instances"] * 2}
    with pytest.raises(InputError, match="c7i.large us-east-2 is priced twice"):
        load_gateway_prices(priced_file(tmp_path, doc))


def test_gateway_cost_sums_vm_and_regional_address():
    prices = GatewayPrices.model_validate(PRICED)
    cost = gateway_cost(dev_fleet().regions, DeploySettings(), prices)
    assert cost is not None and not cost.unpriced
    assert cost.usd_per_hour == pytest.approx(0.27)  # the us-east-2 address row beats the global
    assert "test table (us-east-2), read 2026-12-01" in cost.items[1].note
    other = DeploySettings.model_validate({"gateway": {"region": "eu-west-1"}})
    elsewhere = gateway_cost(dev_fleet().regions, other, prices)
    assert elsewhere is not None
    assert elsewhere.usd_per_hour == pytest.approx(0.01)  # the VM is not priced there
    assert [i.name for i in elsewhere.unpriced] == ["c7i.large VM"]
    off = DeploySettings.model_validate({"gateway": {"enabled": False}})
    assert gateway_cost(dev_fleet().regions, off, prices) is None


def test_price_file_rejects_a_price_without_its_source(tmp_path):
    doc = PRICED | {"addresses": [dict(PRICED["addresses"][0], source="")]}
    with pytest.raises(InputError, match=r"addresses\[0\]\.source"):
        load_gateway_prices(priced_file(tmp_path, doc))


def test_budget_for_the_allocation_leaves_out_the_gateway():
    cost = gateway_cost(dev_fleet().regions, DeploySettings(), GatewayPrices.model_validate(PRICED))
    allocation = allocation_after_gateway(dev_fleet().allocation, cost)
    assert allocation.budget_usd_per_hour == pytest.approx(10 - 0.27)
    unbudgeted = dev_fleet(allocation={}).allocation
    assert allocation_after_gateway(unbudgeted, cost) is unbudgeted
    with pytest.raises(InputError, match=r"budget_usd_per_hour.*does not cover the gateway"):
        allocation_after_gateway(
            dev_fleet(allocation={"budget_usd_per_hour": 0.2}).allocation, cost
        )


def test_cost_diff_has_a_gateway_line_in_its_total(preview):
    plan: Plan = preview("dev", REPO / "stacks").plan
    cost = gateway_cost(dev_fleet().regions, DeploySettings(), GatewayPrices.model_validate(PRICED))
    text = cost_diff_table(None, plan, None, cost)
    assert f"Coral plan: {plan.hourly_cost_usd + 0.27:,.2f} $/hour" in text
    gateway_row = next(line for line in text.splitlines() if "gateway" in line and "│" in line)
    assert "0.27" in gateway_row
    again = cost_diff_table(plan, plan, None, cost)  # a running stack: no change
    assert "(+0.00)" in again
    elsewhere = DeploySettings.model_validate({"gateway": {"region": "eu-west-1"}})
    unpriced = gateway_cost(dev_fleet().regions, elsewhere, load_gateway_prices())
    assert unpriced is not None
    text = cost_diff_table(None, plan, None, unpriced)
    total = plan.hourly_cost_usd + unpriced.usd_per_hour  # the address alone
    assert "gateway*" in text and f"Coral plan: {total:,.2f} $/hour" in text
    assert "left out of the totals" in text


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
    committed = gateway_cost(dev_fleet().regions, DeploySettings(), load_gateway_prices())
    assert committed is not None and not committed.unpriced
    kept = preview("tight", tight).outputs
    assert kept["hourly_cost_usd"] == pytest.approx(nodes + committed.usd_per_hour)
    assert kept["gateway_hourly_cost_usd"] == pytest.approx(committed.usd_per_hour)


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
    assert "gateway" in r.stdout and "in the totals and the budget" in r.stdout
    assert "unpriced" not in r.stdout
    r = runner.invoke(app, ["preview", "--stack", "closed", *library])
    assert r.exit_code == 0, r.output
    assert "api_cidrs is empty" in r.stderr
    assert "unreachable: api_cidrs is empty" in r.stdout
