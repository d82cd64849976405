"""The local device: which GPU (or the CPU), its catalog GPU id, driver and library versions."""

from __future__ import annotations

import re
import shutil
import subprocess

import torch

from solver.errors import InputError

# Device names as `torch.cuda.get_device_name()` reports them (nvidia-smi's "name" column), e.g.
# "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Tesla T4"; first match wins.
GPU_NAME_PATTERNS = (
    ("h200", r"H200"),
    ("h100", r"H100"),
    ("a100-80gb", r"A100.*80"),
    ("a100-40gb", r"A100"),
    ("l40s", r"L40S"),
    ("l4", r"\bL4\b"),
    ("a10g", r"A10G"),
    ("t4", r"\bT4\b"),
    ("v100", r"V100"),
)
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def pick_device(name: str) -> torch.device:
    """`auto` (a GPU when there is one, else the CPU), `cpu` or `cuda`."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device", "cuda asked for but torch sees no GPU", "use --device cpu")
    if name not in ("cpu", "cuda"):
        raise InputError("--device", f"unknown device '{name}'", "use auto, cpu or cuda")
    return torch.device(name)


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The named dtype; default bfloat16 on a GPU (what vLLM serves), float32 on the CPU."""
    name = name or ("bfloat16" if device.type == "cuda" else "float32")
    if name not in DTYPES:
        raise InputError("--dtype", f"unknown dtype '{name}'", f"use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gpu_id_for(name: str) -> str:
    """The catalog GPU id for a device name; 'cpu' for the CPU.

    Raises:
        InputError: a GPU this table does not know (pass --node).
    """
    if name == "cpu":
        return "cpu"
    for gpu_id, pattern in GPU_NAME_PATTERNS:
        if re.search(pattern, name):
            return gpu_id
    raise InputError(
        "--node", f"cannot tell the catalog GPU id of '{name}'", "pass --node <gpu>x<count>"
    )


def driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi, or None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        result = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.splitlines()[0].strip() if result.stdout.strip() else None
