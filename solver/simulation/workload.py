"""The workload a model's plan is judged on: generated requests or a real trace, split so that
planning and verification never see the same requests.

A model's workload is `workload_trace` when the stack gives one (a packaged trace or a CSV in
the project), else the packaged trace its `workload` is named after ("Azure Conversation",
"Azure Code": `TRACE_SHAPES`), else requests generated like its `workload` shape
(`traces.generate_trace`; "BurstGPT" and the "(lognormal)" shapes).

Generated lengths, planned and simulated alike, come from one `traces.LengthDistribution`:
lognormal with the declared means, capped only at the model's context (the `max_context` a
caller passes, its model card's; without one nothing is capped): the prompt at max_context - 1,
the output at max_context - prompt. `planning_workload` takes its quantiles, `model_trace` and
`stack_requests` its samples; `Trace.capped` counts the requests the cap cut and
`Workload.capped_share` is the share it cuts, for `traces.cap_note` to
print. A trace's requests (packaged or CSV) are scaled to the declared means, then capped by
the same rule (`traces.cap_lengths`): a recorded prompt longer than the model serves is not
served as if it fit.

- **Generated**: planning draws with seeds `PLAN_SEED + i`, verification with `VERIFY_SEED + i`,
  a replay with `REPLAY_SEED + i` (i: the model's index in name order).
- **Trace**: the trace is cut into `TRACE_BLOCK_S` blocks; planning reads the even ones,
  verification the odd ones (`trace_window`), so both span the whole trace; a replay reads it
  all (what production would have sent, planning's requests included). Each window's
  time is scaled so its mean rate is the model's demand (the Azure traces' README suggests it:
  dividing timestamps by k multiplies the rate by k and keeps the bursts' shape), and every
  length is scaled by one factor per trace so the trace's mean prompt and output lengths become
  the stack's `mean_prompt_tokens` / `mean_output_tokens` (the template library and the demand
  in tokens/s are sized for those means). A window lasts as long as its requests do at that
  rate, at most the asked duration.

`request_rate` is a model's demand in requests/s, also for demand given in tokens/s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import numpy as np

from solver.catalog.model_cards import ModelCard, get_card
from solver.errors import InputError
from solver.io import data_path
from solver.simulation.traces import (
    LengthDistribution,
    Trace,
    WorkloadShape,
    cap_lengths,
    generate_trace,
    load_trace_csv,
    shape_of,
)
from solver.stack import ModelSpec

Purpose = Literal["plan", "verify", "replay"]
PLAN_SEED, VERIFY_SEED, REPLAY_SEED = 1_000, 2_000, 3_000
# A trace's planning and verification windows interleave in blocks of this many seconds of
# trace: long enough to keep its bursts (seconds) whole, short enough that both windows see
# every part of the hour. With halves instead, prod's gpt-oss-20b was predicted 92.2% and
# verified 96.1% on the Azure code trace (its second half is calmer); with 60 s blocks, 91.6%
# and 94.4% (docs/slo-attainment.md).
TRACE_BLOCK_S = 60.0
PACKAGED_TRACES = {
    "azure-conv-2023": "traces/azure-2023/azure_conv_2023.csv",
    "azure-code-2023": "traces/azure-2023/azure_code_2023.csv",
}
# A `workload` named after a packaged trace is that trace: its requests resampled (its length
# pairs and its bursts, in windows), not a distribution fitted to it. "<name> (lognormal)" keeps
# the generated shape (`traces.SHAPES`).
TRACE_SHAPES = {"Azure Conversation": "azure-conv-2023", "Azure Code": "azure-code-2023"}
# Quantiles of a generated shape's lengths in the capacity model's sample (planning_workload).
PLAN_QUANTILES = 400


def model_contexts(models: Iterable[str], cards: Mapping[str, ModelCard]) -> dict[str, int]:
    """Each model's context in tokens (its card's `max_context`; a length bucket's is its
    model's), for `stack_requests(max_contexts=...)`.

    Raises:
        InputError: a model without a card.
    """
    return {m: get_card(dict(cards), m).max_context for m in models}


def trace_of(spec: ModelSpec) -> str | None:
    """The trace a model's requests come from: its `workload_trace`, or the packaged trace its
    `workload` is named after; None for a generated shape."""
    return spec.workload_trace or TRACE_SHAPES.get(spec.workload)


def request_rate(spec: ModelSpec) -> float:
    """A model's demand in requests/s: as given, or its tokens/s over the mean lengths (the
    larger of the two phases' rates, so neither phase is under-loaded)."""
    d = spec.demand
    if d is None:
        return 0.0
    if d.requests_per_s is not None:
        return d.requests_per_s
    assert d.tokens_per_s is not None
    return max(
        d.tokens_per_s.prefill / spec.mean_prompt_tokens,
        d.tokens_per_s.decode / spec.mean_output_tokens,
    )


