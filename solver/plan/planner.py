"""From a stack to a plan: demand per (model, phase), libraries, allocation, the plan file.

`plan_with_library` is what `coral plan` and the Pulumi program run: libraries from a folder
(built, or rebuilt when stale, there when asked), then the plan to the models' SLO attainment
targets (`solver.plan.attainment`: capacity model, closed loop, verification; length buckets
through `solver.plan.length_routing`), validated. `plan_stack` is one allocation: Coral's or a
baseline's (`solver/allocation/baselines.py`), assembled into a `Plan`.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from solver import timing
from solver.allocation.baselines import homo_solution, priorities
from solver.allocation.paper_baselines import paper_baseline
from solver.allocation.problem import (
    Column,
    Problem,
    Solution,
    SpotRules,
    make_columns,
    priority_tiers,
)
from solver.allocation.solve import solve_allocation
from solver.catalog.market import Market, build_market, region_name
from solver.catalog.offers import Catalog, split_node_id
from solver.errors import CoralError, InputError, StaleLibraryError
from solver.io import digest
from solver.performance.perf_model import PerfModel
from solver.plan.attainment import Simulations, base_factors, plan_to_target, with_slowdowns
from solver.plan.demand import capacity_needed, stack_demand
from solver.plan.length_routing import plan_routed
from solver.plan.validator import validate_plan
from solver.plan_schema import Instance, JobResult, Method, Plan, instance_key, template_ref
from solver.serving.executors import started_in_processes
from solver.serving.library import (
    Library,
    build_libraries,
    library_owner,
    load_library,
    save_library,
)
from solver.serving.serving_template import ServingTemplate
from solver.stack import FleetConfig
from solver.timing import RESTRICTED_WAIT
from solver.types import Job


@timing.phase("library")
def libraries_for(
    perf: PerfModel,
    fleet: FleetConfig,
    jobs: list[Job],
    directory: Path,
    build_missing: bool = True,
    workers: int = 2,
    progress: Callable[[Job, int, int], None] | None = None,
    rebuild_stale: bool = True,
    stack: str | None = None,
    force: bool = False,
) -> dict[Job, Library]:
    """Load each job's library from `directory`; build missing ones, and stale ones when asked
    (`stack`: recorded as the folder's owner; a folder another stack owns is never written to
    unless `force`).

    Raises:
        InputError: a library is missing and `build_missing` is False.
        StaleLibraryError: a library is stale and `rebuild_stale` is False (it names the
            changed inputs).
    """
    scope = fleet.library_scope()
    libs: dict[Job, Library] = {}
    todo: list[Job] = []
    for job in jobs:
        try:
            libs[job] = load_library(directory, perf, scope, *job)
        except StaleLibraryError:
            if not rebuild_stale:
                raise
            todo.append(job)
        except InputError:  # missing
            if not build_missing:
                raise
            todo.append(job)
    if todo:
        _check_owner(directory, stack, force)
        # Each library is saved as soon as it is built: a build stopped half-way resumes from
        # the (model, phase) libraries it finished.
        for lib in build_libraries(
            perf,
            scope,
            todo,
            workers,
            progress,
            on_built=lambda b: save_library(b, directory, stack),
        ):
            libs[(lib.model, lib.phase)] = lib
    return libs


def _check_owner(directory: Path, stack: str | None, force: bool) -> None:
    """Refuse to build into a library folder that another stack owns (its OWNER file).

    Raises:
        InputError: naming the folder, its owner and the fix.
    """
    owner = (library_owner(directory) or {}).get("stack")
    if stack is None or owner in (None, stack) or force:
        return
    raise InputError(
        "--library",
        f"{directory} holds the template libraries of stack '{owner}', not '{stack}'; building "
        "here would overwrite them",
        f"drop --library (the default is .coral/library/{stack}), or pass --force to take the "
        "folder over",
    )


def plan_from_solution(
    stack: str,
    method: Method,
    fleet: FleetConfig,
    market: Market,
    demand: dict[Job, float],
    columns: list[Column],
    solution: Solution,
    libs: dict[Job, Library],
    factors: dict[str, float] | None = None,
) -> Plan:
    """Assemble a plan: stable instance keys, costs per model and phase, demand vs supply.

    Columns carry each template's capacity at the SLO target (`factors` x its library
    throughput); the plan records the library's template and the factor.
    """
    instances: list[Instance] = []
    templates = {}
    used_factors: dict[str, float] = {}
    originals = {
        template_ref(m, ph, t.key): t for (m, ph), lib in libs.items() for t in lib.templates
    }
    k = fleet.allocation.startup_penalty_k
    penalty = 0.0
    for i in sorted(solution.counts, key=lambda i: columns[i].running_key):
        c, n = columns[i], solution.counts[i]
        (cloud, region), (model, phase) = c.region, c.job
        ref = template_ref(model, phase, c.template.key)
        templates[ref] = originals.get(ref, c.template)
        if factors is not None:
            used_factors[ref] = factors[ref]
        for idx in range(n):
            instances.append(
                Instance(
                    key=instance_key(model, phase, cloud, region, c.template.key, idx, c.zone),
                    model=model,
                    phase=c.template.phase,
                    cloud=cloud,
                    region=region,
                    template=c.template.key,
                    index=idx,
                    nodes=c.template.nodes,
                    usd_per_hour=round(c.price, 6),
                    throughput=c.template.throughput,
                    market="spot" if c.is_spot else "on-demand",
                    zone=c.zone,
                )
            )
    cost_by_model: dict[str, dict[str, float]] = {}
    jobs = []
    for job, d in sorted(demand.items()):
        mine = [x for x in instances if (x.model, x.phase) == job]
        usd = sum(x.usd_per_hour for x in mine)
        cost_by_model.setdefault(job[0], {})[job[1]] = round(usd, 4)
        jobs.append(
            JobResult(
                model=job[0],
                phase=job[1],
                unit="requests/s" if job[1] == "aggregated" else "tokens/s",
                demand=round(d, 6),
                throughput=round(sum(x.throughput for x in mine), 6),
                usd_per_hour=round(usd, 4),
                instances=len(mine),
            )
        )
    spot_on = fleet.allocation.spot.enabled
    if solution.report is not None:
        penalty = max(0.0, solution.report.objective - sum(x.usd_per_hour for x in instances))
    elif k:
        penalty = k * sum(x.usd_per_hour for x in instances)
    return Plan(
        stack=stack,
        method=method,
        mode=fleet.library.mode,
        served_fraction=solution.fraction,
        served_fractions={m: round(f, 4) for m, f in sorted(solution.fractions.items())},
        hourly_cost_usd=round(sum(x.usd_per_hour for x in instances), 4),
        startup_penalty_usd_per_hour=round(penalty, 4),
        cost_by_model=cost_by_model,
        jobs=jobs,
        instances=instances,
        templates=templates,
        binding=solution.binding,
        solver=solution.report,
        input_hashes={
            "libraries": digest({f"{m}/{p}": lib.input_hashes for (m, p), lib in libs.items()}),
            "market": digest(
                [
                    market.as_rows(),
                    sorted((f"{r}/{g}", n) for (r, g), n in market.gpu_pools.items()),
                    *([_spot_rows(market)] if spot_on else []),
                ]
            ),
            "demand": digest(sorted(demand.items())),
            # Spot settings count only when spot is on: other plans hash as before spot was.
            "allocation": digest(
                fleet.allocation.model_dump(exclude=None if spot_on else {"spot"})
            ),
        },
        capacity_factors=used_factors,
    )


def _spot_rows(market: Market) -> list[tuple[str, str, float, list[str], float, float]]:
    """(region, node config, spot $/hour, zones, preemptions/hour, zone correlation) per slot."""
    return [
        (region_name(r), n, t.usd_per_hour, list(t.zones), t.preemption.rate_per_hour,
         t.preemption.zone_correlation)
        for (r, n), t in sorted(market.spot.items())
    ]  # fmt: skip


# (id of a library template, factor) -> (that template, kept alive so its id stays its own;
# the scaled copy)
_SCALED: dict[tuple[int, float], tuple[ServingTemplate, ServingTemplate]] = {}


def at_capacity(t: ServingTemplate, factor: float) -> ServingTemplate:
    """The template with its throughput times `factor` (cached: the closed loop re-plans with
    mostly the same factors, and a pydantic copy of 20,000 templates per round adds up)."""
    key = (id(t), factor)
    hit = _SCALED.get(key)
    if hit is None:
        if len(_SCALED) > 500_000:
            _SCALED.clear()
        hit = _SCALED[key] = (t, t.model_copy(update={"throughput": t.throughput * factor}))
    return hit[1]


@timing.phase("ILP")
def plan_stack(
    stack: str,
    fleet: FleetConfig,
    catalog: Catalog,
    libs: dict[Job, Library],
    previous: Plan | None = None,
    method: Method = "coral",
    factors: dict[str, float] | None = None,
    restriction: Restriction | None = None,
) -> Plan:
    """Solve the allocation for a stack (or run a baseline) and assemble the plan.

    `factors` (template ref -> capacity at the SLO target / throughput, from
    `solver.plan.attainment`) scale each template's throughput; a template with factor 0 is
    not offered. None: every template at its library throughput (the paper's formulation).
    `restriction`: offer only the templates it keeps (`RESTRICTIONS`).
    """
    demand = stack_demand(fleet.models)
    market = build_market(fleet.market_scope(), catalog)
    templates = {job: lib.templates for job, lib in libs.items()}
    if method == "cauchy":  # Cauchy-like: Coral's ILP over single-config templates
        restriction = "single config"
    kept = _kept_templates(restriction)
    if kept is not None:
        keeps = RESTRICTIONS[kept]
        templates = {job: [t for t in ts if keeps(t)] for job, ts in templates.items()}
    if factors is not None:
        templates = {
            job: [at_capacity(t, f) for t in ts if (f := factors[template_ref(*job, t.key)]) > 0]
            for job, ts in templates.items()
        }
    # Spot columns for Coral's ILP only: the baselines rent on-demand, as their papers do.
    spot = fleet.allocation.spot
    rules = (
        SpotRules(spot, fleet.allocation.boot_minutes / 60)
        if spot.enabled and method in ("coral", "cauchy") and restriction not in ON_DEMAND
        else None
    )
    columns = make_columns(templates, market, demand, rules)
    # Capacity to buy: demand over the target utilization (headroom for queueing).
    needed = capacity_needed(fleet.allocation, demand)
    if method in ("homo-paper", "cauchy-paper"):
        columns, solution = paper_baseline(
            method, fleet.models, fleet.allocation, market, needed, columns
        )
    elif method == "homo":
        solution = homo_solution(fleet.models, fleet.allocation, market, needed, columns)
    else:
        running = previous.counts() if previous is not None else {}
        problem = Problem(
            needed, columns, market, fleet.allocation, running, priorities(fleet.models)
        )
        solution = solve_allocation(problem)
    return plan_from_solution(
        stack, method, fleet, market, demand, columns, solution, libs, factors
    )


Restriction = Literal[
    "one GPU type",
    "single config",
    "on-demand",
    "one GPU type, on-demand",
    "single config, on-demand",
]
# Restrictions of Coral's template space that its closed loop also searches (`plan_to_targets`),
# widest first. "single config" is Cauchy's space (one node config per template), so Coral's
# plan is never dearer than Cauchy's at the same targets; "one GPU type" is what
# `library.mixing: false` builds.
RESTRICTIONS: dict[Restriction, Callable[[ServingTemplate], bool]] = {
    "one GPU type": lambda t: len({split_node_id(n)[0] for n in t.nodes}) == 1,
    "single config": lambda t: len(set(t.nodes)) == 1,
}
# With spot allowed, the closed loop first runs its searches on on-demand capacity alone (no
# spot column), the same searches it runs without spot, and then again with spot columns
# (`plan_to_targets`). Running only the mixed search on-demand was not enough: on
# paper-core-scarce the loop with spot ended serving 77% of demand where the loop without it
# served 84%, the better plan coming from its single-config search. Each names the template
# restriction it keeps (None: every template).
ON_DEMAND: dict[Restriction, Restriction | None] = {
    "on-demand": None,
    "one GPU type, on-demand": "one GPU type",
    "single config, on-demand": "single config",
}


def _kept_templates(restriction: Restriction | None) -> Restriction | None:
    """The template restriction a search keeps (None: every template)."""
    return ON_DEMAND[restriction] if restriction in ON_DEMAND else restriction


def _on_demand_twin(restriction: Restriction | None) -> Restriction:
    """The search over the same templates on on-demand capacity alone."""
    return next(r for r, kept in ON_DEMAND.items() if kept == restriction)


def _name(restriction: Restriction | None) -> str:
    """A search's name in progress lines and `closed_loop_stop`."""
    return "mixed" if restriction is None else restriction


def plan_to_targets(
    stack: str,
    fleet: FleetConfig,
    perf: PerfModel,
    libs: dict[Job, Library],
    previous: Plan | None = None,
    method: Method = "coral",
    root: Path | None = None,
    on_round: Callable[[str], None] | None = None,
    cache: Path | None = None,
    simulations: Simulations | None = None,
    workers: int = 1,
    on_solve: OnSolve | None = None,
) -> Plan:
    """The method planned to the models' SLO attainment targets (the closed loop and the
    verification, `attainment.plan_to_target`). For Coral the loop also runs over each of
    `RESTRICTIONS` that offers other templates than the searches before it, and the best plan
    is kept (`best_at_target`).

    `workers`: processes for the capacity model of templates not cached; above 1, the
    restricted searches also run in up to `workers` forked processes while this one runs the
    mixed search (the same plans as one after the other: each search depends only on its
    inputs). The searches reuse each other's simulations (a worker's come back when it ends),
    and the caller's, given `simulations`. `on_solve(plan, factors)`: called for every
    allocation the searches solve, in search order. `on_round`: the capacity model's progress
    (a line per tenth of the templates it models, from PROGRESS_TEMPLATES) and a line per
    closed-loop round."""
    if on_round:  # minutes on a large stack the first time (the factors are cached after)
        count = sum(len(lib.templates) for lib in libs.values())
        on_round(f"capacity model: the SLO capacity of {count:,} templates")
    with timing.phase("capacity model"):  # once, for every search
        base = base_factors(fleet.models, perf, libs, root, cache, workers, _tenths(on_round))
    sims = simulations if simulations is not None else Simulations(perf, root)
    searches = _Searches(stack, fleet, perf, libs, previous, root, base, sims)
    # The closed loop is a search over whole instances, and its path depends on where it
    # starts: on staging it ended at 17.88 $/h where the same loop over single-config
    # templates ended at 12.85, and on prod at 42.34 where the loop over one-GPU-type templates
    # ended at 40.48, at the same targets. Every plan of a restricted search is a Coral plan,
    # so Coral keeps the best.
    restrictions = _restrictions(libs) if method == "coral" and fleet.attainment.rounds else []
    searched: list[Restriction | None] = [None, *restrictions]
    if method == "coral" and fleet.allocation.spot.enabled:
        # The searches the loop runs with spot off come first, on-demand, and a search with
        # spot columns replaces their best only by `best_at_target`'s rule: allowing spot never
        # ends at a plan that serves less or meets fewer targets than not allowing it.
        searched = [*(_on_demand_twin(r) for r in searched), *searched]
    first, *rest = searched
    if not rest:
        return searches.run(method, first, on_round, on_solve)
    if workers > 1:
        found = _in_parallel(searches, first, rest, workers, on_round, on_solve)
    else:
        found = [(_name(first), searches.run(method, first, on_round, on_solve))]
        for restriction in rest:
            said = _said(on_round, _name(restriction))
            plan = searches.restricted(restriction, said, on_solve)
            if plan is not None:
                found.append((_name(restriction), plan))
    return best_at_target(found, priorities(fleet.models))


OnSolve = Callable[[Plan, dict[str, float]], None]


PROGRESS_TEMPLATES = 2_000  # fewer templates to model take a second or two: no progress lines


def _tenths(on_round: Callable[[str], None] | None) -> Callable[[int, int], None] | None:
    """The capacity model's progress as a line per tenth of the templates it models."""
    if on_round is None:
        return None
    said = [0]

    def progress(done: int, total: int) -> None:
        tenth = 10 * done // max(1, total)
        if total >= PROGRESS_TEMPLATES and tenth > said[0]:
            said[0] = tenth
            on_round(f"capacity model: {done:,} of {total:,} templates modelled ({tenth}0%)")

    return progress


@dataclass(frozen=True)
class _Searches:
    """What every closed-loop search of one `plan_to_targets` shares (forked search workers
    read it from `_IN_WORKERS`)."""

    stack: str
    fleet: FleetConfig
    perf: PerfModel
    libs: dict[Job, Library]
    previous: Plan | None
    root: Path | None
    base: dict[str, float]  # the capacity model's factors
    sims: Simulations

    def run(
        self,
        method: Method,
        restriction: Restriction | None,
        progress: Callable[[str], None] | None,
        on_solve: OnSolve | None,
    ) -> Plan:
        """One search: the closed loop over the templates `restriction` keeps."""

        def solve(factors: dict[str, float]) -> Plan:
            plan = plan_stack(
                self.stack,
                self.fleet,
                self.perf.catalog,
                self.libs,
                self.previous,
                method=method,
                factors=factors,
                restriction=restriction,
            )
            if on_solve:
                on_solve(plan, factors)
            return plan

        return plan_to_target(
            self.fleet.attainment_scope(),
            self.perf,
            self.libs,
            solve,
            self.root,
            progress,
            base=self.base,
            simulations=self.sims,
        )

    def restricted(
        self,
        restriction: Restriction | None,
        progress: Callable[[str], None],
        on_solve: OnSolve | None,
    ) -> Plan | None:
        """A restricted search (Coral's), or None when it failed: it is a second opinion, so
        its failure is a progress line, not an error."""
        try:
            return self.run("coral", restriction, progress, on_solve)
        except CoralError as exc:
            progress(f"failed: {exc}")
            return None


def _said(on_round: Callable[[str], None] | None, name: str) -> Callable[[str], None]:
    """A restricted search's progress lines, named."""

    def said(line: str) -> None:
        if on_round:
            on_round(f"{name} search, {line}")

    return said


def _restrictions(libs: dict[Job, Library]) -> list[Restriction]:
    """The restrictions whose search offers templates no search before it offers (the
    mixed search first): a search over the same templates would find the same plan."""
    searched = [_offered(libs, None)]
    out: list[Restriction] = []
    for restriction in RESTRICTIONS:
        offered = _offered(libs, restriction)
        if offered and offered not in searched:
            searched.append(offered)
            out.append(restriction)
    return out


# A restricted search in a worker: its plan (None when it failed; the line says why), and the
# (plan, factors) of its solves when asked.
_Found = tuple[Restriction | None, Plan | None, list[tuple[Plan, dict[str, float]]]]
# What forked search workers read while they run: the searches, a queue per restriction for its
# progress lines (none: no progress asked), and whether to keep their solves.
_IN_WORKERS: list[tuple[_Searches, dict[Restriction | None, Any], bool]] = []


def _search_in_worker(restriction: Restriction | None) -> tuple[_Found, dict[Any, Any]]:
    """In a worker process: one restricted search, and the simulations it added."""
    searches, queues, record = _IN_WORKERS[0]
    known = searches.sims.keys()
    solves: list[tuple[Plan, dict[str, float]]] = []
    lines = queues.get(restriction)  # a SimpleQueue: written to its pipe before put returns
    said = _said(lines.put if lines is not None else None, _name(restriction))
    plan = searches.restricted(
        restriction, said, (lambda p, f: solves.append((p, f))) if record else None
    )
    return (restriction, plan, solves), searches.sims.since(known)


def _in_parallel(
    searches: _Searches,
    first: Restriction | None,
    restrictions: list[Restriction | None],
    workers: int,
    on_round: Callable[[str], None] | None,
    on_solve: OnSolve | None,
) -> list[tuple[str, Plan]]:
    """The first search (the mixed one; with spot allowed, the on-demand one) here while the
    others run in up to `workers` forked processes. Each other search's progress lines (as
    they come) and then its solves are passed on after the first search's, search by search:
    the same lines in the same order as one search after the other.

    Their lines are read into `held` between the first search's rounds and while waiting, so a
    worker never waits on a full pipe for long; a line is in its pipe before `put` returns, so
    a search's future is done only after its last line can be read."""
    fork = multiprocessing.get_context("fork")
    queues = {r: fork.SimpleQueue() for r in restrictions} if on_round else {}
    held: dict[Restriction | None, list[str]] = {r: [] for r in restrictions}

    def read() -> None:
        for restriction, lines in queues.items():
            while not lines.empty():
                held[restriction].append(lines.get())

    def first_said(line: str) -> None:
        read()
        if on_round:
            on_round(line)

    def pass_on(restriction: Restriction | None) -> None:
        read()
        lines, held[restriction] = held[restriction], []
        for line in lines:
            if on_round:
                on_round(line)

    _IN_WORKERS[:] = [(searches, queues, on_solve is not None)]
    found: list[tuple[str, Plan]] = []
    try:
        tasks = [(r,) for r in restrictions]
        with started_in_processes(_search_in_worker, tasks, min(workers, len(tasks))) as futures:
            found.append((_name(first), searches.run("coral", first, first_said, on_solve)))
            with timing.phase(RESTRICTED_WAIT):
                for restriction, future in zip(restrictions, futures, strict=True):
                    while not future.done():
                        wait([future], timeout=0.2)
                        pass_on(restriction)
                    pass_on(restriction)
                    (_, plan, solves), sims = future.result()
                    searches.sims.add(sims)
                    for solved, factors in solves:
                        if on_solve:
                            on_solve(solved, factors)
                    if plan is not None:
                        found.append((_name(restriction), plan))
    finally:
        _IN_WORKERS.clear()
    return found


def _offered(libs: dict[Job, Library], restriction: Restriction | None) -> frozenset[str]:
    """The templates a search offers (template refs)."""
    kept = _kept_templates(restriction)
    keeps = RESTRICTIONS[kept] if kept is not None else (lambda t: True)
    return frozenset(
        template_ref(m, ph, t.key)
        for (m, ph), lib in libs.items()
        for t in lib.templates
        if keeps(t)
    )


SERVED_TOLERANCE = 1e-4  # plans floor served fractions to 0.01%


def served_key(plan: Plan, priority: dict[str, int]) -> tuple[float, ...]:
    """How much a plan serves, by the allocation's rule, as a key that sorts better plans
    higher: per priority tier (highest first) the least served fraction, then the tier's total
    (`solver.allocation.problem.priority_tiers`)."""
    fractions = plan.served_fractions or {m: plan.served_fraction for m in priority}
    key: list[float] = []
    for tier in priority_tiers(sorted(fractions), priority):
        shares = [fractions[m] for m in tier]
        key += [round(min(shares) / SERVED_TOLERANCE), round(sum(shares) / SERVED_TOLERANCE)]
    return tuple(key)


def _short(plan: Plan) -> set[str]:
    """Every row below its target, length buckets included (`Plan.below_target` leaves them
    out, but in a search the buckets are the routed models' only rows)."""
    return {a.model for a in plan.attainment if a.short_by > 0}


def _charged(plan: Plan) -> float:
    """What the allocation minimises: $/hour plus the start-up penalty of new instances."""
    return plan.hourly_cost_usd + plan.startup_penalty_usd_per_hour


def _mean_served(plan: Plan) -> float:
    shares = list(plan.served_fractions.values()) or [plan.served_fraction]
    return sum(shares) / len(shares)


def least_served(plan: Plan) -> float:
    """The least served model's share of its demand."""
    return min(plan.served_fractions.values(), default=plan.served_fraction)


def best_at_target(found: list[tuple[str, Plan]], priority: dict[str, int] | None = None) -> Plan:
    """The best of the closed loop's searches, in the order they ran (the mixed search first;
    with spot allowed, the on-demand one): a later search's plan replaces the best so far when
    it meets every target that one meets (length buckets included) and either serves more
    (max-min fair by priority, then the most in total: `served_key`), or serves as much and
    meets more targets, or serves as much and meets the same targets for less ($/hour plus the
    start-up penalty, what the allocation minimises). A replacing plan keeps the first plan's
    method, and its closed_loop_stop says which search it came from."""
    first_name, best = found[0]
    best_name = first_name
    priority = priority if priority is not None else {m: 0 for m in best.served_fractions}
    for name, plan in found[1:]:
        if not _short(plan) <= _short(best):
            continue
        more, was = served_key(plan, priority), served_key(best, priority)
        fewer_short = _short(plan) < _short(best)
        cheaper = _charged(plan) < _charged(best) - 1e-6
        if more > was or (more == was and (fewer_short or cheaper)):
            best, best_name = plan, name
    if best_name == first_name:
        return best
    first = found[0][1]
    if served_key(best, priority) != served_key(first, priority):
        how = (
            f"serves more (least served model {least_served(best):.1%}, models on average "
            f"{_mean_served(best):.1%} of their demand; against {least_served(first):.1%} and "
            f"{_mean_served(first):.1%})"
        )
    elif _short(best) < _short(first):
        missed = ", ".join(sorted(_short(first) - _short(best)))
        how = f"serves as much and also meets the target of {missed}"
    else:
        how = "serves as much for less"
    others = ", ".join(
        f"{name} {p.hourly_cost_usd:.2f} $/h" for name, p in found if name != best_name
    )
    why = (
        f"{best.closed_loop_stop}; kept the {best_name} search's plan "
        f"({best.hourly_cost_usd:.2f} $/h; {others}): it meets every target the {first_name} "
        f"search's plan meets and {how}"
    )
    return best.model_copy(update={"method": found[0][1].method, "closed_loop_stop": why})


def plan_with_library(
    stack: str,
    fleet: FleetConfig,
    perf: PerfModel,
    directory: Path,
    previous: Plan | None = None,
    method: Method = "coral",
    workers: int = 2,
    progress: Callable[[Job, int, int], None] | None = None,
    rebuild_stale: bool = True,
    root: Path | None = None,
    on_round: Callable[[str], None] | None = None,
    force: bool = False,
) -> Plan:
    """Load (or build) the stack's libraries from `directory`, plan for the models' SLO
    attainment targets (with length buckets for the models that ask:
    `solver.plan.length_routing`), verify by simulation, and validate the plan.

    What `coral plan` and the Pulumi program both run. `root`: the project folder that
    relative `workload_trace` paths are read from; `on_round`: a line per closed-loop round;
    `force`: build into a library folder another stack owns.
    """
    loaded: dict[Job, Library] = {}
    sims = Simulations(perf, root)  # a model planned alike in several plans is simulated once

    def plan_once(planned_fleet: FleetConfig) -> Plan:
        libs = libraries_for(
            perf,
            planned_fleet,
            list(stack_demand(planned_fleet.models)),
            directory,
            True,
            workers,
            progress,
            rebuild_stale,
            stack,
            force,
        )
        loaded.update(libs)

        return plan_to_targets(
            stack,
            planned_fleet,
            perf,
            libs,
            previous,
            method,
            root,
            on_round,
            directory,
            sims,
            workers,
        )

    plan, planned_fleet = plan_routed(fleet, plan_once, root, on_round, previous)
    plan = with_slowdowns(plan, planned_fleet.attainment_scope(), sims)
    jobs = set(stack_demand(planned_fleet.models))
    library = {
        template_ref(m, ph, t.key): t
        for (m, ph), lib in loaded.items()
        if (m, ph) in jobs
        for t in lib.templates
    }
    return validate_plan(plan, fleet.plan_scope(), perf.catalog, perf.cards, library)
