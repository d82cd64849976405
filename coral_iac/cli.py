"""The `coral` command-line tool (Typer + Rich). Human output on stderr, `--json` on stdout."""

from __future__ import annotations

import csv
import datetime as dt
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
import yaml
from rich.table import Table

from coral_iac.bench_cli import register as register_bench_command
from coral_iac.console import STACKS_DIR, err, out, print_json, progress_bar, reports_errors
from coral_iac.demand_cli import demand_app
from coral_iac.deploy_cli import register as register_deploy_commands
from coral_iac.plan_cli import plan_app
from coral_iac.sim_cli import register as register_simulate_command

app = typer.Typer(
    help="Coral IaC: serve many LLMs on the cheapest mix of cloud GPUs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
catalog_app = typer.Typer(help="GPU types, node configs and cloud offers.", no_args_is_help=True)
profile_app = typer.Typer(
    help="The performance model: layer times and profile tables T̂.", no_args_is_help=True
)
app.add_typer(catalog_app, name="catalog")
app.add_typer(profile_app, name="profile")
app.add_typer(plan_app, name="plan")
app.add_typer(demand_app, name="demand")
register_deploy_commands(app)
register_simulate_command(app)
register_bench_command(app)

DEFAULT_HELIX_DIR = Path("../shared/calibration/helix")


# ---------------------------------------------------------------- catalog


@catalog_app.command("show")
@reports_errors
def catalog_show(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    cloud: Annotated[str | None, typer.Option(help="Only this cloud (aws, gcp).")] = None,
    region: Annotated[str | None, typer.Option(help="Only this region.")] = None,
) -> None:
    """Print every offer: instance type, node config, $/hour, network, default availability."""
    from solver.catalog import load_catalog

    cat = load_catalog()
    offers = [o for o in cat.offers if (cloud in (None, o.cloud)) and (region in (None, o.region))]
    if as_json:
        print_json([o.model_dump(mode="json") | {"node": o.node} for o in offers])
        return
    table = Table(title=f"{len(offers)} offers (on-demand, USD/hour)")
    for col in (
        "cloud",
        "region",
        "node",
        "instance type",
        "$/hour",
        "$/GPU-hour",
        "net Gbps",
        "avail",
        "price read",
    ):
        table.add_column(col, justify="right" if col[0] in "$na" else "left")
    for o in offers:
        table.add_row(
            o.cloud,
            o.region,
            o.node,
            o.instance_type,
            f"{o.price_usd_per_hour:.3f}",
            f"{o.price_usd_per_hour / o.gpu_count:.3f}",
            f"{o.network_gbps:g}",
            str(o.availability),
            str(o.retrieved),
        )
    out.print(table)
    if cat.unsold_shapes:
        err.print(
            "Shapes of the 1/2/4/8-GPU grid no cloud here sells: "
            + ", ".join(f"{u.cloud}:{u.node}" for u in cat.unsold_shapes)
        )


@catalog_app.command("import-skypilot")
@reports_errors
def catalog_import_skypilot(
    vms_csv: Annotated[Path, typer.Argument(help="SkyPilot catalog vms.csv (schema v8).")],
    cloud: Annotated[str, typer.Option(help="Which cloud the file is for: aws or gcp.")],
    region: Annotated[list[str] | None, typer.Option(help="Keep only these regions.")] = None,
    out_path: Annotated[
        Path | None, typer.Option("--out", help="Write offers YAML here (default: stdout).")
    ] = None,
) -> None:
    """Read a SkyPilot vms.csv into offers (cheapest instance per region and node shape)."""
    from solver.catalog import load_catalog
    from solver.errors import InputError
    from solver.skypilot import import_vms_rows

    try:
        with vms_csv.open(encoding="utf-8", newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as exc:
        raise InputError(
            str(vms_csv), f"cannot read file ({exc.strerror})", "check the path"
        ) from exc
    offers = import_vms_rows(
        rows,
        cloud,
        load_catalog(),
        f"SkyPilot catalog {vms_csv.name}",
        dt.date.today(),
        set(region) if region else None,
    )
    doc = {"schema_version": 1, "offers": [o.model_dump(mode="json") for o in offers]}
    text = yaml.safe_dump(doc, sort_keys=False)
    if out_path:
        out_path.write_text(text, encoding="utf-8")
        err.print(f"Wrote {len(offers)} offers to {out_path}")
    else:
        sys.stdout.write(text)


# ---------------------------------------------------------------- profile

Phase = Literal["prefill", "decode"]
MeasuredOpt = Annotated[
    Path | None,
    typer.Option(
        "--measured",
        help="Folder of measured tables (<model>__<node>__<phase>.csv) that replace "
        "the analytical model where present (default: $CORAL_MEASURED_DIR when set).",
    ),
]


@profile_app.command("layer-time")
@reports_errors
def profile_layer_time(
    model: Annotated[str, typer.Option(help="Model id, e.g. llama2-70b.")],
    node: Annotated[str, typer.Option(help="Node config <gpu>x<count>, e.g. l4x1.")],
    phase: Annotated[str, typer.Option(help="prefill or decode.")],
    batch: Annotated[int | None, typer.Option(help="Decode batch (sequences).")] = None,
    tokens: Annotated[int | None, typer.Option(help="Prefill batch (prompt tokens).")] = None,
    context: Annotated[
        float | None,
        typer.Option(
            help="Decode context, or prefill prompt length, in tokens (default: the calibration's "
            "fitted values, the lengths the measurements were taken at)."
        ),
    ] = None,
    measured: MeasuredOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Time of one transformer layer on one node (TP across the node's GPUs)."""
    from solver.calibration import load_calibration
    from solver.defaults import load_perf_model
    from solver.errors import InputError

    ph = _phase(phase)
    size = batch if ph == "decode" else tokens
    if size is None:
        need = "--batch" if ph == "decode" else "--tokens"
        raise InputError(need, f"required for --phase {ph}", f"pass {need} N")
    cal = load_calibration()
    ctx = context or (cal.decode_context_tokens if ph == "decode" else cal.prefill_prompt_tokens)
    pm = load_perf_model(measured)
    lt = pm.layer_time(model, node, ph, size, ctx)
    result = {
        "model": model,
        "node": pm.catalog.node(node).id,
        "phase": ph,
        "size": size,
        "context": ctx,
        "ms_per_layer": round(lt.ms, 6),
        "tp": lt.tp,
        "source": lt.source,
    }
    if as_json:
        print_json(result)
    else:
        out.print(
            f"{model} on {result['node']} ({ph}, size {size}, context {ctx:g}): "
            f"[bold]{lt.ms:.3f} ms[/] per layer (TP={lt.tp}, {lt.source})"
        )


def _phase(phase: str) -> Phase:
    from solver.errors import InputError

    if phase not in ("prefill", "decode"):
        raise InputError("--phase", f"unknown phase '{phase}'", "use prefill or decode")
    return phase  # type: ignore[return-value]


@profile_app.command("table")
@reports_errors
def profile_table(
    model: Annotated[str, typer.Option(help="Model id, e.g. qwen3-32b.")],
    phase: Annotated[str, typer.Option(help="prefill or decode.")],
    budget_ms: Annotated[float, typer.Option(help="Per-stage latency budget, ms.")],
    context: Annotated[
        float, typer.Option(help="Decode context / prefill prompt length, tokens.")
    ] = 1024,
    node: Annotated[list[str] | None, typer.Option(help="Only these node configs.")] = None,
    no_hop: Annotated[
        bool,
        typer.Option(
            "--no-hop", help="Do not charge the hop to a next stage (single-stage replicas)."
        ),
    ] = False,
    measured: MeasuredOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """T̂_j(c): the most tokens/s each node config delivers holding j layers within the budget."""
    from solver.defaults import load_perf_model

    pm = load_perf_model(measured)
    entries = pm.profile_table(model, _phase(phase), budget_ms, node, context, hop=not no_hop)
    if as_json:
        print_json([e.__dict__ for e in entries])
        return
    by_node: dict[str, list[Any]] = {}
    for e in entries:
        by_node.setdefault(e.node, []).append(e)
    table = Table(
        title=f"T̂ for {model} {phase}, budget {budget_ms:g} ms per stage "
        f"(tokens/s at j layers; * = measured table)"
    )
    for col in ("node", "max j", "TP", "T̂ at j=1", "T̂ at j=max/2", "T̂ at max j", "batch at max j"):
        table.add_column(col, justify="left" if col == "node" else "right")
    nodes = node or list(pm.catalog.node_configs)
    for n in nodes:
        es = by_node.get(pm.catalog.node(n).id, [])
        if not es:
            table.add_row(n, "0", "-", "-", "-", "-", "-")
            continue
        mark = "*" if es[0].source == "measured" else ""
        mid = es[(len(es) - 1) // 2]
        table.add_row(
            f"{n}{mark}",
            str(es[-1].layers),
            str(es[-1].tp),
            f"{es[0].tokens_per_s:,.0f}",
            f"{mid.tokens_per_s:,.0f} (j={mid.layers})",
            f"{es[-1].tokens_per_s:,.0f}",
            str(es[-1].batch),
        )
    out.print(table)


@profile_app.command("calibrate")
@reports_errors
def profile_calibrate(
    data: Annotated[Path, typer.Option(help="Folder of Helix per-layer CSVs.")] = DEFAULT_HELIX_DIR,
    write: Annotated[
        bool,
        typer.Option(
            help="Refit and write solver/data/calibration.yaml (else: check the stored fit)."
        ),
    ] = False,
    doc: Annotated[
        Path | None, typer.Option(help="Write the error table as Markdown here.")
    ] = None,
    measured: Annotated[
        Path | None,
        typer.Option(
            help="Also fit to this folder of `coral profile measure` tables (one-GPU, TP 1), "
            "e.g. the output of scripts/profile_gpu.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Per-file error of the performance model against the measured timings (and refit)."""
    from coral_iac.reports import calibration_markdown
    from solver.calibration import (
        error_table,
        fit,
        load_calibration,
        load_helix_dir,
        load_profiler_dir,
    )
    from solver.catalog import load_catalog
    from solver.io import data_path
    from solver.model_cards import load_model_cards

    files, cards, cat = load_helix_dir(data), load_model_cards(), load_catalog()
    source = "Helix-ASPLOS25 per-layer timings (Apache-2.0), ../shared/calibration/helix/"
    command = "coral profile calibrate --write"
    if measured is not None:
        files += load_profiler_dir(measured, cat)
        source += f"; coral profile measure tables, {measured}"
        command += f" --measured {measured}"
    cal = fit(files, cards, cat, source=source, command=command) if write else load_calibration()
    if write:
        path = data_path("calibration.yaml")
        header = "# Fitted efficiency factors of the performance model. Generated: do not edit.\n"
        path.write_text(header + yaml.safe_dump(cal.model_dump(mode="json"), sort_keys=False))
        err.print(f"Wrote {path}")
    rows = error_table(files, cards, cat, cal)
    if as_json:
        print_json([r.__dict__ for r in rows])
    md = calibration_markdown(rows, cal, files, cards, cat)
    if doc:
        doc.write_text(md, encoding="utf-8")
        err.print(f"Wrote {doc}")
    if not as_json:
        sys.stdout.write(md)


@profile_app.command("measure")
@reports_errors
def profile_measure(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Model id, e.g. llama2-70b.")],
    phase: Annotated[str, typer.Option(help="prefill or decode.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for the CSV and JSON sidecar.")],
    batches: Annotated[
        str | None, typer.Option(help="Decode batch sizes, e.g. 1,8,64 (default 1..256).")
    ] = None,
    tokens: Annotated[
        str | None, typer.Option(help="Prefill token counts, e.g. 128,1024 (default 128..16384).")
    ] = None,
    context: Annotated[
        int, typer.Option(help="Decode: KV-cache tokens per sequence; prefill: prompt length.")
    ] = 1024,
    engine: Annotated[str, typer.Option(help="torch (one layer) or vllm (the engine).")] = "torch",
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree over local GPUs.")] = 1,
    node: Annotated[
        str | None, typer.Option(help="Node config to name the table (default <gpu>x<tp>).")
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cuda or cpu.")] = "auto",
    dtype: Annotated[
        str | None, typer.Option(help="bfloat16 (GPU default), float16, float32 (CPU default).")
    ] = None,
    warmup: Annotated[int, typer.Option(help="Untimed calls per size.")] = 3,
    repeats: Annotated[int, typer.Option(help="Timed calls per size (median kept).")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of weights and inputs.")] = 0,
    budget_s: Annotated[
        float | None, typer.Option(help="Stop adding larger sizes after this many seconds.")
    ] = None,
    tiny: Annotated[
        bool, typer.Option("--tiny", help="A toy-sized layer of the same kind (smoke runs).")
    ] = False,
    hf_config: Annotated[
        str | None, typer.Option(help="vllm: config folder or HF repo (default: the card's).")
    ] = None,
    vllm_layers: Annotated[str, typer.Option(help="vllm: the two layer counts L1,L2.")] = "2,6",
) -> None:
    """Time one decoder layer on the local GPU (or CPU) and write a measured table.

    Needs the optional extra: pip install 'coral-iac\\[profile]'.
    """
    try:
        import torch  # noqa: F401

        from profiler.command import parse_sizes, run_measure
        from profiler.measure import MeasureSpec
    except ImportError as exc:
        # Printed without Rich markup, which would swallow "[profile]".
        err.print(
            f"Error: coral profile measure: the profiler needs torch, which cannot be imported "
            f"({exc})\n  To fix: pip install 'coral-iac[profile]'",
            markup=False,
            highlight=False,
        )
        raise typer.Exit(1) from None
    ph = _phase(phase)
    given = [(p.opts[0], ctx.params[p.name or ""]) for p in ctx.command.params]
    command = " ".join(
        ["coral profile measure"]
        + [opt if v is True else f"{opt} {v}" for opt, v in given if v not in (None, False)]
    )
    spec = MeasureSpec(
        model, ph, parse_sizes(batches if ph == "decode" else tokens, ph), context, device,
        dtype, warmup, repeats, seed, tp, node, budget_s, command,
    )  # fmt: skip
    path, record = run_measure(spec, out_dir, engine, tiny, hf_config, vllm_layers, err.print)
    err.print(f"Wrote {path} ({len(record.points)} sizes, {record.device}, {record.dtype})")


def main() -> None:  # pragma: no cover - console entry point
    app()


# ---------------------------------------------------------------- templates

templates_app = typer.Typer(help="Serving-template library (offline stage).", no_args_is_help=True)
app.add_typer(templates_app, name="templates")
LIB_PHASES = ("prefill", "decode", "aggregated")


def _fleet(stack: str, mode: str | None) -> Any:
    from solver.stack import load_stack

    fleet = load_stack(STACKS_DIR, stack)
    return fleet if mode is None else fleet.with_mode(mode)


@templates_app.command("build")
@reports_errors
def templates_build(
    stack: Annotated[str, typer.Option(help="Stack name (stacks/Pulumi.<stack>.yaml).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Library folder to write.")],
    mode: Annotated[str | None, typer.Option(help="vllm or general (overrides the stack).")] = None,
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
    from solver.defaults import load_perf_model
    from solver.library import build_libraries, save_library
    from solver.template_library import available_node_configs

    fleet = _fleet(stack, mode)
    phases = phase or ["prefill", "decode"]
    for ph in phases:
        if ph not in LIB_PHASES:
            from solver.errors import InputError

            raise InputError(
                "--phase", f"unknown phase '{ph}'", "use prefill, decode or aggregated"
            )
    if executor not in ("process", "ray"):
        from solver.errors import InputError

        raise InputError("--executor", f"unknown executor '{executor}'", "use process or ray")
    pm = load_perf_model(measured)
    _, unsold = available_node_configs(fleet, pm.catalog)
    if unsold:
        err.print(
            f"Skipped node configs no offer sells in this stack's regions: {', '.join(unsold)}"
        )
    table = Table(title=f"Serving-template library: {stack}, mode {fleet.library.mode}")
    for col in ("model", "phase", "enumerated", "feasible", "dominated", "kept", "seconds"):
        table.add_column(col, justify="left" if col in ("model", "phase") else "right")
    jobs = [(m, ph) for m in fleet.models for ph in phases]
    with progress_bar() as bar:
        tasks = {job: bar.add_task(f"{job[0]} {job[1]}", total=None) for job in jobs}
        libs = build_libraries(
            pm,
            fleet,
            jobs,  # type: ignore[arg-type]
            workers,
            lambda job, d, t: bar.update(tasks[job], completed=d, total=t),
            executor,  # type: ignore[arg-type]
            ray_address,
        )
    for lib in libs:
        save_library(lib, out_dir)
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
    mode: Annotated[str | None, typer.Option(help="vllm or general, when both are built.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List templates by throughput per dollar (at the cheapest region offering all nodes)."""
    from solver.catalog import load_catalog
    from solver.errors import InputError
    from solver.library import Library

    pattern = f"{model}__{phase}__*__{mode or '*'}.json"
    files = sorted(library.glob(pattern))
    if not files:
        raise InputError(
            "--library",
            f"no library file matches {library / pattern}",
            "build it with `coral templates build`, or check --model/--phase/--mode",
        )
    cat = load_catalog()
    rows = []
    for f in files:
        lib = Library.model_validate_json(f.read_text(encoding="utf-8"))
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
    table = Table(title=f"Top {len(rows)} serving templates: {model} {phase}")
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
