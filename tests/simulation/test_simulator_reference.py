"""The simulator's fast decode pass and routing against their plain numpy formulation, bit for
bit: every first-token and finish time, every peak, every route.

The reference functions below re-scan the running batch with numpy at every event; the simulator
keeps a heap of finishing rounds, Python scalars and a tiled round-robin sequence instead. Both
do the same float operations in the same order, so results must be equal, not close.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.simulation.simulator import decode_pass, smooth_wrr


@dataclass
class Instance:
    """Stage times with awkward floats, so a changed order of operations shows."""

    kv_capacity: int
    max_running: int
    max_prefill_tokens: int
    round_base: float
    round_slope: float

    def decode_round_ms(self, running: int) -> float:
        return self.round_base + self.round_slope * math.sqrt(running)

    def prefill_ms(self, tokens: int) -> tuple[float, float]:
        key = -(-tokens // 64) * 64
        return key * 0.0731 + 1.37, key * 0.0379 + 0.11


def ref_wrr(weights: list[float], n: int) -> np.ndarray:
    current = [0.0] * len(weights)
    total = sum(weights)
    out = np.empty(n, dtype=np.int64)
    for r in range(n):
        for i, w in enumerate(weights):
            current[i] += w
        best = max(range(len(weights)), key=lambda i: (current[i], -i))
        current[best] -= total
        out[r] = best
    return out


def ref_rounds(
    t: float,
    k: int,
    round_s: float,
    run_idx: np.ndarray,
    run_left: np.ndarray,
    finish: np.ndarray,
    context: np.ndarray,
    kv_used: int,
) -> tuple[float, np.ndarray, np.ndarray, int]:
    t += k * round_s
    run_left = run_left - k
    done = run_left == 0
    if done.any():
        finish[run_idx[done]] = t
        kv_used -= int(context[run_idx[done]].sum())
        run_idx, run_left = run_idx[~done], run_left[~done]
    return t, run_idx, run_left, kv_used


Passed = tuple[np.ndarray, np.ndarray, int]  # first token, finish, peak KV


def ref_decode(
    inst: Instance, ready: np.ndarray, context: np.ndarray, tokens: np.ndarray
) -> Passed:
    n = len(ready)
    first, finish = np.full(n, np.inf), np.full(n, np.inf)
    run_idx = np.empty(0, dtype=np.int64)
    run_left = np.empty(0, dtype=np.int64)
    kv_used = peak = 0
    t, nxt = 0.0, 0
    while nxt < n or len(run_idx):
        admit: list[int] = []
        while (
            nxt < n
            and ready[nxt] <= t
            and kv_used + context[nxt] <= inst.kv_capacity
            and len(run_idx) + len(admit) < inst.max_running
        ):
            kv_used += int(context[nxt])
            admit.append(nxt)
            nxt += 1
        if admit:
            run_idx = np.concatenate([run_idx, np.array(admit, dtype=np.int64)])
            run_left = np.concatenate([run_left, tokens[admit]])
        if nxt < n and context[nxt] > inst.kv_capacity and ready[nxt] <= t and not len(run_idx):
            nxt += 1
            continue
        peak = max(peak, kv_used)
        if not len(run_idx):
            t = max(t, ready[nxt])
            continue
        round_s = inst.decode_round_ms(len(run_idx)) / 1e3
        k = int(run_left.min())
        blocked = nxt < n and (
            kv_used + context[nxt] > inst.kv_capacity or len(run_idx) >= inst.max_running
        )
        if nxt < n and not blocked and ready[nxt] > t:
            k = min(k, max(1, math.ceil((ready[nxt] - t) / round_s)))
        new = np.isinf(first[run_idx])
        first[run_idx[new]] = t + round_s
        t, run_idx, run_left, kv_used = ref_rounds(
            t, k, round_s, run_idx, run_left, finish, context, kv_used
        )
    return first, finish, peak


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


# (gap to the previous arrival in s, prompt tokens, output tokens): gaps of 0 make ties
REQUESTS = st.lists(
    st.tuples(
        st.one_of(st.just(0.0), st.floats(0, 0.5)), st.integers(1, 3000), st.integers(1, 200)
    ),
    min_size=1,
    max_size=150,
)
INSTANCES = st.builds(
    Instance,
    kv_capacity=st.integers(200, 40_000),
    max_running=st.one_of(st.just(1 << 30), st.integers(1, 48)),
    max_prefill_tokens=st.one_of(st.just(1 << 30), st.integers(64, 4096)),
    round_base=st.floats(0.5, 40),
    round_slope=st.floats(0, 3),
)


def arrays(reqs: list[tuple[float, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrival = np.cumsum([r[0] for r in reqs])
    return arrival, np.array([r[1] for r in reqs]), np.array([r[2] for r in reqs])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(REQUESTS, INSTANCES)
def test_decode_pass_is_the_reference_bit_for_bit(reqs, inst):
    ready, prompt, output = arrays(reqs)
    context = prompt + output
    first, finish, peak = decode_pass(inst, ready, context, output)
    ref_first, ref_finish, ref_peak = ref_decode(inst, ready, context, output)
    assert same(first, ref_first) and same(finish, ref_finish) and peak == ref_peak


WEIGHTS = st.one_of(
    st.lists(st.floats(0.01, 1e5), min_size=1, max_size=12),  # distinct floats
    st.lists(st.integers(1, 9).map(float), min_size=1, max_size=12),  # periodic, ties
    st.tuples(st.floats(0.01, 1e5), st.integers(1, 12)).map(lambda p: [p[0]] * p[1]),  # equal
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(WEIGHTS, st.integers(0, 400))
def test_smooth_wrr_is_the_reference_sequence(weights, n):
    assert same(smooth_wrr(weights, n), ref_wrr(weights, n))
