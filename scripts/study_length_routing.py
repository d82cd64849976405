"""Study: what length-aware routing (prompt-length buckets, one pool each) saves at equal attainment.

Issue #16, item 6. Mélange-style routing sends each request to a pool chosen by its prompt length,
so short prompts can go to cheap templates and long prompts to templates that prefill fast. This
script measures what that would save on the Azure 2023 traces, with the planner as it is:

- **One pool** (the baseline): a single-model copy of the stack (same regions, node_configs,
  library and attainment settings, SLOs and demand; no budget) judged on the packaged trace,
  planned with `plan_with_library` to the model's `slo_attainment` and verified on the trace's
  other half.
- **Buckets**: the trace's requests split by prompt length at thresholds (quantiles of the raw
  prompt lengths, or token counts). Each bucket is a CSV of its requests with their original
  timestamps (a thinned stream of the same hour), planned alone as its own model stack: demand =
  the model's requests/s x the bucket's share of requests, mean lengths = the bucket's raw means
  x (stack mean / trace mean), which is exactly how `solver/simulation/workload.py` scales the
  full trace, so every request keeps the length it has in the one-pool run. Each bucket has its
  own template library (the library is sized for the mean lengths) and the same attainment
  target, so the routed fleet meets at least the target overall. Cost = sum over buckets.
- **Shared miss budget** (equal overall attainment): the target is per model, and one pool
  may spend its whole miss budget on its long prompts. So the longest bucket is also re-planned
  at the target the others leave it: (target - sum of the shorter buckets' share x planned
  attainment) / its share, at least 0.5 (planned: on their planning windows, never the
  verification's).

Printed: a Markdown table per (stack, model) with $/h, saving against one pool, verified
attainment (overall, request-weighted, and the worst bucket), the one pool's attainment on each
bucket's requests (in its own verification: where one pool's misses are), GPUs, and the
templates each bucket bought; then a summary, one row per (pair, demand). `--scale K` (repeatable)
multiplies the demand: whole instances weigh less at scale.
Libraries go to `.coral/library/study-length-routing/` (reused when their inputs are unchanged).

Usage: scripts/study_length_routing [--pair STACK:MODEL:TRACE ...] [--split 0.5 --split 0.33,0.67]
       [--scale K ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from solver.io import data_path
from solver.simulation.traces import Trace, load_trace_csv
from solver.simulation.workload import PACKAGED_TRACES, request_rate, trace_window
from solver.stack import ModelSpec, load_stack

REPO = Path(__file__).resolve().parents[1]

LIBRARIES = REPO / ".coral" / "library" / "study-length-routing"
DEFAULT_PAIRS = [
    "dev:phi-4:azure-conv-2023",
    "paper-core:phi-4:azure-conv-2023",
    "paper-core:gpt-oss-20b:azure-code-2023",
]
DEFAULT_SPLITS = ["0.5", "0.9", "0.33,0.67", "0.5,0.9", "rr2"]


@dataclass(frozen=True)
class Bucket:
    """One prompt-length range of the trace: its requests and what the stack copy needs."""

    label: str  # e.g. "<=1020", "1021-2734", ">2734" (raw trace tokens)
    trace: Trace
    share: float  # of the trace's requests
    mask: np.ndarray  # which of the trace's requests


@dataclass
class Outcome:
    """One planned pool (the whole trace, or a bucket)."""

    usd: float
    target: float
    planned: float | None
    verified: float | None
    requests: int
    gpus: int
    templates: str
    served: float


def split_trace(trace: Trace, split: str) -> list[Bucket]:
    """Buckets at the split's thresholds: quantiles of the prompt lengths (< 1) or tokens;
    `rrN`: the length-blind control, N pools taking the requests in turn (round-robin)."""
    masks: list[tuple[str, np.ndarray]] = []
    if split.startswith("rr"):
        n = int(split[2:])
        turn = np.arange(len(trace.prompt)) % n
        masks = [(f"rr {b + 1}/{n}", turn == b) for b in range(n)]
    else:
        raw = [float(x) for x in split.split(",")]
        cuts = sorted({int(np.quantile(trace.prompt, x)) if x < 1 else int(x) for x in raw})
        edges = [0, *cuts, None]
        for lo, hi in zip(edges, edges[1:], strict=False):
            keep = trace.prompt > lo
            if hi is not None:
                keep &= trace.prompt <= hi
            label = f"<={hi}" if lo == 0 else (f">{lo}" if hi is None else f"{lo + 1}-{hi}")
            masks.append((label, keep))
    return [
        Bucket(
            label, Trace(trace.arrival_s[m], trace.prompt[m], trace.output[m]), float(m.mean()), m
        )
        for label, m in masks
        if m.any()
    ]


def write_csv(path: Path, trace: Trace) -> None:
    """The requests as `timestamp,prompt_tokens,output_tokens`, original timestamps kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = "".join(
        f"{t:.6f},{p},{o}\n"
        for t, p, o in zip(trace.arrival_s, trace.prompt, trace.output, strict=True)
    )
    path.write_text("timestamp,prompt_tokens,output_tokens\n" + rows, encoding="utf-8")


