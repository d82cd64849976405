"""Measure every model card, both phases, in one process within a deadline (scripts/profile_gpu).

One process so torch and CUDA start once. Each (model, phase) gets an equal share of the time
left, as `run_grid`'s budget (it stops starting larger sizes once spent); a (model, phase) that
fails is recorded and the rest go on. `summary.json` in the output folder lists what ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from solver.catalog.model_cards import load_model_cards
from solver.errors import CoralError
from solver.performance.profiler.command import run_measure
from solver.performance.profiler.measure import DEFAULT_CONTEXT, MeasureSpec
from solver.types import Phase

# Grids sized for about 25 s per (model, phase) on one H200: 9 decode batches, 8 prefill sizes.
FULL = {
    "decode": (1, 2, 4, 8, 16, 32, 64, 128, 256),
    "prefill": (128, 256, 512, 1024, 2048, 4096, 8192, 16384),
}
SMOKE = {"decode": (1, 4), "prefill": (16, 64)}
PHASES: tuple[Phase, ...] = ("decode", "prefill")


@dataclass(frozen=True)
class RunResult:
    model: str
    phase: str
    status: str  # "ok", "failed" or "skipped"
    seconds: float
    csv: str | None = None
    detail: str = ""


def run_suite(
    out_dir: Path, deadline_s: float, smoke: bool, models: list[str] | None, tp: int
) -> list[RunResult]:
    """Every (model, phase) in turn; returns one result each, also written to summary.json."""
    names = models or sorted(load_model_cards())
    jobs = [(m, ph) for m in names for ph in PHASES]
    start, results = time.monotonic(), []
    for i, (model, phase) in enumerate(jobs):
        left = deadline_s - (time.monotonic() - start)
        if left <= 0:
            results.append(RunResult(model, phase, "skipped", 0.0, detail="deadline reached"))
            continue
        results.append(_one(out_dir, model, phase, smoke, tp, left / (len(jobs) - i)))
        r = results[-1]
        print(f"[{i + 1}/{len(jobs)}] {model} {phase}: {r.status}, {r.seconds:.1f} s {r.detail}")
    summary = {
        "device": _device(),
        "deadline_s": deadline_s,
        "smoke": smoke,
        "runs": [asdict(r) for r in results],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return results


def _one(
    out_dir: Path, model: str, phase: Phase, smoke: bool, tp: int, budget_s: float
) -> RunResult:
    grids = SMOKE if smoke else FULL
    spec = MeasureSpec(
        model=model,
        phase=phase,
        sizes=grids[phase],
        context=32 if smoke else DEFAULT_CONTEXT,
        device="cpu" if smoke else "auto",
        warmup=1 if smoke else 3,
        repeats=2 if smoke else 10,
        tp=tp,
        budget_s=budget_s * 0.8,  # the last size started may overrun
        command=" ".join(["python -m solver.performance.profiler.suite", *sys.argv[1:]]),
    )
    t0 = time.monotonic()
    try:
        path, record = run_measure(spec, out_dir, tiny=smoke)
    except (CoralError, RuntimeError, ValueError) as exc:  # one failure must not stop the rest
        first_line = str(exc).splitlines()[0]
        return RunResult(model, phase, "failed", time.monotonic() - t0, detail=first_line)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    note = f"({len(record.points)} sizes{'; ' + '; '.join(record.notes) if record.notes else ''})"
    return RunResult(model, phase, "ok", time.monotonic() - t0, str(path), note)


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="Folder for tables and summary.")
    parser.add_argument("--deadline-s", type=float, default=420, help="Whole-suite time limit.")
    parser.add_argument("--smoke", action="store_true", help="Tiny layers on the CPU, tiny grids.")
    parser.add_argument("--model", action="append", help="Only these models (repeatable).")
    parser.add_argument("--tp", type=int, default=1, help="Tensor-parallel degree.")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_suite(args.out, args.deadline_s, args.smoke, args.model, args.tp)
    ok = sum(r.status == "ok" for r in results)
    print(f"{ok} of {len(results)} (model, phase) measured; tables in {args.out}")
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
