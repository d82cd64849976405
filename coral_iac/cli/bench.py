"""`coral bench`: the evaluation's one door.

`coral bench --stack S --out DIR`: Coral vs Homo vs Cauchy-like on stacks, in both runtime
modes, with a Markdown report and PNG plots (cost by model and method, goodput, solve time).
Its subcommands run the paper evaluation (`solver/evaluation/`): `paper` (every Sec. 6 scenario
beside the paper's ratios), `explain` (the measurements behind the differences), `helix`
(Sec. 6.6, coupled and uncoupled decode), `figures` (Fig. 1a and 1b) and `fig1a` (Fig. 1a for
any job); and `spot` (each stack on-demand only and with spot allowed). The paper's numbers come from `solver/data/paper_results.yaml`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.text import Text
from typer.core import TyperGroup

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
from solver.errors import CoralError, InputError
from solver.io import digest, read_text
from solver.types import LibPhase

METHODS = ("coral", "homo", "cauchy")
UNMIXED = "coral-one-gpu-type"  # Coral on a library without mixing (coral:fleet.library.mixing)
COLORS = {"coral": "C0", "homo": "C1", "cauchy": "C2", UNMIXED: "C3"}


def paper_claim(stack: str) -> str:
    """The paper's ratios for a stack that is one of its Sec. 6 scenarios as committed (Homo's
    and Cauchy's cost over Coral's; under scarcity, Coral's goodput over theirs), from
    `solver/data/paper_results.yaml`; "" for any other stack."""
    # Deferred: the evaluation loads the planner (OR-Tools); `coral --help` should not.
    from solver.evaluation.paper_results import paper_results
    from solver.evaluation.scenarios import scenario_of_stack

    key = scenario_of_stack(stack)
    return "" if key is None else paper_results().summary(key)


def library_cache(fleet: Any) -> Path:
    """One library folder per (node configs, library settings), shared by the stacks that have
    the same ones (the paper's scenario stacks); files are checked against their input hashes."""
    return library_root() / f"bench-{digest([sorted(fleet.node_configs), fleet.library])}"


def with_traces(fleet: Any, traces: str) -> Any:
    """`--traces generated`: models whose workload is named after a packaged trace (Azure
    conversation or code) are judged on that shape's lognormal stand-in instead of the trace
    (`azure`, the default, as `coral plan` does)."""
    # Deferred: the simulator's modules (numpy, traces) load only when a bench runs.
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
    loop for every method, as `coral plan` runs them: Coral's also over restrictions of its
    templates, `planner.RESTRICTIONS`),
    verified on the workload the planner never saw; `label` names the row when it is not the
    method's own name."""
    # Deferred: the planner loads OR-Tools; `coral --help` should not.
    from solver.plan.attainment import simulate_workload
    from solver.plan.planner import plan_to_targets

    plan = plan_to_targets(name, fleet, perf, libs, method=method, root=stacks_dir().parent)  # type: ignore[arg-type]
    sim = simulate_workload(
        plan,
        fleet.models,
        perf,
        "verify",
        fleet.attainment.verify_minutes * 60,
        stacks_dir().parent,
    )
    summary: dict[str, Any] = sim.summary() if sim is not None else {}
    return {
        "stack": name,
        "mode": mode,
        "method": label or method,
        "usd_per_hour": plan.hourly_cost_usd,
        "served": plan.served_fraction,
        "serves_any": plan.serves_any(),
        "gpus": plan.gpus(perf.catalog),
        "solve_s": plan.solver.solve_seconds if plan.solver else 0.0,
        "goodput": summary.get("goodput_tokens_per_s", 0.0),
        "attainment": summary.get("slo_attainment", 0.0),
        "worst_model": min((a.judged or 0.0 for a in plan.attainment), default=0.0),
        "below_target": [a.model for a in plan.below_target()],
        "ttft_p50_ms": summary.get("ttft_p50_ms"),
        "ttft_p99_ms": summary.get("ttft_p99_ms"),
        "tpot_p50_ms": summary.get("tpot_p50_ms"),
        "tpot_p99_ms": summary.get("tpot_p99_ms"),
        "cost_by_model": {m: sum(v.values()) for m, v in plan.cost_by_model.items()},
    }


