"""The library file, format 2: a JSON header line, then the templates as one columnar JSON line.

Format 1 was one pydantic JSON document: loading re-validated every template of every library on
every `coral plan` (35 s of the 54 s of paper-extended's, 57k templates). Format 2:

- line 1, the header: format, model, phase, mode, SLO, input hashes, node configs, stats, the
  stack the library was built for, the template count and the SHA-256 of line 2. It is all
  `load_library` needs to tell a stale file from a fresh one, without reading the templates;
- line 2, the body: the templates as columns (key, node ids, stage ids, budget id, unit id,
  throughput), with the node names, stages, stage budgets and units that templates share stored
  once in tables.

Loading validates the header with pydantic and the body against its hash, then constructs the
templates without re-validating each (`model_construct`): the body is byte for byte what
`encode` wrote from validated templates. Identical stages are one shared (frozen) object.
"""

from __future__ import annotations

import gc
import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from solver.serving.serving_template import ServingTemplate, Stage, StageMember
from solver.types import FROZEN, LibPhase, Mode

FORMAT = 2

StageRow = tuple[int, tuple[tuple[int, tuple[int, ...], int], ...]]  # layers, members


class LibraryStats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    enumerated: int = Field(description="Node multisets within N_max and the memory bounds.")
    feasible: int = Field(description="Multisets with a placement meeting the SLO.")
    dominated: int = Field(description="Dropped: a sub-multiset delivers at least as much.")
    kept: int
    # Wall time is reported by the build but not saved: same inputs must give the same file.
    build_seconds: float = Field(default=0.0, exclude=True)


class LibraryHeader(BaseModel):
    """Line 1 of a format-2 library file."""

    model_config = FROZEN
    format: Literal[2]
    model: str
    phase: LibPhase
    mode: Mode
    slo_ms: dict[str, float]
    input_hashes: dict[str, str]
    node_configs: list[str]
    stats: LibraryStats
    stack: str | None = Field(description="The stack it was built for (None: not recorded).")
    templates: int = Field(ge=0, description="How many templates the body holds.")
    body_sha256: str


def encode_body(templates: list[ServingTemplate]) -> bytes:
    """The body line: templates as columns, shared values interned in tables."""
    nodes: dict[str, int] = {}
    stages: dict[StageRow, int] = {}
    budgets: dict[tuple[float, ...], int] = {}
    units: dict[str, int] = {}
    cols: dict[str, list[Any]] = {
        k: [] for k in ("key", "node_ids", "stage_ids", "budget_id", "unit_id", "throughput")
    }
    for t in templates:
        cols["key"].append(t.key)
        cols["node_ids"].append([nodes.setdefault(n, len(nodes)) for n in t.nodes])
        cols["stage_ids"].append([stages.setdefault(_stage_row(s), len(stages)) for s in t.stages])
        cols["budget_id"].append(budgets.setdefault(tuple(t.stage_budget_ms), len(budgets)))
        cols["unit_id"].append(units.setdefault(t.unit, len(units)))
        cols["throughput"].append(t.throughput)
    body = {
        "nodes": list(nodes),
        "stages": [[layers, [list(m) for m in members]] for layers, members in stages],
        "budgets": [list(b) for b in budgets],
        "units": list(units),
        **cols,
    }
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def _stage_row(s: Stage) -> StageRow:
    return s.layers, tuple((m.node, tuple(m.gpus), m.tp) for m in s.members)


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def decode_body(body: bytes, model: str, phase: LibPhase, mode: Mode) -> list[ServingTemplate]:
    """The templates of a body line whose hash was checked, constructed without validation.

    The cyclic garbage collector is paused meanwhile: the objects built are all kept, and its
    passes over the growing heap took two thirds of the time (1.7 s of 2.3 s, paper-extended).

    Raises:
        KeyError, IndexError, ValueError, TypeError: the body is not what `encode_body` writes.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _decode(json.loads(body), model, phase, mode)
    finally:
        if enabled:
            gc.enable()


def _decode(data: Any, model: str, phase: LibPhase, mode: Mode) -> list[ServingTemplate]:
    names: list[str] = data["nodes"]
    stages = [
        Stage.model_construct(
            layers=layers,
            members=[StageMember.model_construct(node=n, gpus=g, tp=tp) for n, g, tp in members],
        )
        for layers, members in data["stages"]
    ]
    budgets: list[list[float]] = data["budgets"]
    units: list[str] = data["units"]
    make = ServingTemplate.model_construct
    rows = zip(
        data["key"],
        data["node_ids"],
        data["stage_ids"],
        data["budget_id"],
        data["unit_id"],
        data["throughput"],
        strict=True,
    )
    return [
        make(
            key=key,
            model=model,
            phase=phase,
            mode=mode,
            nodes=[names[i] for i in node_ids],
            stages=[stages[i] for i in stage_ids],
            throughput=throughput,
            unit=units[unit],
            stage_budget_ms=list(budgets[budget]),
        )
        for key, node_ids, stage_ids, budget, unit, throughput in rows
    ]
