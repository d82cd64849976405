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
        f"Data: {cal.data}. Fitted on {cal.fitted_on}, performance model v{cal.perf_model_version}.",
        f"Fitted unknowns of the measurements: decode context {cal.decode_context_tokens:g} tokens, "
        f"prefill prompt length {cal.prefill_prompt_tokens:g} tokens.",
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
    lines += [
        "",
        "Fitted factors (fractions of datasheet peaks; overheads in ms per layer):",
        "",
        "| GPU | decode mem | decode compute | decode overhead | prefill compute | "
        "prefill overhead |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for gpu, e in [*sorted(cal.gpus.items()), ("default (others)", cal.default)]:
        lines.append(
            f"| {gpu} | {e.decode_mem:.3f} | {e.decode_compute:.3f} | "
            f"{e.decode_overhead_ms:.3f} | {e.prefill_compute:.3f} | "
            f"{e.prefill_overhead_ms:.3f} |"
        )
    return "\n".join(lines) + "\n"
