"""One decoder layer built from a model card, with random weights, for timing.

The layer is the Llama/Qwen decoder the model cards describe: RMSNorm, grouped-query attention
with rotary position embeddings through PyTorch's scaled-dot-product attention (SDPA), a residual,
RMSNorm, and a SwiGLU MLP, or for MoE cards a top-k router over `experts` SwiGLU experts of which
each token runs `active_experts`. Under tensor parallelism (TP) a layer holds one rank's shard in
the Megatron split vLLM uses: Q heads, KV heads (replicated when fewer than the TP degree) and the
MLP's intermediate size are divided, and the attention and MLP outputs are all-reduced.
Not modelled: biases, Q/K norms (Qwen3), attention sinks and sliding windows in prefill (GPT-OSS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from solver.catalog.model_cards import ModelCard

RMS_EPS = 1e-5
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class LayerShape:
    """Sizes of one layer (one TP rank's shard when `tp` > 1)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    experts: int = 1
    active_experts: int = 1

    @classmethod
    def from_card(cls, card: ModelCard) -> LayerShape:
        return cls(
            card.hidden_size,
            card.attention_heads,
            card.kv_heads,
            card.head_dim,
            card.ffn_size,
            card.experts,
            card.active_experts,
        )

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless vLLM could shard this layer `tp` ways."""
        if tp < 1 or self.heads % tp or self.ffn % tp:
            raise ValueError(
                f"TP {tp} must divide the attention heads ({self.heads}) and the MLP "
                f"intermediate size ({self.ffn})"
            )
        if self.kv_heads % tp and tp % self.kv_heads:
            raise ValueError(f"TP {tp} and the KV heads ({self.kv_heads}) must divide one another")


class DecoderLayer(torch.nn.Module):
    """One decoder layer (or one TP rank of it); weights are plain tensors, never trained."""

    def __init__(
        self, shape: LayerShape, weights: dict[str, torch.Tensor], group: ProcessGroup | None = None
    ):
        super().__init__()
        self.shape = shape
        self.w = weights
        self.group = group  # a torch.distributed process group, or None without TP

    def forward(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """x: [sequences, new tokens, hidden]. Without a cache every sequence is a causal prompt;
        with one (K, V: [sequences, kv_heads, context + 1, head_dim]) x holds one new token per
        sequence, whose K and V are written into the cache's last slot."""
        h = x + self._all_reduce(self.attention(rms_norm(x, self.w["attn_norm"]), kv_cache))
        mlp_in = rms_norm(h, self.w["mlp_norm"])
        return h + self._all_reduce(self.moe(mlp_in) if self.shape.is_moe else self.mlp(mlp_in))

    def attention(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        s, w = self.shape, self.w
        seqs, new = x.shape[0], x.shape[1]
        q = (x @ w["wq"].T).view(seqs, new, s.heads, s.head_dim).transpose(1, 2)
        k = (x @ w["wk"].T).view(seqs, new, s.kv_heads, s.head_dim).transpose(1, 2)
        v = (x @ w["wv"].T).view(seqs, new, s.kv_heads, s.head_dim).transpose(1, 2)
        start = 0 if kv_cache is None else kv_cache[0].shape[2] - 1
        cos, sin = rope_tables(start, new, s.head_dim, x.device, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k_all, v_all = kv_cache
            k_all[:, :, -1:] = k  # in place, as a paged KV cache is written: no copy of C tokens
            v_all[:, :, -1:] = v
            o = F.scaled_dot_product_attention(q, k_all, v_all, enable_gqa=True)
        return o.transpose(1, 2).reshape(seqs, new, s.heads * s.head_dim) @ w["wo"].T

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return swiglu(x, w["w_gate"], w["w_up"], w["w_down"])

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        """Top-k routing: softmax over the k best router logits, then each expert runs only on
        the tokens routed to it (one host sync to list the experts hit)."""
        s, w = self.shape, self.w
        flat = x.reshape(-1, s.hidden)
        top_logits, top_idx = torch.topk(flat @ w["router"].T, s.active_experts, dim=-1)
        gates = torch.softmax(top_logits, dim=-1)
        out = torch.zeros_like(flat)
        for e in torch.unique(top_idx).tolist():
            token, slot = torch.nonzero(top_idx == e, as_tuple=True)
            y = swiglu(flat[token], w["e_gate"][e], w["e_up"][e], w["e_down"][e])
            out.index_add_(0, token, y * gates[token, slot].unsqueeze(-1))
        return out.view_as(x)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            torch.distributed.all_reduce(t, group=self.group)
        return t


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight


def swiglu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def rope_tables(
    start: int, count: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [count, head_dim], for positions start..start+count-1 (half-split layout)."""
    inv_freq = ROPE_THETA ** (
        -torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    )
    pos = torch.arange(start, start + count, device=device, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq).repeat(1, 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


def random_weights(
    shape: LayerShape, device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Full-layer weights, N(0, 1/fan_in) so activations stay O(1); norms near 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    s = shape

    def mat(*dims: int) -> torch.Tensor:
        t = torch.randn(*dims, generator=gen, device=device, dtype=torch.float32)
        scaled: torch.Tensor = t / dims[-1] ** 0.5
        return scaled.to(dtype)

    w = {
        "attn_norm": 1 + 0.1 * mat(1, s.hidden).view(-1),
        "mlp_norm": 1 + 0.1 * mat(1, s.hidden).view(-1),
        "wq": mat(s.heads * s.head_dim, s.hidden),
        "wk": mat(s.kv_heads * s.head_dim, s.hidden),
        "wv": mat(s.kv_heads * s.head_dim, s.hidden),
        "wo": mat(s.hidden, s.heads * s.head_dim),
    }
    if s.is_moe:
        w |= {
            "router": mat(s.experts, s.hidden),
            "e_gate": mat(s.experts, s.ffn, s.hidden),
            "e_up": mat(s.experts, s.ffn, s.hidden),
            "e_down": mat(s.experts, s.hidden, s.ffn),
        }
    else:
        w |= {
            "w_gate": mat(s.ffn, s.hidden),
            "w_up": mat(s.ffn, s.hidden),
            "w_down": mat(s.hidden, s.ffn),
        }
    return w


def shard_weights(
    shape: LayerShape, w: dict[str, torch.Tensor], rank: int, tp: int
) -> tuple[LayerShape, dict[str, torch.Tensor]]:
    """Rank `rank`'s slice of full-layer weights under `tp`-way TP (Megatron split).

    Q heads, and the MLP/expert intermediate size, split evenly; KV heads split when there are
    at least `tp` of them, else each rank keeps the one its Q heads use (vLLM replicates them).
    """
    shape.check_tp(tp)
    s, hd = shape, shape.head_dim
    q_heads, ffn = s.heads // tp, s.ffn // tp
    kv = s.kv_heads // tp if s.kv_heads >= tp else 1
    kv_first = rank * kv if s.kv_heads >= tp else rank * s.kv_heads // tp
    qs = slice(rank * q_heads * hd, (rank + 1) * q_heads * hd)
    ks = slice(kv_first * hd, (kv_first + kv) * hd)
    fs = slice(rank * ffn, (rank + 1) * ffn)
    out = {
        "attn_norm": w["attn_norm"],
        "mlp_norm": w["mlp_norm"],
        "wq": w["wq"][qs],
        "wk": w["wk"][ks],
        "wv": w["wv"][ks],
        "wo": w["wo"][:, qs],
    }
    if s.is_moe:
        out |= {
            "router": w["router"],
            "e_gate": w["e_gate"][:, fs],
            "e_up": w["e_up"][:, fs],
            "e_down": w["e_down"][:, :, fs],
        }
    else:
        out |= {"w_gate": w["w_gate"][fs], "w_up": w["w_up"][fs], "w_down": w["w_down"][:, fs]}
    shard = LayerShape(s.hidden, q_heads, kv, hd, ffn, s.experts, s.active_experts)
    return shard, {k: v.contiguous() for k, v in out.items()}
