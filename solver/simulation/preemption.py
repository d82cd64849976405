"""Spot preemptions for the simulator to replay: when each spot instance of a plan is taken back,
and when its replacement serves again.

An `Outage` is one instance down from `down_s` until `up_s` (the replacement booted). They come
from the market's preemption model (`sample_outages`: each spot offer's rate per node-hour and
its zone correlation, `solver.catalog.preemption`) or from a trace of real preemptions
(`load_outages`: a CSV of `instance,down_s[,up_s]`). `simulate(..., outages=...)` replays them:
a request in flight on an instance when it goes down is retried on another instance of its
phase (`solver.simulation.simulator`'s module doc).

The sampling model: a spot instance is down when any of its nodes is taken, so its preemption
rate is the sum of its nodes' rates (exponential lifetimes, as the shipped rates assume). Each
preemption of a node of config N in zone Z, with the offer's `zone_correlation`, takes every spot
instance that uses N in Z (capacity is reclaimed per zone and type) and otherwise only its own
instance. An instance that is down is not taken again; its replacement, up `boot_s` later, can be.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from solver.catalog.market import Slot, SpotTerms
from solver.errors import InputError, unknown_value
from solver.io import read_text
from solver.plan_schema import Instance


@dataclass(frozen=True)
class Outage:
    """One instance down: taken back at `down_s`, its replacement serving again at `up_s`
    (`down_s` + the boot time; it may lie past the simulated window)."""

    instance: str  # the plan's instance key
    down_s: float
    up_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.down_s < self.up_s:
            raise ValueError(
                f"outage of {self.instance}: needs 0 <= down_s < up_s, got {self.down_s}, "
                f"{self.up_s}"
            )


@dataclass(frozen=True)
class _Clock:
    """One node of a spot instance: its preemption rate (per second) and correlation."""

    instance: int  # index into the sampled instances
    node: str
    rate_per_s: float
    zone_correlation: float


def sample_outages(
    instances: Sequence[Instance],
    spot: Mapping[Slot, SpotTerms],
    duration_s: float,
    boot_s: float,
    seed: int,
) -> list[Outage]:
    """Preemptions of the spot instances among `instances` over [0, duration_s), drawn from the
    market's spot terms (`Market.spot`), each replacement serving `boot_s` after its outage;
    sorted by time, then instance key. On-demand instances are never taken. The same inputs and
    `seed` give the same outages (numpy's Generator).

    Competing exponential clocks, one per node of every spot instance that is up: the next
    preemption comes after an exponential time at their summed rate, on a node drawn by rate
    (memoryless, so the draw is simply redone when a replacement comes up first).

    Raises:
        InputError: a spot instance's node that the market does not sell as spot in its region
            (the plan is from another market).
        ValueError: a negative window or a boot time that is not positive.
    """
    if duration_s < 0 or not boot_s > 0:
        raise ValueError(f"needs duration_s >= 0 and boot_s > 0, got {duration_s}, {boot_s}")
    taken = sorted((i for i in instances if i.is_spot), key=lambda i: i.key)
    clocks: list[_Clock] = []
    for k, inst in enumerate(taken):
        for node in inst.nodes:
            terms = spot.get(((inst.cloud, inst.region), node))
            if terms is None:
                raise InputError(
                    f"instance {inst.key}",
                    f"a spot instance on {node}, which the market does not sell as spot in "
                    f"{inst.cloud}:{inst.region}",
                    "re-plan against this market (the plan's spot instances must be on nodes "
                    "the market's spot terms cover)",
                )
            p = terms.preemption
            clocks.append(_Clock(k, node, p.rate_per_hour / 3_600.0, p.zone_correlation))
    group = [(i.cloud, i.region, i.zone) for i in taken]
    rng = np.random.default_rng(seed)
    up_at = [0.0] * len(taken)  # an instance is up from this time on
    out: list[Outage] = []
    t = 0.0
    while t < duration_s:
        live = [c for c in clocks if up_at[c.instance] <= t]
        cumulative = np.cumsum([c.rate_per_s for c in live])
        total = float(cumulative[-1]) if live else 0.0
        back = min((u for u in up_at if u > t), default=math.inf)
        step = rng.exponential(1.0 / total) if total > 0 else math.inf
        if t + step >= back:
            t = back  # a replacement is up first: draw again with it
            continue
        t += step
        if t >= duration_s:
            break
        hit = live[int(np.searchsorted(cumulative, rng.random() * total, side="right"))]
        if rng.random() < hit.zone_correlation:
            down = [
                j
                for j, inst in enumerate(taken)
                if up_at[j] <= t and group[j] == group[hit.instance] and hit.node in inst.nodes
            ]
        else:
            down = [hit.instance]
        for j in down:
            up_at[j] = t + boot_s
            out.append(Outage(taken[j].key, t, t + boot_s))
    return sorted(out, key=lambda o: (o.down_s, o.instance))


OUTAGE_COLUMNS = ("instance", "down_s", "up_s")
_OUTAGE_FIX = "write rows of instance,down_s[,up_s] under a header naming them (seconds)"


def load_outages(path: Path, boot_s: float, instances: Collection[str]) -> list[Outage]:
    """A trace of preemptions: a CSV whose header names `instance` and `down_s`, and optionally
    `up_s` (when the replacement served again; empty or absent: `down_s + boot_s`). Times are
    seconds from the start of the simulated window; `instances` are the plan's instance keys.
    Sorted by time, then instance key.

    Raises:
        InputError: naming the file and line: a missing file or header, a row that is not
            numbers, a time out of order (negative, or up_s not after down_s), an instance not
            in the plan (with the closest keys), or an instance taken while it is still down.
    """
    if not path.exists():
        raise InputError(str(path), "no such outage file", _OUTAGE_FIX)
    rows = list(csv.reader(read_text(path).splitlines()))
    header = [c.strip() for c in rows[0]] if rows else []
    if "instance" not in header or "down_s" not in header:
        raise InputError(
            f"{path}:1", f"the header must name instance and down_s, got {header}", _OUTAGE_FIX
        )
    extra = sorted(set(header) - set(OUTAGE_COLUMNS))
    if extra or len(set(header)) != len(header):
        raise InputError(
            f"{path}:1",
            f"unknown or repeated columns in {header} (known: {', '.join(OUTAGE_COLUMNS)})",
            _OUTAGE_FIX,
        )
    col = {name: header.index(name) for name in header}
    known = set(instances)
    parsed: list[tuple[Outage, int]] = []
    for line, row in enumerate(rows[1:], start=2):
        if not "".join(row).strip():
            continue
        where = f"{path}:{line}"
        if len(row) != len(header):
            raise InputError(where, f"{len(row)} columns, the header has {len(header)}: {row}",
                             _OUTAGE_FIX)  # fmt: skip
        key = row[col["instance"]].strip()
        if key not in known:
            guess = unknown_value(where, key, known, "instance of the plan")
            raise InputError(
                where, guess.problem, "use the plan's instance keys (plan.json, instances[].key)",
                guess.suggestions,
            )  # fmt: skip
        up_text = row[col["up_s"]].strip() if "up_s" in col else ""
        try:
            down = float(row[col["down_s"]])
            up = float(up_text) if up_text else down + boot_s
        except ValueError as exc:
            raise InputError(where, f"not a number of seconds: {row}", _OUTAGE_FIX) from exc
        if not (math.isfinite(down) and down >= 0 and up > down):
            raise InputError(
                where,
                f"times out of order: down_s {down}, up_s {up}",
                "down_s is at least 0 and up_s after it (or empty: down_s + the boot time)",
            )
        parsed.append((Outage(key, down, up), line))
    parsed.sort(key=lambda p: (p[0].down_s, p[0].instance, p[0].up_s))
    last_up: dict[str, float] = {}
    for o, line in parsed:
        if o.down_s < last_up.get(o.instance, -math.inf):
            raise InputError(
                f"{path}:{line}",
                f"{o.instance} is taken at {o.down_s:g} s while still down (until "
                f"{last_up[o.instance]:g} s)",
                "drop this row, or end the earlier outage before it (its up_s)",
            )
        last_up[o.instance] = o.up_s
    return [o for o, _ in parsed]


def serving_periods(outages: Sequence[Outage]) -> dict[str, list[tuple[float, float]]]:
    """Instance key -> the periods [start, end) in which it (or its replacement) serves, in
    order: from -inf to its first outage, from each `up_s` to the next outage, the last to inf.
    Overlapping outages of one instance count as one."""
    down: dict[str, list[tuple[float, float]]] = {}
    for o in sorted(outages, key=lambda o: (o.instance, o.down_s, o.up_s)):
        spans = down.setdefault(o.instance, [])
        if spans and o.down_s <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], o.up_s))
        else:
            spans.append((o.down_s, o.up_s))
    out: dict[str, list[tuple[float, float]]] = {}
    for key, spans in down.items():
        starts = [-math.inf] + [up for _, up in spans]
        ends = [d for d, _ in spans] + [math.inf]
        out[key] = list(zip(starts, ends, strict=True))
    return out


def zone_losses(instances: Sequence[Instance], at_s: float, boot_s: float) -> dict[str, list[Outage]]:
    """For each (region, zone) with spot instances: every one of them taken at `at_s`, each
    replacement serving `boot_s` later (a correlated preemption of the whole zone, the loss the
    plan's zone spread buys spare capacity for). Keyed `<cloud>:<region>/<zone>`, sorted."""
    zones: dict[str, list[Outage]] = {}
    for inst in sorted(instances, key=lambda i: i.key):
        if inst.is_spot:
            where = f"{inst.cloud}:{inst.region}/{inst.zone}"
            zones.setdefault(where, []).append(Outage(inst.key, at_s, at_s + boot_s))
    return dict(sorted(zones.items()))

