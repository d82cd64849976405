"""Device-side timing of one layer call: warm-up, then the median of repeats on fresh inputs.

On a GPU each call is bracketed by CUDA events (time on the device, not the host's launch time);
on the CPU the calls are synchronous, so `time.perf_counter_ns` around them is the device time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Repeated timings of one call, ms."""

    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.samples_ms) - min(self.samples_ms)) / self.median_ms


def time_call(
    make_inputs: Callable[[], object],
    call: Callable[[object], object],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> Timing:
    """Time `call(make_inputs())`; inputs are made fresh for every call, outside the timing."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    samples = []
    for i in range(warmup + repeats):
        inputs = make_inputs()
        ms = _timed_cuda(call, inputs) if device.type == "cuda" else _timed_host(call, inputs)
        if i >= warmup:
            samples.append(ms)
    return Timing(tuple(samples))


def _timed_cuda(call: Callable[[object], object], inputs: object) -> float:
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    start.record()
    call(inputs)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def _timed_host(call: Callable[[object], object], inputs: object) -> float:
    t0 = time.perf_counter_ns()
    call(inputs)
    return (time.perf_counter_ns() - t0) / 1e6
