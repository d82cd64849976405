"""`coral plan`: solve a stack's allocation (or a baseline), validate it, show and diff plans."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from coral_iac.cli.console import (
    err,
    library_root,
    load_stack_named,
    out,
    print_json,
    progress_bar,
    reports_errors,
    stacks_dir,
    warn,
)
from coral_iac.deployable import unverified_placements

plan_app = typer.Typer(
    help="Plan a stack: the cheapest template instances per region that meet demand.",
    invoke_without_command=True,
)
EXIT_SCARCE = 3


@plan_app.callback()
@reports_errors
def plan(
    ctx: typer.Context,
    stack: Annotated[
        str | None, typer.Option(help="Stack name (stacks/Pulumi.<stack>.yaml).")
    ] = None,
    baseline: Annotated[
        str | None,
        typer.Option(help="Run a baseline: homo, cauchy, or the paper's homo-paper, cauchy-paper."),
    ] = None,
    previous: Annotated[
        Path | None, typer.Option(help="The running plan (start-up penalty counts from it).")
    ] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write plan.json here.")] = None,
    library: Annotated[
        Path | None,
        typer.Option(
            help="Template-library folder (default .coral/library/<stack>; built if missing or stale)."
        ),
    ] = None,
    workers: Annotated[int, typer.Option(help="Worker processes for a library build.")] = 2,
    strict: Annotated[
        bool,
        typer.Option(
            help="Exit 3 (and leave --out untouched) when demand cannot be fully served or a "
            "model's verified SLO attainment is below its target."
        ),
    ] = False,
    add_only: Annotated[
        bool,
        typer.Option(
            help="Keep every instance of --previous and only add (coral:fleet.allocation.add_only)."
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(help="Build into a --library folder that another stack's libraries own."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Solve the allocation for a stack and print (and optionally write) the plan."""
    if ctx.invoked_subcommand is not None:
        return
    from solver.errors import InputError

    if stack is None:
        raise InputError("--stack", "missing", "pass --stack NAME (a stacks/Pulumi.<NAME>.yaml)")
    if baseline not in (None, "homo", "cauchy", "homo-paper", "cauchy-paper"):
        raise InputError(
            "--baseline",
            f"unknown baseline '{baseline}'",
            "use homo, cauchy, homo-paper or cauchy-paper",
        )
    if add_only and previous is None:
        raise InputError("--add-only", "needs the running plan", "pass --previous plan.json")
    if add_only and baseline in ("homo", "homo-paper", "cauchy-paper"):
        raise InputError(
            "--add-only", f"the {baseline} baseline ignores the running plan", "drop one of the two"
        )
    if out_file is not None and out_file.is_dir():  # before minutes of planning, not after
        raise InputError(str(out_file), "is a folder", "give a file path, e.g. plan.json")
    from solver.timing import timed

    with timed() as times:
        result, problems = make_plan(
            stack, baseline or "coral", previous, library, workers, add_only, force
        )
    if (line := gap_warning(result)) is not None:
        warn(line)
    failed = result.served_fraction < 1 or bool(result.below_target())
    # A zero-served plan, or one failing --strict, never replaces the running plan in --out.
    write = out_file is not None and not (strict and failed) and result.serves_any()
    if write:
        from solver.io import write_atomic

        assert out_file is not None
        write_atomic(out_file, result.model_dump_json(indent=1) + "\n")
    unverified = unverified_placements(result)
    if as_json:
        extra = {"deploy_problems": problems, "unverified": unverified, "timings": times.table()}
        print_json(plan_json(result) | extra)
    else:
        show_plan(result)
        err.print(phase_line(times), highlight=False)
        if write:
            err.print(f"Wrote {out_file}")
        show_deployable(problems)
    for line in unverified:
        warn(line)
    for a in result.below_target():
        warn(
            f"{a.model}: SLO attainment {100 * (a.judged or 0):.1f}% on the "
            + ("whole trace" if a.judged != a.verified else "verification workload")
            + f", {100 * a.short_by:.1f} points below its target {100 * a.target:g}%: "
            f"{a.cause}"
        )
    for a in result.attainment:
        if a.replay_gap > REPLAY_TOLERANCE:
            warn(
                f"{a.model}: {100 * (a.verified or 0):.1f}% verified on the trace's held-out "
                f"windows, {100 * (a.replayed or 0):.1f}% on the whole trace "
                f"({100 * a.replay_gap:.1f} points apart): the trace's windows differ more "
                "than one window can show; the plan is judged by the lower"
            )
    if out_file is not None and not write:
        err.print(f"Left {out_file} as it was.")
    if strict and failed:
        raise typer.Exit(EXIT_SCARCE)


