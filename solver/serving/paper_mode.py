"""The paper's template space (Sec. 4.2): one stage per node, TP inside a node, DP in a stage.

Library mode `paper` places a node multiset exactly as the paper's per-template ILP allows:

- every node is assigned whole to exactly one pipeline stage (a set partition of the nodes);
- inside a node, its GPUs serve the stage with tensor parallelism (the profile entry's TP degree,
  the best valid one for that layer count; a node never splits across stages);
- several nodes in one stage split its load (data parallelism: their T̂ add up);
- every phase may span several nodes, decode included (multi-node decode);
- the per-stage budget is the phase's SLO / S;
- a decode pipeline runs one micro-batch size at every stage (coupled): the same
  sequences pass through every stage, so the stage with the least KV per sequence (or the
  slowest) caps the batch for all (`solver.serving.placement_search.place_coupled`). The
  paper's per-stage T̂ lets each stage pick its own batch, which a pipeline cannot: measured
  on Helix's cluster, such templates sustained about half their library throughput in the
  simulator (docs/paper-figures.md).

Unlike `general`, it has no per-GPU TP=1 chains (one vLLM process per GPU, several stages inside
a node), which the paper's space does not contain. Templates of this mode are for evaluation and
simulation: stock vLLM runs one TP size per pipeline and PP=1 on the disaggregated decode side,
so it cannot run data-parallel stages, mixed TP degrees or multi-node decode pipelines.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from solver.modes import PaperMode
from solver.serving.candidates import Candidate, RowSource, general_candidate, whole_node_candidate
from solver.serving.placement_search import place_coupled, place_fast
from solver.types import Mode

PAPER_MODE: Mode = PaperMode.name  # the label of this space's candidates
# The coupled decode search's grids: periods geometric from PERIOD_FLOOR x the per-stage budget
# to the budget (ratio 1.04 between neighbours), micro-batches every integer up to 32 then
# geometric (ratio 1.03), plus every T̂ entry's own batch.
PERIODS = 96
PERIOD_FLOOR = 0.025
BATCH_STEP = 1.03


def paper_candidate(
    rows: RowSource, nodes: tuple[str, ...], coupled: bool = True
) -> Candidate | None:
    """Best placement of one multiset in the paper's space; None when nothing fits the budgets.

    Args:
        rows: the (model, phase) T̂ rows.
        nodes: the node multiset, in sorted order.

    Returns:
        The throughput-optimal set partition of the nodes into stages (every node whole, at the
        TP degree its profile entry chose), labelled mode `paper`; None if no partition has
        positive throughput. Decode pipelines of several stages are coupled (one micro-batch
        size at every stage) unless `coupled` is False (the paper's uncoupled T̂, kept to
        measure what the coupling changes).
    """
    if not coupled or rows.phase != "decode" or len(nodes) == 1:
        found = general_candidate(rows, nodes)
        return None if found is None else replace(found, mode=PAPER_MODE)
    return _coupled_decode(rows, nodes)


def _coupled_decode(rows: RowSource, nodes: tuple[str, ...]) -> Candidate | None:
    """Best of: every node in one data-parallel stage (S = 1, not coupled: each node serves its
    own sequences) and the best coupled pipeline of S >= 2 stages."""
    labels = tuple(sorted(set(nodes)).index(n) for n in nodes)
    single = place_fast({1: rows.rows_for(nodes, 1, last=True)}, rows.layers, labels, [1])
    counts = range(2, len(nodes) + 1)
    piped = place_coupled(
        {s: rows.rows_for(nodes, s) for s in counts},
        {s: rows.rows_for(nodes, s, last=True) for s in counts},
        {s: np.stack([coupled_seqs(rows, n, s, False) for n in nodes], axis=1) for s in counts},
        {s: np.stack([coupled_seqs(rows, n, s, True) for n in nodes], axis=1) for s in counts},
        {s: periods(rows, s) for s in counts},
        rows.layers,
        labels,
    )
    found = [p for p in (single, piped) if p is not None]
    if not found:
        return None
    best = max(found, key=lambda p: p.throughput)  # the single stage first on ties
    return whole_node_candidate(rows, nodes, best, PAPER_MODE)


def periods(rows: RowSource, stages: int) -> np.ndarray:
    """The period grid (ms) of an S-stage decode pipeline: up to its per-stage budget."""
    budget = rows.spec.slo_ms.decode / stages
    return budget * np.geomspace(PERIOD_FLOOR, 1.0, PERIODS)


def batch_grid(top: int) -> np.ndarray:
    """Micro-batch sizes tried: 1..32, then geometric, up to `top`."""
    sizes, b = list(range(1, min(top, 32) + 1)), 32.0
    while b * BATCH_STEP <= top:
        b *= BATCH_STEP
        sizes.append(int(b))
    return np.unique(np.array(sizes + [top], dtype=np.int64))


def coupled_seqs(rows: RowSource, node: str, stages: int, last: bool) -> np.ndarray:
    """(PERIODS, L) x(j, p): the most sequences `node` holding j layers runs per micro-batch of
    an S-stage decode pipeline within period p (cached on `rows`).

    The same T̂ entries as the uncoupled table (its TP degree per j, its batch: the KV share of
    one of S micro-batches in flight, the batch cap and the per-stage budget), then, on the
    batch grid, the largest batch whose stage time (`PerfModel.stage_time_ms`, linear in the
    layer count) is within p. Zero where the entry is infeasible.
    """
    cache: dict[tuple[str, int, bool], np.ndarray] = rows.__dict__.setdefault("_coupled", {})
    key = (node, stages, last)
    if key in cache:
        return cache[key]
    perf, ctx = rows.perf, rows.spec.decode_context_tokens
    hop = stages > 1 and not last
    budget = rows.spec.slo_ms.decode / stages
    grid_p = periods(rows, stages)
    entries = perf.profile_table(
        rows.model, "decode", budget, [node], ctx, hop=hop, in_flight=stages
    )
    out = np.zeros((len(grid_p), rows.layers))
    for tp in sorted({e.tp for e in entries}):
        mine = [e for e in entries if e.tp == tp]
        caps = np.array([e.batch for e in mine])
        js = np.array([e.layers for e in mine])
        grid = np.unique(np.concatenate([batch_grid(int(caps.max())), caps]))

        def time(b: int, layers: int, tp: int = tp) -> float:
            return perf.stage_time_ms(rows.model, node, tp, "decode", b, ctx, layers, hop)

        one = np.array([time(int(b), 1) for b in grid])
        per_layer = np.array([time(int(b), 2) for b in grid]) - one
        t = np.maximum.accumulate(js[:, None] * per_layer + (one - per_layer), axis=1)
        ok = (t[None] <= grid_p[:, None, None] * (1 + 1e-9)) & (grid <= caps[:, None])[None]
        out[:, js - 1] = np.where(ok, grid, 0).max(axis=2)
    cache[key] = out
    return out
