"""Build, hash, save and load serving-template libraries (one file per model/phase/SLO/mode).

Every library file records a hash of each input (GPU data, node configs, model card, performance
model version, calibration and settings, SLO and request shape, N_max, rho, mode). Loading a file
whose hashes differ from the current inputs is an error that names the changed input, unless the
caller asks for a rebuild: a stale library is never used silently.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from solver.errors import InputError, StaleLibraryError
from solver.io import digest
from solver.performance.analytical import PERF_MODEL_VERSION
from solver.performance.perf_model import PerfModel
from solver.stack import FleetConfig
from solver.templates.enumeration import (
    Candidate,
    RowSource,
    available_node_configs,
    enumerate_multisets,
    to_template,
)
from solver.templates.executors import CHUNK, Executor, run_tasks
from solver.templates.pruning import prune_dominated
from solver.templates.serving_template import ServingTemplate
from solver.types import Job, LibPhase, Mode

LIBRARY_FORMAT = 1


class LibraryStats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    enumerated: int = Field(description="Node multisets within N_max and the memory bounds.")
    feasible: int = Field(description="Multisets with a placement meeting the SLO.")
    dominated: int = Field(description="Dropped: a sub-multiset delivers at least as much.")
    kept: int
    # Wall time is reported by the build but not saved: same inputs must give the same file.
    build_seconds: float = Field(default=0.0, exclude=True)


class Library(BaseModel):
    """One (model, phase, SLO, mode) library file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal[1] = 1
    model: str
    phase: LibPhase
    mode: Mode
    slo_ms: dict[str, float]
    input_hashes: dict[str, str]
    node_configs: list[str]
    stats: LibraryStats
    templates: list[ServingTemplate]

    @property
    def filename(self) -> str:
        return library_filename(self.model, self.phase, self.slo_ms, self.mode)


def library_filename(model: str, phase: str, slo_ms: dict[str, float], mode: str) -> str:
    slo = "-".join(f"{v:g}" for v in slo_ms.values())
    return f"{model}__{phase}__{slo}ms__{mode}.json"


def input_hashes(
    perf: PerfModel, fleet: FleetConfig, model: str, phase: LibPhase
) -> dict[str, str]:
    """A hash per input, so a mismatch can name what changed."""
    nodes, _ = available_node_configs(fleet, perf.catalog)
    spec = fleet.models[model]
    slo = spec.slo_ms.model_dump()
    return {
        "gpu_data": digest(
            {g: perf.catalog.gpus[g].model_dump() for g in sorted(perf.catalog.gpus)}
        ),
        "node_configs": digest([perf.catalog.node(n).model_dump() for n in nodes]),
        "model_card": digest(perf.card(model).model_dump()),
        "perf_model": digest(
            {
                "version": PERF_MODEL_VERSION,
                "settings": perf.settings.model_dump(),
                "calibration": {
                    g: e.model_dump() for g, e in sorted(perf.calibration.gpus.items())
                },
                "runtime": perf.calibration.runtime(perf.runtime).model_dump()
                | {"name": perf.runtime},
                "allreduce": {
                    k: {t: f.model_dump() for t, f in v.items()}
                    for k, v in sorted(perf.calibration.allreduce.items())
                },
                # The parsed points, not only the keys: a re-measured table must mark it stale.
                "measured": {
                    "/".join(key): {"x": list(t.x), "ms": list(t.ms)}
                    for key, t in sorted(perf.measured.tables.items())
                },
            }
        ),
        "slo_and_workload": digest(
            {
                "slo": slo,
                "prompt": spec.mean_prompt_tokens,
                "output": spec.mean_output_tokens,
                "phase": phase,
            }
        ),
        "n_max": digest(fleet.library.n_max),
        "rho": digest(fleet.library.rho),
        "mode": digest(fleet.library.mode),
    }


