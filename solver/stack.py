"""Stack config (`stacks/Pulumi.<stack>.yaml`, key `coral:fleet`): one schema for every stack.

Parsed once into frozen pydantic models; errors name the key path (`coral:fleet.models.phi-4.
slo_ms.prefill`) and the fix. Later stages extend it (demand, availability, prices, budget).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from solver.errors import InputError
from solver.io import parse_model, read_yaml

Mode = Literal["vllm", "general"]
FLEET_KEY = "coral:fleet"
FROZEN = ConfigDict(frozen=True, extra="forbid")


class Slo(BaseModel):
    model_config = FROZEN
    prefill: float = Field(gt=0, description="Prefill latency SLO, ms (TTFT-like).")
    decode: float = Field(gt=0, description="Decode latency SLO, ms per output token.")


class ModelSpec(BaseModel):
    """One served model: its SLOs and the mean request shape of its workload."""

    model_config = FROZEN
    slo_ms: Slo
    mean_prompt_tokens: float = Field(gt=0, description="Mean prompt length of its workload.")
    mean_output_tokens: float = Field(gt=0, description="Mean output length of its workload.")
    workload: str = Field(default="", description="Trace the lengths come from, with source.")

    @property
    def decode_context_tokens(self) -> float:
        """Mean context during decode: the prompt plus half the output."""
        return self.mean_prompt_tokens + self.mean_output_tokens / 2


class LibrarySettings(BaseModel):
    """Serving-template enumeration settings (paper defaults)."""

    model_config = FROZEN
    n_max: int = Field(default=6, ge=1, le=8, description="Most nodes in one serving template.")
    rho: float = Field(default=12, gt=1, description="Most total GPU memory, x model weights.")
    mode: Mode = Field(default="vllm", description="Runtime capability: vllm or general.")


class Region(BaseModel):
    model_config = FROZEN
    cloud: Literal["aws", "gcp"]
    region: str


class FleetConfig(BaseModel):
    """The `coral:fleet` object of a stack."""

    model_config = FROZEN
    description: str = ""
    models: dict[str, ModelSpec] = Field(min_length=1)
    regions: list[Region] = Field(min_length=1)
    node_configs: list[str] = Field(min_length=1, description="Node configs the fleet may rent.")
    library: LibrarySettings = Field(default_factory=LibrarySettings)

    @model_validator(mode="after")
    def _unique(self) -> FleetConfig:
        if len(set(self.node_configs)) != len(self.node_configs):
            raise ValueError("node_configs lists a node config twice")
        return self


def parse_fleet(config: dict[str, Any], source: str) -> FleetConfig:
    if FLEET_KEY not in config:
        raise InputError(
            f"{source}: config", f"no '{FLEET_KEY}' key", f"add a '{FLEET_KEY}' object"
        )
    return parse_model(FleetConfig, config[FLEET_KEY], f"{source}: {FLEET_KEY}")


def stack_path(stacks_dir: Path, stack: str) -> Path:
    return stacks_dir / f"Pulumi.{stack}.yaml"


def load_stack(stacks_dir: Path, stack: str) -> FleetConfig:
    """Load `stacks/Pulumi.<stack>.yaml`; an unknown stack lists the known ones."""
    path = stack_path(stacks_dir, stack)
    if not path.exists():
        known = sorted(
            p.name[len("Pulumi.") : -len(".yaml")] for p in stacks_dir.glob("Pulumi.*.yaml")
        )
        from solver.errors import unknown_value

        raise unknown_value("--stack", stack, known, "stack")
    doc = read_yaml(path) or {}
    return parse_fleet(doc.get("config") or {}, str(path))
