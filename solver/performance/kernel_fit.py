"""Fit the attention and elementwise kernels of the layer model to Vidur's operator timings.

Data (vendored, MIT, each folder's README says where from):

- `solver/data/calibration/vidur-sim/attention.csv`: Vidur's FlashAttention timings for
  Llama-2-70B's attention shape (64 query heads, 8 KV heads, hidden 8192) at TP 2 on A100-80GB:
  prefill chunks of 64-4096 tokens after 0-4096 cached tokens, decode batches of 1-128 sequences
  at 32-4096 cached tokens. The time of one kernel call is `attn_prefill` or `attn_decode` plus the
  input and output reshapes around it (medians of the repeats).
- `solver/data/calibration/vidur/compute_*.csv`: the elementwise kernels of one layer (two norms,
  rotary embedding, MLP activation, residual add) for five model shapes at TP 1-8 on A100-80GB,
  H100 and A40.

Forms (as `solver.performance.analytical.layer_breakdown` uses them):

    prefill attention = latency + 4 * tokens * (cached + chunk) * heads * hd / tp / (tf * e)
    decode attention  = latency + batch * cached * kv_bytes_per_token / min(tp, kv_heads) / (bw * e)
    elementwise       = 5 * latency + tokens * elementwise_bytes_per_token / (bw * e)

Each minimises squared log error (relative error), as the GEMM and Helix fits do.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from solver.errors import InputError
from solver.io import data_path
from solver.performance.analytical import ELEMENTWISE_KERNELS
from solver.performance.vidur import ComputeRow, GpuPeak, load_compute_rows, load_peaks

ATTENTION_SHAPE = {"n_embd": 8192, "n_q_head": 64, "n_kv_head": 8, "tp": 2}  # Llama-2-70B
ATTENTION_GPU = "a100-80gb"
SOURCE = (
    "microsoft/vidur (MIT): data/profiling attention.csv (Llama-2-70B shape, TP 2, A100-80GB; "
    "solver/data/calibration/vidur-sim/) and compute_*_mlp.csv elementwise columns "
    "(solver/data/calibration/vidur/)"
)


def vidur_sim_dir() -> Path:
    """The vendored Vidur profiling set for Llama-2-70B on A100-80GB (what Vidur itself reads)."""
    return data_path("calibration/vidur-sim")


@dataclass(frozen=True)
class AttentionRow:
    """One timed attention call on one GPU (TP 2 shard of the Llama-2-70B shape)."""

    prefill: bool
    batch: int
    chunk: int  # prefill tokens in the call (0 for decode)
    cached: int  # tokens already in the KV cache per sequence
    ms: float


def load_attention_rows(path: Path | None = None) -> list[AttentionRow]:
    """Vidur's attention timings (medians), input and output reshapes included.

    Raises:
        InputError: naming the file and line for a missing or non-numeric cell.
    """
    path = path or vidur_sim_dir() / "attention.csv"
    try:
        text = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc.strerror}", "restore the file") from exc
    out = []
    for line_no, row in enumerate(csv.DictReader(text), start=2):
        prefill = row.get("is_prefill") == "True"
        op = "attn_prefill" if prefill else "attn_decode"
        try:
            ms = sum(
                float(row[f"time_stats.{name}.median"] or 0.0)
                for name in (op, "attn_input_reshape", "attn_output_reshape")
            )
            out.append(
                AttentionRow(
                    prefill=prefill,
                    batch=int(row["batch_size"]),
                    chunk=int(row["prefill_chunk_size"]),
                    cached=int(row["kv_cache_size"]),
                    ms=ms,
                )
            )
        except (KeyError, ValueError) as exc:
            raise InputError(f"{path}:{line_no}", f"bad attention row: {exc}", "fix it") from exc
    return out


def attention_prefill_flops(rows: list[AttentionRow]) -> np.ndarray:
    s = ATTENTION_SHAPE
    hd = s["n_embd"] // s["n_q_head"]
    return np.array(
        [4 * r.batch * r.chunk * (r.cached + r.chunk) * s["n_q_head"] / s["tp"] * hd for r in rows],
        dtype=np.float64,
    )


def attention_decode_bytes(rows: list[AttentionRow]) -> np.ndarray:
    s = ATTENTION_SHAPE
    hd = s["n_embd"] // s["n_q_head"]
    per_token = 2 * s["n_kv_head"] * hd * 2  # K and V, 16-bit
    return np.array(
        [r.batch * r.cached * per_token / min(s["tp"], s["n_kv_head"]) for r in rows],
        dtype=np.float64,
    )


@dataclass(frozen=True)
class LinearFit:
    """latency + work / (peak * efficiency), with its errors on the rows it was fitted to."""

    latency_ms: float
    efficiency: float
    median_abs_rel_error: float
    rows: int


def fit_latency_throughput(
    work: np.ndarray, ms: np.ndarray, peak: float, kernels: int
) -> LinearFit:
    """Fit ms = kernels * latency + work / (peak * e) * 1e3 in log space."""

    def predict(x: np.ndarray) -> np.ndarray:
        return np.asarray(kernels * x[0] + work / (peak * x[1]) * 1e3)

    sol = least_squares(
        lambda x: np.log(predict(x) / ms), [0.01, 0.5], bounds=([0.0, 0.01], [1.0, 1.5])
    )
    errors = np.abs(predict(sol.x) / ms - 1.0)
    return LinearFit(float(sol.x[0]), float(sol.x[1]), float(np.median(errors)), len(ms))


def fit_attention(rows: list[AttentionRow], peak: GpuPeak) -> tuple[LinearFit, LinearFit]:
    """(prefill, decode) fits on the A100-80GB attention rows."""
    pre = [r for r in rows if r.prefill]
    dec = [r for r in rows if not r.prefill and r.cached > 0]
    prefill = fit_latency_throughput(
        attention_prefill_flops(pre),
        np.array([r.ms for r in pre]),
        peak.dense_tflops * 1e12,
        1,
    )
    decode = fit_latency_throughput(
        attention_decode_bytes(dec),
        np.array([r.ms for r in dec]),
        peak.memory_bandwidth_gb_s * 1e9,
        1,
    )
    return prefill, decode


def elementwise_bytes(row: ComputeRow) -> float:
    """Bytes one measured row's elementwise kernels move (the same count as the layer model's
    `elementwise_bytes_per_token`, from Vidur's shape columns; non-gated MLPs read one input)."""
    s = row.shape
    h, hd = s.n_embd, s.n_embd // s.n_head
    rotary = 2 * (s.n_head + s.n_kv_head) * hd / row.tp
    activation = (3 if s.use_gated_mlp else 2) * s.n_expanded_embd / row.tp
    return row.num_tokens * 2.0 * (7 * h + rotary + activation)


