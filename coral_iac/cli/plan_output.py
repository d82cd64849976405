"""What `coral plan` prints about a plan: its tables (stdout) and the solver's lines (stderr).

docs/output.md explains every column and line.
"""

from __future__ import annotations

from typing import Any

from coral_iac.cli.console import FittedTable, err, out

REPLAY_TOLERANCE = 0.03  # verified vs whole-trace attainment: more apart than this is said


def show_plan(p: Any) -> None:
    """The plan's tables, then the solver's objective and why the SLO closed loop stopped."""
    out.print(plan_table(p))
    if p.attainment:
        out.print(attainment_table(p))
    if p.routing:
        out.print(routing_table(p))
    if p.solver:
        err.print(solver_line(p), highlight=False)
    for line in p.binding:
        err.print(f"[yellow]Limited by:[/] {line}", highlight=False)
    if p.closed_loop_stop:
        err.print(
            f"SLO closed loop ended at {p.hourly_cost_usd:,.2f} $/h: {p.closed_loop_stop}",
            highlight=False,
        )


def plan_table(p: Any) -> FittedTable:
    """Per (model, phase): instances, templates per region, throughput against demand, $/h."""
    title = (
        f"Plan {p.stack} ({p.method}, mode {p.mode}): {p.hourly_cost_usd:,.2f} $/hour, "
        f"{len(p.instances)} instances, served "
        + (f"{100 * p.served_fraction:.1f}%" if p.served_fraction >= 1 else p.short_words())
    )
    table = FittedTable(title=title)
    right = ("instances", "$/hour")
    for col in (
        "model",
        "phase",
        "instances",
        "templates (region: count)",
        "throughput / demand",
        "$/hour",
    ):
        table.add_column(col, justify="right" if col in right else "left")
    for job in p.jobs:
        mine: dict[str, int] = {}
        for i in p.instances:
            if (i.model, i.phase) == (job.model, job.phase):
                spot = f" spot {i.zone}" if i.market == "spot" else ""
                k = f"{i.cloud}:{i.region} {i.template}{spot}"
                mine[k] = mine.get(k, 0) + 1
        table.add_row(
            job.model,
            job.phase,
            str(job.instances),
            "\n".join(f"{k}: {n}" for k, n in sorted(mine.items())) or "-",
            f"{job.throughput:,.0f} / {job.demand:,.0f} {job.unit}",
            f"{job.usd_per_hour:,.2f}",
        )
    return table


def solver_line(p: Any) -> str:
    """The cost solve's status and objective, the objective split into the plan's $/hour and
    the start-up penalty it adds (K x the $/hour of instances the running plan lacks)."""
    s = p.solver
    bound = "no bound" if s.best_bound is None else f"bound {s.best_bound:,.2f}"
    gap = "gap unknown" if s.gap is None else f"gap {100 * s.gap:.2f}%"
    # Both parts as printed, so the sum reads right to the cent.
    objective, cost = round(s.objective, 2), round(p.hourly_cost_usd, 2)
    return (
        f"Solver {s.backend}: {s.status}, objective {objective:,.2f} = {cost:,.2f} $/h + "
        f"{max(0.0, objective - cost):,.2f} start-up penalty (K x the $/h of new instances), "
        f"{bound}, {gap}, {s.solve_seconds:.2f} s"
    )


