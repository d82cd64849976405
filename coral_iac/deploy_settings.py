"""How the Pulumi program deploys a plan: the `deploy` section of `coral:fleet` (ports, CIDRs,
images, secrets, drain time, the gateway). The solver never reads it; the boot time is the
solver's `allocation.boot_minutes`, which also sets the start-up penalty K."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from solver.io import parse_model
from solver.stack import DEPLOY_KEY, FLEET_KEY, fleet_object, read_stack_config, stack_path
from solver.types import FROZEN


class GatewaySettings(BaseModel):
    """The stack's gateway: one HAProxy VM giving each model one address (docs/gateway.md)."""

    model_config = FROZEN
    enabled: bool = Field(
        default=True, description="Declare the gateway (false: clients use replica endpoints)."
    )
    cloud: Literal["aws"] = Field(
        default="aws",
        description="Only aws: the gateway polls its HAProxy configuration from SSM Parameter "
        "Store, so a plan change updates it in place.",
    )
    region: str | None = Field(
        default=None,
        min_length=1,
        description="Region of the gateway VM (default: the first aws region in `regions`).",
    )
    instance_type: str = Field(
        default="c7i.large", min_length=1, description="EC2 instance type of the gateway VM."
    )
    ami_parameter: str = Field(
        default="/aws/service/debian/release/12/latest/amd64",
        description="Public SSM parameter holding the Debian 12 AMI id (HAProxy 2.6 from Debian).",
    )
    disk_gb: int = Field(default=20, ge=8, le=1000, description="Encrypted root disk.")
    health_check_interval_ms: int = Field(
        default=2000, ge=100, le=60000, description="HAProxy's GET /health interval per replica."
    )
    tls_secret: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9/_+=.@-]{1,512}$",  # Secrets Manager's name characters
        description="Secrets Manager name (in the gateway's region) of a PEM bundle: the "
        "certificate, its chain and its unencrypted private key. Set, the API port speaks "
        "HTTPS only (TLS 1.2+, HTTP/2 and 1.1); the gateway reloads a renewed certificate "
        "within a poll. Default: plain HTTP.",
    )


class DeploySettings(BaseModel):
    """How the Pulumi program deploys a plan (ignored by the solver)."""

    model_config = FROZEN
    api_port: int = Field(default=8000, ge=1, le=65535, description="Public API port.")
    api_cidrs: list[str] = Field(
        default_factory=list,
        description="IPv4 CIDRs allowed to reach the API port (nothing else is open).",
    )
    hf_token_secret: str = Field(
        default="coral/hf-token",
        min_length=1,
        description="Secret-manager name of the Hugging Face token, read by nodes at boot.",
    )
    api_key_secret: str | None = Field(
        default=None,
        min_length=1,
        description="Secret-manager name of an API key that clients must send (Authorization: "
        "Bearer <key>): the gateway checks it, and aggregated vLLM servers get it as "
        "VLLM_API_KEY, read at boot (never in user-data). Default: no key.",
    )
    max_model_len: int = Field(
        default=8192,
        gt=0,
        description="vLLM's --max-model-len, capped at each model card's max_context.",
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    disk_headroom_gb: int = Field(
        default=100,
        ge=20,
        description="Root disk beyond the model's downloaded files and the vLLM venv "
        "(coral_iac/model_files.py sizes both): logs, caches, the image itself.",
    )
    aws_ami_parameter: str = Field(
        default="/aws/service/deeplearning/ami/x86_64/"
        "base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id",
        description="Public SSM parameter holding the Deep Learning AMI id (per region); Ubuntu "
        "24.04's Python 3.12 runs vLLM 0.33.0 (coral_iac/data/images.yaml). Read once per "
        "region: the id is recorded in the stack's `images` output and kept (`refresh_images`).",
    )
    refresh_images: bool = Field(
        default=False,
        description="Read aws_ami_parameter again for every AWS region (the newest image). Off, "
        "each region keeps the image the stack first resolved, so a new DLAMI release never "
        "replaces running nodes; on, replicas move to a newer image a share at a time "
        "(image_rollout_share), each old one serving until its successor is ready.",
    )
    image_rollout_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="When a region's boot image changes (refresh_images, or a new gcp_image), "
        "the most of a model's prefill, decode or aggregated replicas replaced at a time (at "
        "least one); the next ones start once those successors serve.",
    )
    gcp_image: str = Field(
        default="projects/deeplearning-platform-release/global/images/family/"
        "common-cu129-ubuntu-2204-nvidia-580",
        description="GCP image family (Ubuntu: honours cloud-init user-data; its Python 3.10 is "
        "too old for vLLM 0.33.0, so nodes install Python 3.12 with uv; images.yaml).",
    )
    gcp_zones: dict[str, str] = Field(
        default_factory=dict,
        description="Region -> zone for every GCP node there (default: per node, the first zone "
        "the catalog says sells its offer).",
    )
    drain_minutes: float = Field(
        default=5,
        ge=0,
        description="How long an instance leaving the plan gets no new requests before it is "
        "deleted (at the first run after this); its node's stop step then waits for what is "
        "still in flight.",
    )
    rebuild_library: bool = Field(
        default=False, description="Rebuild a stale template library instead of failing."
    )
    gateway: GatewaySettings = Field(
        default_factory=GatewaySettings, description="One address per model (docs/gateway.md)."
    )

    @model_validator(mode="before")
    @classmethod
    def _boot_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "boot_minutes" in data:
            raise ValueError(
                "boot_minutes moved to coral:fleet.allocation.boot_minutes (one boot time for "
                "the start-up penalty K and for readiness); move the key there"
            )
        return data

    @model_validator(mode="after")
    def _cidrs(self) -> DeploySettings:

        for i, cidr in enumerate(self.api_cidrs):
            try:
                ipaddress.IPv4Network(cidr)
            except ValueError as e:
                raise ValueError(f"api_cidrs[{i}]: '{cidr}' is not an IPv4 CIDR ({e})") from e
        return self


def parse_deploy(config: dict[str, Any], source: str) -> DeploySettings:
    """`coral:fleet.deploy` of a stack's `config` mapping (defaults when absent)."""
    raw = fleet_object(config, source).get(DEPLOY_KEY) or {}
    return parse_model(DeploySettings, raw, f"{source}: {FLEET_KEY}.{DEPLOY_KEY}")


def load_deploy_settings(stacks_dir: Path, stack: str) -> DeploySettings:
    """`coral:fleet.deploy` of `stacks/Pulumi.<stack>.yaml`."""
    path = stack_path(stacks_dir, stack)
    return parse_deploy(read_stack_config(path), str(path))
