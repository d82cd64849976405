"""Serving-template enumeration (offline stage): node multisets, and each one's best placement.

A serving template is (model, phase, SLO, mode, node multiset, placement, throughput). For each
(model, phase) of a stack this module enumerates multisets of at most N_max nodes whose total GPU
memory lies in [weights, rho x weights], finds each one's throughput-optimal placement
(`solver.templates.placement_search`) under the runtime mode; `solver.templates.pruning` then
drops dominated templates.

Runtime modes:
- general: the paper's space, any set partition of the nodes into S stages (DP inside a stage),
  each node at its best TP degree, per-stage budget SLO/S.
- vllm: what stock vLLM runs: a chain with one stage per node at one TP size (nodes all of one GPU
  count), or one stage per GPU at TP=1 (any mix of node sizes). Decode templates are single-node
  (NixlConnector needs PP=1 on the decode side).

Phases: prefill and decode are throughput in tokens/s of that phase. Aggregated (one replica serves
both) is in requests/s at the model's mean prompt/output lengths: each stage time-shares between
phases, so a node holding j layers serves 1 / (P / T̂pre_j + O / T̂dec_j) requests/s with both
per-stage budgets SLO_phase / S met.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from solver.catalog.offers import Catalog
from solver.performance.analytical import valid_tp_degrees
from solver.performance.perf_model import PerfModel
from solver.stack import FleetConfig, ModelSpec
from solver.templates.placement_search import Placement, place_chain, place_fast
from solver.templates.serving_template import ServingTemplate, Stage, StageMember, template_key
from solver.types import LibPhase, Mode


def available_node_configs(fleet: FleetConfig, catalog: Catalog) -> tuple[list[str], list[str]]:
    """(node configs sold in the fleet's regions, listed ones no offer there sells).

    A node the stack prices itself (`coral:fleet.prices`) in one of its regions is sold there,
    as the market (`build_market`) prices it: paper-helix's a100-40gbx1, l4x2 and t4x2, which
    AWS does not sell, are Helix's cluster.
    """
    if fleet.market.kind == "paper":
        from solver.catalog.paper_market import paper_node_configs

        return paper_node_configs(fleet, catalog)
    regions = {(r.cloud, r.region) for r in fleet.regions}
    sold = {o.node for o in catalog.offers if (o.cloud, o.region) in regions}
    sold |= {p.node for p in fleet.prices if (p.cloud, p.region) in regions}
    return [n for n in fleet.node_configs if n in sold], [
        n for n in fleet.node_configs if n not in sold
    ]


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


@dataclass
class RowSource:
    """T̂ rows (arrays over j = 1..L) of one (model, phase), cached per (node, S, tp, last).

    `last` rows are for the last stage of a pipeline of S > 1 stages, which sends nothing on (no
    hop); every other stage of such a pipeline pays its hop to the next stage.
    """

    perf: PerfModel
    model: str
    phase: LibPhase
    spec: ModelSpec
    node_names: list[str] | None = None  # node configs to tabulate; default: the catalog's

    def __post_init__(self) -> None:
        # (node, S, tp, last) -> (T̂ over j, the TP degree each entry uses)
        self._cache: dict[tuple[str, int, int | None, bool], tuple[np.ndarray, np.ndarray]] = {}
        self._chains: dict[tuple[str, ...], Placement | None] = {}
        self.layers = self.perf.card(self.model).layers
        self._matrix: dict[tuple[int, bool], np.ndarray] = {}  # (S, last) -> every node's row
        self._names = sorted(self.node_names or self.perf.catalog.node_configs)
        self._index = {n: i for i, n in enumerate(self._names)}

    def chosen_tp(self, node: str, stages: int, layers: int, last: bool = False) -> int:
        """TP degree the node's best-TP T̂ entry at `layers` uses (aggregated: both phases')."""
        return int(self._entry(node, stages, None, last)[1][layers - 1])

    def chain_over_gpus(self, gpus: tuple[str, ...]) -> Placement | None:
        """vLLM chain with one TP=1 process per GPU (GPU types in pipeline order), cached:
        many multisets share one GPU sequence (l40sx2 + l40sx1 runs like l40sx1 * 3)."""
        if gpus not in self._chains:
            s = len(gpus)
            table = np.stack(
                [self.row(f"{g}x1", s, 1, last=i == s - 1) for i, g in enumerate(gpus)]
            )
            self._chains[gpus] = place_chain(table, self.layers)
        return self._chains[gpus]

    def rows_for(self, nodes: tuple[str, ...], stages: int, last: bool = False) -> np.ndarray:
        """(len(nodes), L) table of the nodes' T̂ rows at `stages` stages, best TP each."""
        for n in nodes:
            if n not in self._index:  # a node outside `node_names`: tabulate it too
                self._index[n] = len(self._names)
                self._names.append(n)
                self._matrix.clear()
        if (stages, last) not in self._matrix:
            self._matrix[(stages, last)] = np.stack(
                [self.row(n, stages, last=last) for n in self._names]
            )
        return self._matrix[(stages, last)][[self._index[n] for n in nodes]]

    def row(self, node: str, stages: int, tp: int | None = None, last: bool = False) -> np.ndarray:
        """T̂ of `node` holding j = 1..L layers as one of `stages` stages (the last if `last`),
        at TP `tp` (default: the best valid TP per j)."""
        return self._entry(node, stages, tp, last)[0]

    def _entry(
        self, node: str, stages: int, tp: int | None, last: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        key = (node, stages, tp, last)
        if key not in self._cache:
            hop = stages > 1 and not last
            if self.phase != "aggregated":
                self._cache[key] = self._phase_row(self.phase, node, stages, tp, hop)
            else:
                self._cache[key] = self._aggregated_row(node, stages, tp, hop)
        return self._cache[key]

    def _phase_row(
        self, phase: Literal["prefill", "decode"], node: str, s: int, tp: int | None, hop: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        budget = getattr(self.spec.slo_ms, phase) / s
        ctx = (
            self.spec.mean_prompt_tokens if phase == "prefill" else self.spec.decode_context_tokens
        )
        out = np.zeros(self.layers)
        tps = np.full(self.layers, tp or self.perf.catalog.node(node).gpu_count)
        # A decode pipeline of s stages keeps s micro-batches in flight, each holding its KV.
        in_flight = s if phase == "decode" else 1
        for e in self.perf.profile_table(
            self.model, phase, budget, [node], ctx, hop=hop, tp=tp, in_flight=in_flight
        ):
            out[e.layers - 1] = e.tokens_per_s
            tps[e.layers - 1] = e.tp
        return out, tps

    def _aggregated_row(
        self, node: str, s: int, tp: int | None, hop: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Requests/s 1 / (P / T̂pre_j(tp) + O / T̂dec_j(tp)) with both phases at one TP degree.

        A replica runs one TP, so with `tp` None each j takes the TP that maximises the combined
        rate with both budgets met at that TP (the smaller TP on ties), not each phase's own best.
        """
        card, g = self.perf.card(self.model), self.perf.catalog.node(node).gpu_count
        p, o = self.spec.mean_prompt_tokens, self.spec.mean_output_tokens
        best, best_tp = np.zeros(self.layers), np.full(self.layers, tp or g)
        for t in [tp] if tp is not None else valid_tp_degrees(card, g):
            pre = self._phase_row("prefill", node, s, t, hop)[0]
            dec = self._phase_row("decode", node, s, t, hop)[0]
            with np.errstate(divide="ignore"):
                rate = np.where((pre > 0) & (dec > 0), 1.0 / (p / pre + o / dec), 0.0)
            better = rate > best
            best, best_tp = np.where(better, rate, best), np.where(better, t, best_tp)
        return best, best_tp


@dataclass(frozen=True)
class Candidate:
    """A placed multiset before it becomes a `ServingTemplate` (cheap to pickle and prune).

    `procs` lists, in pipeline order within each stage, the processes as (node index, GPU
    indices, TP size); `placement.stages` index into it.
    """

    nodes: tuple[str, ...]
    mode: Mode
    placement: Placement
    procs: tuple[tuple[int, tuple[int, ...], int], ...]

    @property
    def throughput(self) -> float:
        return self.placement.throughput


def best_candidate(rows: RowSource, nodes: tuple[str, ...], mode: Mode) -> Candidate | None:
    """Best placement of one multiset under the mode; None when nothing fits the budgets."""
    if mode == "paper":
        from solver.templates.paper_mode import paper_candidate

        return paper_candidate(rows, nodes)
    if mode == "general":
        # The paper's space; vLLM's chains are runnable too, so general includes them.
        candidates = [_general(rows, nodes), _vllm_per_gpu(rows, nodes, decode_pp1=False)]
    elif rows.phase == "decode" and len(nodes) > 1:
        return None  # vLLM disaggregated decode runs PP=1
    else:
        candidates = [_vllm_per_gpu(rows, nodes)]
    counts = {rows.perf.catalog.node(n).gpu_count for n in nodes}
    if len(counts) == 1 and mode == "vllm":
        candidates.append(vllm_per_node(rows, nodes))
    found = [c for c in candidates if c is not None]
    return max(found, key=lambda c: c.throughput, default=None)


def _general(rows: RowSource, nodes: tuple[str, ...]) -> Candidate | None:
    labels = tuple(sorted(set(nodes)).index(n) for n in nodes)
    stage_counts = range(1, len(nodes) + 1)
    tables = {s: rows.rows_for(nodes, s) for s in stage_counts}
    last = {s: rows.rows_for(nodes, s, last=True) for s in stage_counts}
    placement = place_fast(tables, rows.layers, labels, last=last)
    if placement is None:
        return None
    # Every node serves its stage whole, at the TP degree its profile entry chose.
    s_count = len(placement.stages)
    tps = {
        k: rows.chosen_tp(nodes[k], s_count, j, last=i == s_count - 1)
        for i, (members, j) in enumerate(zip(placement.stages, placement.layers, strict=True))
        for k in members
    }
    procs = tuple(
        (k, tuple(range(rows.perf.catalog.node(n).gpu_count)), tps[k]) for k, n in enumerate(nodes)
    )
    return Candidate(nodes, "general", placement, procs)


def vllm_per_node(rows: RowSource, nodes: tuple[str, ...]) -> Candidate | None:
    """One stage per node, all at the largest TP degree the (uniform) node size allows.

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
            best = Candidate(nodes, "vllm", placement, procs)
    return best


def _vllm_per_gpu(
    rows: RowSource, nodes: tuple[str, ...], decode_pp1: bool = True
) -> Candidate | None:
    """One vLLM process per GPU (TP=1), each its own pipeline stage.

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
            best = Candidate(nodes, "vllm" if decode_pp1 else "general", placement, procs)
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
