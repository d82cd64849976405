"""Analytical performance model: time of one transformer layer on one node, per phase.

Roofline with sequential kernels, per layer on a node running tensor parallelism (TP) over `tp` of
its GPUs:

    t = overhead + max(W / (bw*e_mem), F_gemm / (tf*e_cmp))      # weight GEMMs
                 + max(KV / (bw*e_mem), F_attn / (tf*e_cmp))     # attention
                 + 2 * allreduce(tokens * hidden * 2 bytes, tp)   # TP, two per layer

W is the weight bytes the step reads (attention, router, and the experts the batch touches), F_gemm
= 2 * tokens * active params, KV the cache bytes read (decode) and F_attn the attention FLOPs. All
per GPU: divided by tp (KV by min(tp, kv_heads), since vLLM replicates KV heads when tp exceeds
them). The efficiency factors e_* and the per-layer overhead are fitted per GPU type on measured
data (`solver/calibration.py`, stored in `solver/data/calibration.yaml`).

A node may leave GPUs idle: the node's layer time is the best over the TP degrees it can run
(divisors of its GPU count that vLLM accepts for the model's heads), so more GPUs per node never
make a layer slower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import GpuType, NodeConfig
from solver.types import Phase

PERF_MODEL_VERSION = "3"  # 2: decode pipelines hold KV for every micro-batch in flight; 3: the
# last stage of a pipeline pays no hop, and an aggregated replica runs one TP for both phases


class Efficiency(BaseModel):
    """Fitted fractions of datasheet peaks, and fixed per-layer cost, for one GPU type."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    decode_mem: float = Field(gt=0, le=1.2, description="Fraction of memory bandwidth (decode).")
    decode_compute: float = Field(gt=0, le=1.2, description="Fraction of peak TFLOPS (decode).")
    decode_overhead_ms: float = Field(ge=0, description="Fixed cost per layer per decode step.")
    prefill_compute: float = Field(gt=0, le=1.2, description="Fraction of peak TFLOPS (prefill).")
    prefill_overhead_ms: float = Field(ge=0, description="Fixed cost per layer per prefill step.")


class PerfSettings(BaseModel):
    """Runtime assumptions of the model; every field is a documented setting."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="vLLM --gpu-memory-utilization (its default 0.9)."
    )
    runtime_reserve_gb: float = Field(
        default=1.5, ge=0, description="Per-GPU memory for CUDA context, activations, graphs."
    )
    min_kv_tokens: int = Field(
        default=4096, gt=0, description="KV tokens a stage must hold to count as useful."
    )
    hop_latency_ms: float = Field(
        default=0.5, ge=0, description="Latency of one inter-node hop in a region (assumption)."
    )
    allreduce_latency_ms: dict[str, float] = Field(
        default_factory=lambda: {"nvlink": 0.01, "pcie": 0.025},
        description="Fixed latency of one intra-node allreduce, by link type (assumption).",
    )
    max_batch_tokens: int = Field(
        default=65536, gt=0, description="Largest prefill batch (tokens) or decode batch searched."
    )


@dataclass(frozen=True)
class LayerTime:
    """One layer's time on a node, with the TP degree that achieves it and its provenance."""

    ms: float
    tp: int
    source: Literal["analytical", "measured"]


def valid_tp_degrees(card: ModelCard, gpu_count: int) -> list[int]:
    """TP degrees a node of `gpu_count` GPUs can run for this model (vLLM's head rules)."""
    out = []
    for tp in range(1, gpu_count + 1):
        if gpu_count % tp or card.attention_heads % tp:
            continue
        if card.kv_heads % tp and tp % card.kv_heads:
            continue
        out.append(tp)
    return out


def experts_touched(card: ModelCard, tokens: float) -> float:
    """Expected distinct experts a batch of `tokens` routes to (uniform routing)."""
    if not card.is_moe:
        return 1.0
    miss = float((1.0 - card.active_experts / card.experts) ** tokens)
    return card.experts * (1.0 - miss)


