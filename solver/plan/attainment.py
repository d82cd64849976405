"""Plans that meet their SLO attainment targets: capacity at the target, a closed loop, and a
verification on requests the planner never saw.

1. **Capacity model** (`solver.capacity.slo_capacity.capacity_factors`): each template's capacity at its model's
   target, from the planning workload's lengths and burstiness.
2. **Closed loop**: plan with those capacities, simulate the plan on the planning workload
   (`workload.model_trace(..., "plan")`), and for every model below its target (plus `MARGIN`)
   lower the capacity of the phase its misses come from (prefill when the prompt's own prefill
   took most of the TTFT SLO, else decode), by a step that grows with the shortfall; re-plan, at
   most `attainment.rounds` times.
3. **Verification**: the final plan simulated for `attainment.verify_minutes` on the
   verification workload (other seeds, or the trace's other blocks). Its attainment per model is
   the plan's claim; `coral plan --strict` exits 3 and the Pulumi program refuses a plan below
   target unless the stack sets `attainment.accept_below_target`. A plan with spot instances is
   also simulated on that workload with one zone's spot instances taken back at once, for each
   of its zones (`ModelAttainment.under_preemption`, the lowest; a report beside the claim).

Scarce plans (served fraction < 1) are simulated at the demand they serve.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import t as student_t

from solver import timing
from solver.capacity.slo_capacity import (
    ADMISSION_SHARE,
    CAPACITY_MODEL_VERSION,
    MAX_UTILIZATION,
    capacity_factors,
)
from solver.io import digest, write_atomic
from solver.performance.perf_model import PerfModel
from solver.plan_schema import ModelAttainment, Plan, template_ref
from solver.serving.executors import map_in_processes
from solver.serving.instance_model import InstanceModel
from solver.serving.library import Library
from solver.serving.serving_template import ServingTemplate
from solver.simulation.admission import admission_limits
from solver.simulation.preemption import zone_losses
from solver.simulation.results import ModelResult, SimResult
from solver.simulation.simulator import simulate
from solver.simulation.traces import Trace
from solver.simulation.workload import (
    Purpose,
    Workload,
    model_contexts,
    model_trace,
    planning_workload,
    request_rate,
    trace_of,
)
from solver.stack import AttainmentScope, ModelSpec
from solver.types import Job

MARGIN = 0.02  # the closed loop aims this far above each target (seed-to-seed noise)
MIN_REQUESTS = 3_000  # a simulated window holds at least this many requests per model
GAIN = 3.0  # capacity cut per point of shortfall, times the phase's share of the misses
MAX_STEP, MIN_STEP = 0.4, 0.03  # capacity cut per round and phase, as a share
RELAX_SURPLUS = 0.015  # above target + MARGIN by this much: give capacity back
MAX_HEADROOM = 4.0  # the loop's correction of the capacity model, at most
UNREACHABLE_FACTOR = 0.1  # capacity / T-hat of a template no target is reachable on

PlanFn = Callable[[dict[str, float]], Plan]


def base_factors(
    models: Mapping[str, ModelSpec],
    perf: PerfModel,
    libs: dict[Job, Library],
    root: Path | None = None,
    cache: Path | None = None,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, float]:
    """Template ref -> capacity factor at its model's target, from the capacity model.

    `cache`: a folder (the library's) where each job's factors are kept, keyed by the library's
    input hashes, the SLOs, the target and the planning workload, so an unchanged stack
    reuses them (the model takes about 40 s on 55,000 templates on 2 cores). Each job's are
    saved as soon as they are computed, so a run that is stopped keeps the jobs it finished.
    `workers`: processes that share the jobs not cached, in chunks of templates (the factors
    are the same). `progress(done, total)`: templates modelled of those not cached, as chunks
    finish.
    """
    jobs: list[_CapacityJob] = []
    for i, (model, spec) in enumerate(sorted(models.items())):
        workload = planning_workload(spec, i, root, perf.card(model).max_context)
        jobs += [
            _CapacityJob(lib, spec, workload, _cache_path(cache, lib, spec, workload))
            for (m, _), lib in sorted(libs.items())
            if m == model
        ]
    factors = [_load(job.path, len(job.lib.templates)) for job in jobs]
    missing = [k for k, f in enumerate(factors) if f is None]
    computed = _compute([jobs[k] for k in missing], perf, workers, progress) if missing else []
    for k, values in zip(missing, computed, strict=True):
        factors[k] = values
        if (path := jobs[k].path) is not None:
            buffer = io.BytesIO()
            np.save(buffer, values)
            write_atomic(path, buffer.getvalue())
    out: dict[str, float] = {}
    for job, f in zip(jobs, factors, strict=True):
        assert f is not None
        for t, x in zip(job.lib.templates, f, strict=True):
            out[template_ref(job.lib.model, job.lib.phase, t.key)] = round(float(x), 6)
    return out


@dataclass(frozen=True)
class _CapacityJob:
    """One (model, phase)'s templates to model, and where its factors are kept."""

    lib: Library
    spec: ModelSpec
    workload: Workload
    path: Path | None


def _cache_path(
    cache: Path | None, lib: Library, spec: ModelSpec, workload: Workload
) -> Path | None:
    """Where a job's factors are kept under `cache`, keyed by every input of the model."""
    if cache is None:
        return None
    key = digest(
        [
            CAPACITY_MODEL_VERSION,
            lib.input_hashes,
            [t.key for t in lib.templates],
            spec.slo_ms.model_dump(),
            spec.slo_attainment,
            workload.arrival_scv,
            hashlib.sha256(workload.prompts.tobytes() + workload.outputs.tobytes()).hexdigest(),
        ]
    )
    return cache / "capacity" / f"{lib.model}__{lib.phase}__{key}.npy"


def _load(path: Path | None, n: int) -> np.ndarray | None:
    """Factors saved at `path` for `n` templates; None when absent or unreadable."""
    if path is None or not path.exists():
        return None
    try:
        saved = np.load(path)
    except (OSError, ValueError):
        return None  # unreadable: computed again and rewritten
    return np.asarray(saved, dtype=np.float64) if saved.shape == (n,) else None


PARALLEL_TEMPLATES = 2_000  # fewer templates to model than this: one process is faster
CHUNK_TEMPLATES = 1_000  # templates per task in worker processes


_JOBS: list[tuple[list[_CapacityJob], PerfModel]] = []  # what forked workers read


def _compute(
    jobs: list[_CapacityJob],
    perf: PerfModel,
    workers: int,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[np.ndarray]:
    """`_reachable_factors` of each job, in job order as each is complete, in `workers`
    processes when it pays: each job's templates at its target in chunks (a template's factor
    does not depend on the others); a job none of whose templates reaches its target goes on
    below it, in this process. `progress(done, total)` in templates."""
    total = sum(len(j.lib.templates) for j in jobs)
    done = 0

    def finished(j: _CapacityJob, f: np.ndarray) -> np.ndarray:
        if f.max(initial=0.0) > 0 or not len(f):
            return f
        return _reachable_factors(j.lib, j.spec, j.workload, perf, below=True)

    if workers <= 1 or total < PARALLEL_TEMPLATES:
        for j in jobs:
            f = _reachable_factors(j.lib, j.spec, j.workload, perf)
            done += len(j.lib.templates)
            if progress:
                progress(done, total)
            yield f
        return
    tasks = [
        (k, start, min(start + CHUNK_TEMPLATES, len(j.lib.templates)))
        for k, j in enumerate(jobs)
        for start in range(0, len(j.lib.templates), CHUNK_TEMPLATES)
    ]
    pending: list[np.ndarray] = []
    following = 0  # the next job to yield
    _JOBS[:] = [(jobs, perf)]
    try:
        results = map_in_processes(_chunk_factors, tasks, workers)
        for (k, _, stop), values in zip(tasks, results, strict=True):
            for _ in range(following, k):  # jobs without templates have no chunks
                yield np.zeros(0)
            following = k
            pending.append(values)
            done += len(values)
            if progress:
                progress(done, total)
            if stop == len(jobs[k].lib.templates):  # the job's last chunk
                yield finished(jobs[k], np.concatenate(pending))
                pending, following = [], k + 1
        for _ in range(following, len(jobs)):
            yield np.zeros(0)
    finally:
        _JOBS.clear()


def _chunk_factors(k: int, start: int, stop: int) -> np.ndarray:
    """In a worker: job `k`'s factors at its target for templates [start, stop)."""
    jobs, perf = _JOBS[0]
    job = jobs[k]
    templates = job.lib.templates[start:stop]
    return capacity_factors(
        templates,
        job.spec.slo_ms,
        job.workload,
        job.spec.slo_attainment,
        lambda t: InstanceModel.serving(perf, t, job.spec),
    )


def _reachable_factors(
    lib: Library, spec: ModelSpec, workload: Workload, perf: PerfModel, below: bool = False
) -> np.ndarray:
    """Factors at the model's target or, when no template reaches it (prompts too long for
    the SLO on every template), at the highest target some template reaches, in steps of
    0.01; when none reaches any, a token UNREACHABLE_FACTOR for every template, so the plan
    still serves and the verification reports the model short, with why. `below`: the
    target is known to be out of reach (start one step under it)."""
    built: dict[str, InstanceModel] = {}  # each instance (and its chunk search) once

    def instance(t: ServingTemplate) -> InstanceModel:
        if t.key not in built:
            built[t.key] = InstanceModel.serving(perf, t, spec)
        return built[t.key]

    target = round(spec.slo_attainment - 0.01, 3) if below else spec.slo_attainment
    while target > 0:
        f = capacity_factors(lib.templates, spec.slo_ms, workload, target, instance)
        if f.max(initial=0.0) > 0:
            return f
        target = round(target - 0.01, 3)
    return np.full(len(lib.templates), UNREACHABLE_FACTOR)


def plan_to_target(
    scope: AttainmentScope,
    perf: PerfModel,
    libs: dict[Job, Library],
    solve: PlanFn,
    root: Path | None = None,
    progress: Callable[[str], None] | None = None,
    cache: Path | None = None,
    base: dict[str, float] | None = None,
    simulations: Simulations | None = None,
) -> Plan:
    """The closed loop and the verification (module doc); `solve(factors)` plans once;
    `cache`: where the capacity model's factors are kept (`base_factors`); `base`: those
    factors, when the caller has them already; `simulations`: results to reuse (shared with
    the caller's other closed loops)."""
    if base is None:
        base = base_factors(scope.models, perf, libs, root, cache)
    loop = ClosedLoopRound(scope, perf, base, solve, root, progress, simulations)
    headroom = {job: 1.0 for job in libs}
    rounds = scope.attainment.rounds
    plan, planned, sims = loop.run(headroom, simulate_it=rounds > 0)
    best = (plan, planned, dict(headroom))
    plan_round = best_round = loop.count - 1  # the rounds `plan` and `best` are (-1: none ran)
    stop = _initial_stop(plan, rounds)
    out_of_rounds = f"out of rounds (attainment.rounds = {scope.attainment.rounds})"
    while not stop and (short := loop.short(planned)):
        if rounds == 0:
            stop = out_of_rounds
            break
        rounds -= 1
        cut = _cut_that_changes(plan, headroom, short, sims, scope, loop)
        if cut is None:
            names = ", ".join(sorted(short))
            stop = (
                f"cutting the capacity of {names} to {MIN_HEADROOM:.0%} of the model's changed "
                "no instance (the plan cannot add what they lack: see the binding constraints)"
            )
            break
        headroom, cut_plan = cut
        plan, planned, sims = loop.run(headroom, cut_plan)
        plan_round = loop.count - 1
        if _closer(plan, planned, best, scope):
            best, best_round = (plan, planned, dict(headroom)), plan_round
        if not plan.instances:
            stop = "a round served nothing"
    if not plan.instances or loop.short(planned):  # the round closest to every target
        if _closer(best[0], best[1], (plan, planned, headroom), scope):
            plan, planned, headroom = best[0], best[1], dict(best[2])
            plan_round = best_round
    kept: set[str] = set()  # models whose last give-back put a model below target
    while not stop and plan.instances and not loop.short(planned):  # give back spare headroom
        if rounds == 0:
            stop = out_of_rounds
            break
        given = _give_back_that_changes(plan, headroom, planned, scope, loop, kept)
        if given is None:
            stop = "every model meets its target, and giving capacity back to any model " + (
                "changed no instance or put one below its target" if kept else "changed no instance"
            )
            break
        more, candidate, model = given
        rounds -= 1
        relaxed, relaxed_planned, _ = loop.run(more, candidate)
        if below := loop.short(relaxed_planned):
            kept.add(model)  # keep the round before, and give back elsewhere
            if loop.progress:
                loop.progress(
                    f"round {loop.count - 1} put {', '.join(sorted(below))} below target: "
                    f"keeping round {plan_round}'s plan ({plan.hourly_cost_usd:,.2f} $/h)"
                )
            continue
        plan, planned, headroom = relaxed, relaxed_planned, more
        plan_round = loop.count - 1
    if loop.progress and stop:
        loop.progress(_stop_line(loop.count - 1, plan_round, plan, stop))
    return verify_plan(plan, scope, perf, planned, headroom, root, stop, loop.progress, loop.sims)


def _stop_line(last: int, kept: int, plan: Plan, stop: str) -> str:
    """The loop's last progress line: why it stopped, and the round whose plan it keeps, with
    that plan's cost (not always the last round printed: a round that missed a target, or
    that was further from the targets than an earlier one, is dropped)."""
    cost = f"{plan.hourly_cost_usd:,.2f} $/h"
    if last < 0:
        return f"no round run ({cost}): {stop}"
    if kept == last:
        return f"stopped after round {last} ({cost}): {stop}"
    return f"stopped after round {last}, keeping round {kept}'s plan ({cost}): {stop}"


BOOSTS = (1.0, 2.0, 4.0, 8.0)  # a cut that changes nothing doubles its floor, to MAX_STEP
MIN_HEADROOM = 0.05  # a job cut below this share of its modelled capacity: nothing will help


def _initial_stop(plan: Plan, rounds: int) -> str:
    """Why the loop does not start ('' when it does)."""
    if rounds == 0:
        return "no closed loop (attainment.rounds = 0)"
    if not plan.instances:
        return "the plan serves nothing"
    return ""


def _cut_that_changes(
    plan: Plan,
    headroom: dict[Job, float],
    short: dict[str, float],
    sims: dict[str, ModelResult],
    scope: AttainmentScope,
    loop: ClosedLoopRound,
) -> tuple[dict[Job, float], Plan] | None:
    """The first of ever deeper capacity cuts for the short models whose plan differs from
    `plan` in some instance, and that plan; None when the plan stays the same until every
    short job is below MIN_HEADROOM. Cuts compound (`_raise_headroom`, its floor doubled up
    to MAX_STEP per try) and are planned without simulating: a cut that whole instances absorb
    would only re-simulate the same fleet."""
    before, trial = _fleet_keys(plan), dict(headroom)
    jobs = [job for job in trial if job[0] in short]
    tries = 0
    while any(trial[job] >= MIN_HEADROOM for job in jobs):
        boost = BOOSTS[min(tries, len(BOOSTS) - 1)]
        for model, gap in short.items():
            _raise_headroom(trial, model, gap, sims[model], scope, boost)
        tries += 1
        candidate = loop.solve(scaled_factors(loop.base, trial))
        if _fleet_keys(candidate) != before:
            return trial, candidate
    return None


def _give_back_that_changes(
    plan: Plan,
    headroom: dict[Job, float],
    planned: dict[str, float],
    scope: AttainmentScope,
    loop: ClosedLoopRound,
    kept: set[str],
) -> tuple[dict[Job, float], Plan, str] | None:
    """Headroom given back to one model well above target (the one furthest above first; not
    those in `kept`), repeated (`_relaxed`, up to MAX_HEADROOM) until the plan drops an
    instance: that headroom, plan and model; None when no model's give-back changes the plan.
    One model at a time, so one model's give-back that misses does not cost the others'."""
    before = _fleet_keys(plan)
    targets = {m: scope.models[m].slo_attainment for m in planned}
    for model in sorted(planned, key=lambda m: targets[m] - planned[m]):
        if model in kept:
            continue
        trial = headroom
        while (more := _relaxed(trial, planned, scope, only=model)) is not None:
            trial = more
            candidate = loop.solve(scaled_factors(loop.base, trial))
            if _fleet_keys(candidate) != before:
                return trial, candidate, model
    return None


def _closer(
    plan: Plan,
    planned: dict[str, float],
    best: tuple[Plan, dict[str, float], dict[Job, float]],
    scope: AttainmentScope,
) -> bool:
    """Whether this round is closer to every target than `best`: it serves something where
    best served nothing, or its worst shortfall (target - attainment, over models) is smaller."""

    def worst(p: Plan, att: dict[str, float]) -> tuple[bool, float]:
        gaps = [scope.models[m].slo_attainment - a for m, a in att.items()]
        return (sum(p.served_fractions.values()) > 0, -max(gaps, default=0.0))

    return worst(plan, planned) > worst(best[0], best[1])


class ClosedLoopRound:
    """One closed-loop round: plan at the scaled capacities, simulate on the planning workload."""

    def __init__(
        self,
        scope: AttainmentScope,
        perf: PerfModel,
        base: dict[str, float],
        solve: PlanFn,
        root: Path | None,
        progress: Callable[[str], None] | None,
        sims: Simulations | None = None,
    ) -> None:
        self.scope, self.perf, self.base, self.solve = scope, perf, base, solve
        self.root, self.progress, self.count = root, progress, 0
        # A round re-simulates only the models whose instances (or served fraction) changed.
        self.sims = sims if sims is not None else Simulations(perf, root)

    def run(
        self, headroom: dict[Job, float], plan: Plan | None = None, simulate_it: bool = True
    ) -> tuple[Plan, dict[str, float], dict[str, ModelResult]]:
        """Plan at `headroom` (or take `plan`, already planned at it) and simulate it."""
        plan = plan or self.solve(scaled_factors(self.base, headroom))
        if not simulate_it or not plan.instances:
            return plan, {}, {}
        minutes = self.scope.attainment.planning_minutes
        with timing.phase("closed-loop simulation"):
            sims = self.sims.run(
                plan,
                self.scope.models,
                "plan",
                minutes * 60,
                room=self.scope.room,
                step_scale=self.scope.attainment.latency_margin,
            )
        planned = {m: float(r.met.mean()) if len(r.met) else 1.0 for m, r in sims.items()}
        if self.progress:
            line = ", ".join(f"{m} {100 * a:.1f}%" for m, a in sorted(planned.items()))
            self.progress(f"round {self.count}: {plan.hourly_cost_usd:,.2f} $/h; {line}")
        self.count += 1
        return plan, planned, sims

    def short(self, planned: dict[str, float]) -> dict[str, float]:
        """Model -> points below its target plus MARGIN, for the models below it."""
        want = {m: self.scope.models[m].slo_attainment + MARGIN for m in planned}
        return {m: want[m] - a for m, a in planned.items() if a < want[m]}


def _fleet_keys(plan: Plan) -> dict[str, tuple[object, ...]]:
    """Model -> what its simulation depends on: its instances' templates and the served
    fraction (which sets the simulated demand)."""
    out: dict[str, list[str]] = {}
    for i in plan.instances:
        out.setdefault(i.model, []).append(f"{i.phase}/{i.template}")
    return {m: (m, plan.fraction_of(m), *sorted(t)) for m, t in out.items()}


def _relaxed(
    headroom: dict[Job, float],
    planned: dict[str, float],
    scope: AttainmentScope,
    only: str | None = None,
) -> dict[Job, float] | None:
    """Headroom given back to the models well above target (`only` that one; None: nothing to
    give back).

    The correction may exceed 1 (up to MAX_HEADROOM): the capacity model is pessimistic where a
    pool of many instances smooths bursts that one instance would see whole."""
    trial = dict(headroom)
    for (model, phase), k in headroom.items():
        if only is not None and model != only:
            continue
        surplus = planned.get(model, 0.0) - scope.models[model].slo_attainment - MARGIN
        if k < MAX_HEADROOM and surplus > RELAX_SURPLUS:
            trial[(model, phase)] = min(MAX_HEADROOM, k * (1.0 + min(0.25, 2.0 * surplus)))
    return trial if trial != headroom else None


def scaled_factors(base: dict[str, float], headroom: dict[Job, float]) -> dict[str, float]:
    """The capacity factors with each (model, phase)'s headroom applied (template ref -> factor)."""
    out = {}
    by_job = {f"{m}/{ph}/": k for (m, ph), k in headroom.items()}
    for ref, f in base.items():
        model, phase, _ = ref.split("/", 2)
        out[ref] = round(min(MAX_UTILIZATION, f * by_job.get(f"{model}/{phase}/", 1.0)), 6)
    return out


def _raise_headroom(
    headroom: dict[Job, float],
    model: str,
    gap: float,
    result: ModelResult,
    scope: AttainmentScope,
    boost: float = 1.0,
) -> None:
    """Lower the capacity of the phase(s) a short model's misses come from (at least
    MIN_STEP x `boost`: whole instances can absorb a small cut unchanged)."""
    spec = scope.models[model]
    jobs = [job for job in headroom if job[0] == model]
    if spec.serving == "aggregated" or result.prefill_done_s is None:
        shares = {job: 1.0 for job in jobs}
    else:
        miss = ~result.met
        prefill_ms = (result.prefill_done_s - result.arrival_s) * 1e3
        budget = spec.slo_ms.prefill - spec.slo_ms.decode - ADMISSION_SHARE * spec.slo_ms.prefill
        at_prefill = miss & (prefill_ms > budget)
        total = max(1, int(miss.sum()))
        p = float(at_prefill.sum()) / total
        shares = {(model, "prefill"): p, (model, "decode"): 1.0 - p}
    for job in jobs:
        share = shares.get(job, 0.0)
        if share >= 0.2:
            headroom[job] *= 1.0 - min(MAX_STEP, max(MIN_STEP * boost, GAIN * gap * share))


def _traces(
    models: Mapping[str, ModelSpec],
    purpose: Purpose,
    duration_s: float,
    plan: Plan,
    root: Path | None,
    contexts: Mapping[str, int],
    offered: float | None = None,
    room: float = 1.0,
) -> tuple[dict[str, Trace], float]:
    """Every served model's requests, over a window long enough for MIN_REQUESTS of the slowest
    model, lengths capped at each model's context (`contexts`, `model_contexts`); returns the
    traces and the window's length. At the fraction of its demand the plan
    serves times `room` (what the closed loop sizes: `AttainmentScope.room`), or with `offered`,
    at that multiple of its whole demand (what reaches the gateway, which sheds what the plan
    does not admit)."""
    scale = {
        m: plan.fraction_of(m) * room if offered is None or plan.fraction_of(m) <= 0 else offered
        for m in models
    }
    # The window holds MIN_REQUESTS of the slowest model's served (with `offered`: admitted)
    # requests: a scarce model admits about its served fraction of what is offered.
    rates = [request_rate(s) * min(scale[m], plan.fraction_of(m)) for m, s in models.items()]
    if any(r > 0 for r in rates):
        slowest = min(r for r in rates if r > 0)
        duration_s = min(max(duration_s, MIN_REQUESTS / slowest), 4 * 3_600.0)
    traces = {}
    for i, (model, spec) in enumerate(sorted(models.items())):
        if request_rate(spec) * scale[model] <= 0:
            continue
        trace = model_trace(spec, i, purpose, duration_s, root, scale[model], contexts.get(model))
        if offered is not None and purpose != "replay":
            trace = _repeated(trace, duration_s)
        traces[model] = trace
    return traces, duration_s


def _repeated(trace: Trace, duration_s: float) -> Trace:
    """`trace` played again from its start until `duration_s` (a trace window at a scarce
    model's whole demand can end long before its admitted requests fill the window); each copy
    starts one mean gap after the last request of the one before."""
    if len(trace) < 2 or trace.arrival_s[-1] >= duration_s:
        return trace
    span = float(trace.arrival_s[-1]) * len(trace) / (len(trace) - 1)
    copies = math.ceil(duration_s / span)
    arrival = np.concatenate([trace.arrival_s + k * span for k in range(copies)])
    keep = arrival < duration_s
    kept = int(np.count_nonzero(keep))
    return Trace(
        arrival[keep],
        np.tile(trace.prompt, copies)[keep],
        np.tile(trace.output, copies)[keep],
        round(trace.capped * kept / len(trace)),  # each copy's share of the capped ones
    )


def simulate_workload(
    plan: Plan,
    specs: Mapping[str, ModelSpec],
    perf: PerfModel,
    purpose: Purpose,
    duration_s: float,
    root: Path | None = None,
    models: set[str] | None = None,
) -> SimResult | None:
    """The plan simulated on its stack's planning or verification workload, at the demand it
    serves, for at least `duration_s` (longer when a model's rate needs it for MIN_REQUESTS);
    only `models` when given (`specs`: the stack's models by name); None when it serves nothing."""
    traces, duration_s = _traces(
        specs, purpose, duration_s, plan, root, model_contexts(specs, perf.cards)
    )
    served = {i.model for i in plan.instances if models is None or i.model in models}
    traces = {m: t for m, t in traces.items() if m in served}
    return simulate(plan, specs, perf, traces, duration_s) if traces else None


class Simulations:
    """Each model's simulated result, kept for reuse within one `coral plan`: by the closed
    loop's rounds, by each of its searches (mixed and restricted templates often plan a
    model alike), by length routing's plans and by the verification.

    A model's result depends only on what its key holds: the workload (purpose, window, the
    model's spec and its place in name order, which seeds its requests), the fraction of its
    demand served, and its instances' templates; other models' instances never meet its
    requests."""

    def __init__(self, perf: PerfModel, root: Path | None) -> None:
        self.perf, self.root = perf, root
        self._results: dict[tuple[object, ...], ModelResult] = {}

    def run(
        self,
        plan: Plan,
        specs: Mapping[str, ModelSpec],
        purpose: Purpose,
        duration_s: float,
        models: set[str] | None = None,
        offered: float | None = None,
        room: float = 1.0,
        step_scale: float = 1.0,
    ) -> dict[str, ModelResult]:
        """`plan` simulated on its stack's `purpose` workload for at least `duration_s`
        (`simulate_workload`), per served model (of `models` when given), reusing results.
        With `offered`, at that multiple of each model's whole demand behind the gateway's
        admission control (`admission_limits`, with `room`), as the deployed fleet takes it;
        without it, at `room` x the demand each model is served (the closed loop's load).
        `step_scale`: every engine step that many times as long as modelled (the stack's
        `attainment.latency_margin`; `simulate`)."""
        contexts = model_contexts(specs, self.perf.cards)
        traces, duration_s = _traces(
            specs, purpose, duration_s, plan, self.root, contexts, offered, room
        )
        limits = admission_limits(plan, specs, self.root, room) if offered is not None else {}
        templates: dict[str, list[str]] = {}
        for i in plan.instances:
            templates.setdefault(i.model, []).append(f"{i.phase}/{i.template}")
        order = {m: k for k, m in enumerate(sorted(specs))}
        keys = {
            m: (
                purpose,
                duration_s,
                m,
                order[m],
                specs[m].model_dump_json(),
                plan.fraction_of(m),
                offered,
                room,
                step_scale,
                limits[m].count if m in limits else None,
                limits[m].period_s if m in limits else None,
                *sorted(t),
            )
            for m, t in templates.items()
            if m in traces and (models is None or m in models)
        }
        todo = {m: traces[m] for m, k in keys.items() if k not in self._results}
        if todo:
            fresh = simulate(
                plan, specs, self.perf, todo, duration_s, admission=limits, step_scale=step_scale
            ).models
            self._results.update({keys[m]: r for m, r in fresh.items()})
        return {m: self._results[k] for m, k in keys.items()}

    def keys(self) -> set[tuple[object, ...]]:
        """What is simulated so far (to pass on only what comes after: `since`)."""
        return set(self._results)

    def since(self, keys: set[tuple[object, ...]]) -> dict[tuple[object, ...], ModelResult]:
        """The results simulated after `keys` (a search in another process hands them back)."""
        return {k: r for k, r in self._results.items() if k not in keys}

    def add(self, results: dict[tuple[object, ...], ModelResult]) -> None:
        """Results simulated elsewhere for the same stack (each key holds what its result
        depends on, so they stand for this process's too)."""
        self._results.update(results)


REPLAY_MAX_S = 4 * 3_600.0  # a whole trace at the model's demand, capped at four hours
SPIKE_LOAD = 1.5  # every plan is also verified at this multiple of its demand (a traffic spike)
HELD_OUT_BATCHES = 20
# Every plan is also verified as if each engine step took this much longer than modelled.
SLOWDOWNS = (1.2, 1.5)
ZONE_LOSS_AT = 1 / 3  # where in the verification window a zone's spot instances are taken


def under_preemption(
    plan: Plan, scope: AttainmentScope, perf: PerfModel, duration_s: float, root: Path | None
) -> dict[str, float]:
    """Model -> its lowest attainment on the verification workload (as `simulate_workload`
    builds it) with every spot instance of one zone taken back at once, a third of the way
    through its requests (warm queues), each replacement serving `scope.boot_minutes` later; the lowest over the
    plan's spot zones (`zone_losses`). This is the correlated loss the plan's zone spread
    (`allocation.spot.zone_loss_serves`) pays spare capacity for; at the shipped preemption
    rates a sampled window of half an hour almost never holds a preemption, so sampling them
    (`sample_outages`, `coral simulate --preemptions`) would report the verified share again.
    Only the models that run a spot instance; {} when none does."""
    spot_models = {i.model for i in plan.instances if i.is_spot}
    if not spot_models or scope.boot_minutes is None:
        return {}
    contexts = model_contexts(scope.models, perf.cards)
    traces, duration_s = _traces(scope.models, "verify", duration_s, plan, root, contexts, 1.0)
    traces = {m: t for m, t in traces.items() if m in spot_models}
    limits = admission_limits(plan, scope.models, root, scope.room)
    worst: dict[str, float] = {}
    # A third into the requests: a trace's held-out window can end well before `duration_s`.
    span = max((float(t.arrival_s[-1]) for t in traces.values() if len(t)), default=duration_s)
    losses = zone_losses(plan.instances, span * ZONE_LOSS_AT, scope.boot_minutes * 60)
    margin = scope.attainment.latency_margin
    for outages in losses.values():
        result = simulate(plan, scope.models, perf, traces, duration_s, outages, limits, margin)
        for m, r in result.models.items():
            worst[m] = min(worst.get(m, 1.0), r.admitted_attainment)
    return worst


def with_slowdowns(plan: Plan, scope: AttainmentScope, sims: Simulations) -> Plan:
    """`plan` with each verified model's attainment if every engine step took SLOWDOWNS x as
    long as modelled (`ModelAttainment.slower`): the verification workload at the demand,
    behind the gateway, at `simulate`'s `step_scale` (exact by a change of clock). Run once on
    the plan `coral plan` keeps, not on every plan compared: it changes no choice."""
    minutes = scope.attainment.verify_minutes
    if minutes <= 0 or not plan.attainment:
        return plan
    with timing.phase("verification"):
        slower = {
            f"{k:g}": sims.run(plan, scope.models, "verify", minutes * 60, None, 1.0, scope.room, k)
            for k in SLOWDOWNS
        }
    rows = [
        row.model_copy(
            update={
                "slower": {
                    k: round(by_model[row.model].admitted_attainment, 4)
                    for k, by_model in slower.items()
                    if row.model in by_model
                }
            }
        )
        for row in plan.attainment
    ]
    return plan.model_copy(update={"attainment": rows})


def verify_plan(
    plan: Plan,
    scope: AttainmentScope,
    perf: PerfModel,
    planned: dict[str, float],
    headroom: dict[Job, float],
    root: Path | None,
    stop: str = "",
    progress: Callable[[str], None] | None = None,
    sims: Simulations | None = None,
) -> Plan:
    sims = sims if sims is not None else Simulations(perf, root)
    minutes = scope.attainment.verify_minutes
    # Trace-backed models are also replayed on their whole trace: a verification window that
    # the hour as a whole contradicts is said, not hidden (`ModelAttainment.replay_gap`).
    traced = {m for m, spec in scope.models.items() if trace_of(spec) is not None}
    has_spot = any(i.is_spot for i in plan.instances)
    if progress and minutes > 0:
        whole_trace = f", and {', '.join(sorted(traced))} on the whole trace" if traced else ""
        preempted = ", and again without each spot zone" if has_spot else ""
        progress(
            f"verifying the plan on {minutes:g} min of traffic it was not planned on"
            f"{whole_trace}{preempted}"
        )
    margin = scope.attainment.latency_margin  # steps that many times slower than modelled
    with timing.phase("verification"):
        # At the whole demand, behind the gateway's admission control: a scarce plan's excess
        # is shed as the deployed gateway sheds it, not left out of the traffic.
        sim = (
            sims.run(plan, scope.models, "verify", minutes * 60, None, 1.0, scope.room, margin)
            if minutes > 0
            else {}
        )
        spike = (
            sims.run(
                plan, scope.models, "verify", minutes * 60, None, SPIKE_LOAD, scope.room, margin
            )
            if minutes > 0
            else {}
        )
        whole = (
            sims.run(plan, scope.models, "replay", REPLAY_MAX_S, traced, 1.0, scope.room, margin)
            if minutes > 0 and traced
            else {}
        )
        preempted_att = (
            under_preemption(plan, scope, perf, minutes * 60, root) if minutes > 0 else {}
        )
    rows = []
    for model, spec in sorted(scope.models.items()):
        r = sim.get(model)
        w = whole.get(model)
        s = spike.get(model)
        row = ModelAttainment(
            model=model,
            target=spec.slo_attainment,
            workload=trace_of(spec) or _generated(spec),
            planned=round(planned[model], 4) if model in planned else None,
            verified=round(r.admitted_attainment, 4) if r is not None else None,
            verified_requests=len(r.met) if r is not None else 0,
            replayed=round(w.admitted_attainment, 4) if w is not None and len(w.met) else None,
            verified_minutes=round(float(r.arrival_s[-1]) / 60, 2)
            if r is not None and len(r.arrival_s)
            else 0.0,
            headroom={ph: round(k, 4) for (m, ph), k in sorted(headroom.items()) if m == model},
            under_preemption=round(preempted_att[model], 4) if model in preempted_att else None,
            shed=round(r.shed_share, 4) if r is not None else None,
            held_out_lower=held_out_lower_bound(r) if r is not None else None,
            spike=round(s.admitted_attainment, 4) if s is not None else None,
            spike_shed=round(s.shed_share, 4) if s is not None else None,
            capped=r.capped if r is not None else 0,
        )
        # The cause comes from the run the row is judged by (`ModelAttainment.judged`).
        whole_lower = row.replayed is not None and row.judged == row.replayed != row.verified
        worse = w if whole_lower else r
        if (row.short_by or row.unsupported) and worse is not None:
            cause = (
                row.unsupported
                if row.unsupported and row.judged is not None and row.judged >= row.target
                else _cause(worse, spec.slo_ms.prefill, spec.slo_ms.decode)
            )
            row = row.model_copy(update={"cause": cause})
        rows.append(row)
    return plan.model_copy(update={"attainment": rows, "closed_loop_stop": stop})


def held_out_lower_bound(r: ModelResult, batches: int = HELD_OUT_BATCHES) -> float | None:
    """A one-sided 95% lower confidence bound of the admitted attainment `r` estimates, by batch
    means: the requests in arrival order cut into `batches` consecutive batches, whose shares
    vary as the traffic's bursts do (requests close in time miss together, so a bound that
    treats them as independent draws, like Wilson's, is too narrow). Student's t with
    `batches - 1` degrees of freedom. None with fewer requests than batches."""
    met = r.met
    if len(met) < batches:
        return None
    shares = np.array([b.mean() for b in np.array_split(met.astype(np.float64), batches)])
    spread = float(shares.std(ddof=1)) / math.sqrt(batches)
    return round(
        max(0.0, float(shares.mean()) - float(student_t.ppf(0.95, batches - 1)) * spread), 4
    )


def _cause(r: ModelResult, ttft_slo: float, tpot_slo: float) -> str:
    """Why requests missed, in words: which SLO, and whether long prompts or waiting did it."""
    miss = ~r.met
    n = int(miss.sum())
    if n == 0:
        return ""
    unfinished = int((~np.isfinite(r.finish_s)).sum())
    ttft = r.ttft_ms
    late_first = miss & (ttft > ttft_slo)
    late_tokens = miss & (r.tpot_ms > tpot_slo)
    parts = [f"{n} of {len(miss)} requests missed"]
    if late_first.any():
        finite = ttft[late_first & np.isfinite(ttft)]
        p50 = float(np.median(finite)) if len(finite) else math.inf
        parts.append(
            f"{100 * late_first.sum() / n:.0f}% by TTFT (their median {p50:,.0f} ms vs "
            f"{ttft_slo:g} ms)"
        )
    if late_tokens.any():
        parts.append(f"{100 * late_tokens.sum() / n:.0f}% by TPOT (SLO {tpot_slo:g} ms)")
    if unfinished:
        parts.append(f"{unfinished} never finished in the window")
    if r.prefill_done_s is not None and late_first.any():
        alone = (r.prefill_done_s - r.arrival_s)[late_first] * 1e3
        parts.append(
            f"prefill took {float(np.median(alone[np.isfinite(alone)])):,.0f} ms (median) of it"
            if np.isfinite(alone).any()
            else "prefill never finished"
        )
    return "; ".join(parts)


def _generated(spec: ModelSpec) -> str:
    """What a generated workload is drawn from, for the plan: the named shape, or the lengths
    measured on the fleet (with their source)."""
    m = spec.measured_lengths
    if m is None:
        return f"generated, not a trace ({spec.workload or 'default shape'})"
    return (
        f"generated, not a trace, from measured lengths: prompt mean {m.mean_prompt_tokens:g} "
        f"sigma {m.prompt_sigma:g}, output mean {m.mean_output_tokens:g} sigma "
        f"{m.output_sigma:g}, {m.requests} requests ({m.source})"
    )
