"""Measurements behind the differences between the paper's ratios and ours.

`coral bench paper` gives the ratios and splits each into template $ per T̂, the SLO capacity
discount and whole instances. `coral bench explain` measures what those parts rest on, on the
core scenarios (their plans take seconds, so every probe runs on every method):

1. **How tight each method's plan is.** The closed loop (`solver.plan.attainment`) stops after
   `attainment.rounds` rounds, and gives capacity back to every model at once, stopping at the
   first trial that leaves any model short. So methods can end at different distances above the
   target. Here each method's plan is tightened job by job (coordinate descent): raise one
   (model, phase)'s capacity correction by 25% (then 10%) and keep it while the simulated
   planning window stays at target + the loop's margin and the plan serves no less and costs no
   more (or serves more). Then the plan is verified on the verification window as usual. The
   ratios of the tightened plans measure how much of each ratio was loop slack.
2. **The paper's capacity model.** Each method solved once at library T̂ (full batches at the
   per-stage budget, no queueing: what the paper's ILP buys), then simulated on the
   verification window: whether T̂ is a usable capacity at our SLOs.
3. **Why single-node prefill gets a deep SLO discount.** In the paper's space a template's
   per-stage budget is the phase SLO / S, so a single-node prefill (S = 1) sizes its batch to
   take the whole TTFT SLO and any wait behind a batch misses. For each model, the prefill node
   the homo-paper baseline buys is re-profiled at budgets SLO / k (k = 1, 2, 4, 8): its T̂, its
   capacity factor at the target (`solver.capacity.slo_capacity`) and their product.
4. **Helix's cluster at more demand.** Coral on paper-helix (paper setup) at 1, 1.5, 2, 3 and 4
   times its 4 req/s, until it serves less than 90%: how much of the cluster the demand needs.

`run` gives the result, `markdown` its report (`explain.md`, beside `explain.json`). Every
function takes the project folder (`root`: its `stacks/`, relative trace paths) and the library
cache of `coral bench paper` (`cache`), whose libraries it reuses.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

from solver.capacity.slo_capacity import capacity_factors
from solver.evaluation.paper_comparison import Log, cost_by_phase, decompose, job_breakdown
from solver.evaluation.paper_results import paper_results
from solver.evaluation.scenarios import (
    BASELINES,
    PAPER_N_MAX,
    VARIANTS,
    Planned,
    cluster_cost,
    library_dir,
    plan_recorded,
    scale_demand,
    scenario,
    scenario_fleet,
    scenario_name,
    scenarios,
)
from solver.performance.perf_model import PerfModel
from solver.plan.attainment import (
    ClosedLoopRound,
    base_factors,
    scaled_factors,
    simulate_workload,
    verify_plan,
)
from solver.plan.planner import plan_stack
from solver.plan_schema import Method, Plan
from solver.serving.instance_model import InstanceModel
from solver.simulation.workload import planning_workload
from solver.stack import FleetConfig
from solver.types import Job

CORE = ("core/default", "core/scarce", "core/large-heavy", "core/small-heavy")
STEPS = (1.25, 1.10)  # the tightening's steps per pass
MAX_TRIALS_PER_JOB = 10
BUDGET_DIVISORS = (1, 2, 4, 8)


# ---------------------------------------------------------------- 1. tightening


def tighten(
    name: str,
    fleet: FleetConfig,
    perf: PerfModel,
    p: Planned,
    method: Method,
    cache: Path,
    root: Path,
) -> tuple[Plan, int]:
    """The plan after job-by-job tightening of its closed loop's result (module doc, 1), and the
    number of trial plans it took."""

    def solve(factors: dict[str, float]) -> Plan:
        return plan_stack(name, fleet, perf.catalog, p.libs, None, method, factors)

    loop = ClosedLoopRound(
        fleet.attainment_scope(),
        perf,
        base_factors(fleet.models, perf, p.libs, root, cache),
        solve,
        root,
        None,
    )
    head = headroom_of(p.plan, p.libs)
    plan, planned, _ = loop.run(head)
    trials = 1
    if not plan.instances or loop.short(planned):
        return p.plan, trials

    def better(new: Plan, att: dict[str, float]) -> bool:
        if loop.short(att) or new.served_fraction < plan.served_fraction - 1e-9:
            return False
        more = new.served_fraction > plan.served_fraction + 1e-9
        return more or new.hourly_cost_usd <= plan.hourly_cost_usd + 1e-9

    for step in STEPS:
        by_cost = sorted(head, key=lambda j: -plan.cost_by_model.get(j[0], {}).get(j[1], 0.0))
        for job in by_cost:
            for _ in range(MAX_TRIALS_PER_JOB):
                trial = dict(head)
                trial[job] = head[job] * step
                new, att, _ = loop.run(trial)
                trials += 1
                if not better(new, att):
                    break
                head, plan, planned = trial, new, att
    return verify_plan(plan, fleet.attainment_scope(), perf, planned, head, root), trials


def headroom_of(plan: Plan, libs: dict[Job, Any]) -> dict[Job, float]:
    """The closed loop's final correction per (model, phase) as the plan records it (1: none)."""
    head = {job: 1.0 for job in libs}
    for a in plan.attainment:
        for job in head:
            if job[0] == a.model and job[1] in a.headroom:
                head[job] = a.headroom[job[1]]
    return head


