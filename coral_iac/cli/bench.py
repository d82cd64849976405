"""`coral bench`: Coral vs Homo vs Cauchy-like on stacks, in both runtime modes, with a
Markdown report and PNG plots (cost by model and method, goodput, solve time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from coral_iac.cli.console import (
    FittedTable,
    err,
    library_root,
    load_stack_named,
    out,
    progress_bar,
    reports_errors,
    stacks_dir,
    warn,
)
from solver.errors import CoralError

METHODS = ("coral", "homo", "cauchy")
UNMIXED = "coral-one-gpu-type"  # Coral on a library without mixing (coral:fleet.library.mixing)
COLORS = {"coral": "C0", "homo": "C1", "cauchy": "C2", UNMIXED: "C3"}

# The paper's headline ratios (Mei et al., arXiv 2605.04357, Sec. 6.3-6.5): cost of Homo and
# Cauchy over Coral's at default demand; under scarcity, Coral's goodput over theirs.
PAPER = {
    "paper-core": "cost 1.62x Homo, 1.60x Cauchy",
    "paper-extended": "cost 3.14x Homo, 2.66x Cauchy",
    "paper-core-scarce": "goodput 1.24x Homo at equal cost; 1.51x cheaper than Cauchy",
    "paper-extended-scarce": "goodput 7.64x Homo (at 1.52x its cost), 2.39x Cauchy (1.25x cheaper)",
    "paper-extended-large-heavy": "cost 2.79x Homo, 3.47x Cauchy",
    "paper-extended-small-heavy": "cost 2.34x Homo, 1.64x Cauchy",
}


def library_cache(fleet: Any) -> Path:
    """One library folder per (node configs, library settings), shared by the stacks that have
    the same ones (the paper's scenario stacks); files are checked against their input hashes."""
    from solver.io import digest

    return library_root() / f"bench-{digest([sorted(fleet.node_configs), fleet.library])}"


def with_traces(fleet: Any, traces: str) -> Any:
    """`--traces generated`: models whose workload is named after a packaged trace (Azure
    conversation or code) are judged on that shape's lognormal stand-in instead of the trace
    (`azure`, the default, as `coral plan` does)."""
    from solver.simulation.workload import TRACE_SHAPES

    if traces == "azure":
        return fleet
    models = {
        m: spec.model_copy(update={"workload": f"{spec.workload} (lognormal)"})
        if spec.workload in TRACE_SHAPES and spec.workload_trace is None
        else spec
        for m, spec in fleet.models.items()
    }
    return fleet.model_copy(update={"models": models})


def unmixed(fleet: Any) -> Any:
    """The stack with `library.mixing: false`: one GPU type per template."""
    return fleet.model_copy(update={"library": fleet.library.model_copy(update={"mixing": False})})


def with_target(fleet: Any, target: float | None) -> Any:
    """Every model's SLO attainment target set to `target` (None: the stack's)."""
    if target is None:
        return fleet
    models = {m: s.model_copy(update={"slo_attainment": target}) for m, s in fleet.models.items()}
    return fleet.model_copy(update={"models": models})


def bench_row(
    name: str, mode: str, method: str, fleet: Any, perf: Any, libs: Any, label: str | None = None
) -> dict[str, Any]:
    """One method planned to the stack's attainment targets (the same capacity model and closed
    loop for every method, as `coral plan` runs them: Coral's also over single-config templates),
    verified on the workload the planner never saw; `label` names the row when it is not the
    method's own name."""
    from solver.plan.attainment import simulate_workload
    from solver.plan.planner import plan_to_targets

    plan = plan_to_targets(name, fleet, perf, libs, method=method, root=stacks_dir().parent)  # type: ignore[arg-type]
    sim = simulate_workload(
        plan, fleet, perf, "verify", fleet.attainment.verify_minutes * 60, stacks_dir().parent
    )
    summary: dict[str, Any] = sim.summary() if sim is not None else {}
    return {
        "stack": name,
        "mode": mode,
        "method": label or method,
        "usd_per_hour": plan.hourly_cost_usd,
        "served": plan.served_fraction,
        "gpus": plan.gpus(perf.catalog),
        "solve_s": plan.solver.solve_seconds if plan.solver else 0.0,
        "goodput": summary.get("goodput_tokens_per_s", 0.0),
        "attainment": summary.get("slo_attainment", 0.0),
        "worst_model": min((a.verified or 0.0 for a in plan.attainment), default=0.0),
        "below_target": [a.model for a in plan.below_target()],
        "ttft_p50_ms": summary.get("ttft_p50_ms"),
        "ttft_p99_ms": summary.get("ttft_p99_ms"),
        "tpot_p50_ms": summary.get("tpot_p50_ms"),
        "tpot_p99_ms": summary.get("tpot_p99_ms"),
        "cost_by_model": {m: sum(v.values()) for m, v in plan.cost_by_model.items()},
    }


def bench(
    stacks: Annotated[list[str], typer.Option("--stack", help="Stacks to compare (repeat).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for report.md and plots.")],
    modes: Annotated[list[str] | None, typer.Option("--mode", help="vllm and/or general.")] = None,
    workers: Annotated[int, typer.Option(help="Workers for library builds.")] = 2,
    target: Annotated[
        float | None,
        typer.Option(
            min=0.5, max=0.999, help="Every model's SLO attainment target (default: the stack's)."
        ),
    ] = None,
    traces: Annotated[
        str,
        typer.Option(
            help="azure: the Azure conversation and code models on the real 2023 traces (as "
            "coral plan does); generated: on those shapes' lognormal stand-ins instead."
        ),
    ] = "azure",
    target_utilization: Annotated[
        float | None,
        typer.Option(
            min=0.05,
            max=1.0,
            help="Expert override of the stacks' allocation target_utilization, for every method.",
        ),
    ] = None,
) -> None:
    """Plan every method to the same SLO attainment targets, verify each by simulation, and
    compare cost, achieved attainment, goodput and latency; write the report and plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from coral_iac.demand_sources import resolve_demand
    from solver.errors import InputError
    from solver.performance.default_model import load_perf_model
    from solver.plan.demand import stack_demand
    from solver.plan.planner import libraries_for

    if traces not in ("azure", "generated"):
        raise InputError("--traces", f"unknown value '{traces}'", "use azure or generated")
    rows: list[dict[str, Any]] = []
    with progress_bar() as bar:
        task = bar.add_task("bench", total=len(stacks) * len(modes or ["vllm", "general"]))
        for name in stacks:
            for mode in modes or ["vllm", "general"]:
                stack_fleet = resolve_demand(load_stack_named(name), name, stacks_dir(), warn)
                perf = load_perf_model(cards=stack_fleet.model_cards)  # the stack's own models
                fleet = with_target(
                    with_traces(
                        stack_fleet.with_mode(mode).with_target_utilization(target_utilization),
                        traces,
                    ),
                    target,
                )
                libs = libraries_for(
                    perf, fleet, list(stack_demand(fleet)), library_cache(fleet), workers=workers
                )
                for method in (*METHODS, UNMIXED):
                    try:
                        if method == UNMIXED:  # what mixing GPU types buys on this stack
                            one = unmixed(fleet)
                            one_libs = libraries_for(
                                perf,
                                one,
                                list(stack_demand(one)),
                                library_cache(one),
                                workers=workers,
                            )
                            rows.append(bench_row(name, mode, "coral", one, perf, one_libs, method))
                        else:
                            rows.append(bench_row(name, mode, method, fleet, perf, libs))
                    except CoralError as e:  # one failed solve must not lose the whole run
                        err.print(Text(f"{name} {mode} {method}: {e}"), highlight=False)
                        rows.append(
                            {"stack": name, "mode": mode, "method": method, "error": str(e)}
                        )
                bar.advance(task)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = FittedTable(title="Coral vs baselines at equal SLO attainment targets")
    cols = (
        "stack",
        "mode",
        "method",
        "$/hour",
        "GPUs",
        "served",
        "SLO met (worst model)",
        "goodput tok/s",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
        "solve s",
    )
    for c in cols:
        table.add_column(c, justify="left" if c in ("stack", "mode", "method") else "right")
    md = [
        "# Coral vs baselines at equal SLO attainment",
        "",
        "Every method is planned to the same per-model SLO attainment targets with the same "
        "capacity model and closed loop (docs/slo-attainment.md), then verified by simulation "
        "on a workload no planner saw, at the demand it serves. "
        f"Traces: {traces}; target: {'each stack' + chr(39) + 's' if target is None else target}.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        if "error" in r:
            cells = [r["stack"], r["mode"], r["method"], "failed", *["-"] * (len(cols) - 4)]
            table.add_row(*cells)
            md.append("| " + " | ".join(cells) + " |")
            continue
        short = f" (short: {', '.join(r['below_target'])})" if r["below_target"] else ""
        cells = [
            r["stack"],
            r["mode"],
            r["method"],
            f"{r['usd_per_hour']:.2f}",
            str(r["gpus"]),
            f"{r['served']:.3f}",
            f"{100 * r['attainment']:.1f}% ({100 * r['worst_model']:.1f}%){short}",
            f"{r['goodput']:,.0f}",
            f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])}",
            f"{_ms(r['tpot_p50_ms'])} / {_ms(r['tpot_p99_ms'])}",
            f"{r['solve_s']:.2f}",
        ]
        table.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if "error" in r]
    md += ["", *headline(rows), ""]
    if failed:
        md += (
            ["Failed:", ""]
            + [f"- {r['stack']} {r['mode']} {r['method']}: {r['error']}" for r in failed]
            + [""]
        )
    md += [
        "![cost by model](cost_by_model.png)",
        "![goodput](goodput.png)",
        "![solve time](solve_time.png)",
    ]
    (out_dir / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    (out_dir / "results.json").write_text(
        json.dumps(rows, indent=1, sort_keys=True) + "\n", encoding="utf-8"
    )
    _plots(plt, [r for r in rows if "error" not in r], out_dir)
    out.print(table)
    err.print(f"Wrote {out_dir / 'report.md'}, results.json and 3 plots")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def headline(rows: list[dict[str, Any]]) -> list[str]:
    """Ratios per stack and mode next to the paper's: Homo's and Cauchy's cost over Coral's,
    and Coral's goodput over theirs (the scarce scenarios' measure)."""
    out = [
        "## Headline ratios",
        "",
        "| stack | mode | Homo $ / Coral $ | Cauchy $ / Coral $ | one GPU type $ / Coral $ "
        "| Coral goodput / Homo | Coral goodput / Cauchy | paper |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    by = {(r["stack"], r["mode"], r["method"]): r for r in rows}
    for stack, mode in dict.fromkeys((r["stack"], r["mode"]) for r in rows):
        c, h, k = (by[(stack, mode, m)] for m in METHODS)
        u = by.get((stack, mode, UNMIXED), {"error": "not run"})
        if any("error" in r for r in (c, h, k)):
            out.append(f"| {stack} | {mode} | - | - | - | - | - | {PAPER.get(stack, '')} |")
            continue

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}x" if b > 0 else "-"

        def cost(base: dict[str, Any], coral: dict[str, Any]) -> str:
            """A baseline that serves nothing (its budget or pools allow none of its
            replicas) has no cost ratio: its $0 or its idle nodes would read as cheaper."""
            if not base["served"]:
                return "serves nothing"
            return ratio(base["usd_per_hour"], coral["usd_per_hour"])

        out.append(
            f"| {stack} | {mode} | {cost(h, c)} | {cost(k, c)} "
            f"| {'-' if 'error' in u else cost(u, c)} | {ratio(c['goodput'], h['goodput'])} "
            f"| {ratio(c['goodput'], k['goodput'])} | {PAPER.get(stack, '')} |"
        )
    return out


def _plots(plt: Any, rows: list[dict[str, Any]], out_dir: Path) -> None:
    """One panel per stack, one bar per (mode, method): cost stacked by model, goodput, solve
    time (log scale)."""
    stacks = list(dict.fromkeys(r["stack"] for r in rows))
    models = sorted({m for r in rows for m in r["cost_by_model"]})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(models)}

    def panels(title: str) -> tuple[Any, list[Any]]:
        cols = min(3, len(stacks))
        nrows = -(-len(stacks) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        for ax in axes.flat[len(stacks) :]:
            ax.set_visible(False)
        fig.suptitle(title)
        return fig, list(axes.flat)

    def finish(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)

    fig, axes = panels("Cost by model and method ($/hour)")
    for ax, stack in zip(axes, stacks, strict=False):
        mine = [r for r in rows if r["stack"] == stack]
        labels = [f"{r['mode']}\n{r['method']}" for r in mine]
        bottom = [0.0] * len(mine)
        for m in models:
            vals = [r["cost_by_model"].get(m, 0.0) for r in mine]
            ax.bar(labels, vals, bottom=bottom, label=m, color=colors[m])
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(stack, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].legend(fontsize=6)
    finish(fig, "cost_by_model.png")
    for key, fname, title, log in (
        ("goodput", "goodput.png", "Simulated goodput (SLO-meeting output tokens/s)", False),
        ("solve_s", "solve_time.png", "Allocation solve time (s, log)", True),
    ):
        fig, axes = panels(title)
        for ax, stack in zip(axes, stacks, strict=False):
            mine = [r for r in rows if r["stack"] == stack]
            values = [max(r[key] or 0.0, 1e-3) if log else r[key] or 0.0 for r in mine]
            ax.bar(
                [f"{r['mode']}\n{r['method']}" for r in mine],
                values,
                color=[COLORS[r["method"]] for r in mine],
            )
            if log:
                ax.set_yscale("log")
            ax.set_title(stack, fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
        finish(fig, fname)


def register(app: typer.Typer) -> None:
    app.command("bench")(reports_errors(bench))
