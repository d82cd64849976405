"""Boot images against the pinned vLLM wheel: its Requires-Python and its CUDA driver needs."""

from __future__ import annotations

from email.parser import Parser

import yaml
from packaging.specifiers import SpecifierSet

from coral_iac.bootstrap import VLLM_VERSION
from coral_iac.deploy_settings import DeploySettings
from solver.catalog.vllm_support import load_vllm_build
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
    """Each image's NVIDIA driver branch is at least the one the wheel's CUDA needs (R580 for
    CUDA 13.x: NVIDIA's CUDA-and-drivers table, solver/data/vllm_build.yaml), and says where the
    driver is stated and whether that statement is about this image itself."""
    build = load_vllm_build()
    assert build.cuda.startswith("13.") and build.min_driver_major == 580
    assert "supported-drivers-and-cuda-toolkit-versions" in build.min_driver_source
    doc = yaml.safe_load(IMAGES.read_text(encoding="utf-8"))
    for cloud, entry in doc["images"].items():
        image = entry["default"]
        assert image["driver_major"] >= build.min_driver_major, cloud
        if image.get("driver_version"):  # "595.91.07": the branch is its first number
            assert int(str(image["driver_version"]).split(".")[0]) == image["driver_major"], cloud
        assert isinstance(image["driver_verified"], bool), cloud
        assert image["driver_source"] and image["driver_note"] and image["retrieved"], cloud


def test_deploy_defaults_are_the_recorded_images():
    doc = yaml.safe_load(IMAGES.read_text(encoding="utf-8"))["images"]
    d = DeploySettings()
    assert d.aws_ami_parameter == doc["aws"]["default"]["ssm_parameter"]
    assert d.gcp_image == doc["gcp"]["default"]["image"]
