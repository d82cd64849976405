"""From a stack to a plan: demand per (model, phase), libraries, allocation, the plan file.

`plan_with_library` is what `coral plan` and the Pulumi program run: libraries from a folder
(built, or rebuilt when stale, there when asked), then the plan to the models' SLO attainment
targets (`solver.plan.attainment`: capacity model, closed loop, verification; length buckets
through `solver.plan.length_routing`), validated. `plan_stack` is one allocation: Coral's or a
baseline's (`solver/allocation/baselines.py`), assembled into a `Plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from solver import timing
from solver.allocation.baselines import cauchy_columns, homo_solution, priorities
from solver.allocation.paper_baselines import paper_baseline
from solver.allocation.problem import Column, Problem, Solution, make_columns
from solver.allocation.solve import solve_allocation
from solver.catalog.market import Market, build_market
from solver.catalog.offers import Catalog
from solver.errors import CoralError, InputError, StaleLibraryError
from solver.io import digest
from solver.performance.perf_model import PerfModel
from solver.plan.attainment import Simulations, base_factors, plan_to_target
from solver.plan.demand import capacity_needed, stack_demand
from solver.plan.length_routing import plan_routed
from solver.plan.validator import validate_plan
from solver.plan_schema import Instance, JobResult, Method, Plan, instance_key, template_ref
from solver.serving.library import (
    Library,
    build_libraries,
    library_owner,
    load_library,
    save_library,
)
from solver.serving.serving_template import ServingTemplate
from solver.stack import FleetConfig
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
    libs: dict[Job, Library] = {}
    todo: list[Job] = []
    for job in jobs:
        try:
            libs[job] = load_library(directory, perf, fleet, *job)
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
            fleet,
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
                    key=instance_key(model, phase, cloud, region, c.template.key, idx),
                    model=model,
                    phase=c.template.phase,
                    cloud=cloud,
                    region=region,
                    template=c.template.key,
                    index=idx,
                    nodes=c.template.nodes,
                    usd_per_hour=round(c.price, 6),
                    throughput=c.template.throughput,
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
                ]
            ),
            "demand": digest(sorted(demand.items())),
            "allocation": digest(fleet.allocation.model_dump()),
        },
        capacity_factors=used_factors,
    )


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
) -> Plan:
    """Solve the allocation for a stack (or run a baseline) and assemble the plan.

    `factors` (template ref -> capacity at the SLO target / throughput, from
    `solver.plan.attainment`) scale each template's throughput; a template with factor 0 is
    not offered. None: every template at its library throughput (the paper's formulation).
    """
    demand = stack_demand(fleet)
    market = build_market(fleet, catalog)
    templates = {job: lib.templates for job, lib in libs.items()}
    if factors is not None:
        templates = {
            job: [at_capacity(t, f) for t in ts if (f := factors[template_ref(*job, t.key)]) > 0]
            for job, ts in templates.items()
        }
    columns = make_columns(templates, market, demand)
    # Capacity to buy: demand over the target utilization (headroom for queueing).
    needed = capacity_needed(fleet, demand)
    if method in ("homo-paper", "cauchy-paper"):
        columns, solution = paper_baseline(method, fleet, market, needed, columns)
    elif method == "homo":
        solution = homo_solution(fleet, market, needed, columns)
    else:
        if method == "cauchy":
            columns = cauchy_columns(columns)
        running = previous.counts() if previous is not None else {}
        problem = Problem(needed, columns, market, fleet.allocation, running, priorities(fleet))
        solution = solve_allocation(problem)
    return plan_from_solution(
        stack, method, fleet, market, demand, columns, solution, libs, factors
    )


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
) -> Plan:
    """The method planned to the models' SLO attainment targets (the closed loop and the
    verification, `attainment.plan_to_target`). For Coral the loop also runs over single-config
    templates, and the better plan is kept (`better_at_target`). Both loops reuse each other's
    simulations (and the caller's, given `simulations`). `workers`: processes for the capacity
    model of templates not cached."""
    sims = simulations if simulations is not None else Simulations(perf, root)

    def solve_as(how: Method) -> Callable[[dict[str, float]], Plan]:
        def solve(factors: dict[str, float]) -> Plan:
            return plan_stack(
                stack, fleet, perf.catalog, libs, previous, method=how, factors=factors
            )

        return solve

    if on_round:  # minutes on a large stack the first time (the factors are cached after)
        count = sum(len(lib.templates) for lib in libs.values())
        on_round(f"capacity model: the SLO capacity of {count:,} templates")
    with timing.phase("capacity model"):
        base = base_factors(fleet, perf, libs, root, cache, workers)  # once, for both searches
    plan = plan_to_target(
        fleet, perf, libs, solve_as(method), root, on_round, base=base, simulations=sims
    )
    if method != "coral" or fleet.attainment.rounds == 0:
        return plan
    # The closed loop is a search over whole instances, and its path depends on where it
    # starts: on staging it ended at 17.88 $/h where the same loop over single-config
    # templates (Cauchy's, a restriction of Coral's) ended at 12.85 at the same targets.
    # Every plan of that restricted search is a Coral plan, so Coral keeps the better.

    def said(line: str) -> None:
        if on_round:
            on_round(f"single-config search, {line}")

    try:
        single = plan_to_target(
            fleet, perf, libs, solve_as("cauchy"), root, said, base=base, simulations=sims
        )
    except CoralError as exc:  # the restricted search is a second opinion: Coral's plan stands
        said(f"failed: {exc}")
        return plan
    return better_at_target(plan, single)


def better_at_target(coral: Plan, single: Plan) -> Plan:
    """Coral's closed-loop plan, or the plan of the same loop over single-config templates
    (a restriction of Coral's search, so a Coral plan too) when that one serves at least as
    much, meets every target Coral's meets, and costs less; it is then labelled Coral's, and
    its closed_loop_stop says where it came from."""

    def served(p: Plan) -> float:
        return sum(p.served_fractions.values()) if p.served_fractions else p.served_fraction

    coral_short = {a.model for a in coral.below_target()}
    single_short = {a.model for a in single.below_target()}
    if (
        served(single) >= served(coral) - 1e-9
        and single_short <= coral_short
        and single.hourly_cost_usd < coral.hourly_cost_usd - 1e-6
    ):
        why = (
            f"{single.closed_loop_stop}; kept the single-config search's plan "
            f"({single.hourly_cost_usd:.2f} $/h, every instance on one node config), cheaper "
            f"than the mixed search's {coral.hourly_cost_usd:.2f} $/h at the same targets"
        )
        return single.model_copy(update={"method": coral.method, "closed_loop_stop": why})
    return coral


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
            list(stack_demand(planned_fleet)),
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
    jobs = set(stack_demand(planned_fleet))
    library = {
        template_ref(m, ph, t.key): t
        for (m, ph), lib in loaded.items()
        if (m, ph) in jobs
        for t in lib.templates
    }
    return validate_plan(plan, fleet, perf.catalog, perf.cards, library)
