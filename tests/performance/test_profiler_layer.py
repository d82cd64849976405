"""The profiler's layer is numerically the architecture it claims (float64 against a reference).

The reference is written the slow, obvious way: one token and one head at a time, softmax and
SiLU from their formulas, rotary embedding pair by pair, MoE routing by sorting each token's
router scores. It shares no code with profiler/layer.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from solver.catalog.model_cards import load_model_cards
from solver.performance.profiler.cards import tiny_card
from solver.performance.profiler.layer import (
    RMS_EPS,
    ROPE_THETA,
    DecoderLayer,
    LayerShape,
    random_weights,
    rms_norm,
)
from solver.performance.profiler.measure import decode_cache
from solver.performance.profiler.tp import tp_forward

DENSE = LayerShape(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48)
MOE = LayerShape(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=16, experts=6, active_experts=2)
F64, CPU = torch.float64, torch.device("cpu")


def ref_rms(v, weight):
    return v / math.sqrt(sum(float(a) ** 2 for a in v) / len(v) + RMS_EPS) * weight


def ref_rope(v, pos):
    half, out = len(v) // 2, v.clone()
    for i in range(half):
        angle = pos * ROPE_THETA ** (-2 * i / len(v))
        c, s = math.cos(angle), math.sin(angle)
        out[i] = v[i] * c - v[i + half] * s
        out[i + half] = v[i + half] * c + v[i] * s
    return out


def ref_swiglu(v, gate, up, down):
    g = gate @ v
    return down @ (g / (1 + torch.exp(-g)) * (up @ v))


def ref_attention_one(s, w, q_in, keys, values, pos):
    """One token attending to `keys`/`values` ([tokens, kv_heads, head_dim], already rotated)."""
    heads = []
    for h in range(s.heads):
        kv = h // (s.heads // s.kv_heads)
        q = ref_rope(w["wq"][h * s.head_dim : (h + 1) * s.head_dim] @ q_in, pos)
        scores = [float(q @ k[kv]) / math.sqrt(s.head_dim) for k in keys]
        top = max(scores)
        e = [math.exp(x - top) for x in scores]
        heads.append(sum(ei / sum(e) * v[kv] for ei, v in zip(e, values, strict=True)))
    return w["wo"] @ torch.cat(heads)


def ref_mlp(s, w, v):
    if not s.is_moe:
        return ref_swiglu(v, w["w_gate"], w["w_up"], w["w_down"])
    scores = (w["router"] @ v).tolist()
    chosen = sorted(range(s.experts), key=lambda e: -scores[e])[: s.active_experts]
    z = [math.exp(scores[e] - scores[chosen[0]]) for e in chosen]
    return sum(
        zi / sum(z) * ref_swiglu(v, w["e_gate"][e], w["e_up"][e], w["e_down"][e])
        for zi, e in zip(z, chosen, strict=True)
    )


def ref_kv(s, w, n, pos):
    k = ref_rope_heads(s, (w["wk"] @ n).view(s.kv_heads, s.head_dim), pos)
    return k, (w["wv"] @ n).view(s.kv_heads, s.head_dim)


def ref_rope_heads(s, k, pos):
    return torch.stack([ref_rope(k[i], pos) for i in range(s.kv_heads)])


def ref_prefill(s, w, x):
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        normed = [ref_rms(x[b, t], w["attn_norm"]) for t in range(x.shape[1])]
        kvs = [ref_kv(s, w, n, t) for t, n in enumerate(normed)]
        for t in range(x.shape[1]):
            keys, values = zip(*kvs[: t + 1], strict=True)
            h = x[b, t] + ref_attention_one(s, w, normed[t], keys, values, t)
            out[b, t] = h + ref_mlp(s, w, ref_rms(h, w["mlp_norm"]))
    return out


def ref_decode(s, w, x, cache_k, cache_v):
    out, ctx = torch.empty_like(x), cache_k.shape[2] - 1
    for b in range(x.shape[0]):
        n = ref_rms(x[b, 0], w["attn_norm"])
        k_new, v_new = ref_kv(s, w, n, ctx)
        keys = [cache_k[b, :, u] for u in range(ctx)] + [k_new]
        values = [cache_v[b, :, u] for u in range(ctx)] + [v_new]
        h = x[b, 0] + ref_attention_one(s, w, n, keys, values, ctx)
        out[b, 0] = h + ref_mlp(s, w, ref_rms(h, w["mlp_norm"]))
    return out


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def assert_close(out, ref, x):
    """Whole output and the layer's own contribution (without the residual) within 1e-9."""
    assert rel_err(out, ref) < 1e-9
    assert rel_err(out - x, ref - x) < 1e-9


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense-gqa", "moe-top2-of-6"])
def test_prefill_matches_reference(shape):
    w = random_weights(shape, CPU, F64, seed=1)
    x = torch.randn(2, 5, shape.hidden, generator=torch.Generator().manual_seed(2), dtype=F64)
    with torch.inference_mode():
        out = DecoderLayer(shape, w)(x)
    assert_close(out, ref_prefill(shape, w, x), x)


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense-gqa", "moe-top2-of-6"])
def test_decode_with_kv_cache_matches_reference(shape):
    w = random_weights(shape, CPU, F64, seed=3)
    gen = torch.Generator().manual_seed(4)
    cache_k, cache_v = decode_cache(shape, 3, 6, CPU, F64, gen)
    x = torch.randn(3, 1, shape.hidden, generator=gen, dtype=F64)
    ref = ref_decode(shape, w, x, cache_k.clone(), cache_v.clone())
    with torch.inference_mode():
        out = DecoderLayer(shape, w)(x, (cache_k, cache_v))
    assert_close(out, ref, x)


