"""Measure with vLLM's own engine: dummy weights, two layer counts, per-layer time by difference.

vLLM is started twice, with the model config's `num_hidden_layers` overridden to L1 and then L2
(`hf_overrides`), random weights (`load_format="dummy"`) and no tokenizer, so no weights are
downloaded; only the config is read (a local folder via --hf-config, or the card's Hugging Face
repo). Everything but the decoder layers (embedding, LM head, sampling, scheduling) is the same
in both runs, so ms per layer = (t(L2) - t(L1)) / (L2 - L1). Prefill time is one generate call of
N // P prompts of P random tokens with max_tokens=1; a decode step is
(t(max_tokens=1+D) - t(max_tokens=1)) / D for B prompts of C tokens. Prefix caching is off and
every repeat draws new prompts, so no repeat reuses a cache. Each layer count runs in its own
process so the first engine's GPU memory is freed before the second starts.

The pure parts (engine arguments, the difference arithmetic) need neither vLLM nor a GPU.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solver.catalog.model_cards import ModelCard
from solver.errors import InputError
from solver.performance.profiler.measure import Grid, MeasureSpec
from solver.performance.profiler.record import PointRecord

DEFAULT_LAYERS = (2, 6)  # even counts keep alternating layer types (GPT-OSS) balanced
DECODE_STEPS = 16


class EngineUnavailable(InputError):
    """vLLM is not installed here."""


def engine_kwargs(source: str, layers: int, spec: MeasureSpec) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for one layer count."""
    largest = max(spec.sizes)
    most_seqs = largest if spec.phase == "decode" else max(1, largest // spec.context)
    most_tokens = largest if spec.phase == "prefill" else largest * spec.context
    return {
        "model": source,
        "load_format": "dummy",
        "hf_overrides": {"num_hidden_layers": layers},
        "skip_tokenizer_init": True,
        "tensor_parallel_size": spec.tp,
        "dtype": spec.dtype or "bfloat16",
        "enable_prefix_caching": False,
        "max_num_seqs": most_seqs,
        "max_num_batched_tokens": max(most_tokens, spec.context + DECODE_STEPS + 1),
        "max_model_len": spec.context + DECODE_STEPS + 1,
        "seed": spec.seed,
    }


def per_layer_ms(t_few_ms: float, t_many_ms: float, few: int, many: int) -> float:
    """ms per layer from the same call timed at two layer counts.

    Raises:
        InputError: the counts are not increasing, or the difference is not positive (noise
            larger than the layers' time).
    """
    if many <= few or few < 1:
        raise InputError("--vllm-layers", f"need 1 <= L1 < L2, got {few}, {many}", "e.g. 2,6")
    diff = t_many_ms - t_few_ms
    if diff <= 0:
        raise InputError(
            "--vllm-layers",
            f"{many} layers took {t_many_ms:.3f} ms, not more than {few} layers "
            f"({t_few_ms:.3f} ms)",
            "widen the layer counts or raise --repeats",
        )
    return diff / (many - few)


def decode_step_ms(t_prefill_only_ms: float, t_with_decode_ms: float, steps: int) -> float:
    """One decode step: the time `steps` extra tokens added, per token."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return (t_with_decode_ms - t_prefill_only_ms) / steps


def random_prompts(
    count: int, length: int, vocab_size: int, rng: random.Random
) -> list[dict[str, list[int]]]:
    """`count` prompts of `length` random token ids (vLLM's TokensPrompt shape)."""
    return [
        {"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(length)]}
        for _ in range(count)
    ]


def measure_vllm(
    card: ModelCard,
    spec: MeasureSpec,
    source: str | None,
    layers: tuple[int, int] = DEFAULT_LAYERS,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[Grid, str]:
    """Per-layer times by the two-layer-count difference; returns the grid and vLLM's version."""
    try:
        # vLLM is optional (GPU nodes only): imported only when measuring with it.
        import vllm
    except ImportError as exc:
        raise EngineUnavailable(
            "--engine vllm",
            "vLLM is not installed here",
            "pip install vllm on the GPU node, or use --engine torch",
        ) from exc
    spec.check()
    few, many = layers
    per_count = {n: _run_in_child(card, spec, source or card.hf_repo, n) for n in (few, many)}
    grid = Grid()
    for size in sorted(spec.sizes):
        ms = per_layer_ms(per_count[few][size], per_count[many][size], few, many)
        grid.points.append(PointRecord(x=size, ms_per_layer=ms, min_ms=ms, max_ms=ms))
        progress(f"{size}: {ms:.4f} ms")
    return grid, str(vllm.__version__)


def _run_in_child(card: ModelCard, spec: MeasureSpec, source: str, layers: int) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        proc = multiprocessing.get_context("spawn").Process(
            target=_engine_times, args=(card, spec, source, layers, str(out))
        )
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise InputError(
                "--engine vllm", f"the vLLM run with {layers} layers failed", "see its log above"
            )
        return {int(k): v for k, v in json.loads(out.read_text(encoding="utf-8")).items()}


def _engine_times(card: ModelCard, spec: MeasureSpec, source: str, layers: int, out: str) -> None:
    """Child process: median ms of the timed call at every size, for one layer count."""
    # vLLM is optional (GPU nodes only): imported only when measuring with it.
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(source, layers, spec))
    rng = random.Random(spec.seed)

    def run(count: int, length: int, max_tokens: int) -> float:
        prompts = random_prompts(count, length, card.vocab_size, rng)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return (time.perf_counter() - t0) * 1e3

    def once(size: int) -> float:
        if spec.phase == "prefill":
            if size <= spec.context:
                return run(1, size, 1)
            return run(size // spec.context, spec.context, 1)
        short = run(size, spec.context, 1)
        return decode_step_ms(short, run(size, spec.context, 1 + DECODE_STEPS), DECODE_STEPS)

    times = {}
    for size in spec.sizes:
        for _ in range(spec.warmup):
            once(size)
        times[size] = statistics.median(once(size) for _ in range(spec.repeats))
    Path(out).write_text(json.dumps(times), encoding="utf-8")
