"""Build, hash, save and load serving-template libraries (one file per model/phase/SLO/mode).

Files are format 2 (`library_format`: a checked header line, then the templates as columns);
a format-1 file (one pydantic document, slow to load) is converted on its first load.

Every library file records a hash of each input (GPU data, node configs, model card, performance
model version, calibration and settings, SLO and request shape, N_max, rho, mode). Loading a file
whose hashes differ from the current inputs is an error that names the changed input, unless the
caller asks for a rebuild: a stale library is never used silently.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from solver.errors import InputError, StaleLibraryError
from solver.io import digest, write_atomic
from solver.performance.analytical import PERF_MODEL_VERSION
from solver.performance.perf_model import PerfModel
from solver.serving.candidates import Candidate, RowSource
from solver.serving.enumeration import (
    available_node_configs,
    enumerate_multisets,
    to_template,
)
from solver.serving.executors import CHUNK, Executor, run_tasks
from solver.serving.library_format import (
    FORMAT,
    LibraryHeader,
    LibraryStats,
    body_digest,
    decode_body,
    encode_body,
)
from solver.serving.placement_search import COUPLED_DECODE_VERSION
from solver.serving.pruning import prune_dominated
from solver.serving.serving_template import ServingTemplate
from solver.stack import LibraryScope
from solver.types import Job, LibPhase, Mode

LIBRARY_FORMAT = FORMAT
log = logging.getLogger("coral.library")


class Library(BaseModel):
    """One (model, phase, SLO, mode) library file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal[2] = 2
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
    perf: PerfModel, scope: LibraryScope, model: str, phase: LibPhase
) -> dict[str, str]:
    """A hash per input, so a mismatch can name what changed."""
    nodes, _ = available_node_configs(scope.market, perf.catalog)
    spec = scope.models[model]
    slo = spec.slo_ms.model_dump()
    hashes = {
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
                "kernels": {g: k.model_dump() for g, k in sorted(perf.calibration.kernels.items())},
                "operators": {
                    f"{gpu}/{shape}/tp{tp}": [t.tokens, t.gemm_ms, t.elementwise_ms]
                    for (gpu, shape, tp), t in sorted(perf.calibration.operators.tables.items())
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
        "n_max": digest(scope.library.n_max),
        "rho": digest(scope.library.rho),
        # The library mode by its name (the template space), apart from the runtime whose
        # overheads `perf_model` records (`perf.runtime`: vllm or helix).
        "mode": digest(scope.library.mode),
    }
    corrections = {f"{g}/{p}": k for (g, m, p), k in sorted(perf.corrections.items()) if m == model}
    if corrections:  # keyed only when measured, so uncalibrated libraries keep their hashes
        hashes["step_corrections"] = digest(corrections)
    if not scope.library.mixing:  # keyed only when off, so mixed libraries keep their hashes
        hashes["mixing"] = digest(False)
    if scope.library.strategy.coupled_decode(phase):  # the paper's coupled decode pipelines
        hashes["placement"] = digest(COUPLED_DECODE_VERSION)
    return hashes


def build_libraries(
    perf: PerfModel,
    scope: LibraryScope,
    jobs: list[Job],
    workers: int = 1,
    progress: Callable[[Job, int, int], None] | None = None,
    executor: Executor = "process",
    ray_address: str | None = None,
    on_built: Callable[[Library], object] | None = None,
) -> list[Library]:
    """Enumerate, place and prune every node multiset of each (model, phase) job.

    All jobs share one pool of workers, so small libraries fill the gaps of large ones.
    `progress(job, done, total)` is called as chunks of multisets finish; `on_built(library)`
    as each job's library is complete (jobs finish in order), so a caller can save it before
    the next one is done and an interrupted build keeps what it finished.
    """
    settings = scope.library
    nodes, _ = available_node_configs(scope.market, perf.catalog)
    multisets: dict[Job, list[tuple[str, ...]]] = {}
    for job in jobs:
        weight = perf.card(job[0]).weight_bytes
        multisets[job] = list(
            enumerate_multisets(
                nodes, settings.n_max, settings.rho, weight, perf.catalog, settings.mixing
            )
        )
    tasks = [
        (job, ms[i : i + CHUNK]) for job, ms in multisets.items() for i in range(0, len(ms), CHUNK)
    ]
    found: dict[Job, list[Candidate]] = {job: [] for job in jobs}
    done = dict.fromkeys(jobs, 0)
    # Jobs run in task order on a shared pool: a job's time is from the previous job's end.
    last_end = time.perf_counter()
    built: dict[Job, Library] = {}
    for (job, chunk), result in zip(
        tasks, run_tasks(perf, scope, tasks, workers, executor, ray_address), strict=True
    ):
        found[job].extend(result)
        done[job] += len(chunk)
        if progress:
            progress(job, done[job], len(multisets[job]))
        if done[job] == len(multisets[job]):
            seconds = time.perf_counter() - last_end
            built[job] = _library(perf, scope, nodes, job, len(multisets[job]), found[job], seconds)
            last_end = time.perf_counter()
            if on_built:
                on_built(built[job])
    for job in jobs:  # a job with no multiset to place has no chunk
        if job not in built:
            built[job] = _library(perf, scope, nodes, job, 0, [], 0.0)
            if on_built:
                on_built(built[job])
    return [built[job] for job in jobs]


def _library(
    perf: PerfModel,
    scope: LibraryScope,
    nodes: list[str],
    job: Job,
    enumerated: int,
    found: list[Candidate],
    seconds: float,
) -> Library:
    """A job's library from its placed candidates: the undominated ones, as templates."""
    model, phase = job
    kept, dominated = prune_dominated(found)
    rows = RowSource(perf, model, phase, scope.models[model], nodes)
    templates = sorted((to_template(rows, c) for c in kept), key=lambda t: t.key)
    return Library(
        model=model,
        phase=phase,
        mode=scope.library.mode,
        slo_ms=_slo_of(scope, model, phase),
        input_hashes=input_hashes(perf, scope, model, phase),
        node_configs=nodes,
        stats=LibraryStats(
            enumerated=enumerated,
            feasible=len(found),
            dominated=dominated,
            kept=len(kept),
            build_seconds=round(seconds, 3),
        ),
        templates=templates,
    )


def build_library(
    perf: PerfModel, scope: LibraryScope, model: str, phase: LibPhase, workers: int = 1
) -> Library:
    """One (model, phase) library; see `build_libraries`."""
    return build_libraries(perf, scope, [(model, phase)], workers)[0]


def _slo_of(scope: LibraryScope, model: str, phase: LibPhase) -> dict[str, float]:
    slo = scope.models[model].slo_ms
    if phase == "aggregated":
        return {"prefill": slo.prefill, "decode": slo.decode}
    return {phase: getattr(slo, phase)}


def save_library(lib: Library, directory: Path, stack: str | None = None) -> Path:
    """Write `lib` to `directory` in format 2 (`library_format`), atomically.

    A reader (or a concurrent `coral plan`) sees the old file or the new one, never half of
    one. The folder's `OWNER` records which stack (when given) and inputs each file was
    built for.

    Returns:
        The file written.
    """
    path = directory / lib.filename
    body = encode_body(lib.templates)
    header = LibraryHeader(
        format=FORMAT,
        **lib.model_dump(include={"model", "phase", "mode", "slo_ms", "input_hashes"}),
        node_configs=lib.node_configs,
        stats=lib.stats,
        stack=stack,
        templates=len(lib.templates),
        body_sha256=body_digest(body),
    )
    write_atomic(path, header.model_dump_json().encode("utf-8") + b"\n" + body + b"\n")
    _record_owner(directory, lib, stack)
    return path


OWNER_FILE = "OWNER"  # JSON; not *.json, which globs of library files match


def _record_owner(directory: Path, lib: Library, stack: str | None) -> None:
    """OWNER: {"stack": name or null, "libraries": {file: digest of its input hashes}}."""
    record = library_owner(directory) or {"stack": None, "libraries": {}}
    if stack is not None:
        record["stack"] = stack
    record["libraries"][lib.filename] = digest(lib.input_hashes)
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    write_atomic(directory / OWNER_FILE, text)


def library_owner(directory: Path) -> dict[str, Any] | None:
    """What `directory/OWNER` records (the stack and each file's inputs), or None."""
    try:
        record = json.loads((directory / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("libraries"), dict)
    return record if ok else None


def load_library(
    directory: Path, perf: PerfModel, scope: LibraryScope, model: str, phase: LibPhase
) -> Library:
    """Load one library file and check its input hashes against the current inputs.

    The header is checked before any template is read; the templates are constructed without
    re-validating each, once the body matches the hash the header records. A format-1 file is
    converted in place (once; it says so), or reported stale when its inputs changed.

    Raises:
        InputError: the file is missing, or unreadable (truncated, edited): rebuilt by
            `coral plan`.
        StaleLibraryError: an input changed since it was built (named).
    """
    path = directory / library_filename(
        model, phase, _slo_of(scope, model, phase), scope.library.mode
    )
    if not path.exists():
        raise InputError(
            str(path),
            "no serving-template library for this model/phase/SLO/mode",
            "run `coral templates build --stack STACK --out DIR`",
        )
    return read_library(path, input_hashes(perf, scope, model, phase))


def read_library(path: Path, current: dict[str, str] | None = None) -> Library:
    """One library file, its header and body hash checked (and its inputs, given `current`).

    Raises:
        InputError: unreadable (truncated, edited).
        StaleLibraryError: its input hashes differ from `current` (named).
    """
    try:
        with path.open("rb") as handle:
            head, body = handle.readline(), handle.read()
    except OSError as exc:
        raise InputError(str(path), f"cannot read it ({exc.strerror})", "check the path") from exc
    if head.startswith(b'{"format":1,'):
        return _convert_format_1(path, head, current)
    header = _header(path, head, body)
    if current is not None:
        _check_fresh(path, header.input_hashes, current)
    templates = decode_body(body.rstrip(b"\n"), header.model, header.phase, header.mode)
    fields = header.model_dump(include={"model", "phase", "mode", "slo_ms", "input_hashes"})
    return Library(
        **fields, node_configs=header.node_configs, stats=header.stats, templates=templates
    )


def _header(path: Path, head: bytes, body: bytes) -> LibraryHeader:
    """The checked header of a format-2 file.

    Raises:
        InputError: not a format-2 header, or the body does not match its hash or count.
    """
    fix = "delete it: `coral plan` rebuilds it (or `coral templates build --stack STACK`)"
    try:
        header = LibraryHeader.model_validate_json(head)
    except ValidationError as exc:
        raise InputError(str(path), f"not a serving-template library: {exc}", fix) from exc
    if body_digest(body.rstrip(b"\n")) != header.body_sha256:
        raise InputError(str(path), "corrupt library: its templates do not match its hash", fix)
    return header


def _check_fresh(path: Path, saved: dict[str, str], current: dict[str, str]) -> None:
    """Raises: StaleLibraryError naming the inputs that changed since the file was built."""
    changed = sorted(k for k in current if saved.get(k) != current[k])
    if changed:
        raise StaleLibraryError(
            str(path),
            f"stale library: input(s) changed since it was built: {', '.join(changed)}",
            "rebuild it with `coral templates build --stack STACK --out DIR` (`coral plan` "
            "rebuilds its own cache; for `pulumi up` set coral:fleet.deploy.rebuild_library)",
        )


def _convert_format_1(path: Path, text: bytes, current: dict[str, str] | None) -> Library:
    """Read a format-1 file (every template validated: slow, once) and rewrite it in format 2.

    Raises:
        StaleLibraryError: its inputs changed (so it is rebuilt, not converted).
    """
    old = json.loads(text)
    if current is not None:
        _check_fresh(path, old.get("input_hashes", {}), current)
    old["format"] = FORMAT
    lib = Library.model_validate(old)
    owner = library_owner(path.parent) or {}
    save_library(lib, path.parent, owner.get("stack"))
    log.warning(
        "converted %s from library format 1 (every template re-validated on each load) to "
        "format %d (loads in a fraction of the time)",
        path,
        FORMAT,
    )
    return lib
