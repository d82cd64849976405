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
- **Disaggregated decode** (`decode_pass`): decode advances every running sequence by one
  token per round of S x max_s(stage time at the micro-batch size ceil(running / S)); requests
  are admitted while their full KV (prompt + output) fits and fewer than --max-num-seqs run.
- **Disaggregation** (as vLLM's PD proxy runs it). The prefill instance runs with
  max_tokens=1 (the engine, each request ending at its first token). The KV cache then moves to
  a decode instance: prompt x KV bytes per token over the decode node's network, plus one hop
  latency. The decode instance streams every output token, so TTFT ends at decode's first token.
- **Routing** is the paper's: smooth weighted round-robin across a (model, phase)'s instances,
  with weights = template throughput.
- **Spot preemptions** (`outages`, `solver.simulation.preemption`): an instance that is down
  takes no requests (the round-robin skips it), and the requests in flight on it when it goes
  down are retried on an instance of their phase that is up, arriving there at the outage (or,
  when none is up, when the first comes back; a miss when none does within the window). A retry
  starts over (a new prefill; in disaggregated decode, the KV moved again), and its TTFT and
  latency still count from the request's arrival. The replacement instance serves again, empty,
  from the outage's `up_s`. Outages are resolved in time order (`_replay`), so each cut is the
  one the requests routed before it cause.

Per request: TTFT, TPOT = (finish - first token) / (output - 1), end-to-end latency, and whether
both SLOs are met (TTFT <= prefill SLO, TPOT <= decode SLO). Goodput = output tokens/s of the
requests that met them. In disaggregated decode, whole runs of rounds are skipped at once (to the
next completion or arrival), timed at the model's mean decode context.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from solver.errors import InputError
from solver.performance.perf_model import PerfModel
from solver.plan_schema import Plan, template_ref
from solver.serving.instance_model import InstanceModel
from solver.simulation.admission import AdmissionLimit, admit
from solver.simulation.preemption import Outage, serving_periods
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


def decode_pass(
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


Passed = tuple[np.ndarray, np.ndarray, int]  # first token, finish, peak KV tokens
PassFn = Callable[[int, np.ndarray, np.ndarray], Passed]
"""One instance's pass: (its index in the phase, the requests it is given in routing order, when
each may start there) -> (first token, finish, peak KV) per request given. Where requests start
when routed (aggregated, prefill), the starts are in order."""


@dataclass(frozen=True)
class _Life:
    """One instance of a phase (by index) serving from `start_s` until `end_s`: until its first
    outage, or its replacement from an outage's up time until the next (or inf). Each life
    starts empty."""

    instance: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class _Replayed:
    first: np.ndarray  # each request's first token (its last attempt's)
    finish: np.ndarray
    retried: np.ndarray  # bool: cut by an outage at least once
    peaks: dict[int, int]  # instance index -> peak KV tokens over its lives


def _replay(
    weights: list[float],
    periods: list[list[tuple[float, float]]],
    enter: np.ndarray,
    run: PassFn,
    duration_s: float,
    ready: np.ndarray | None = None,
) -> _Replayed:
    """One (model, phase)'s requests on instances that go down and come back (`periods`: each
    instance's serving periods, `serving_periods`). Each request is routed at `enter` and its
    work there starts at `ready` (default `enter`; disaggregated decode: routed at arrival, as
    without outages, the KV arriving after its prefill; inf: it never gets there, a miss).

    Each attempt (a leg) is routed at its entry by smooth WRR over the instances up then (one
    that is down is skipped, its current value kept), in order of entry then request, and runs
    on that instance's current life. With none up it waits for the next to come up (a miss when
    none does before `duration_s`). The outages are taken in time order: at each down time d,
    the legs on the lives ending at d that have not finished by d are cut, and their requests
    enter again at d (their work starting at d, or at `ready` when later). Routing and every pass
    are causal (what happens before d depends only on legs entering before d), so the legs a
    later cut adds never change an earlier cut: one round per down time, each rerunning only the
    lives whose legs changed. A request counts as retried when a leg whose work had started is
    cut."""
    ready = enter if ready is None else ready
    lives = [_Life(k, s, e) for k, spans in enumerate(periods) for s, e in spans]
    bounds = np.array(sorted({t for lf in lives for t in (lf.start_s, lf.end_s) if t < math.inf}))
    # The lives up in each span between bounds: span i is [bounds[i-1], bounds[i]).
    live_in = [
        [j for j, lf in enumerate(lives) if lf.start_s <= t < lf.end_s]
        for t in [-math.inf, *bounds.tolist()]
    ]
    # Where a leg entering in span i is routed: then, or when the next span with a life up opens.
    opens: list[float] = [math.inf] * len(live_in)
    following = math.inf
    for i in range(len(live_in) - 1, -1, -1):
        if live_in[i]:
            following = -math.inf if i == 0 else float(bounds[i - 1])
        opens[i] = following
    leg_req: list[int] = list(range(len(enter)))
    leg_at: list[float] = enter.tolist()  # routed at
    leg_ready: list[float] = ready.tolist()  # its work may start at
    passes: dict[tuple[int, tuple[int, ...]], Passed] = {}
    cut: set[int] = set()
    retried: set[int] = set()
    for d in [*sorted({lf.end_s for lf in lives if lf.end_s < math.inf}), math.inf]:
        span = np.searchsorted(bounds, leg_at, side="right").tolist()
        at = [
            t if live_in[i] else (opens[i] if opens[i] < duration_s else math.inf)
            for t, i in zip(leg_at, span, strict=True)
        ]
        span = np.searchsorted(bounds, at, side="right").tolist()
        current = [0.0] * len(weights)
        on: dict[int, list[int]] = {}  # life -> its legs, in routing order
        for leg in sorted(range(len(at)), key=lambda g: (at[g], leg_req[g])):
            if at[leg] == math.inf:
                continue
            up = live_in[span[leg]]
            best, top = -1, -math.inf
            for j in up:
                k = lives[j].instance
                v = current[k] = current[k] + weights[k]
                if v > top:
                    best, top = j, v
            current[lives[best].instance] -= sum(weights[lives[j].instance] for j in up)
            on.setdefault(best, []).append(leg)
        start = [max(t, r) for t, r in zip(at, leg_ready, strict=True)]
        first = np.full(len(at), math.inf)
        finish = np.full(len(at), math.inf)
        peaks: dict[int, int] = {}
        for j, legs in sorted(on.items()):
            key = (j, tuple(legs))
            if key not in passes:
                reqs = np.array([leg_req[g] for g in legs], dtype=np.int64)
                passes[key] = run(lives[j].instance, reqs, np.array([start[g] for g in legs]))
            fst, fin, peak = passes[key]
            first[legs], finish[legs] = fst, fin
            k = lives[j].instance
            peaks[k] = max(peaks.get(k, 0), peak)
        if d == math.inf:
            break
        for j, legs in sorted(on.items()):
            if lives[j].end_s != d:
                continue
            for g in legs:
                if g not in cut and finish[g] > d and start[g] < math.inf:
                    cut.add(g)
                    if start[g] < d:
                        retried.add(leg_req[g])
                    leg_req.append(leg_req[g])
                    leg_at.append(d)
                    leg_ready.append(max(d, leg_ready[g]))
    n = len(enter)
    last = np.arange(n)  # each request's last leg: the one that counts
    for g in range(n, len(leg_req)):
        last[leg_req[g]] = g
    gone = np.zeros(n, dtype=bool)
    gone[sorted(retried)] = True
    return _Replayed(first[last], finish[last], gone, peaks)


def _engine_runner(instances: list[InstanceModel], trace: Trace) -> PassFn:
    """Aggregated instances: the engine on the requests given."""

    def run(k: int, idx: np.ndarray, at: np.ndarray) -> Passed:
        inst = instances[k]
        return engine_pass(
            inst, at, trace.prompt[idx], trace.output[idx], inst.max_batched_tokens,
            inst.max_running,
        )  # fmt: skip

    return run


def _prefill_runner(instances: list[InstanceModel], trace: Trace) -> PassFn:
    """Disaggregated prefill instances: done at the first token (the peak is not kept)."""

    def run(k: int, idx: np.ndarray, at: np.ndarray) -> Passed:
        done = _prefill_only(instances[k], at, trace.prompt[idx])
        return done, done, 0

    return run


def _decode_runner(instances: list[InstanceModel], trace: Trace, hop_ms: float) -> PassFn:
    """Disaggregated decode instances: each request's KV moves in from its start (the prefill's
    end, or the outage it is retried at: the KV is assumed kept, not prefilled again), then
    decode, as `simulate` does without outages (a request never prefilled never gets here)."""

    def run(k: int, idx: np.ndarray, at: np.ndarray) -> Passed:
        inst = instances[k]
        kv_bits = trace.prompt[idx] * inst.kv_bytes_per_token * 8
        transfer = hop_ms / 1e3 + kv_bits / (inst.network_gbps * 1e9)
        ready = at + transfer
        order = np.argsort(ready, kind="stable")
        need = trace.output[idx][order]
        has = (need > 0) & np.isfinite(ready[order])
        first, finish = np.full(len(idx), math.inf), at.astype(np.float64)
        finish[order[has]] = math.inf
        peak = 0
        if has.any():
            fst, fin, peak = decode_pass(
                inst, ready[order][has], (trace.prompt + trace.output)[idx][order][has], need[has]
            )
            first[order[has]], finish[order[has]] = fst, fin
        return first, finish, peak

    return run


def _periods_of(
    keys: list[str], periods: dict[str, list[tuple[float, float]]]
) -> list[list[tuple[float, float]]] | None:
    """Each instance's serving periods, in `keys`' order; None when none has an outage."""
    if not any(k in periods for k in keys):
        return None
    return [periods.get(k, [(-math.inf, math.inf)]) for k in keys]


def simulate(
    plan: Plan,
    models: Mapping[str, ModelSpec],
    perf: PerfModel,
    traces: dict[str, Trace],
    duration_s: float,
    outages: Sequence[Outage] = (),
    admission: Mapping[str, AdmissionLimit] | None = None,
    step_scale: float = 1.0,
) -> SimResult:
    """Simulate every model's trace on the plan's instances (`models`: the stack's model
    specs, by name). `outages`: spot preemptions to replay (`solver.simulation.preemption`;
    module doc); a (model, phase) none of whose instances has one runs as without them.
    `admission`: the gateway's limits by model (`admission.admission_limits`); a model's
    requests over its limit are shed (answered 429 at once) and only the admitted ones reach
    its instances; each result counts the shed ones (`ModelResult.shed`).

    `step_scale`: every engine step and KV transfer takes this many times as long as the
    performance model says. Simulated by a change of clock, exactly: the simulator's times are
    step times and the arrival and outage times alone, so the admitted requests (admitted on
    the real clock) and the outages run with their times divided by it, and every time of the
    result is multiplied back.

    Raises:
        InputError: an outage of an instance the plan does not have.
    """
    if step_scale != 1.0:
        outages = [Outage(o.instance, o.down_s / step_scale, o.up_s / step_scale) for o in outages]
        duration_s /= step_scale
    periods = serving_periods(outages)
    unknown = sorted(set(periods) - {i.key for i in plan.instances})
    if unknown:
        raise InputError(
            "outages",
            f"{len(unknown)} instance(s) not in the plan, e.g. {unknown[0]}",
            "give outages of the simulated plan's instances (its instances[].key)",
        )
    results = {}
    for model, offered in sorted(traces.items()):
        spec = models[model]
        trace, shed = _admitted(offered, (admission or {}).get(model))
        admitted_s = trace.arrival_s
        if step_scale != 1.0:
            trace = Trace(trace.arrival_s / step_scale, trace.prompt, trace.output, trace.capped)
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
        retried = np.zeros(n, dtype=bool)
        if agg and (agg_lives := _periods_of(names["aggregated"], periods)) is not None:
            r = _replay(
                [i.throughput for i in agg], agg_lives, trace.arrival_s,
                _engine_runner(agg, trace), duration_s,
            )  # fmt: skip
            first, finish, retried = r.first, r.finish, r.retried
            peaks.update({names["aggregated"][k]: r.peaks.get(k, 0) for k in range(len(agg))})
        elif agg:
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
            if (pre_lives := _periods_of(names["prefill"], periods)) is not None:
                r = _replay(
                    [i.throughput for i in pre], pre_lives, trace.arrival_s,
                    _prefill_runner(pre, trace), duration_s,
                )  # fmt: skip
                prefill_done, retried = r.finish, r.retried
            else:
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
            if (dec_lives := _periods_of(names["decode"], periods)) is not None:
                hop_ms = perf.settings.hop_latency_ms
                r = _replay(
                    [i.throughput for i in dec], dec_lives, trace.arrival_s,
                    _decode_runner(dec, trace, hop_ms), duration_s, prefill_done,
                )  # fmt: skip
                first, finish, retried = r.first, r.finish, retried | r.retried
                peaks.update({names["decode"][k]: r.peaks.get(k, 0) for k in range(len(dec))})
            else:
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
                        fst, fin, peak = decode_pass(
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
            admitted_s,
            first * step_scale,
            finish * step_scale,
            trace.output,
            spec.slo_ms.prefill,
            spec.slo_ms.decode,
            peaks,
            prefill_done * step_scale if prefill_done is not None else None,
            int(retried.sum()),
            shed,
            offered.capped,
        )
    return SimResult(duration_s * step_scale, results)


def _admitted(trace: Trace, limit: AdmissionLimit | None) -> tuple[Trace, int]:
    """The requests of `trace` the gateway's `limit` admits, and how many it sheds."""
    if limit is None:
        return trace, 0
    keep = admit(trace.arrival_s, limit)
    kept = Trace(trace.arrival_s[keep], trace.prompt[keep], trace.output[keep])
    return kept, int(len(trace) - keep.sum())


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
            _, finish, _ = decode_pass(
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
