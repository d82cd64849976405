"""Tiny stand-ins for model cards: the same kind of layer at toy sizes, for smoke runs and tests."""

from __future__ import annotations

from typing import Any

from solver.catalog.model_cards import ModelCard

TINY_HEADS = 4


def tiny_card(card: ModelCard, **overrides: Any) -> ModelCard:
    """`card` shrunk to a layer that runs in milliseconds on a CPU.

    Keeps the kind of layer: MHA stays MHA, GQA stays GQA, a MoE card keeps several experts with
    top-k routing, a sliding window stays (shorter). Tables measured from it are smoke output,
    never data: their sidecar says `tiny`.
    """
    gqa = card.kv_heads < card.attention_heads
    sizes: dict[str, Any] = {
        "hidden_size": 64,
        "attention_heads": TINY_HEADS,
        "kv_heads": max(1, TINY_HEADS * card.kv_heads // card.attention_heads) if gqa else 4,
        "head_dim": 16,
        "ffn_size": 32 if card.is_moe else 128,
        "experts": min(card.experts, 8),
        "active_experts": min(card.active_experts, 2),
        "sliding_window": None if card.sliding_window is None else min(card.sliding_window, 16),
    }
    return card.model_copy(update=sizes | overrides)
