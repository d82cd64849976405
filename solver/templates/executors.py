"""Where the library build places its chunks of node multisets: in-process, a process pool, or
Ray actors. Each worker caches its T̂ rows, so a chunk costs only its placements."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Literal

from solver.errors import InputError
from solver.performance.perf_model import PerfModel
from solver.stack import FleetConfig
from solver.templates.enumeration import (
    Candidate,
    RowSource,
    available_node_configs,
    best_candidate,
)
from solver.types import Job

Executor = Literal["process", "ray"]
CHUNK = 256  # multisets per task: large enough to amortise dispatch, small for a live bar


class _Placer:
    """Places chunks of multisets; one per worker process or Ray actor, caching T̂ rows."""

    def __init__(self, perf: PerfModel, fleet: FleetConfig) -> None:
        self.perf, self.fleet = perf, fleet
        self.nodes, _ = available_node_configs(fleet, perf.catalog)
        self.rows: dict[Job, RowSource] = {}

    def place(self, job: Job, chunk: list[tuple[str, ...]]) -> list[Candidate]:
        if job not in self.rows:
            model, phase = job
            self.rows[job] = RowSource(
                self.perf, model, phase, self.fleet.models[model], self.nodes
            )
        rows, mode = self.rows[job], self.fleet.library.mode
        return [c for ms in chunk if (c := best_candidate(rows, ms, mode)) is not None]


_PLACER: list[_Placer] = []  # the worker process's placer, set by the pool initializer


def _init_process(perf: PerfModel, fleet: FleetConfig) -> None:
    _PLACER[:] = [_Placer(perf, fleet)]


def _place_in_process(job: Job, chunk: list[tuple[str, ...]]) -> list[Candidate]:
    return _PLACER[0].place(job, chunk)


def run_tasks(
    perf: PerfModel,
    fleet: FleetConfig,
    tasks: list[tuple[Job, list[tuple[str, ...]]]],
    workers: int,
    executor: Executor,
    ray_address: str | None,
) -> Iterator[list[Candidate]]:
    """Results of every task, in task order, from the chosen executor."""
    if executor == "ray":
        yield from _run_on_ray(perf, fleet, tasks, workers, ray_address)
    elif workers <= 1:
        placer = _Placer(perf, fleet)
        yield from (placer.place(job, chunk) for job, chunk in tasks)
    else:
        with ProcessPoolExecutor(
            workers, initializer=_init_process, initargs=(perf, fleet)
        ) as pool:
            yield from pool.map(_place_in_process, *zip(*tasks, strict=True))


def _run_on_ray(
    perf: PerfModel,
    fleet: FleetConfig,
    tasks: list[tuple[Job, list[tuple[str, ...]]]],
    workers: int,
    address: str | None,
) -> Iterator[list[Candidate]]:
    """One Ray actor per worker (each caches its T̂ rows), tasks spread by `ActorPool`."""
    try:  # optional extra; typed as Any so type checks pass with or without it installed
        ray: Any = importlib.import_module("ray")
        actor_pool: Any = importlib.import_module("ray.util").ActorPool
    except ImportError as e:
        raise InputError(
            "--executor", "ray is not installed", "pip install -e '.[ray]' (or use process)"
        ) from e
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, num_cpus=None if address else workers, log_to_driver=False)
    try:
        n_actors = workers if not address else max(1, int(ray.cluster_resources().get("CPU", 1)))
        actor = ray.remote(num_cpus=1)(_Placer)
        pool = actor_pool([actor.remote(perf, fleet) for _ in range(n_actors)])
        yield from pool.map(lambda a, t: a.place.remote(*t), tasks)
    finally:
        if started_here:
            ray.shutdown()


