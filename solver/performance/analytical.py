"""Analytical performance model: time of one transformer layer on one node, per phase.

Roofline with sequential kernels, per layer on a node running tensor parallelism (TP) over `tp` of
its GPUs, split into the four components `coral profile explain` reports:

    gemm        = smax(W / (bw*e_mem), F_gemm / (tf*e_cmp))     # the layer's weight GEMMs
    attention   = latency + KV / (bw*e_attn)   (decode)          # attention kernel
                = latency + F_attn / (tf*e_attn) (prefill)
    elementwise = latency + E / (bw*e_elem)                     # norms, rotary, activation, add
    comm        = 2 * allreduce(tokens * hidden * 2 bytes, tp)   # TP, two per layer
    overhead    = the runtime's fixed cost per layer             # launch cost, scheduler (helix)
    t = gemm + attention + elementwise + comm + overhead

W is the weight bytes the step reads (attention, router, and the experts the batch touches), F_gemm
= 2 * tokens * active params, KV the cache bytes read (decode), F_attn the attention FLOPs
(prefill) and E the bytes the elementwise kernels read and write. All per GPU: divided by tp (KV by
min(tp, kv_heads), since vLLM replicates KV heads when tp exceeds them). The GEMM factors e_* are a
property of the GPU (fitted per GPU type, or derived from the nearest measured chip:
`solver/data/calibration.yaml`); the attention and elementwise kernels have their own factors
(`KernelFactors`), fitted on Vidur's operator timings and derived for chips it did not time. The fixed costs are a property of the
serving runtime (`Runtime`): a per-layer cost and a per-step cost, the latter paid once per
pipeline-stage pass (`PerfModel.stage_time_ms`), not per layer. The all-reduce is an alpha-beta
model per interconnect and TP degree (`AllReduceFit`).

A node may leave GPUs idle: the node's layer time is the best over the TP degrees it can run
(divisors of its GPU count that vLLM accepts for the model's heads), so more GPUs per node never
make a layer slower.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import NodeConfig
from solver.errors import InputError
from solver.types import Phase

PERF_MODEL_VERSION = "6"  # 2: decode pipelines hold KV for every micro-batch in flight; 3: the
# last stage of a pipeline pays no hop, and an aggregated replica runs one TP for both phases;
# 4: fixed costs belong to the runtime (vllm by default, helix for fitting Helix's files), a
# per-step cost per stage pass, all-reduce per interconnect and TP, no GPU uses a generic default;
# 5: attention and elementwise kernels timed with their own fitted factors (Vidur's operators),
# GEMMs on a smooth roofline (smax = the p-norm of the memory and compute times, p = 2);
# 6: measured GEMM and elementwise times where a profile covers the layer's shape on the GPU at
# the TP degree (`operator_tables`), and the profile table's batch at a measured step's end

Bound = Literal["compute", "memory"]


class Efficiency(BaseModel):
    """Fractions of datasheet peaks one GPU type reaches (a property of the chip)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    decode_mem: float = Field(gt=0, le=1.2, description="Fraction of memory bandwidth (decode).")
    decode_compute: float = Field(gt=0, le=1.2, description="Fraction of peak TFLOPS (decode).")
    prefill_compute: float = Field(gt=0, le=1.2, description="Fraction of peak TFLOPS (prefill).")
    gemm_latency_ms: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fixed time of one weight-GEMM kernel, ms (GEMMS_PER_LAYER per layer): the "
        "floor Vidur's small-batch GEMM timings show on every chip, whatever the runtime.",
    )


GEMMS_PER_LAYER = 4  # QKV, O, MLP up/gate, MLP down (an MoE layer's experts run as one fused pair)
ELEMENTWISE_KERNELS = 5  # input norm, rotary embedding, MLP activation, post-attention norm, add


