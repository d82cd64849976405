"""Wall time per planning phase: where a `coral plan` spends its seconds.

The planner marks its phases (`phase("ILP")`, ...); nothing is recorded unless a caller asks
(`timed()`), so the marks cost nothing in tests and in the Pulumi program. Phases may nest;
each is charged its own time only, the time of the phases inside it going to them, so the
phases add up to the run's wall time less `OTHER`.

    with timed() as times:
        plan = plan_with_library(...)
    times.table()  # {"library": 0.4, "capacity model": 1.1, "ILP": 6.2, ...}

A phase marks a block (`with phase("ILP"):`) or a whole function (`@phase("ILP")`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

OTHER = "other"  # wall time no phase claims (reading the stack, assembling the plan)

# The wall time a plan waits for its restricted searches after its own (mixed) search ends, when
# they run in other processes: their ILP and simulation are not in the phases above.
RESTRICTED_WAIT = "restricted searches"
# The phases of a plan, in the order data flows; `coral plan` and scripts/bench_plan list them so.
PHASES = (
    "library",
    "capacity model",
    "ILP",
    "closed-loop simulation",
    "verification",
    RESTRICTED_WAIT,
    OTHER,
)


@dataclass
class PhaseTimes:
    """Seconds and entries per phase of one timed run, and its wall time."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0
    _open: list[list[float]] = field(default_factory=list)  # [start, seconds of inner phases]

    def table(self) -> dict[str, float]:
        """Every phase of PHASES (0 when it did not run), then any other, and OTHER: the
        wall time no phase claimed."""
        out = {name: round(self.seconds.get(name, 0.0), 3) for name in PHASES if name != OTHER}
        out |= {k: round(v, 3) for k, v in sorted(self.seconds.items()) if k not in out}
        out[OTHER] = round(max(0.0, self.wall - sum(self.seconds.values())), 3)
        return out


_ACTIVE: ContextVar[PhaseTimes | None] = ContextVar("coral_phase_times", default=None)


@contextmanager
def timed() -> Iterator[PhaseTimes]:
    """Record the phases run inside this block (and its wall time) into the yielded times."""
    times = PhaseTimes()
    token = _ACTIVE.set(times)
    start = time.perf_counter()
    try:
        yield times
    finally:
        times.wall = time.perf_counter() - start
        _ACTIVE.reset(token)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Charge the time of this block, less that of the phases inside it, to `name`."""
    times = _ACTIVE.get()
    if times is None:
        yield
        return
    times._open.append([time.perf_counter(), 0.0])
    try:
        yield
    finally:
        start, inner = times._open.pop()
        elapsed = time.perf_counter() - start
        times.seconds[name] = times.seconds.get(name, 0.0) + elapsed - inner
        times.calls[name] = times.calls.get(name, 0) + 1
        if times._open:
            times._open[-1][1] += elapsed