def fit_elementwise(rows: list[ComputeRow], peak: GpuPeak) -> LinearFit:
    """One GPU's elementwise fit (Phi-2's parallel block has one norm less: left out)."""
    rows = [r for r in rows if r.elementwise_ms > 0 and r.model != "phi-2"]
    return fit_latency_throughput(
        np.array([elementwise_bytes(r) for r in rows]),
        np.array([r.elementwise_ms for r in rows]),
        peak.memory_bandwidth_gb_s * 1e9,
        ELEMENTWISE_KERNELS,
    )


@dataclass(frozen=True)
class KernelCalibration:
    """Everything fitted: attention on the one timed chip, elementwise per timed GPU."""

    attention_prefill: LinearFit
    attention_decode: LinearFit
    elementwise: dict[str, LinearFit]


def calibrate_kernels(
    attention_path: Path | None = None, compute_dir: Path | None = None
) -> KernelCalibration:
    """Fit the kernels on the vendored files (or the given ones)."""
    peaks = load_peaks()
    prefill, decode = fit_attention(load_attention_rows(attention_path), peaks[ATTENTION_GPU])
    rows = load_compute_rows(compute_dir)
    elementwise = {
        gpu: fit_elementwise([r for r in rows if r.gpu == gpu], peaks[gpu])
        for gpu in sorted({r.gpu for r in rows})
    }
    return KernelCalibration(prefill, decode, elementwise)


