"""`coral templates`: build and inspect the serving-template library (the offline stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypedDict

import typer

from coral_iac.cli.console import (
    FittedTable,
    MeasuredOpt,
    err,
    load_stack_named,
    out,
    print_json,
    progress_bar,
    reports_errors,
)
from solver.errors import InputError

templates_app = typer.Typer(help="Serving-template library (offline stage).", no_args_is_help=True)
LIB_PHASES = ("prefill", "decode", "aggregated")


class TemplateRow(TypedDict):
    """One row of `coral templates show` (its `--json` output)."""

    key: str
    mode: str
    nodes: list[str]
    stages: list[dict[str, Any]]
    layer_partition: str
    tokens_per_s: float
    unit: str
    usd_per_hour: float
    region: str
    tokens_per_s_per_usd: float


def _fleet(stack: str, mode: str | None) -> Any:
    fleet = load_stack_named(stack)  # the project root from any subfolder; the name checked
    return fleet if mode is None else fleet.with_mode(mode)


@templates_app.command("build")
@reports_errors
def templates_build(
    stack: Annotated[str, typer.Option(help="Stack name (stacks/Pulumi.<stack>.yaml).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Library folder to write.")],
    mode: Annotated[
        str | None, typer.Option(help="vllm, general or paper (overrides the stack).")
    ] = None,
    workers: Annotated[int, typer.Option(help="Worker processes (or Ray actors).")] = 2,
    executor: Annotated[
        str, typer.Option(help="process (local worker processes) or ray.")
    ] = "process",
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster address (default: start a local Ray).")
    ] = None,
    phase: Annotated[
        list[str] | None, typer.Option(help="Phases to build (default: prefill and decode).")
    ] = None,
    measured: MeasuredOpt = None,
) -> None:
    """Build the serving-template library for every model of a stack."""
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.performance.default_model import load_perf_model
    from solver.serving.enumeration import available_node_configs
    from solver.serving.library import build_libraries, save_library

    fleet = _fleet(stack, mode)
    phases = phase or ["prefill", "decode"]
    for ph in phases:
        if ph not in LIB_PHASES:
            raise InputError(
                "--phase", f"unknown phase '{ph}'", "use prefill, decode or aggregated"
            )
    if executor not in ("process", "ray"):
        raise InputError("--executor", f"unknown executor '{executor}'", "use process or ray")
    pm = load_perf_model(measured, cards=fleet.model_cards, corrections=fleet.step_corrections())
    _, unsold = available_node_configs(fleet.market_scope(), pm.catalog)
    if unsold:
        err.print(
            f"Skipped node configs no offer sells in this stack's regions: {', '.join(unsold)}"
        )
    table = FittedTable(title=f"Serving-template library: {stack}, mode {fleet.library.mode}")
    for col in ("model", "phase", "enumerated", "feasible", "dominated", "kept", "seconds"):
        table.add_column(col, justify="left" if col in ("model", "phase") else "right")
    jobs = [(m, ph) for m in fleet.models for ph in phases]
    with progress_bar() as bar:
        tasks = {job: bar.add_task(f"{job[0]} {job[1]}", total=None) for job in jobs}
        libs = build_libraries(
            pm,
            fleet.library_scope(),
            jobs,  # type: ignore[arg-type]
            workers,
            lambda job, d, t: bar.update(tasks[job], completed=d, total=t),
            executor,  # type: ignore[arg-type]
            ray_address,
        )
    for lib in libs:
        save_library(lib, out_dir, stack)
        s = lib.stats
        table.add_row(
            lib.model,
            lib.phase,
            str(s.enumerated),
            str(s.feasible),
            str(s.dominated),
            str(s.kept),
            f"{s.build_seconds:.1f}",
        )
    err.print(table)
    err.print(f"Wrote {out_dir}")


@templates_app.command("show")
@reports_errors
def templates_show(
    library: Annotated[Path, typer.Option(help="Library folder.")],
    model: Annotated[str, typer.Option(help="Model id.")],
    phase: Annotated[str, typer.Option(help="prefill, decode or aggregated.")],
    top: Annotated[int, typer.Option(help="How many templates.")] = 10,
    mode: Annotated[
        str | None, typer.Option(help="vllm, general or paper, when several are built.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List templates by throughput per dollar (at the cheapest region offering all nodes)."""
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.catalog.offers import load_catalog
    from solver.serving.library import read_library

    pattern = f"{model}__{phase}__*__{mode or '*'}.json"
    files = sorted(library.glob(pattern))
    if not files:
        raise InputError(
            "--library",
            f"no library file matches {library / pattern}",
            "build it with `coral templates build`, or check --model/--phase/--mode",
        )
    cat = load_catalog()
    rows: list[TemplateRow] = []
    for f in files:
        lib = read_library(f)
        for t in lib.templates:
            price = cat.cheapest_region(t.nodes)
            if price is None:
                continue  # no single region sells all its nodes
            (cloud, region_name), usd = price
            region = f"{cloud}:{region_name}"
            rows.append(
                {
                    "key": t.key,
                    "mode": t.mode,
                    "nodes": t.nodes,
                    "stages": [s.model_dump() for s in t.stages],
                    "layer_partition": t.layer_partition,
                    "tokens_per_s": t.throughput,
                    "unit": t.unit,
                    "usd_per_hour": round(usd, 4),
                    "region": region,
                    "tokens_per_s_per_usd": round(t.throughput / usd, 4),
                }
            )
    rows.sort(key=lambda r: (-r["tokens_per_s_per_usd"], r["key"]))
    rows = rows[:top]
    if as_json:
        print_json(rows)
        return
    table = FittedTable(title=f"Top {len(rows)} serving templates: {model} {phase}")
    for col in ("nodes", "mode", "stages (layers)", "throughput", "$/hour", "region", "per $"):
        table.add_column(
            col, justify="right" if col in ("throughput", "$/hour", "per $") else "left"
        )
    for r in rows:
        table.add_row(
            r["key"],
            r["mode"],
            r["layer_partition"],
            f"{r['tokens_per_s']:,.1f} {r['unit']}",
            f"{r['usd_per_hour']:.3f}",
            r["region"],
            f"{r['tokens_per_s_per_usd']:,.1f}",
        )
    out.print(table)
