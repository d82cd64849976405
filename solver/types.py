"""The vocabulary every stage shares, defined once: phases, library modes, jobs, frozen models."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import ConfigDict

Phase = Literal["prefill", "decode"]
"""A request's two phases; SLOs are per phase (prefill: TTFT-like ms, decode: ms per token)."""

LibPhase = Literal["prefill", "decode", "aggregated"]
"""What a serving template serves: one phase (disaggregated), or both on one pipeline."""

Mode = Literal["vllm", "general", "paper"]
"""A library mode's name (`coral:fleet.library.mode`), the template space a stack plans in: vllm
(placements stock vLLM runs); general (the paper's PP+DP space plus per-GPU chains); paper
(exactly the paper's space: `solver.serving.paper_mode`, evaluation only). Its behaviour is a
`solver.modes.LibraryMode`; not to be confused with the performance model's runtime."""

Job = tuple[str, LibPhase]
"""(model id, library phase): one row of demand and one set of serving templates."""

FROZEN = ConfigDict(frozen=True, extra="forbid")
"""Every boundary model: immutable once parsed, and unknown keys are errors."""

BUCKET_SEP = "@"  # "<model>@b<i>": a length bucket's name in a plan (model ids never hold it)


def per_model(by_job: Mapping[Job, float]) -> dict[str, float]:
    """Each model's least value over its jobs (model, phase), at most 1: its served fraction."""
    out: dict[str, float] = {}
    for (model, _), f in by_job.items():
        out[model] = min(out.get(model, 1.0), f)
    return out


def base_model(name: str) -> str:
    """The model a plan's model name serves: "phi-4@b1" (a length bucket) -> "phi-4"."""
    return name.split(BUCKET_SEP, 1)[0]
