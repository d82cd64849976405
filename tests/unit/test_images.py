"""Boot images against the pinned vLLM wheel: its Requires-Python and its CUDA driver needs."""

from __future__ import annotations

from email.parser import Parser

import yaml
from packaging.specifiers import SpecifierSet

from coral_iac.bootstrap import VLLM_VERSION
from coral_iac.deploy_settings import DeploySettings
from tests.conftest import REPO

IMAGES = REPO / "coral_iac" / "data" / "images.yaml"
SITE = REPO / ".vllm-venv" / "lib"


def wheel_metadata():
    found = sorted(SITE.glob(f"python3*/site-packages/vllm-{VLLM_VERSION}.dist-info/METADATA"))
    assert found, f"no vllm-{VLLM_VERSION}.dist-info in .vllm-venv: run scripts/vllm_env"
    return Parser().parsestr(found[0].read_text(encoding="utf-8"))


def test_every_image_runs_the_pinned_wheels_python():
    requires = SpecifierSet(wheel_metadata()["Requires-Python"])
    doc = yaml.safe_load(IMAGES.read_text(encoding="utf-8"))
    assert set(doc["images"]) == {"aws", "gcp"}
    for cloud, entry in doc["images"].items():
        image = entry["default"]
        python = image.get("runtime_python", image["python"])
        assert python in requires, f"{cloud}: Python {python} outside vLLM's {requires}"
        if "runtime_python" in image:  # the system Python is too old: the boot installs one
            assert image["python"] not in requires


def test_every_image_driver_runs_the_wheels_cuda():
    doc = yaml.safe_load(IMAGES.read_text(encoding="utf-8"))
    for cloud, entry in doc["images"].items():
        assert entry["default"]["driver_major"] >= doc["vllm_min_driver"], cloud
        assert entry["default"]["source"] and entry["default"]["retrieved"]


def test_deploy_defaults_are_the_recorded_images():
    doc = yaml.safe_load(IMAGES.read_text(encoding="utf-8"))["images"]
    d = DeploySettings()
    assert d.aws_ami_parameter == doc["aws"]["default"]["ssm_parameter"]
    assert d.gcp_image == doc["gcp"]["default"]["image"]
