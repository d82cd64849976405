"""The paper's evaluation beside ours: one table, three columns per scenario.

For every scenario of the paper's Sec. 6 (`solver.evaluation.scenarios`: core and extended,
default, scarce, large-heavy, small-heavy; Helix), each ratio the paper reports
(`solver/data/paper_results.yaml`) beside two measurements of ours: the paper setup (paper mode,
Table 1 market, homo-paper and cauchy-paper) and ours (the committed stack, homo and cauchy).

Every method is planned through `coral plan`'s path (`plan_with_library`'s steps: libraries,
`solver.plan.attainment.plan_to_target`, validation), so each meets the same SLO attainment
targets. Ratios: method $/h over Coral's (the paper's "Coral is Nx cheaper") and, where demand is
not all served, Coral's goodput over the method's (goodput = served fraction x output tokens/s x
verified attainment, per model). Each ratio twice: with whole instances (the plans) and without
(`solver.evaluation.relaxation.relaxed_cost`).

Each ratio is also split into three exact factors (`decompose`): the bought templates' $ per
library T̂, our SLO capacity discount, and whole instances. `demand_scale` plans every scenario
at K x its requests/s.

Libraries are shared by the scenarios of one setup (their inputs do not depend on demand or
pools) and cached under `<cache>/<setup>__<variant>__n<N_max>/`.

`coral bench paper` runs it (`run_comparison`, then `report`); `combined` merges earlier runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from solver.evaluation.relaxation import fractional_cost, relaxed_cost
from solver.evaluation.scenarios import (
    BASELINES,
    SCENARIO_KEYS,
    VARIANTS,
    Planned,
    Scenario,
    cluster_cost,
    gpu_range,
    library_dir,
    plan_recorded,
    scale_demand,
    scenario_fleet,
    scenario_name,
    scenarios,
)
from solver.io import write_atomic
from solver.performance.perf_model import PerfModel
from solver.plan_schema import Method, Plan, template_ref
from solver.stack import FleetConfig

Log = Callable[[str], object]

# ---------------------------------------------------------------- one plan's summary


def goodput(plan: Plan, fleet: FleetConfig) -> float:
    """Output tokens/s that meet the SLOs: each model's served fraction x its output tokens/s x
    its verified (else planned) attainment (`ModelAttainment.judged`)."""
    att = {
        a.model: a.judged if a.judged is not None else (a.planned or 0.0) for a in plan.attainment
    }
    total = 0.0
    for m, spec in fleet.models.items():
        d = spec.phase_demand()
        tokens = d.get("decode", d.get("aggregated", 0.0) * spec.mean_output_tokens)
        total += plan.fraction_of(m) * tokens * att.get(m, 0.0)
    return total


def summarize(p: Planned, fleet: FleetConfig, perf: PerfModel, method: Method) -> dict[str, Any]:
    """What the table and the explanations need from one plan."""
    plan, cat = p.plan, perf.catalog
    gpus_by_type: dict[str, int] = {}
    bought: dict[str, dict[str, int]] = {}
    for i in plan.instances:
        for n in i.nodes:
            g = cat.node(n).gpu_id
            gpus_by_type[g] = gpus_by_type.get(g, 0) + cat.node(n).gpu_count
        job = bought.setdefault(f"{i.model}/{i.phase}", {})
        job[i.template] = job.get(i.template, 0) + 1
    multi = sum(1 for i in plan.instances if len(i.nodes) > 1)
    mixed = sum(1 for i in plan.instances if len({cat.node(n).gpu_id for n in i.nodes}) > 1)
    return {
        "method": method,
        "usd_per_hour": plan.hourly_cost_usd,
        "relaxed_usd_per_hour": round(relaxed_cost(p, fleet, perf, method), 4),
        "fractional_usd_per_hour": round(fractional_cost(plan, fleet), 4),
        "gpus": plan.gpus(cat),
        "gpus_by_type": dict(sorted(gpus_by_type.items())),
        "served_fraction": plan.served_fraction,
        "served_fractions": plan.served_fractions,
        "serves_any": plan.serves_any(),
        "goodput_tokens_per_s": round(goodput(plan, fleet), 2),
        "min_verified": min(
            (a.judged for a in plan.attainment if a.judged is not None), default=None
        ),
        "below_target": [a.model for a in plan.below_target()],
        "cost_by_phase": cost_by_phase(plan),
        "cost_by_model": plan.cost_by_model,
        "instances": len(plan.instances),
        "multi_node_instances": multi,
        "mixed_gpu_instances": mixed,
        "templates": {
            k: dict(sorted(v.items(), key=lambda kv: -kv[1])) for k, v in sorted(bought.items())
        },
        "plan_seconds": round(p.seconds, 1),
        "jobs": job_breakdown(plan, fleet),
    }


def cost_by_phase(plan: Plan) -> dict[str, float]:
    """$/hour per phase, rounded, in phase order."""
    by_phase: dict[str, float] = {}
    for i in plan.instances:
        by_phase[i.phase] = by_phase.get(i.phase, 0.0) + i.usd_per_hour
    return {k: round(v, 4) for k, v in sorted(by_phase.items())}


def job_breakdown(plan: Plan, fleet: FleetConfig) -> dict[str, dict[str, float]]:
    """Per model/phase: $/h bought, the bought templates' library T̂ and their capacity at the
    SLO target (T̂ x factor), and the capacity needed (served fraction x demand / target
    utilization). Their quotients split a cost into template $ per T̂, the SLO capacity
    discount and whole-instance over-provisioning (`decompose`)."""
    u = fleet.allocation.target_utilization
    out: dict[str, dict[str, float]] = {}
    for j in plan.jobs:
        mine = [i for i in plan.instances if (i.model, i.phase) == (j.model, j.phase)]
        library = 0.0
        for i in mine:
            ref = template_ref(i.model, i.phase, i.template)
            t = plan.templates.get(ref)
            library += t.throughput if t is not None else i.throughput
        out[f"{j.model}/{j.phase}"] = {
            "usd_per_hour": round(sum(i.usd_per_hour for i in mine), 4),
            "library_throughput": round(library, 3),
            "capacity": round(sum(i.throughput for i in mine), 3),
            "need": round(plan.fraction_of(j.model) * j.demand / u, 3),
        }
    return out


# ---------------------------------------------------------------- the table


def ratios(rows: dict[str, dict[str, Any]], base: str) -> dict[str, float | bool | None]:
    """Method over Coral: cost (integral and relaxed); Coral's goodput over the method's. A
    baseline that serves nothing has no cost ratio (on Helix's cluster no single node holds
    Llama-2-70B, so the single-node baselines place nothing)."""
    c, b = rows["coral"], rows[base]

    def div(a: float | None, d: float | None) -> float | None:
        return a / d if a is not None and d else None

    if not b.get("serves_any", b["served_fraction"]):
        return {
            "cost": None,
            "cost_relaxed": None,
            "goodput": None,
            "served": None,
            "serves_nothing": True,
        }
    return {
        "cost": div(b["usd_per_hour"], c["usd_per_hour"]),
        "cost_relaxed": div(b["relaxed_usd_per_hour"], c["relaxed_usd_per_hour"]),
        "goodput": div(c["goodput_tokens_per_s"], b["goodput_tokens_per_s"]),
        "served": div(c["served_fraction"], b["served_fraction"]),  # the least served models'
    }


def compare(result: dict[str, Any]) -> dict[str, Any]:
    """Per scenario and baseline: the paper's ratio and ours in both variants."""
    out: dict[str, Any] = {}
    for key, sc in result["scenarios"].items():
        rows = {}
        for base in ("homo", "cauchy"):
            rows[base] = {
                "reported": sc["paper"].get(base),
                **{
                    v: ratios(sc["variants"][v]["methods"], BASELINES[v][base == "cauchy"])
                    for v in sc["variants"]
                    if BASELINES[v][base == "cauchy"] in sc["variants"][v]["methods"]
                },
            }
        out[key] = rows
    return out


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _cell(r: dict[str, float | None] | None, scarce: bool, mark: str = "") -> str:
    """'cost (relaxed)' and, when any method serves less than all demand, '; goodput'."""
    if not r:
        return "-"
    if r.get("serves_nothing"):
        return "the baseline serves nothing"
    s = f"{_x(r['cost'])}{mark} ({_x(r['cost_relaxed'])})"
    if scarce:
        s += f"; goodput {_x(r['goodput'])}"
    return s


