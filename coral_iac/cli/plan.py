"""`coral plan`: solve a stack's allocation (or a baseline), validate it, show and diff plans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.text import Text
from typer.core import TyperGroup

from coral_iac.cli.console import (
    FittedTable,
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
from coral_iac.cli.plan_output import REPLAY_TOLERANCE, diff_table, show_plan
from coral_iac.deploy_settings import load_deploy_settings
from coral_iac.deployable import deploy_problems, unverified_placements
from coral_iac.gateway_config import (
    NO_GATEWAY_ADMISSION,
    AdmissionRow,
    admission_rows,
    gateway_region,
)
from solver.catalog.vllm_support import check_deployable_gpus
from solver.errors import InputError
from solver.io import check_replaceable, parse_model, read_text, write_atomic
from solver.plan_schema import Plan, diff_plans
from solver.timing import timed


class PlanGroup(TyperGroup):
    """`coral plan` plans with --stack, and `coral plan diff OLD NEW` compares two plans: its
    help says both, and marks --stack required. The parser cannot require it (`plan diff`
    takes none), so a missing --stack is the InputError `plan` raises."""

    def format_usage(self, ctx: Any, formatter: Any) -> None:
        formatter.write_usage(ctx.command_path, "--stack NAME [OPTIONS]")
        formatter.write_usage(ctx.command_path, "diff [OPTIONS] OLD NEW", prefix="       ")

    def format_help(self, ctx: Any, formatter: Any) -> None:
        stack = next(p for p in self.params if p.name == "stack")
        stack.required = True
        try:
            super().format_help(ctx, formatter)
        finally:
            stack.required = False


plan_app = typer.Typer(
    cls=PlanGroup,
    help="Plan a stack: the cheapest template instances per region that meet demand. "
    "docs/output.md explains every column of its tables and its closed-loop and solver lines.",
    invoke_without_command=True,
)
EXIT_SCARCE = 3  # --strict and a shortfall, or a plan that serves none of the demand


@plan_app.callback()
@reports_errors
def plan(
    ctx: typer.Context,
    stack: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="Stack name (stacks/Pulumi.<NAME>.yaml)."),
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
    workers: Annotated[
        int,
        typer.Option(
            help="Worker processes for a library build, the capacity model and the closed "
            "loop's restricted searches (1: all in this process, one after the other; the "
            "same plan either way)."
        ),
    ] = 2,
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
    latency_margin: Annotated[
        float | None,
        typer.Option(
            "--margin",
            metavar="K",
            help="Plan as if every engine step took K x as long as modelled, 1 to 3 (the "
            "stack's attainment.latency_margin), e.g. to see what 1.2 costs.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Solve the allocation for a stack and print (and optionally write) the plan."""
    if ctx.invoked_subcommand is not None:
        return
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
    if out_file is not None:  # before minutes of planning, not after
        check_replaceable(out_file)
    with timed() as times:
        result, problems, admission, contexts = make_plan(
            stack, baseline or "coral", previous, library, workers, add_only, force, latency_margin
        )
    if (line := gap_warning(result)) is not None:
        warn(line)
    failed = result.served_fraction < 1 or bool(result.below_target())
    # A zero-served plan, or one failing --strict, never replaces the running plan in --out.
    write = out_file is not None and not (strict and failed) and result.serves_any()
    if write:
        assert out_file is not None
        write_atomic(out_file, result.model_dump_json(indent=1) + "\n")  # checks it again
    unverified = unverified_placements(result)
    if as_json:
        extra = {
            "deploy_problems": problems,
            "unverified": unverified,
            "timings": times.table(),
            "admission": admission.model_dump(mode="json"),
            "context_warnings": contexts,
        }
        print_json(plan_json(result) | extra)
    else:
        show_plan(result)
        show_admission(admission)
        err.print(phase_line(times), highlight=False)
        if write:
            err.print(f"Wrote {out_file}")
        show_deployable(problems)
    for line in unverified:
        warn(line)
    for a in result.below_target():
        if not a.short_by:  # at its target on too few held-out requests
            warn(
                f"{a.model}: the claim of {100 * (a.judged or 0):.1f}% is refused: {a.unsupported}"
            )
            continue
        warn(
            f"{a.model}: SLO attainment {100 * (a.judged or 0):.1f}% on the "
            + ("whole trace" if a.judged != a.verified else "verification workload")
            + f", {100 * a.short_by:.1f} points below its target {100 * a.target:g}%: "
            f"{a.cause}"
        )
    for line in (
        zone_loss_warnings(result)
        + shed_warnings(result)
        + spike_warnings(result)
        + workload_warnings(result)
        + contexts
    ):
        warn(line)
    if admission.gateway is None and result.serves_any():
        warn(f"admission: {NO_GATEWAY_ADMISSION}")
    for a in result.attainment:
        if a.replay_gap > REPLAY_TOLERANCE:
            warn(
                f"{a.model}: {100 * (a.verified or 0):.1f}% on the trace's held-out windows, "
                f"{100 * (a.replayed or 0):.1f}% on the whole trace ({100 * a.replay_gap:.1f} "
                "points apart: the trace's bursts fall unevenly between its windows); the plan "
                f"claims the lower, {100 * (a.judged or 0):.1f}%"
            )
    if out_file is not None and not write:
        err.print(f"Left {out_file} as it was.")
    if not result.serves_any():
        err.print(Text.assemble(("Error:", "bold red"), " ", serves_nothing(result)))
        raise typer.Exit(EXIT_SCARCE)
    if strict and failed:
        raise typer.Exit(EXIT_SCARCE)


