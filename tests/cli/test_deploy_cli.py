"""`coral preview` and `coral render` (the program offline), and the repository's shell scripts."""

from __future__ import annotations

import json
import shutil
import subprocess

import yaml
from typer.testing import CliRunner

from coral_iac.cli.app import app
from tests.conftest import REPO, committed_library

runner = CliRunner()


def test_preview_lists_nodes_and_cost(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    library = ["--library", str(committed_library("dev"))]
    r = runner.invoke(app, ["preview", "--stack", "dev", "--json", *library])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["outputs"]["hourly_cost_usd"] > 0
    assert any(x["type"] == "aws:ec2/instance:Instance" for x in data["resources"])
    r = runner.invoke(app, ["preview", "--stack", "dev", *library])
    assert r.exit_code == 0 and "aws:us-east-2" in r.stdout and "$/hour" in r.stdout
    assert "starting, 0 retiring, 0 draining" in r.stdout  # a new stack: everything boots


def test_preview_rebuilds_a_stale_local_library(tmp_path, monkeypatch):
    """Offline, `coral preview` rebuilds a stale cache as `coral plan` does."""
    monkeypatch.chdir(REPO)
    library = ["--library", str(tmp_path / "library")]
    assert runner.invoke(app, ["preview", "--stack", "dev", "--json", *library]).exit_code == 0
    files = sorted((tmp_path / "library").glob("*.json"))
    assert files
    for f in files:  # format 2: a JSON header line, then the templates column by column
        header, body = f.read_text().split("\n", 1)
        doc = json.loads(header)
        doc["input_hashes"]["perf_model"] = "stale"
        f.write_text(json.dumps(doc) + "\n" + body)
    r = runner.invoke(app, ["preview", "--stack", "dev", "--json", *library])
    assert r.exit_code == 0, r.output
    for f in files:  # rebuilt for the current inputs
        assert json.loads(f.read_text().split("\n", 1)[0])["input_hashes"]["perf_model"] != "stale"


def test_render_writes_valid_user_data_per_node(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    library = ["--library", str(committed_library("dev"))]
    out = tmp_path / "ud"
    r = runner.invoke(app, ["render", "--stack", "dev", "--out", str(out), *library])
    assert r.exit_code == 0, r.output
    files = sorted(out.glob("*.yaml"))
    assert files
    for f in files:
        doc = yaml.safe_load(f.read_text())
        assert f.read_text().startswith("#cloud-config") and doc["runcmd"]


def test_preview_unknown_stack_suggests_known(monkeypatch):
    monkeypatch.chdir(REPO)
    r = runner.invoke(app, ["preview", "--stack", "prd"])
    assert r.exit_code == 1 and "prod" in r.output


def test_repository_shell_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed: scripts/test installs it"
    scripts = [
        p
        for p in (REPO / "scripts").iterdir()
        if p.is_file() and p.read_text().startswith("#!/usr/bin/env bash")
    ]
    scripts.append(REPO / ".ci" / "run")
    r = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_preview_and_render_a_stack_with_gcp_instances_through_the_cli(tmp_path, monkeypatch):
    """dev-gcp plans only GCP nodes: their `tags` are network tags (a list), which crashed `coral
    preview`; their replica keys come back from the sanitised labels. (staging has a GCP region
    too, but whether its plan buys a GCP node depends on its demand and prices: it buys none
    since gpt-oss-20b moved to the Azure code trace.)"""
    monkeypatch.chdir(REPO)
    library = ["--library", str(committed_library("dev-gcp"))]
    r = runner.invoke(app, ["preview", "--stack", "dev-gcp", *library])
    assert r.exit_code == 0, r.output
    assert "gcp:us-central1:" in r.stdout and "/gcp:us-central1/" in r.stdout
    out = tmp_path / "ud"
    r = runner.invoke(app, ["render", "--stack", "dev-gcp", "--out", str(out), *library])
    assert r.exit_code == 0, r.output
    assert any("gcp" in f.name for f in out.glob("*.yaml"))


def test_a_stack_stock_vllm_cannot_run_exits_1_with_the_reason(tmp_path, monkeypatch):
    """paper-helix plans Helix's general placements (benchmarks only): `coral preview` and
    `coral render` refuse it with the fix, instead of rendering nodes vLLM would refuse. The
    deployable stacks (dev, staging, prod) go through both commands in test_vllm_validation."""
    monkeypatch.chdir(REPO)
    library = ["--library", str(committed_library("paper-helix"))]
    for command in (["preview"], ["render", "--out", str(tmp_path / "ud")]):
        r = runner.invoke(app, [*command, "--stack", "paper-helix", *library])
        assert r.exit_code == 1, r.output
        assert "only 'vllm' placements run on stock vLLM; set mode: vllm" in r.output


def test_preview_says_what_the_plan_needs_of_each_quota(tmp_path, monkeypatch):
    """A launch past the account's on-demand quota fails and leaves the fleet short: preview
    names each quota the GPU nodes count against, with the command that reads the limit. dev
    runs two g6e.xlarge (4 vCPUs each: solver/data/offers.yaml) under AWS's G and VT quota."""
    monkeypatch.chdir(REPO)
    library = ["--library", str(committed_library("dev"))]
    r = runner.invoke(app, ["preview", "--stack", "dev", "--json", *library])
    assert r.exit_code == 0, r.output
    (need,) = json.loads(r.stdout)["quota"]
    assert (need["cloud"], need["region"], need["quota"]) == ("aws", "us-east-2", "L-DB2E81BA")
    assert need["needed"] == 8 and need["during_replacement"] == 16
    assert "--quota-code L-DB2E81BA --region us-east-2" in need["check"]


def test_instance_classes_count_against_their_own_quota():
    from coral_iac.quota import aws_quota

    assert aws_quota("g6e.12xlarge")[0] == aws_quota("vt1.3xlarge")[0] == "L-DB2E81BA"
    assert aws_quota("p4d.24xlarge")[0] == "L-417A185B"
    assert aws_quota("c7i.large")[0] == "L-1216C47A"
    # Spot capacity has quotas of its own (zero by default for GPUs on most accounts).
    assert aws_quota("g6e.12xlarge", spot=True)[0] == "L-3819A6DF"
    assert aws_quota("p3.8xlarge", spot=True)[0] == aws_quota("p4d.24xlarge", spot=True)[0]
    assert aws_quota("p4d.24xlarge", spot=True)[0] == "L-7212CCBC"
    assert aws_quota("p5.48xlarge", spot=True)[0] == "L-C4BD4855"
    assert aws_quota("c7i.large", spot=True)[0] == "L-34B43A08"


def test_spot_instances_need_the_spot_and_preemptible_quotas():
    from coral_iac.quota import quota_needs
    from solver.catalog.offers import load_catalog
    from solver.plan_schema import Instance, Plan

    def inst(cloud: str, region: str, node: str, zone: str | None) -> Instance:
        return Instance(key=f"m/aggregated/{cloud}:{region}/{node}/{zone}/0", model="m",
                        phase="aggregated", cloud=cloud, region=region, template=node, index=0,
                        nodes=[node], usd_per_hour=1.0, throughput=1.0,
                        market="spot" if zone else "on-demand", zone=zone)  # fmt: skip

    plan = Plan.model_construct(instances=[
        inst("aws", "us-east-2", "l4x1", "use2-az1"), inst("aws", "us-east-2", "l4x1", None),
        inst("gcp", "us-central1", "l4x1", "us-central1-a"),
    ])  # fmt: skip
    needs = {(n.cloud, n.quota): n.needed for n in quota_needs(plan, load_catalog())}
    assert needs[("aws", "L-3819A6DF")] == needs[("aws", "L-DB2E81BA")] > 0
    assert needs[("gcp", "PREEMPTIBLE_NVIDIA_L4_GPUS")] == 1
    assert ("gcp", "NVIDIA_L4_GPUS") not in needs and ("gcp", "PREEMPTIBLE_CPUS") in needs


def test_preview_json_shows_each_resource_with_its_inputs_and_masks_secrets(tmp_path, monkeypatch):
    """A script can check what would be declared (zones, images, disks) from `--json`, as from
    `pulumi preview --json`; a key that names a secret value is masked."""
    from coral_iac.cli.deploy import masked

    monkeypatch.chdir(REPO)
    r = runner.invoke(app, ["preview", "--stack", "dev", "--json", "--library",
                            str(committed_library("dev"))])  # fmt: skip
    assert r.exit_code == 0, r.output
    resources = json.loads(r.stdout)["resources"]
    nodes = [x for x in resources if x["type"] == "aws:ec2/instance:Instance"]
    assert nodes and all(n["inputs"]["metadataOptions"]["httpTokens"] == "required" for n in nodes)
    assert all(n["inputs"]["rootBlockDevice"]["encrypted"] for n in nodes)
    zones = {x["inputs"].get("availabilityZone") for x in resources
             if x["type"] == "aws:ec2/subnet:Subnet"}  # fmt: skip
    assert "us-east-2a" in zones
    assert masked({"secretString": "hf_x", "tags": [{"apiToken": "t"}], "secretId": "coral/hf"}) == {
        "secretString": "[secret]", "tags": [{"apiToken": "[secret]"}], "secretId": "coral/hf"}