def test_moe_runs_only_the_routed_experts():
    """Zeroing an expert no token picks leaves the output unchanged; zeroing a picked one not."""
    w = random_weights(MOE, CPU, F64, seed=5)
    x = torch.randn(1, 1, MOE.hidden, generator=torch.Generator().manual_seed(6), dtype=F64)
    layer = DecoderLayer(MOE, w)
    with torch.inference_mode():
        h = x + layer.attention(rms_norm(x, w["attn_norm"]), None)
        base = layer(x)
    scores = (w["router"] @ ref_rms(h[0, 0], w["mlp_norm"])).tolist()
    ranked = sorted(range(MOE.experts), key=lambda e: -scores[e])
    for expert, changes in ((ranked[-1], False), (ranked[0], True)):
        zeroed = dict(w) | {"e_down": w["e_down"].clone()}
        zeroed["e_down"][expert] = 0
        with torch.inference_mode():
            assert (not torch.equal(DecoderLayer(MOE, zeroed)(x), base)) is changes


# Each case spawns two processes that import torch (about 4 s on 2 cores): the KV-replicated
# split (the subtler one) runs by default, the plain split with the slow checks.
@pytest.mark.parametrize(
    ("kv_heads", "tp"),
    [pytest.param(2, 2, marks=pytest.mark.slow), (1, 2)],
    ids=["kv-split", "kv-replicated"],
)
def test_tensor_parallel_layer_equals_the_whole_layer(kv_heads, tp):
    """TP over gloo ranks (the sharded weights plus all-reduces) gives the unsplit output."""
    card = tiny_card(load_model_cards()["qwen3-235b-a22b"], kv_heads=kv_heads)
    shape = LayerShape.from_card(card)
    x = torch.randn(1, 4, shape.hidden, generator=torch.Generator().manual_seed(7), dtype=F64)
    with torch.inference_mode():
        whole = DecoderLayer(shape, random_weights(shape, CPU, F64, seed=8))(x)
    assert rel_err(tp_forward(card, tp, x, seed=8, dtype=F64), whole) < 1e-9
