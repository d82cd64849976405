"""Where the library build places its chunks of node multisets: in-process, a process pool, or
Ray actors. Each worker caches its T̂ rows, so a chunk costs only its placements.

SIGINT and SIGTERM during a build end every worker (pool processes are terminated; Ray is shut
down and whatever local Ray process outlives that is killed) before the build stops with
`Terminated`; workers ignore SIGINT (Ctrl-C reaches the whole
process group; the parent decides) and on Linux die with their parent even if it is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import inspect
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypeVar

from solver.errors import InputError
from solver.performance.perf_model import PerfModel
from solver.serving.candidates import Candidate, RowSource
from solver.serving.enumeration import (
    available_node_configs,
    best_candidate,
)
from solver.stack import LibraryScope
from solver.types import Job

Executor = Literal["process", "ray"]
R = TypeVar("R")
CHUNK = 256  # multisets per task: large enough to amortise dispatch, small for a live bar


class _Placer:
    """Places chunks of multisets; one per worker process or Ray actor, caching T̂ rows."""

    def __init__(self, perf: PerfModel, scope: LibraryScope) -> None:
        self.perf, self.scope = perf, scope
        self.nodes, _ = available_node_configs(scope.market, perf.catalog)
        self.rows: dict[Job, RowSource] = {}

    def place(self, job: Job, chunk: list[tuple[str, ...]]) -> list[Candidate]:
        if job not in self.rows:
            model, phase = job
            self.rows[job] = RowSource(
                self.perf, model, phase, self.scope.models[model], self.nodes
            )
        rows, mode = self.rows[job], self.scope.library.strategy
        return [c for ms in chunk if (c := best_candidate(rows, ms, mode)) is not None]


_PLACER: list[_Placer] = []  # the worker process's placer, set by the pool initializer


class Terminated(KeyboardInterrupt):
    """A build stopped by SIGINT or SIGTERM, after its workers were ended.

    A KeyboardInterrupt, so `except Exception` blocks do not swallow it and the CLI stops as for
    Ctrl-C (no traceback, nothing written).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


# Running builds: a pool (None for Ray) and the generator that owns it. A signal ends their
# workers, and closes a generator that is suspended (its `finally` then shuts the pool down).
_LIVE: list[tuple[ProcessPoolExecutor | None, Generator[Any, None, None]]] = []


def _terminate_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate (then kill) every worker process of `pool`; takes none of its locks, so a
    signal handler may call it while the main thread holds one."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    for pool, results in list(_LIVE):
        if pool is not None:
            _terminate_workers(pool)
        if (
            inspect.getgeneratorstate(results) != inspect.GEN_RUNNING
        ):  # suspended: close it now (else the exception ends it)
            results.close()
    raise Terminated(signum)


