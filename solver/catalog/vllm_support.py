"""Which GPUs the pinned vLLM wheel can run, and the plan-time check that refuses the others.

`solver/data/vllm_build.yaml` records what the wheel was built with (CUDA 13.0, kernels for
sm_75 and newer) and each catalog GPU's compute capability, each with its source.
`check_deployable_gpus` refuses a deployable stack (`library.mode: vllm`) that names a node config
of a GPU the build has no kernels for (the V100, sm_70), naming the stack key and the fix; the
general and paper modes describe hardware stock vLLM does not run anyway and are not checked.
"""

from __future__ import annotations

import datetime as dt
from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from solver.catalog.offers import split_node_id
from solver.errors import InputError
from solver.io import data_path, parse_model, read_yaml
from solver.modes import LibraryMode
from solver.types import FROZEN


class Wheel(BaseModel):
    model_config = FROZEN
    file: str
    sha256: str = Field(min_length=64, max_length=64)
    source: str
    retrieved: dt.date


class VllmBuild(BaseModel):
    """The pinned wheel's CUDA build and the compute capability of every catalog GPU."""

    model_config = FROZEN
    schema_version: Literal[1]
    vllm_version: str
    wheel: Wheel
    cuda: str = Field(description="CUDA toolkit the wheel's kernels were compiled with.")
    cuda_source: str
    kernel_sms: list[int] = Field(min_length=1, description="SM targets, major * 10 + minor.")
    kernel_sms_source: str
    min_driver_major: int = Field(gt=0, description="Oldest NVIDIA driver branch for that CUDA.")
    min_driver_source: str
    retrieved: dt.date
    compute_capability: dict[str, int] = Field(description="GPU id -> major * 10 + minor.")
    compute_capability_source: str

    def runs(self, gpu: str) -> bool:
        """Whether the wheel has kernels this GPU can execute: a target of the same major
        version and a minor no larger than the GPU's (SASS runs upwards within a major only)."""
        cc = self.compute_capability[gpu]
        return any(sm // 10 == cc // 10 and sm % 10 <= cc % 10 for sm in self.kernel_sms)

    def reason(self, gpu: str) -> str:
        """Why `gpu` cannot run the wheel (for a GPU `runs` refuses)."""
        cc = self.compute_capability[gpu]
        lowest = min(self.kernel_sms)
        return (
            f"vLLM {self.vllm_version}'s CUDA {self.cuda} build has no kernels for {gpu} "
            f"(compute capability {cc // 10}.{cc % 10}, sm_{cc}; the wheel's lowest target is "
            f"sm_{lowest})"
        )


@cache
def load_vllm_build(path: Path | None = None) -> VllmBuild:
    """Parse `solver/data/vllm_build.yaml` (or `path`)."""
    where = path or data_path("vllm_build.yaml")
    return parse_model(VllmBuild, read_yaml(where), str(where))


def unsupported_gpus(node_configs: list[str], build: VllmBuild | None = None) -> dict[str, str]:
    """Node config -> why, for each node config whose GPU the wheel cannot run.

    Raises:
        InputError: a node config's GPU has no compute capability in vllm_build.yaml.
    """
    build = build or load_vllm_build()
    refused: dict[str, str] = {}
    for node in node_configs:
        gpu = split_node_id(node)[0]
        if gpu not in build.compute_capability:
            raise InputError(
                f"vllm_build.yaml compute_capability.{gpu}",
                f"no compute capability recorded for GPU '{gpu}' (node config {node})",
                "add it from https://developer.nvidia.com/cuda-gpus",
                suggestions=sorted(build.compute_capability),
            )
        if not build.runs(gpu):
            refused[node] = build.reason(gpu)
    return refused


def check_deployable_gpus(node_configs: list[str], mode: LibraryMode, stack: str = "") -> None:
    """Refuse a deployable stack (`library.mode: vllm`, `mode.deployable`) with a node config the
    pinned vLLM build cannot run. Other modes are not deployable and pass.

    Raises:
        InputError: naming `coral:fleet.node_configs`, each refused node config and why, and the
            fix (drop them, or plan the stack in general mode for simulation only).
    """
    if not mode.deployable:
        return
    refused = unsupported_gpus(node_configs)
    if refused:
        where = f"stacks/Pulumi.{stack}.yaml " if stack else ""
        raise InputError(
            f"{where}coral:fleet.node_configs",
            "; ".join(f"{node}: {why}" for node, why in refused.items()),
            f"remove {', '.join(refused)} from node_configs (and their availability, prices and "
            "gpu_pools), or set library.mode: general for a simulation-only stack",
        )