def serves_nothing(p: Any) -> str:
    """Why a plan that serves none of the demand is no plan: the constraints that bound it."""
    why = "; ".join(p.binding) or f"served {p.short_words()}"
    return (
        f"the plan serves none of the demand, so there is nothing to deploy ({why}).\n"
        "  To fix: raise what binds (budget_usd_per_hour, availability, gpu_pools), or lower "
        "demand or loosen the SLO (docs/allocation.md, Scarcity)"
    )


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
    latency_margin: float | None = None,
) -> tuple[Any, list[str], Admission, list[str]]:
    """Load the stack, its libraries and the running plan; solve; validate; return the plan,
    why the Pulumi program would refuse it (empty: it deploys), what its gateway admits and
    where requests are longer than the models serve (`context_warnings`).

    `add_only` turns on coral:fleet.allocation.add_only (keep every running instance);
    `latency_margin` sets coral:fleet.attainment.latency_margin.
    """
    # Deferred to keep `coral` quick to start: httpx (through demand_sources) takes about
    # 35 ms to import, the performance model (scipy) and the planner (ortools) about a second.
    from coral_iac.demand_sources import resolve_demand
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
    check_deployable_gpus(fleet.node_configs, fleet.library.strategy, stack)
    if add_only:
        allocation = fleet.allocation.model_copy(update={"add_only": True})
        fleet = fleet.model_copy(update={"allocation": allocation})
    if latency_margin is not None:
        fleet = fleet.with_latency_margin(latency_margin)
    perf = load_perf_model(cards=fleet.model_cards, corrections=fleet.step_corrections())
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
    problems = deploy_problems(
        result, perf.catalog, fleet.library, fleet.allocation, fleet.attainment
    )
    deploy = load_deploy_settings(stacks_dir(), stack)
    contexts = context_warnings(result, fleet, perf.cards, deploy.max_model_len)
    return result, problems, admission_report(result, fleet, stack), contexts


def context_warnings(plan: Plan, fleet: Any, cards: Any, max_model_len: int) -> list[str]:
    """A line per model whose requests are longer than it is served: held-out requests the
    model's context cut (`ModelAttainment.capped`: verified as capped), and planning requests
    longer than the deployed --max-model-len (coral:deploy.max_model_len, at most the card's
    context), which vLLM refuses with HTTP 400 while the plan counts them as served."""
    from solver.simulation.workload import model_trace  # deferred: numpy and the traces

    lines = []
    for a in plan.attainment:
        if a.capped and "@" not in a.model:
            context = cards[a.model].max_context
            offered = round(a.verified_requests / (1 - (a.shed or 0.0))) or a.capped
            lines.append(
                f"{a.model}: {a.capped:,} of about {offered:,} held-out requests are longer than "
                f"the model's {context:,}-token context: verified as capped (the prompt at "
                f"{context - 1:,} tokens, the output at what the context leaves), as a client "
                "that truncates them would be served; vLLM refuses a longer prompt"
            )
    for i, (model, spec) in enumerate(sorted(fleet.models.items())):
        served = min(max_model_len, cards[model].max_context)
        if served >= cards[model].max_context or plan.fraction_of(model) <= 0:
            continue
        trace = model_trace(spec, i, "plan", 3_600.0, stacks_dir().parent)
        longer = int(((trace.prompt + trace.output) > served).sum())
        if longer:
            lines.append(
                f"{model}: {longer:,} of {len(trace):,} planning requests "
                f"({100 * longer / len(trace):.2g}%) are longer than coral:deploy.max_model_len "
                f"({served:,} tokens): the deployed vLLM refuses them (HTTP 400) while the plan "
                f"counts them as served. Raise coral:deploy.max_model_len (the model's context "
                f"is {cards[model].max_context:,}) or have clients truncate prompts"
            )
    return lines