def at_headroom(
    name: str,
    fleet: FleetConfig,
    perf: PerfModel,
    p: Planned,
    other: Plan,
    cache: Path,
    root: Path,
) -> Plan:
    """Coral's ILP at another method's final closed-loop corrections (its headroom per model and
    phase), verified: whether Coral serving less than a baseline comes from the loop's end state
    rather than from its columns (Coral's columns include the baseline's)."""
    head = headroom_of(other, p.libs)
    factors = scaled_factors(base_factors(fleet.models, perf, p.libs, root, cache), head)
    plan = plan_stack(name, fleet, perf.catalog, p.libs, None, "coral", factors)
    return verify_plan(plan, fleet.attainment_scope(), perf, {}, head, root)


# ---------------------------------------------------------------- 3. budget probe


def budget_probe(
    fleet: FleetConfig, perf: PerfModel, homo: Plan, root: Path
) -> list[dict[str, Any]]:
    """Each model's homo-paper prefill node at per-stage budgets SLO / k (module doc, 3)."""
    rows = []
    for i, (model, spec) in enumerate(sorted(fleet.models.items())):
        refs = [r for r in homo.templates if r.startswith(f"{model}/prefill/")]
        if not refs:
            continue
        t = homo.templates[refs[0]]
        if len(t.nodes) != 1:
            continue
        node, card = t.nodes[0], perf.card(model)
        workload = planning_workload(spec, i, root, card.max_context)
        base = None
        for k in BUDGET_DIVISORS:
            budget = spec.slo_ms.prefill / k
            full = [
                e
                for e in perf.profile_table(
                    model, "prefill", budget, [node], spec.mean_prompt_tokens, hop=False
                )
                if e.layers == card.layers
            ]
            if not full:
                rows.append({"model": model, "node": node, "k": k, "budget_ms": budget})
                continue
            e = full[0]
            probe = t.model_copy(update={"throughput": e.tokens_per_s, "stage_budget_ms": [budget]})
            # The prefill capacity model runs each template's instance, as the planner's does.
            f = float(
                capacity_factors(
                    [probe],
                    spec.slo_ms,
                    workload,
                    spec.slo_attainment,
                    partial(InstanceModel.serving, perf, spec=spec),
                )[0]
            )
            cap = e.tokens_per_s * f
            base = base if base is not None else cap
            rows.append(
                {
                    "model": model,
                    "node": node,
                    "k": k,
                    "budget_ms": round(budget, 1),
                    "batch_tokens": e.batch,
                    "t_hat": round(e.tokens_per_s, 1),
                    "factor": round(f, 4),
                    "capacity": round(cap, 1),
                    "capacity_over_k1": round(cap / base, 3) if base else None,
                }
            )
    return rows


# ---------------------------------------------------------------- 4. Helix's cluster

HELIX_LOADS = (1.0, 1.5, 2.0, 3.0, 4.0)
HELIX_SATURATED = 0.9  # served fraction below which the cluster is taken as full