@dataclass(frozen=True)
class Workload:
    """What the capacity model needs to know of a model's requests."""

    prompts: np.ndarray  # a sample of prompt lengths (tokens), sorted
    outputs: np.ndarray  # a sample of output lengths (tokens), sorted
    arrival_scv: float  # squared CV of arrivals, as counts in 1 s windows (IDC; 1 = Poisson)
    # The share of the model's requests the context cuts: of the length distribution for a
    # generated shape (`LengthDistribution.capped_share`), of the planning window's requests
    # for a trace or a length bucket.
    capped_share: float = 0.0


def model_trace(
    spec: ModelSpec,
    index: int,
    purpose: Purpose,
    duration_s: float,
    root: Path | None = None,
    scale: float = 1.0,
    max_context: int | None = None,
) -> Trace:
    """The model's requests for planning or verification, at `scale` x its demand rate.

    Args:
        spec: the model (demand, mean lengths, workload shape or trace).
        index: the model's index in name order (seeds differ per model).
        purpose: "plan" or "verify": disjoint seeds, or disjoint halves of a trace.
        duration_s: how long, at most (a trace window may be shorter).
        root: the project folder a relative `workload_trace` path is read from.
        scale: demand multiplier (a scarce plan's served fraction, `coral simulate --load`).
        max_context: the model's context in tokens (its card's `max_context`): generated
            lengths, generated or a trace's, are capped at it (module doc); None: not capped.

    Raises:
        InputError: an unknown packaged trace or an unreadable CSV.
    """
    if spec.length_slice is not None:
        return _bucket_trace(spec, index, purpose, duration_s, root, scale, max_context)
    rate = request_rate(spec) * scale
    if trace_of(spec) is None:
        seed = {"plan": PLAN_SEED, "verify": VERIFY_SEED, "replay": REPLAY_SEED}[purpose] + index
        return generate_trace(
            rate,
            duration_s,
            spec.mean_prompt_tokens,
            spec.mean_output_tokens,
            seed=seed,
            max_context=max_context,
            shape=shape_for(spec),
        )
    return _trace_window(spec, purpose, rate, duration_s, root, max_context)


def _bucket_trace(
    spec: ModelSpec,
    index: int,
    purpose: Purpose,
    duration_s: float,
    root: Path | None,
    scale: float,
    max_context: int | None,
) -> Trace:
    """A length bucket's requests: the whole model's stream (at the model's rate and mean
    lengths) thinned to the prompts inside the bucket, so every request keeps its length,
    arrival time and burst; thinned by the lengths as drawn (or recorded), then capped at
    `max_context`, so a prompt longer than the context stays in the longest bucket."""
    s = spec.length_slice
    assert s is not None
    whole = spec.model_copy(
        update={
            "mean_prompt_tokens": s.base_prompt_tokens,
            "mean_output_tokens": s.base_output_tokens,
            "length_slice": None,
        }
    )
    full = model_trace(whole, index, purpose, duration_s, root, scale / s.share)
    keep = full.prompt > s.min_prompt_tokens
    if s.max_prompt_tokens is not None:
        keep &= full.prompt <= s.max_prompt_tokens
    prompt, output, capped = cap_lengths(full.prompt[keep], full.output[keep], max_context)
    return Trace(full.arrival_s[keep], prompt, output, capped)


