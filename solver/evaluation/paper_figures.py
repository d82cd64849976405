"""The paper's Fig. 1a and Fig. 1b on our performance model, as PNGs and one JSON.

- Fig. 1a: Qwen3-235B prefill at the 1800 ms SLO: the best mixed-GPU serving template against
  the best single-GPU-type ones, in tokens/s per $/hour, beside the paper's numbers
  (`solver/data/paper_results.yaml`: 526 mixed, 481 / 460 / 476 pure H100 Tok/s/USD).
- Fig. 1b: GPT-OSS-120B decode (the paper's "GPT-OSS 120B decode plans"): throughput and cost
  of every template in the library, heterogeneous node sets (more than one GPU type) against
  homogeneous ones; how evenly each class covers the throughput range (the paper: heterogeneous
  sets give a near-continuous range, homogeneous ones leave gaps that force over-provisioning).

Two set-ups, each its own library build of `paper-extended`'s jobs:

- paper: the paper's template space (`library.mode: paper`) on the paper market (Table 1
  relative prices, every node size at linear per-GPU price, `market: paper`);
- ours: the stack as committed (vLLM mode, the catalog's real prices, cheapest region).

Templates are the library's, after dominance pruning (a node set that a sub-multiset matches is
dropped): what the allocation can choose from. Node configs: L40S, H100 and A100-80GB at every
size by default (`NODE_CONFIGS`; the paper-space build of all 20 takes far longer).

`fig1a_job` is Fig. 1a for any (model, phase) of any stack, at the catalog's prices and at
Table 1's relative prices (`coral bench fig1a`); `run` and `write_figures` are
`coral bench figures`. matplotlib is imported only where a figure is drawn.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

from solver.catalog.market import Market, build_market
from solver.catalog.paper_market import RELATIVE_COST
from solver.evaluation.paper_results import paper_results
from solver.io import digest, write_atomic
from solver.performance.perf_model import PerfModel
from solver.plan.planner import libraries_for
from solver.serving.candidates import RowSource
from solver.serving.enumeration import best_candidate, to_template
from solver.serving.library import build_libraries
from solver.serving.serving_template import ServingTemplate
from solver.stack import FleetConfig, load_stack
from solver.types import Job, LibPhase

STACK = "paper-extended"
FIG1A: Job = ("qwen3-235b-a22b", "prefill")
FIG1B: Job = ("gpt-oss-120b", "decode")
# The GPUs of the paper's Fig. 1a story (L40S, H100) and A100-80GB, every node size: the
# paper-space build of all 20 of the stack's configs takes far longer than a few minutes on 2
# cores (over 200,000 six-node multisets for Qwen3-235B). `--node-configs all` uses them all.
NODE_CONFIGS = [f"{g}x{k}" for g in ("l40s", "h100", "a100-80gb") for k in (1, 2, 4, 8)]
# Table 1's relative GPU-hour prices (the paper market's), its A100 row for both A100s.
PAPER_RELATIVE = {**RELATIVE_COST, "a100-40gb": RELATIVE_COST["a100-80gb"]}


def setup_fleet(
    name: str, node_configs: list[str] | None, stacks: Path, stack: str = STACK
) -> FleetConfig:
    """`stack` (from the folder `stacks`) in set-up `name` (paper or ours), on `node_configs`
    (None: the stack's own)."""
    fleet = load_stack(stacks, stack)
    if name == "paper":
        library = fleet.library.model_copy(update={"mode": "paper"})
        market = fleet.market.model_copy(update={"kind": "paper"})
        fleet = fleet.model_copy(update={"library": library, "market": market})
    if node_configs:
        fleet = fleet.model_copy(update={"node_configs": node_configs})
    return fleet


def gpu_types(t: ServingTemplate) -> set[str]:
    """The GPU types of a template's nodes (`h100x2` -> h100)."""
    return {n.rsplit("x", 1)[0] for n in t.nodes}


def priced(templates: list[ServingTemplate], market: Market) -> list[dict[str, Any]]:
    """Each template with its cheapest $/hour over the market's regions (None: unsold)."""
    rows = []
    for t in templates:
        prices = [p for r in market.regions if (p := market.template_price(r, t.nodes))]
        if prices:
            usd = min(prices)
            rows.append(
                {
                    "template": t.key,
                    "tokens_per_s": round(t.throughput, 1),
                    "usd_per_hour": round(usd, 4),
                    "per_usd_hour": round(t.throughput / usd, 2),
                    "mixed": len(gpu_types(t)) > 1,
                    "gpus": sorted(gpu_types(t)),
                    "stages": len(t.stages),
                }
            )
    return rows


def fig1a_numbers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best mixed and the three best single-type templates (the paper shows three pure H100)."""
    mixed = sorted((r for r in rows if r["mixed"]), key=lambda r: -r["per_usd_hour"])
    single = sorted((r for r in rows if not r["mixed"]), key=lambda r: -r["per_usd_hour"])
    h100 = [r for r in single if r["gpus"] == ["h100"]]
    out: dict[str, Any] = {
        "best_mixed": mixed[0] if mixed else None,
        "best_single_type": single[:3],
        "best_pure_h100": h100[:3],
    }
    if mixed and single:
        out["mixed_over_best_single"] = round(
            mixed[0]["per_usd_hour"] / single[0]["per_usd_hour"], 4
        )
    return out


def coverage(rows: list[dict[str, Any]], lo: float, hi: float, best: float) -> dict[str, Any]:
    """How evenly a class of templates covers throughputs in [lo, hi]: distinct levels, the
    largest ratio between neighbouring levels, and the over-provisioning of provisioning a
    target D with the cheapest single template of at least D (median and p90 over a log grid
    of D, as (its throughput - D) / D, and its $/hour over what D costs at `best`, the best
    tokens/s per $/hour of either class)."""
    levels = np.unique([r["tokens_per_s"] for r in rows if lo <= r["tokens_per_s"] <= hi])
    gaps = levels[1:] / levels[:-1] if len(levels) > 1 else np.array([np.inf])
    targets = np.geomspace(lo, hi, 200)
    over, cost = [], []
    if not rows:
        return {"templates": 0}
    for d in targets:
        fits = [r for r in rows if r["tokens_per_s"] >= d]
        if not fits:
            continue
        pick = min(fits, key=lambda r: r["usd_per_hour"])
        over.append(pick["tokens_per_s"] / d - 1)
        cost.append(pick["usd_per_hour"] * best / d)
    return {
        "templates": len(rows),
        "levels_in_range": int(len(levels)),
        "largest_gap_ratio": round(float(gaps.max()), 3),
        "median_gap_ratio": round(float(np.median(gaps)), 4),
        "over_provisioning_median": round(float(np.median(over)), 4) if over else None,
        "over_provisioning_p90": round(float(np.percentile(over, 90)), 4) if over else None,
        "cost_over_ideal_median": round(float(np.median(cost)), 4) if cost else None,
    }


def fig1b_numbers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Coverage of each class over the throughputs both classes reach (the smallest
    heterogeneous set is larger than the smallest homogeneous one)."""
    classes = [[r["tokens_per_s"] for r in rows if r["mixed"] == m] for m in (False, True)]
    lo = float(max(min(c) for c in classes if c))
    hi = float(max(max(c) for c in classes if c))
    best = max(r["per_usd_hour"] for r in rows)
    return {
        "range_tokens_per_s": [lo, hi],
        "best_per_usd_hour": best,
        "heterogeneous": coverage([r for r in rows if r["mixed"]], lo, hi, best),
        "homogeneous": coverage([r for r in rows if not r["mixed"]], lo, hi, best),
    }


def plot_1a(results: dict[str, Any], path: Path) -> None:
    """Bars normalised to each set-up's best single-type template, absolute values on top."""
    # matplotlib is optional and heavy: loaded only to draw.
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    # pyplot after the backend is chosen.
    import matplotlib.pyplot as plt

    paper = paper_results().fig1a.numbers()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    groups: list[tuple[str, list[tuple[str, float, str]]]] = [
        (
            "paper (reported)",
            [("mixed", paper["mixed"], f"{paper['mixed']:g}")]
            + [(f"H100 #{i + 1}", v, f"{v:g}") for i, v in enumerate(paper["pure_h100"])],
        )
    ]
    for name, r in results.items():
        a = r["fig1a"]
        bars = []
        if a["best_mixed"]:
            bars.append(("mixed", a["best_mixed"]["per_usd_hour"], a["best_mixed"]["template"]))
        bars += [
            (f"single #{i + 1}", s["per_usd_hour"], s["template"])
            for i, s in enumerate(a["best_single_type"])
        ]
        groups.append((f"ours, {name} set-up", bars))
    x = 0.0
    ticks, labels = [], []
    for gname, bars in groups:
        ref = max(v for label, v, _ in bars if label != "mixed")
        for label, v, note in bars:
            color = "tab:orange" if label == "mixed" else "tab:blue"
            ax.bar(x, v / ref, color=color, width=0.8)
            ax.text(x, v / ref + 0.01, f"{v:,.0f}", ha="center", va="bottom", fontsize=7)
            ax.text(x, 0.02, note, rotation=90, ha="center", va="bottom", fontsize=6, color="w")
            x += 1
        ticks.append(x - (len(bars) + 1) / 2)
        labels.append(gname)
        x += 1
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("tokens/s per $/h, / best single-type")
    ax.set_ylim(0, 1.25)
    ax.axhline(1.0, color="grey", lw=0.6, ls="--")
    ax.set_title(
        "Fig. 1a: Qwen3-235B prefill, 1800 ms SLO: best mixed (orange) vs best single-GPU-type "
        "templates (blue)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_1b(results: dict[str, Any], path: Path) -> None:
    """Per set-up: throughput vs $/hour of every template, and the tok/s per $/h spread."""
    # matplotlib is optional and heavy: loaded only to draw.
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    # pyplot after the backend is chosen.
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(len(results), 3, figsize=(15, 3.9 * len(results)), squeeze=False)
    for (name, r), (ax_s, ax_c, ax_b) in zip(results.items(), axes, strict=True):
        rows = r["fig1b_templates"]
        for mixed, color, label in ((False, "tab:blue", "homogeneous"), (True, "tab:orange", "heterogeneous")):  # fmt: skip
            sel = [t for t in rows if t["mixed"] == mixed]
            if not sel:
                continue
            ax_s.scatter(
                [t["usd_per_hour"] for t in sel],
                [t["tokens_per_s"] for t in sel],
                s=8,
                alpha=0.6,
                color=color,
                label=f"{label} ({len(sel)})",
            )
            ax_c.eventplot(
                [sorted(t["tokens_per_s"] for t in sel)],
                lineoffsets=1 if mixed else 0,
                linelengths=0.8,
                colors=color,
                linewidths=0.6,
            )
            per = [t["per_usd_hour"] for t in sel]
            jitter = np.random.default_rng(0).uniform(-0.25, 0.25, len(per))
            ax_b.scatter(per, (1 if mixed else 0) + jitter, s=5, alpha=0.4, color=color)
            ax_b.boxplot(
                [per],
                positions=[1 if mixed else 0],
                orientation="horizontal",
                widths=0.6,
                showfliers=False,
            )
        for ax in (ax_s, ax_c, ax_b):
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax_s.set_yscale("log")
        ax_s.set_xlabel("$/hour")
        ax_s.set_ylabel("decode tokens/s")
        ax_s.legend(fontsize=7)
        mode = r["mode"]
        ax_s.set_title(f"GPT-OSS-120B decode, {name} set-up ({mode} mode)", fontsize=9)
        ax_c.set_yticks([0, 1], ["homogeneous", "heterogeneous"], fontsize=8)
        ax_c.set_xlabel("decode tokens/s (one line per template)")
        cov = r["fig1b"]
        ax_c.set_title(
            "throughput levels; largest gap x{:.2f} (homo) vs x{:.2f} (hetero)".format(
                cov["homogeneous"].get("largest_gap_ratio", float("nan")),
                cov["heterogeneous"].get("largest_gap_ratio", float("nan")),
            ),
            fontsize=9,
        )
        ax_b.set_yticks([0, 1], ["homogeneous", "heterogeneous"], fontsize=8)
        ax_b.set_ylim(-0.6, 1.6)
        ax_b.set_xlabel("decode tokens/s per $/hour (box: quartiles)")
        ax_b.set_title("throughput per dollar, over node multisets", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def run_setup(
    name: str,
    perf: PerfModel,
    workers: int,
    node_configs: list[str] | None,
    stacks: Path,
    cache: Path,
    stack: str = STACK,
) -> dict[str, Any]:
    """One set-up's libraries (cached under `cache`), priced: the Fig. 1a and 1b numbers, the
    paper's Fig. 1a plan in our model, and every Fig. 1b template."""
    fleet = setup_fleet(name, node_configs, stacks, stack)
    market = build_market(fleet.market_scope(), perf.catalog)
    t0 = time.perf_counter()
    folder = cache / (name + ("" if node_configs is None else "-" + digest(node_configs)))
    by_job = libraries_for(perf, fleet, [FIG1A, FIG1B], folder, workers=workers, stack=stack)
    took = time.perf_counter() - t0
    rows_a = priced(by_job[FIG1A].templates, market)
    spec = fleet.models[FIG1A[0]]
    source = RowSource(perf, FIG1A[0], FIG1A[1], spec, fleet.node_configs)
    paper_nodes = tuple(paper_results().fig1a.plan.nodes)
    cand = best_candidate(source, paper_nodes, fleet.library.mode)
    paper_plan = priced([to_template(source, cand)], market) if cand else []
    rows_b = priced(by_job[FIG1B].templates, market)
    return {
        "mode": fleet.library.mode,
        "market": fleet.market.kind,
        "node_configs": fleet.node_configs,
        "build_seconds": round(took, 1),
        "fig1a": fig1a_numbers(rows_a)
        | {"paper_plan_in_our_model": paper_plan[0] if paper_plan else None},
        "fig1b": fig1b_numbers(rows_b),
        "fig1b_templates": sorted(rows_b, key=lambda r: (r["usd_per_hour"], r["template"])),
    }


def run(
    perf: PerfModel,
    setups: list[str],
    workers: int,
    node_configs: list[str] | None,
    stacks: Path,
    cache: Path,
    stack: str = STACK,
) -> dict[str, Any]:
    """Every set-up (`run_setup`) beside the paper's Fig. 1a: numbers.json."""
    t0 = time.perf_counter()
    results = {s: run_setup(s, perf, workers, node_configs, stacks, cache, stack) for s in setups}
    paper = paper_results().fig1a.numbers()
    return {
        "stack": stack,
        "fig1a_job": list(FIG1A),
        "fig1b_job": list(FIG1B),
        "paper_fig1a": paper
        | {"mixed_over_best_pure_h100": round(paper["mixed"] / max(paper["pure_h100"]), 4)},
        "setups": results,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def write_figures(doc: dict[str, Any], out: Path) -> dict[str, Any]:
    """fig1a.png, fig1b.png and numbers.json under `out`; returns the summary to print (each
    set-up's mixed over best single-type ratio and library build time)."""
    out.mkdir(parents=True, exist_ok=True)
    results = doc["setups"]
    plot_1a(results, out / "fig1a.png")
    plot_1b(results, out / "fig1b.png")
    write_atomic(out / "numbers.json", json.dumps(doc, indent=1) + "\n")
    summary = {
        s: {"fig1a": r["fig1a"].get("mixed_over_best_single"), "build_s": r["build_seconds"]}
        for s, r in results.items()
    }
    return summary | {"seconds": doc["seconds"]}


# ---------------------------------------------------------------- Fig. 1a for any job


def best_of(rows: list[tuple[ServingTemplate, float]], mixed: bool) -> dict[str, object] | None:
    """The template with the most tokens/s per $/hour among the mixed (or single-type) ones."""
    kept = [(t, p) for t, p in rows if (len({n.split("x")[0] for n in t.nodes}) > 1) == mixed]
    if not kept:
        return None
    t, price = max(kept, key=lambda r: r[0].throughput / r[1])
    return {
        "template": "+".join(t.nodes),
        "tokens_per_s": round(t.throughput, 1),
        "usd_per_hour": round(price, 3),
        "tokens_per_s_per_usd_hour": round(t.throughput / price, 2),
    }


def fig1a_job(
    perf: PerfModel,
    fleet: FleetConfig,
    stack: str,
    model: str,
    phase: LibPhase,
    workers: int = 2,
) -> dict[str, Any]:
    """Fig. 1a for one (model, phase) of a stack: the best mixed-GPU template against the best
    single-GPU-type one, in tokens/s per $/hour, at two price sets: the stack's catalog prices
    (cheapest region selling every node), and Table 1's relative GPU-hour prices scaled to the
    catalog's cheapest L4 GPU-hour, linear in GPU count. Builds only that job's library (not
    cached)."""
    (lib,) = build_libraries(perf, fleet.library_scope(), [(model, phase)], workers=workers)
    market = build_market(fleet.market_scope(), perf.catalog)
    l4_gpu_hour = min(p for (r, n), p in market.price.items() if n == "l4x1")
    catalog_rows, paper_rows = [], []
    for t in lib.templates:
        prices = [p for r in market.regions if (p := market.template_price(r, t.nodes))]
        if prices:
            catalog_rows.append((t, min(prices)))
        gpus = [market.gpu_of[n] for n in t.nodes]
        if all(g in PAPER_RELATIVE for g, _ in gpus):
            paper_rows.append((t, sum(PAPER_RELATIVE[g] * k * l4_gpu_hour for g, k in gpus)))
    out: dict[str, Any] = {
        "stack": stack,
        "model": model,
        "phase": phase,
        "mode": fleet.library.mode,
        "slo_ms": lib.slo_ms,
    }
    for name, rows in (("catalog", catalog_rows), ("paper_table1", paper_rows)):
        mixed, homo = best_of(rows, True), best_of(rows, False)
        ratio = None
        if mixed and homo:
            ratio = round(
                float(cast(float, mixed["tokens_per_s_per_usd_hour"]))
                / float(cast(float, homo["tokens_per_s_per_usd_hour"])),
                4,
            )
        out[name] = {"best_mixed": mixed, "best_single_type": homo, "mixed_over_single": ratio}
    return out
