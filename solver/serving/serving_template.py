"""What a serving template is: a node multiset with its placement (stages, layers, TP).

Plain pydantic models with no solver imports, so plans, the validator and the Pulumi program
can read templates without OR-Tools. The library that builds them is
`solver/serving/library.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from solver.types import FROZEN, LibPhase, Mode


class StageMember(BaseModel):
    """One node (or one GPU of it, for one-process-per-GPU layouts) serving a stage."""

    model_config = FROZEN
    node: int = Field(description="Index into the template's `nodes`.")
    gpus: list[int] = Field(description="GPU indices on that node (CUDA_VISIBLE_DEVICES).")
    tp: int = Field(description="Tensor-parallel size of this process.")


class Stage(BaseModel):
    model_config = FROZEN
    layers: int = Field(gt=0, description="Consecutive layers this stage holds.")
    members: list[StageMember] = Field(min_length=1, description=">1 = data parallel (general).")


class ServingTemplate(BaseModel):
    """A node multiset in one region with its throughput-optimal placement."""

    model_config = FROZEN
    key: str = Field(description="Stable id: the node multiset, e.g. 'l40sx1*3+l4x1'.")
    model: str
    phase: LibPhase
    mode: Mode
    nodes: list[str] = Field(description="Node configs, sorted, one entry per node.")
    stages: list[Stage] = Field(description="Pipeline stages in order.")
    throughput: float = Field(gt=0, description="tokens/s (prefill, decode) or requests/s.")
    unit: Literal["tokens/s", "requests/s"]
    stage_budget_ms: list[float] = Field(description="Per-stage budget per SLO phase.")

    @property
    def layer_partition(self) -> str:
        """VLLM_PP_LAYER_PARTITION: layers per stage, comma-separated."""
        return ",".join(str(s.layers) for s in self.stages)

    @property
    def tp_size(self) -> int:
        return self.stages[0].members[0].tp


def template_key(nodes: tuple[str, ...] | list[str]) -> str:
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n] = counts.get(n, 0) + 1
    return "+".join(f"{n}*{c}" if c > 1 else n for n, c in sorted(counts.items()))