def _paper_cell(p: dict[str, Any] | None) -> str:
    return p["text"] if p else "-"


def markdown(result: dict[str, Any]) -> str:
    """The comparison table, the GPU counts and each scenario's plans, as markdown."""
    cmp = compare(result)
    out = [
        "# The paper's ratios beside ours",
        "",
        f"Generated by `coral bench paper` ({runs_text(result)}). Every method at the "
        "same SLO attainment targets (`coral plan`'s closed loop and verification). Cells: "
        "baseline $/h over Coral's with whole instances (without whole instances in brackets: "
        "LP relaxation for coral and cauchy, fractional counts of their own templates for the "
        "greedy baselines); under scarcity also Coral's goodput over the baseline's.",
        "",
        "| scenario | vs | paper | ours, paper setup (paper mode, Table 1 market, *-paper "
        "baselines) | ours, real catalog (committed mode, homo/cauchy) |",
        "|---|---|---|---|---|",
    ]
    for key, rows in cmp.items():
        sc = result["scenarios"][key]
        scarce = any(
            m["served_fraction"] < 0.9999
            for v in sc["variants"].values()
            for m in v["methods"].values()
        )
        paper_var = sc["variants"].get("paper") or {}
        mark = "†" if paper_var.get("n_max", 6) < 6 else ""
        for base, r in rows.items():
            out.append(
                f"| {key} | {base} | {_paper_cell(r['reported'])} | "
                f"{_cell(r.get('paper'), scarce, mark)} | {_cell(r.get('ours'), scarce)} |"
            )
        if "helix" in sc["paper"]:
            out.append(helix_row(sc))
    if "†" in "\n".join(out):
        out += [
            "",
            "†: the paper-setup library of this setup stops at fewer nodes per template than "
            "the paper's N_max = 6 (see the plans below); the baselines' single-node templates "
            "are all there, so Coral's cost is an upper bound and the ratio a lower bound on the "
            "full space's.",
        ]
    out += by_phase(result)
    out += factor_table(result)
    out += ["", "## GPUs, cost and service per plan", ""]
    out.append(
        "| scenario | variant | method | $/h | relaxed $/h | GPUs (paper: range) | GPUs by type "
        "| served | goodput tok/s | min verified | below target | decode share | multi-node / "
        "mixed instances | plan s |"
    )
    out.append("|---|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|")
    for key, sc in result["scenarios"].items():
        for v, var in sc["variants"].items():
            for m, row in var["methods"].items():
                dec = row["cost_by_phase"].get("decode", 0.0)
                share = dec / row["usd_per_hour"] if row["usd_per_hour"] else 0.0
                gt = ", ".join(f"{g} {n}" for g, n in row["gpus_by_type"].items())
                mv = "-" if row["min_verified"] is None else f"{row['min_verified']:.1%}"
                out.append(
                    f"| {key} | {v} (N_max {var.get('n_max', '-')}) | {m} | "
                    f"{row['usd_per_hour']:.2f} | "
                    f"{row['relaxed_usd_per_hour']:.2f} | {row['gpus']} ({gpu_range(sc['setup'])}) "
                    f"| {gt} | {row['served_fraction']:.1%} | {row['goodput_tokens_per_s']:,.0f} | "
                    f"{mv} | {', '.join(row['below_target']) or 'none'} | {share:.0%} | "
                    f"{row['multi_node_instances']} / {row['mixed_gpu_instances']} | "
                    f"{row['plan_seconds']:.0f} |"
                )
    out += ["", "## Templates bought (instances per template, per model and phase)", ""]
    for key, sc in result["scenarios"].items():
        out.append(f"### {key}")
        out.append("")
        for v, var in sc["variants"].items():
            for m, row in var["methods"].items():
                parts = [
                    f"{job}: " + ", ".join(f"{n} {t}" for t, n in ts.items())
                    for job, ts in row["templates"].items()
                ]
                out.append(f"- {v} {m} ({row['usd_per_hour']:.2f} $/h): " + "; ".join(parts))
        out.append("")
    return "\n".join(out) + "\n"


