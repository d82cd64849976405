"""Phase times: each phase is charged its own time, nested phases theirs, the rest is "other"."""

from __future__ import annotations

import pytest

from solver import timing


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def test_nested_phases_are_charged_their_own_time(clock: Clock) -> None:
    @timing.phase("ILP")
    def solve() -> None:
        clock.now += 2.0

    with timing.timed() as times:
        clock.now += 1.0  # reading the stack: no phase
        with timing.phase("closed-loop simulation"):
            clock.now += 3.0
            solve()  # inside the simulation's block, charged to the ILP
            clock.now += 0.5
        solve()
    assert times.wall == 8.5
    table = times.table()
    assert table["ILP"] == 4.0
    assert table["closed-loop simulation"] == 3.5
    assert table["other"] == 1.0
    assert table["library"] == 0.0  # every phase is listed, in the order data flows
    assert list(table)[: len(timing.PHASES) - 1] == list(timing.PHASES[:-1])
    assert times.calls == {"ILP": 2, "closed-loop simulation": 1}


def test_phases_outside_a_timed_run_record_nothing(clock: Clock) -> None:
    with timing.timed() as times:
        pass
    with timing.phase("ILP"):
        clock.now += 5.0
    assert times.seconds == {}


def test_a_phase_that_raises_is_still_charged(clock: Clock) -> None:
    with timing.timed() as times, pytest.raises(KeyError), timing.phase("verification"):
        clock.now += 1.5
        raise KeyError("x")
    assert times.seconds == {"verification": 1.5}
