"""Library artifact: input hashes detect stale files and name the changed input."""

from __future__ import annotations

from pathlib import Path

import pytest

from solver.errors import InputError
from solver.library import build_library, load_library, save_library
from solver.stack import load_stack
from solver.template_library import prune_dominated

STACKS = Path(__file__).resolve().parents[2] / "stacks"


def test_library_round_trip_and_stale_detection(perf, tmp_path):
    fleet = load_stack(STACKS, "paper-core")
    lib = build_library(perf, fleet, "gpt-oss-20b", "prefill")
    assert lib.stats.kept == len(lib.templates) > 0
    assert lib.stats.enumerated >= lib.stats.feasible >= lib.stats.kept
    for t in lib.templates:
        assert sum(s.layers for s in t.stages) == perf.card("gpt-oss-20b").layers
        assert len({m.tp for s in t.stages for m in s.members}) == 1  # vLLM: one TP size
    save_library(lib, tmp_path)
    assert load_library(tmp_path, perf, fleet, "gpt-oss-20b", "prefill") == lib
    spec = fleet.models["gpt-oss-20b"]
    changed = fleet.model_copy(
        update={
            "models": fleet.models
            | {"gpt-oss-20b": spec.model_copy(update={"mean_prompt_tokens": 4000})}
        }
    )
    with pytest.raises(InputError, match="slo_and_workload"):
        load_library(tmp_path, perf, changed, "gpt-oss-20b", "prefill")


def test_dominated_templates_are_dropped(perf):
    fleet = load_stack(STACKS, "paper-core")
    lib = build_library(perf, fleet, "phi-4", "prefill")
    kept, dropped = prune_dominated(lib.templates)
    assert dropped == 0  # the saved library is already pruned
    best = {tuple(sorted(t.nodes)): t.throughput for t in lib.templates}
    for nodes, tput in best.items():
        for i in range(len(nodes)):
            sub = nodes[:i] + nodes[i + 1 :]
            assert best.get(sub, 0.0) < tput
