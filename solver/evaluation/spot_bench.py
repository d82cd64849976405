"""`coral bench spot`: what allowing spot capacity saves on a stack, at the same SLO attainment
targets, and what the plan's attainment is when the cloud takes spot nodes back.

Each stack is planned twice to its models' targets, closed loop and verification included
(`plan_recorded`): on-demand only, and with `allocation.spot` enabled (the stack's own spot
settings, else the defaults: half of each job's throughput at most, spare capacity for a whole
zone's loss). The spot plan's verification also replays the loss of each of its spot zones
(`ModelAttainment.under_preemption`). Whether a stack's preemption rates are published (the AWS
Spot Instance Advisor's buckets) or assumed is said per stack, because the downtime the plan
pays for, and so the spot columns' throughput and the plan's choice, rest on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from solver.catalog.market import build_market
from solver.evaluation.scenarios import plan_recorded
from solver.performance.perf_model import PerfModel
from solver.plan_schema import Plan
from solver.stack import FleetConfig

ASSUMED = "assumed"  # how an assumed rate's source begins (`solver.catalog.preemption`)


@dataclass(frozen=True)
class Side:
    """One plan of the comparison, in the numbers the table shows."""

    usd_per_hour: float
    served_fraction: float
    instances: int
    spot_instances: int
    worst_verified: float | None  # the lowest judged attainment over the stack's models
    below_target: tuple[str, ...]
    worst_under_preemption: float | None  # over the models with spot instances: one zone lost
    seconds: float

    @classmethod
    def of(cls, plan: Plan, seconds: float) -> Side:
        judged = [a.judged for a in plan.attainment if a.judged is not None]
        under = [a.under_preemption for a in plan.attainment if a.under_preemption is not None]
        return cls(
            usd_per_hour=round(plan.hourly_cost_usd, 2),
            served_fraction=round(plan.served_fraction, 4),
            instances=len(plan.instances),
            spot_instances=sum(i.is_spot for i in plan.instances),
            worst_verified=round(min(judged), 4) if judged else None,
            below_target=tuple(
                a.model for a in plan.attainment if a.judged is not None and a.judged < a.target
            ),
            worst_under_preemption=round(min(under), 4) if under else None,
            seconds=round(seconds, 1),
        )


def spot_fleet(fleet: FleetConfig) -> FleetConfig:
    """The stack with spot allowed (its own spot settings otherwise)."""
    spot = fleet.allocation.spot.model_copy(update={"enabled": True})
    return fleet.model_copy(
        update={"allocation": fleet.allocation.model_copy(update={"spot": spot})}
    )


def on_demand_fleet(fleet: FleetConfig) -> FleetConfig:
    """The stack with spot turned off."""
    spot = fleet.allocation.spot.model_copy(update={"enabled": False})
    return fleet.model_copy(
        update={"allocation": fleet.allocation.model_copy(update={"spot": spot})}
    )


def preemption_sources(fleet: FleetConfig, perf: PerfModel) -> dict[str, int]:
    """How many of the stack's spot slots have a measured rate, and how many an assumed one."""
    market = build_market(fleet.market_scope(), perf.catalog)
    assumed = sum(t.preemption.source.startswith(ASSUMED) for t in market.spot.values())
    return {"measured": len(market.spot) - assumed, "assumed": assumed}


