"""`scripts/stack_costs`: plan every committed stack and tabulate what each costs, how much of
its demand it serves and the SLO attainment it verifies, beside an earlier run of the same
table (`--before`), so a change to the models shows its price per stack.

Each stack is planned through the user's door (`coral plan --stack S --out ...`, its own
library cache); the plans are kept in the output folder (`plans/`), `costs.json` holds the
numbers, `costs.md` the table and `admission.md` each model's attainment behind the gateway's
admission control, at its demand and at 1.5x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from solver.io import write_atomic
from solver.plan_schema import Plan

ROOT = Path(__file__).resolve().parents[2]
# The CLI of the checkout in --root (another commit's work tree gives that commit's numbers,
# with this environment's packages): `python -c` runs with the working directory (the
# checkout) first on the import path, ahead of the installed package.
CLI = "from coral_iac.cli.app import app; app()"


def committed_stacks(root: Path = ROOT) -> list[str]:
    return sorted(p.name.removeprefix("Pulumi.").removesuffix(".yaml")
                  for p in (root / "stacks").glob("Pulumi.*.yaml"))  # fmt: skip


def summarise(plan: Plan, seconds: float) -> dict[str, object]:
    # What the plan claims per model (`ModelAttainment.judged`: the lower of its held-out
    # windows and the whole trace).
    verified = [a.judged for a in plan.attainment if a.judged is not None]
    short = [a.model for a in plan.attainment if a.judged is not None and a.judged < a.target]
    return {
        "usd_per_hour": round(plan.hourly_cost_usd, 2),
        "served_fraction": round(plan.served_fraction, 4),
        "instances": len(plan.instances),
        "worst_verified_attainment": round(min(verified), 4) if verified else None,
        "models_below_target": short,
        "plan_seconds": round(seconds, 1),
        # Per model: verified at the whole demand behind the gateway's admission control.
        "admission": {
            a.model: {
                "served": round(plan.fraction_of(a.model), 4),
                "target": a.target,
                "verified": a.judged,
                "held_out_lower": a.held_out_lower,
                "shed": a.shed,
                "spike": a.spike,
                "spike_shed": a.spike_shed,
                "slower": a.slower,
            }
            for a in plan.attainment
            if "@" not in a.model
        },
    }


def render_admission(results: dict[str, dict]) -> str:  # type: ignore[type-arg]
    """The admission table: per stack and model, what the plan serves, the admitted requests'
    attainment at the whole demand (with its held-out lower bound), the share shed, and the
    same at 1.5x the demand."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [
        "# Admission control per committed stack",
        "",
        "Written by `scripts/stack_costs` with the cost table beside it: each model's whole "
        "demand sent through the gateway's admission control (`solver/simulation/admission.py`) "
        "on its verification workload. `verified` is the admitted requests' share meeting both "
        "SLOs (for a trace, the lower of its held-out windows and the whole trace), with the "
        "one-sided 95% lower bound of the held-out estimate; `shed` the share answered 429; "
        "`1.5x` the same at 1.5x the demand; `steps 1.2x / 1.5x` the held-out share if every "
        "engine step took 1.2x and 1.5x as long as modelled (`ModelAttainment.slower`).",
        "",
        "| stack | model | served | target | verified (lower bound) | shed | 1.5x verified | "
        "1.5x shed | steps 1.2x / 1.5x |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stack, row in sorted(results.items()):
        for model, a in sorted(row.get("admission", {}).items()):
            slow = a.get("slower") or {}
            lines.append(
                f"| {stack} | {model} | {pct(a['served'])} | {pct(a['target'])} | "
                f"{pct(a['verified'])} ({pct(a['held_out_lower'])}) | {pct(a['shed'])} | "
                f"{pct(a['spike'])} | {pct(a['spike_shed'])} | "
                f"{pct(slow.get('1.2'))} / {pct(slow.get('1.5'))} |"
            )
    return "\n".join(lines) + "\n"


def render(after: dict[str, dict], before: dict[str, dict], label: str) -> str:  # type: ignore[type-arg]
    def cell(row: dict | None) -> str:  # type: ignore[type-arg]
        if row is None:
            return "-"
        text = f"{row['usd_per_hour']:.2f}"
        if row["served_fraction"] < 0.9995:
            text += f" (least served model {row['served_fraction']:.1%})"
        return text

    def attained(row: dict | None) -> str:  # type: ignore[type-arg]
        if row is None or row["worst_verified_attainment"] is None:
            return "-"
        below = (
            f", below: {', '.join(row['models_below_target'])}"
            if row["models_below_target"]
            else ""
        )
        return f"{row['worst_verified_attainment']:.1%}{below}"

    lines = [
        "# Cost per committed stack",
        "",
        f"Written by `scripts/stack_costs{label}`: every stack in `stacks/` planned with "
        "`coral plan --stack S`. $/h is the plan's provisioning cost; when the stack's budget or "
        "availability cannot cover all demand, the share of its demand the least served model "
        "gets follows it; "
        "attainment is the lowest verified share of requests within both SLOs over the stack's "
        "models (and which models miss their target).",
        "",
        "| stack | before $/h | after $/h | change | attainment before | attainment after |",
        "|---|---:|---:|---:|---|---|",
    ]
    for stack in sorted(set(after) | set(before)):
        a, b = after.get(stack), before.get(stack)
        change = "-"
        if a and b and b["usd_per_hour"]:
            change = f"{a['usd_per_hour'] / b['usd_per_hour'] - 1:+.0%}"
        lines.append(
            f"| {stack} | {cell(b)} | {cell(a)} | {change} | {attained(b)} | {attained(a)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "stack-costs")
    parser.add_argument("--before", type=Path, help="An earlier costs.json to compare with.")
    parser.add_argument("--stacks", nargs="*", help="Only these stacks (default: every one).")
    parser.add_argument("--latency-margin", type=float,
                        help="Plan every stack with `coral plan --margin` this factor.")  # fmt: skip
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="The checkout whose stacks and code to plan with (default: this one).")  # fmt: skip
    args = parser.parse_args(argv)
    root = args.root.resolve()
    stacks = args.stacks or committed_stacks(root)
    before = json.loads(args.before.read_text())["stacks"] if args.before else {}
    (args.out / "plans").mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}  # type: ignore[type-arg]
    margin = ["--margin", str(args.latency_margin)] if args.latency_margin else []
    for i, stack in enumerate(stacks, 1):
        started = time.perf_counter()
        path = args.out / "plans" / f"{stack}.json"
        run = subprocess.run(  # noqa: S603 (our own CLI, fixed arguments)
            [sys.executable, "-c", CLI, "plan", "--stack", stack, "--out", str(path.resolve()),
             *margin],
            cwd=root, capture_output=True, text=True, check=False,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        if run.returncode != 0:
            print(
                f"{stack}: coral plan failed ({run.returncode})\n{run.stderr[-2000:]}",
                file=sys.stderr,
            )
            return 1
        results[stack] = summarise(Plan.model_validate_json(path.read_text()), seconds)
        print(f"[{i}/{len(stacks)}] {stack}: {results[stack]['usd_per_hour']} $/h "
              f"({seconds:.0f} s)", flush=True)  # fmt: skip
    label = f" --before {args.before}" if args.before else ""
    label += f" --latency-margin {args.latency_margin:g}" if args.latency_margin else ""
    write_atomic(
        args.out / "costs.json", (json.dumps({"stacks": results}, indent=1) + "\n").encode()
    )
    write_atomic(args.out / "costs.md", render(results, before, label).encode())
    write_atomic(args.out / "admission.md", render_admission(results).encode())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
