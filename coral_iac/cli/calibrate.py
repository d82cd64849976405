"""`coral calibrate`: fit the performance model's step times to the running fleet's own latency."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

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
from solver.errors import InputError, mask_credentials


def calibrate_cmd(
    stack: Annotated[str, typer.Option(help="Stack name (stacks/Pulumi.<stack>.yaml).")],
    plan_file: Annotated[
        Path, typer.Option("--plan", help="The running plan: plan.json from `coral plan --out`.")
    ],
    prometheus: Annotated[
        str | None,
        typer.Option(
            "--prometheus",
            help="Prometheus base URL (default: the stack's demand_source.prometheus.url).",
        ),
    ] = None,
    metrics: Annotated[
        Path | None,
        typer.Option(
            "--metrics",
            help="Instead of Prometheus: a recorded exposition (the text of /federate, or of "
            "vLLM's /metrics) whose series carry the coral_replica label; --window is then the "
            "time its counters cover.",
        ),
    ] = None,
    window: Annotated[str, typer.Option(help="The window read, a Prometheus duration.")] = "1h",
    write: Annotated[
        bool,
        typer.Option(
            "--write",
            help="Store the corrections in the stack file (coral:fleet.calibration); the next "
            "plan and `pulumi up` use them.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also draw predicted against measured p50/p90 (PNG) here."),
    ] = None,
) -> None:
    """Replay each replica's measured load through its engine model and fit, per GPU type, model
    and phase, how much slower (or faster) its steps are than modelled."""

    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from coral_iac.cli.plan import load_plan
    from coral_iac.demand_sources import checked_url, with_prometheus_url
    from coral_iac.fleet_metrics import (
        metrics_from_exposition,
        read_replica_metrics,
        window_seconds,
    )
    from solver.io import read_text
    from solver.operations.step_calibration import ReplicaFit, calibrate, pool, replica_facts
    from solver.performance.default_model import load_perf_model
    from solver.plan.length_routing import fleet_for_plan
    from solver.stack import PrometheusSource
    from solver.validation import check_fleet

    window_seconds(window)  # a bad --window fails before anything is read
    if metrics is not None and prometheus is not None:
        raise InputError(
            "--metrics", "given with --prometheus", "read one source: drop one of the options"
        )
    fleet = load_stack_named(stack)
    plan = load_plan(plan_file)
    if plan.stack != stack:
        warn(f"{plan_file} is a plan of stack {plan.stack}, calibrated against {stack}")
    fleet = fleet_for_plan(fleet, plan)
    deployed = load_perf_model(cards=fleet.model_cards, corrections=fleet.step_corrections())
    check_fleet(fleet, deployed.catalog, deployed.cards)
    base = load_perf_model(cards=fleet.model_cards)
    facts = replica_facts(plan, fleet.models, base, deployed)
    keys = [f.replica for f in facts]
    if metrics is not None:
        source = f"recorded exposition {metrics.name}, covering {window}"
        measured = metrics_from_exposition(read_text(metrics), keys, window)
        queries: list[str] = []
    else:
        configured = fleet.demand_source.prometheus
        if configured is None and prometheus is None:
            raise InputError(
                "--prometheus",
                f"stack {stack} names no Prometheus (demand_source.prometheus.url)",
                "pass --prometheus URL, or --metrics FILE with a recorded exposition",
            )
        settings = (
            with_prometheus_url(configured, prometheus)
            if configured is not None
            else PrometheusSource(url=checked_url(str(prometheus), "--prometheus"))
        )
        source = f"Prometheus {mask_credentials(settings.url)}, increase() over {window}"
        measured, queries = read_replica_metrics(settings, keys, window)
    cards = deployed.cards
    results = calibrate(
        facts,
        measured,
        lambda m: cards[m.split("@")[0]].max_context if m.split("@")[0] in cards else None,
        progress=lambda r: err.print(f"replaying {r} ..."),
    )
    fits = [r for r in results if isinstance(r, ReplicaFit)]
    corrections, notes = pool(fits)
    rows = [_row(r) for r in results]
    if as_json:
        print_json(
            {
                "stack": stack,
                "source": source,
                "window": window,
                "queries": queries,
                "replicas": rows,
                "corrections": [c.__dict__ | {"replicas": list(c.replicas)} for c in corrections],
                "notes": notes,
            }
        )
    else:
        _print(stack, source, rows, corrections, notes)
    if plot is not None:
        _plot(plot, results)
        err.print(f"Wrote {plot}")
    if write:
        _write(stack, fleet, corrections, source, window)


def _row(r: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "replica": r.replica,
        "model": r.model,
        "phase": r.phase,
        "gpus": sorted(set(r.gpus)),
        "requests": r.requests,
    }
    if hasattr(r, "factors"):
        row |= {
            "factors": {
                phase: {"factor": k, "low": lo, "high": hi} for phase, (k, lo, hi) in r.factors.items()
            },
            "replay": r.replay,
        }
    else:
        row["refused"] = r.reason
    row["quantiles"] = {
        q.metric: {
            f"{kind}_{stat}_ms": values[i] * 1e3
            for kind, values in (
                ("measured", q.measured), ("predicted", q.predicted),
                ("uncalibrated", q.uncalibrated),
            )  # fmt: skip
            for i, stat in enumerate(("mean", "p50", "p90"))
        }
        for q in r.quantiles
    }
    return row


def _ms(values: dict[str, float], kind: str) -> str:
    return " / ".join(f"{values[f'{kind}_{stat}_ms']:,.0f}" for stat in ("mean", "p50", "p90"))


def _print(
    stack: str, source: str, rows: list[dict[str, Any]], corrections: list[Any], notes: list[str]
) -> None:
    table = FittedTable(title=f"Calibration of stack {stack} ({source})")
    for col in ("replica", "GPUs", "requests", "latency", "measured ms", "model ms",
                "calibrated ms", "factor (95%)"):  # fmt: skip
        left = col in ("replica", "GPUs", "latency")
        table.add_column(col, justify="left" if left else "right", overflow="fold")
    for r in rows:
        factor = (
            "; ".join(
                (f"{phase} " if len(r["factors"]) > 1 else "")
                + f"{f['factor']:.2f} ({f['low']:.2f}-{f['high']:.2f})"
                for phase, f in r["factors"].items()
            )
            if "factors" in r
            else "refused"
        )
        metrics = r["quantiles"] or {"-": None}
        for i, (metric, q) in enumerate(metrics.items()):
            first = i == 0
            table.add_row(
                r["replica"] if first else "", ", ".join(r["gpus"]) if first else "",
                f"{r['requests']:,}" if first else "",
                f"{metric.upper()} mean / p50 / p90" if q else "-",
                _ms(q, "measured") if q else "-", _ms(q, "uncalibrated") if q else "-",
                _ms(q, "predicted") if q else "-", factor if first else "",
            )  # fmt: skip
    out.print(table)
    for r in rows:
        if "refused" in r:
            warn(f"{r['replica']}: not fitted: {r['refused']}")
    for line in notes:
        warn(line)
    if not corrections:
        out.print("No correction fitted.")
        return
    summary = FittedTable(title="Step-time corrections (measured / modelled)")
    for col in ("GPU", "model", "phase", "factor", "95% interval", "requests", "replicas"):
        summary.add_column(col, justify="right" if col in ("factor", "requests") else "left")
    for c in corrections:
        summary.add_row(c.gpu, c.model, c.phase, f"{c.factor:.3f}", f"{c.low:.3f}-{c.high:.3f}",
                        f"{c.requests:,}", str(len(c.replicas)))  # fmt: skip
    out.print(summary)


def _plot(path: Path, results: list[Any]) -> None:
    # Deferred: matplotlib takes a second to import, and only --plot draws.
    import matplotlib

    matplotlib.use("Agg")
    # After use("Agg"): pyplot picks its backend when imported (no display needed).
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        points = [(r, q) for r in results for q in r.quantiles if q.metric == metric]
        lo, hi = math.inf, 0.0
        for _, q in points:
            for values, style in ((q.uncalibrated, "o"), (q.predicted, "s")):
                ms = [v * 1e3 for v in values[1:]]  # p50 and p90
                measured = [v * 1e3 for v in q.measured[1:]]
                filled = style == "s"
                ax.scatter(measured, ms, marker=style, facecolors=None if filled else "none",
                           edgecolors="C0" if filled else "C1", c="C0" if filled else None)  # fmt: skip
                lo, hi = min(lo, *ms, *measured), max(hi, *ms, *measured)
        if points:
            ax.plot([lo / 1.2, hi * 1.2], [lo / 1.2, hi * 1.2], "k--", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_title(f"{metric.upper()} p50 and p90 per replica")
        ax.set_xlabel("measured (ms)")
        ax.set_ylabel("predicted (ms)")
    axes[0].scatter([], [], marker="o", facecolors="none", edgecolors="C1", label="model")
    axes[0].scatter([], [], marker="s", c="C0", label="calibrated")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write(stack: str, fleet: Any, corrections: list[Any], source: str, window: str) -> None:
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from coral_iac.stack_files import with_fleet_key
    from solver.io import write_atomic
    from solver.stack import FleetCalibration, StepCorrection, parse_fleet, stack_path

    if not corrections:
        err.print("Nothing fitted: the stack file is unchanged.")
        return
    # A (GPU type, model) measured again replaces all its corrections (an aggregated model's
    # one factor, or its prompt and decode steps' apart); the others are kept.
    fresh = {(c.gpu, c.model) for c in corrections}
    kept = [
        c
        for c in (fleet.calibration.corrections if fleet.calibration else [])
        if (c.gpu, c.model) not in fresh
    ]
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    calibration = FleetCalibration(
        source=f"coral calibrate: {source}",
        window=window,
        measured_utc=now,
        corrections=sorted(
            kept
            + [
                StepCorrection(
                    gpu=c.gpu, model=c.model, phase=c.phase, factor=round(c.factor, 4),
                    low=round(c.low, 4), high=round(c.high, 4), requests=c.requests,
                    replicas=list(c.replicas), measured_utc=now,
                )  # fmt: skip
                for c in corrections
            ],
            key=lambda c: (c.gpu, c.model, c.phase),
        ),
    )
    value = calibration.model_dump(mode="json", exclude_none=True)
    path = stack_path(stacks_dir(), stack)
    text = with_fleet_key(path, "calibration", value)
    parse_fleet(yaml.safe_load(text)["config"], str(path), stacks_dir())  # never write a bad file
    write_atomic(path, text)
    err.print(
        f"Wrote {len(corrections)} corrections to {path} (coral:fleet.calibration"
        + (f"; kept {len(kept)} measured earlier" if kept else "")
        + ")"
    )


def register(app: typer.Typer) -> None:
    app.command("calibrate")(reports_errors(calibrate_cmd))
