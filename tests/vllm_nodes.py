"""Rendered nodes as vLLM sees them: the `vllm serve` argv of every process in user-data, model
folders holding only a `config.json` written from the model card, and one batched call of
`tests/vllm_check.py` in `.vllm-venv` (scripts/vllm_env) that runs vLLM 0.33.0's own checks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from solver.catalog.model_cards import ModelCard, load_model_cards
from tests.conftest import REPO

VLLM_PYTHON = REPO / ".vllm-venv" / "bin" / "python"
CHECK = REPO / "tests" / "vllm_check.py"
HEAD_IP = "10.0.7.21"
# Transformers architecture and model_type of each card's hf_repo (its config.json, the card's
# `source`); the other config.json fields come from the card.
ARCH = {
    "llama1-30b": ("LlamaForCausalLM", "llama"),
    "llama2-70b": ("LlamaForCausalLM", "llama"),
    "llama3.1-70b": ("LlamaForCausalLM", "llama"),
    "phi-4": ("Phi3ForCausalLM", "phi3"),
    "qwen3-32b": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3-235b-a22b": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gpt-oss-20b": ("GptOssForCausalLM", "gpt_oss"),
    "gpt-oss-120b": ("GptOssForCausalLM", "gpt_oss"),
}


@dataclass
class Proc:
    """One `vllm serve` process of a rendered node."""

    id: str  # "<file>#<process index>"
    instance: str  # CORAL_REPLICA
    model: str
    argv: list[str]
    partition: str
    env: dict[str, str] = field(default_factory=dict)


def config_json(card: ModelCard, model: str) -> dict:
    """A config.json with the card's architecture numbers (no weights, no tokenizer)."""
    arch, model_type = ARCH[model]
    cfg: dict = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": card.hidden_size,
        "intermediate_size": card.ffn_size,
        "num_attention_heads": card.attention_heads,
        "num_key_value_heads": card.kv_heads,
        "head_dim": card.head_dim,
        "num_hidden_layers": card.layers,
        "vocab_size": card.vocab_size,
        "max_position_embeddings": card.max_context,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    if model_type == "qwen3_moe":
        cfg |= {
            "num_experts": card.experts,
            "num_experts_per_tok": card.active_experts,
            "moe_intermediate_size": card.ffn_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if model_type == "gpt_oss":
        cfg |= {
            "num_local_experts": card.experts,
            "num_experts_per_tok": card.active_experts,
            "experts_per_token": card.active_experts,
            "sliding_window": card.sliding_window,
            "layer_types": ["sliding_attention", "full_attention"] * (card.layers // 2),
        }
    return cfg


def write_models(root: Path) -> dict[str, Path]:
    """One folder per model card, holding only its config.json."""
    out = {}
    for name, card in load_model_cards().items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config_json(card, name)), encoding="utf-8")
        out[name] = folder
    return out


def processes(user_data: Path) -> list[Proc]:
    """Every `vllm serve` process of one rendered user-data file, with its exact argv."""
    doc = yaml.safe_load(user_data.read_text(encoding="utf-8"))
    files = {w["path"]: w["content"] for w in doc["write_files"]}
    if "/etc/coral/node.env" not in files:  # the gateway's user-data
        return []
    env = dict(
        shlex.split(line)[0].split("=", 1)
        for line in files["/etc/coral/node.env"].splitlines()
        if "=" in line
    )
    script = files["/usr/local/bin/coral-node-start"]
    out = []
    for k, line in enumerate(re.findall(r"^\s*args=\((.*)\)\s*$", script, re.M)):
        argv = [HEAD_IP if a == "${MASTER_ADDR}" else a for a in shlex.split(line)]
        out.append(
            Proc(
                f"{user_data.parent.name}/{user_data.name}#{k}",
                env["CORAL_REPLICA"],
                env["CORAL_MODEL"],
                argv,
                env["CORAL_LAYER_PARTITION"],
                env,
            )
        )
    return out


def run_vllm_checks(procs: list[Proc], models: dict[str, Path]) -> dict[str, dict]:
    """vLLM's own checks on every process, in one subprocess of `.vllm-venv`; id -> result."""
    assert VLLM_PYTHON.exists(), (
        f"{VLLM_PYTHON} is missing: scripts/vllm_env creates it (scripts/test runs it)"
    )
    items = [
        {"id": p.id, "argv": [str(models[p.model]), *p.argv[1:]], "partition": p.partition}
        for p in procs
    ]
    env = os.environ | {
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",
        "VLLM_NO_USAGE_STATS": "1",
    }
    r = subprocess.run(
        [str(VLLM_PYTHON), str(CHECK)],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return {x["id"]: x for x in json.loads(r.stdout.strip().splitlines()[-1])}
