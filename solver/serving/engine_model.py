"""Closed-form models of vLLM's engine on one instance under Poisson-like load: the share of
requests that meet their SLOs at a rate, and the highest rate that meets a target share.

They serve two callers, so the two can never disagree: `InstanceModel` picks the chunk
(--max-num-batched-tokens) that serves the most at the SLO, and the capacity model
(`solver.capacity.slo_capacity`) charges each template for queueing and interference at that chunk.
Both read an instance only through its stage times (`prefill_ms`, `batch_stage_ms`).

**Prefill-only** (`prefill_attainment`): under load every step is a full chunk C, so the
instance serves mu = C / period(C) prompt tokens/s and rho = rate / mu. A prompt of L tokens
waits for the queue ahead (Kingman's G/G/1 mean in token time, with an exponential tail reached
with probability rho; the prompts arriving while it waits join its first pass, which lengthens
the tail), then takes ceil(L / C) passes through every stage at their exact idle time; a pass
carries its own piece and, with probability rho, the rest of the chunk filled by other prompts
(stage time linear in tokens between 64 and C). So a big chunk is fast alone and slow under
load: each prompt waits for every prompt packed beside it.

**Aggregated** (`aggregated_meets`; vLLM's chunked prefill, prefill and decode in one step): a
request gets a token once per pass of its micro-batch through all S stages. At rate lambda,
b = lambda O TPOT sequences decode (Little), b / S per micro-batch. A prompt of L tokens
prefills in floor(L / room) full pieces of room = C - b / S tokens and one piece of the rest,
and while it does its micro-batch is heavy (its stage time with the piece), which holds every
micro-batch behind it: each pass adds its S stage steps' (heavy - light). A step where several
micro-batches carry a prompt costs their heaviest once, so with a share `busy` of passes
carrying a prompt the extra is shared by (1 - (1 - busy)^S) / (S busy). So
TPOT = S light / (1 - lambda S E[extra per prompt] x that share), with light and heavy at b / S
decodes (a fixed point in b). The rate is feasible when the target share of requests meet both SLOs:
TPOT per output length (while a request of O tokens decodes, Poisson(lambda (O - 1) TPOT)
prompts arrive, each making a run of its rounds heavy, each round at its own piece and its own
length's attention: short outputs are the ones one long prompt pushes over) times TTFT per
prompt length (half a light pass to join, a wait for a micro-batch with room, each of the S
holding one prompt for its rounds: M/G/S by Sakasegawa's approximation, Kingman's for S = 1,
with an exponential tail; and its own rounds, each as heavy as its own piece).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

BISECTION_STEPS = 24  # rate bisection, to 1e-7 of the upper bound
FIXED_POINT_STEPS = 60  # aggregated: iterations of the step-time fixed point (damped)
FIXED_POINT_TOLERANCE = 1e-6  # relative change of TPOT that ends it
SEARCH_STEPS = 12  # the chunk search's rate bisection: to 1/4096 of the upper bound


class PrefillTimes(Protocol):
    def prefill_ms(self, tokens: int) -> tuple[float, float]: ...

    def prompt_alone_ms(self, length: int, chunk: int) -> float: ...


class StepTimes(Protocol):
    @property
    def stages(self) -> Sequence[object]: ...

    def batch_stage_ms(
        self, tokens: int, decode_seqs: int, decode_context: float, prefill_pairs: float
    ) -> list[float]: ...


@dataclass(frozen=True)
class PrefillEngine:
    """What the prefill-only model needs of instances (arrays broadcast together: one entry
    per instance, or per candidate chunk): the chunk C, a pass's latency through every stage
    at C tokens and at 64, the saturated rate mu = C / period(C) in prompt tokens/s, and, per
    prompt length, the time the prompt's own passes take on an idle instance (`alone_ms`, one
    row per entry, one column per length)."""

    chunk: np.ndarray
    latency_ms: np.ndarray
    latency_64_ms: np.ndarray
    mu: np.ndarray
    alone_ms: np.ndarray
    joined_tokens: np.ndarray

    @staticmethod
    def of(inst: PrefillTimes, chunks: Sequence[int], lengths: np.ndarray) -> PrefillEngine:
        passes = [inst.prefill_ms(c) for c in chunks]
        return PrefillEngine(
            np.array(chunks, dtype=np.float64),
            np.array([lat for lat, _ in passes]),
            np.full(len(chunks), inst.prefill_ms(64)[0]),
            np.array([c / period * 1e3 for c, (_, period) in zip(chunks, passes, strict=True)]),
            np.array([[inst.prompt_alone_ms(int(x), c) for x in lengths] for c in chunks]),
            joined_tokens(np.array(chunks, dtype=np.float64), lengths),
        )

    @staticmethod
    def stack(engines: Sequence[PrefillEngine]) -> PrefillEngine:
        return PrefillEngine(
            *(np.concatenate([getattr(e, f) for e in engines]) for f in PrefillEngine.FIELDS)
        )

    FIELDS: ClassVar[tuple[str, ...]] = (
        "chunk",
        "latency_ms",
        "latency_64_ms",
        "mu",
        "alone_ms",
        "joined_tokens",
    )


def joined_tokens(chunk: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per chunk (rows) and prompt length (columns), the mean tokens one arriving prompt (of
    `lengths`, equally likely) adds to the prompt's first pass: at most the room its piece
    leaves in the chunk. Independent of the load, so computed once per engine."""
    rounds = np.ceil(lengths[None, :] / chunk[:, None])
    room = np.maximum(chunk[:, None] - lengths[None, :] / rounds, 0.0)
    return np.asarray(
        np.minimum(lengths[None, None, :], room[:, :, None]).mean(axis=2), dtype=np.float64
    )