def helix_sweep(
    perf: PerfModel, workers: int, log: Log, root: Path, cache: Path
) -> list[dict[str, Any]]:
    """Coral on Helix's cluster (paper setup) at the stack's 4 req/s times each of HELIX_LOADS,
    until it serves less than HELIX_SATURATED of it: how much of the cluster the demand needs,
    and the most the cluster serves at the SLO target (the paper's Coral used 57 of 64 GPUs)."""
    sc = scenario("helix")
    base = scenario_fleet(sc, "paper", root / "stacks", perf.catalog)
    cluster = cluster_cost(base, perf)
    rows = []
    for load in HELIX_LOADS:
        fleet = scale_demand(base, load)
        directory = library_dir(cache, fleet, "helix", "paper")
        p = plan_recorded(sc.stack, fleet, perf, directory, "coral", workers, root)
        rps = sum(s.demand.requests_per_s or 0.0 for s in fleet.models.values() if s.demand)
        row = {
            "load": load,
            "requests_per_s": rps,
            "served_fraction": p.plan.served_fraction,
            "served_requests_per_s": round(rps * p.plan.served_fraction, 3),
            "usd_per_hour": p.plan.hourly_cost_usd,
            "cost_over_cluster": round(p.plan.hourly_cost_usd / cluster, 3),
            "gpus": p.plan.gpus(perf.catalog),
            "min_verified": summary(p.plan, fleet)["min_verified"],
            "binding": p.plan.binding,
        }
        rows.append(row)
        log(f"helix x{load}: {row}")
        if p.plan.served_fraction < HELIX_SATURATED:
            break
    return rows


# ---------------------------------------------------------------- the run


def full_batch_row(plan: Plan, fleet: FleetConfig, perf: PerfModel, root: Path) -> dict[str, Any]:
    """The plan at library T̂: its cost, and each model's attainment when simulated on the
    verification window (the simulator's verdict on the paper's capacity model)."""
    minutes = fleet.attainment.verify_minutes
    sim = (
        simulate_workload(plan, fleet.models, perf, "verify", minutes * 60, root)
        if minutes
        else None
    )
    verified = {
        m: float(r.met.mean()) for m, r in (sim.models if sim else {}).items() if len(r.met)
    }
    return {
        "usd_per_hour": plan.hourly_cost_usd,
        "served_fraction": plan.served_fraction,
        "gpus": plan.gpus(perf.catalog),
        "cost_by_phase": cost_by_phase(plan),
        "verified": {m: round(v, 4) for m, v in sorted(verified.items())},
        "min_verified": round(min(verified.values()), 4) if verified else None,
    }


def summary(plan: Plan, fleet: FleetConfig) -> dict[str, Any]:
    verified = [a.judged for a in plan.attainment if a.judged is not None]
    return {
        "jobs": job_breakdown(plan, fleet),
        "usd_per_hour": plan.hourly_cost_usd,
        "served_fraction": plan.served_fraction,
        "min_verified": min(verified) if verified else None,
        "verified": {a.model: a.judged for a in plan.attainment},
        "cause": {a.model: a.cause for a in plan.attainment if a.cause},
        "headroom": {a.model: a.headroom for a in plan.attainment},
    }