def phase_line(times: Any) -> str:
    """The run's wall time and its phases that took time, in one line."""
    spent = [f"{name} {s:.1f} s" for name, s in times.table().items() if s >= 0.05]
    return f"Planned in {times.wall:.1f} s: " + ", ".join(spent)


def make_plan(
    stack: str,
    method: str,
    previous: Path | None,
    library: Path | None,
    workers: int,
    add_only: bool = False,
    force: bool = False,
) -> tuple[Any, list[str]]:
    """Load the stack, its libraries and the running plan; solve; validate; return the plan and
    why the Pulumi program would refuse it (empty: it deploys).

    `add_only` turns on coral:fleet.allocation.add_only (keep every running instance).
    """
    from coral_iac.cli.deploy import check_plan_stack
    from coral_iac.demand_sources import resolve_demand
    from coral_iac.deployable import deploy_problems
    from solver.catalog.vllm_support import check_deployable_gpus
    from solver.performance.default_model import load_perf_model
    from solver.plan.planner import plan_with_library

    # The same demand the Pulumi program plans for: the stack's demand source.
    fleet = resolve_demand(
        load_stack_named(stack),
        stack,
        stacks_dir(),
        warn=warn,
    )
    # A deployable stack naming a GPU the pinned vLLM build cannot run is refused before any
    # library is built (solver/data/vllm_build.yaml: V100, sm_70).
    check_deployable_gpus(fleet.node_configs, fleet.library.mode, stack)
    if add_only:
        allocation = fleet.allocation.model_copy(update={"add_only": True})
        fleet = fleet.model_copy(update={"allocation": allocation})
    perf = load_perf_model(cards=fleet.model_cards)
    running = load_plan(previous) if previous is not None else None
    check_plan_stack(running, stack, previous)
    with progress_bar() as bar:
        tasks: dict[Any, Any] = {}

        def progress(job: Any, done: int, total: int) -> None:
            if job not in tasks:
                tasks[job] = bar.add_task(f"templates {job[0]} {job[1]}", total=total)
            bar.update(tasks[job], completed=done)

        result = plan_with_library(
            stack,
            fleet,
            perf,
            library or library_root() / stack,
            running,
            method,  # type: ignore[arg-type]
            workers,
            progress,
            root=stacks_dir().parent,
            on_round=lambda line: err.print(f"SLO closed loop, {line}", highlight=False),
            force=force,
        )
    return result, deploy_problems(result, fleet, perf.catalog)


def load_plan(path: Path) -> Any:
    from solver.errors import InputError
    from solver.io import parse_model
    from solver.plan.schema import Plan

    if not path.exists():
        raise InputError(
            str(path), "no such plan file", "pass a plan.json written by `coral plan --out`"
        )
    import json

    try:
        from solver.io import read_text

        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise InputError(
            str(path), f"not JSON: {e}", "pass a plan.json written by `coral plan --out`"
        ) from e
    return parse_model(Plan, data, str(path))


def show_deployable(problems: list[str]) -> None:
    if not problems:
        err.print("Deployable: `pulumi up` accepts this plan.")
        return
    err.print("[red]`pulumi up` will refuse this plan:[/]", highlight=False)
    for line in problems:
        err.print(f"  - {line}", highlight=False, soft_wrap=True)


def gap_warning(p: Any) -> str | None:
    """A line when the plan's optimality gap is unknown or above the stack's relative_gap."""
    s = p.solver
    if s is None:
        return None
    if s.gap is None:
        return (
            f"the {s.backend} solve stopped after {s.solve_seconds:.1f} s without a bound: this "
            "plan is feasible but how far it is from the cheapest is unknown (raise "
            "coral:fleet.allocation.time_limit_s)"
        )
    if s.gap > s.relative_gap + 1e-9:
        return (
            f"the plan is within {100 * s.gap:.2f}% of the cheapest, above the stack's "
            f"relative_gap {100 * s.relative_gap:.2f}% (the solve hit its time limit; raise "
            "coral:fleet.allocation.time_limit_s)"
        )
    return None


def plan_json(p: Any) -> dict[str, Any]:
    data: dict[str, Any] = p.model_dump(mode="json")
    data["status"] = p.solver.status if p.solver else "greedy"
    data["solve_seconds"] = p.solver.solve_seconds if p.solver else 0.0
    return data


