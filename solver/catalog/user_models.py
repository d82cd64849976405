"""Your own models: a model card built from the model's Hugging Face `config.json`.

A stack serves any decoder-only model whose card it declares under `coral:fleet.model_cards`:

    model_cards:
      my-llama-8b:
        config: models/my-llama-8b/config.json   # relative to the stacks folder
        hf_repo: my-org/my-llama-8b              # what each node downloads at boot
        retrieved: 2026-11-30                    # when you took the config

The card's architecture (layers, hidden size, heads, KV heads, head size, MLP size, experts,
vocabulary, context, weight dtype) is read from the config; any card field written next to
`config` wins over it, and a card may also be written out whole without a config. The result is
a `UserModelCard`, used by every stage exactly like a built-in card.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from solver.catalog.model_cards import ModelCard, ModelId, load_model_cards
from solver.errors import InputError
from solver.io import read_text

# torch dtype names in config.json -> bytes per weight (what vLLM loads unquantised).
DTYPE_BYTES = {"bfloat16": 2.0, "float16": 2.0, "half": 2.0, "float32": 4.0, "float": 4.0}

# Card field -> the config.json keys that give it, first found wins (Llama, Qwen, Mistral,
# Mixtral, Qwen-MoE, DeepSeek and GPT-OSS spell some of them differently).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "attention_heads": ("num_attention_heads", "n_head"),
    "vocab_size": ("vocab_size",),
    "max_context": ("max_position_embeddings", "n_positions", "max_sequence_length"),
}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


class UserModelCard(ModelCard):
    """A model card a stack declares, and where its architecture came from."""

    config: str | None = Field(
        default=None, description="The config.json it was read from, relative to the stacks folder."
    )
    safetensors_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Bytes of the repository's *.safetensors (model.safetensors.index.json "
        "metadata.total_size), for the node's disk; default: the weights x 1.1.",
    )


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((cfg[k] for k in keys if cfg.get(k) is not None), None)


def card_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The card fields a Hugging Face `config.json` gives (its `text_config` for a multimodal
    model).

    Raises:
        InputError: a field the card needs is missing (named, with the config keys tried), or
            the weight dtype is one the card cannot size.
    """
    if "text_config" in cfg and _first(cfg, CONFIG_KEYS["layers"]) is None:
        cfg = cfg["text_config"]
    fields: dict[str, Any] = {}
    for name, keys in CONFIG_KEYS.items():
        value = _first(cfg, keys)
        if value is None:
            raise InputError(
                where,
                f"no {name}: none of {', '.join(keys)} is in the config",
                f"use the model's own config.json, or write `{name}:` next to `config:`",
            )
        fields[name] = value
    heads = fields["attention_heads"]
    fields["kv_heads"] = cfg.get("num_key_value_heads") or heads
    fields["head_dim"] = cfg.get("head_dim") or fields["hidden_size"] // heads
    experts = _first(cfg, EXPERT_KEYS) or 1
    fields["experts"] = experts
    if experts > 1:
        fields["active_experts"] = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
        fields["ffn_size"] = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    else:
        fields["ffn_size"] = cfg.get("intermediate_size") or cfg.get("n_inner")
    for name in ("active_experts", "ffn_size"):
        if fields.get(name, 1) is None:
            raise InputError(
                where,
                f"no {name} in the config",
                f"write `{name}:` next to `config:` (the MLP size per expert, experts per token)",
            )
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise InputError(
            where,
            f"weight dtype '{dtype}' is not one the card can size",
            "write `weight_bytes_per_param:` next to `config:` (e.g. 1 for 8-bit weights)",
            sorted(DTYPE_BYTES),
        )
    fields["weight_bytes_per_param"] = DTYPE_BYTES[dtype]
    fields.update(_sliding_window(cfg))
    return fields


def _sliding_window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Sliding-window attention: `layer_types` says which layers slide (GPT-OSS, Gemma); without
    it a window applies to every layer unless `use_sliding_window` is false (Qwen2 configs
    carry a window they do not use)."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return {}
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        fraction = sum(t == "sliding_attention" for t in types) / len(types)
    else:
        fraction = 1.0
    return {"sliding_window": window, "sliding_window_layer_fraction": fraction} if fraction else {}


def resolve_entry(entry: Any, where: str, stacks_dir: Path | None) -> Any:
    """A stack's `model_cards.<id>` entry with its `config` file read in (explicit fields win).

    Entries without `config` (a card written out whole) and non-mappings (which validation then
    refuses with the key path) pass through unchanged.

    Raises:
        InputError: the config file is missing, unreadable or not a JSON object.
    """
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), str):
        return entry
    path = Path(entry["config"])
    if not path.is_absolute() and stacks_dir is not None:
        path = stacks_dir / path
    where = f"{where}.config"
    try:
        cfg = json.loads(read_text(path))
    except InputError as exc:
        raise InputError(
            where,
            f"{exc.field}: {exc.problem}",
            "give the model's config.json, its path relative to the stacks folder",
        ) from exc
    except json.JSONDecodeError as exc:
        raise InputError(
            where, f"{path} is not JSON: {exc.msg} (line {exc.lineno})", "give the config.json"
        ) from exc
    if not isinstance(cfg, dict):
        raise InputError(where, f"{path} is not a JSON object", "give the model's config.json")
    fields = card_fields(cfg, f"{where} ({path})")
    repo = entry.get("hf_repo", "?")
    defaults = {"display_name": repo.rsplit("/", 1)[-1], "source": f"config.json of {repo}"}
    return defaults | fields | entry


def stack_cards(user: Mapping[ModelId, ModelCard]) -> dict[ModelId, ModelCard]:
    """The shipped cards plus a stack's own (`FleetConfig.model_cards`).

    Raises:
        InputError: a stack card reuses a built-in id.
    """
    shipped = load_model_cards()
    for model in user:
        if model in shipped:
            raise InputError(
                f"coral:fleet.model_cards.{model}",
                "is a built-in model id",
                f"use the built-in card (remove this entry), or another id (e.g. {model}-custom)",
            )
    return shipped | dict(user)
