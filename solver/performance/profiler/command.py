"""`coral profile measure`: parse the grid, pick the engine, measure, write table and sidecar."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from solver.catalog.model_cards import ModelCard, get_card, load_model_cards
from solver.errors import InputError
from solver.performance.profiler.cards import tiny_card
from solver.performance.profiler.device import pick_device, pick_dtype
from solver.performance.profiler.measure import (
    DEFAULT_BATCHES,
    DEFAULT_TOKENS,
    MeasureSpec,
    build_layer,
    layer_ms,
    make_record,
    run_grid,
)
from solver.performance.profiler.record import MeasurementRecord
from solver.performance.profiler.tp import measure_tp
from solver.performance.profiler.vllm_engine import measure_vllm
from solver.types import Phase

ENGINES = ("torch", "vllm")


def parse_sizes(text: str | None, phase: Phase) -> tuple[int, ...]:
    """'1,8,64' -> (1, 8, 64); None -> the phase's default grid."""
    if text is None:
        return DEFAULT_BATCHES if phase == "decode" else DEFAULT_TOKENS
    name = "--batches" if phase == "decode" else "--tokens"
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise InputError(
            name, f"not a comma-separated list of integers: '{text}'", "e.g. 1,8,64"
        ) from exc


def parse_layers(text: str) -> tuple[int, int]:
    """'2,6' -> (2, 6): the two layer counts of the vLLM difference method."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise InputError("--vllm-layers", f"expected two integers L1,L2, got '{text}'", "e.g. 2,6")
    return int(parts[0]), int(parts[1])


def run_measure(
    spec: MeasureSpec,
    out_dir: Path,
    engine: str = "torch",
    tiny: bool = False,
    hf_config: str | None = None,
    vllm_layers: str = "2,6",
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[Path, MeasurementRecord]:
    """Measure one (model, phase) and write `<model>__<node>__<phase>.csv` plus its sidecar."""
    card = get_card(load_model_cards(), spec.model)
    if tiny:
        card = tiny_card(card)
    if engine not in ENGINES:
        raise InputError("--engine", f"unknown engine '{engine}'", "use torch or vllm")
    if engine == "vllm":
        record = _measure_with_vllm(card, spec, hf_config, parse_layers(vllm_layers), progress)
    else:
        record = measure(card, spec, progress)
    if tiny:
        smoke = record.method + " (tiny stand-in layer: smoke output, not data)"
        record = record.model_copy(update={"method": smoke})
    return record.write(out_dir), record


def measure(
    card: ModelCard, spec: MeasureSpec, progress: Callable[[str], None] = lambda _: None
) -> MeasurementRecord:
    """Measure one (model, phase) with torch and return its record: on the local device, or
    split `spec.tp` ways over local ranks (`solver.performance.profiler.tp`)."""
    spec.check()
    if spec.tp != 1:
        return measure_tp(card, spec, progress)
    device = pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device)
    layer = build_layer(card, device, dtype, spec.seed)
    gen = torch.Generator(device=device).manual_seed(spec.seed + 1)
    grid = run_grid(
        lambda n: layer_ms(layer, card, spec, n, gen), spec.sizes, spec.budget_s, progress
    )
    return make_record(card, spec, device, dtype, grid, "torch layer: median of repeats")


def _measure_with_vllm(
    card: ModelCard,
    spec: MeasureSpec,
    hf_config: str | None,
    layers: tuple[int, int],
    progress: Callable[[str], None],
) -> MeasurementRecord:
    grid, version = measure_vllm(card, spec, hf_config, layers, progress)
    device = torch.device("cuda")
    few, many = layers
    method = f"vLLM engine, dummy weights: ({many}-layer - {few}-layer time) / {many - few}"
    return make_record(card, spec, device, pick_dtype(spec.dtype, device), grid, method, version)