class KernelFactors(BaseModel):
    """The attention and elementwise kernels on one GPU type: fractions of its datasheet peaks
    and fixed times per kernel (fitted on Vidur's operator timings, or derived)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    attention_prefill_compute: float = Field(
        gt=0, le=1.2, description="Fraction of peak TFLOPS prefill attention reaches."
    )
    attention_prefill_latency_ms: float = Field(ge=0, le=1, description="Fixed prefill time, ms.")
    attention_decode_mem: float = Field(
        gt=0, le=1.2, description="Fraction of memory bandwidth decode attention reaches."
    )
    attention_decode_latency_ms: float = Field(ge=0, le=1, description="Fixed decode time, ms.")
    elementwise_mem: float = Field(
        gt=0, le=1.2, description="Fraction of memory bandwidth the elementwise kernels reach."
    )
    elementwise_latency_ms: float = Field(
        ge=0, le=1, description="Fixed time of one elementwise kernel, ms."
    )


def elementwise_bytes_per_token(card: ModelCard, tp: int) -> float:
    """Bytes one token moves through a layer's elementwise kernels on one GPU (16-bit values):
    two norms (read and write the hidden state, not sharded), the residual add (two reads, one
    write), rotary embedding on this GPU's query and key heads, and the gated MLP's activation
    (reads the up and gate projections, writes one; a MoE token's active experts each)."""
    h = card.hidden_size
    rotary = 2 * (card.attention_heads + card.kv_heads) * card.head_dim / tp
    activation = 3 * card.active_experts * card.ffn_size / tp
    return 2.0 * (4 * h + 3 * h + rotary + activation)


class Overheads(BaseModel):
    """One runtime's fixed costs on one GPU type, ms: per layer and per stage pass, per phase."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    decode_layer_ms: float = Field(ge=0, description="Fixed cost per layer per decode step.")
    prefill_layer_ms: float = Field(ge=0, description="Fixed cost per layer per prefill step.")
    decode_step_ms: float = Field(ge=0, description="Fixed cost per stage pass (decode).")
    prefill_step_ms: float = Field(ge=0, description="Fixed cost per stage pass (prefill).")
    collective_launch_ms: float = Field(
        default=0.0, ge=0, description="CPU cost of launching each TP all-reduce."
    )

    def layer_ms(self, phase: Phase) -> float:
        return self.decode_layer_ms if phase == "decode" else self.prefill_layer_ms

    def step_ms(self, phase: Phase) -> float:
        return self.decode_step_ms if phase == "decode" else self.prefill_step_ms


class LayerOverhead(BaseModel):
    """A runtime's fixed cost per layer on one GPU type, ms (fitted, e.g. Helix's per GPU)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    decode_layer_ms: float = Field(ge=0, description="Fixed cost per layer per decode step.")
    prefill_layer_ms: float = Field(ge=0, description="Fixed cost per layer per prefill step.")


