"""The JSON sidecar written next to each measured table: what was measured, where, how."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from solver.types import FROZEN, Phase


class PointRecord(BaseModel):
    """One row of the table with its repeat statistics."""

    model_config = FROZEN
    x: int = Field(description="Decode batch (sequences) or prefill batch (prompt tokens).")
    ms_per_layer: float = Field(description="Median over the repeats (the CSV's second column).")
    min_ms: float = Field(description="Fastest repeat.")
    max_ms: float = Field(description="Slowest repeat.")


class MeasurementRecord(BaseModel):
    """Provenance of one measured table `<model>__<node>__<phase>.csv`."""

    model_config = FROZEN
    model: str = Field(description="Model card id.")
    node: str = Field(description="Node config the table describes, <gpu>x<count>.")
    phase: Phase
    engine: Literal["torch", "vllm"] = Field(description="Who ran the layer.")
    method: str = Field(description="How ms per layer was obtained.")
    device: str = Field(description="Device name as the driver reports it, or 'cpu'.")
    tp: int = Field(ge=1, description="Tensor-parallel degree (GPUs the layer is split over).")
    driver: str | None = Field(description="NVIDIA driver version (nvidia-smi), None on CPU.")
    cuda_runtime: str | None = Field(description="CUDA runtime torch was built with.")
    torch_version: str
    vllm_version: str | None = Field(default=None, description="Only for engine vllm.")
    dtype: str = Field(description="Weights, activations and KV cache dtype.")
    context_tokens: int = Field(
        description="Decode: tokens already in each sequence's KV cache; prefill: prompt length "
        "per sequence (larger batches are several prompts of this length)."
    )
    warmup: int = Field(ge=0, description="Untimed calls per point.")
    repeats: int = Field(ge=1, description="Timed calls per point, each on fresh random inputs.")
    seed: int
    measured_at: dt.datetime = Field(description="UTC time the measurement finished.")
    card_source: str = Field(description="Where the model card's architecture numbers come from.")
    command: str = Field(description="The command line that produced this table.")
    points: tuple[PointRecord, ...]
    notes: tuple[str, ...] = Field(default=(), description="Sizes skipped and why.")

    def csv_text(self) -> str:
        """The measured table: header-less rows 'x,ms per layer'."""
        return "".join(f"{p.x},{p.ms_per_layer:.6g}\n" for p in self.points)

    def write(self, out_dir: Path) -> Path:
        """Write `<model>__<node>__<phase>.csv` and its `.json` sidecar; return the CSV path."""
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{self.model}__{self.node}__{self.phase}"  # ids hold dots: no with_suffix
        csv_path = out_dir / f"{stem}.csv"
        csv_path.write_text(self.csv_text(), encoding="utf-8")
        (out_dir / f"{stem}.json").write_text(self.model_dump_json(indent=1) + "\n", "utf-8")
        return csv_path