class Admission(BaseModel):
    """What `coral plan` says of admission control: where the gateway runs (None: none), and
    per model what it admits."""

    gateway: str | None
    models: list[AdmissionRow]


def admission_report(plan: Any, fleet: Any, stack: str) -> Admission:
    """The gateway's admission per model for `plan`, as the Pulumi program would configure it,
    with the stack's gateway region (None where the stack runs no gateway)."""
    from solver.plan.length_routing import fleet_for_plan  # deferred: the planner's imports

    deploy = load_deploy_settings(stacks_dir(), stack)
    region = gateway_region(fleet.regions, deploy.gateway) if deploy.gateway.enabled else None
    routed = fleet_for_plan(fleet, plan)  # length buckets as models of their own
    return Admission(
        gateway=region,
        models=admission_rows(
            plan, routed.models, stacks_dir().parent, fleet.attainment_scope().room
        ),
    )


def show_admission(admission: Admission) -> None:
    """`coral plan`'s admission table: per model, demand, capacity and what the gateway admits."""
    if not admission.models:
        return
    where = (
        f"at the gateway ({admission.gateway}): the excess gets 429 with Retry-After"
        if admission.gateway
        else "NOT enforced: the stack runs no gateway"
    )
    table = FittedTable(title=f"Admission control, requests/s ({where})")
    for col in ("model", "demand", "capacity at target", "admitted", "as HAProxy counts", "basis"):
        table.add_column(col, justify="left" if col in ("model", "basis") else "right")
    for r in admission.models:
        table.add_row(
            r.model,
            f"{r.demand_rps:,.3g}",
            f"{r.capacity_rps:,.3g}",
            f"{r.admitted_rps:,.3g}",
            f"{r.count} per {r.period_s} s",
            r.basis,
        )
    out.print(table)


# A model served in full whose gateway sheds more than this share of its requests at the stated
# demand is warned of: its clients get 429s in ordinary traffic, not only in a spike.
SHED_AT_DEMAND_WARNING = 0.01


def shed_warnings(plan: Plan) -> list[str]:
    """A line per model the plan serves in full that the gateway still sheds at its demand: its
    capacity at the target leaves too little room above the demand for a minute's bursts."""
    return [
        f"{a.model}: the plan serves all of its demand, yet the gateway sheds "
        f"{100 * (a.shed or 0):.1f}% of its requests at that demand: bursts within a minute go "
        "above its capacity at the target, and those requests get 429. Lower "
        "coral:fleet.allocation.target_utilization to give it room above the demand"
        for a in plan.attainment
        if plan.fraction_of(a.model) >= 1
        and (a.shed or 0) > SHED_AT_DEMAND_WARNING
        and "@" not in a.model
    ]


def spike_warnings(plan: Plan) -> list[str]:
    """A line per model whose admitted requests miss the target at SPIKE_LOAD x its demand."""
    return [
        f"{a.model}: at 1.5x its demand the gateway sheds {100 * (a.spike_shed or 0):.1f}% and "
        f"the admitted requests meet the SLOs {100 * a.spike:.1f}% of the time, below the "
        f"target {100 * a.target:g}%: a lasting spike under what the gateway admits (its "
        "capacity at the target, or its demand's busy minutes) reaches replicas sized for the "
        "demand. Lower coral:fleet.allocation.target_utilization to size them for more (0.67: "
        "for 1.5x the demand), or accept that spikes degrade it"
        for a in plan.attainment
        if a.spike is not None and a.spike < a.target and "@" not in a.model
    ]


def workload_warnings(plan: Plan) -> list[str]:
    """A line per model judged on generated requests rather than a trace of its traffic."""
    return [
        f"{a.model}: judged on {a.workload}: requests drawn from a named shape at the stated "
        "mean lengths, whose tails and bursts may not be your traffic's. Set the model's "
        "workload_trace to a CSV of your own requests (timestamp,prompt_tokens,output_tokens) "
        "to plan and verify on them (docs/slo-attainment.md)"
        for a in plan.attainment
        if a.workload.startswith("generated") and "@" not in a.model
    ]