def attainment_table(p: Any) -> FittedTable:
    """Per model: SLO attainment target, on the planning workload, and verified on requests
    the planner never saw at the whole demand behind the gateway's admission control (the
    admitted requests' share, with the margin the held-out sample cannot vouch for), the share
    shed, and the same at 1.5x the demand (a spike); as if every engine step took 1.2x and 1.5x
    as long as modelled (`slower steps`). For a trace-backed model the verified
    share is the lower of the trace's held-out windows and the whole trace
    (`ModelAttainment.judged`), both shown before it; the closed loop's headroom per phase."""
    table = FittedTable(title="SLO attainment (share of requests meeting both TTFT and TPOT SLOs)")
    replayed = any(a.replayed is not None for a in p.attainment)
    evidence = ("held-out", "whole trace") if replayed else ()
    spot = any(a.under_preemption is not None for a in p.attainment)
    lost = ("one spot zone lost",) if spot else ()
    sheds = any(a.shed is not None for a in p.attainment)
    admitted = ("shed", "1.5x demand") if sheds else ()
    slow = ("slower steps",) if any(a.slower for a in p.attainment) else ()
    cols = ("model / workload", "target", "planned", *evidence, "verified", *admitted, *slow,
            *lost, "headroom")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in (cols[0], "headroom") else "right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    for a in p.attainment:
        status = "[green]meets[/]" if a.verified is not None and not a.short_by else ""
        if a.short_by:
            status = f"[red]short {100 * a.short_by:.1f} pts[/]"
        elif a.unsupported:
            status = "[red]too few requests[/]"
        if "@" in a.model:  # a length bucket: its model as a whole is judged on its own row
            status = "bucket" if not a.short_by else f"bucket, {100 * a.short_by:.1f} pts under"
        margin = f"\nmargin {100 * a.margin:+.1f} pts" if a.margin is not None else ""
        held_out = f"{pct(a.verified)}\n({a.verified_minutes:g} min)"
        verified = f"{pct(a.judged)}{margin}\n{status}"
        spike = f"{pct(a.spike)}\n{pct(a.spike_shed)} shed" if a.spike is not None else "-"
        table.add_row(
            f"{a.model}\n{a.workload}"
            + (f"\n{a.capped:,} capped at its context" if a.capped else ""),
            pct(a.target),
            pct(a.planned),
            *(
                (held_out, pct(a.replayed), verified)
                if replayed
                else (f"{held_out}{margin}\n{status}",)
            ),
            *((pct(a.shed), spike) if sheds else ()),
            *(("\n".join(f"{k}x: {pct(v)}" for k, v in a.slower.items()) or "-",) if slow else ()),
            *((pct(a.under_preemption),) if spot else ()),
            "\n".join(f"{ph} {k:.2f}" for ph, k in a.headroom.items()) or "-",
        )
    return table


def routing_table(p: Any) -> FittedTable:
    """Length routing per model that asks for it: the decision, both plans' cost (and verified
    attainment), and each bucket: its prompt tokens, Content-Length bound, share and target."""
    table = FittedTable(title="Length routing (requests to buckets by prompt length)")
    for col in ("model", "routed", "one pool $/h", "buckets $/h", "buckets", "why"):
        table.add_column(col, justify="right" if "$" in col else "left")

    def cost(usd: float | None, verified: float | None) -> str:
        at = f" ({100 * verified:.1f}%)" if verified is not None else ""
        return "-" if usd is None else f"{usd:,.2f}{at}"

    def bucket(b: Any) -> str:
        where = (
            f"<={b.max_prompt_tokens:g} tok ({b.max_body_bytes} B)"
            if b.max_prompt_tokens is not None
            else f">{b.min_prompt_tokens:g} tok"
        )
        return f"{b.name.split('@')[1]}: {where}, {100 * b.share:.0f}%, target {100 * b.target:g}%"

    for d in p.routing:
        table.add_row(
            d.model,
            "yes" if d.routed else "no",
            cost(d.one_pool_usd_per_hour, d.one_pool_verified),
            cost(d.routed_usd_per_hour, d.routed_verified),
            "\n".join(bucket(b) for b in d.buckets),
            d.reason,
        )
    return table


def diff_table(title: str, diff: dict[str, Any]) -> FittedTable:
    """`coral plan diff`: instances added and removed, and $/hour before and after, per model."""
    table = FittedTable(title=title)
    for col in ("model", "added", "removed", "$/hour before", "$/hour after", "change"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for m, row in diff["by_model"].items():
        table.add_row(
            m,
            str(row["added"]),
            str(row["removed"]),
            f"{row['before']:,.2f}",
            f"{row['after']:,.2f}",
            f"{row['after'] - row['before']:+,.2f}",
        )
    return table
