"""Vidur's measured GEMM and all-reduce timings: loaders, the roofline GEMM prediction and fits.

The vendored files (`solver/data/calibration/vidur/`, MIT, see its README) time one layer's weight
GEMMs on one rank of a TP group (A100-80GB, H100, A40) and NCCL all-reduce on NVLink nodes. This
module fits, per GPU, the efficiency factors of the same GEMM roofline the analytical model uses,

    gemm_ms = GEMMS_PER_LAYER * latency_ms + smax(W / tp / (bw*e_mem), 2*tokens*P / tp / (tf*e_cmp))

with smax the smooth roofline `(a^2 + b^2)^(1/2)` (`analytical.smooth_roofline`), P the layer's GEMM
parameters (QKV + O + MLP), W = 2*P bytes (fp16/bf16), bw/tf the datasheet
peaks. The fixed per-GEMM latency is the ONE term added to the analytical form: without it the
small-token rows (kernel launch and tail latency) push H100's median error to 11-15% per TP (6-7%
with it), and every GPU's fitted e_mem collapses to 0.47-0.60 because the bandwidth factor absorbs
the latency (`scripts/bench_calibration --no-latency` shows both). All-reduce is fitted
per topology and rank count as `latency_ms + 2*(n-1)/n * size / bus_bw` (NCCL's ring factor).
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml
from pydantic import BaseModel, Field
from scipy.optimize import minimize

from solver.catalog.offers import GpuFile
from solver.errors import InputError
from solver.io import data_path, load_yaml_model
from solver.performance.analytical import GEMMS_PER_LAYER, smooth_roofline
from solver.types import FROZEN

SOURCE = (
    "microsoft/vidur commit 7d47513363ec447a741ac5e47241580b47724fbf (2024-11-19), "
    "data/profiling/ (MIT); vendored in solver/data/calibration/vidur/"
)
GEMM_FORM = (
    "gemm_ms = gemms_per_layer * gemm_latency_ms + 1e3 * smax(2*P / tp / (bw*e_mem), "
    "2*tokens*P / tp / (tf*e_cmp)); P = h*(h + 2*kv_heads*head_dim) + h*h + (3 if gated else 2)"
    "*h*ffn; bw in B/s, tf in FLOP/s (datasheet peaks)"
)
ALLREDUCE_FORM = "all_reduce_ms = latency_ms + 1e3 * 2*(n-1)/n * size_bytes / (bus_bw_gb_s*1e9)"
SKU_TO_GPU = {"a100": "a100-80gb", "h100": "h100", "a40": "a40"}
WEIGHT_GEMM_COLUMNS = (
    "attn_pre_proj_ms",
    "attn_post_proj_ms",
    "mlp_up_proj_ms",
    "mlp_down_proj_ms",
)
ELEMENTWISE_COLUMNS = (
    "input_layernorm_ms",
    "attn_rope_ms",
    "mlp_act_ms",
    "post_attention_layernorm_ms",
    "add_ms",
)
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp")
COMPUTE_COLUMNS = (*SHAPE_COLUMNS, "num_tokens", "num_tensor_parallel_workers")
ALLREDUCE_COLUMNS = ("num_workers", "size", "devices_per_node", "all_reduce_ms")
BYTES_PER_PARAM = 2  # fp16 / bf16 weights, as Vidur measured
FloatArray = npt.NDArray[np.float64]


def vidur_dir() -> Path:
    """The vendored Vidur folder shipped in `solver/data/calibration/vidur/`."""
    return data_path("calibration/vidur")


class LayerShape(BaseModel):
    """A transformer layer's shape as Vidur records it (full model, before TP sharding)."""

    model_config = FROZEN
    n_head: int = Field(gt=0, description="Attention (query) heads.")
    n_kv_head: int = Field(gt=0, description="KV heads (GQA when fewer than n_head).")
    n_embd: int = Field(gt=0, description="Hidden size h.")
    n_expanded_embd: int = Field(gt=0, description="MLP intermediate size (ffn).")
    use_gated_mlp: bool = Field(description="Gated MLP (SwiGLU: up and gate projections).")

    @property
    def gemm_params(self) -> int:
        """Weight-GEMM parameters of one layer: QKV, O and the MLP projections."""
        h = self.n_embd
        head_dim = h // self.n_head
        qkv = h * (h + 2 * self.n_kv_head * head_dim)
        mlp = (3 if self.use_gated_mlp else 2) * h * self.n_expanded_embd
        return qkv + h * h + mlp


