"""Build, hash, save and load serving-template libraries (one file per model/phase/SLO/mode).

Every library file records a hash of each input (GPU data, node configs, model card, performance
model version, calibration and settings, SLO and request shape, N_max, rho, mode). Loading a file
whose hashes differ from the current inputs is an error that names the changed input, unless the
caller asks for a rebuild: a stale library is never used silently.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from solver.errors import InputError
from solver.perf import PERF_MODEL_VERSION
from solver.profile import PerfModel
from solver.stack import FleetConfig, Mode
from solver.template_library import (
    LibPhase,
    RowSource,
    ServingTemplate,
    available_node_configs,
    enumerate_multisets,
    place_multiset,
    prune_dominated,
)

LIBRARY_FORMAT = 1
Progress = Callable[[int], None]


class LibraryStats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    enumerated: int = Field(description="Node multisets within N_max and the memory bounds.")
    feasible: int = Field(description="Multisets with a placement meeting the SLO.")
    dominated: int = Field(description="Dropped: a sub-multiset delivers at least as much.")
    kept: int
    build_seconds: float


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


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def input_hashes(
    perf: PerfModel, fleet: FleetConfig, model: str, phase: LibPhase
) -> dict[str, str]:
    """A hash per input, so a mismatch can name what changed."""
    nodes, _ = available_node_configs(fleet, perf.catalog)
    spec = fleet.models[model]
    slo = spec.slo_ms.model_dump()
    return {
        "gpu_data": _digest(
            {g: perf.catalog.gpus[g].model_dump() for g in sorted(perf.catalog.gpus)}
        ),
        "node_configs": _digest([perf.catalog.node(n).model_dump() for n in nodes]),
        "model_card": _digest(perf.card(model).model_dump()),
        "perf_model": _digest(
            {
                "version": PERF_MODEL_VERSION,
                "settings": perf.settings.model_dump(),
                "calibration": {
                    g: e.model_dump() for g, e in sorted(perf.calibration.gpus.items())
                },
                "default": perf.calibration.default.model_dump(),
                "measured": sorted(map(str, perf.measured.tables)),
            }
        ),
        "slo_and_workload": _digest(
            {
                "slo": slo,
                "prompt": spec.mean_prompt_tokens,
                "output": spec.mean_output_tokens,
                "phase": phase,
            }
        ),
        "n_max": _digest(fleet.library.n_max),
        "rho": _digest(fleet.library.rho),
        "mode": _digest(fleet.library.mode),
    }


# Worker state: set once per process by the pool initializer (avoids re-sending the model).
_WORKER: dict[str, Any] = {}


def _init_worker(perf: PerfModel, model: str, phase: LibPhase, spec: Any, mode: Mode) -> None:
    _WORKER["rows"] = RowSource(perf, model, phase, spec)
    _WORKER["mode"] = mode


def _place_chunk(chunk: list[tuple[str, ...]]) -> list[ServingTemplate]:
    rows, mode = _WORKER["rows"], _WORKER["mode"]
    return [t for ms in chunk if (t := place_multiset(rows, ms, mode)) is not None]


def build_library(
    perf: PerfModel,
    fleet: FleetConfig,
    model: str,
    phase: LibPhase,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> Library:
    """Enumerate, place and prune every node multiset of one (model, phase) for this stack."""
    start = time.perf_counter()
    spec, settings = fleet.models[model], fleet.library
    nodes, _ = available_node_configs(fleet, perf.catalog)
    multisets = list(
        enumerate_multisets(
            nodes, settings.n_max, settings.rho, perf.card(model).weight_bytes, perf.catalog
        )
    )
    chunks = [multisets[i : i + 256] for i in range(0, len(multisets), 256)]
    found: list[ServingTemplate] = []
    done = 0
    if workers <= 1:
        _init_worker(perf, model, phase, spec, settings.mode)
        results = map(_place_chunk, chunks)
        for chunk, res in zip(chunks, results, strict=True):
            found.extend(res)
            done += len(chunk)
            if progress:
                progress(done, len(multisets))
    else:
        with ProcessPoolExecutor(
            workers, initializer=_init_worker, initargs=(perf, model, phase, spec, settings.mode)
        ) as pool:
            for chunk, res in zip(chunks, pool.map(_place_chunk, chunks), strict=True):
                found.extend(res)
                done += len(chunk)
                if progress:
                    progress(done, len(multisets))
    kept, dominated = prune_dominated(found)
    kept.sort(key=lambda t: t.key)
    return Library(
        model=model,
        phase=phase,
        mode=settings.mode,
        slo_ms=_slo_of(fleet, model, phase),
        input_hashes=input_hashes(perf, fleet, model, phase),
        node_configs=nodes,
        stats=LibraryStats(
            enumerated=len(multisets),
            feasible=len(found),
            dominated=dominated,
            kept=len(kept),
            build_seconds=round(time.perf_counter() - start, 3),
        ),
        templates=kept,
    )


def _slo_of(fleet: FleetConfig, model: str, phase: LibPhase) -> dict[str, float]:
    slo = fleet.models[model].slo_ms
    if phase == "aggregated":
        return {"prefill": slo.prefill, "decode": slo.decode}
    return {phase: getattr(slo, phase)}


def save_library(lib: Library, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / lib.filename
    path.write_text(lib.model_dump_json(indent=1) + "\n", encoding="utf-8")
    return path


def load_library(
    directory: Path, perf: PerfModel, fleet: FleetConfig, model: str, phase: LibPhase
) -> Library:
    """Load one library file and check its input hashes against the current inputs.

    Raises:
        InputError: the file is missing, or an input changed since it was built (named).
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
        raise InputError(
            str(path),
            f"stale library: input(s) changed since it was built: {', '.join(changed)}",
            "rebuild it (`coral templates build ... --rebuild`)",
        )
    return lib
