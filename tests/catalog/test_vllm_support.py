"""GPUs the pinned vLLM build cannot run are refused at plan time (solver/data/vllm_build.yaml),
and the recorded build facts match the wheel installed in .vllm-venv."""

from __future__ import annotations

import re
from email.parser import Parser
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coral_iac.bootstrap import VLLM_VERSION
from coral_iac.cli.app import app
from solver.catalog.offers import load_catalog
from solver.catalog.vllm_support import (
    check_deployable_gpus,
    load_vllm_build,
    unsupported_gpus,
)
from solver.errors import InputError
from solver.modes import GeneralMode, PaperMode, VllmMode, library_mode
from tests.conftest import REPO

BUILD = load_vllm_build()
SITE = REPO / ".vllm-venv" / "lib"


def installed_wheel() -> Path:
    found = sorted(SITE.glob("python3*/site-packages/vllm"))
    assert found, "no vllm package in .vllm-venv: run scripts/vllm_env"
    return found[0]


def test_the_build_file_names_the_pinned_wheel_and_every_catalog_gpu():
    assert BUILD.vllm_version == VLLM_VERSION
    assert set(BUILD.compute_capability) == set(load_catalog().gpus)
    assert BUILD.wheel.file.startswith(f"vllm-{VLLM_VERSION}-")


def test_the_installed_wheel_is_the_recorded_cuda_build():
    """The CUDA release and kernel targets in vllm_build.yaml are what the wheel's compiled
    kernels say (the same read as `strings`), and its METADATA is the pinned version."""
    pkg = installed_wheel()
    meta = Parser().parsestr(
        (pkg.parent / f"vllm-{VLLM_VERSION}.dist-info" / "METADATA").read_text(encoding="utf-8")
    )
    assert meta["Version"] == VLLM_VERSION
    for name in ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"):
        data = (pkg / name).read_bytes()
        assert f"Cuda compilation tools, release {BUILD.cuda},".encode() in data, name
        assert b"libcudart.so." + BUILD.cuda.split(".")[0].encode() in data, name
        sms = {int(m) for m in re.findall(rb"sm_(\d+)a?\b", data)}
        assert sms <= set(BUILD.kernel_sms), (name, sms)
        assert min(sms) == min(BUILD.kernel_sms), name


def test_only_the_v100_is_refused():
    refused = {gpu for gpu in BUILD.compute_capability if not BUILD.runs(gpu)}
    assert refused == {"v100"}
    why = unsupported_gpus(["t4x1", "v100x1", "h100x8"])
    assert list(why) == ["v100x1"]
    assert "sm_70" in why["v100x1"] and "CUDA 13.0" in why["v100x1"]


def test_a_deployable_stack_with_a_v100_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(InputError) as exc:
        check_deployable_gpus(["l4x1", "v100x1"], VllmMode(), "s")
    text = str(exc.value)
    assert "stacks/Pulumi.s.yaml coral:fleet.node_configs" in text
    assert "v100x1" in text and "remove v100x1 from node_configs" in text
    for mode in (GeneralMode(), PaperMode()):  # not deployable: simulation only
        check_deployable_gpus(["l4x1", "v100x1"], mode, "s")
    check_deployable_gpus(["l4x1", "t4x4"], VllmMode(), "s")


def test_an_unknown_gpu_is_an_error_naming_the_data_file():
    with pytest.raises(InputError, match="vllm_build.yaml compute_capability.b200"):
        unsupported_gpus(["b200x8"])


def test_coral_plan_refuses_a_vllm_stack_with_v100_before_planning(tmp_path, monkeypatch):
    (tmp_path / "Pulumi.yaml").write_text((REPO / "Pulumi.yaml").read_text())
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    doc["config"]["coral:fleet"]["node_configs"].append("v100x1")
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "Pulumi.v.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["plan", "--stack", "v"])
    assert r.exit_code == 1, r.output
    assert "coral:fleet.node_configs" in r.output and "v100x1" in r.output
    assert not (tmp_path / ".coral").exists()  # refused before any library was built


def test_no_committed_vllm_stack_names_a_gpu_the_build_cannot_run():
    for path in sorted((REPO / "stacks").glob("Pulumi.*.yaml")):
        fleet = yaml.safe_load(path.read_text())["config"]["coral:fleet"]
        mode = fleet.get("library", {}).get("mode", "vllm")
        stack = path.stem.removeprefix("Pulumi.")
        check_deployable_gpus(fleet["node_configs"], library_mode(mode), stack)