def by_phase(result: dict[str, Any]) -> list[str]:
    """Each baseline's $/h over Coral's, split by phase, where every method serves all demand:
    which phase a ratio comes from. A phase Coral spends little on moves the total little."""
    out = [
        "",
        "## Where the ratios come from: baseline $/h over Coral's, by phase",
        "",
        "Rows where every method serves all of the demand. Coral's decode share is decode's part "
        "of its $/h; the total ratio is the phases' ratios weighted by Coral's shares.",
        "",
        "| scenario | variant | Coral's decode share | baseline | prefill | decode | total |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for key, sc in result["scenarios"].items():
        for v, var in sc["variants"].items():
            ms = var["methods"]
            coral = ms.get("coral")
            if coral is None or any(m["served_fraction"] < 0.9999 for m in ms.values()):
                continue
            cp = coral["cost_by_phase"]
            share = cp.get("decode", 0.0) / coral["usd_per_hour"]
            for base, row in ms.items():
                if base == "coral":
                    continue
                bp = row["cost_by_phase"]
                cells = [
                    _x(bp.get(ph, 0.0) / cp[ph]) if cp.get(ph) else "-"
                    for ph in ("prefill", "decode")
                ]
                total = _x(row["usd_per_hour"] / coral["usd_per_hour"])
                out.append(
                    f"| {key} | {v} | {share:.0%} | {base} | {' | '.join(cells)} | {total} |"
                )
    return out


def decompose(
    coral: dict[str, Any], base: dict[str, Any], phase: str | None = None
) -> dict[str, float] | None:
    """A baseline's $/h over Coral's (over `phase`'s jobs, or all) as the exact product of three
    factors, each a quotient of costs over the same jobs and needs:

    - template: fractional cost at the bought templates' library T̂ (sum of need x $ / T̂);
    - slo: how much more the SLO capacity discount (T̂ over capacity at the target) costs it;
    - whole: how much more whole instances cost it (bought capacity over need).

    None where the two do not serve the same needs (a served fraction below 1) or a job lacks
    capacity."""

    def costs(row: dict[str, Any]) -> tuple[float, float, float] | None:
        c = slo = lib = 0.0
        for job, j in row.get("jobs", {}).items():
            if phase is not None and not job.endswith("/" + phase) or j["need"] <= 0:
                continue
            if j["capacity"] <= 0 or j["library_throughput"] <= 0:
                return None
            c += j["usd_per_hour"]
            slo += j["need"] * j["usd_per_hour"] / j["capacity"]
            lib += j["need"] * j["usd_per_hour"] / j["library_throughput"]
        return (c, slo, lib) if lib > 0 else None

    if coral["served_fraction"] < 0.9999 or base["served_fraction"] < 0.9999:
        return None
    a, b = costs(coral), costs(base)
    if a is None or b is None:
        return None
    return {
        "cost": b[0] / a[0],
        "template": b[2] / a[2],
        "slo": (b[1] / b[2]) / (a[1] / a[2]),
        "whole": (b[0] / b[1]) / (a[0] / a[1]),
    }


def factor_table(result: dict[str, Any]) -> list[str]:
    """`decompose` for every baseline, per phase and in total."""
    out = [
        "",
        "## Why: each ratio as template $ per T̂ x SLO capacity discount x whole instances",
        "",
        "Rows where every method serves all of the demand. Each ratio (baseline over Coral) is "
        "the exact product of three: **template**, the cost of the bought templates at their "
        "library T̂ bought fractionally (what the paper's ILP optimises); **SLO discount**, what "
        "our capacity model's discount (capacity at the attainment target over T̂, "
        "`solver/capacity/slo_capacity.py`) costs on top; **whole instances**, what buying whole "
        "instances costs on top (bought capacity over need).",
        "",
        "| scenario | variant | baseline | phase | ratio | template | SLO discount | "
        "whole instances |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for key, sc in result["scenarios"].items():
        for v, var in sc["variants"].items():
            ms = var["methods"]
            if "coral" not in ms:
                continue
            for base, row in ms.items():
                if base == "coral":
                    continue
                for phase in ("prefill", "decode", None):
                    d = decompose(ms["coral"], row, phase)
                    if d is None:
                        continue
                    out.append(
                        f"| {key} | {v} | {base} | {phase or '**total**'} | {_x(d['cost'])} | "
                        f"{_x(d['template'])} | {_x(d['slo'])} | {_x(d['whole'])} |"
                    )
    return out


def runs_text(result: dict[str, Any]) -> str:
    """Which runs made the table: commit, date, wall time, workers (and what each planned)."""
    runs = result.get("runs") or [result]
    parts = []
    for r in runs:
        what = ""
        if "scenarios" in r and "runs" in result:
            what = ": " + ", ".join(f"{k} {'+'.join(v)}" for k, v in r["scenarios"].items())
        scale = r.get("demand_scale", 1.0)
        what += f", demand x{scale:g}" if scale != 1.0 else ""
        parts.append(
            f"{r['commit']}, {r['date']}, {r['seconds']:.0f} s wall, {r['workers']} workers{what}"
        )
    return "; ".join(parts)


def helix_row(sc: dict[str, Any]) -> str:
    """Sec. 6.6: Coral against Helix, which rents the whole cluster."""
    cells = []
    for v in ("paper", "ours"):
        var = sc["variants"].get(v)
        if not var:
            cells.append("-")
            continue
        c = var["methods"]["coral"]
        over = var["cluster_usd_per_hour"] / c["usd_per_hour"] if c["usd_per_hour"] else None
        cells.append(
            f"cluster $/h over Coral's {_x(over)}"
            f"; Coral serves {c['served_fraction']:.0%} of 4 req/s, min verified "
            f"{'-' if c['min_verified'] is None else format(c['min_verified'], '.0%')}"
        )
    return f"| helix | Helix | {sc['paper']['helix']['text']} | {cells[0]} | {cells[1]} |"


def run_scenario(
    sc: Scenario,
    variants: list[str],
    perf: PerfModel,
    workers: int,
    stacks: Path,
    cache: Path,
    log: Log = print,
    paper_n_max: dict[str, int] | None = None,
    demand_scale: float = 1.0,
    root: Path | None = None,
) -> dict[str, Any]:
    """One scenario in each of `variants`, every method of the variant planned and summarised.
    `stacks`: the stacks folder; `cache`: where the libraries go; `root`: the project folder
    relative trace paths are read from (default: the folder above `stacks`)."""
    root = stacks.parent if root is None else root
    out: dict[str, Any] = {"setup": sc.setup, "stack": sc.stack, "heavy": list(sc.heavy)}
    out["paper"] = sc.paper
    out["variants"] = {}
    for v in variants:
        fleet = scenario_fleet(sc, v, stacks, perf.catalog, (paper_n_max or {}).get(sc.setup))
        fleet = scale_demand(fleet, demand_scale)
        name = scenario_name(sc)
        methods = {}
        t0 = time.perf_counter()
        for method in VARIANTS[v]:
            directory = library_dir(cache, fleet, sc.setup, v)
            p = plan_recorded(name, fleet, perf, directory, method, workers, root)
            methods[method] = summarize(p, fleet, perf, method)
            log(
                f"{sc.key} {v} {method}: {p.plan.hourly_cost_usd:.2f} $/h, "
                f"served {p.plan.served_fraction:.1%} ({p.seconds:.0f} s)"
            )
        out["variants"][v] = {
            "mode": fleet.library.mode,
            "market": fleet.market.kind,
            "n_max": fleet.library.n_max,
            "seconds": round(time.perf_counter() - t0, 1),
            "cluster_usd_per_hour": round(cluster_cost(fleet, perf), 4)
            if sc.setup == "helix"
            else None,
            "methods": methods,
        }
    return out


def run_comparison(
    keys: list[str],
    variants: list[str],
    perf: PerfModel,
    workers: int,
    stacks: Path,
    cache: Path,
    provenance: dict[str, Any],
    log: Log = print,
    paper_n_max: dict[str, int] | None = None,
    demand_scale: float = 1.0,
    on_scenario: Callable[[dict[str, Any]], object] | None = None,
) -> dict[str, Any]:
    """Every scenario of `keys` (in the table's order) in `variants`: the result `report` and
    `combined` read. `provenance`: what the run records about itself (commit, date, workers);
    `on_scenario(result so far)` after each scenario, so what is done survives a later
    failure."""
    t0 = time.perf_counter()
    result: dict[str, Any] = {**provenance, "demand_scale": demand_scale, "scenarios": {}}
    for sc in scenarios():
        if sc.key not in keys:
            continue
        result["scenarios"][sc.key] = run_scenario(
            sc, variants, perf, workers, stacks, cache, log, paper_n_max, demand_scale
        )
        result["seconds"] = time.perf_counter() - t0
        if on_scenario is not None:
            on_scenario(result)
    result["seconds"] = time.perf_counter() - t0
    return result


def combined(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results merged (later ones win per scenario variant), each run listed."""
    out: dict[str, Any] = {"scenarios": {}, "runs": []}
    for r in results:
        for run in r.get("runs") or [r]:
            own = (
                run["scenarios"]  # a combined file's run lists what it planned
                if "runs" in r
                else {k: sorted(v["variants"]) for k, v in r["scenarios"].items()}
            )
            out["runs"].append(
                {k: run[k] for k in ("commit", "date", "seconds", "workers")}
                | {"scenarios": own, "demand_scale": run.get("demand_scale", 1.0)}
            )
        for key, sc in r["scenarios"].items():
            mine = out["scenarios"].setdefault(key, {**sc, "variants": {}})
            mine["variants"].update(sc["variants"])
    order = list(SCENARIO_KEYS)
    out["scenarios"] = dict(
        sorted(
            out["scenarios"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99
        )
    )
    return out


def report(result: dict[str, Any]) -> str:
    """The result's comparison (stored in it, `compare`) and its Markdown table."""
    result["comparison"] = compare(result)
    return markdown(result)


def save_report(out: Path, stem: str, text: str, result: dict[str, Any]) -> None:
    """`<stem>.md` and `<stem>.json` under `out`, each written whole (`write_atomic`)."""
    write_atomic(out / f"{stem}.md", text)
    write_atomic(out / f"{stem}.json", json.dumps(result, indent=1, sort_keys=True) + "\n")