def prefill_attainment(
    engine: PrefillEngine,
    rho: np.ndarray,
    lengths: np.ndarray,
    arrival_scv: float,
    budget_ms: float,
) -> np.ndarray:
    """Share of prompts (equally likely `lengths`) that finish prefill within `budget_ms` at
    utilization `rho` (of mu) on each instance of `engine` (module doc); vectorised over
    instances."""
    r = np.minimum(rho, 1 - 1e-9)[:, None]
    chunk, lat_c = engine.chunk[:, None], engine.latency_ms[:, None]
    lat_64, mu = engine.latency_64_ms[:, None], engine.mu[:, None]
    mean = float(lengths.mean())
    cs2 = float(lengths.var()) / mean**2
    wait_ms = r / (1 - r) * (arrival_scv + cs2) / 2 * mean / mu * 1e3
    rounds = np.ceil(lengths[None, :] / chunk)
    piece = lengths[None, :] / rounds
    # A pass filled by others costs what a full chunk costs over the piece alone (linear in the
    # piece between 64 tokens and C); the prompt's own passes take their exact idle time.
    alone = lat_64 + (lat_c - lat_64) * np.clip((piece - 64) / np.maximum(chunk - 64, 1), 0, 1)
    slack = budget_ms - engine.alone_ms - rounds * r * (lat_c - alone)
    # A prompt that waits is joined in its first pass by the prompts arriving while it waits
    # (vLLM schedules every waiting prompt into the next step, up to the chunk), which adds
    # their tokens' time to its own: the wait's tail, given a wait (mean wait_ms / r), grows by
    # what lambda x that mean brings, each arrival taking the room its piece leaves.
    per_ms = r * mu / mean / 1e3  # prompts per ms
    joined = engine.joined_tokens / mu * 1e3
    tail_ms = wait_ms / r * (1 + per_ms * joined)
    late = r * np.exp(-np.maximum(slack, 0.0) / np.maximum(tail_ms, 1e-9))
    # Steps are not preempted: an arrival that finds the first stage busy waits for the rest of
    # its pass there, up to a full chunk's period (uniform; the latency on one stage, half of
    # it on two), with the probability that the first stage is busy (the share of time the
    # prompts' own passes hold it at this rate).
    period = chunk / mu * 1e3
    held = engine.alone_ms.mean(axis=1)[:, None] * period / lat_c
    busy = np.minimum(1.0, r * mu / mean * held / 1e3)
    behind = busy * np.clip(1.0 - slack / period, 0.0, 1.0)
    met = np.where(slack >= 0, (1.0 - late) * (1.0 - behind), 0.0).mean(axis=1)
    return np.asarray(np.where(rho >= 1.0, 0.0, met), dtype=np.float64)


def prefill_capacity(
    engine: PrefillEngine,
    lengths: np.ndarray,
    arrival_scv: float,
    budget_ms: float,
    share: float,
    steps: int = BISECTION_STEPS,
) -> np.ndarray:
    """Per instance of `engine`, the highest rate (prompt tokens/s) at which `share` of the
    prompts meet `budget_ms` (`prefill_attainment`, bisection on rho in `steps`); 0 where
    even a trickle misses."""

    def ok(rho: np.ndarray) -> np.ndarray:
        return prefill_attainment(engine, rho, lengths, arrival_scv, budget_ms) >= share

    return np.asarray(highest_each(ok, len(engine.chunk), 1.0, steps) * engine.mu, dtype=np.float64)