def compare_stack(
    name: str,
    fleet: FleetConfig,
    perf: PerfModel,
    directory: Path,
    workers: int,
    root: Path,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`name` planned on-demand and with spot (module doc), as one row of the table."""
    sources = preemption_sources(fleet, perf)
    row: dict[str, Any] = {"stack": name, "preemption_rates": sources}
    if progress:
        progress(f"{name}: planning on-demand only")
    od = plan_recorded(name, on_demand_fleet(fleet), perf, directory, "coral", workers, root)
    row["on_demand"] = asdict(Side.of(od.plan, od.seconds))
    if not sum(sources.values()):
        row["spot"] = None
        row["note"] = "no node config of the stack sells as spot in its regions"
        return row
    if progress:
        progress(f"{name}: planning with spot allowed")
    sp = plan_recorded(name, spot_fleet(fleet), perf, directory, "coral", workers, root)
    row["spot"] = asdict(Side.of(sp.plan, sp.seconds))
    row["spot_zones"] = sorted(
        {f"{i.cloud}:{i.zone}" for i in sp.plan.instances if i.zone is not None}
    )
    if worse := worse_than_on_demand(row["on_demand"], row["spot"]):
        row["note"] = f"allowing spot ends worse than on-demand here: {worse}"
    return row


def worse_than_on_demand(od: dict[str, Any], sp: dict[str, Any]) -> str:
    """How the spot plan falls short of the on-demand one ("" when it does not): it serves a
    smaller share of demand, or misses a target the on-demand plan meets. Allowing spot should
    never do either (the closed loop also runs every search on-demand), so a row that says so
    is a fault to report, not a saving."""
    if sp["served_fraction"] < od["served_fraction"]:
        return (
            f"the spot plan serves {sp['served_fraction']:.1%} of demand against "
            f"{od['served_fraction']:.1%}"
        )
    missed = sorted(set(sp["below_target"]) - set(od["below_target"]))
    return f"the spot plan misses the target of {', '.join(missed)}" if missed else ""


def saving(row: dict[str, Any]) -> float | None:
    """1 - spot $/h / on-demand $/h, when both serve the same share of demand and the spot
    plan meets every target the on-demand one meets."""
    od, sp = row["on_demand"], row.get("spot")
    if sp is None or not od["usd_per_hour"] or sp["served_fraction"] != od["served_fraction"]:
        return None
    if worse_than_on_demand(od, sp):
        return None
    return 1 - float(sp["usd_per_hour"]) / float(od["usd_per_hour"])


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _cost(side: dict[str, Any] | None) -> str:
    """$/h, and the least served model's share when a plan cannot serve all demand."""
    if side is None:
        return "-"
    served = side["served_fraction"]
    return f"{side['usd_per_hour']:.2f}" + (f" (serves {served:.1%})" if served < 0.9995 else "")


def _attained(side: dict[str, Any] | None) -> str:
    if side is None:
        return "-"
    below = f" (below: {', '.join(side['below_target'])})" if side["below_target"] else ""
    return _pct(side["worst_verified"]) + below


def report(rows: list[dict[str, Any]], provenance: dict[str, Any]) -> str:
    """The Markdown table (and what its columns mean)."""
    lines = [
        "# Spot capacity per committed stack",
        "",
        f"`coral bench spot` at commit {provenance.get('commit') or '?'} "
        f"({provenance.get('date', '')}). Each stack is planned to its models' SLO attainment "
        "targets twice: on-demand only, and with `allocation.spot` enabled (at most half of "
        "each job's throughput from spot, spare capacity for a whole zone's loss).",
        "",
        "- **$/h**: the plan's provisioning cost, with the share of demand its least served "
        "model gets when the stack cannot serve it all; **saving**: 1 - spot / on-demand, "
        "where both serve the same share and the spot plan meets every target the on-demand "
        "plan meets.",
        "- **attainment**: the lowest verified share of requests within both SLOs over the "
        "stack's models, without preemptions (and the models below their target).",
        "- **one zone lost**: over the models that run spot instances, the lowest share on the "
        "spot plan's verification traffic with every spot instance of one of its zones taken "
        "back a third of the way in and replaced `allocation.boot_minutes` later (the worst "
        "zone; `coral plan`'s `one spot zone lost`). It can read above the attainment column, "
        "which also counts the models without spot.",
        "- **rates**: how many of the stack's spot slots have a published preemption rate (the "
        "AWS Spot Instance Advisor's bucket, its upper bound; the open `>20%` bucket taken as "
        "30%) and how many an assumed one (30% a month: every GCP slot, and AWS types the "
        "advisor does not list). Every zone correlation (0.5) is assumed. The downtime each "
        "spot instance is charged, and so the savings, rest on these rates; the zone-loss "
        "check does not (it takes a whole zone, whatever the rate).",
        "",
        "| stack | on-demand $/h | spot $/h | saving | spot instances | attainment on-demand "
        "| attainment spot | one zone lost | rates measured / assumed |",
        "|---|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for row in rows:
        od, sp = row["on_demand"], row.get("spot")
        rates = row["preemption_rates"]
        count = "-" if sp is None else f"{sp['spot_instances']} of {sp['instances']}"
        under = "-" if sp is None else _pct(sp["worst_under_preemption"])
        mark = " (note)" if row.get("note") else ""
        lines.append(
            f"| {row['stack']}{mark} | {_cost(od)} | {_cost(sp)} | {_pct(saving(row))} "
            f"| {count} | {_attained(od)} | {_attained(sp)} | {under} "
            f"| {rates['measured']} / {rates['assumed']} |"
        )
    notes = [f"- {r['stack']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join([*lines, "", *notes]).rstrip() + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """$/hour per stack, on-demand beside spot (log scale: the stacks span 3 orders)."""
    # Deferred: matplotlib is heavy and only the plot needs it.
    import matplotlib

    matplotlib.use("Agg")  # files only
    # pyplot after the backend is chosen.
    import matplotlib.pyplot as plt

    names = [r["stack"] for r in rows]
    od = [r["on_demand"]["usd_per_hour"] for r in rows]
    sp = [r["spot"]["usd_per_hour"] if r.get("spot") else 0.0 for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.2))
    ax.bar([i - 0.2 for i in x], od, width=0.4, label="on-demand only", color="C0")
    ax.bar([i + 0.2 for i in x], sp, width=0.4, label="spot allowed", color="C1")
    for i, row in enumerate(rows):
        s = saving(row)
        if s is not None:
            ax.annotate(f"{s:.0%}", (i + 0.2, sp[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("$/hour (log)")
    ax.set_title("Plan cost at the same SLO attainment targets (label: saving)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
