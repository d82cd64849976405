"""Benchmark the per-GPU GEMM and all-reduce fits on Vidur's measurements (issue #15).

Prints, as Markdown: the fitted factors per GPU; per GPU and TP degree the rows, median and worst
absolute relative error of the weight-GEMM prediction (target: median <= 10%); a leave-one-model-out
cross-validation per GPU and held-out model (target: median <= 15%); and the all-reduce fits per
topology and rank count. `--json` prints the same as JSON, `--yaml` the fit for
`solver/data/calibration.yaml`, `--no-latency` the plain roofline (no per-GEMM latency) to compare.

Run through `scripts/bench_calibration` (it sets up the environment first).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from solver.performance.vidur import (
    ErrorRow,
    VidurCalibration,
    calibrate,
    calibration_yaml,
    factors_of,
    leave_one_model_out,
    load_compute_rows,
    load_peaks,
    tp_errors,
)

TP_TARGET, LOMO_TARGET = 0.10, 0.15


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _error_table(title: str, key: str, rows: list[ErrorRow], target: float) -> list[str]:
    lines = [
        f"### {title}",
        "",
        f"| GPU | {key} | rows | median | worst | median <= {_pct(target)} |",
    ]
    lines.append("|---|---|---:|---:|---:|---|")
    for r in rows:
        ok = "yes" if r.median_abs_rel_error <= target else "NO"
        lines.append(
            f"| {r.gpu} | {r.group} | {r.rows} | {_pct(r.median_abs_rel_error)} "
            f"| {_pct(r.worst_abs_rel_error)} | {ok} |"
        )
    return [*lines, ""]


def _factor_table(cal: VidurCalibration) -> list[str]:
    lines = ["### Fitted GEMM factors per GPU", "", f"`{cal.gemm_form}`", ""]
    lines += ["| GPU | e_mem | e_cmp | latency per GEMM (ms) | bw (GB/s) | TFLOPS | rows |"]
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for gpu, c in cal.gpus.items():
        lines.append(
            f"| {gpu} | {c.e_mem:.3f} | {c.e_cmp:.3f} | {c.gemm_latency_ms:.4f} "
            f"| {c.peak_memory_bandwidth_gb_s:g} | {c.peak_dense_tflops:g} | {c.rows} |"
        )
    return [*lines, ""]


def _allreduce_table(cal: VidurCalibration) -> list[str]:
    lines = ["### All-reduce fits (intra-node rows)", "", f"`{cal.allreduce_form}`", ""]
    lines += ["| topology | n | latency (ms) | busbw (GB/s) | rows | median | worst |"]
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for topology, fits in cal.allreduce.items():
        for n, f in fits.items():
            lines.append(
                f"| {topology} | {n} | {f.latency_ms:.4f} | {f.bus_bandwidth_gb_s:.1f} | {f.rows} "
                f"| {_pct(f.median_abs_rel_error)} | {_pct(f.worst_abs_rel_error)} |"
            )
    return [*lines, ""]


def _report(latency: bool) -> tuple[VidurCalibration, list[ErrorRow], list[ErrorRow]]:
    rows = load_compute_rows()
    peaks = load_peaks()
    cal = calibrate(latency=latency)
    return cal, tp_errors(rows, peaks, factors_of(cal)), leave_one_model_out(rows, peaks, latency)


def main(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON, not Markdown.")] = False,
    as_yaml: Annotated[bool, typer.Option("--yaml", help="Print the fit as YAML.")] = False,
    no_latency: Annotated[
        bool, typer.Option("--no-latency", help="Fit the plain roofline (no per-GEMM latency).")
    ] = False,
) -> None:
    """Fit Vidur's files and print the factors and errors."""
    cal, per_tp, lomo = _report(latency=not no_latency)
    if as_yaml:
        print(calibration_yaml(cal), end="")
        return
    if as_json:
        out: dict[str, Any] = {
            "calibration": cal.model_dump(mode="json"),
            "per_gpu_tp": [r.model_dump() for r in per_tp],
            "leave_one_model_out": [r.model_dump() for r in lomo],
        }
        print(json.dumps(out, indent=2))
        return
    form = "plain roofline" if no_latency else "roofline + per-GEMM latency"
    lines = [f"## Vidur calibration ({form})", "", f"Source: {cal.source}", ""]
    lines += _factor_table(cal)
    lines += _error_table("GEMM error per GPU and TP degree", "TP", per_tp, TP_TARGET)
    lines += _error_table("Leave-one-model-out", "held-out model", lomo, LOMO_TARGET)
    lines += _allreduce_table(cal)
    print("\n".join(lines))


if __name__ == "__main__":
    typer.run(main)