def run(
    keys: list[str],
    perf: PerfModel,
    workers: int,
    log: Log,
    root: Path,
    cache: Path,
    variants: list[str] | None = None,
) -> dict[str, Any]:
    """The probes (module doc) on each scenario of `keys`, per variant and method: the
    `scenarios` part of `explain.json`."""
    out: dict[str, Any] = {}
    if "helix" in keys:
        out["helix"] = {"sweep": helix_sweep(perf, workers, log, root, cache)}
    for sc in scenarios():
        if sc.key not in keys or sc.key == "helix":
            continue
        out[sc.key] = {}
        for v in variants or list(VARIANTS):
            n_max = PAPER_N_MAX.get(sc.setup)
            fleet = scenario_fleet(sc, v, root / "stacks", perf.catalog, n_max)
            name = scenario_name(sc)
            directory = library_dir(cache, fleet, sc.setup, v)
            rows: dict[str, Any] = {}
            planned: dict[str, Planned] = {}
            for method in VARIANTS[v]:
                t0 = time.perf_counter()
                p = plan_recorded(name, fleet, perf, directory, method, workers, root)
                planned[method] = p
                tight, trials = tighten(name, fleet, perf, p, method, directory, root)
                # Every template at its library T̂: the capacity the paper's ILP gives it.
                full = plan_stack(name, fleet, perf.catalog, p.libs, None, method, None)
                rows[method] = {
                    "loop": summary(p.plan, fleet),
                    "tightened": summary(tight, fleet),
                    "trials": trials,
                    "full_batch": full_batch_row(full, fleet, perf, root),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                if method.startswith("homo") and v == "paper":
                    out[sc.key]["budget_probe"] = budget_probe(fleet, perf, p.plan, root)
                log(
                    f"{sc.key} {v} {method}: loop {p.plan.hourly_cost_usd:.2f} $/h, tightened "
                    f"{tight.hourly_cost_usd:.2f} $/h ({trials} trials, "
                    f"{rows[method]['seconds']:.0f} s)"
                )
            coral = planned["coral"]
            for other, q in planned.items():
                if q.plan.served_fraction > coral.plan.served_fraction + 1e-9:
                    swapped = at_headroom(name, fleet, perf, coral, q.plan, directory, root)
                    rows["coral"].setdefault("at_headroom_of", {})[other] = summary(swapped, fleet)
                    log(
                        f"{sc.key} {v} coral at {other}'s headroom: "
                        f"{swapped.hourly_cost_usd:.2f} $/h, served {swapped.served_fraction:.1%}"
                    )
            out[sc.key][v] = rows
    return out


def merged(result: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """`result` over an earlier explain.json's: later runs win per scenario and variant, and
    both runs are listed."""
    old = dict(earlier)
    scenarios_ = dict(old.get("scenarios", {}))
    for key, sc in result["scenarios"].items():
        scenarios_[key] = {**scenarios_.get(key, {}), **sc}
    return {**result, "scenarios": scenarios_, "runs": [*old.get("runs", []), *result["runs"]]}


def _ratio(b: dict[str, Any], c: dict[str, Any]) -> str:
    if not b["served_fraction"]:
        return "serves nothing"
    s = f"{b['usd_per_hour'] / c['usd_per_hour']:.2f}x" if c["usd_per_hour"] else "-"
    if min(b["served_fraction"], c["served_fraction"]) < 0.9999:
        s += f" (served {c['served_fraction']:.1%} / {b['served_fraction']:.1%})"
    return s


def _parts(coral: dict[str, Any], base: dict[str, Any]) -> str:
    d = decompose(coral, base)
    if d is None:
        return "-"
    return f"{d['template']:.2f} x {d['slo']:.2f} x {d['whole']:.2f}"


def _short(row: dict[str, Any]) -> str:
    causes = row.get("cause", {})
    return "; ".join(f"{m} {_pct(row['verified'][m])}: {c}" for m, c in causes.items()) or "none"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def markdown(result: dict[str, Any]) -> str:
    """explain.md: the probes' tables (module doc), section by section."""
    res = result["scenarios"]
    out = [
        "# What the paper-vs-ours differences rest on",
        "",
        "Generated by `coral bench explain` ("
        + "; ".join(
            f"{r['commit']}, {r['date']}, {r['seconds']:.0f} s wall: {', '.join(r['scenarios'])}"
            for r in result.get("runs") or [result | {"scenarios": list(res)}]
        )
        + "). Method and probes: `solver/evaluation/paper_explain.py`'s docstring. Every target in "
        "sections 1-3 is 90%.",
        "",
        "## 1. The closed loop as in the table, and tightened job by job",
        "",
        "| scenario | variant | method | loop $/h | served | min verified | tightened $/h | "
        "served | min verified | trials |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, sc in res.items():
        for v in VARIANTS:
            rows = sc.get(v, {})
            for m in VARIANTS[v]:  # the table's order, whatever the JSON's key order
                if m not in rows:
                    continue
                r = rows[m]
                a, t = r["loop"], r["tightened"]
                out.append(
                    f"| {key} | {v} | {m} | {a['usd_per_hour']:.2f} | {_pct(a['served_fraction'])}"
                    f" | {_pct(a['min_verified'])} | {t['usd_per_hour']:.2f} | "
                    f"{_pct(t['served_fraction'])} | {_pct(t['min_verified'])} | {r['trials']} |"
                )
    out += [
        "",
        "## 2. Ratios: the loop's plans, the tightened ones, and at library T̂",
        "",
        "Baseline $/h over Coral's (with the served fractions, Coral's / the baseline's, where "
        "either serves less than all). At T̂ also the lowest verified attainment of any model.",
        "",
        "| scenario | variant | vs | loop (the table) | tightened | tightened: template x SLO "
        "discount x whole instances | at library T̂ | min verified at T̂ (Coral / baseline) |",
        "|---|---|---|---:|---:|---|---:|---:|",
    ]
    for key, sc in res.items():
        for v in VARIANTS:
            rows = sc.get(v, {})
            if "coral" not in rows:
                continue
            c = rows["coral"]
            for base in BASELINES[v]:
                if base not in rows:
                    continue
                r = rows[base]
                fb_c, fb_b = c["full_batch"], r["full_batch"]
                out.append(
                    f"| {key} | {v} | {base} | {_ratio(r['loop'], c['loop'])} | "
                    f"{_ratio(r['tightened'], c['tightened'])} | "
                    f"{_parts(c['tightened'], r['tightened'])} | {_ratio(fb_b, fb_c)} | "
                    f"{_pct(fb_c['min_verified'])} / {_pct(fb_b['min_verified'])} |"
                )
    swaps = [
        (key, v, m, s)
        for key, sc in res.items()
        for v in VARIANTS
        for m, s in sc.get(v, {}).get("coral", {}).get("at_headroom_of", {}).items()
    ]
    if swaps:
        out += [
            "",
            "Where a baseline serves more than Coral: Coral's ILP at that baseline's final "
            "closed-loop corrections (headroom per model and phase), verified.",
            "",
            "| scenario | variant | headroom of | Coral $/h | served | min verified | short, "
            "and why |",
            "|---|---|---|---:|---:|---:|---|",
        ]
        for key, v, m, s in swaps:
            out.append(
                f"| {key} | {v} | {m} | {s['usd_per_hour']:.2f} | {_pct(s['served_fraction'])}"
                f" | {_pct(s['min_verified'])} | {_short(s)} |"
            )
    out += [
        "",
        "## 3. Single-node prefill at smaller per-stage budgets (paper setup)",
        "",
        "The node homo-paper buys for each model's prefill, re-profiled at TTFT SLO / k. "
        "Capacity = T̂ x the capacity factor at the target.",
        "",
        "| model | node | k | budget ms | batch tokens | T̂ tok/s | factor | "
        "capacity tok/s | capacity / k=1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    seen = set()
    for sc in res.values():
        for r in sc.get("budget_probe", []):
            if (r["model"], r["node"], r["k"]) in seen:
                continue  # the same node for the same model in another scenario
            seen.add((r["model"], r["node"], r["k"]))
            if "t_hat" not in r:
                out.append(
                    f"| {r['model']} | {r['node']} | {r['k']} | {r['budget_ms']:.0f} | "
                    "nothing fits | | | | |"
                )
                continue
            out.append(
                f"| {r['model']} | {r['node']} | {r['k']} | {r['budget_ms']:.0f} | "
                f"{r['batch_tokens']:,} | {r['t_hat']:,.0f} | {r['factor']:.3f} | "
                f"{r['capacity']:,.0f} | {r['capacity_over_k1']:.2f}x |"
            )
    sweep = res.get("helix", {}).get("sweep")
    if sweep:
        helix = paper_results().helix
        share = 1.0 + helix.cost_vs_helix.value
        unused = int(helix.cluster_gpus.value - helix.coral_gpus.value)
        out += [
            "",
            "## 4. Coral on Helix's cluster at more demand (paper setup)",
            "",
            "paper-helix's 4 req/s of Llama-2-70B times each load, Coral planned as in the table "
            "(target 0.5: the SLOs are Helix's medians). Cost over the whole cluster's $/h "
            f"(what Helix rents); the paper's Coral costs {share:.2f} of it and leaves {unused} of "
            f"the {helix.cluster_gpus.value:.0f} GPUs unused.",
            "",
            "| load | req/s | served | served req/s | Coral $/h | over the cluster | GPUs | "
            "min verified | binding |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in sweep:
            out.append(
                f"| x{r['load']:g} | {r['requests_per_s']:g} | {_pct(r['served_fraction'])} | "
                f"{r['served_requests_per_s']:g} | {r['usd_per_hour']:.2f} | "
                f"{r['cost_over_cluster']:.2f} | {r['gpus']} | {_pct(r['min_verified'])} | "
                f"{'; '.join(r.get('binding', [])) or '-'} |"
            )
    return "\n".join(out) + "\n"
