"""Benchmark the serving-template library build (issue #3) and report the heterogeneity finding.

For each stack and mode: node multisets enumerated, feasible, kept after dominance pruning, and
the wall time of the whole build (every model, prefill and decode; enumeration, placement and
pruning; not file writing). Repeats a build when one run is quick, and reports the median.

Run through `scripts/bench_library` (it sets up the environment first).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from solver.performance.default_model import load_perf_model
from solver.serving.library import Library, build_libraries
from solver.stack import FleetConfig, load_stack

STACKS = Path(__file__).resolve().parents[1] / "stacks"
FINDING_MODEL, FINDING_PHASE = "qwen3-235b-a22b", "prefill"
console = Console()


def _build(fleet: FleetConfig, workers: int) -> tuple[list[Library], float]:
    perf = load_perf_model()
    jobs = [(m, ph) for m in fleet.models for ph in ("prefill", "decode")]
    start = time.perf_counter()
    libs = build_libraries(perf, fleet.library_scope(), jobs, workers)  # type: ignore[arg-type]
    return libs, time.perf_counter() - start


def heterogeneity_finding(lib: Library, fleet: FleetConfig) -> dict[str, object]:
    """Best tokens/s per $/hour among templates mixing GPU types vs those of one GPU type.

    Price: the cheapest of the stack's regions that offers every node of the template.
    """
    perf = load_perf_model()
    regions = [(r.cloud, r.region) for r in fleet.regions]
    best: dict[str, tuple[float, str, str]] = {}
    for t in lib.templates:
        price = perf.catalog.cheapest_region(t.nodes, regions)
        if price is None:
            continue
        kind = "mixed" if len({perf.catalog.node(n).gpu_id for n in t.nodes}) > 1 else "one type"
        value = t.throughput / price[1]
        if kind not in best or value > best[kind][0]:
            best[kind] = (value, t.key, t.layer_partition)
    mixed, single = best["mixed"], best["one type"]
    return {
        "mode": lib.mode,
        "mixed": mixed,
        "one_type": single,
        "ratio": mixed[0] / single[0],
    }


def main(
    stacks: Annotated[list[str] | None, typer.Option(help="Stacks to build.")] = None,
    modes: Annotated[list[str] | None, typer.Option(help="vllm and/or general.")] = None,
    workers: Annotated[int, typer.Option(help="Worker processes.")] = 2,
    repeats: Annotated[int, typer.Option(help="Runs per build when a run is quick.")] = 3,
    quick_seconds: Annotated[float, typer.Option(help="A run under this is repeated.")] = 60,
    markdown: Annotated[Path | None, typer.Option(help="Also write the tables here.")] = None,
) -> None:
    table = Table(title=f"Template library build, N_max and rho from each stack, {workers} workers")
    for col in ("stack", "mode", "enumerated", "feasible", "kept", "dropped", "runs", "median s"):
        table.add_column(col, justify="left" if col in ("stack", "mode") else "right")
    md = [
        "| stack | mode | enumerated | feasible | kept | dropped (dominated) | runs | median s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    findings = []
    total = 0.0
    for stack in stacks or ["paper-core", "paper-extended"]:
        base = load_stack(STACKS, stack)
        for mode in modes or ["vllm", "general"]:
            fleet = base.with_mode(mode)
            libs, first = _build(fleet, workers)
            times = [first]
            while first < quick_seconds and len(times) < repeats:
                times.append(_build(fleet, workers)[1])
            median = statistics.median(times)
            total += median
            s = [lib.stats for lib in libs]
            row = (
                stack,
                mode,
                sum(x.enumerated for x in s),
                sum(x.feasible for x in s),
                sum(x.kept for x in s),
                sum(x.dominated for x in s),
                len(times),
                f"{median:.1f}",
            )
            table.add_row(*map(str, row))
            md.append("| " + " | ".join(map(str, row)) + " |")
            for lib in libs:
                if (lib.model, lib.phase) == (FINDING_MODEL, FINDING_PHASE):
                    findings.append(heterogeneity_finding(lib, fleet))
    console.print(table)
    console.print(f"Sum of medians: {total:.1f} s")
    md.append(f"\nSum of medians: {total:.1f} s\n")
    for f in findings:
        mixed, single = f["mixed"], f["one_type"]
        line = (
            f"{FINDING_MODEL} {FINDING_PHASE}, mode {f['mode']}: best mixed-GPU template "
            f"{mixed[1]} ({mixed[2]}) {mixed[0]:.1f} tok/s per $/h vs best one-GPU-type "  # type: ignore[index]
            f"{single[1]} ({single[2]}) {single[0]:.1f}: ratio {f['ratio']:.3f}"  # type: ignore[index]
        )
        console.print(line)
        md.append(f"- {line}")
    if markdown:
        markdown.write_text("\n".join(md) + "\n", encoding="utf-8")


if __name__ == "__main__":
    typer.run(main)