@contextlib.contextmanager
def _ends_workers_on_signal() -> Iterator[None]:
    """While active (main thread only), SIGINT and SIGTERM end the live builds' workers and
    raise `Terminated`; the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _tracked(pool: ProcessPoolExecutor | None, results: Generator[R, None, None]) -> Iterator[R]:
    """`results`, registered for the signal handler while it runs."""
    entry = (pool, results)
    _LIVE.append(entry)
    try:
        with _ends_workers_on_signal():
            yield from results
    finally:
        _LIVE.remove(entry)
        results.close()


def _prctl(option: int, value: int) -> None:
    """Linux's prctl(2); nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(option, value)


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies (even by SIGKILL)."""
    _prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def _signals_held_while_forking() -> Iterator[None]:
    """Record SIGINT and SIGTERM while a pool forks its workers, and act on them after.

    A signal that arrives during a fork has its exception raised inside an at-fork hook
    (logging's lock release), where Python prints and drops it: Ctrl-C was lost and the plan
    ran on. Recorded, it goes to the handler it was meant for once the workers exist. (A
    signal mask would not do: it holds for one thread, and the kernel hands the signal to
    another.) Main thread only, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, _: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for held_signal, handler in previous.items():
            signal.signal(held_signal, handler)
        for signum in dict.fromkeys(caught):
            meant = previous[signal.Signals(signum)]
            if callable(meant):
                meant(signum, None)  # default_int_handler raises KeyboardInterrupt
            elif meant == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def _init_worker() -> None:
    # A forked worker writes to the real streams, not through a parent's Rich progress proxy
    # (whose lock a parent thread may have held at the fork).
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()


def _init_process(perf: PerfModel, scope: LibraryScope) -> None:
    _init_worker()
    _PLACER[:] = [_Placer(perf, scope)]


def _place_in_process(job: Job, chunk: list[tuple[str, ...]]) -> list[Candidate]:
    return _PLACER[0].place(job, chunk)


def run_tasks(
    perf: PerfModel,
    scope: LibraryScope,
    tasks: list[tuple[Job, list[tuple[str, ...]]]],
    workers: int,
    executor: Executor,
    ray_address: str | None,
) -> Iterator[list[Candidate]]:
    """Results of every task, in task order, from the chosen executor.

    Raises:
        Terminated: SIGINT or SIGTERM arrived; every worker has ended.
    """
    if executor == "ray":
        yield from _tracked(None, _run_on_ray(perf, scope, tasks, workers, ray_address))
    elif workers <= 1:
        placer = _Placer(perf, scope)
        yield from (placer.place(job, chunk) for job, chunk in tasks)
    else:
        pool = ProcessPoolExecutor(workers, initializer=_init_process, initargs=(perf, scope))
        yield from _tracked(pool, _pool_results(pool, _place_in_process, tasks))


def map_in_processes(
    fn: Callable[..., R], tasks: list[tuple[Any, ...]], workers: int
) -> Iterator[R]:
    """`fn(*task)` for every task, in `workers` forked processes, results in task order.

    `fn` must be a module-level function; what it reads besides its arguments (large inputs
    set in a module global before the first task) reaches the workers by fork, not by pickling.
    Signals end the workers as for a library build (module doc).

    Raises:
        Terminated: SIGINT or SIGTERM arrived; every worker has ended.
    """
    pool = _forked_pool(workers)
    yield from _tracked(pool, _pool_results(pool, fn, tasks))


def _forked_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of `workers` processes forked from this one (so they read its module globals)."""
    return ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_worker
    )


def started_in_processes(
    fn: Callable[..., R], tasks: list[tuple[Any, ...]], workers: int
) -> contextlib.AbstractContextManager[list[Future[R]]]:
    """`fn(*task)` for every task, started now in `workers` forked processes while the caller
    goes on with its own work; yields their futures (in task order).

    As for `map_in_processes`, `fn` is module-level and reads its large inputs from a module
    global set before this block. The workers end with the block: an exception in it (Ctrl-C
    included) terminates them; otherwise the block waits for their tasks. Workers ignore SIGINT
    and die with this process."""
    return _submitted(_forked_pool(workers), fn, tasks)


@contextlib.contextmanager
def _submitted(
    pool: ProcessPoolExecutor, fn: Callable[..., R], tasks: list[tuple[Any, ...]]
) -> Iterator[list[Future[R]]]:
    """`fn(*task)` for every task submitted to `pool` (its workers forked with signals held);
    the workers end with the block, however it ends: terminated on an exception, else waited
    for."""
    finished = False
    try:
        with _signals_held_while_forking():
            futures = [pool.submit(fn, *task) for task in tasks]
        yield futures
        finished = True
    finally:
        if not finished:  # an error, a signal, or the consumer stopped early
            _terminate_workers(pool)
        # Waits for the pool's manager thread, so nothing of the pool is left for exit time.
        pool.shutdown(wait=True, cancel_futures=not finished)


def _pool_results(
    pool: ProcessPoolExecutor, fn: Callable[..., R], tasks: list[tuple[Any, ...]]
) -> Generator[R, None, None]:
    """The pool's results in task order; its workers end with it, however it ends.

    Not `pool.map`: closed early, it cancels its futures before the workers end, and the
    pool's manager thread then fails setting the broken pool's error on them
    (InvalidStateError in a thread)."""
    with _submitted(pool, fn, tasks) as futures:
        for future in futures:
            yield future.result()


def _run_on_ray(
    perf: PerfModel,
    scope: LibraryScope,
    tasks: list[tuple[Job, list[tuple[str, ...]]]],
    workers: int,
    address: str | None,
) -> Generator[list[Candidate], None, None]:
    """One Ray actor per worker (each caches its T̂ rows), tasks spread by `ActorPool`."""
    try:  # optional extra; typed as Any so type checks pass with or without it installed
        ray: Any = importlib.import_module("ray")
        actor_pool: Any = importlib.import_module("ray.util").ActorPool
    except ImportError as e:
        raise InputError(
            "--executor", "ray is not installed", "pip install -e '.[ray]' (or use process)"
        ) from e
    started_here = not ray.is_initialized()
    local: dict[int, str] = {}  # the local Ray processes this build started: pid -> start time
    try:
        if started_here:
            _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: Ray's orphans stay our descendants
            try:
                ray.init(
                    address=address, num_cpus=None if address else workers, log_to_driver=False
                )
            except SystemExit as e:  # ray.init's own SIGTERM handler: sys.exit(15)
                if e.code == signal.SIGTERM:
                    raise Terminated(signal.SIGTERM) from None
                raise
            _reclaim_signals()  # that handler would exit with 15 and end nothing
            local = _descendants()
        n_actors = workers if not address else max(1, int(ray.cluster_resources().get("CPU", 1)))
        actor = ray.remote(num_cpus=1)(_Placer)
        pool = actor_pool([actor.remote(perf, scope) for _ in range(n_actors)])
        yield from pool.map(lambda a, t: a.place.remote(*t), tasks)
    finally:
        if started_here:
            local |= _descendants()
            ray.shutdown()
            # After a signal, ray.shutdown() leaves the raylet's agents (DashboardAgent,
            # RuntimeEnvAgent) running (Ray 2.x, measured): end what is left.
            _end_processes(local)


def _reclaim_signals() -> None:
    """Inside a tracked build on the main thread, SIGINT and SIGTERM go to `_on_signal` again."""
    if _LIVE and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _on_signal)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (tells a process from a later one with its pid); None
    once it has exited or is a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _descendants() -> dict[int, str]:
    """Linux: every live descendant of this process, pid -> start time (elsewhere: none)."""
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    todo = [os.getpid()]
    while todo:
        parent = todo.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found and (start := _start_time(pid)):
                found[pid] = start
                todo.append(pid)
    return found


def _end_processes(processes: dict[int, str], grace_s: float = 3.0) -> None:
    """Kill those of `processes` (pid -> start time) still running after `grace_s`."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_start_time(p) == t for p, t in processes.items()):
        time.sleep(0.05)
    for pid, start in processes.items():
        if _start_time(pid) == start:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
