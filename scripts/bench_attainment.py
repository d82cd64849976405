"""Benchmark SLO attainment through the user's door: `coral plan --stack S --json` per stack.

Per stack: wall time of `coral plan` (median of --repeats; the closed loop and the verification
included), $/hour, and per model the target, the attainment on the planning workload (the
planner's prediction) and on the verification workload (another seed or trace window), with
their difference. Then the cost of meeting 0.9, 0.95 and 0.99 on one stack (--targets-stack).
Prints Markdown tables (docs/slo-attainment.md carries a run of them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CORAL = REPO / ".venv" / "bin" / "coral"


def committed() -> list[str]:
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in (REPO / "stacks").glob("*.yaml"))


def plan(stack: str, cwd: Path = REPO, library: Path | None = None) -> tuple[dict, float]:
    """`coral plan --stack S --json` (libraries in `library`, default the repository's
    .coral/library/S): the plan and the command's wall seconds."""
    library = library or REPO / ".coral" / "library" / stack
    t = time.perf_counter()
    r = subprocess.run(
        [str(CORAL), "plan", "--stack", stack, "--json", "--library", str(library)],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t
    if r.returncode not in (0, 3):
        sys.exit(f"coral plan --stack {stack} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout), wall


def stack_rows(stacks: list[str], repeats: int) -> None:
    print("| stack | coral plan s (median) | $/hour | model | target | planned | verified | diff | minutes |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for stack in stacks:
        walls, p = [], {}
        for _ in range(repeats):
            p, wall = plan(stack)
            walls.append(wall)
        for i, a in enumerate(p.get("attainment", [])):
            diff = (
                f"{100 * (a['verified'] - a['planned']):+.1f}"
                if a["verified"] is not None and a["planned"] is not None
                else "-"
            )
            lead = (
                f"| {stack} | {statistics.median(walls):.1f} | {p['hourly_cost_usd']:.2f} "
                if i == 0
                else "| | | "
            )
            print(
                f"{lead}| {a['model']} | {a['target']:.2f} | {pct(a['planned'])} | "
                f"{pct(a['verified'])} | {diff} | {a['verified_minutes']:g} |",
                flush=True,
            )


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def target_rows(stack: str, targets: list[float]) -> None:
    """The same stack planned at each attainment target (every model), in a scratch project."""
    print(f"\n| {stack}: target | $/hour | verified (worst model) |")
    print("|---:|---:|---:|")
    doc = yaml.safe_load((REPO / "stacks" / f"Pulumi.{stack}.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "stacks").mkdir()
        (root / "Pulumi.yaml").write_text((REPO / "Pulumi.yaml").read_text())
        for t in targets:
            for spec in doc["config"]["coral:fleet"]["models"].values():
                spec["slo_attainment"] = t
            (root / "stacks" / f"Pulumi.{stack}.yaml").write_text(yaml.safe_dump(doc))
            p, _ = plan(stack, cwd=root)
            worst = min((a["verified"] for a in p["attainment"] if a["verified"] is not None), default=None)
            print(f"| {t:.2f} | {p['hourly_cost_usd']:.2f} | {pct(worst)} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", action="append", help="default: every committed stack")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--targets-stack", default="paper-core")
    ap.add_argument("--targets", default="0.9,0.95,0.99")
    args = ap.parse_args()
    stack_rows(args.stack or committed(), args.repeats)
    if args.targets_stack:
        target_rows(args.targets_stack, [float(x) for x in args.targets.split(",")])


if __name__ == "__main__":
    main()