def highest_each(
    ok: Callable[[np.ndarray], np.ndarray], n: int, top: float, steps: int = BISECTION_STEPS
) -> np.ndarray:
    """Per entry, the largest x in [0, top] with ok(x), ok falling with x (vectorised
    bisection in `steps`): `top` where ok(top), 0 where even ok(1e-4) fails."""
    lo, hi = np.zeros(n), np.full(n, top)
    ok_top = ok(hi)
    for _ in range(steps):
        mid = (lo + hi) / 2
        good = ok(mid)
        lo, hi = np.where(good, mid, lo), np.where(good, hi, mid)
    feasible = ok(np.full(n, 1e-4))
    return np.asarray(np.where(ok_top, top, np.where(feasible, lo, 0.0)), dtype=np.float64)


def aggregated_meets(
    inst: StepTimes,
    rate: float,
    lengths: np.ndarray,
    outputs: np.ndarray,
    arrival_scv: float,
    slo_ms: tuple[float, float],
    target: float,
    chunk: int,
    max_seqs: int,
) -> bool:
    """Whether `target` of the requests (prompt `lengths` and `outputs`, equally likely) meet
    both SLOs (TTFT, TPOT in ms) at `rate` requests/s on an aggregated instance (module doc)."""
    ttft_s, tpot_slo_s = slo_ms[0] / 1e3, slo_ms[1] / 1e3
    mean_prompt, mean_output = float(lengths.mean()), float(outputs.mean())
    cs2 = float(lengths.var()) / mean_prompt**2
    context = mean_prompt + mean_output / 2
    s = len(inst.stages)

    def stage_s(
        tokens: float, decodes: float, prefill: float, prompt: float = mean_prompt
    ) -> float:
        # A prompt's pieces attend to what it has cached: on average half of it before them.
        pairs = prefill * (prompt + prefill) / 2
        times = inst.batch_stage_ms(max(1, math.ceil(tokens)), math.ceil(decodes), context, pairs)
        return max(times) / 1e3

    tpot = s * stage_s(1, 1, 0)
    for _ in range(FIXED_POINT_STEPS):
        decoding = rate * mean_output * tpot  # Little: each decodes for output x TPOT
        per_batch = decoding / s
        room = chunk - per_batch
        if decoding > max_seqs or room < 1:
            return False  # more sequences than --max-num-seqs or the KV cache admit
        # vLLM fills each pass's room: a prompt takes floor(L / room) full pieces and one last
        # piece of the rest (stage time is not linear in the piece: measured GEMMs run in steps).
        full = np.floor(lengths / room)
        rest = lengths - full * room
        rounds = full + (rest > 0)
        has_rest = float((rest > 0).mean())
        mean_rest = float(rest[rest > 0].mean()) if has_rest else 0.0
        light = stage_s(per_batch, per_batch, 0)
        heavy_full = stage_s(per_batch + room, per_batch, room)
        heavy_rest = stage_s(per_batch + mean_rest, per_batch, mean_rest) if has_rest else light
        # A prompt holds one micro-batch's room for its rounds, a pass through every stage
        # each; S micro-batches are in flight, so S prompts prefill at once.
        holding = s * (float(full.mean()) * heavy_full + has_rest * heavy_rest)
        busy = rate * holding / s  # share of each micro-batch's passes that carry a prompt
        if busy >= 1:
            return False  # prompts arrive faster than the chunk beside decodes takes them
        # A heavy pass lengthens every stage step it takes by (heavy - light), and so every
        # micro-batch's pass; when several of the S micro-batches carry a prompt in the same
        # step, that step costs their heaviest only: a step is heavy with 1 - (1 - busy)^S,
        # not S busy.
        overlap = (1 - (1 - busy) ** s) / (s * busy) if busy > 0 else 1.0
        per_prompt = float(full.mean()) * (heavy_full - light) + has_rest * (heavy_rest - light)
        stall = rate * s * per_prompt * overlap
        if stall >= 1:
            return False
        nxt = s * light / (1 - stall)
        if abs(nxt - tpot) < FIXED_POINT_TOLERANCE * tpot:
            break
        tpot = (tpot + nxt) / 2
    # Each prompt's rounds at its own pieces, attending to its own length (a long prompt's
    # chunks are full and attend far: heavier than the mean's).
    own = np.array(
        [
            f * stage_s(per_batch + room, per_batch, room, x)
            + (stage_s(per_batch + r, per_batch, r, x) if r > 0 else 0.0)
            for x, f, r in zip(lengths, full, rest, strict=True)
        ]
    )
    # While a request of O tokens decodes, Poisson(rate (O - 1) TPOT) prompts arrive and each
    # adds its passes' (heavy - light), shared as above, to the S-stage passes of its window:
    # its TPOT is met while that extra stays within (SLO - S light) (O - 1) / S. Counted in
    # units of one full heavy pass's extra.
    steps = np.maximum(outputs - 1, 1)
    unit = max(heavy_full - light, 1e-12)
    allowed = (tpot_slo_s - s * light) * steps / (s * unit)
    extra = np.maximum(own - rounds * light, 0.0) * overlap / unit
    # Each heavy pass lengthens the window, letting more prompts in (a branching process with
    # mean offspring `stall` per pass): the mean is in TPOT already, the count's variance grows
    # by 1 / (1 - stall)^2 beyond Poisson's.
    dispersion = 1.0 / (1.0 - stall) ** 2
    met_tpot = compound_poisson_cdf(allowed, rate * steps * tpot, extra, dispersion)
    tpot_met = float(np.where(outputs > 1, met_tpot, 1.0).mean())
    # Waiting for a micro-batch with room: M/G/S (Sakasegawa's approximation, Kingman's for
    # S = 1), waiting at all with probability p_wait, then exponentially.
    p_wait = busy ** (math.sqrt(2 * (s + 1)) - 1)
    wait = p_wait / (s * (1 - busy)) * (arrival_scv + cs2) / 2 * holding
    slack = ttft_s - s * light / 2 - s * own
    late = p_wait * np.exp(-p_wait * np.maximum(slack, 0.0) / max(wait, 1e-12))
    ttft_met = float(np.where(slack >= 0, 1.0 - late, 0.0).mean())
    return ttft_met * tpot_met >= target


