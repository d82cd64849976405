"""`coral profile`: layer times, profile tables T̂, calibration, and GPU measurements."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from coral_iac.cli.console import FittedTable, MeasuredOpt, err, out, print_json, reports_errors
from solver.errors import InputError
from solver.types import Phase

profile_app = typer.Typer(
    help="The performance model: layer times and profile tables T̂.", no_args_is_help=True
)


RuntimeOpt = Annotated[
    str,
    typer.Option(
        help="Serving runtime whose fixed costs apply: vllm (vLLM 0.33, CUDA graphs; what plans "
        "use) or helix (Helix's eager runtime, which its files were measured with).",
    ),
]
ContextOpt = Annotated[
    float | None,
    typer.Option(
        help="Decode context, or prefill prompt length, in tokens (default: the calibration's "
        "fitted values, the lengths the measurements were taken at)."
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
    context: ContextOpt = None,
    runtime: RuntimeOpt = "vllm",
    measured: MeasuredOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Time of one transformer layer on one node (TP across the node's GPUs), by component."""
    result = _layer_result(model, node, phase, batch, tokens, context, runtime, measured)
    if as_json:
        print_json(result)
    else:
        out.print(
            f"{model} on {result['node']} ({result['phase']}, size {result['size']}, context "
            f"{result['context']:g}, runtime {runtime}): [bold]{result['ms_per_layer']:.3f} ms[/] "
            f"per layer (TP={result['tp']}, {result['source']})"
        )


@profile_app.command("explain")
@reports_errors
def profile_explain(
    model: Annotated[str, typer.Option(help="Model id, e.g. llama2-70b.")],
    node: Annotated[str, typer.Option(help="Node config <gpu>x<count>, e.g. h100x8.")],
    phase: Annotated[str, typer.Option(help="prefill or decode.")],
    batch: Annotated[int, typer.Option(help="Decode batch (sequences).")] = 1,
    tokens: Annotated[int, typer.Option(help="Prefill batch (prompt tokens).")] = 2048,
    context: ContextOpt = None,
    runtime: RuntimeOpt = "vllm",
    measured: MeasuredOpt = None,
) -> None:
    """One layer's time by component (weight GEMMs, attention, TP all-reduce, runtime overhead)
    and what bounds it."""
    r = _layer_result(model, node, phase, batch, tokens, context, runtime, measured)
    if "components" not in r:
        out.print(f"{model} on {r['node']}: {r['ms_per_layer']:.3f} ms per layer from a measured "
                  "table, which has no components.")  # fmt: skip
        return
    table = FittedTable(
        title=f"{model} on {r['node']}, {r['phase']} size {r['size']}, context {r['context']:g}, "
        f"TP {r['tp']}, runtime {runtime}"
    )
    for col in ("component", "ms per layer", "share", "bound by"):
        table.add_column(col, justify="left" if col in ("component", "bound by") else "right")
    sides = {
        "gemm_ms": r["gemm_bound"],
        "attention_ms": r["attention_bound"],
        "elementwise_ms": "memory",
    }
    for name, ms in r["components"].items():
        share = ms / r["ms_per_layer"] if r["ms_per_layer"] else 0.0
        table.add_row(name.removesuffix("_ms"), f"{ms:.4f}", f"{share:.0%}", sides.get(name, ""))
    table.add_row("total", f"{r['ms_per_layer']:.4f}", "100%", "")
    out.print(table)
    out.print(f"Bound: [bold]{r['bound']}[/]. Per stage pass add {r['step_overhead_ms']:g} ms "
              f"(the {runtime} runtime's per-step cost, once per stage, not per layer).")  # fmt: skip


def _layer_result(
    model: str,
    node: str,
    phase: str,
    batch: int | None,
    tokens: int | None,
    context: float | None,
    runtime: str,
    measured: Path | None,
) -> dict[str, Any]:
    """The layer time and its components, as `layer-time --json` prints them."""
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.performance.calibration import load_calibration
    from solver.performance.default_model import load_perf_model

    ph = _phase(phase)
    size = batch if ph == "decode" else tokens
    if size is None:
        need = "--batch" if ph == "decode" else "--tokens"
        raise InputError(need, f"required for --phase {ph}", f"pass {need} N")
    cal = load_calibration()
    ctx = context or (cal.decode_context_tokens if ph == "decode" else cal.prefill_prompt_tokens)
    pm = load_perf_model(measured, runtime=runtime)
    lt, parts = pm.layer_breakdown(model, node, ph, size, ctx)
    result: dict[str, Any] = {
        "model": model,
        "node": pm.catalog.node(node).id,
        "phase": ph,
        "size": size,
        "context": ctx,
        "runtime": runtime,
        "ms_per_layer": round(lt.ms, 6),
        "tp": lt.tp,
        "source": lt.source,
        "step_overhead_ms": pm.step_overhead_ms(node, ph),
    }
    if parts is not None:
        result["components"] = {k: round(v, 6) for k, v in parts.components().items()}
        result |= {"gemm_bound": parts.gemm_bound, "attention_bound": parts.attention_bound}
        result["bound"] = parts.bound()
    return result


def _phase(phase: str) -> Phase:

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
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from solver.performance.default_model import load_perf_model

    pm = load_perf_model(measured)
    entries = pm.profile_table(model, _phase(phase), budget_ms, node, context, hop=not no_hop)
    if as_json:
        print_json([e.__dict__ for e in entries])
        return
    by_node: dict[str, list[Any]] = {}
    for e in entries:
        by_node.setdefault(e.node, []).append(e)
    table = FittedTable(
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
    data: Annotated[
        Path | None,
        typer.Option(
            help="Folder of Helix per-layer CSVs (default: the packaged Helix data, "
            "solver/data/calibration/helix/).",
            show_default=False,
        ),
    ] = None,
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
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
    from coral_iac.cli.reports import calibration_markdown
    from solver.catalog.model_cards import load_model_cards
    from solver.catalog.offers import load_catalog
    from solver.io import data_path
    from solver.performance.calibration import (
        HELIX_SOURCE,
        dump_calibration,
        error_table,
        fit,
        helix_data_dir,
        load_calibration,
        load_helix_dir,
        load_profiler_dir,
    )

    files, cards, cat = load_helix_dir(data or helix_data_dir()), load_model_cards(), load_catalog()
    source = HELIX_SOURCE if data is None else f"Helix-format per-layer timings, {data}"
    command = "coral profile calibrate --write" + ("" if data is None else f" --data {data}")
    if measured is not None:
        files += load_profiler_dir(measured, cat)
        source += f"; coral profile measure tables, {measured}"
        command += f" --measured {measured}"
    cal = fit(files, cards, cat, source=source, command=command) if write else load_calibration()
    if write:
        path = data_path("calibration.yaml")
        path.write_text(dump_calibration(cal), encoding="utf-8")
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
        # Deferred: torch is the optional `profile` extra.
        import torch  # noqa: F401

        # Deferred to when the command runs: the solver modules behind it (numpy,
        # pydantic, OR-Tools) would slow the start of every coral command.
        from solver.performance.profiler.command import parse_sizes, run_measure
        from solver.performance.profiler.measure import MeasureSpec
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
