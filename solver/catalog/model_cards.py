"""Model cards: the architecture facts the performance model needs, from `solver/data/models.yaml`.

Derived quantities (parameters per layer, KV bytes per token) live here so that every stage computes
them the same way. Counts follow the Llama/Qwen/GPT-OSS decoder: attention has Q and O projections
of heads*head_dim and K, V projections of kv_heads*head_dim; a gated (SwiGLU) MLP has three
hidden x ffn matrices per expert; a MoE layer adds a hidden x experts router.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from solver.errors import unknown_value
from solver.io import data_path, load_yaml_model
from solver.types import base_model

ModelId = str


class ModelCard(BaseModel):
    """One model's published architecture."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    display_name: str
    hf_repo: str = Field(description="Hugging Face repository the weights come from.")
    layers: int = Field(gt=0, description="Transformer layers (num_hidden_layers).")
    hidden_size: int = Field(gt=0)
    attention_heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0, description="Key/value heads (== attention_heads for MHA).")
    head_dim: int = Field(gt=0)
    ffn_size: int = Field(gt=0, description="MLP intermediate size (per expert for MoE).")
    experts: int = Field(default=1, ge=1, description="Routed experts per layer (1 = dense).")
    active_experts: int = Field(default=1, ge=1, description="Experts each token uses.")
    vocab_size: int = Field(gt=0)
    weight_bytes_per_param: float = Field(gt=0, description="Bytes per dense/attention weight.")
    expert_weight_bytes_per_param: float | None = Field(
        default=None, gt=0, description="Bytes per expert weight when quantised differently."
    )
    sliding_window: int | None = Field(default=None, gt=0, description="Window of local layers.")
    sliding_window_layer_fraction: float = Field(default=0.0, ge=0, le=1)
    max_context: int = Field(gt=0)
    params_b: float | None = Field(default=None, gt=0, description="Published size, 1e9 params.")
    params_source: str | None = None
    source: str
    retrieved: dt.date

    @model_validator(mode="after")
    def _consistent(self) -> ModelCard:
        if self.active_experts > self.experts:
            raise ValueError(f"active_experts ({self.active_experts}) > experts ({self.experts})")
        if self.attention_heads % self.kv_heads:
            raise ValueError(
                f"attention_heads ({self.attention_heads}) must be a multiple of kv_heads "
                f"({self.kv_heads})"
            )
        return self

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    @property
    def attention_params(self) -> int:
        q_o = 2 * self.hidden_size * self.attention_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.kv_heads * self.head_dim
        return q_o + k_v

    @property
    def expert_params(self) -> int:
        """Parameters of one expert's gated MLP (the whole MLP for a dense model)."""
        return 3 * self.hidden_size * self.ffn_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.experts if self.is_moe else 0

    @property
    def expert_bytes_per_param(self) -> float:
        return self.expert_weight_bytes_per_param or self.weight_bytes_per_param

    @property
    def layer_weight_bytes(self) -> float:
        """Bytes of one layer's weights as stored on the GPU (all experts)."""
        dense = (self.attention_params + self.router_params) * self.weight_bytes_per_param
        return dense + self.experts * self.expert_params * self.expert_bytes_per_param

    @property
    def active_params_per_layer(self) -> int:
        """Parameters one token multiplies through in one layer (active experts only)."""
        return self.attention_params + self.router_params + self.active_experts * self.expert_params

    @property
    def embedding_bytes(self) -> float:
        """One vocab x hidden matrix (input embedding or LM head)."""
        return self.vocab_size * self.hidden_size * self.weight_bytes_per_param

    @property
    def weight_bytes(self) -> float:
        """Whole-model weight bytes: all layers plus input embedding and LM head."""
        return self.layers * self.layer_weight_bytes + 2 * self.embedding_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        """K and V for one token in one full-attention layer, in the 16-bit KV dtype."""
        return 2 * self.kv_heads * self.head_dim * 2.0

    def kv_tokens_held(self, context: float) -> float:
        """KV entries one sequence of `context` tokens keeps per layer, averaged over layers.

        Sliding-window layers keep at most `sliding_window` tokens; template placement treats
        layers as interchangeable, so the average is the honest per-layer figure.
        """
        if self.sliding_window is None:
            return context
        frac = self.sliding_window_layer_fraction
        return (1 - frac) * context + frac * min(context, self.sliding_window)


class ModelFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1]
    models: dict[ModelId, ModelCard]


def load_model_cards(path: Path | None = None) -> dict[ModelId, ModelCard]:
    return load_yaml_model(ModelFile, path or data_path("models.yaml")).models


def get_card(cards: dict[ModelId, ModelCard], model: ModelId) -> ModelCard:
    """The card of `model`, or of the model a length bucket ("phi-4@b1") serves."""
    model = base_model(model)
    if model not in cards:
        raise unknown_value("model", model, cards, "model")
    return cards[model]
