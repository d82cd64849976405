"""Serving-template enumeration (offline stage): node multisets, and each one's best placement.

A serving template is (model, phase, SLO, mode, node multiset, placement, throughput). For each
(model, phase) of a stack this module enumerates multisets of at most N_max nodes whose total GPU
memory lies in [weights, rho x weights], finds each one's throughput-optimal placement
(`solver.serving.placement_search`) in the library mode's space; `solver.serving.pruning`
then drops dominated templates.

Library modes (`solver.modes`: each mode's `candidates` picks among the searches here):
- general: the paper's space, any set partition of the nodes into S stages (DP inside a stage),
  each node at its best TP degree, per-stage budget SLO/S; plus vLLM's per-GPU chains.
- vllm: what stock vLLM runs: a chain with one stage per node at one TP size (nodes all of one GPU
  count), or one stage per GPU at TP=1 (any mix of node sizes). Decode templates are single-node
  (NixlConnector needs PP=1 on the decode side).
- paper: exactly the paper's space, decode pipelines coupled (`solver.serving.paper_mode`).

Phases: prefill and decode are throughput in tokens/s of that phase. Aggregated (one replica serves
both) is in requests/s at the model's mean prompt/output lengths: each stage time-shares between
phases, so a node holding j layers serves 1 / (P / T̂pre_j + O / T̂dec_j) requests/s with both
per-stage budgets SLO_phase / S met.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from solver.catalog.market import market_source
from solver.catalog.offers import Catalog
from solver.modes import LibraryMode, VllmMode, library_mode
from solver.performance.analytical import valid_tp_degrees
from solver.serving.candidates import Candidate, general_candidate
from solver.serving.candidates import RowSource as RowSource  # re-exported: solver/evaluation
from solver.serving.paper_mode import paper_candidate
from solver.serving.placement_search import place_chain
from solver.serving.serving_template import ServingTemplate, Stage, StageMember, template_key
from solver.stack import MarketScope
from solver.types import Mode


def available_node_configs(scope: MarketScope, catalog: Catalog) -> tuple[list[str], list[str]]:
    """(node configs sold in the stack's regions, listed ones no offer there sells), as the
    stack's market source says (`solver.catalog.market.MarketSource.node_configs`).

    A node the stack prices itself (`coral:fleet.prices`) in one of its regions is sold there,
    as the market (`build_market`) prices it: paper-helix's a100-40gbx1, l4x2 and t4x2, which
    AWS does not sell, are Helix's cluster.
    """
    return market_source(scope).node_configs(scope, catalog)


def enumerate_multisets(
    nodes: list[str],
    n_max: int,
    rho: float,
    weight_bytes: float,
    catalog: Catalog,
    mixing: bool = True,
) -> Iterator[tuple[str, ...]]:
    """Multisets of at most n_max nodes with weights <= total GPU memory <= rho x weights;
    without `mixing`, only those whose nodes all carry one GPU type."""
    mem = {n: catalog.node(n).memory_gb * 1e9 for n in nodes}
    gpu = {n: catalog.node(n).gpu_id for n in nodes}
    for size in range(1, n_max + 1):
        for combo in itertools.combinations_with_replacement(sorted(nodes), size):
            if not mixing and len({gpu[n] for n in combo}) > 1:
                continue
            total = sum(mem[n] for n in combo)
            if weight_bytes <= total <= rho * weight_bytes:
                yield combo


def best_candidate(
    rows: RowSource, nodes: tuple[str, ...], mode: LibraryMode | Mode
) -> Candidate | None:
    """Best placement of one multiset in the mode's space; None when nothing fits the budgets.

    Args:
        mode: the stack's mode (`fleet.library.strategy`); a mode's name (as a script passes
            `fleet.library.mode`) is looked up.
    """
    strategy = library_mode(mode) if isinstance(mode, str) else mode
    found = [c for c in strategy.candidates(_Searches(rows, nodes)) if c is not None]
    return max(found, key=lambda c: c.throughput, default=None)


@dataclass(slots=True)
class _Searches:
    """The placement searches of one multiset (`solver.modes.PlacementSearches`), which a
    mode's `candidates` picks from."""

    rows: RowSource
    nodes: tuple[str, ...]

    @property
    def decode(self) -> bool:
        return self.rows.phase == "decode"

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    @property
    def one_gpu_count(self) -> bool:
        return len({self.rows.perf.catalog.node(n).gpu_count for n in self.nodes}) == 1

    def set_partition(self) -> Candidate | None:
        return general_candidate(self.rows, self.nodes)

    def paper(self) -> Candidate | None:
        return paper_candidate(self.rows, self.nodes)

    def per_gpu_chain(self, label: Mode, decode_pp1: bool) -> Candidate | None:
        return _vllm_per_gpu(self.rows, self.nodes, label, decode_pp1)

    def per_node_chain(self, label: Mode) -> Candidate | None:
        return vllm_per_node(self.rows, self.nodes, label)


def vllm_per_node(
    rows: RowSource, nodes: tuple[str, ...], label: Mode = VllmMode.name
) -> Candidate | None:
    """One stage per node, all at the largest TP degree the (uniform) node size allows,
    labelled with the mode `label` (vllm, the one mode whose space holds it).

    Pipeline order: by node config, except that the config whose node ends the chain best (the
    last stage sends no hop) goes last; the sorted order wins ties.
    """
    card = rows.perf.card(rows.model)
    tp = max(valid_tp_degrees(card, rows.perf.catalog.node(nodes[0]).gpu_count))
    s, best = len(nodes), None
    for end in sorted(set(nodes), reverse=True):  # the sorted order first
        order = sorted(range(s), key=lambda k: (nodes[k] == end, nodes[k], k))
        table = np.stack([rows.row(nodes[k], s, tp, last=i == s - 1) for i, k in enumerate(order)])
        placement = place_chain(table, rows.layers)
        if placement is not None and (best is None or placement.throughput > best.throughput):
            procs = tuple((k, tuple(range(tp)), tp) for k in order)
            best = Candidate(nodes, label, placement, procs)
    return best


def _vllm_per_gpu(
    rows: RowSource, nodes: tuple[str, ...], label: Mode, decode_pp1: bool
) -> Candidate | None:
    """One vLLM process per GPU (TP=1), each its own pipeline stage, labelled with the mode
    `label` whose space it is placed in; with `decode_pp1`, decode only on a single GPU.

    Pipeline order: by GPU type, then node, then GPU, except that the GPU type whose process
    ends the chain best (the last stage sends no hop) goes last; the sorted order wins ties. A
    node's GPUs stay adjacent, and every multiset with the same GPUs shares the cached chains.
    """
    cfgs = [rows.perf.catalog.node(n) for n in nodes]
    if decode_pp1 and rows.phase == "decode" and sum(c.gpu_count for c in cfgs) > 1:
        return None
    best = None
    for end in sorted({c.gpu_id for c in cfgs}, reverse=True):  # the sorted order first
        procs = tuple(
            sorted(
                ((k, (g,), 1) for k, c in enumerate(cfgs) for g in range(c.gpu_count)),
                key=lambda p: (cfgs[p[0]].gpu_id == end, cfgs[p[0]].gpu_id, p[0], p[1]),
            )
        )
        placement = rows.chain_over_gpus(tuple(cfgs[k].gpu_id for k, _, _ in procs))
        if placement is not None and (best is None or placement.throughput > best.throughput):
            best = Candidate(nodes, label, placement, procs)
    return best


def to_template(rows: RowSource, cand: Candidate) -> ServingTemplate:
    """The full template of a candidate: stages with their processes, budgets, key."""
    stages = [
        Stage(
            layers=j,
            members=[
                StageMember(node=cand.procs[i][0], gpus=list(cand.procs[i][1]), tp=cand.procs[i][2])
                for i in members
            ],
        )
        for members, j in zip(cand.placement.stages, cand.placement.layers, strict=True)
    ]
    s = len(stages)
    slo = rows.spec.slo_ms
    budgets = {
        "prefill": [slo.prefill / s],
        "decode": [slo.decode / s],
        "aggregated": [slo.prefill / s, slo.decode / s],
    }[rows.phase]
    return ServingTemplate(
        key=template_key(cand.nodes),
        model=rows.model,
        phase=rows.phase,
        mode=cand.mode,
        nodes=list(cand.nodes),
        stages=stages,
        throughput=round(cand.throughput, 6),
        unit="requests/s" if rows.phase == "aggregated" else "tokens/s",
        stage_budget_ms=budgets,
    )
