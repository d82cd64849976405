"""Time one decoder layer over a grid of sizes and write the measured table with its sidecar.

Prefill of N tokens runs N // P causal prompts of length P (one prompt of N when N <= P); decode
of B sequences at context C runs one new token per sequence against a random KV cache of C
tokens. For cards with sliding-window layers (GPT-OSS), decode time is the layer-fraction
weighted mean of a full-attention layer (context C) and a sliding layer (context min(C, window)),
the same per-layer average the analytical model uses.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import split_node_id
from solver.errors import InputError
from solver.performance.profiler.device import (
    device_name,
    driver_version,
    gpu_id_for,
)
from solver.performance.profiler.layer import DecoderLayer, LayerShape, random_weights
from solver.performance.profiler.record import MeasurementRecord, PointRecord
from solver.performance.profiler.timing import Timing, time_call
from solver.types import Phase

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_CONTEXT = 1024


@dataclass(frozen=True)
class MeasureSpec:
    """What to measure and how; sizes are decode batches or prefill token counts."""

    model: str
    phase: Phase
    sizes: tuple[int, ...]
    context: int = DEFAULT_CONTEXT
    device: str = "auto"
    dtype: str | None = None
    warmup: int = 3
    repeats: int = 10
    seed: int = 0
    tp: int = 1
    node: str | None = None
    budget_s: float | None = None
    command: str = ""

    def check(self) -> None:
        name = "--batches" if self.phase == "decode" else "--tokens"
        if not self.sizes or min(self.sizes) < 1 or len(set(self.sizes)) != len(self.sizes):
            raise InputError(name, f"need distinct sizes >= 1, got {self.sizes}", "e.g. 1,8,64")
        if len(self.sizes) < 2:
            raise InputError(name, "a measured table needs at least 2 sizes", "pass 2 or more")
        if self.context < 1:
            raise InputError("--context", f"must be >= 1, got {self.context}", "e.g. 1024")
        if self.phase == "prefill":
            bad = [n for n in self.sizes if n > self.context and n % self.context]
            if bad:
                raise InputError(
                    "--tokens",
                    f"{bad} are neither <= the prompt length {self.context} nor multiples of it",
                    "use token counts that are whole numbers of prompts",
                )
        if self.node is not None:
            split_node_id(self.node)


@dataclass
class Grid:
    """Points measured so far and the sizes skipped."""

    points: list[PointRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def prefill_inputs(
    n_tokens: int,
    prompt_len: int,
    hidden: int,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> torch.Tensor:
    """Hidden states of N tokens as whole prompts: [prompts, prompt length, hidden]."""
    seqs, length = (1, n_tokens) if n_tokens <= prompt_len else (n_tokens // prompt_len, prompt_len)
    return torch.randn(seqs, length, hidden, generator=gen, device=device, dtype=dtype)


def decode_cache(
    shape: LayerShape,
    batch: int,
    context: int,
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random KV cache of `context` tokens per sequence plus the slot the new token fills."""
    dims = (batch, shape.kv_heads, context + 1, shape.head_dim)
    return (
        torch.randn(*dims, generator=gen, device=device, dtype=dtype),
        torch.randn(*dims, generator=gen, device=device, dtype=dtype),
    )


def time_point(
    layer: DecoderLayer,
    phase: Phase,
    size: int,
    context: int,
    spec: MeasureSpec,
    gen: torch.Generator,
    before: Callable[[], object] = lambda: None,
) -> Timing:
    """Median-of-repeats time of one layer call at one size; fresh random inputs each call.

    `before` runs ahead of every call, untimed (TP ranks meet at a barrier there).
    """
    w0 = layer.w["wq"]
    device, dtype, hidden = w0.device, w0.dtype, layer.shape.hidden
    cache = (
        None if phase == "prefill" else decode_cache(layer.shape, size, context, device, dtype, gen)
    )

    def make() -> object:
        before()
        if cache is None:
            return prefill_inputs(size, context, hidden, device, dtype, gen)
        return torch.randn(size, 1, hidden, generator=gen, device=device, dtype=dtype)

    def call(x: object) -> object:
        return layer(x, cache)

    with torch.inference_mode():
        return time_call(make, call, device, spec.warmup, spec.repeats)


