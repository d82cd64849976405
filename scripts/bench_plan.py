"""Wall time of `coral plan` per committed stack, split by phase, through the user's door.

Each run is `coral plan --stack S --json` in a fresh process, library already built (a first,
untimed run builds it); the phases are the ones `coral plan --json` reports under "timings"
(solver/timing.py). Medians over --repeats runs, written as a Markdown table and as JSON.
`--cold` adds one first plan per stack into an empty library folder (the library built on the
way), the time a new user waits once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench_attainment import REPO, committed, plan

from solver.timing import PHASES


def bench(stack: str, repeats: int, cold: bool) -> dict:
    library = REPO / ".coral" / "library" / stack
    row: dict = {"stack": stack}
    if cold:
        with tempfile.TemporaryDirectory() as empty:
            _, row["first_plan_s"] = plan(stack, library=Path(empty))
    if not any(library.glob("*.json")):
        plan(stack, library=library)  # builds the library; not timed
    runs = []
    for i in range(repeats):
        result, wall = plan(stack, library=library)
        runs.append((wall, result["timings"]))
        print(f"  {stack} run {i + 1}/{repeats}: {wall:.1f} s", file=sys.stderr, flush=True)
    row["wall_s"] = round(statistics.median(w for w, _ in runs), 2)
    row["phases_s"] = {
        name: round(statistics.median(t.get(name, 0.0) for _, t in runs), 2) for name in PHASES
    }
    row["usd_per_hour"] = result["hourly_cost_usd"]
    row["gap"] = result["solver"]["gap"]
    return row


def markdown(rows: list[dict], repeats: int) -> str:
    cold = any("first_plan_s" in r for r in rows)
    head = ["stack", "wall s", *PHASES, "$/hour"] + (["first plan s"] if cold else [])
    lines = [
        f"Median of {repeats} warm runs of `coral plan --stack S --json` (library built), "
        "seconds per phase; written by `scripts/bench_plan`."
        + (" First plan: one run into an empty library folder." if cold else ""),
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for r in rows:
        cells = [r["stack"], f"{r['wall_s']:.1f}"]
        cells += [f"{r['phases_s'][p]:.1f}" for p in PHASES]
        cells.append(f"{r['usd_per_hour']:,.2f}")
        if cold:
            cells.append(f"{r.get('first_plan_s', float('nan')):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="append", help="a stack (default: every committed one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="also time a first plan per stack")
    parser.add_argument("--out", type=Path, help="write NAME.md and NAME.json here (a folder)")
    args = parser.parse_args()
    rows = []
    for stack in args.stack or committed():
        rows.append(bench(stack, args.repeats, args.cold))
    table = markdown(rows, args.repeats)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan-times.md").write_text(table)
        (args.out / "plan-times.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