def _allreduce_ms(gpu: GpuType, tp: int, nbytes: float, latency_ms: dict[str, float]) -> float:
    if tp == 1:
        return 0.0
    per_direction_gb_s = gpu.intra_node_bandwidth_gb_s / 2
    ring_bytes = 2 * (tp - 1) / tp * nbytes
    return latency_ms[gpu.intra_node_link] + ring_bytes / (per_direction_gb_s * 1e9) * 1e3


def _weights_read_bytes(card: ModelCard, tokens: float) -> float:
    dense = (card.attention_params + card.router_params) * card.weight_bytes_per_param
    experts = experts_touched(card, tokens) * card.expert_params * card.expert_bytes_per_param
    return dense + experts


def decode_layer_ms(
    card: ModelCard,
    gpu: GpuType,
    eff: Efficiency,
    tp: int,
    batch: float,
    context: float,
    settings: PerfSettings,
) -> float:
    """One decode step of `batch` sequences at `context` tokens through one layer, in ms."""
    bw = gpu.memory_bandwidth_gb_s * 1e9 * eff.decode_mem
    flops = gpu.dense_tflops * 1e12 * eff.decode_compute
    held = card.kv_tokens_held(context)
    t_gemm = max(
        _weights_read_bytes(card, batch) / tp / bw,
        2 * batch * card.active_params_per_layer / tp / flops,
    )
    kv_bytes = batch * held * card.kv_bytes_per_token_per_layer / min(tp, card.kv_heads)
    attn_flops = 4 * batch * held * card.attention_heads * card.head_dim / tp
    t_attn = max(kv_bytes / bw, attn_flops / flops)
    comm = 2 * _allreduce_ms(gpu, tp, batch * card.hidden_size * 2, settings.allreduce_latency_ms)
    return eff.decode_overhead_ms + (t_gemm + t_attn) * 1e3 + comm


def prefill_layer_ms(
    card: ModelCard,
    gpu: GpuType,
    eff: Efficiency,
    tp: int,
    tokens: float,
    prompt_tokens: float,
    settings: PerfSettings,
) -> float:
    """Prefill of a batch of `tokens` prompt tokens (prompts of `prompt_tokens`) through one layer.

    Causal attention: a token at position i attends to i earlier tokens, so on average a prompt's
    tokens attend to half its (window-limited) length: F_attn = 2 * tokens * held * heads * hd.
    """
    bw = gpu.memory_bandwidth_gb_s * 1e9 * eff.decode_mem
    flops = gpu.dense_tflops * 1e12 * eff.prefill_compute
    held = card.kv_tokens_held(prompt_tokens)
    t_gemm = max(
        _weights_read_bytes(card, tokens) / tp / bw,
        2 * tokens * card.active_params_per_layer / tp / flops,
    )
    t_attn = 2 * tokens * held * card.attention_heads * card.head_dim / tp / flops
    comm = 2 * _allreduce_ms(gpu, tp, tokens * card.hidden_size * 2, settings.allreduce_latency_ms)
    return eff.prefill_overhead_ms + (t_gemm + t_attn) * 1e3 + comm


def analytical_layer_ms(
    card: ModelCard,
    node: NodeConfig,
    eff: Efficiency,
    tp: int,
    phase: Phase,
    size: float,
    context: float,
    settings: PerfSettings,
) -> float:
    """Dispatch on phase: `size` is the decode batch or the prefill token count; `context` is
    the decode context or the prefill prompt length."""
    if phase == "decode":
        return decode_layer_ms(card, node.gpu, eff, tp, size, context, settings)
    return prefill_layer_ms(card, node.gpu, eff, tp, size, context, settings)


def hop_ms(card: ModelCard, tokens: float, network_gbps: float, settings: PerfSettings) -> float:
    """Send one stage's activations (tokens x hidden, 16-bit) to the next node, in ms."""
    nbytes = tokens * card.hidden_size * 2
    return settings.hop_latency_ms + nbytes * 8 / (network_gbps * 1e9) * 1e3