class BenchGroup(TyperGroup):
    """`coral bench --stack S --out DIR` compares methods on stacks; `coral bench paper` and the
    other subcommands run the paper evaluation. The help says both and marks --stack and --out
    required; the parser cannot require them (the subcommands take neither), so `bench` checks."""

    def format_usage(self, ctx: Any, formatter: Any) -> None:
        formatter.write_usage(ctx.command_path, "--stack NAME [--stack ...] --out DIR [OPTIONS]")
        formatter.write_usage(ctx.command_path, "COMMAND [OPTIONS]", prefix="       ")

    def format_help(self, ctx: Any, formatter: Any) -> None:
        required = [p for p in self.params if p.name in ("stacks", "out_dir")]
        for p in required:
            p.required = True
        try:
            super().format_help(ctx, formatter)
        finally:
            for p in required:
                p.required = False


bench_app = typer.Typer(cls=BenchGroup, invoke_without_command=True)


def bench(
    ctx: typer.Context,
    stacks: Annotated[
        list[str] | None, typer.Option("--stack", help="Stacks to compare (repeat).")
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Folder for report.md and plots.")
    ] = None,
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
    """Compare Coral with its baselines at equal SLO attainment targets, or run the paper's
    evaluation (the commands below).

    With --stack and --out: plan every method (Coral, Homo, Cauchy-like, Coral on one GPU type
    per template) to the same SLO attainment targets, verify each by simulation, and compare
    cost, achieved attainment, goodput and latency; write report.md, results.json and plots."""
    if ctx.invoked_subcommand is not None:
        if stacks or out_dir is not None:
            raise typer.BadParameter(
                f"--stack and --out belong to `coral bench` itself, not to `coral bench "
                f"{ctx.invoked_subcommand}` (see `coral bench {ctx.invoked_subcommand} --help`)",
                param_hint="--stack/--out",
            )
        return
    if not stacks:
        raise typer.BadParameter(
            "missing: pass --stack NAME (repeatable) and --out DIR, or name a command (see "
            "`coral bench --help`)",
            param_hint="--stack",
        )
    if out_dir is None:
        raise typer.BadParameter("missing: pass --out DIR", param_hint="--out")
    # matplotlib is optional and heavy, the planner loads OR-Tools: loaded only to bench.
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    # pyplot after the backend is chosen.
    import matplotlib.pyplot as plt

    from coral_iac.demand_sources import resolve_demand
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
                perf = load_perf_model(
                    cards=stack_fleet.model_cards, corrections=stack_fleet.step_corrections()
                )  # the stack's own models
                fleet = with_target(
                    with_traces(
                        stack_fleet.with_mode(mode).with_target_utilization(target_utilization),
                        traces,
                    ),
                    target,
                )
                libs = libraries_for(
                    perf,
                    fleet,
                    list(stack_demand(fleet.models)),
                    library_cache(fleet),
                    workers=workers,
                )
                for method in (*METHODS, UNMIXED):
                    try:
                        if method == UNMIXED:  # what mixing GPU types buys on this stack
                            one = unmixed(fleet)
                            one_libs = libraries_for(
                                perf,
                                one,
                                list(stack_demand(one.models)),
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
            out.append(f"| {stack} | {mode} | - | - | - | - | - | {paper_claim(stack)} |")
            continue

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.2f}x" if b > 0 else "-"

        def cost(base: dict[str, Any], coral: dict[str, Any]) -> str:
            """A baseline that serves nothing (its budget or pools allow none of its
            replicas) has no cost ratio: its $0 or its idle nodes would read as cheaper. One
            that serves some models but not others ("served", the least served model's
            share, is 0) has one."""
            if not base.get("serves_any", base["served"] > 0):
                return "serves nothing"
            return ratio(base["usd_per_hour"], coral["usd_per_hour"])

        out.append(
            f"| {stack} | {mode} | {cost(h, c)} | {cost(k, c)} "
            f"| {'-' if 'error' in u else cost(u, c)} | {ratio(c['goodput'], h['goodput'])} "
            f"| {ratio(c['goodput'], k['goodput'])} | {paper_claim(stack)} |"
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


BENCH_HELP = (
    "Compare Coral with its baselines on stacks (--stack, --out), or run the paper's evaluation "
    "(the commands below: paper, explain, helix, figures, fig1a).\n\n"
    "With --stack and --out: plan every method (Coral, Homo, Cauchy-like, and Coral on one GPU "
    "type per template) to the same SLO attainment targets, verify each by simulation, and "
    "compare cost, achieved attainment, goodput and latency; write report.md, results.json and "
    "plots. docs/simulator.md and docs/paper-setup.md describe both."
)
bench_app.callback(help=BENCH_HELP)(reports_errors(bench))


# ---------------------------------------------------------------- the paper's evaluation


def _project() -> Path:
    """The project folder: its stacks/, and relative trace paths."""
    return stacks_dir().parent


def _cache(name: str) -> Path:
    """The evaluation's own cache folder beside the library cache (.coral/<name>)."""
    return library_root().parent / name


def _log(line: str) -> None:
    err.print(Text(line), highlight=False)


def _provenance(workers: int | None = None) -> dict[str, Any]:
    """What a report records about its run: the commit (short hash, "" outside git), the date
    and, when given, the library build workers."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=_project(),
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:  # no git
        commit = ""
    out: dict[str, Any] = {"commit": commit, "date": time.strftime("%Y-%m-%d")}
    return out if workers is None else out | {"workers": workers}


def _choices(given: list[str] | None, known: tuple[str, ...] | list[str], hint: str) -> list[str]:
    """`given` (default: all of `known`), each checked against `known`."""
    unknown = [g for g in given or [] if g not in known]
    if unknown:
        raise typer.BadParameter(f"{unknown}: choose from {list(known)}", param_hint=hint)
    return list(given or known)


SCENARIO_HELP = (
    "A scenario of the paper's Sec. 6 (repeatable): core/default, core/scarce, core/large-heavy, "
    "core/small-heavy, extended/default, extended/scarce, extended/large-heavy, "
    "extended/small-heavy, helix."
)
VARIANT_HELP = (
    "paper (paper mode, Table 1 market, homo-paper and cauchy-paper) and/or ours (the stack as "
    "committed, homo and cauchy); default both."
)


@bench_app.command(
    "paper",
    help="The paper's ratios beside ours: every Sec. 6 scenario planned with Coral and both "
    "baselines, in the paper's setup and ours, at equal SLO attainment targets.\n\n"
    "Prints the comparison table (Markdown) and, with --out, writes table.md and table.json "
    "there. The whole run (every scenario, both variants, libraries built cold) takes 25-40 "
    "minutes on 2 cores; --scenario picks fewer. docs/paper-setup.md explains the table.",
)
@reports_errors
def paper(
    scenario: Annotated[
        list[str] | None, typer.Option(help=SCENARIO_HELP + " Default: all.")
    ] = None,
    variant: Annotated[list[str] | None, typer.Option(help=VARIANT_HELP)] = None,
    workers: Annotated[int, typer.Option(help="Library build processes.")] = 2,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Write table.md and table.json here.")
    ] = None,
    paper_n_max: Annotated[
        list[str] | None,
        typer.Option(
            help="SETUP=N: the paper variant's N_max for a setup (core, extended, helix; "
            "default extended=4, the paper's is 6: hours to build)."
        ),
    ] = None,
    combine: Annotated[
        list[Path] | None,
        typer.Option(help="Render from earlier runs' table.json files (merged) instead."),
    ] = None,
    demand_scale: Annotated[
        float,
        typer.Option(help="Every model's requests/s times this (e.g. 3: the paper's GPU counts)."),
    ] = 1.0,
) -> None:
    """`solver.evaluation.paper_comparison` on the chosen scenarios, reported."""
    # Deferred: the evaluation loads the planner (OR-Tools); `coral --help` should not.
    from solver.evaluation import paper_comparison
    from solver.evaluation.scenarios import PAPER_N_MAX, SCENARIO_KEYS, SETUPS, VARIANTS
    from solver.performance.default_model import load_perf_model

    def write(result: dict[str, Any], quiet: bool = False) -> None:
        text = paper_comparison.report(result)
        if not quiet:
            typer.echo(text)
        if out_dir is not None:
            paper_comparison.save_report(out_dir, "table", text, result)
            if not quiet:
                err.print(f"Wrote {out_dir / 'table.md'} and table.json", highlight=False)

    if combine:
        write(paper_comparison.combined([json.loads(read_text(f)) for f in combine]))
        return
    n_max = dict(PAPER_N_MAX)
    for item in paper_n_max or []:
        setup, _, value = item.partition("=")
        if setup not in SETUPS or not value.isdigit() or int(value) < 1:
            raise typer.BadParameter(
                f"'{item}': give SETUP=N with SETUP one of {sorted(SETUPS)} and N >= 1, "
                "e.g. extended=6",
                param_hint="--paper-n-max",
            )
        n_max[setup] = int(value)
    keys = _choices(scenario, SCENARIO_KEYS, "--scenario")
    variants = _choices(variant, list(VARIANTS), "--variant")
    if not demand_scale > 0:
        raise typer.BadParameter(f"{demand_scale}: give a factor > 0", param_hint="--demand-scale")
    result = paper_comparison.run_comparison(
        keys,
        variants,
        load_perf_model(),
        workers,
        _project() / "stacks",
        _cache("paper_eval"),
        _provenance(workers),
        log=_log,
        paper_n_max=n_max,
        demand_scale=demand_scale,
        on_scenario=lambda r: write(r, quiet=True),  # what is done survives a later failure
    )
    write(result)


@bench_app.command(
    "explain",
    help="The measurements behind the differences between the paper's ratios and ours: each "
    "method's plan tightened job by job, every method at library T̂ in the simulator, "
    "single-node prefill at smaller per-stage budgets, and Coral on Helix's cluster at more "
    "demand.\n\n"
    "Prints explain.md and writes it with explain.json to --out. Reuses `coral bench paper`'s "
    "libraries; about 10 minutes on 2 cores for the core scenarios once they are built.",
)
@reports_errors
def explain(
    scenario: Annotated[
        list[str] | None, typer.Option(help=SCENARIO_HELP + " Default: the core ones.")
    ] = None,
    workers: Annotated[int, typer.Option(help="Library build processes.")] = 2,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Where explain.md and explain.json go.")
    ] = Path("docs/bench/paper"),
    merge: Annotated[
        bool, typer.Option(help="Keep the other scenarios of an explain.json already in --out.")
    ] = False,
    variant: Annotated[list[str] | None, typer.Option(help=VARIANT_HELP)] = None,
) -> None:
    """`solver.evaluation.paper_explain` on the chosen scenarios, reported."""
    # Deferred: the evaluation loads the planner (OR-Tools); `coral --help` should not.
    from solver.evaluation import paper_explain
    from solver.evaluation.paper_comparison import save_report
    from solver.evaluation.scenarios import SCENARIO_KEYS, VARIANTS
    from solver.performance.default_model import load_perf_model
    from solver.plan.attainment import MARGIN

    keys = _choices(scenario, SCENARIO_KEYS, "--scenario") if scenario else []
    keys = keys or [k for k in SCENARIO_KEYS if k.startswith("core/")]
    variants = _choices(variant, list(VARIANTS), "--variant")
    t0 = time.perf_counter()
    result: dict[str, Any] = _provenance() | {"margin": MARGIN}
    result["scenarios"] = paper_explain.run(
        keys, load_perf_model(), workers, _log, _project(), _cache("paper_eval"), variants
    )
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["runs"] = [{k: result[k] for k in ("commit", "date", "seconds")} | {"scenarios": keys}]
    earlier = out_dir / "explain.json"
    if merge and earlier.exists():
        result = paper_explain.merged(result, json.loads(read_text(earlier)))
    text = paper_explain.markdown(result)
    typer.echo(text)
    save_report(out_dir, "explain", text, result)
    err.print(f"Wrote {out_dir / 'explain.md'} and explain.json", highlight=False)


@bench_app.command(
    "helix",
    help="The paper's Helix comparison (Sec. 6.6): paper-helix in the paper's template space, "
    "with coupled decode pipelines (one micro-batch size at every stage) and with the paper's "
    "uncoupled per-stage T̂; each plan's templates and the whole plan checked in the "
    "simulator.\n\n"
    "Prints JSON (docs/bench/paper-figures/helix.json is this output). 1-3 minutes on 2 cores "
    "with the libraries built cold.",
)
@reports_errors
def helix(
    workers: Annotated[int, typer.Option(help="Library build processes (coupled).")] = 1,
    duration: Annotated[float, typer.Option(help="Simulated seconds per check.")] = 1200.0,
) -> None:
    """`solver.evaluation.paper_helix.run`, as JSON on stdout."""
    # Deferred: the evaluation loads the planner (OR-Tools); `coral --help` should not.
    from solver.evaluation import paper_helix
    from solver.performance.default_model import load_perf_model

    result = paper_helix.run(
        load_perf_model(), _project(), _cache("paper_helix"), workers, duration
    )
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


@bench_app.command(
    "figures",
    help="The paper's Fig. 1a (Qwen3-235B prefill: best mixed-GPU template against the best "
    "single-type ones, per $/hour) and Fig. 1b (GPT-OSS-120B decode: how evenly heterogeneous "
    "and homogeneous node sets cover the throughput range) on our performance model, in the "
    "paper's set-up and ours.\n\n"
    "Writes fig1a.png, fig1b.png and numbers.json to --out and prints a summary (JSON). About 2 "
    "minutes on 2 cores with the libraries built cold.",
)
@reports_errors
def figures(
    out_dir: Annotated[
        Path, typer.Option("--out", help="Folder for fig1a.png, fig1b.png, numbers.json.")
    ] = Path("docs/bench/paper-figures"),
    workers: Annotated[int, typer.Option(help="Library build processes.")] = 2,
    setups: Annotated[
        str,
        typer.Option(
            help="Comma-separated: paper (paper mode, Table 1 market) and/or ours (as committed)."
        ),
    ] = "paper,ours",
    node_configs: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated node configs, or 'all' for the stack's (default: L40S, H100 "
            "and A100-80GB at 1, 2, 4 and 8 GPUs)."
        ),
    ] = None,
    stack: Annotated[
        str, typer.Option(help="The stack whose Fig. 1a and 1b jobs are built.")
    ] = "paper-extended",
) -> None:
    """`solver.evaluation.paper_figures.run`, drawn and written."""
    # Deferred: the evaluation loads the planner (OR-Tools) and matplotlib; `coral --help`
    # should not.
    from solver.evaluation import paper_figures
    from solver.performance.default_model import load_perf_model

    chosen = _choices(setups.split(","), ["paper", "ours"], "--setups")
    given = node_configs or ",".join(paper_figures.NODE_CONFIGS)
    nodes = None if given == "all" else given.split(",")
    load_stack_named(stack)  # the name checked, and a missing stack named
    doc = paper_figures.run(
        load_perf_model(),
        chosen,
        workers,
        nodes,
        _project() / "stacks",
        _cache("paper_figures"),
        stack,
    )
    summary = paper_figures.write_figures(doc, out_dir)
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    err.print(f"Wrote {out_dir / 'fig1a.png'}, fig1b.png and numbers.json", highlight=False)


@bench_app.command(
    "fig1a",
    help="Fig. 1a for any (model, phase) of a stack: the best mixed-GPU serving template "
    "against the best single-GPU-type one, in tokens/s per $/hour, at the catalog's prices and "
    "at the paper's Table 1 relative prices. Builds only that job's library (not cached); "
    "prints JSON.",
)
@reports_errors
def fig1a(
    stack: Annotated[str, typer.Option(help="Stack name (stacks/Pulumi.<NAME>.yaml).")] = (
        "paper-extended"
    ),
    model: Annotated[str, typer.Option(help="A model of the stack.")] = "qwen3-235b-a22b",
    phase: Annotated[str, typer.Option(help="prefill, decode or aggregated.")] = "prefill",
    mode: Annotated[
        str | None,
        typer.Option(help="Library mode: vllm, general or paper (default: the stack's)."),
    ] = None,
    workers: Annotated[int, typer.Option(help="Library build processes.")] = 2,
) -> None:
    """`solver.evaluation.paper_figures.fig1a_job`, as JSON on stdout."""
    # Deferred: the evaluation loads the template search; `coral --help` should not.
    from solver.evaluation.paper_figures import fig1a_job
    from solver.performance.default_model import load_perf_model

    fleet = load_stack_named(stack)
    fleet = fleet if mode is None else fleet.with_mode(mode)
    if model not in fleet.models:
        raise InputError(
            "--model", f"'{model}' is not a model of {stack}", f"use one of {sorted(fleet.models)}"
        )
    if phase not in ("prefill", "decode", "aggregated"):
        raise InputError("--phase", f"unknown phase '{phase}'", "use prefill, decode or aggregated")
    perf = load_perf_model(cards=fleet.model_cards, corrections=fleet.step_corrections())
    result = fig1a_job(perf, fleet, stack, model, cast(LibPhase, phase), workers)
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


@bench_app.command(
    "spot",
    help="What allowing spot capacity saves: each stack planned to its SLO attainment targets "
    "on-demand only and with allocation.spot enabled, both verified by simulation, the spot "
    "plan also with preemptions replayed.\n\n"
    "Writes table.md, results.json and spot.png to --out and prints the table. Every committed "
    "stack by default; the paper-extended stacks take minutes each. docs/bench/spot/table.md "
    "is this output.",
)
@reports_errors
def spot(
    stacks: Annotated[
        list[str] | None,
        typer.Option("--stack", help="Stacks to compare (repeat; default: every committed one)."),
    ] = None,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Folder for table.md, results.json and spot.png.")
    ] = Path("docs/bench/spot"),
    workers: Annotated[int, typer.Option(help="Library build and capacity model processes.")] = 2,
) -> None:
    """`solver.evaluation.spot_bench` on the chosen stacks, written and printed."""
    # Deferred: the evaluation loads the planner (OR-Tools) and matplotlib.
    from coral_iac.demand_sources import resolve_demand
    from solver.evaluation import spot_bench
    from solver.io import write_atomic
    from solver.performance.default_model import load_perf_model

    names = stacks or sorted(
        p.name.removeprefix("Pulumi.").removesuffix(".yaml")
        for p in stacks_dir().glob("Pulumi.*.yaml")
    )
    for name in names:
        load_stack_named(name)  # every name checked before the first (long) plan
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    text = ""
    for k, name in enumerate(names, 1):
        fleet = resolve_demand(load_stack_named(name), name, stacks_dir(), warn)
        perf = load_perf_model(cards=fleet.model_cards, corrections=fleet.step_corrections())
        started = time.perf_counter()
        row = spot_bench.compare_stack(
            name, fleet, perf, library_root() / name, workers, _project(), _log
        )
        rows.append(row)
        _log(f"[{k}/{len(names)}] {name}: {time.perf_counter() - started:.0f} s")
        # Written after every stack: a long run stopped part-way keeps what it measured.
        text = spot_bench.report(rows, _provenance(workers))
        write_atomic(out_dir / "table.md", text.encode())
        doc = {"provenance": _provenance(workers), "stacks": rows}
        write_atomic(out_dir / "results.json", (json.dumps(doc, indent=1) + "\n").encode())
        spot_bench.plot(rows, out_dir / "spot.png")
    typer.echo(text)
    err.print(f"Wrote {out_dir / 'table.md'}, results.json and spot.png", highlight=False)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