@dataclass(frozen=True)
class ComputeRow:
    """One measured batch: a layer's weight GEMMs on one rank at a TP degree."""

    gpu: str
    model: str
    shape: LayerShape
    num_tokens: int
    tp: int
    gemm_ms: float
    elementwise_ms: float


@dataclass(frozen=True)
class AllReduceRow:
    """One measured NCCL all-reduce of `size_bytes` over `n` ranks."""

    topology: str
    n: int
    devices_per_node: int
    size_bytes: float
    ms: float


class GpuPeak(BaseModel):
    """The datasheet peaks a GPU's factors are fractions of."""

    model_config = FROZEN
    memory_bandwidth_gb_s: float = Field(gt=0, description="Memory bandwidth, GB/s.")
    dense_tflops: float = Field(gt=0, description="Dense BF16/FP16 tensor TFLOPS.")
    source: str = Field(description="Where the peaks come from.")


class GemmFactors(BaseModel):
    """Fitted fractions of the peaks, and the fixed latency of one GEMM launch."""

    model_config = FROZEN
    e_mem: float = Field(gt=0, le=1.2, description="Fraction of memory bandwidth.")
    e_cmp: float = Field(gt=0, le=1.2, description="Fraction of dense tensor TFLOPS.")
    gemm_latency_ms: float = Field(ge=0, description="Fixed time per GEMM (4 per layer), ms.")


