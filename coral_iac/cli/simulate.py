"""`coral simulate`: replay generated (or real) traces against a plan in the event simulator."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, cast

import typer

from coral_iac.cli.console import (
    FittedTable,
    library_root,
    load_stack_named,
    out,
    print_json,
    reports_errors,
    stacks_dir,
)
from solver.errors import InputError


def simulate_cmd(
    stack: Annotated[str, typer.Option(help="Stack name (SLOs, request shapes, demand).")],
    plan_file: Annotated[Path, typer.Option("--plan", help="plan.json from `coral plan --out`.")],
    duration: Annotated[
        float | None,
        typer.Option(
            help="Simulated seconds (default 600). With --trace-dir: replay only the traces' "
            "first this many seconds (default: all of them)."
        ),
    ] = None,
    load: Annotated[float, typer.Option(help="Demand multiplier (1 = the stack's demand).")] = 1.0,
    trace_dir: Annotated[
        Path | None,
        typer.Option(help="Folder of <model>.csv traces (columns: timestamp, prompt, output)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the generated traces.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    capacity: Annotated[
        bool,
        typer.Option(
            "--capacity",
            help="Instead: drive each template alone past its capacity and compare the "
            "throughput it sustains with the template library's figure.",
        ),
    ] = False,
    outages: Annotated[
        Path | None,
        typer.Option(
            help="Replay these spot preemptions: a CSV with the columns instance, down_s and "
            "optionally up_s (instance keys of the plan; seconds; up_s defaults to down_s plus the "
            "stack's boot_minutes, under allocation)."
        ),
    ] = None,
    preemptions: Annotated[
        float,
        typer.Option(
            help="Replay spot preemptions sampled from the market's preemption model (seed "
            "--seed), the rates times this (0: none; e.g. 100 to stress a plan).",
            min=0,
        ),
    ] = 0.0,
    admission: Annotated[
        bool,
        typer.Option(
            help="Shed what the plan does not admit, as the gateway does (docs/gateway.md, "
            "'Admission control'); --no-admission sends every request to the replicas.",
        ),
    ] = True,
) -> None:
    """Simulate a plan: goodput, SLO attainment, TTFT and TPOT percentiles, per model."""

    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from coral_iac.cli.console import warn
    from coral_iac.cli.plan import load_plan
    from coral_iac.demand_sources import resolve_demand
    from solver.performance.default_model import load_perf_model
    from solver.plan.length_routing import fleet_for_plan
    from solver.simulation.admission import admission_limits
    from solver.simulation.simulator import simulate
    from solver.simulation.traces import cap_lengths, cap_note, load_trace_csv
    from solver.simulation.workload import model_contexts

    for name, value in (("--duration", 600.0 if duration is None else duration), ("--load", load)):
        if not math.isfinite(value) or value <= 0:
            example = "600" if name == "--duration" else "1.0"
            raise InputError(
                name, f"must be a positive number, got {value}", f"e.g. {name} {example}"
            )
    # The same demand `coral plan` used: the stack's demand source (config, file, Prometheus).
    fleet = resolve_demand(load_stack_named(stack), stack, stacks_dir(), warn=warn)
    plan = load_plan(plan_file)
    fleet = fleet_for_plan(fleet, plan)  # a routed model's length buckets
    perf = load_perf_model(cards=fleet.model_cards, corrections=fleet.step_corrections())
    contexts = model_contexts(fleet.models, perf.cards)
    if capacity:
        _capacity(plan, fleet, perf, duration or 600.0, as_json)
        return
    if trace_dir is not None:
        traces = {}
        for m, spec in sorted(fleet.models.items()):  # a length bucket: its model's file, cut
            t = load_trace_csv(trace_dir / f"{m.split('@')[0]}.csv")
            if (cut := spec.length_slice) is not None:
                keep = t.prompt > cut.min_prompt_tokens
                if cut.max_prompt_tokens is not None:
                    keep &= t.prompt <= cut.max_prompt_tokens
                t = type(t)(t.arrival_s[keep], t.prompt[keep], t.output[keep])
            traces[m] = t
        traces, span = _replay_span(traces, duration)
        for m, t in traces.items():  # served as the model's context allows, as generated ones
            traces[m] = type(t)(t.arrival_s, *cap_lengths(t.prompt, t.output, contexts[m]))
        what = f"{span:g} s of the traces in {trace_dir} (at their own rate)"
    else:
        span = duration or 600.0
        traces = stack_workload(fleet, span, load, seed, contexts)
        what = f"{span:g} s of {stack} at {load:g}x demand"
    replayed = _outages(plan, fleet, perf, span, seed, outages, preemptions)
    room = fleet.attainment_scope().room
    limits = admission_limits(plan, fleet.models, stacks_dir().parent, room) if admission else None
    summary = simulate(plan, fleet.models, perf, traces, span, replayed, limits).summary()
    summary["duration_s"] = span
    summary["admission"] = (
        {m: limit.model_dump(mode="json") for m, limit in limits.items()} if limits else None
    )
    if as_json:
        print_json(summary)
        return
    lost = f", {len(replayed)} spot outages" if replayed else ""
    gate = "behind the gateway's admission control" if admission else "without admission control"
    table = FittedTable(title=f"Simulated {what}{lost}, {gate}")
    shed = "shed" in summary
    cols: tuple[str, ...] = (
        "model", "requests", "goodput tok/s", "SLO met", "TTFT p50/p99 ms", "TPOT p50/p99 ms"
    )  # fmt: skip
    if shed:
        cols = ("model", "offered", "admitted", "shed", "SLO met of admitted",
                "SLO met of offered", *cols[2:])  # fmt: skip
    if replayed:
        cols = (*cols, "retried")
    for col in cols:
        table.add_column(col, justify="left" if col == "model" else "right")
    rows = dict(summary["by_model"])  # type: ignore[call-overload]
    rows["all"] = summary
    for model, r in rows.items():
        counts = (
            (
                str(r.get("offered", r["requests"])),
                str(r["requests"]),
                str(r.get("shed", 0)),
                f"{100 * r['slo_attainment']:.1f}%",
                f"{100 * r.get('offered_attainment', r['slo_attainment']):.1f}%",
            )
            if shed
            else (str(r["requests"]),)
        )
        table.add_row(
            model,
            *counts,
            f"{r['goodput_tokens_per_s']:,.0f}",
            *(() if shed else (f"{100 * r['slo_attainment']:.1f}%",)),
            f"{_ms(r['ttft_p50_ms'], 0)} / {_ms(r['ttft_p99_ms'], 0)}",
            f"{_ms(r['tpot_p50_ms'], 1)} / {_ms(r['tpot_p99_ms'], 1)}",
            *([str(r.get("retried", 0))] if replayed else []),
        )
    out.print(table)
    for model, r in summary["by_model"].items():  # type: ignore[attr-defined]
        offered = int(r.get("offered", r["requests"]))
        if (note := cap_note(int(r.get("capped", 0)), offered, contexts[model])) is not None:
            warn(f"{model}: {note}")


def _outages(
    plan: Any,
    fleet: Any,
    perf: Any,
    duration: float,
    seed: int,
    path: Path | None,
    scale: float,
) -> list[Any]:
    """The spot outages to replay: from `path`, or sampled at `scale` x the market's rates."""
    # Deferred to when the command runs (numpy and the market).
    from solver.catalog.market import SpotTerms, build_market
    from solver.simulation.preemption import load_outages, sample_outages

    if path is not None and scale > 0:
        raise InputError(
            "--outages", "give --outages or --preemptions, not both", "drop one of them"
        )
    boot_s = fleet.allocation.boot_minutes * 60
    if path is not None:
        return load_outages(path, boot_s, {i.key for i in plan.instances})
    if scale <= 0:
        return []
    spot = build_market(fleet.market_scope(), perf.catalog).spot
    stressed = {
        slot: SpotTerms(
            t.usd_per_hour,
            t.zones,
            t.preemption.model_copy(update={"rate_per_hour": t.preemption.rate_per_hour * scale}),
        )
        for slot, t in spot.items()
    }
    return sample_outages(plan.instances, stressed, duration, boot_s, seed)


