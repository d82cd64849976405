"""Event-driven simulation of a plan serving request traces: TTFT, TPOT, SLO attainment, goodput.

What is modelled:

- **Instances.** Each serving instance of the plan is a pipeline of its template's stages. A
  stage's time comes from the same function the template library uses
  (`PerfModel.stage_time_ms`: its layers at its TP on its node, plus its hop to the next
  stage; the last stage sends none). A data-parallel stage (general mode: several members hold
  the same layers) splits each micro-batch across its members in proportion to their speed, and
  takes as long as its slowest share; its KV capacity is the sum of its members'.
- **Engine** (`engine_pass`, vLLM's V1 scheduler with chunked prefill), for aggregated and
  prefill-only instances: each step is one micro-batch of at most --max-num-batched-tokens
  tokens: the running requests first (a decode takes one token, a prefill in progress its next
  chunk), then waiting ones FCFS while fewer than --max-num-seqs run. A pipeline of S stages
  keeps up to S micro-batches in flight, each request in at most one, and a micro-batch enters a
  stage when that stage is free: a prefill chunk stalls the decodes of its micro-batch for its
  whole pipeline, and every micro-batch behind it. Each step is timed for what it holds
  (`InstanceModel.batch_stage_ms`: the tokens' GEMMs and elementwise kernels, the decodes'
  attention at their context, the chunks' attention). KV is paged in 16-token blocks grown as a
  request runs; when none is free, the latest admitted request that is not in a step is
  preempted and later recomputed (never an earlier one, so the oldest always progresses).
- **Disaggregated decode** (`_decode_pass`): decode advances every running sequence by one
  token per round of S x max_s(stage time at the micro-batch size ceil(running / S)); requests
  are admitted while their full KV (prompt + output) fits and fewer than --max-num-seqs run.
- **Disaggregation** (as vLLM's PD proxy runs it). The prefill instance runs with
  max_tokens=1 (the engine, each request ending at its first token). The KV cache then moves to
  a decode instance: prompt x KV bytes per token over the decode node's network, plus one hop
  latency. The decode instance streams every output token, so TTFT ends at decode's first token.
- **Routing** is the paper's: smooth weighted round-robin across a (model, phase)'s instances,
  with weights = template throughput.

Per request: TTFT, TPOT = (finish - first token) / (output - 1), end-to-end latency, and whether
both SLOs are met (TTFT <= prefill SLO, TPOT <= decode SLO). Goodput = output tokens/s of the
requests that met them. In disaggregated decode, whole runs of rounds are skipped at once (to the
next completion or arrival), timed at the model's mean decode context.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping

import numpy as np

from solver.performance.perf_model import PerfModel
from solver.plan_schema import Plan, template_ref
from solver.serving.instance_model import InstanceModel
from solver.simulation.results import ModelResult, SimResult
from solver.simulation.traces import Trace, WorkloadShape, generate_trace
from solver.stack import ModelSpec


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


KV_BLOCK_TOKENS = 16  # vLLM's default --block-size on CUDA


def engine_pass(
    inst: InstanceModel,
    arrival: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    chunk: int,
    max_seqs: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """vLLM's V1 scheduler on one instance, step by step (requests sorted by arrival). Returns
    (first token time, finish time, peak KV tokens held).

    Each step is one micro-batch of at most `chunk` tokens (--max-num-batched-tokens): the
    running requests first, in admission order (a decode takes one token, a prefill in progress
    its next chunk), then waiting requests FCFS while fewer than `max_seqs` (--max-num-seqs)
    run. So prefill chunks and decodes share every step, and a long prompt slows the decodes
    beside it. KV is paged: a request holds blocks of 16 tokens for what it has computed, grown
    as it runs; when a running request needs a block and none is free, the last admitted one is
    preempted (its blocks freed; later it recomputes its prompt and the tokens it generated).
    A pipeline of S stages keeps up to S micro-batches in flight, each request in at most one;
    a micro-batch enters a stage when that stage is free. The first token comes when the
    prefill's last chunk leaves the last stage; a request that can never fit is left unfinished
    (an SLO miss)."""
    n = len(arrival)
    arrival_l, output_l = arrival.tolist(), output.tolist()
    target = prompt.tolist()  # tokens to prefill (prompt, or prompt + generated after preemption)
    kv = [0] * n  # tokens whose KV is computed
    gen = [0] * n  # tokens generated (the first comes with the prefill's last chunk)
    blocks = [0] * n
    first, finish = [math.inf] * n, [math.inf] * n
    n_stages = len(inst.stages)
    total_blocks = inst.kv_capacity // KV_BLOCK_TOKENS
    free = total_blocks
    waiting: deque[int] = deque()
    running: list[int] = []
    busy: set[int] = set()
    flights: list[tuple[float, int, list[tuple[int, int]]]] = []  # (done, seq, [(req, tokens)])
    stage_free = [0.0] * n_stages
    t, nxt, done, seq, peak = 0.0, 0, 0, 0, 0

    def preempt(victim: int) -> None:
        nonlocal free
        free += blocks[victim]
        blocks[victim] = kv[victim] = 0
        target[victim] = int(prompt[victim]) + max(0, gen[victim])
        running.remove(victim)
        waiting.appendleft(victim)

    def schedule() -> list[tuple[int, int]]:
        nonlocal free
        budget, batch, blocked = chunk, [], False
        for rank, i in enumerate(list(running)):
            if budget <= 0:
                break
            if i in busy or i not in running:
                continue
            c = min(target[i] - kv[i], budget) if kv[i] < target[i] else 1
            need = -(-(kv[i] + c) // KV_BLOCK_TOKENS) - blocks[i]
            # Out of blocks: preempt the latest admitted request that is not in a step, never
            # an earlier one (so the oldest always progresses); when only requests in a step
            # are later, wait for them; when this is the latest, preempt it.
            while need > free:
                later = running[running.index(i) + 1 :]
                victims = [v for v in later if v not in busy]
                if not victims:
                    break
                preempt(victims[-1])
            if need > free:
                blocked = True
                if running[-1] == i and rank > 0:
                    preempt(i)
                continue
            free -= need
            blocks[i] += need
            batch.append((i, c))
            budget -= c
        while waiting and budget > 0 and len(running) < max_seqs and not blocked:
            i = waiting[0]
            c = min(target[i] - kv[i], budget)
            need = -(-(kv[i] + c) // KV_BLOCK_TOKENS) - blocks[i]
            if need > free:
                break
            waiting.popleft()
            running.append(i)
            free -= need
            blocks[i] += need
            batch.append((i, c))
            budget -= c
        return batch

    while done < n:
        while nxt < n and arrival_l[nxt] <= t:
            if -(-(target[nxt] + output_l[nxt]) // KV_BLOCK_TOKENS) > total_blocks:
                done += 1  # can never fit: unfinished
            else:
                waiting.append(nxt)
            nxt += 1
        while flights and flights[0][0] <= t:
            at, _, batch = heapq.heappop(flights)
            for i, c in batch:
                busy.discard(i)
                decoding = kv[i] >= target[i]
                kv[i] += c
                if decoding or kv[i] == target[i]:
                    gen[i] += 1
                    if first[i] == math.inf:
                        first[i] = at
                if gen[i] >= output_l[i]:
                    finish[i] = at
                    free += blocks[i]
                    blocks[i] = 0
                    running.remove(i)
                    done += 1
        if len(flights) < n_stages and stage_free[0] <= t and (waiting or len(busy) < len(running)):
            batch = schedule()
            if batch:
                decodes = [i for i, c in batch if c == 1 and kv[i] >= target[i]]
                dec_ctx = sum(kv[i] for i in decodes) / len(decodes) if decodes else 0.0
                pairs = sum(c * (kv[i] + c) for i, c in batch if kv[i] < target[i])
                tokens = sum(c for _, c in batch)
                at = t
                for s, ms in enumerate(inst.batch_stage_ms(tokens, len(decodes), dec_ctx, pairs)):
                    at = max(at, stage_free[s]) + ms / 1e3
                    stage_free[s] = at
                busy.update(i for i, _ in batch)
                seq += 1
                heapq.heappush(flights, (at, seq, batch))
                peak = max(peak, (total_blocks - free) * KV_BLOCK_TOKENS)
                continue
        events = [stage_free[0]] if stage_free[0] > t else []
        if flights:
            events.append(flights[0][0])
        if nxt < n:
            events.append(arrival_l[nxt])
        if not events:
            break  # nothing in flight, nothing to come: the rest can never be served
        t = min(events)
    return np.array(first), np.array(finish), peak


def _prefill_only(inst: InstanceModel, arrival: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """A disaggregated prefill instance: vLLM's scheduler with max_tokens=1 (each request ends
    with its first token). Returns each request's completion time (s)."""
    _, finish, _ = engine_pass(
        inst, arrival, prompt, np.ones(len(prompt), dtype=np.int64), inst.max_batched_tokens,
        inst.max_running,
    )  # fmt: skip
    return finish