def _open_csv(path: Path, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """Rows of a headed CSV with their line numbers; a missing column or cell is an InputError."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(str(path), f"cannot read file ({exc.strerror})", "check the path") from exc
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in required if c not in (reader.fieldnames or [])]
    if missing:
        raise InputError(f"{path}:1", f"header lacks columns {missing}", "use Vidur's header")
    rows: list[tuple[int, dict[str, str]]] = []
    for line_no, row in enumerate(reader, start=2):
        if None in row or any(row.get(c) in (None, "") for c in reader.fieldnames or []):
            raise InputError(
                f"{path}:{line_no}",
                f"expected {len(reader.fieldnames or [])} cells, got {dict(row)}",
                "give every column a value, as the header lists",
            )
        rows.append((line_no, row))
    return rows


def _cell(path: Path, line_no: int, row: dict[str, str], column: str, kind: type[Any]) -> Any:
    """One typed cell; a value that does not parse is an InputError naming file, line, column."""
    raw = row[column]
    if kind is bool:
        if raw not in ("True", "False"):
            raise InputError(f"{path}:{line_no}", f"{column}={raw!r} is not True/False", "fix it")
        return raw == "True"
    try:
        value = kind(raw)
    except ValueError as exc:
        raise InputError(
            f"{path}:{line_no}", f"{column}={raw!r} is not a {kind.__name__}", "write a number"
        ) from exc
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{path}:{line_no}", f"{column}={raw!r} is negative or not finite", "fix")
    return value


def _compute_row(path: Path, line_no: int, row: dict[str, str], gpu: str, model: str) -> ComputeRow:
    shape = LayerShape(
        **{
            c: _cell(path, line_no, row, c, bool if c == "use_gated_mlp" else int)
            for c in SHAPE_COLUMNS
        }
    )
    return ComputeRow(
        gpu=gpu,
        model=model,
        shape=shape,
        num_tokens=_cell(path, line_no, row, "num_tokens", int),
        tp=_cell(path, line_no, row, "num_tensor_parallel_workers", int),
        gemm_ms=sum(_cell(path, line_no, row, c, float) for c in WEIGHT_GEMM_COLUMNS),
        elementwise_ms=sum(
            _cell(path, line_no, row, c, float) for c in ELEMENTWISE_COLUMNS if c in row
        ),
    )


def load_compute_file(path: Path) -> list[ComputeRow]:
    """Load one `compute_<sku>_<model>_mlp.csv` file, the SKU mapped to our catalog's GPU id.

    Args:
        path: the file; its name gives the SKU and the model.

    Returns:
        One row per measurement, in file order.

    Raises:
        InputError: naming the file for an unknown SKU or name, or file and line for a bad row.
    """
    parts = path.stem.split("_")
    if len(parts) < 4 or parts[0] != "compute" or parts[-1] != "mlp":
        raise InputError(str(path), "name is not compute_<sku>_<model>_mlp.csv", "rename it")
    sku, model = parts[1], "_".join(parts[2:-1])
    if sku not in SKU_TO_GPU:
        raise InputError(str(path), f"unknown SKU '{sku}'", f"use one of {sorted(SKU_TO_GPU)}")
    # Elementwise columns are summed where present (Phi-2's parallel block has no second norm).
    required = (*COMPUTE_COLUMNS, *WEIGHT_GEMM_COLUMNS)
    return [
        _compute_row(path, line_no, row, SKU_TO_GPU[sku], model)
        for line_no, row in _open_csv(path, required)
    ]


def load_allreduce_file(path: Path) -> list[AllReduceRow]:
    """Load one `network_<topology>_all_reduce.csv` file.

    Args:
        path: the file; its name gives the topology (`h100_dgx`, `a100_pairwise_nvlink`, ...).

    Returns:
        One row per measurement (all ranks counts, intra- and inter-node).

    Raises:
        InputError: naming the file for a bad name, or file and line for a bad row.
    """
    name = path.stem
    if not (name.startswith("network_") and name.endswith("_all_reduce")):
        raise InputError(str(path), "name is not network_<topology>_all_reduce.csv", "rename it")
    topology = name.removeprefix("network_").removesuffix("_all_reduce")
    return [
        AllReduceRow(
            topology=topology,
            n=_cell(path, line_no, row, "num_workers", int),
            devices_per_node=_cell(path, line_no, row, "devices_per_node", int),
            size_bytes=_cell(path, line_no, row, "size", float),
            ms=_cell(path, line_no, row, "all_reduce_ms", float),
        )
        for line_no, row in _open_csv(path, ALLREDUCE_COLUMNS)
    ]


def load_compute_rows(directory: Path | None = None) -> list[ComputeRow]:
    """Every compute file of the Vidur folder (the vendored one by default), sorted by name."""
    folder = directory or vidur_dir()
    return [r for p in sorted(folder.glob("compute_*.csv")) for r in load_compute_file(p)]


def load_allreduce_rows(directory: Path | None = None) -> list[AllReduceRow]:
    """Every all-reduce file of the Vidur folder (the vendored one by default), sorted by name."""
    folder = directory or vidur_dir()
    return [
        r for p in sorted(folder.glob("network_*_all_reduce.csv")) for r in load_allreduce_file(p)
    ]


def load_peaks(gpus_path: Path | None = None) -> dict[str, GpuPeak]:
    """Datasheet peaks of every GPU Vidur measured, from the catalog's `gpus.yaml` (the A40 is
    there as a reference chip that no offer sells), so the fit and the model use one number.

    Raises:
        InputError: when a measured GPU has no entry in the file.
    """
    path = gpus_path or data_path("gpus.yaml")
    catalog = load_yaml_model(GpuFile, path).gpus
    peaks: dict[str, GpuPeak] = {}
    for gpu in SKU_TO_GPU.values():
        if gpu not in catalog:
            raise InputError(f"{path}: gpus.{gpu}", "no datasheet peaks", "add them with a source")
        entry = catalog[gpu]
        peaks[gpu] = GpuPeak(
            memory_bandwidth_gb_s=entry.memory_bandwidth_gb_s,
            dense_tflops=entry.dense_tflops,
            source=entry.source,
        )
    return peaks


def gemm_ms_array(
    params: FloatArray, tokens: FloatArray, tp: FloatArray, peak: GpuPeak, factors: GemmFactors
) -> FloatArray:
    """The analytical model's GEMM time of one layer on one rank, for arrays of rows (ms).

    Same form as `t_gemm` in `analytical.decode_layer_ms`/`prefill_layer_ms`, plus the fixed
    latency of the layer's four GEMMs.

    Args:
        params: the layer's GEMM parameters P (whole model, before sharding).
        tokens: tokens in the batch.
        tp: tensor-parallel degree (P is split over it).
        peak: the GPU's datasheet peaks.
        factors: the fractions of the peaks reached, and the per-GEMM latency.

    Returns:
        Milliseconds per row.
    """
    bw = peak.memory_bandwidth_gb_s * 1e9 * factors.e_mem
    tf = peak.dense_tflops * 1e12 * factors.e_cmp
    t_mem = BYTES_PER_PARAM * params / tp / bw
    t_cmp = 2 * tokens * params / tp / tf
    result: FloatArray = (
        GEMMS_PER_LAYER * factors.gemm_latency_ms + smooth_roofline(t_mem, t_cmp) * 1e3
    )
    return result


def predict_gemm_ms(
    shape: LayerShape, tokens: float, tp: int, peak: GpuPeak, factors: GemmFactors
) -> float:
    """One layer's weight-GEMM time on one rank (ms): `gemm_ms_array` for one row.

    Args:
        shape: the layer's shape.
        tokens: tokens in the batch.
        tp: tensor-parallel degree.
        peak: the GPU's datasheet peaks.
        factors: fitted factors.

    Returns:
        Milliseconds.
    """
    one = np.array([float(shape.gemm_params)]), np.array([float(tokens)]), np.array([float(tp)])
    return float(gemm_ms_array(*one, peak, factors)[0])


def _arrays(rows: Sequence[ComputeRow]) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    return (
        np.array([r.shape.gemm_params for r in rows], dtype=np.float64),
        np.array([r.num_tokens for r in rows], dtype=np.float64),
        np.array([r.tp for r in rows], dtype=np.float64),
        np.array([r.gemm_ms for r in rows], dtype=np.float64),
    )


def _factors(x: Sequence[float], latency: bool) -> GemmFactors:
    e_mem, e_cmp = (min(math.exp(v), 1.2) for v in x[:2])
    return GemmFactors(e_mem=e_mem, e_cmp=e_cmp, gemm_latency_ms=math.exp(x[2]) if latency else 0.0)


def _minimise(loss: Callable[[FloatArray], float], x0: list[float]) -> list[float]:
    """Deterministic Nelder-Mead from a fixed start (no randomness anywhere)."""
    opts = {"xatol": 1e-7, "fatol": 1e-10, "maxiter": 20000, "maxfev": 20000}
    res = minimize(loss, np.array(x0), method="Nelder-Mead", options=opts)
    return [float(v) for v in res.x]


def fit_gemm(rows: Sequence[ComputeRow], peak: GpuPeak, latency: bool = True) -> GemmFactors:
    """Fit (e_mem, e_cmp[, per-GEMM latency]) minimising the mean absolute log error.

    Args:
        rows: one GPU's measured rows.
        peak: that GPU's datasheet peaks.
        latency: fit the fixed per-GEMM latency (else the plain roofline, latency 0).

    Returns:
        The fitted factors (each efficiency capped at 1.2).

    Raises:
        InputError: when no rows are given.
    """
    if not rows:
        raise InputError("vidur.compute", "no rows to fit", "give at least one measured row")
    params, tokens, tp, measured = _arrays(rows)
    log_measured = np.log(measured)

    def loss(x: FloatArray) -> float:
        pred = gemm_ms_array(params, tokens, tp, peak, _factors(list(x), latency))
        return float(np.mean(np.abs(np.log(pred) - log_measured)))

    x0 = [math.log(0.7), math.log(0.7)] + ([math.log(0.01)] if latency else [])
    return _factors(_minimise(loss, x0), latency)


def abs_rel_errors(rows: Sequence[ComputeRow], peak: GpuPeak, factors: GemmFactors) -> list[float]:
    """|predicted / measured - 1| for each row."""
    params, tokens, tp, measured = _arrays(rows)
    pred = gemm_ms_array(params, tokens, tp, peak, factors)
    return [float(e) for e in np.abs(pred / measured - 1.0)]


class ErrorRow(BaseModel):
    """Median and worst absolute relative error over a group of rows."""

    model_config = FROZEN
    gpu: str = Field(description="GPU id (catalog naming) or topology.")
    group: str = Field(description="What the rows share: 'tp=2', a held-out model, 'n=8'.")
    rows: int = Field(ge=0, description="Rows in the group.")
    median_abs_rel_error: float = Field(ge=0)
    worst_abs_rel_error: float = Field(ge=0)


def _error_row(gpu: str, group: str, errors: Sequence[float]) -> ErrorRow:
    return ErrorRow(
        gpu=gpu,
        group=group,
        rows=len(errors),
        median_abs_rel_error=statistics.median(errors),
        worst_abs_rel_error=max(errors),
    )


def by_gpu(rows: Sequence[ComputeRow]) -> dict[str, list[ComputeRow]]:
    """Rows grouped by GPU id, in first-seen order."""
    out: dict[str, list[ComputeRow]] = {}
    for r in rows:
        out.setdefault(r.gpu, []).append(r)
    return out


def tp_errors(
    rows: Sequence[ComputeRow], peaks: dict[str, GpuPeak], factors: dict[str, GemmFactors]
) -> list[ErrorRow]:
    """Per (GPU, TP degree): rows, median and worst error of the fitted prediction."""
    out = []
    for gpu, gpu_rows in by_gpu(rows).items():
        for tp in sorted({r.tp for r in gpu_rows}):
            group = [r for r in gpu_rows if r.tp == tp]
            out.append(_error_row(gpu, f"tp={tp}", abs_rel_errors(group, peaks[gpu], factors[gpu])))
    return out


def leave_one_model_out(
    rows: Sequence[ComputeRow], peaks: dict[str, GpuPeak], latency: bool = True
) -> list[ErrorRow]:
    """Per GPU and held-out model: fit on the GPU's other models, errors on the held-out one.

    Args:
        rows: measured rows of every GPU.
        peaks: datasheet peaks per GPU.
        latency: whether the fit includes the per-GEMM latency term.

    Returns:
        One row per (GPU, held-out model), for GPUs measured on at least two models.
    """
    out = []
    for gpu, gpu_rows in by_gpu(rows).items():
        models = sorted({r.model for r in gpu_rows})
        for held in models if len(models) > 1 else []:
            train = [r for r in gpu_rows if r.model != held]
            test = [r for r in gpu_rows if r.model == held]
            factors = fit_gemm(train, peaks[gpu], latency)
            out.append(_error_row(gpu, held, abs_rel_errors(test, peaks[gpu], factors)))
    return out


def allreduce_ms_array(
    size_bytes: FloatArray, n: int, latency_ms: float, bus_bw_gb_s: float
) -> FloatArray:
    """NCCL ring all-reduce time (ms): latency + 2(n-1)/n * size / bus bandwidth.

    Args:
        size_bytes: message sizes.
        n: ranks taking part.
        latency_ms: fixed cost of one all-reduce.
        bus_bw_gb_s: NCCL's bus bandwidth (busbw), GB/s.

    Returns:
        Milliseconds per size.
    """
    ring = 2 * (n - 1) / n
    result: FloatArray = latency_ms + ring * size_bytes / (bus_bw_gb_s * 1e9) * 1e3
    return result


class AllReduceFit(BaseModel):
    """Fitted alpha-beta all-reduce cost of one topology at one rank count."""

    model_config = FROZEN
    latency_ms: float = Field(gt=0, description="Fixed cost of one all-reduce, ms.")
    bus_bandwidth_gb_s: float = Field(gt=0, description="NCCL busbw, GB/s (ring factor apart).")
    rows: int = Field(gt=0, description="Intra-node measurements fitted.")
    median_abs_rel_error: float = Field(ge=0)
    worst_abs_rel_error: float = Field(ge=0)


def fit_allreduce(rows: Sequence[AllReduceRow]) -> AllReduceFit:
    """Fit latency and bus bandwidth to rows of one rank count (mean absolute log error).

    Args:
        rows: measurements of one topology and one `n`.

    Returns:
        The fit with its errors on the same rows.

    Raises:
        InputError: when the rows are empty or mix rank counts.
    """
    counts = {r.n for r in rows}
    if len(counts) != 1:
        raise InputError("vidur.all_reduce", f"rank counts {sorted(counts)}", "fit one n at a time")
    n = counts.pop()
    size = np.array([r.size_bytes for r in rows], dtype=np.float64)
    measured = np.array([r.ms for r in rows], dtype=np.float64)

    def loss(x: FloatArray) -> float:
        pred = allreduce_ms_array(size, n, math.exp(x[0]), math.exp(x[1]))
        return float(np.mean(np.abs(np.log(pred / measured))))

    lat, bw = (math.exp(v) for v in _minimise(loss, [math.log(0.02), math.log(100.0)]))
    errors = np.abs(allreduce_ms_array(size, n, lat, bw) / measured - 1.0)
    return AllReduceFit(
        latency_ms=lat,
        bus_bandwidth_gb_s=bw,
        rows=len(rows),
        median_abs_rel_error=float(np.median(errors)),
        worst_abs_rel_error=float(errors.max()),
    )


def fit_allreduce_all(rows: Sequence[AllReduceRow]) -> dict[str, dict[int, AllReduceFit]]:
    """Fits per topology and rank count, on intra-node rows only (TP stays inside a node).

    Args:
        rows: all-reduce rows of any topologies; inter-node rows are left out.

    Returns:
        `{topology: {n: fit}}`, sorted.
    """
    groups: dict[tuple[str, int], list[AllReduceRow]] = {}
    for r in rows:
        if r.devices_per_node == r.n:
            groups.setdefault((r.topology, r.n), []).append(r)
    out: dict[str, dict[int, AllReduceFit]] = {}
    for topology, n in sorted(groups):
        out.setdefault(topology, {})[n] = fit_allreduce(groups[topology, n])
    return out


class GpuGemmCalibration(BaseModel):
    """One GPU's fitted GEMM factors, ready for `solver/data/calibration.yaml`."""

    model_config = FROZEN
    e_mem: float = Field(gt=0, le=1.2, description="Fraction of memory bandwidth.")
    e_cmp: float = Field(gt=0, le=1.2, description="Fraction of dense tensor TFLOPS.")
    gemm_latency_ms: float = Field(ge=0, description="Fixed time per weight GEMM, ms.")
    gemms_per_layer: int = Field(default=GEMMS_PER_LAYER, description="QKV, O, MLP up, down.")
    peak_memory_bandwidth_gb_s: float = Field(gt=0)
    peak_dense_tflops: float = Field(gt=0)
    peak_source: str
    models: list[str] = Field(description="Model shapes measured (compute file names).")
    rows: int = Field(gt=0, description="Measured rows fitted.")
    median_abs_rel_error: float = Field(ge=0)
    worst_abs_rel_error: float = Field(ge=0)


