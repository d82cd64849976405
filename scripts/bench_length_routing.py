"""What length-aware routing decides and saves: a stack's routed models planned as one pool and as
length buckets (solver/plan/length_routing.py) at several multiples of their demand.

Per (stack, demand scale, routed model): one pool's $/hour and verified attainment, the buckets'
$/hour and verified attainment, the saving, what the planner chose, and the planning wall time
(the one-pool plan, the bucket plans and the final one, all closed loops with verification).
Every model of the stack is scaled alike. Prints a Markdown table; `--json FILE` writes the rows.

Usage: scripts/bench_length_routing [--stack prod] [--scale 0.5 --scale 1 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from coral_iac.demand_sources import resolve_demand
from solver.performance.default_model import load_perf_model
from solver.plan.planner import plan_with_library
from solver.stack import Demand, FleetConfig, PhaseTokens, load_stack

REPO = Path(__file__).resolve().parents[1]


def scaled(fleet: FleetConfig, k: float) -> FleetConfig:
    """Every model's demand times k."""
    models = {}
    for name, spec in fleet.models.items():
        d = spec.demand
        if d is not None and d.requests_per_s is not None:
            d = Demand(requests_per_s=d.requests_per_s * k)
        elif d is not None and d.tokens_per_s is not None:
            t = d.tokens_per_s
            d = Demand(tokens_per_s=PhaseTokens(prefill=t.prefill * k, decode=t.decode * k))
        models[name] = spec.model_copy(update={"demand": d})
    return fleet.model_copy(update={"models": models})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", action="append", help="default: prod and staging")
    parser.add_argument("--scale", action="append", type=float, help="default: 0.5 1 2 3")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    perf = load_perf_model()
    rows = []
    for stack in args.stack or ["prod", "staging"]:
        base = resolve_demand(load_stack(REPO / "stacks", stack), stack, REPO / "stacks", warn=print)
        for k in args.scale or [0.5, 1.0, 2.0, 3.0]:
            t = time.perf_counter()
            library = REPO / ".coral" / "library" / stack
            plan = plan_with_library(stack, scaled(base, k), perf, library, root=REPO)
            seconds = time.perf_counter() - t
            for d in plan.routing:
                one, routed = d.one_pool_usd_per_hour or 0.0, d.routed_usd_per_hour or 0.0
                rows.append(
                    {
                        "stack": stack,
                        "scale": k,
                        "model": d.model,
                        "one_pool_usd_per_hour": one,
                        "one_pool_verified": d.one_pool_verified,
                        "buckets_usd_per_hour": routed,
                        "buckets_verified": d.routed_verified,
                        "saving": (one - routed) / one if one else 0.0,
                        "routed": d.routed,
                        "reason": d.reason,
                        "plan_usd_per_hour": plan.hourly_cost_usd,
                        "plan_seconds": round(seconds, 1),
                        "buckets": [
                            (b.max_prompt_tokens, round(b.share, 3), b.target) for b in d.buckets
                        ],
                    }
                )
            print(f"{stack} x{k:g}: {seconds:.1f} s", flush=True)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    print(
        "\n| stack | demand | model | one pool $/h (verified) | buckets $/h (verified) | saving "
        "| chosen | plan $/h | coral plan s |"
    )
    print("|---|---:|---|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['stack']} | x{r['scale']:g} | {r['model']} | {r['one_pool_usd_per_hour']:.2f} "
            f"({pct(r['one_pool_verified'])}) | {r['buckets_usd_per_hour']:.2f} "
            f"({pct(r['buckets_verified'])}) | {100 * r['saving']:+.1f}% | "
            f"{'buckets' if r['routed'] else 'one pool'} | {r['plan_usd_per_hour']:.2f} | "
            f"{r['plan_seconds']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
