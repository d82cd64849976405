"""Measured per-layer operator times that replace the fitted GEMM and elementwise terms.

The fitted roofline (`analytical.layer_breakdown`) is smooth in the batch's tokens; real GEMMs are
not. cuBLAS tiles the token dimension, so a layer's weight GEMMs run in steps: on A100-80GB at
TP 2, one Llama-2-70B layer takes 3.76 ms at 992 tokens and 4.11 ms at 1000 (Vidur's profile).
A scheduler whose passes fill one chunk size sits on one of those steps, and a smooth fit is then
several percent off at exactly the size that matters. Where a profile measured the layer's shape
on the GPU at the TP degree, the layer model therefore reads the GEMM and elementwise times from
it (linear between measured sizes) and keeps its own attention, all-reduce and runtime terms.

Source: `solver/data/calibration/vidur-sim/mlp.csv` (Vidur's profile of Llama-2-70B's
non-attention operators on A100-80GB, TP 1-8, 1-4096 tokens; MIT; see its README). A table
applies to every model card with the same layer shape (Llama-3.1-70B shares Llama-2-70B's) and
16-bit weights, on that GPU; everything else keeps the fitted model.

A larger batch is never faster: each table is made monotone (running maximum over sizes), which
the profile table's binary searches need and which errs towards the slower neighbour.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from solver.catalog.model_cards import ModelCard
from solver.errors import InputError
from solver.io import data_path

PROFILE_GPU = "a100-80gb"  # vidur-sim/mlp.csv is Vidur's `a100` device (A100-80GB SXM)
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp")
MEASURED_BYTES_PER_PARAM = 2  # Vidur timed fp16/bf16 weights

Shape = tuple[int, int, int, int, bool]  # n_head, n_kv_head, n_embd, n_expanded_embd, gated


def card_shape(card: ModelCard) -> Shape | None:
    """The layer shape a profile row would record for `card`; None where no profile can apply
    (MoE layers, or weights other than 16-bit)."""
    if card.is_moe or card.weight_bytes_per_param != MEASURED_BYTES_PER_PARAM:
        return None
    if card.hidden_size != card.attention_heads * card.head_dim:
        return None
    return (card.attention_heads, card.kv_heads, card.hidden_size, card.ffn_size, True)


@dataclass(frozen=True)
class OperatorTable:
    """One layer's weight GEMMs and elementwise kernels on one rank, ms, at measured token counts
    (strictly increasing, each series made monotone)."""

    tokens: tuple[float, ...]
    gemm_ms: tuple[float, ...]
    elementwise_ms: tuple[float, ...]
    source: str

    def at(self, tokens: float) -> tuple[float, float] | None:
        """(GEMM ms, elementwise ms) at `tokens`, linear between measured sizes; None past the
        largest measured size (the fitted model takes over there)."""
        if tokens > self.tokens[-1]:
            return None
        return (
            float(np.interp(tokens, self.tokens, self.gemm_ms)),
            float(np.interp(tokens, self.tokens, self.elementwise_ms)),
        )


@dataclass(frozen=True)
class OperatorTables:
    """Operator tables keyed by (GPU id, layer shape, TP degree)."""

    tables: dict[tuple[str, Shape, int], OperatorTable] = field(default_factory=dict)

    def get(self, gpu_id: str, card: ModelCard, tp: int) -> OperatorTable | None:
        shape = card_shape(card)
        if shape is None:
            return None
        return self.tables.get((gpu_id, shape, tp))

    def __len__(self) -> int:
        return len(self.tables)


def _median(row: dict[str, str], op: str) -> float:
    return float(row[f"time_stats.{op}.median"])


def load_vidur_mlp(path: Path, gpu_id: str = PROFILE_GPU) -> OperatorTables:
    """Tables from one Vidur `mlp.csv` (one model's shape, several TP degrees): medians of each
    operator's repeats, repeated sizes averaged, each series made monotone.

    Raises:
        InputError: the file is missing, lacks a column, or holds a value that is not a number.
    """
    try:
        rows = list(csv.DictReader(path.read_text(encoding="utf-8").splitlines()))
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc.strerror}", "restore the file") from exc
    sums: dict[tuple[Shape, int], dict[int, list[tuple[float, float]]]] = {}
    try:
        for row in rows:
            shape: Shape = (
                int(row["n_head"]),
                int(row["n_kv_head"]),
                int(row["n_embd"]),
                int(row["n_expanded_embd"]),
                row["use_gated_mlp"] == "True",
            )
            key = (shape, int(row["num_tensor_parallel_workers"]))
            gemm = sum(_median(row, op) for op in GEMM_OPS)
            elementwise = sum(_median(row, op) for op in ELEMENTWISE_OPS)
            sums.setdefault(key, {}).setdefault(int(row["num_tokens"]), []).append(
                (gemm, elementwise)
            )
    except (KeyError, ValueError, TypeError) as exc:
        raise InputError(str(path), f"bad profiling row: {exc!r}", "restore Vidur's file") from exc
    tables: dict[tuple[str, Shape, int], OperatorTable] = {}
    for (shape, tp), by_size in sums.items():
        sizes = sorted(by_size)
        gemm_series = np.maximum.accumulate([np.mean([g for g, _ in by_size[s]]) for s in sizes])
        elem_series = np.maximum.accumulate([np.mean([e for _, e in by_size[s]]) for s in sizes])
        tables[(gpu_id, shape, tp)] = OperatorTable(
            tuple(float(s) for s in sizes),
            tuple(float(g) for g in gemm_series),
            tuple(float(e) for e in elem_series),
            f"{path.name} (TP {tp})",
        )
    return OperatorTables(tables)


@cache
def shipped_operator_tables() -> OperatorTables:
    """The vendored profile (`solver/data/calibration/vidur-sim/mlp.csv`), read once."""
    return load_vidur_mlp(data_path("calibration/vidur-sim") / "mlp.csv")