def show_plan(p: Any) -> None:
    title = (
        f"Plan {p.stack} ({p.method}, mode {p.mode}): {p.hourly_cost_usd:,.2f} $/hour, "
        f"{len(p.instances)} instances, served "
        + (f"{100 * p.served_fraction:.1f}%" if p.served_fraction >= 1 else p.short_words())
    )
    table = Table(title=title)
    for col in (
        "model",
        "phase",
        "instances",
        "templates (region: count)",
        "throughput / demand",
        "$/hour",
    ):
        table.add_column(col, justify="right" if col in ("instances", "$/hour") else "left")
    for job in p.jobs:
        mine: dict[str, int] = {}
        for i in p.instances:
            if (i.model, i.phase) == (job.model, job.phase):
                k = f"{i.cloud}:{i.region} {i.template}"
                mine[k] = mine.get(k, 0) + 1
        table.add_row(
            job.model,
            job.phase,
            str(job.instances),
            "\n".join(f"{k}: {n}" for k, n in sorted(mine.items())) or "-",
            f"{job.throughput:,.0f} / {job.demand:,.0f} {job.unit}",
            f"{job.usd_per_hour:,.2f}",
        )
    out.print(table)
    if p.attainment:
        out.print(attainment_table(p))
    if p.routing:
        out.print(routing_table(p))
    if p.solver:
        s = p.solver
        bound = "no bound" if s.best_bound is None else f"bound {s.best_bound:,.2f}"
        gap = "gap unknown" if s.gap is None else f"gap {100 * s.gap:.2f}%"
        err.print(
            f"Solver {s.backend}: {s.status}, objective {s.objective:,.2f} (incl. start-up penalty "
            f"{p.startup_penalty_usd_per_hour:,.2f}), {bound}, {gap}, {s.solve_seconds:.2f} s"
        )
    for line in p.binding:
        err.print(f"[yellow]Limited by:[/] {line}", highlight=False)
    if p.closed_loop_stop:
        err.print(f"SLO closed loop stopped: {p.closed_loop_stop}", highlight=False)


REPLAY_TOLERANCE = 0.03  # verified vs whole-trace attainment: more apart than this is said


def attainment_table(p: Any) -> Table:
    """Per model: SLO attainment target, on the planning workload, verified on another, and on
    the whole trace for a trace-backed model."""
    table = Table(title="SLO attainment (share of requests meeting both TTFT and TPOT SLOs)")
    replayed = any(a.replayed is not None for a in p.attainment)
    cols = ("model", "workload", "target", "planned", "verified", "whole trace", "headroom", "")
    for col in cols:
        if col == "whole trace" and not replayed:
            continue
        table.add_column(col, justify="left" if col in ("model", "workload", "") else "right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    for a in p.attainment:
        status = "[green]meets[/]" if a.verified is not None and not a.short_by else ""
        if a.short_by:
            status = f"[red]short {100 * a.short_by:.1f} pts[/]"
        if "@" in a.model:  # a length bucket: its model as a whole is judged on its own row
            status = "bucket" if not a.short_by else f"bucket, {100 * a.short_by:.1f} pts under"
        cells = [
            a.model,
            a.workload,
            pct(a.target),
            pct(a.planned),
            f"{pct(a.verified)} ({a.verified_minutes:g} min)",
            *([pct(a.replayed)] if replayed else []),
            " ".join(f"{ph} {k:g}" for ph, k in a.headroom.items()),
            status,
        ]
        table.add_row(*cells)
    return table


def routing_table(p: Any) -> Table:
    """Length routing per model that asks for it: the decision, both plans' cost (and verified
    attainment), and each bucket: its prompt tokens, Content-Length bound, share and target."""
    table = Table(title="Length routing (requests to buckets by prompt length)")
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


@plan_app.command("diff")
@reports_errors
def plan_diff(
    old: Annotated[Path, typer.Argument(help="The running plan.json.")],
    new: Annotated[Path, typer.Argument(help="The proposed plan.json.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Instances added and removed, and the $/hour change per model."""
    from solver.plan.schema import diff_plans

    a, b = load_plan(old), load_plan(new)
    diff = diff_plans(a, b)
    if as_json:
        print_json(diff)
        return
    table = Table(title=f"{old} -> {new}: {diff['hourly_cost_delta_usd']:+,.2f} $/hour")
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
    out.print(table)
    for k in diff["added"]:
        out.print(f"[green]+ {k}[/]", highlight=False)
    for k in diff["removed"]:
        out.print(f"[red]- {k}[/]", highlight=False)
    if not diff["added"] and not diff["removed"]:
        out.print("No change.")
