"""`scripts/bench_vidur`: our simulator and our capacity model beside Vidur on the same requests.

For every case (Llama-2-70B on A100-80GB, TP 2, PP 1 or 2, aggregated or prefill-only, fixed or
lognormal lengths) and every rate of a geometric grid, the same Poisson request stream goes to our
engine and, when `.vidur-venv` exists (`scripts/vidur_env`), to Vidur's `sarathi` scheduler with
the chunk and batch cap we render (and its `vllm` scheduler for reference). It writes
`results.json`, `table.md` (TTFT/TPOT p50/p90, throughput and the highest rate meeting the SLOs
per tool) and `rates.png` into the output folder.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from solver.evaluation.reference import (
    CONVERSATION,
    FIXED,
    Case,
    Outcome,
    Requests,
    highest_rate,
    instance_template,
    plan_capacity,
    requests,
    simulate_ours,
)
from solver.io import write_atomic
from solver.performance.default_model import load_perf_model
from solver.performance.kernel_fit import vidur_sim_dir
from solver.performance.perf_model import PerfModel
from solver.serving.instance_model import InstanceModel
from solver.stack import Slo
from solver.types import LibPhase

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vidur_runner.py")
VIDUR_PYTHON = ROOT / ".vidur-venv" / "bin" / "python"
SLO = Slo(prefill=1500, decode=80)
MODEL, NODE = "llama2-70b", "a100-80gbx2"
SEED = 7  # one request stream per (case, rate), the same for every tool
# A prefill-only limit with lognormal prompts rests on the few long prompts near the TTFT
# budget: at zero load 94-95% of prompts meet it against a 93% share, so at 600 requests one
# stream's limit is noise (our simulator's PP 1 limit spans 0.33-0.75 req/s over five seeds).
# At 12,000 it spans 0.44-0.51 over seeds 7-10, and a prefill-only run costs seconds, in Vidur
# as in ours.
PREFILL_REQUESTS = 12_000
REFINE_STEPS = 3  # halvings of each tool's grid bracket around its limit (see `refine`)
# Our limit on three more streams (bisection to 0.4%): how much of a gap to
# Vidur one stream's noise could be, and the median of four for plan / simulate.
OTHER_SEEDS = (8, 9, 10)
SEED_BISECTION_STEPS = 10
# plan / simulate: our limit (median of the four seeds' streams) on at least this many requests
# per run; our simulator is cheap, and 600 requests leave an aggregated lognormal limit 10% noisy.
PRECISE_REQUESTS = 2_400
Summary = dict[str, float | None]  # one tool's run at one rate (Outcome.summary)
RATES = [round(0.1 * 2 ** (k / 2), 3) for k in range(13)]  # 0.1 .. 6.4 req/s


def cases() -> list[Case]:
    phases: tuple[LibPhase, ...] = ("aggregated", "prefill")
    return [
        Case(MODEL, nodes, phase, SLO, 1024, 256, shape)
        for shape in (FIXED, CONVERSATION)
        for nodes in ((NODE,), (NODE, NODE))
        for phase in phases
    ]


def run_vidur(case: Case, req: Requests, scheduler: str, chunk: int, cap: int) -> Outcome | None:
    """Vidur on the requests (None when its environment is missing or it fails)."""
    if not VIDUR_PYTHON.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.csv"
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["arrival_s", "prompt_tokens", "output_tokens"])
            w.writerows(
                zip(req.arrival_s.tolist(), req.prompt.tolist(), req.output.tolist(), strict=True)
            )
        out = Path(tmp) / "out.json"
        cmd = [str(VIDUR_PYTHON), str(RUNNER), "simulate", "--requests", str(path),
               "--profiles", str(vidur_sim_dir()), "--pp", str(len(case.nodes)), "--tp", "2",
               "--scheduler", scheduler, "--chunk-size", str(chunk), "--batch-cap", str(cap),
               "--out", str(out)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
        if done.returncode != 0 or not out.exists():
            print(f"  vidur failed ({scheduler}): {done.stderr.strip()[-400:]}")
            return None
        rows = json.loads(out.read_text())["requests"]
    ttft = np.array([r["ttft_s"] if r["ttft_s"] is not None else math.inf for r in rows])
    tpot = np.array([r["tpot_s"] if r["tpot_s"] is not None else math.inf for r in rows])
    done_s = np.array(
        [r["completed_s"] if r["completed_s"] is not None else math.inf for r in rows]
    )
    return Outcome(ttft, tpot, done_s)


def _reusable(path: Path) -> dict[tuple[object, ...], dict[str, Summary]]:
    """Vidur's summaries of an earlier results.json, by (case, requests per run, chunk, batch
    cap, judged TTFT, rate), where it ran from the same seed."""
    out: dict[tuple[object, ...], dict[str, Summary]] = {}
    for row in json.loads(path.read_text()):
        if row.get("seed") != SEED:
            continue
        key = (row["case"], row.get("requests_per_run"), row["chunk"], row["batch_cap"],
               row["judged"]["ttft_ms"])  # fmt: skip
        for rate, tools in row["rates"].items():
            out[(*key, rate)] = {k: v for k, v in tools.items() if k.startswith("vidur-")}
    return out


def refine(
    attainment_at: Callable[[float], Summary | None],
    rates: list[float],
    target: float,
    steps: int = REFINE_STEPS,
) -> float:
    """Highest rate meeting the target for one tool: the grid's bracket (last meeting rate,
    first missing one) halved geometrically `steps` times, each half one more run, then
    interpolated inside the last bracket (`highest_on_grid`). A 1.41x grid read by
    interpolation alone misplaces a limit on a curved attainment curve by up to 12%; three
    halvings bring the bracket to 4.4%."""

    def share(rate: float) -> float | None:
        summary = attainment_at(rate)
        return None if summary is None else float(summary["attainment"] or 0.0)

    seen = [(r, a) for r in rates if (a := share(r)) is not None]
    if not seen:
        return 0.0
    lo_i = next((i for i, (_, a) in enumerate(seen) if a < target), len(seen))
    if 0 < lo_i < len(seen):
        lo, hi = seen[lo_i - 1][0], seen[lo_i][0]
        for _ in range(steps):
            mid = round(math.sqrt(lo * hi), 4)
            a = share(mid)
            if a is None:
                break
            seen.append((mid, a))
            lo, hi = (mid, hi) if a >= target else (lo, mid)
    seen.sort()
    return highest_on_grid([r for r, _ in seen], [a for _, a in seen], target)


def highest_on_grid(rates: list[float], attainment: list[float], target: float) -> float:
    """Highest rate meeting the target, interpolated between the grid's last meeting rate and
    the first missing one (geometrically); 0 when the lowest misses."""
    best = 0.0
    for i, (r, a) in enumerate(zip(rates, attainment, strict=True)):
        if a < target:
            if i == 0:
                return 0.0
            r0, a0 = rates[i - 1], attainment[i - 1]
            w = (a0 - target) / max(a0 - a, 1e-9)
            return round(float(r0 * (r / r0) ** w), 3)
        best = r
    return best


def bench_case(
    perf: PerfModel,
    case: Case,
    n: int,
    rates: list[float],
    tools: list[str],
    earlier: dict[tuple[object, ...], dict[str, Summary]],
    started: float,
) -> dict[str, object]:
    """One case: every tool on the grid's streams of `n` requests, each tool's limit refined
    around its bracket, and our limit on the other seeds' streams."""
    template = instance_template(perf, case)
    inst = InstanceModel.serving(perf, template, case.spec())
    chunk, cap = inst.max_batched_tokens, min(inst.max_running, 128)
    slo, target = case.judged
    grid: dict[str, dict[str, Summary]] = {}

    def run(tool: str, rate: float) -> Summary | None:
        """One tool's summary at one rate on the case's stream (already run, kept, or run now)."""
        key = str(rate)
        if tool in grid.get(key, {}):
            return grid[key][tool]
        req = requests(case, rate, n, seed=SEED)
        kept = earlier.get((case.label, n, chunk, cap, slo.prefill, key), {})
        if tool == "coral":
            summary = simulate_ours(perf, template, case, req).summary(req, slo)
        elif tool in kept:
            summary = kept[tool]
        else:
            v = run_vidur(case, req, tool.removeprefix("vidur-"), chunk, cap)
            if v is None:
                return None
            summary = v.summary(req, slo)
        grid.setdefault(key, {})[tool] = summary
        return summary

    def ours_on(seed: int, requests_per_run: int) -> Callable[[float], float]:
        return lambda rate: simulate_ours(
            perf, template, case, requests(case, rate, requests_per_run, seed=seed)
        ).attainment(slo)

    for rate in rates:
        done = {tool: s for tool in tools if (s := run(tool, rate)) is not None}
        print(f"{case.label} {rate:>6} req/s: "
              + ", ".join(f"{k} {x['attainment']:.2f}" for k, x in done.items()),
              f"({time.time() - started:.0f} s)", flush=True)  # fmt: skip

    def tool_at(tool: str) -> Callable[[float], Summary | None]:
        return lambda rate: run(tool, rate)

    highest = {tool: refine(tool_at(tool), rates, target) for tool in tools}

    def limit(seed: int, requests_per_run: int) -> float:
        return round(highest_rate(ours_on(seed, requests_per_run), target, rates[0], rates[-1],
                                  SEED_BISECTION_STEPS), 3)  # fmt: skip

    by_seed = {str(seed): limit(seed, n) for seed in OTHER_SEEDS}
    precise_n = max(n, PRECISE_REQUESTS)
    precise = (
        [highest["coral"], *by_seed.values()]
        if precise_n == n
        else [limit(seed, precise_n) for seed in (SEED, *OTHER_SEEDS)]
    )
    print(f"{case.label}: highest {highest}, ours by seed {by_seed}, on {precise_n}: {precise}",
          flush=True)  # fmt: skip
    return {
        "case": case.label, "template": template.key, "chunk": chunk, "batch_cap": cap,
        "requests_per_run": n, "seed": SEED, "kv_capacity_tokens": inst.kv_capacity,
        "plan_capacity_req_s": round(plan_capacity(perf, template, case), 3),
        "judged": {"ttft_ms": slo.prefill, "target": target},
        "rates": {k: grid[k] for k in sorted(grid, key=float)},
        "grid": [str(r) for r in rates],
        "highest_rate_req_s": highest, "coral_limit_by_seed": by_seed,
        "coral_precise": {"requests_per_run": precise_n, "limits": precise,
                          "median": round(float(np.median(precise)), 3)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "vidur")
    parser.add_argument(
        "--requests", type=int, default=600, help="Requests per run (aggregated cases)."
    )
    parser.add_argument(
        "--prefill-requests",
        type=int,
        default=PREFILL_REQUESTS,
        help="Requests per run of the prefill-only cases (cheap, and their limit needs many).",
    )
    parser.add_argument("--no-vidur", action="store_true", help="Only our side.")
    parser.add_argument("--every", type=int, default=1, help="Every k-th rate of the grid only.")
    parser.add_argument(
        "--reuse-vidur",
        type=Path,
        help="A results.json whose Vidur runs to keep where the requests, chunk and batch cap "
        "are the same (Vidur is deterministic on them): only our side runs again.",
    )
    args = parser.parse_args(argv)
    perf = load_perf_model()
    rates = RATES[:: args.every]
    earlier = _reusable(args.reuse_vidur) if args.reuse_vidur else {}
    results = []
    started = time.time()
    tools = ["coral"] + ([] if args.no_vidur else ["vidur-sarathi", "vidur-vllm"])
    for case in cases():
        n = args.prefill_requests if case.phase == "prefill" else args.requests
        results.append(bench_case(perf, case, n, rates, tools, earlier, started))
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "results.json", (json.dumps(results, indent=1) + "\n").encode())
    write_atomic(args.out / "table.md", render_table(results).encode())
    plot(results, args.out / "rates.png")
    print(f"wrote {args.out} in {time.time() - started:.0f} s")


