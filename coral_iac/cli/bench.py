"""`coral bench`: Coral vs Homo vs Cauchy-like on stacks, in both runtime modes, with a
Markdown report and PNG plots (cost by model and method, goodput, solve time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from coral_iac.cli.console import LIBRARY_ROOT, STACKS_DIR, err, out, progress_bar, reports_errors
from solver.errors import CoralError

METHODS = ("coral", "homo", "cauchy")

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

    return LIBRARY_ROOT / f"bench-{digest([sorted(fleet.node_configs), fleet.library])}"


def _simulate(plan: Any, fleet: Any, perf: Any, duration: float) -> dict[str, Any]:
    """Simulated summary at the plan's served demand."""
    from solver.simulation.simulator import simulate
    from solver.simulation.traces import stack_traces

    traces = stack_traces(fleet.models, duration, scale=plan.served_fraction)
    return simulate(plan, fleet, perf, traces, duration).summary()


def bench(
    stacks: Annotated[list[str], typer.Option("--stack", help="Stacks to compare (repeat).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for report.md and plots.")],
    modes: Annotated[list[str] | None, typer.Option("--mode", help="vllm and/or general.")] = None,
    duration: Annotated[float, typer.Option(help="Simulated seconds per plan.")] = 300,
    workers: Annotated[int, typer.Option(help="Workers for library builds.")] = 2,
    target_utilization: Annotated[
        float | None,
        typer.Option(
            min=0.05,
            max=1.0,
            help="Override allocation.target_utilization for every method (headroom).",
        ),
    ] = None,
) -> None:
    """Plan, simulate and compare every method; write the report and plots; print the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from solver.performance.default_model import load_perf_model
    from solver.plan.demand import stack_demand
    from solver.plan.planner import libraries_for, plan_stack
    from solver.stack import load_stack

    perf = load_perf_model()
    rows: list[dict[str, Any]] = []
    with progress_bar() as bar:
        task = bar.add_task("bench", total=len(stacks) * len(modes or ["vllm", "general"]))
        for name in stacks:
            for mode in modes or ["vllm", "general"]:
                fleet = (
                    load_stack(STACKS_DIR, name)
                    .with_mode(mode)
                    .with_target_utilization(target_utilization)
                )
                libs = libraries_for(
                    perf, fleet, list(stack_demand(fleet)), library_cache(fleet), workers=workers
                )
                for method in METHODS:
                    try:
                        plan = plan_stack(name, fleet, perf.catalog, libs, method=method)  # type: ignore[arg-type]
                    except CoralError as e:  # one failed solve must not lose the whole run
                        err.print(Text(f"{name} {mode} {method}: {e}"), highlight=False)
                        rows.append(
                            {"stack": name, "mode": mode, "method": method, "error": str(e)}
                        )
                        continue
                    sim = _simulate(plan, fleet, perf, duration)
                    rows.append(
                        {
                            "stack": name,
                            "mode": mode,
                            "method": method,
                            "usd_per_hour": plan.hourly_cost_usd,
                            "served": plan.served_fraction,
                            "solve_s": plan.solver.solve_seconds if plan.solver else 0.0,
                            "goodput": sim["goodput_tokens_per_s"],
                            "attainment": sim["slo_attainment"],
                            "cost_by_model": {
                                m: sum(v.values()) for m, v in plan.cost_by_model.items()
                            },
                        }
                    )
                bar.advance(task)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = Table(title="Coral vs baselines")
    cols = ("stack", "mode", "method", "$/hour", "served", "goodput tok/s", "SLO met", "solve s")
    for c in cols:
        table.add_column(c, justify="left" if c in ("stack", "mode", "method") else "right")
    u = "each stack's" if target_utilization is None else f"{target_utilization:g}"
    md = [
        "# Coral vs baselines",
        "",
        f"Simulated {duration:g} s per plan at its served demand; target utilization {u}.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in rows:
        if "error" in r:
            cells = [r["stack"], r["mode"], r["method"], "failed", "-", "-", "-", "-"]
            table.add_row(*cells)
            md.append("| " + " | ".join(cells) + " |")
            continue
        cells = [
            r["stack"],
            r["mode"],
            r["method"],
            f"{r['usd_per_hour']:.2f}",
            f"{r['served']:.3f}",
            f"{r['goodput']:,.0f}",
            f"{100 * r['attainment']:.1f}%",
            f"{r['solve_s']:.2f}",
        ]
        table.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if "error" in r]
    md += ["", *headline(rows), ""]
    if failed:
        md += ["Failed:", ""] + [
            f"- {r['stack']} {r['mode']} {r['method']}: {r['error']}" for r in failed
        ] + [""]
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


def headline(rows: list[dict[str, Any]]) -> list[str]:
    """Ratios per stack and mode next to the paper's: Homo's and Cauchy's cost over Coral's,
    and Coral's goodput over theirs (the scarce scenarios' measure)."""
    out = [
        "## Headline ratios",
        "",
        "| stack | mode | Homo $ / Coral $ | Cauchy $ / Coral $ | Coral goodput / Homo "
        "| Coral goodput / Cauchy | paper |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    by = {(r["stack"], r["mode"], r["method"]): r for r in rows}
    for stack, mode in dict.fromkeys((r["stack"], r["mode"]) for r in rows):
        c, h, k = (by[(stack, mode, m)] for m in METHODS)
        if any("error" in r for r in (c, h, k)):
            out.append(f"| {stack} | {mode} | - | - | - | - | {PAPER.get(stack, '')} |")
            continue

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}x" if b > 0 else "-"

        out.append(
            f"| {stack} | {mode} | {ratio(h['usd_per_hour'], c['usd_per_hour'])} "
            f"| {ratio(k['usd_per_hour'], c['usd_per_hour'])} | {ratio(c['goodput'], h['goodput'])} "
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
                color=[{"coral": "C0", "homo": "C1", "cauchy": "C2"}[r["method"]] for r in mine],
            )
            if log:
                ax.set_yscale("log")
            ax.set_title(stack, fontsize=9)
            ax.tick_params(axis="x", labelsize=7)
        finish(fig, fname)


def register(app: typer.Typer) -> None:
    app.command("bench")(reports_errors(bench))
