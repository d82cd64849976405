"""A recorded exposition of a fleet whose steps are slower than modelled by a known factor.

Each replica of a plan serves a share of the packaged Azure conversation trace (its own
arrival times, scaled to the replica's rate, and its own prompt and output lengths: not the
Poisson arrivals and lognormal lengths the fit replays) in the project's engine model with every
step `slowdown` x its modelled time (`InstanceModel`'s step times patched, as
tests/simulation/test_slowdown.py slows them), and vLLM's four request histograms of what it served are written in the
Prometheus exposition format by prometheus_client (as vLLM writes them), in vLLM's own buckets,
with the `coral_replica` label a scrape adds.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from solver.operations.step_calibration import Replay, ReplicaFacts, predict
from solver.serving.instance_model import InstanceModel
from solver.simulation.workload import _read_trace

# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py; `request_tokens` is its 1-2-5 series
# up to the model's context).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


def token_buckets(max_context: int) -> tuple[float, ...]:
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_context:
                return tuple(float(x) for x in out)
            out.append(m * scale)
        scale *= 10


def replica_requests(rate: float, seconds: float, seed: int) -> Replay:
    """`seconds` of the Azure conversation trace at `rate` requests/s, from a seeded offset."""
    trace = _read_trace("azure-conv-2023", None)
    rng = np.random.default_rng(seed)
    scale = (len(trace) / trace.arrival_s[-1]) / rate  # the trace's rate over ours
    start = rng.integers(0, len(trace) // 2)
    arrival = (trace.arrival_s[start:] - trace.arrival_s[start]) * scale
    keep = arrival < seconds
    prompt = trace.prompt[start:][keep]
    output = trace.output[start:][keep]
    return Replay(rate, None, None, arrival[keep], prompt, output)  # type: ignore[arg-type]


def record(
    facts: list[ReplicaFacts],
    rates: dict[str, float],
    seconds: float,
    slowdown: float,
    max_context: int,
    seed: int = 1,
    noise: float = 0.0,
    label: Callable[[str], str] = str,
) -> str:
    """The exposition of `facts`' replicas serving `seconds` at `rates` (replica -> requests/s)
    with every step `slowdown` x its modelled time; `noise` > 0 multiplies each request's
    latencies by its own lognormal factor of that sigma (what no step factor explains).
    `label`: the replica label's value of an instance key (a GCP node's is `gcp_label`'s)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine", "coral_replica"]
    tokens = token_buckets(max_context)
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", labels, registry=registry,
                     buckets=TTFT_BUCKETS)  # fmt: skip
    tpot = Histogram("vllm:request_time_per_output_token_seconds", "TPOT", labels,
                     registry=registry, buckets=TPOT_BUCKETS)  # fmt: skip
    prompt = Histogram("vllm:request_prompt_tokens", "prompt", labels, registry=registry,
                       buckets=tokens)  # fmt: skip
    generation = Histogram("vllm:request_generation_tokens", "generation", labels,
                           registry=registry, buckets=tokens)  # fmt: skip
    for i, f in enumerate(facts):
        if f.replica not in rates:
            continue
        load = replica_requests(rates[f.replica], seconds, seed + i)
        with slowed(slowdown):
            first, per_token = predict(f.instance, f.phase, load, 1.0, 1.0)
        outputs = np.ones_like(load.outputs) if f.phase == "prefill" else load.outputs
        if noise:
            jitter = np.random.default_rng(seed + 100 + i).lognormal(0.0, noise, len(first))
            first, per_token = first * jitter, per_token * jitter
        done = np.isfinite(first) & np.isfinite(per_token)
        values = (f.model, "0", label(f.replica))
        for h, xs in ((ttft, first), (tpot, per_token), (prompt, load.prompts),
                      (generation, outputs)):  # fmt: skip
            child = h.labels(*values)
            for x in np.asarray(xs, dtype=np.float64)[done]:
                child.observe(float(x))
    return generate_latest(registry).decode()


def slowed(factor: float) -> mock._patch_default_new:  # type: ignore[name-defined]
    """Every step of every InstanceModel `factor` x as long (a fresh instance's memo-free
    times: the patched methods are the ones the engine passes call)."""
    batch, decode = InstanceModel.batch_stage_ms, InstanceModel.decode_round_ms

    def slow_batch(self, *args):  # type: ignore[no-untyped-def]
        return [factor * ms for ms in batch(self, *args)]

    def slow_decode(self, running):  # type: ignore[no-untyped-def]
        return factor * decode(self, running)

    return mock.patch.multiple(InstanceModel, batch_stage_ms=slow_batch,
                               decode_round_ms=slow_decode)  # fmt: skip