def _replay_span(traces: dict[str, Any], duration: float | None) -> tuple[dict[str, Any], float]:
    """The traces from their first request (the earliest of any model's), cut to `duration`
    seconds when given, and the span they cover (goodput is per this span, not per a duration
    they do not fill)."""
    start = min((float(t.arrival_s[0]) for t in traces.values() if len(t)), default=0.0)
    cut: dict[str, Any] = {}
    for m, t in traces.items():
        at = t.arrival_s - start
        keep = at < duration if duration is not None else at >= 0
        cut[m] = type(t)(at[keep], t.prompt[keep], t.output[keep])
    last = max((float(t.arrival_s[-1]) for t in cut.values() if len(t)), default=0.0)
    span = duration if duration is not None else last
    return cut, max(span, 1e-9)


def stack_workload(
    fleet: Any, duration: float, load: float, seed: int, contexts: dict[str, int]
) -> dict[str, Any]:
    """Each model's requests at `load` x its demand (requests/s, or tokens/s over the mean
    lengths): its trace's verification window, or generated with seed `seed + i`; lengths
    capped at each model's context (`contexts`)."""
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.simulation.workload import stack_requests

    return stack_requests(
        fleet.models, duration, load, seed, stacks_dir().parent, max_contexts=contexts
    )


def _capacity(plan: Any, fleet: Any, perf: Any, duration: float, as_json: bool) -> None:
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.simulation.simulator import capacity_check

    rows = capacity_check(plan, fleet.models, perf, duration_s=duration)
    if as_json:
        print_json(rows)
        return
    table = FittedTable(
        title="Capacity per template: simulated at 1.5x its throughput vs the library"
    )
    cols = ("model", "phase", "template", "library", "simulated", "ratio")
    for col in cols:
        table.add_column(col, justify="left" if col in cols[:3] else "right")
    for r in rows:
        ratio = cast(float, r["ratio"])  # capacity_check rows are dict[str, object]
        flag = "" if 0.9 <= ratio <= 1.1 else " !"
        table.add_row(
            str(r["model"]),
            str(r["phase"]),
            str(r["template"]),
            f"{r['library']:,.2f}",
            f"{r['simulated']:,.2f}",
            f"{r['ratio']:.3f}{flag}",
        )
    out.print(table)
    out.print(
        "Units: prompt tokens/s (prefill), output tokens/s (decode), requests/s (aggregated)."
    )