def layer_ms(
    layer: DecoderLayer,
    card: ModelCard,
    spec: MeasureSpec,
    size: int,
    gen: torch.Generator,
    before: Callable[[], object] = lambda: None,
) -> tuple[float, float, float]:
    """(median, min, max) ms of one layer at `size`, sliding-window layers averaged in."""
    full = time_point(layer, spec.phase, size, spec.context, spec, gen, before)
    window, frac = card.sliding_window, card.sliding_window_layer_fraction
    if spec.phase == "prefill" or window is None or frac == 0 or window >= spec.context:
        return full.median_ms, min(full.samples_ms), max(full.samples_ms)
    local = time_point(layer, "decode", size, window, spec, gen, before)

    def mix(a: float, b: float) -> float:
        return (1 - frac) * a + frac * b

    return (
        mix(full.median_ms, local.median_ms),
        mix(min(full.samples_ms), min(local.samples_ms)),
        mix(max(full.samples_ms), max(local.samples_ms)),
    )


def run_grid(
    measure_one: Callable[[int], tuple[float, float, float]],
    sizes: Sequence[int],
    budget_s: float | None,
    progress: Callable[[str], None] = lambda _: None,
) -> Grid:
    """Measure sizes in increasing order; stop at the budget or at the first out-of-memory size."""
    grid, start = Grid(), time.monotonic()
    ordered = sorted(sizes)
    for i, size in enumerate(ordered):
        spent = time.monotonic() - start
        if budget_s is not None and spent > budget_s and len(grid.points) >= 2:
            grid.notes.append(f"sizes {ordered[i:]} skipped: time budget {budget_s:g} s spent")
            break
        try:
            med, lo, hi = measure_one(size)
        except torch.OutOfMemoryError:
            grid.notes.append(f"sizes {ordered[i:]} skipped: out of device memory at {size}")
            break
        grid.points.append(PointRecord(x=size, ms_per_layer=med, min_ms=lo, max_ms=hi))
        progress(f"{size}: {med:.4f} ms")
    return grid


def build_layer(
    card: ModelCard, device: torch.device, dtype: torch.dtype, seed: int
) -> DecoderLayer:
    shape = LayerShape.from_card(card)
    return DecoderLayer(shape, random_weights(shape, device, dtype, seed))


def make_record(
    card: ModelCard,
    spec: MeasureSpec,
    device: torch.device,
    dtype: torch.dtype,
    grid: Grid,
    method: str,
    vllm_version: str | None = None,
) -> MeasurementRecord:
    """The sidecar for a finished grid; the node config defaults to <local gpu>x<tp>."""
    if len(grid.points) < 2:
        raise InputError(
            f"{spec.model} {spec.phase}",
            f"only {len(grid.points)} sizes measured ({'; '.join(grid.notes)})",
            "use smaller sizes or a larger --budget-s",
        )
    name = device_name(device)
    node = spec.node or f"{gpu_id_for(name)}x{spec.tp}"
    return MeasurementRecord(
        model=spec.model,
        node=node,
        phase=spec.phase,
        engine="torch" if vllm_version is None else "vllm",
        method=method,
        device=name,
        tp=spec.tp,
        driver=driver_version() if device.type == "cuda" else None,
        cuda_runtime=torch.version.cuda if device.type == "cuda" else None,
        torch_version=torch.__version__,
        vllm_version=vllm_version,
        dtype=str(dtype).removeprefix("torch."),
        context_tokens=spec.context,
        warmup=spec.warmup,
        repeats=spec.repeats,
        seed=spec.seed,
        measured_at=dt.datetime.now(dt.UTC).replace(microsecond=0),
        card_source=card.source,
        command=spec.command,
        points=tuple(grid.points),
        notes=tuple(grid.notes),
    )