class VidurCalibration(BaseModel):
    """Everything fitted from the Vidur files: GEMM factors per GPU, all-reduce per topology."""

    model_config = FROZEN
    source: str = SOURCE
    gemm_form: str = GEMM_FORM
    allreduce_form: str = ALLREDUCE_FORM
    gpus: dict[str, GpuGemmCalibration]
    allreduce: dict[str, dict[int, AllReduceFit]]


def gpu_calibration(
    rows: Sequence[ComputeRow], peak: GpuPeak, latency: bool = True
) -> GpuGemmCalibration:
    """Fit one GPU's rows and record the factors with their peaks, source and errors."""
    factors = fit_gemm(rows, peak, latency)
    errors = abs_rel_errors(rows, peak, factors)
    return GpuGemmCalibration(
        **factors.model_dump(),
        peak_memory_bandwidth_gb_s=peak.memory_bandwidth_gb_s,
        peak_dense_tflops=peak.dense_tflops,
        peak_source=peak.source,
        models=sorted({r.model for r in rows}),
        rows=len(rows),
        median_abs_rel_error=statistics.median(errors),
        worst_abs_rel_error=max(errors),
    )


def calibrate(directory: Path | None = None, latency: bool = True) -> VidurCalibration:
    """Load the Vidur folder (the vendored one by default) and fit everything.

    Args:
        directory: a folder laid out like `solver/data/calibration/vidur/`.
        latency: whether the GEMM fit includes the per-GEMM latency term.

    Returns:
        The YAML-ready fit (`calibration_yaml` renders it).
    """
    peaks = load_peaks()
    gpus = {
        gpu: gpu_calibration(gpu_rows, peaks[gpu], latency)
        for gpu, gpu_rows in sorted(by_gpu(load_compute_rows(directory)).items())
    }
    return VidurCalibration(gpus=gpus, allreduce=fit_allreduce_all(load_allreduce_rows(directory)))


def factors_of(cal: VidurCalibration) -> dict[str, GemmFactors]:
    """The fitted GEMM factors per GPU, as `gemm_ms_array` takes them."""
    return {
        gpu: GemmFactors(e_mem=c.e_mem, e_cmp=c.e_cmp, gemm_latency_ms=c.gemm_latency_ms)
        for gpu, c in cal.gpus.items()
    }


def calibration_yaml(cal: VidurCalibration, digits: int = 4) -> str:
    """The fit as YAML text (floats to `digits` significant digits, rank counts as int keys)."""

    def rounded(value: Any) -> Any:
        if isinstance(value, float):
            return float(f"{value:.{digits}g}")
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return value

    return yaml.safe_dump({"vidur": rounded(cal.model_dump())}, sort_keys=False, width=100)