def _ms(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def epochs_cmd(
    stack: Annotated[str, typer.Option(help="Stack name.")],
    availability: Annotated[
        str, typer.Option(help="Availability factor per epoch, comma-separated.")
    ] = "1,0.8,0.6,0.8,1",
    epoch_minutes: Annotated[float, typer.Option(help="Adjustment interval.")] = 6,
    startup_minutes: Annotated[float, typer.Option(help="Time before a new node serves.")] = 6,
    library: Annotated[Path | None, typer.Option(help="Template-library folder.")] = None,
    target_utilization: Annotated[
        float | None,
        typer.Option(
            help="Override the stack's allocation target_utilization (the share of each "
            "instance's capacity a plan counts on)."
        ),
    ] = None,
    cold_start: Annotated[
        bool, typer.Option(help="The first epoch's fleet boots too (default: already serving).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Run the paper's epochs: re-plan each interval (start-up penalty, changing availability)
    and simulate each epoch, counting the start-up time of new instances."""

    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.performance.default_model import load_perf_model
    from solver.plan.demand import stack_demand
    from solver.plan.epochs import run_epochs
    from solver.plan.planner import libraries_for

    try:
        factors = [float(x) for x in availability.split(",")]
    except ValueError as e:
        raise InputError("--availability", f"not numbers: {availability}", "e.g. 1,0.8,0.6") from e
    if not factors or any(f < 0 for f in factors):
        raise InputError("--availability", f"need factors >= 0: {availability}", "e.g. 1,0.8,0.6")
    fleet = load_stack_named(stack).with_target_utilization(target_utilization)
    perf = load_perf_model(cards=fleet.model_cards, corrections=fleet.step_corrections())
    libs = libraries_for(
        perf, fleet, list(stack_demand(fleet.models)), library or library_root() / stack
    )
    results = run_epochs(
        stack,
        fleet,
        perf,
        libs,
        factors,
        epoch_minutes * 60,
        startup_minutes * 60,
        cold_start=cold_start,
    )
    if as_json:
        print_json([asdict(r) for r in results])
        return
    table = FittedTable(title=f"{stack}: {len(results)} epochs of {epoch_minutes:g} min")
    cols = (
        "epoch",
        "avail x",
        "$/hour",
        "penalty $/h",
        "served",
        "+/-",
        "goodput tok/s",
        "SLO met",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            str(r.epoch),
            f"{r.availability_factor:g}",
            f"{r.hourly_cost_usd:,.2f}",
            f"{r.startup_penalty_usd_per_hour:,.2f}",
            f"{r.served_fraction:.3f}",
            f"+{r.added}/-{r.removed}",
            f"{r.goodput_tokens_per_s:,.0f}",
            f"{100 * r.slo_attainment:.1f}%",
        )
    out.print(table)


def register(app: typer.Typer) -> None:
    app.command("simulate")(reports_errors(simulate_cmd))
    app.command("epochs")(reports_errors(epochs_cmd))