def single_model_doc(stack: str, model: str, workload_trace: str) -> dict[str, Any]:
    """The stack's document with only `model` (judged on `workload_trace`) and no budget."""
    doc = yaml.safe_load((REPO / "stacks" / f"Pulumi.{stack}.yaml").read_text(encoding="utf-8"))
    fleet = doc["config"]["coral:fleet"]
    fleet["models"] = {model: fleet["models"][model]}
    fleet["models"][model]["workload_trace"] = workload_trace
    fleet.get("allocation", {}).pop("budget_usd_per_hour", None)
    fleet["demand_source"] = {"kind": "config"}
    return doc


def bucket_doc(
    base: dict[str, Any], model: str, bucket: Bucket, full: Trace, rate: float, csv: str
) -> dict[str, Any]:
    """The one-model stack for a bucket: its share of the demand and its (scaled) mean lengths."""
    doc = copy.deepcopy(base)
    spec = doc["config"]["coral:fleet"]["models"][model]
    k_prompt = spec["mean_prompt_tokens"] / float(full.prompt.mean())
    k_output = spec["mean_output_tokens"] / float(full.output.mean())
    spec["mean_prompt_tokens"] = round(float(bucket.trace.prompt.mean()) * k_prompt, 3)
    spec["mean_output_tokens"] = round(float(bucket.trace.output.mean()) * k_output, 3)
    spec["demand"] = {"requests_per_s": round(rate * bucket.share, 6)}
    spec["workload_trace"] = csv
    return doc


def plan_pool(root: Path, name: str, doc: dict[str, Any], library: Path, perf: Any) -> Outcome:
    """Plan one single-model stack in the scratch project `root` (closed loop + verification)."""
    return outcome(*plan_doc(root, name, doc, library, perf))


