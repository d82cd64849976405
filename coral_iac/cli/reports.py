"""Markdown reports shared by the CLI and the docs (one renderer, so docs match the command)."""

from __future__ import annotations

import statistics

from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import Catalog
from solver.performance.calibration import (
    CalibrationData,
    CalibrationFile,
    FileError,
    all_abs_rel_errors,
)
from solver.types import Phase


def calibration_markdown(
    rows: list[FileError],
    cal: CalibrationData,
    files: list[CalibrationFile],
    cards: dict[str, ModelCard],
    catalog: Catalog,
) -> str:
    """The calibration error table, pooled medians per phase and the fitted factors."""
    lines = [
        "# Performance model vs measured per-layer timings",
        "",
        "Regenerate: `coral profile calibrate --doc docs/calibration.md` "
        "(add `--write` to refit `solver/data/calibration.yaml`, and `--measured DIR` to fit to "
        "`coral profile measure` tables as well).",
        "",
        "The H100, A100-80GB and A40 factors, every GPU's GEMM latency and the NVLink all-reduce "
        "fits come from Vidur's measurements instead: their errors per GPU and TP degree, the "
        "leave-one-model-out check and the all-reduce fits are in "
        "[calibration-vidur.md](calibration-vidur.md) (`scripts/bench_calibration`).",
        "",
        f"Data: {cal.helix_fit.data}. Fitted on {cal.helix_fit.fitted_on} under the "
        f"`{cal.helix_fit.runtime}` runtime, performance model v{cal.perf_model_version}.",
        f"Fitted unknowns of the measurements: decode context {cal.decode_context_tokens:g} tokens, "
        f"prefill prompt length {cal.prefill_prompt_tokens:g} tokens.",
        "",
        "The files were measured under Helix's own runtime (eager vLLM 0.4, one engine step per "
        "layer), so the errors below use the `helix` runtime: the GPU factors plus its per-layer "
        "overhead fitted per GPU. Plans use the `vllm` runtime instead (same GPU factors, its own "
        "fixed costs). `coral profile explain` shows any layer's time by component (weight "
        "GEMMs, attention, all-reduce, overhead); see performance-model.md.",
        "",
        "| file | phase | points | median abs. rel. error | max abs. rel. error |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.phase} | {r.points} | {r.median_abs_rel_error:.1%} "
            f"| {r.max_abs_rel_error:.1%} |"
        )
    lines += [
        "",
        "| phase | all points | median abs. rel. error | target |",
        "|---|---:|---:|---:|",
    ]
    targets: tuple[tuple[Phase, str], ...] = (("decode", "15%"), ("prefill", "20%"))
    for phase, target in targets:
        errs = all_abs_rel_errors(files, cards, catalog, cal, phase)
        lines.append(f"| {phase} | {len(errs)} | {statistics.median(errs):.1%} | <= {target} |")
    return "\n".join([*lines, *_factor_lines(cal), *_runtime_lines(cal)]) + "\n"


def _factor_lines(cal: CalibrationData) -> list[str]:
    """Every GPU's factors and where they come from (own fit or derivation)."""
    resolved = cal.calibration()
    lines = [
        "",
        "GPU factors (fractions of the GPU's own datasheet peaks). A GPU without measurements "
        "takes a measured chip's factors through a derivation named here; none uses a default:",
        "",
        "| GPU | decode mem | decode compute | prefill compute | from |",
        "|---|---:|---:|---:|---|",
    ]
    for gpu, e in sorted(resolved.gpus.items()):
        origin = "own fit" if gpu in cal.gpus else f"derived from {cal.derived[gpu].from_gpu}"
        lines.append(
            f"| {gpu} | {e.decode_mem:.3f} | {e.decode_compute:.3f} | {e.prefill_compute:.3f} "
            f"| {origin} |"
        )
    return lines


def _runtime_lines(cal: CalibrationData) -> list[str]:
    """The runtimes' fixed costs: helix's fitted per GPU, the others' per layer and per step."""
    helix = cal.runtimes["helix"]
    lines = [
        "",
        "Runtime overheads (ms). `helix` (the runtime of the files above; fitted per GPU, per "
        "layer, since each layer is its own engine step):",
        "",
        "| GPU | decode per layer | prefill per layer |",
        "|---|---:|---:|",
    ]
    for gpu, o in sorted(helix.per_gpu.items()):
        lines.append(f"| {gpu} | {o.decode_layer_ms:.3f} | {o.prefill_layer_ms:.3f} |")
    lines += [
        "",
        "| runtime | decode per layer | prefill per layer | decode per stage pass | "
        "prefill per stage pass |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in sorted(cal.runtimes.items()):
        if r.decode_layer_ms is None or r.prefill_layer_ms is None:
            continue
        lines.append(
            f"| {name} | {r.decode_layer_ms:g} | {r.prefill_layer_ms:g} | {r.decode_step_ms:g} "
            f"| {r.prefill_step_ms:g} |"
        )
    return lines