MLP_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


# Vidur's predictor adds this CPU launch cost to every profiled all-reduce
# (`nccl_cpu_launch_overhead_ms`, vidur 0.0.26 default).
VIDUR_NCCL_LAUNCH_MS = 0.02


@dataclass(frozen=True)
class ProfiledLayer:
    """One Llama-2-70B layer at TP 2 on A100-80GB as Vidur's profiles time it (the sum of its
    operators, all-reduces included, each with Vidur's launch cost): the reference the layer
    model is checked against.

    Rows are looked up, not interpolated: the profiles hold every size the comparison asks
    for (prefill chunks and decode batches as measured, contexts at the nearest measured)."""

    mlp: dict[int, float]  # tokens -> the non-attention operators, ms
    prefill_attention: dict[int, float]  # chunk (nothing cached) -> ms
    decode_attention: dict[tuple[int, int], float]  # (batch, cached) -> ms
    allreduce: dict[int, float]  # bytes -> ms (2 ranks on one node)

    def prefill_ms(self, tokens: int) -> float:
        return self.mlp[tokens] + self.prefill_attention[tokens] + 2 * self._allreduce(tokens)

    def decode_ms(self, batch: int, context: int) -> float:
        cached = min(
            (c for b, c in self.decode_attention if b == batch), key=lambda c: abs(c - context)
        )
        attention = self.decode_attention[(batch, cached)]
        return self.mlp[batch] + attention + 2 * self._allreduce(batch)

    def _allreduce(self, tokens: int) -> float:
        size = tokens * ATTENTION_SHAPE["n_embd"] * 2
        measured = self.allreduce[min(self.allreduce, key=lambda s: abs(s - size))]
        return measured + VIDUR_NCCL_LAUNCH_MS


def load_profiled_layer(directory: Path | None = None) -> ProfiledLayer:
    """The Vidur profiling set for Llama-2-70B on A100-80GB at TP 2 (medians; repeats averaged).

    Raises:
        InputError: a file is missing or a row is malformed.
    """
    folder = directory or vidur_sim_dir()

    def rows(name: str) -> list[dict[str, str]]:
        path = folder / name
        try:
            return list(csv.DictReader(path.read_text(encoding="utf-8").splitlines()))
        except OSError as exc:
            raise InputError(str(path), f"cannot read: {exc.strerror}", "restore it") from exc

    def mean_of(pairs: list[tuple[object, float]]) -> dict:  # type: ignore[type-arg]
        acc: dict[object, list[float]] = {}
        for k, v in pairs:
            acc.setdefault(k, []).append(v)
        return {k: float(np.mean(v)) for k, v in acc.items()}

    try:
        mlp = mean_of(
            [
                (int(r["num_tokens"]), sum(float(r[f"time_stats.{op}.median"]) for op in MLP_OPS))
                for r in rows("mlp.csv")
                if r["num_tensor_parallel_workers"] == "2"
            ]
        )
        attention = load_attention_rows(folder / "attention.csv")
        prefill = mean_of([(a.chunk, a.ms) for a in attention if a.prefill and a.cached == 0])
        decode = mean_of([((a.batch, a.cached), a.ms) for a in attention if not a.prefill])
        allreduce = mean_of(
            [
                (int(r["size"]), float(r["time_stats.all_reduce.median"]))
                for r in rows("network-a100-dgx/all_reduce.csv")
                if r["num_workers"] == "2" and r["devices_per_node"] == "2"
            ]
        )
    except (KeyError, ValueError) as exc:
        raise InputError(str(folder), f"bad profiling row: {exc}", "restore the files") from exc
    return ProfiledLayer(mlp, prefill, decode, allreduce)