def plan_doc(
    root: Path, name: str, doc: dict[str, Any], library: Path, perf: Any
) -> tuple[Any, Any]:
    """The stack document written into `root`, loaded and planned: (plan, fleet)."""
    from solver.plan.planner import plan_with_library

    (root / "stacks" / f"Pulumi.{name}.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    fleet = load_stack(root / "stacks", name)
    return plan_with_library(name, fleet, perf, library, root=root), fleet


def outcome(plan: Any, fleet: Any) -> Outcome:
    """What the tables report of a plan."""
    att = plan.attainment[0] if plan.attainment else None
    counts: dict[str, int] = {}
    for i in plan.instances:
        key = f"{i.phase[0]}:{i.template}"
        counts[key] = counts.get(key, 0) + 1
    return Outcome(
        usd=plan.hourly_cost_usd,
        target=fleet.models[next(iter(fleet.models))].slo_attainment,
        planned=att.planned if att else None,
        verified=att.verified if att else None,
        requests=att.verified_requests if att else 0,
        gpus=sum(int(n.rsplit("x", 1)[1]) for i in plan.instances for n in i.nodes),
        templates=" ".join(f"{n}x{k}" for k, n in sorted(counts.items())),
        served=plan.served_fraction,
    )


def one_pool_met(
    plan: Any, fleet: Any, perf: Any, root: Path, full: Trace
) -> tuple[np.ndarray, np.ndarray]:
    """The one pool's verification request by request: the indices of its requests in the
    full trace (the verification window's, `trace_window`, in order) and whether
    each met both SLOs. Checked against the trace's output lengths."""
    from solver.plan.attainment import simulate_workload

    minutes = fleet.attainment.verify_minutes
    sim = simulate_workload(plan, fleet.models, perf, "verify", minutes * 60, root)
    assert sim is not None, "the one pool serves nothing"
    r = next(iter(sim.models.values()))
    idx = trace_window(full.arrival_s, "verify")[0][: len(r.met)]
    spec = next(iter(fleet.models.values()))
    k = spec.mean_output_tokens / float(full.output.mean())
    if not np.array_equal(r.output, np.maximum(1, np.rint(full.output[idx] * k))):
        sys.exit("the verification window is not trace_window's, in order")
    return idx, r.met


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def combined(parts: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Request-weighted verified attainment over the buckets, and the worst bucket's."""
    known = [p for p in parts if p["verified"] is not None and p["requests"]]
    if not known:
        return None, None
    total = sum(p["requests"] for p in known)
    overall = sum(p["verified"] * p["requests"] for p in known) / total
    return overall, min(p["verified"] for p in known)


def study_pair(pair: str, splits: list[str], scale: float, root: Path, perf: Any) -> dict:
    """One (stack, model, trace): the one-pool plan and each split's bucketed plans."""
    stack, model, trace_name = pair.split(":")
    full = load_trace_csv(data_path(PACKAGED_TRACES[trace_name]))
    base = single_model_doc(stack, model, trace_name)
    spec = base["config"]["coral:fleet"]["models"][model]
    rate = request_rate(ModelSpec.model_validate(spec)) * scale
    spec["demand"] = {"requests_per_s": round(rate, 6)}
    tag = f"{stack}-{model}" + (f"-x{scale:g}" if scale != 1.0 else "")
    plan, fleet = plan_doc(root, f"{tag}-one", base, LIBRARIES / f"{stack}-{model}" / "one", perf)
    one = outcome(plan, fleet)
    idx, met = one_pool_met(plan, fleet, perf, root, full)
    rows: dict[str, Any] = {"pair": pair, "rate": rate, "one": asdict(one), "routings": []}
    for split in splits:
        name = split.replace(",", "_")
        jobs = []
        for b_i, bucket in enumerate(split_trace(full, split)):
            csv = f"buckets/{tag}/{name}/b{b_i}.csv"
            write_csv(root / csv, bucket.trace)
            doc = bucket_doc(base, model, bucket, full, rate, csv)
            lib = LIBRARIES / f"{stack}-{model}" / f"{name}-b{b_i}"
            jobs.append((bucket, doc, lib, f"{tag}-{name}-b{b_i}"))
        same = [plan_pool(root, n, d, lib, perf) for _, d, lib, n in jobs]
        kind = f"{split[2:]} pools round-robin" if split.startswith("rr") else f"split at {split}"
        one_met = [float(met[b.mask[idx]].mean()) for b, *_ in jobs]
        rows["routings"].append(routing(f"{kind}, same target", jobs, same, one_met))
        shared = shared_budget(root, model, jobs, same, perf)
        rows["routings"].append(routing(f"{kind}, shared miss budget", jobs, shared, one_met))
        print(f"  {pair} split {split}: done", file=sys.stderr, flush=True)
    return rows


def routing(
    name: str,
    jobs: list[tuple[Bucket, Any, Path, str]],
    parts: list[Outcome],
    one_met: list[float],
) -> dict:
    """A routing's buckets, each with its plan and the one pool's attainment on its requests."""
    buckets = [
        {"bucket": b.label, "share": round(b.share, 4), "one_pool_met": m}
        for (b, *_), m in zip(jobs, one_met, strict=True)
    ]
    return {
        "name": name,
        "parts": [{**b, **asdict(o)} for b, o in zip(buckets, parts, strict=True)],
    }


def shared_budget(
    root: Path,
    model: str,
    jobs: list[tuple[Bucket, Any, Path, str]],
    same: list[Outcome],
    perf: Any,
) -> list[Outcome]:
    """The longest bucket re-planned at the target the others leave it: the model's target
    minus what the shorter buckets' plans reach on their planning windows (not the verified
    numbers, which the planner may not see), over its share; the same plans when that is the
    target."""
    target = same[-1].target
    rest = sum(
        b.share * (o.planned if o.planned is not None else target)
        for (b, *_), o in zip(jobs[:-1], same[:-1], strict=True)
    )
    share_last = jobs[-1][0].share
    want = max(0.5, min(target, math.ceil(200 * (target - rest) / share_last) / 200))
    if want >= target:
        return same
    bucket, doc, lib, name = jobs[-1]
    doc = copy.deepcopy(doc)
    doc["config"]["coral:fleet"]["models"][model]["slo_attainment"] = want
    return [*same[:-1], plan_pool(root, f"{name}-shared", doc, lib, perf)]


def table(r: dict[str, Any]) -> str:
    """Markdown rows for one pair: the one pool, then each routing (total, then its buckets)."""
    one = r["one"]
    lines = [
        f"\n**{r['pair']}** ({r['rate']:g} requests/s, target {one['target']:g})\n",
        "| routing | bucket (raw prompt tokens) | share | target | $/h | saving | verified "
        "| one pool's | GPUs | templates bought (p: prefill, d: decode) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| one pool | all | 100% | {one['target']:g} | {one['usd']:.2f} | - | "
        f"{pct(one['verified'])} | | {one['gpus']} | {one['templates']} |",
    ]
    for route in r["routings"]:
        parts = route["parts"]
        usd = sum(p["usd"] for p in parts)
        overall, worst = combined(parts)
        lines.append(
            f"| {route['name']} | total | 100% | | {usd:.2f} | {saving(one['usd'], usd)} | "
            f"{pct(overall)} (worst {pct(worst)}) | | {sum(p['gpus'] for p in parts)} | |"
        )
        for p in parts:
            lines.append(
                f"| | {p['bucket']} | {100 * p['share']:.0f}% | {p['target']:g} | "
                f"{p['usd']:.2f} | | {pct(p['verified'])} | {pct(p['one_pool_met'])} | "
                f"{p['gpus']} | {p['templates']} |"
            )
    return "\n".join(lines)


def saving(base: float, new: float) -> str:
    return "-" if base <= 0 else f"{100 * (base - new) / base:+.1f}%"


def summary(results: list[dict[str, Any]]) -> str:
    """One row per (pair, demand): one pool's $/h, then each routing's saving and verified
    overall attainment; `*` marks a routing whose overall verified attainment is below target."""
    names = list(dict.fromkeys(route["name"] for r in results for route in r["routings"]))
    lines = [
        "\n| stack: model | requests/s | one pool $/h (verified) | " + " | ".join(names) + " |",
        "|---|---:|---:|" + "---:|" * len(names),
    ]
    for r in results:
        one = r["one"]
        cells = []
        routes = {route["name"]: route for route in r["routings"]}
        for name in names:
            route = routes.get(name)
            if route is None:
                cells.append("-")
                continue
            usd = sum(p["usd"] for p in route["parts"])
            overall, _ = combined(route["parts"])
            flag = "*" if overall is not None and overall < one["target"] else ""
            cells.append(f"{saving(one['usd'], usd)} ({pct(overall)}{flag})")
        stack, model, _ = r["pair"].split(":")
        lines.append(
            f"| {stack}: {model} | {r['rate']:g} | {one['usd']:.2f} ({pct(one['verified'])}) | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", action="append", help="STACK:MODEL:TRACE (default: the three)")
    ap.add_argument("--split", action="append", help="thresholds: quantiles (<1), tokens, rrN")
    ap.add_argument(
        "--scale", type=float, action="append", help="multiply each model's demand (repeat)"
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    from solver.performance.default_model import load_perf_model

    perf = load_perf_model()
    results = []
    with tempfile.TemporaryDirectory(prefix="coral-length-routing-") as tmp:
        root = Path(tmp)
        (root / "stacks").mkdir()
        (root / "Pulumi.yaml").write_text((REPO / "Pulumi.yaml").read_text(encoding="utf-8"))
        for pair in args.pair or DEFAULT_PAIRS:
            for scale in args.scale or [1.0]:
                t0 = time.perf_counter()
                r = study_pair(pair, args.split or DEFAULT_SPLITS, scale, root, perf)
                r["seconds"] = round(time.perf_counter() - t0, 1)
                results.append(r)
                print(table(r), flush=True)
    print(summary(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
