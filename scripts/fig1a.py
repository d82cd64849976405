"""Fig. 1a of the paper, on our performance model: the best mixed-GPU serving template against the
best single-GPU-type one, in tokens/s per $/hour, for one (model, phase) of a stack.

Two price sets: the stack's catalog prices (cheapest region selling every node), and the paper's
Table 1 relative GPU-hour prices (H100 7.6, A100 3.5, L40S 2.2, A10G 1.2, L4 1.0), scaled to the
catalog's cheapest L4 GPU-hour and linear in GPU count. Builds only that job's library.

Usage: .venv/bin/python scripts/fig1a.py [--stack paper-extended] [--model qwen3-235b-a22b]
           [--phase prefill] [--mode vllm|general] [--workers 2]   (prints JSON)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from solver.catalog.market import build_market
from solver.performance.default_model import load_perf_model
from solver.stack import load_stack
from solver.templates.library import build_libraries
from solver.templates.serving_template import ServingTemplate

ROOT = Path(__file__).resolve().parents[1]
# Paper Table 1: GPU-hour price relative to L4 (Mei et al., arXiv 2605.04357).
PAPER_RELATIVE = {"h100": 7.6, "a100-80gb": 3.5, "a100-40gb": 3.5, "l40s": 2.2, "a10g": 1.2, "l4": 1.0}


def best(rows: list[tuple[ServingTemplate, float]], mixed: bool) -> dict[str, object] | None:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", default="paper-extended")
    ap.add_argument("--model", default="qwen3-235b-a22b")
    ap.add_argument("--phase", default="prefill")
    ap.add_argument("--mode", default=None)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    fleet = load_stack(ROOT / "stacks", args.stack)
    fleet = fleet if args.mode is None else fleet.with_mode(args.mode)
    perf = load_perf_model()
    (lib,) = build_libraries(perf, fleet, [(args.model, args.phase)], workers=args.workers)
    market = build_market(fleet, perf.catalog)
    l4_gpu_hour = min(p for (r, n), p in market.price.items() if n == "l4x1")
    catalog_rows, paper_rows = [], []
    for t in lib.templates:
        prices = [p for r in market.regions if (p := market.template_price(r, t.nodes))]
        if prices:
            catalog_rows.append((t, min(prices)))
        gpus = [market.gpu_of[n] for n in t.nodes]
        if all(g in PAPER_RELATIVE for g, _ in gpus):
            paper_rows.append((t, sum(PAPER_RELATIVE[g] * k * l4_gpu_hour for g, k in gpus)))
    out: dict[str, object] = {"stack": args.stack, "model": args.model, "phase": args.phase,
                              "mode": fleet.library.mode, "slo_ms": lib.slo_ms}  # fmt: skip
    for name, rows in (("catalog", catalog_rows), ("paper_table1", paper_rows)):
        mixed, homo = best(rows, True), best(rows, False)
        ratio = None
        if mixed and homo:
            ratio = round(
                float(mixed["tokens_per_s_per_usd_hour"]) / float(homo["tokens_per_s_per_usd_hour"]), 4
            )
        out[name] = {"best_mixed": mixed, "best_single_type": homo, "mixed_over_single": ratio}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