def aggregated_capacity(
    inst: StepTimes,
    lengths: np.ndarray,
    outputs: np.ndarray,
    arrival_scv: float,
    slo_ms: tuple[float, float],
    target: float,
    chunk: int,
    max_seqs: int,
    top: float,
    steps: int = BISECTION_STEPS,
) -> float:
    """The highest rate (requests/s, at most `top`) that `aggregated_meets` (bisection in
    `steps`); 0 when even a thousandth of `top` misses."""

    def ok(rate: float) -> bool:
        return aggregated_meets(
            inst, rate, lengths, outputs, arrival_scv, slo_ms, target, chunk, max_seqs
        )

    return _highest(ok, top, floor=1e-3, steps=steps)


def _highest(
    ok: Callable[[float], bool], top: float, floor: float = 1e-4, steps: int = BISECTION_STEPS
) -> float:
    """Largest rate in [0, top] with ok(rate), ok falling with the rate (bisection)."""
    if ok(top):
        return top
    if not ok(top * floor):
        return 0.0
    lo, hi = 0.0, top
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def compound_poisson_cdf(
    limit: np.ndarray, mean: np.ndarray, sizes: np.ndarray, dispersion: float = 1.0
) -> np.ndarray:
    """P(sum of N sizes <= limit), N with the given mean and variance `dispersion` x mean
    (Poisson at 1, negative binomial above), sizes drawn from the sample `sizes`: per N exactly
    for N = 0 and by a normal approximation of the sum for N >= 1 (vectorised over the
    limit/mean pairs)."""
    # scipy.stats takes about 0.8 s to import, and nothing else a plan imports loads it.
    from scipy.special import ndtr
    from scipy.stats import nbinom, poisson

    m, v = float(sizes.mean()), float(sizes.var())
    top = int(np.ceil(mean.max() + 8 * np.sqrt(dispersion * mean.max()) + 8))
    n = np.arange(top + 1)[None, :]
    if dispersion > 1.0 + 1e-9:
        weight = nbinom.pmf(n, mean[:, None] / (dispersion - 1.0), 1.0 / dispersion)
    else:
        weight = poisson.pmf(n, mean[:, None])
    spread = np.sqrt(np.maximum(n * v, 1e-12))
    within = np.where(n == 0, 1.0, ndtr((limit[:, None] + 0.5 - n * m) / spread))
    out = (weight * within).sum(axis=1)
    return np.asarray(np.where(limit < 0, 0.0, np.clip(out, 0.0, 1.0)), dtype=np.float64)