def trace_window(arrival_s: np.ndarray, purpose: Purpose) -> tuple[np.ndarray, np.ndarray, float]:
    """Which of a trace's requests a purpose reads, and their arrival times in the window.

    The trace is cut into TRACE_BLOCK_S blocks; planning reads the even ones, verification the
    odd ones, each block's requests kept in order with the blocks butted together; a replay
    reads the whole trace. So the two
    windows never share a request, and both span the whole trace: an hour whose halves differ
    (the Azure code trace's second half is calmer) no longer makes one window easier.

    Returns:
        the indices of the window's requests in the trace, their arrival times (seconds of
        trace, from the window's start, blocks joined), and the window's length in seconds of
        trace (its blocks' lengths, the last one cut at the trace's end).
    """
    t = arrival_s - arrival_s[0]
    span = float(t[-1]) if len(t) else 0.0
    if purpose == "replay":
        return np.arange(len(t)), t, span
    block = np.floor(t / TRACE_BLOCK_S).astype(np.int64)
    parity = 0 if purpose == "plan" else 1
    idx = np.nonzero(block % 2 == parity)[0]
    joined = (block[idx] // 2) * TRACE_BLOCK_S + (t[idx] - block[idx] * TRACE_BLOCK_S)
    starts = np.arange(parity, int(span // TRACE_BLOCK_S) + 1, 2) * TRACE_BLOCK_S
    length = float(np.clip(span - starts, 0.0, TRACE_BLOCK_S).sum())  # each block inside the span
    return idx, joined, length


def _trace_window(
    spec: ModelSpec,
    purpose: Purpose,
    rate: float,
    duration_s: float,
    root: Path | None,
    max_context: int | None,
) -> Trace:
    full = _read_trace(trace_of(spec) or "", root)
    idx, arrival, length = trace_window(full.arrival_s, purpose)
    window_rate = len(arrival) / (length or 1.0)
    scale = window_rate / rate if rate > 0 else 1.0  # seconds of trace -> seconds at demand
    arrival = arrival * scale
    inside = arrival < duration_s
    prompt_k = spec.mean_prompt_tokens / float(full.prompt.mean())
    output_k = spec.mean_output_tokens / float(full.output.mean())
    prompt, output, capped = cap_lengths(
        np.maximum(1, np.rint(full.prompt[idx][inside] * prompt_k)).astype(np.int64),
        np.maximum(1, np.rint(full.output[idx][inside] * output_k)).astype(np.int64),
        max_context,
    )
    return Trace(arrival[inside], prompt, output, capped)


@cache
def _read_trace_cached(path: Path) -> Trace:
    return load_trace_csv(path)


def _read_trace(name: str, root: Path | None) -> Trace:
    if name in PACKAGED_TRACES:
        return _read_trace_cached(data_path(PACKAGED_TRACES[name]))
    path = Path(name)
    if not path.is_absolute():
        path = (root or Path.cwd()) / path
    if not path.exists():
        raise InputError(
            "workload_trace",
            f"no trace '{name}' (packaged: {', '.join(sorted(PACKAGED_TRACES))})",
            "name a packaged trace or a CSV of timestamp,prompt_tokens,output_tokens in the project",
        )
    return _read_trace_cached(path.resolve())


def stack_requests(
    models: Mapping[str, ModelSpec],
    duration_s: float,
    load: float = 1.0,
    seed: int | None = None,
    root: Path | None = None,
    purpose: Purpose = "verify",
    max_contexts: Mapping[str, int] | None = None,
) -> dict[str, Trace]:
    """Every model's requests at `load` x its demand, for up to `duration_s`: `model_trace`'s
    (a trace's window or generated with the purpose's seeds), or with `seed`, generated models
    drawn with seeds `seed + i` instead (i: the model's index in name order). `max_contexts`:
    each model's context (`model_contexts`), which its generated lengths are capped at; a
    model not in it is not capped."""
    out = {}
    for i, (model, spec) in enumerate(sorted(models.items())):
        if request_rate(spec) * load <= 0:
            continue
        context = (max_contexts or {}).get(model)
        if seed is not None and trace_of(spec) is None and spec.length_slice is None:
            out[model] = generate_trace(
                request_rate(spec) * load,
                duration_s,
                spec.mean_prompt_tokens,
                spec.mean_output_tokens,
                seed=seed + i,
                max_context=context,
                shape=shape_for(spec),
            )
        else:
            out[model] = model_trace(spec, i, purpose, duration_s, root, load, context)
    return out


def planning_workload(
    spec: ModelSpec, index: int, root: Path | None = None, max_context: int | None = None
) -> Workload:
    """The length sample and arrival variability the capacity model plans with: the planning
    window of the trace (or, for a length bucket, of its thinned stream, as it is verified
    on), else PLAN_QUANTILES quantiles of the lengths the shape's requests are drawn from
    (`LengthDistribution`, capped at `max_context`, the model's context; None: not capped)."""
    if trace_of(spec) is not None or spec.length_slice is not None:
        trace = model_trace(spec, index, "plan", 3_600.0, root, max_context=max_context)
        share = trace.capped / len(trace) if len(trace) else 0.0
        return Workload(np.sort(trace.prompt), np.sort(trace.output), _idc(trace.arrival_s), share)
    shape = shape_for(spec)
    lengths = LengthDistribution.of(
        spec.mean_prompt_tokens, spec.mean_output_tokens, shape, max_context
    )
    q = (np.arange(PLAN_QUANTILES) + 0.5) / PLAN_QUANTILES
    prompts, outputs = lengths.quantiles(q)
    return Workload(prompts, outputs, shape.arrival_cv**2, lengths.capped_share())


def shape_for(spec: ModelSpec) -> WorkloadShape:
    """The shape generated requests of `spec` are drawn in: its named `workload`'s, with the
    length spreads its fleet was measured serving (`measured_lengths`) where it has them."""
    shape = shape_of(spec.workload)
    measured = spec.measured_lengths
    if measured is None:
        return shape
    return WorkloadShape(shape.arrival_cv, measured.prompt_sigma, measured.output_sigma)


def _idc(arrival_s: np.ndarray, window_s: float = 1.0) -> float:
    """Index of dispersion of arrival counts in `window_s` windows (variance / mean; 1 for
    Poisson): bursts of simultaneous arrivals and rate swings raise it."""
    if len(arrival_s) < 2:
        return 1.0
    counts = np.histogram(arrival_s, bins=np.arange(0.0, arrival_s[-1] + window_s, window_s))[0]
    mean = counts.mean()
    return float(max(1.0, counts.var() / mean)) if mean > 0 else 1.0
