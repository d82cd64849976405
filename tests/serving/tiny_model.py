"""A tiny model folder for booting rendered nodes on CPU, made here without downloads: a
`config.json` of the card's architecture family at toy sizes, random weights (safetensors) and a
byte-level BPE tokenizer trained on text at hand. Run with `.vllm-cpu-venv/bin/python` (torch,
transformers and tokenizers); importing it needs none of them until `make_tiny_model` is called.

Usage: tiny_model.py OUT_DIR [--architecture A] [--layers N] [--positions N] [--corpus FILE ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 4, 2, 512, 2048
SEED = 0  # same weights every run: greedy outputs are comparable between set-ups
# The architectures of the model cards (their published config.json's `model_type`), each with
# what it needs beyond the shared toy sizes: experts for the mixtures of experts.
ARCHITECTURES: dict[str, dict[str, object]] = {
    "llama": {},
    "phi3": {"pad_token_id": 0},  # its default (32000) is outside the toy vocabulary
    "qwen3": {"head_dim": HIDDEN // HEADS},
    "qwen3_moe": {
        "head_dim": HIDDEN // HEADS,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": FFN // 2,
    },
    "gpt_oss": {
        "head_dim": HIDDEN // HEADS,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
    },
}


def make_tiny_model(
    out: Path, layers: int, positions: int, corpus: list[Path], architecture: str = "llama"
) -> None:
    """Write a model of `architecture` (a `model_type` in ARCHITECTURES) with `layers` layers
    and `positions` positions to `out`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(p) for p in corpus], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    config = AutoConfig.for_model(
        architecture,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="bfloat16",
        **ARCHITECTURES[architecture],
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    # Several shards and their index, as real repositories have: each node loads only its own.
    model.save_pretrained(out, safe_serialization=True, max_shard_size="1MB")
    (out / "coral-tiny.json").write_text(json.dumps({"layers": layers, "positions": positions}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--architecture", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--corpus", type=Path, nargs="+", required=True)
    args = parser.parse_args()
    make_tiny_model(args.out, args.layers, args.positions, args.corpus, args.architecture)


if __name__ == "__main__":
    main()