def load_plan(path: Path) -> Any:
    """A plan.json written by `coral plan --out`.

    Raises:
        InputError: no such file, not JSON, or not a plan this coral reads: what the file
            holds, against what a plan file is (a JSON object of the schema's plan format).
    """
    fmt = Plan.model_fields["format"].default
    fix = (
        f"pass a plan.json written by `coral plan --out` (a JSON object of plan format {fmt}: "
        '"format", "stack", "instances", "jobs", ...)'
    )
    if not path.exists():
        raise InputError(str(path), "no such plan file", fix)
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise InputError(str(path), f"not JSON: {e}", fix) from e
    if (found := _not_a_plan(data, fmt)) is not None:
        raise InputError(str(path), f"is not a plan this coral reads: {found}", fix)
    try:
        return parse_model(Plan, data, str(path))
    except InputError as e:
        where = e.field.removeprefix(f"{path}: ")
        raise InputError(
            str(path), f"is not a plan this coral reads: {where}: {e.problem}", fix
        ) from e


def check_plan_stack(running: Any, stack: str, path: Path | None) -> None:
    """`--previous` is a plan of this stack: another stack's would make preview "retire"
    instances in regions this stack never had.

    Raises:
        InputError: naming `--previous`, both stacks and the fix.
    """
    if running is not None and running.stack != stack:
        raise InputError(
            "--previous",
            f"{path} is a plan of stack '{running.stack}', not '{stack}'",
            f"pass the running plan of {stack} (`coral plan --stack {stack} --out ...`)",
        )


def _not_a_plan(data: Any, fmt: int) -> str | None:
    """What `data` (a parsed JSON file) holds where a plan file is expected, in words; None
    when it looks like a plan of format `fmt` (the schema then checks every field)."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__.replace('dict', 'object')}"
    found = data.get("format", fmt)  # plans from before the format field are format 1
    if found != fmt:
        newer = isinstance(found, int) and found > fmt
        return (
            f"plan format {found!r} (this coral reads format {fmt}"
            + ("; the file is from a newer coral: upgrade, or plan again with this one)"
               if newer else "; plan again with this coral)")
        )  # fmt: skip
    if not {"stack", "instances", "jobs"} & data.keys():
        keys = ", ".join(sorted(map(str, data))[:6]) or "none"
        return f"none of a plan's keys (stack, instances, jobs); its keys: {keys}"
    return None


def show_deployable(problems: list[str]) -> None:
    if not problems:
        err.print("Deployable: `pulumi up` accepts this plan.")
        return
    err.print("[red]`pulumi up` will refuse this plan:[/]", highlight=False)
    for line in problems:
        err.print(f"  - {line}", highlight=False, soft_wrap=True)


def zone_loss_warnings(plan: Plan) -> list[str]:
    """A line per model whose attainment with one spot zone lost (`one spot zone lost`) falls
    below its target: the zone spread keeps the capacity to serve demand, not the attainment."""
    return [
        f"{a.model}: {100 * a.under_preemption:.1f}% with one spot zone lost, below its target "
        f"{100 * a.target:g}%: the spread keeps the capacity to serve demand, but the requests "
        "the zone's loss cuts retry on full queues while replacements boot. To hold the target "
        "through a zone's loss, lower coral:fleet.allocation.spot.max_share or "
        "allocation.target_utilization (docs/allocation.md, 'Spot capacity')"
        for a in plan.attainment
        if a.under_preemption is not None and a.under_preemption < a.target
    ]


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


@plan_app.command("diff")
@reports_errors
def plan_diff(
    old: Annotated[Path, typer.Argument(help="The running plan.json.")],
    new: Annotated[Path, typer.Argument(help="The proposed plan.json.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Instances added and removed, and the $/hour change per model."""
    a, b = load_plan(old), load_plan(new)
    diff = diff_plans(a, b)
    if as_json:
        print_json(diff)
        return
    out.print(diff_table(f"{old} -> {new}: {diff['hourly_cost_delta_usd']:+,.2f} $/hour", diff))
    for k in diff["added"]:
        out.print(f"[green]+ {k}[/]", highlight=False)
    for k in diff["removed"]:
        out.print(f"[red]- {k}[/]", highlight=False)
    if not diff["added"] and not diff["removed"]:
        out.print("No change.")
