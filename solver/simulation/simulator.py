"""Event-driven simulation of a plan serving request traces: TTFT, TPOT, SLO attainment, goodput.

What is modelled:

- **Instances.** Each serving instance of the plan is a pipeline of its template's stages. A
  stage's time comes from the same function the template library uses
  (`PerfModel.stage_time_ms`: its layers at its TP on its node, plus its hop to the next
  stage; the last stage sends none). A data-parallel stage (general mode: several members hold
  the same layers) splits each micro-batch across its members in proportion to their speed, and
  takes as long as its slowest share; its KV capacity is the sum of its members'.
- **Pipeline.** A pipeline with S stages keeps up to S micro-batches in flight:
  - a new prefill micro-batch can start every max_s(stage time), and each finishes after the
    sum of its stages;
  - decode advances every running sequence by one token per round of S x max_s(stage time at
    the micro-batch size ceil(running / S)).
- **Continuous batching.** Decode admits waiting requests at every event while their full KV
  (prompt + output) fits the instance's KV capacity: the smallest stage capacity. So nothing is
  preempted.
- **Prefill.** FCFS, batching the prompts that have arrived, up to the KV capacity and
  `max_batch_tokens`.
- **Disaggregation** (as vLLM's PD proxy runs it). The prefill instance runs with
  max_tokens=1. The KV cache then moves to a decode instance: prompt x KV bytes per token over
  the decode node's network, plus one hop latency. The decode instance streams every output
  token, so TTFT ends at decode's first token.
- **Aggregated instances** time-share one pipeline between the phases, as vLLM's scheduler does
  without chunked prefill: whenever arrived prompts fit (KV and the running cap), a prefill pass
  runs and every running sequence waits for it; otherwise decode rounds run. So prefill passes
  stall decoding, and TPOT includes the stalls.
- **Routing** is the paper's: smooth weighted round-robin across a (model, phase)'s instances,
  with weights = template throughput.

Per request: TTFT, TPOT = (finish - first token) / (output - 1), end-to-end latency, and whether
both SLOs are met (TTFT <= prefill SLO, TPOT <= decode SLO). Goodput = output tokens/s of the
requests that met them. Between events, whole runs of decode rounds are skipped at once (to the
next completion or arrival). Decode rounds are timed at each model's mean decode context.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from solver.performance.perf_model import PerfModel
from solver.plan.schema import Plan, template_ref
from solver.simulation.results import ModelResult, SimResult
from solver.simulation.traces import Trace
from solver.stack import FleetConfig
from solver.templates.instance_model import InstanceModel


def smooth_wrr(weights: list[float], n: int) -> np.ndarray:
    """nginx's smooth weighted round-robin: instance index for each of n requests, in order.

    Each request adds every weight to its instance's current value, picks the largest (the
    lowest index on a tie) and takes the total off it. When the current values all come back
    to exactly zero, the sequence so far repeats (it is a function of them): it is tiled."""
    k = len(weights)
    if k == 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    current = [0.0] * k
    total = sum(weights)
    zero = [0.0] * k
    pairs = list(enumerate(weights))
    out: list[int] = []
    for _ in range(n):
        best, top = 0, -math.inf
        for i, w in pairs:
            v = current[i] = current[i] + w
            if v > top:
                best, top = i, v
        current[best] = top - total
        out.append(best)
        if current == zero:
            break
    return np.resize(np.array(out, dtype=np.int64), n)


def _chunked_prefill(
    inst: InstanceModel, start: float, prompts: list[int], limit: int
) -> tuple[list[float], float]:
    """A batch of prompts streamed through the pipeline in chunks of at most `limit` tokens
    (vLLM's chunked prefill, with --max-num-batched-tokens = limit), starting at `start`.
    Returns each prompt's completion time (its last chunk out of the last stage) and when the
    pipeline can take new work (the first stage is free again). The last chunk is timed at
    its own size."""
    total = sum(prompts)
    chunk = min(total, limit)
    n = math.ceil(total / chunk)
    latency, period = inst.prefill_ms(chunk)
    last_latency, last_period = inst.prefill_ms(total - (n - 1) * chunk)
    last_ms = (n - 1) * period + last_latency
    done, tokens = [], 0
    for p in prompts:
        tokens += p
        k = math.ceil(tokens / chunk)  # the chunk this prompt ends in (1-based)
        done.append(start + (latency + (k - 1) * period if k < n else last_ms) / 1e3)
    return done, start + ((n - 1) * period + last_period) / 1e3


def _prefill_pass(
    inst: InstanceModel, arrival: np.ndarray, prompt: np.ndarray, cap: int
) -> np.ndarray:
    """FCFS batched prefill on one instance: whenever the pipeline is free, the prompts that
    have arrived, up to `limit` tokens (one prompt over it is chunked). Returns each request's
    completion time (s). (A lone prompt within the limit is one chunk: its latency, inline.)"""
    n = len(arrival)
    arrival_l, prompt_l = arrival.tolist(), prompt.tolist()
    done: list[float] = []
    timing: dict[int, tuple[float, float]] = {}  # prompt tokens -> (latency, period)
    t_free, i = 0.0, 0
    limit = max(1, min(cap, inst.kv_capacity, inst.max_prefill_tokens))
    while i < n:
        start = arrival_l[i] if arrival_l[i] > t_free else t_free
        j, tokens = i + 1, prompt_l[i]
        while j < n and arrival_l[j] <= start and tokens + prompt_l[j] <= limit:
            tokens += prompt_l[j]
            j += 1
        if j == i + 1 and tokens <= limit:
            if tokens not in timing:
                timing[tokens] = inst.prefill_ms(tokens)
            latency, period = timing[tokens]
            done.append(start + latency / 1e3)
            t_free = start + period / 1e3
        else:
            batch, t_free = _chunked_prefill(inst, start, prompt_l[i:j], limit)
            done += batch
        i = j
    return np.array(done, dtype=np.float64)


def _decode_pass(
    inst: InstanceModel, ready: np.ndarray, context: np.ndarray, tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Continuous-batching decode of `tokens` tokens per request, requests ready at `ready`
    (sorted), each holding `context` KV tokens at the end. Returns (first decode token time,
    finish time, peak KV tokens used).

    The running sequences are a heap of the round (counted from the start) each finishes in,
    so an event costs the requests it admits and finishes, not the batch size."""
    n = len(ready)
    ready_l, ctx, tok = ready.tolist(), context.tolist(), tokens.tolist()
    first, finish = [math.inf] * n, [math.inf] * n
    capacity, max_running = inst.kv_capacity, inst.max_running
    running: list[tuple[int, int]] = []  # (round it finishes in, request)
    round_of: dict[int, float] = {}  # batch size -> round time (s)
    push, pop = heapq.heappush, heapq.heappop
    kv_used = peak = rounds = size = 0
    t, nxt = 0.0, 0
    while nxt < n or size:
        # Admit every ready request whose KV fits (FCFS: stop at the first that does not).
        admitted = nxt
        while (
            nxt < n and ready_l[nxt] <= t and kv_used + ctx[nxt] <= capacity and size < max_running
        ):
            kv_used += ctx[nxt]
            push(running, (rounds + tok[nxt], nxt))
            nxt += 1
            size += 1
        if nxt < n and ctx[nxt] > capacity and ready_l[nxt] <= t and not size:
            nxt += 1  # can never fit: leave it unfinished (counts as an SLO miss)
            continue
        if kv_used > peak:
            peak = kv_used
        if not size:
            t = max(t, ready_l[nxt])
            continue
        round_s = round_of.get(size)
        if round_s is None:
            round_s = round_of[size] = inst.decode_round_ms(size) / 1e3
        k = running[0][0] - rounds
        if nxt < n and kv_used + ctx[nxt] <= capacity and size < max_running and ready_l[nxt] > t:
            k = min(k, max(1, math.ceil((ready_l[nxt] - t) / round_s)))
        if nxt > admitted:
            first[admitted:nxt] = [t + round_s] * (nxt - admitted)
        t += k * round_s
        rounds += k
        while size and running[0][0] == rounds:  # finished: leave, KV freed
            i = pop(running)[1]
            finish[i] = t
            kv_used -= ctx[i]
            size -= 1
    return np.array(first), np.array(finish), peak


def _aggregated_pass(
    inst: InstanceModel, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, cap: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Prefill and decode time-sharing one instance (requests sorted by arrival). Returns (first
    token time = end of its prefill, finish time, peak KV tokens used).

    Prefill has priority: whenever arrived prompts fit (KV and the running cap), all of them
    stream through the pipeline in chunks of `limit` tokens and decode waits until the first
    stage is free again; a request decodes once its prefill is out of the last stage. (Draining
    the queue per prefill turn matters when a decode round is expensive: alternating one
    prompt with one round would spend most of the time on rounds.)"""
    n = len(arrival)
    arrival_l, prompt_l, output_l = arrival.tolist(), prompt.tolist(), output.tolist()
    ctx = (prompt + output).tolist()
    first, finish = [math.inf] * n, [math.inf] * n
    capacity, max_running = inst.kv_capacity, inst.max_running
    limit = max(1, min(cap, inst.kv_capacity, inst.max_prefill_tokens))
    running: list[tuple[int, int]] = []  # decoding: (round it finishes in, request)
    pending: list[tuple[float, int]] = []  # prefilled: (out of the pipeline at, request)
    round_of: dict[int, float] = {}  # batch size -> round time (s)
    kv_used = peak = rounds = 0
    t, nxt = 0.0, 0
    while nxt < n or running or pending:
        while pending and pending[0][0] <= t:  # prefills out of the pipeline join decoding
            i = heapq.heappop(pending)[1]
            if output_l[i] - 1 <= 0:  # nothing left to decode: done with its first token
                finish[i] = first[i]
                kv_used -= ctx[i]
            else:
                heapq.heappush(running, (rounds + output_l[i] - 1, i))
        if nxt < n and ctx[nxt] > capacity:
            nxt += 1  # can never fit: leave it unfinished (counts as an SLO miss)
            continue
        batch, busy = nxt, len(running) + len(pending)
        while (
            nxt < n
            and arrival_l[nxt] <= t
            and kv_used + ctx[nxt] <= capacity
            and busy + nxt - batch < max_running
        ):
            kv_used += ctx[nxt]
            nxt += 1
        peak = max(peak, kv_used)
        if nxt > batch:
            first[batch:nxt], t = _chunked_prefill(inst, t, prompt_l[batch:nxt], limit)
            for i in range(batch, nxt):
                heapq.heappush(pending, (first[i], i))
            continue
        if not running:
            waits = [pending[0][0]] if pending else []
            if nxt < n and arrival_l[nxt] > t:  # an arrived one that did not fit waits
                waits.append(arrival_l[nxt])
            if waits:  # else nothing left, or ready ones finished above
                t = max(t, min(waits))
            continue
        if len(running) not in round_of:
            round_of[len(running)] = inst.decode_round_ms(len(running)) / 1e3
        round_s, k = round_of[len(running)], running[0][0] - rounds
        blocked = nxt < n and (kv_used + ctx[nxt] > capacity or busy >= max_running)
        if nxt < n and not blocked:  # stop decoding when the next prompt can start prefill
            k = min(k, max(1, math.ceil((arrival_l[nxt] - t) / round_s)))
        if pending:  # or when a prefill comes out of the pipeline
            k = min(k, max(1, math.ceil((pending[0][0] - t) / round_s)))
        t += k * round_s
        rounds += k
        while running and running[0][0] == rounds:  # finished: leave, KV freed
            i = heapq.heappop(running)[1]
            finish[i] = t
            kv_used -= ctx[i]
    return np.array(first), np.array(finish), peak


def simulate(
    plan: Plan, fleet: FleetConfig, perf: PerfModel, traces: dict[str, Trace], duration_s: float
) -> SimResult:
    """Simulate every model's trace on the plan's instances."""
    results = {}
    for model, trace in sorted(traces.items()):
        spec = fleet.models[model]
        by_phase: dict[str, list[InstanceModel]] = {}
        names: dict[str, list[str]] = {}
        shared: dict[str, InstanceModel] = {}  # replicas of one template time alike
        for inst in plan.instances:
            if inst.model != model:
                continue
            ref = template_ref(model, inst.phase, inst.template)
            if ref not in shared:
                shared[ref] = InstanceModel.serving(perf, plan.templates[ref], spec)
            by_phase.setdefault(inst.phase, []).append(shared[ref])
            names.setdefault(inst.phase, []).append(inst.key)
        n = len(trace)
        first = np.full(n, np.inf)
        finish = np.full(n, np.inf)
        peaks: dict[str, int] = {}
        prefill_done: np.ndarray | None = None
        cap = perf.settings.max_batch_tokens
        pre = by_phase.get("prefill", [])
        dec = by_phase.get("decode", [])
        agg = by_phase.get("aggregated", [])
        if agg:
            route = smooth_wrr([i.throughput for i in agg], n)
            for k, agg_inst in enumerate(agg):
                mine = np.flatnonzero(route == k)
                fst, fin, peak = _aggregated_pass(
                    agg_inst, trace.arrival_s[mine], trace.prompt[mine], trace.output[mine], cap
                )
                first[mine], finish[mine] = fst, fin
                peaks[names["aggregated"][k]] = peak
        elif pre and dec:
            route = smooth_wrr([i.throughput for i in pre], n)
            prefill_done = np.full(n, np.inf)
            for k, pre_inst in enumerate(pre):
                mine = np.flatnonzero(route == k)
                prefill_done[mine] = _prefill_pass(
                    pre_inst, trace.arrival_s[mine], trace.prompt[mine], cap
                )
            # vLLM's PD proxy: prefill runs with max_tokens=1, the KV moves, and the decode
            # instance streams every output token, so the client's first token is decode's first.
            need = trace.output
            droute = smooth_wrr([i.throughput for i in dec], n)
            for k, dec_inst in enumerate(dec):
                mine = np.flatnonzero(droute == k)
                kv_bits = trace.prompt[mine] * dec_inst.kv_bytes_per_token * 8
                transfer = perf.settings.hop_latency_ms / 1e3 + kv_bits / (
                    dec_inst.network_gbps * 1e9
                )
                ready = prefill_done[mine] + transfer
                order = np.argsort(ready, kind="stable")
                idx = mine[order]
                has = need[idx] > 0
                f = np.where(has, np.inf, prefill_done[idx])
                if has.any():
                    fst, fin, peak = _decode_pass(
                        dec_inst,
                        ready[order][has],
                        (trace.prompt + trace.output)[idx][has],
                        need[idx][has],
                    )
                    f[has] = fin
                    first[idx[has]] = fst
                    peaks[names["decode"][k]] = peak
                finish[idx] = f
        results[model] = ModelResult(
            model,
            trace.arrival_s,
            first,
            finish,
            trace.output,
            spec.slo_ms.prefill,
            spec.slo_ms.decode,
            peaks,
            prefill_done,
        )
    return SimResult(duration_s, results)


def capacity_check(
    plan: Plan,
    fleet: FleetConfig,
    perf: PerfModel,
    duration_s: float = 600.0,
    overload: float = 1.5,
) -> list[dict[str, object]]:
    """Each template of the plan driven alone at `overload` x its planned throughput, with every
    request at the model's mean lengths: the throughput it sustains (completions in the last two
    thirds of the run) next to the template library's figure. Units as the library's: prompt
    tokens/s (prefill), output tokens/s (decode), requests/s (aggregated)."""
    from solver.simulation.traces import WorkloadShape, generate_trace

    fixed = WorkloadShape(1.0, 0.0, 0.0)  # Poisson arrivals, every request at the means
    rows: list[dict[str, object]] = []
    for ref in sorted({template_ref(i.model, i.phase, i.template) for i in plan.instances}):
        template = plan.templates[ref]
        spec = fleet.models[template.model]
        inst = InstanceModel.serving(perf, template, spec)
        per_request = {
            "prefill": spec.mean_prompt_tokens,
            "decode": spec.mean_output_tokens,
            "aggregated": 1.0,
        }[template.phase]
        rate = overload * template.throughput / per_request
        trace = generate_trace(
            rate, duration_s, spec.mean_prompt_tokens, spec.mean_output_tokens, shape=fixed
        )
        cap = perf.settings.max_batch_tokens
        if template.phase == "prefill":
            finish = _prefill_pass(inst, trace.arrival_s, trace.prompt, cap)
            work = trace.prompt
        elif template.phase == "decode":
            _, finish, _ = _decode_pass(
                inst, trace.arrival_s, trace.prompt + trace.output, trace.output
            )
            work = trace.output
        else:
            _, finish, _ = _aggregated_pass(inst, trace.arrival_s, trace.prompt, trace.output, cap)
            work = np.ones(len(trace), dtype=np.int64)
        start = duration_s / 3
        window = (finish >= start) & (finish < duration_s)
        simulated = float(work[window].sum()) / (duration_s - start)
        rows.append(
            {
                "model": template.model,
                "phase": template.phase,
                "template": template.key,
                "library": round(template.throughput, 3),
                "simulated": round(simulated, 3),
                "ratio": round(simulated / template.throughput, 3),
                "max_running": inst.max_running,
                "kv_capacity_tokens": inst.kv_capacity,
            }
        )
    return rows