def simulate(
    plan: Plan,
    models: Mapping[str, ModelSpec],
    perf: PerfModel,
    traces: dict[str, Trace],
    duration_s: float,
) -> SimResult:
    """Simulate every model's trace on the plan's instances (`models`: the stack's model
    specs, by name)."""
    results = {}
    for model, trace in sorted(traces.items()):
        spec = models[model]
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
        pre = by_phase.get("prefill", [])
        dec = by_phase.get("decode", [])
        agg = by_phase.get("aggregated", [])
        if agg:
            route = smooth_wrr([i.throughput for i in agg], n)
            for k, agg_inst in enumerate(agg):
                mine = np.flatnonzero(route == k)
                fst, fin, peak = engine_pass(
                    agg_inst,
                    trace.arrival_s[mine],
                    trace.prompt[mine],
                    trace.output[mine],
                    agg_inst.max_batched_tokens,
                    agg_inst.max_running,
                )
                first[mine], finish[mine] = fst, fin
                peaks[names["aggregated"][k]] = peak
        elif pre and dec:
            route = smooth_wrr([i.throughput for i in pre], n)
            prefill_done = np.full(n, np.inf)
            for k, pre_inst in enumerate(pre):
                mine = np.flatnonzero(route == k)
                prefill_done[mine] = _prefill_only(
                    pre_inst, trace.arrival_s[mine], trace.prompt[mine]
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
                # A prompt its prefill instance could never hold never reaches decode (a miss).
                has = (need[idx] > 0) & np.isfinite(ready[order])
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
    models: Mapping[str, ModelSpec],
    perf: PerfModel,
    duration_s: float = 600.0,
    overload: float = 1.5,
) -> list[dict[str, object]]:
    """Each template of the plan driven alone at `overload` x its planned throughput, with every
    request at the model's mean lengths: the throughput it sustains (completions in the last two
    thirds of the run) next to the template library's figure. Units as the library's: prompt
    tokens/s (prefill), output tokens/s (decode), requests/s (aggregated)."""
    fixed = WorkloadShape(1.0, 0.0, 0.0)  # Poisson arrivals, every request at the means
    rows: list[dict[str, object]] = []
    for ref in sorted({template_ref(i.model, i.phase, i.template) for i in plan.instances}):
        template = plan.templates[ref]
        spec = models[template.model]
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
        if template.phase == "prefill":
            finish = _prefill_only(inst, trace.arrival_s, trace.prompt)
            work = trace.prompt
        elif template.phase == "decode":
            _, finish, _ = _decode_pass(
                inst, trace.arrival_s, trace.prompt + trace.output, trace.output
            )
            work = trace.output
        else:
            _, finish, _ = engine_pass(
                inst,
                trace.arrival_s,
                trace.prompt,
                trace.output,
                inst.max_batched_tokens,
                inst.max_running,
            )
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
