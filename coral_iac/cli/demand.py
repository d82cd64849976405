"""`coral demand show` and `coral demand refresh`: a stack's demand and where it comes from."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from coral_iac.cli.console import (
    FittedTable,
    err,
    load_stack_named,
    out,
    print_json,
    reports_errors,
    stacks_dir,
    warn,
)

demand_app = typer.Typer(
    help="Demand per model: from the stack config, its demand file, or Prometheus.",
    no_args_is_help=True,
)
StackOpt = Annotated[str, typer.Option(help="Stack name (stacks/Pulumi.<stack>.yaml).")]
UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--prometheus",
        help="Prometheus base URL; overrides demand_source.prometheus.url in the stack.",
    ),
]


def _row(spec: Any, model: str, demand: Any) -> dict[str, Any]:
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.operations.demand_rules import phase_figures

    return {
        "model": model,
        "serving": spec.serving,
        "demand": demand.model_dump(mode="json", exclude_none=True),
        "phase_demand": {p: round(v, 6) for p, v in phase_figures(spec, demand).items()},
    }


def _lengths(report: Any, model: str) -> dict[str, Any] | None:
    measured = report.lengths.get(model)
    return None if measured is None else measured.model_dump(mode="json")


def _lengths_text(lengths: dict[str, Any] | None) -> str:
    if lengths is None:
        return "config"
    return (
        f"measured: prompt {lengths['mean_prompt_tokens']:g} (sigma {lengths['prompt_sigma']:g}), "
        f"output {lengths['mean_output_tokens']:g} (sigma {lengths['output_sigma']:g})"
    )


@demand_app.command("show")
@reports_errors
def show(
    stack: StackOpt,
    prometheus: UrlOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The demand `coral plan` and the program use, per model, and where each figure came from."""
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from coral_iac.demand_sources import demand_report

    fleet = load_stack_named(stack)
    report = demand_report(fleet, stack, stacks_dir(), prometheus)
    rows = [
        _row(fleet.models[m.model], m.model, m.demand)
        | {"origin": m.origin, "detail": m.detail, "lengths": _lengths(report, m.model)}
        for m in report.models
    ]
    if as_json:
        print_json(
            {
                "stack": stack,
                "kind": report.kind,
                "models": rows,
                "warnings": report.warnings,
                "unknown_models": report.unknown_models,
            }
        )
        return
    table = FittedTable(title=f"Demand of stack {stack} (source: {report.kind})")
    for col in ("model", "prefill tok/s", "decode tok/s", "requests/s", "origin", "detail",
                "lengths"):  # fmt: skip
        table.add_column(col, justify="right" if "/s" in col else "left", overflow="fold")
    for r in rows:
        ph = r["phase_demand"]
        table.add_row(
            r["model"],
            *(f"{ph[p]:,.1f}" if p in ph else "-" for p in ("prefill", "decode", "aggregated")),
            r["origin"],
            r["detail"],
            _lengths_text(r["lengths"]),
        )
    out.print(table)
    for line in report.warnings:
        warn(line)


@demand_app.command("refresh")
@reports_errors
def refresh(
    stack: StackOpt,
    prometheus: UrlOpt = None,
    write: Annotated[
        bool, typer.Option("--write", help="Write the stack's demand file (default: stdout).")
    ] = False,
) -> None:
    """Measure demand in Prometheus now and print (or --write) the stack's demand file.

    Never falls back: Prometheus unreachable is an error (exit 1). A stack whose source is not
    prometheus has nothing to refresh (exit 0).
    """

    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from coral_iac.demand_sources import demand_file_path, refresh_file
    from solver.io import write_atomic
    from solver.operations.demand_rules import demand_file_text

    fleet = load_stack_named(stack)
    if fleet.demand_source.kind != "prometheus":
        # Not an error: the scheduled workflow refreshes every stack the same way.
        err.print(
            f"Stack {stack} takes its demand from {fleet.demand_source.kind}, not Prometheus: "
            "nothing to refresh."
        )
        return
    doc, header, report = refresh_file(fleet, stack, prometheus)
    text = demand_file_text(doc, header)
    for line in report.warnings:
        warn(line)
    if not write:
        sys.stdout.write(text)
        return
    path = demand_file_path(fleet, stack, stacks_dir())
    write_atomic(path, text)  # a reader (the program, a plan) never sees half a file
    err.print(f"Wrote {path} ({len(doc.demand)} models)")