def render_table(results: list[dict]) -> str:  # type: ignore[type-arg]
    lines = [
        "# Our latency model beside Vidur",
        "",
        "Llama-2-70B on A100-80GB, TP 2 per stage, SLO TTFT 1500 ms / TPOT 80 ms, target 90% of "
        "requests within both. Poisson arrivals, 1024-token prompts and 256-token outputs "
        '(fixed, or lognormal as our "Azure Conversation" shape); prefill-only cases end each '
        "request at its first token and are judged as the capacity model judges a prefill "
        "instance: its share of the target (93%) within the TTFT it leaves to decode (1270 ms). "
        "Written by `scripts/bench_vidur`.",
        "",
        "How a limit is read: every tool runs the same Poisson stream (seed 7) at each rate of a "
        "grid a factor of 1.41 apart; each tool's bracket around its limit is then halved three "
        "times (three more runs, to 4.4%) and the limit interpolated inside it. A rate at the "
        "top of the grid means the tool still meets the target there. Prefill-only runs take "
        "more requests, since their limit rests on the few long prompts near the budget. "
        "'ours on 3 more streams' is our simulator's limit on seeds 8-10: how far one stream's "
        "noise alone can move a limit. 'plan / simulate' divides the plan's capacity by "
        "'simulate, 4 streams': the median of our limits on four streams (seeds 7-10) of at "
        "least 2,400 requests each.",
        "",
        "## Highest rate meeting the SLOs (req/s)",
        "",
        "| case | template | chunk | batch cap | KV tokens | requests per run | judged | "
        "plan capacity | coral simulate | ours on 3 more streams | Vidur sarathi | Vidur vllm | "
        "simulate / Vidur | plan / Vidur | simulate, 4 streams | plan / simulate |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(a: object, b: object) -> str:
        ok = isinstance(a, float | int) and isinstance(b, float | int) and b > 0
        return f"{a / b:.2f}" if ok else "-"  # type: ignore[operator]

    for r in results:
        h = r["highest_rate_req_s"]
        plan, ours, vidur = r["plan_capacity_req_s"], h.get("coral"), h.get("vidur-sarathi")
        others = list(r.get("coral_limit_by_seed", {}).values())
        band = f"{min(others)}-{max(others)}" if others else "-"
        median = r.get("coral_precise", {}).get("median")
        judged = f"{r['judged']['target']:.0%} in {r['judged']['ttft_ms']:.0f} ms"
        lines.append(
            f"| {r['case']} | `{r['template']}` | {r['chunk']} | {r['batch_cap']} | "
            f"{r['kv_capacity_tokens']:,} | {r['requests_per_run']:,} | {judged} | {plan} | "
            f"{ours if ours is not None else '-'} | {band} | {vidur or '-'} | "
            f"{h.get('vidur-vllm', '-')} | {ratio(ours, vidur)} | {ratio(plan, vidur)} | "
            f"{median if median is not None else '-'} | {ratio(plan, median)} |"
        )
    lines += ["", "## Latency per rate (ms; p50 / p90)", ""]
    lines += ["| case | rate | tool | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | req/s | attainment |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        for rate, tools in r["rates"].items():
            for tool, s in tools.items():
                lines.append(
                    f"| {r['case']} | {rate} | {tool} | {s['ttft_p50_ms']} | {s['ttft_p90_ms']} | "
                    f"{s['tpot_p50_ms']} | {s['tpot_p90_ms']} | {s['throughput_req_s']} | "
                    f"{s['attainment']} |"
                )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:  # type: ignore[type-arg]
    # Deferred: matplotlib takes about half a second to import; only plots need it.
    import matplotlib

    matplotlib.use("Agg")
    # Deferred: matplotlib takes about half a second to import; only plots need it.
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharey=True)
    for ax, r in zip(axes.flat, results, strict=False):
        for tool, style in (("coral", "o-"), ("vidur-sarathi", "s--"), ("vidur-vllm", "^:")):
            xs = [float(k) for k, v in r["rates"].items() if tool in v]
            ys = [v[tool]["attainment"] for v in r["rates"].values() if tool in v]
            if xs:
                ax.plot(xs, ys, style, label=tool)
        ax.axvline(r["plan_capacity_req_s"], color="grey", lw=1, label="plan capacity")
        ax.axhline(r["judged"]["target"], color="red", lw=0.5)
        ax.set_xscale("log")
        ax.set_title(r["case"], fontsize=9)
        ax.set_xlabel("req/s")
    axes[0][0].set_ylabel("share within both SLOs")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    buf = path.with_suffix(".tmp.png")
    fig.savefig(buf, dpi=90, metadata={"Software": None})
    plt.close(fig)
    buf.replace(path)


if __name__ == "__main__":
    main()
