"""Write the Vidur fits into `solver/data/calibration.yaml`: each measured GPU's own factors
(h100, a100-80gb, a40), the GEMM latency of the Helix-fitted GPUs (derived, with why), the
NVLink all-reduce fits per TP, and the attention and elementwise kernels (`kernels`). Run `coral profile calibrate --write` after it, so the Helix
per-layer overheads are refitted on top of the GEMM latencies. Usage: scripts/apply_vidur_fit.py
"""

from __future__ import annotations

from solver.io import data_path
from solver.performance.analytical import AllReduceFit
from solver.performance.calibration import (
    CalibrationData,
    GpuFactors,
    Interconnect,
    KernelDerivation,
    KernelFit,
    Kernels,
    dump_calibration,
    load_calibration,
)
from solver.performance.kernel_fit import ATTENTION_GPU, KernelCalibration, calibrate_kernels
from solver.performance.kernel_fit import SOURCE as KERNEL_SOURCE
from solver.performance.vidur import SOURCE, VidurCalibration, calibrate

TOPOLOGY = {"nvlink-h100": "h100_dgx", "nvlink-a100": "a100_dgx"}  # 8-GPU NVSwitch nodes
# The Helix-fitted GPUs' GEMM latency: no per-GEMM measurement of their own, so the nearest
# Vidur-measured chip's, and why.
LATENCY_FROM = {
    "a100-40gb": ("a100-80gb", "same GA100 chip (Ampere), measured on the 80 GB part"),
    "l4": ("a40", "nearest measured PCIe GDDR6 card (GA102, the generation before the L4's AD104)"),
    "t4": ("a40", "nearest measured PCIe GDDR6 card (no Turing GEMM timings exist here)"),
}

# GPUs whose kernels nobody timed: the nearest timed chip's factors, as fractions of their own peaks.
KERNELS_FROM = {
    "a100-40gb": ("a100-80gb", "same GA100 chip (Ampere), timed on the 80 GB part"),
    "v100": ("a100-80gb", "no Volta timings; GA100 is GV100's datacenter successor (HBM2, SXM)"),
    "a10g": ("a40", "same GA102 chip (Ampere)"),
    "l4": ("a40", "nearest timed PCIe GDDR6 card (GA102, the generation before the L4's AD104)"),
    "l40s": ("a40", "nearest timed PCIe GDDR6 card (GA102, the generation before AD102)"),
    "t4": ("a40", "nearest timed PCIe GDDR6 card (no Turing kernel timings exist here)"),
}


def kernels_section(fit: KernelCalibration) -> Kernels:
    """Attention measured on A100-80GB only (Vidur's attention file), so every timed GPU takes
    its fractions of peak; elementwise is each timed GPU's own."""
    pre, dec = fit.attention_prefill, fit.attention_decode
    gpus = {}
    for gpu, elem in sorted(fit.elementwise.items()):
        attention = "fitted" if gpu == ATTENTION_GPU else f"{ATTENTION_GPU}'s fractions of peak"
        gpus[gpu] = KernelFit(
            attention_prefill_compute=round(pre.efficiency, 4),
            attention_prefill_latency_ms=round(pre.latency_ms, 5),
            attention_decode_mem=round(dec.efficiency, 4),
            attention_decode_latency_ms=round(dec.latency_ms, 5),
            elementwise_mem=round(elem.efficiency, 4),
            elementwise_latency_ms=round(elem.latency_ms, 5),
            source=f"attention: {attention} ({pre.rows} prefill, {dec.rows} decode rows); "
            f"elementwise: fitted on {elem.rows} rows (median error {elem.median_abs_rel_error:.1%})",
        )
    errors = {
        "attention_prefill": round(pre.median_abs_rel_error, 4),
        "attention_decode": round(dec.median_abs_rel_error, 4),
        **{f"elementwise_{g}": round(e.median_abs_rel_error, 4) for g, e in fit.elementwise.items()},
    }
    return Kernels(
        source=f"fit: {KERNEL_SOURCE} (solver/performance/kernel_fit.py)",
        fit_median_abs_rel_error=errors,
        gpus=gpus,
        derived={g: KernelDerivation(from_gpu=src, why=why) for g, (src, why) in KERNELS_FROM.items()},
    )


def with_vidur(data: CalibrationData, fit: VidurCalibration) -> CalibrationData:
    gpus = dict(data.gpus)
    for gpu, g in fit.gpus.items():
        gpus[gpu] = GpuFactors(
            decode_mem=round(g.e_mem, 4),
            decode_compute=round(g.e_cmp, 4),
            prefill_compute=round(g.e_cmp, 4),
            gemm_latency_ms=round(g.gemm_latency_ms, 5),
            source=f"fit: {SOURCE}; {g.rows} GEMM rows of {len(g.models)} model shapes at TP "
            f"1-8, median error {g.median_abs_rel_error:.1%} (scripts/bench_calibration)",
            gemm_latency_source="fitted with the factors on the same rows",
        )
    for gpu, (src, why) in LATENCY_FROM.items():
        gpus[gpu] = gpus[gpu].model_copy(
            update={
                "gemm_latency_ms": round(fit.gpus[src].gemm_latency_ms, 5),
                "gemm_latency_source": f"derived from {src} (Vidur): {why}",
            }
        )
    allreduce = dict(data.allreduce)
    for key, topo in TOPOLOGY.items():
        fits = fit.allreduce[topo]
        allreduce[key] = Interconnect(
            source=f"fit: {SOURCE}, network_{topo}_all_reduce.csv (intra-node rows)",
            note="alpha-beta per rank count; median errors "
            + ", ".join(f"TP {n}: {f.median_abs_rel_error:.1%}" for n, f in sorted(fits.items())),
            tp={
                n: AllReduceFit(
                    latency_ms=round(f.latency_ms, 5), bus_bandwidth_gb_s=round(f.bus_bandwidth_gb_s, 1)
                )
                for n, f in sorted(fits.items())
            },
        )
    derived = {g: d for g, d in data.derived.items() if g not in fit.gpus}
    return data.model_copy(update={"gpus": dict(sorted(gpus.items())), "derived": derived,
                                   "allreduce": allreduce})  # fmt: skip


def with_kernels(data: CalibrationData, fit: KernelCalibration) -> CalibrationData:
    return data.model_copy(update={"kernels": kernels_section(fit)})


def main() -> None:
    path = data_path("calibration.yaml")
    data = with_kernels(with_vidur(load_calibration(), calibrate()), calibrate_kernels())
    path.write_text(dump_calibration(data), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