def build_libraries(
    perf: PerfModel,
    fleet: FleetConfig,
    jobs: list[Job],
    workers: int = 1,
    progress: Callable[[Job, int, int], None] | None = None,
    executor: Executor = "process",
    ray_address: str | None = None,
) -> list[Library]:
    """Enumerate, place and prune every node multiset of each (model, phase) job.

    All jobs share one pool of workers, so small libraries fill the gaps of large ones.
    `progress(job, done, total)` is called as chunks of multisets finish.
    """
    settings = fleet.library
    nodes, _ = available_node_configs(fleet, perf.catalog)
    multisets: dict[Job, list[tuple[str, ...]]] = {}
    for job in jobs:
        weight = perf.card(job[0]).weight_bytes
        multisets[job] = list(
            enumerate_multisets(nodes, settings.n_max, settings.rho, weight, perf.catalog)
        )
    tasks = [
        (job, ms[i : i + CHUNK]) for job, ms in multisets.items() for i in range(0, len(ms), CHUNK)
    ]
    found: dict[Job, list[Candidate]] = {job: [] for job in jobs}
    done = dict.fromkeys(jobs, 0)
    # Jobs run in task order on a shared pool: a job's time is from the previous job's end.
    last_end = time.perf_counter()
    elapsed: dict[Job, float] = {}
    for (job, chunk), result in zip(
        tasks, run_tasks(perf, fleet, tasks, workers, executor, ray_address), strict=True
    ):
        found[job].extend(result)
        done[job] += len(chunk)
        if done[job] == len(multisets[job]):
            now = time.perf_counter()
            elapsed[job], last_end = now - last_end, now
        if progress:
            progress(job, done[job], len(multisets[job]))
    libraries = []
    for job in jobs:
        model, phase = job
        kept, dominated = prune_dominated(found[job])
        rows = RowSource(perf, model, phase, fleet.models[model], nodes)
        templates = sorted((to_template(rows, c) for c in kept), key=lambda t: t.key)
        libraries.append(
            Library(
                model=model,
                phase=phase,
                mode=settings.mode,
                slo_ms=_slo_of(fleet, model, phase),
                input_hashes=input_hashes(perf, fleet, model, phase),
                node_configs=nodes,
                stats=LibraryStats(
                    enumerated=len(multisets[job]),
                    feasible=len(found[job]),
                    dominated=dominated,
                    kept=len(kept),
                    build_seconds=round(elapsed.get(job, 0.0), 3),
                ),
                templates=templates,
            )
        )
    return libraries


def build_library(
    perf: PerfModel, fleet: FleetConfig, model: str, phase: LibPhase, workers: int = 1
) -> Library:
    """One (model, phase) library; see `build_libraries`."""
    return build_libraries(perf, fleet, [(model, phase)], workers)[0]


def _slo_of(fleet: FleetConfig, model: str, phase: LibPhase) -> dict[str, float]:
    slo = fleet.models[model].slo_ms
    if phase == "aggregated":
        return {"prefill": slo.prefill, "decode": slo.decode}
    return {phase: getattr(slo, phase)}


def save_library(lib: Library, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / lib.filename
    path.write_text(lib.model_dump_json() + "\n", encoding="utf-8")  # compact: files get large
    return path


def load_library(
    directory: Path, perf: PerfModel, fleet: FleetConfig, model: str, phase: LibPhase
) -> Library:
    """Load one library file and check its input hashes against the current inputs.

    Raises:
        InputError: the file is missing.
        StaleLibraryError: an input changed since it was built (named).
    """
    path = directory / library_filename(
        model, phase, _slo_of(fleet, model, phase), fleet.library.mode
    )
    if not path.exists():
        raise InputError(
            str(path),
            "no serving-template library for this model/phase/SLO/mode",
            "run `coral templates build --stack STACK --out DIR`",
        )
    lib = Library.model_validate_json(path.read_text(encoding="utf-8"))
    current = input_hashes(perf, fleet, model, phase)
    changed = sorted(k for k in current if lib.input_hashes.get(k) != current[k])
    if changed:
        raise StaleLibraryError(
            str(path),
            f"stale library: input(s) changed since it was built: {', '.join(changed)}",
            "rebuild it with `coral templates build --stack STACK --out DIR` (`coral plan` "
            "rebuilds its own cache; for `pulumi up` set coral:fleet.deploy.rebuild_library)",
        )
    return lib