class Runtime(BaseModel):
    """A serving runtime's fixed costs: per layer (the same on every GPU, or per GPU where
    fitted per machine) and per stage pass, per phase; `sources` cites each number."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    description: str = Field(description="What runtime this models (engine, version, mode).")
    decode_step_ms: float = Field(ge=0, description="Fixed cost per stage pass (decode).")
    prefill_step_ms: float = Field(ge=0, description="Fixed cost per stage pass (prefill).")
    decode_layer_ms: float | None = Field(default=None, ge=0, description="Per layer, any GPU.")
    prefill_layer_ms: float | None = Field(default=None, ge=0, description="Per layer, any GPU.")
    collective_launch_ms: float = Field(
        default=0.0,
        ge=0,
        description="CPU cost of launching each tensor-parallel all-reduce (two per layer), "
        "beyond the collective's GPU time.",
    )
    per_gpu: dict[str, LayerOverhead] = Field(
        default_factory=dict, description="Per-layer costs fitted per GPU type (win over above)."
    )
    sources: dict[str, str] = Field(description="Where each number comes from.")

    def overheads(self, name: str, gpu: str) -> Overheads:
        """This runtime's fixed costs on GPU type `gpu`.

        Raises:
            InputError: the runtime has no per-layer cost for this GPU (helix: measured on
                three GPUs only).
        """
        layer = self.per_gpu.get(gpu)
        if layer is None:
            if self.decode_layer_ms is None or self.prefill_layer_ms is None:
                raise InputError(
                    "runtime",
                    f"runtime '{name}' has no per-layer overhead for GPU '{gpu}' (it has: "
                    f"{', '.join(sorted(self.per_gpu))})",
                    "use --runtime vllm, or a GPU the runtime was measured on",
                )
            layer = LayerOverhead(
                decode_layer_ms=self.decode_layer_ms, prefill_layer_ms=self.prefill_layer_ms
            )
        return Overheads(
            decode_layer_ms=layer.decode_layer_ms,
            prefill_layer_ms=layer.prefill_layer_ms,
            decode_step_ms=self.decode_step_ms,
            prefill_step_ms=self.prefill_step_ms,
            collective_launch_ms=self.collective_launch_ms,
        )


class AllReduceFit(BaseModel):
    """Alpha-beta all-reduce at one TP degree: t = latency + 2(tp-1)/tp * bytes / bus bandwidth
    (nccl-tests' bus-bandwidth convention, so measured `busbw` plugs in directly)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    latency_ms: float = Field(ge=0, description="Small-message all-reduce time, ms.")
    bus_bandwidth_gb_s: float = Field(gt=0, description="nccl-tests busbw at large messages, GB/s.")

    def ms(self, nbytes: float, tp: int) -> float:
        """One all-reduce of `nbytes` over `tp` GPUs, in ms."""
        ring_bytes = 2 * (tp - 1) / tp * nbytes
        return self.latency_ms + ring_bytes / (self.bus_bandwidth_gb_s * 1e9) * 1e3


@dataclass(frozen=True)
class NodeCosts:
    """What the layer model needs beyond the card and the datasheet: the GPU's efficiency, the
    runtime's overheads on it, and the node's all-reduce fits by TP degree (interconnect named)."""

    eff: Efficiency
    overheads: Overheads
    kernels: KernelFactors
    interconnect: str | None = None
    allreduce: Mapping[int, AllReduceFit] = field(default_factory=dict)

    def allreduce_ms(self, node: str, tp: int, nbytes: float) -> float:
        """One all-reduce on `node` at TP `tp` (0 at TP 1).

        Raises:
            InputError: TP > 1 on a node whose interconnect or TP degree has no all-reduce fit.
        """
        if tp == 1:
            return 0.0
        fit = self.allreduce.get(tp)
        if fit is None:
            raise InputError(
                f"allreduce.{self.interconnect}.tp.{tp}",
                f"no all-reduce fit for {node} (interconnect {self.interconnect}) at TP {tp}",
                "add it to solver/data/calibration.yaml (and the GPU's interconnect to gpus.yaml)",
            )
        return fit.ms(nbytes, tp)


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
    max_batch_tokens: int = Field(
        default=65536, gt=0, description="Largest prefill batch (tokens) or decode batch searched."
    )


@dataclass(frozen=True)
class LayerTime:
    """One layer's time on a node, with the TP degree that achieves it and its provenance."""

    ms: float
    tp: int
    source: Literal["analytical", "measured"]


@dataclass(frozen=True)
class LayerBreakdown:
    """One layer's time by component (ms) and which roofline side bounds each kernel group."""

    gemm_ms: float
    attention_ms: float
    elementwise_ms: float
    comm_ms: float
    overhead_ms: float
    gemm_bound: Bound
    attention_bound: Bound

    @property
    def ms(self) -> float:
        return (
            self.gemm_ms + self.attention_ms + self.elementwise_ms + self.comm_ms + self.overhead_ms
        )

    def components(self) -> dict[str, float]:
        return {
            "gemm_ms": self.gemm_ms,
            "attention_ms": self.attention_ms,
            "elementwise_ms": self.elementwise_ms,
            "comm_ms": self.comm_ms,
            "overhead_ms": self.overhead_ms,
        }

    def bound(self) -> str:
        """What bounds the layer: the largest component, with its roofline side for kernels."""
        name = max(self.components().items(), key=lambda kv: kv[1])[0]
        if name == "gemm_ms":
            return f"{self.gemm_bound} (weight GEMMs)"
        if name == "attention_ms":
            return f"{self.attention_bound} (attention)"
        if name == "elementwise_ms":
            return "memory (elementwise)"
        return "communication" if name == "comm_ms" else "overhead"


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


def _weights_read_bytes(card: ModelCard, tokens: float) -> float:
    dense = (card.attention_params + card.router_params) * card.weight_bytes_per_param
    experts = experts_touched(card, tokens) * card.expert_params * card.expert_bytes_per_param
    return dense + experts


ROOFLINE_P = 2.0  # smooth roofline: (t_mem^p + t_cmp^p)^(1/p)


def smooth_roofline(t_mem: Any, t_cmp: Any) -> Any:
    """A GEMM's time from its memory and compute times: a smooth maximum. Near the roofline's
    corner neither side hides the other (Vidur's Llama-2-70B GEMMs at 96-192 tokens take 20-25%
    longer than max(memory, compute)); far from it the larger side dominates. Works on floats and
    numpy arrays."""
    return (t_mem**ROOFLINE_P + t_cmp**ROOFLINE_P) ** (1.0 / ROOFLINE_P)


def _roofline(nbytes: float, bw: float, flops: float, peak: float) -> tuple[float, Bound]:
    """Seconds of a kernel group, and which side of the roofline is larger."""
    t_mem, t_cmp = nbytes / bw, flops / peak
    return float(smooth_roofline(t_mem, t_cmp)), "compute" if t_cmp > t_mem else "memory"


def layer_breakdown(
    card: ModelCard,
    node: NodeConfig,
    costs: NodeCosts,
    tp: int,
    phase: Phase,
    size: float,
    context: float,
) -> LayerBreakdown:
    """One layer's components. `size` is the decode batch (sequences at `context` tokens) or the
    prefill token count (prompts of `context` tokens).

    Prefill attention: F_attn = 4 * tokens * held * heads * hd (QK^T and PV over every held
    key). The causal mask halves the useful work, but the fused kernels Vidur timed take the
    time of the full square (fitting the causal half leaves 19% median error, the full square
    8%), so the full count is used with the fitted efficiency. Decode attention reads every held
    token's KV: memory-bound at batch x held x KV bytes.

    Raises:
        InputError: TP > 1 on a node without an all-reduce fit (see `NodeCosts.allreduce_ms`).
    """
    gpu, eff = node.gpu, costs.eff
    bw = gpu.memory_bandwidth_gb_s * 1e9 * eff.decode_mem
    cmp = eff.decode_compute if phase == "decode" else eff.prefill_compute
    peak = gpu.dense_tflops * 1e12 * cmp
    held = card.kv_tokens_held(context)
    t_gemm, gemm_bound = _roofline(
        _weights_read_bytes(card, size) / tp, bw, 2 * size * card.active_params_per_layer / tp, peak
    )
    k = costs.kernels
    mem_bw = gpu.memory_bandwidth_gb_s * 1e9
    attn_bound: Bound
    if phase == "decode":
        kv_bytes = size * held * card.kv_bytes_per_token_per_layer / min(tp, card.kv_heads)
        attn_ms = k.attention_decode_latency_ms + kv_bytes / (mem_bw * k.attention_decode_mem) * 1e3
        attn_bound = "memory"
    else:
        attn_flops = 4 * size * held * card.attention_heads * card.head_dim / tp
        tflops = gpu.dense_tflops * 1e12 * k.attention_prefill_compute
        attn_ms = k.attention_prefill_latency_ms + attn_flops / tflops * 1e3
        attn_bound = "compute"
    elem_bytes = size * elementwise_bytes_per_token(card, tp)
    elem_ms = (
        ELEMENTWISE_KERNELS * k.elementwise_latency_ms
        + elem_bytes / (mem_bw * k.elementwise_mem) * 1e3
    )
    comm = 0.0
    if tp > 1:
        one = costs.allreduce_ms(node.id, tp, size * card.hidden_size * 2)
        comm = 2 * (one + costs.overheads.collective_launch_ms)
    return LayerBreakdown(
        gemm_ms=GEMMS_PER_LAYER * eff.gemm_latency_ms + t_gemm * 1e3,
        attention_ms=attn_ms,
        elementwise_ms=elem_ms,
        comm_ms=comm,
        overhead_ms=costs.overheads.layer_ms(phase),
        gemm_bound=gemm_bound,
        attention_bound=attn_bound,
    )


def analytical_layer_ms(
    card: ModelCard,
    node: NodeConfig,
    costs: NodeCosts,
    tp: int,
    phase: Phase,
    size: float,
    context: float,
) -> float:
    """ms per layer: the sum of `layer_breakdown`'s components (per layer, no per-step cost)."""
    return layer_breakdown(card, node, costs, tp, phase, size, context).ms


def hop_ms(card: ModelCard, tokens: float, network_gbps: float, settings: PerfSettings) -> float:
    """Send one stage's activations (tokens x hidden, 16-bit) to the next node, in ms."""
    nbytes = tokens * card.hidden_size * 2
    return settings.hop_latency_ms + nbytes * 8 / (network_gbps * 1e9) * 1e3
