"""Serving-template library (offline stage): enumerate node multisets, place, prune, save.

A serving template is (model, phase, SLO, mode, node multiset, placement, throughput). For each
(model, phase) of a stack this module enumerates multisets of at most N_max nodes whose total GPU
memory lies in [weights, rho x weights], finds each one's throughput-optimal placement
(`solver/placement.py`) under the runtime mode, and drops dominated templates.

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
from pydantic import BaseModel, ConfigDict, Field

from solver.catalog import Catalog
from solver.perf import valid_tp_degrees
from solver.placement import Placement, place_fast, trim_surplus
from solver.profile import PerfModel
from solver.stack import FleetConfig, Mode, ModelSpec

LibPhase = Literal["prefill", "decode", "aggregated"]
PHASES: tuple[LibPhase, ...] = ("prefill", "decode")
FROZEN = ConfigDict(frozen=True, extra="forbid")


class StageMember(BaseModel):
    """One node (or one GPU of it, for one-process-per-GPU layouts) serving a stage."""

    model_config = FROZEN
    node: int = Field(description="Index into the template's `nodes`.")
    gpus: list[int] = Field(description="GPU indices on that node (CUDA_VISIBLE_DEVICES).")
    tp: int = Field(description="Tensor-parallel size of this process.")


class Stage(BaseModel):
    model_config = FROZEN
    layers: int = Field(gt=0, description="Consecutive layers this stage holds.")
    members: list[StageMember] = Field(min_length=1, description=">1 = data parallel (general).")


class ServingTemplate(BaseModel):
    """A node multiset in one region with its throughput-optimal placement."""

    model_config = FROZEN
    key: str = Field(description="Stable id: the node multiset, e.g. 'l40sx1*3+l4x1'.")
    model: str
    phase: LibPhase
    mode: Mode
    nodes: list[str] = Field(description="Node configs, sorted, one entry per node.")
    stages: list[Stage] = Field(description="Pipeline stages in order.")
    throughput: float = Field(gt=0, description="tokens/s (prefill, decode) or requests/s.")
    unit: Literal["tokens/s", "requests/s"]
    stage_budget_ms: list[float] = Field(description="Per-stage budget per SLO phase.")

    @property
    def layer_partition(self) -> str:
        """VLLM_PP_LAYER_PARTITION: layers per stage, comma-separated."""
        return ",".join(str(s.layers) for s in self.stages)

    @property
    def tp_size(self) -> int:
        return self.stages[0].members[0].tp


def template_key(nodes: tuple[str, ...] | list[str]) -> str:
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n] = counts.get(n, 0) + 1
    return "+".join(f"{n}*{c}" if c > 1 else n for n, c in sorted(counts.items()))


def available_node_configs(fleet: FleetConfig, catalog: Catalog) -> tuple[list[str], list[str]]:
    """(node configs sold in the fleet's regions, listed ones no offer there sells)."""
    regions = {(r.cloud, r.region) for r in fleet.regions}
    sold = {o.node for o in catalog.offers if (o.cloud, o.region) in regions}
    return [n for n in fleet.node_configs if n in sold], [
        n for n in fleet.node_configs if n not in sold
    ]


def enumerate_multisets(
    nodes: list[str], n_max: int, rho: float, weight_bytes: float, catalog: Catalog
) -> Iterator[tuple[str, ...]]:
    """Multisets of at most n_max nodes with weights <= total GPU memory <= rho x weights."""
    mem = {n: catalog.node(n).memory_gb * 1e9 for n in nodes}
    for size in range(1, n_max + 1):
        for combo in itertools.combinations_with_replacement(sorted(nodes), size):
            total = sum(mem[n] for n in combo)
            if weight_bytes <= total <= rho * weight_bytes:
                yield combo


@dataclass
class RowSource:
    """T̂ rows (arrays over j = 1..L) of one (model, phase), cached per (node, S, tp)."""

    perf: PerfModel
    model: str
    phase: LibPhase
    spec: ModelSpec

    def __post_init__(self) -> None:
        self._cache: dict[tuple[str, int, int | None], np.ndarray] = {}
        self._tps: dict[tuple[str, int], np.ndarray] = {}
        self.layers = self.perf.card(self.model).layers

    def chosen_tp(self, node: str, stages: int, layers: int) -> int:
        """TP degree the node's T̂ entry at `layers` uses (prefill's, for aggregated)."""
        self.row(node, stages)
        return int(self._tps[(node, stages)][layers - 1])

    def row(self, node: str, stages: int, tp: int | None = None) -> np.ndarray:
        key = (node, stages, tp)
        if key not in self._cache:
            self._cache[key] = self._compute(node, stages, tp)
        return self._cache[key]

    def _phase_row(
        self, phase: Literal["prefill", "decode"], node: str, s: int, tp: int | None
    ) -> np.ndarray:
        budget = getattr(self.spec.slo_ms, phase) / s
        ctx = (
            self.spec.mean_prompt_tokens if phase == "prefill" else self.spec.decode_context_tokens
        )
        out = np.zeros(self.layers)
        tps = np.full(self.layers, tp or self.perf.catalog.node(node).gpu_count)
        for e in self.perf.profile_table(self.model, phase, budget, [node], ctx, hop=s > 1, tp=tp):
            out[e.layers - 1] = e.tokens_per_s
            tps[e.layers - 1] = e.tp
        if tp is None and (node, s) not in self._tps:
            self._tps[(node, s)] = tps
        return out

    def _compute(self, node: str, s: int, tp: int | None) -> np.ndarray:
        if self.phase != "aggregated":
            return self._phase_row(self.phase, node, s, tp)
        pre, dec = self._phase_row("prefill", node, s, tp), self._phase_row("decode", node, s, tp)
        p, o = self.spec.mean_prompt_tokens, self.spec.mean_output_tokens
        with np.errstate(divide="ignore"):
            return np.where((pre > 0) & (dec > 0), 1.0 / (p / pre + o / dec), 0.0)


def place_multiset(rows: RowSource, nodes: tuple[str, ...], mode: Mode) -> ServingTemplate | None:
    """Best placement of one multiset under the mode; None when nothing fits the budgets."""
    if mode == "general":
        # The paper's space; vLLM's chains are runnable too, so general includes them.
        candidates = [_general(rows, nodes), _vllm_per_gpu(rows, nodes, decode_pp1=False)]
    elif rows.phase == "decode" and len(nodes) > 1:
        return None  # vLLM disaggregated decode runs PP=1
    else:
        candidates = [_vllm_per_gpu(rows, nodes)]
    counts = {rows.perf.catalog.node(n).gpu_count for n in nodes}
    if len(counts) == 1 and mode == "vllm":
        candidates.append(_vllm_per_node(rows, nodes))
    found = [c for c in candidates if c is not None]
    return max(found, key=lambda t: t.throughput, default=None)


def _general(rows: RowSource, nodes: tuple[str, ...]) -> ServingTemplate | None:
    labels = tuple(sorted(set(nodes)).index(n) for n in nodes)
    tables = {s: np.stack([rows.row(n, s) for n in nodes]) for s in range(1, len(nodes) + 1)}
    placement = place_fast(tables, rows.layers, labels)
    if placement is None:
        return None
    stages = [
        Stage(layers=j, members=[_whole_node(rows, nodes[k], k, len(members), j) for k in members])
        for members, j in zip(placement.stages, placement.layers, strict=True)
    ]
    return _template(rows, nodes, stages, placement, "general")


def _whole_node(rows: RowSource, node: str, index: int, s_count: int, layers: int) -> StageMember:
    """A node serving a stage at the TP degree its profile entry chose."""
    cfg = rows.perf.catalog.node(node)
    tp = rows.chosen_tp(node, s_count, layers)
    return StageMember(node=index, gpus=list(range(cfg.gpu_count)), tp=tp)


def _chain(table: np.ndarray, n_layers: int) -> Placement | None:
    """One stage per row: T = min(L-th largest over all rows, each row's T̂_1)."""
    if table.shape[0] > n_layers:
        return None
    mono = np.minimum.accumulate(table, axis=1)
    flat = np.sort(mono.ravel())[::-1]
    t = float(min(flat[n_layers - 1], mono[:, 0].min()))
    if t <= 0:
        return None
    js = trim_surplus([int(np.sum(r >= t * (1 - 1e-12))) for r in mono], n_layers)
    achieved = min(float(mono[i, js[i] - 1]) for i in range(len(js)))
    return Placement(achieved, tuple((i,) for i in range(len(js))), tuple(js))


def _vllm_per_node(rows: RowSource, nodes: tuple[str, ...]) -> ServingTemplate | None:
    """One stage per node, all at the largest TP degree the (uniform) node size allows."""
    card = rows.perf.card(rows.model)
    g = rows.perf.catalog.node(nodes[0]).gpu_count
    tp = max(valid_tp_degrees(card, g))
    table = np.stack([rows.row(n, len(nodes), tp) for n in nodes])
    placement = _chain(table, rows.layers)
    if placement is None:
        return None
    stages = [
        Stage(layers=j, members=[StageMember(node=k, gpus=list(range(tp)), tp=tp)])
        for (k,), j in zip(placement.stages, placement.layers, strict=True)
    ]
    return _template(rows, nodes, stages, placement, "vllm")


def _vllm_per_gpu(
    rows: RowSource, nodes: tuple[str, ...], decode_pp1: bool = True
) -> ServingTemplate | None:
    """One vLLM process per GPU (TP=1), each its own pipeline stage, in node order."""
    procs = [
        (k, g) for k, n in enumerate(nodes) for g in range(rows.perf.catalog.node(n).gpu_count)
    ]
    s = len(procs)
    if decode_pp1 and rows.phase == "decode" and s > 1:
        return None
    gpu_node = {n: f"{rows.perf.catalog.node(n).gpu_id}x1" for n in nodes}
    table = np.stack([rows.row(gpu_node[nodes[k]], s, 1) for k, _ in procs])
    placement = _chain(table, rows.layers)
    if placement is None:
        return None
    stages = [
        Stage(layers=j, members=[StageMember(node=procs[i][0], gpus=[procs[i][1]], tp=1)])
        for (i,), j in zip(placement.stages, placement.layers, strict=True)
    ]
    return _template(rows, nodes, stages, placement, "vllm" if decode_pp1 else "general")


def _template(
    rows: RowSource, nodes: tuple[str, ...], stages: list[Stage], placement: Placement, mode: Mode
) -> ServingTemplate:
    s = len(stages)
    slo = rows.spec.slo_ms
    budgets = {
        "prefill": [slo.prefill / s],
        "decode": [slo.decode / s],
        "aggregated": [slo.prefill / s, slo.decode / s],
    }[rows.phase]
    return ServingTemplate(
        key=template_key(nodes),
        model=rows.model,
        phase=rows.phase,
        mode=mode,
        nodes=list(nodes),
        stages=stages,
        throughput=round(placement.throughput, 6),
        unit="requests/s" if rows.phase == "aggregated" else "tokens/s",
        stage_budget_ms=budgets,
    )


def prune_dominated(templates: list[ServingTemplate]) -> tuple[list[ServingTemplate], int]:
    """Drop a template when a template on a proper sub-multiset of its nodes delivers >= it."""
    by_key = {tuple(sorted(t.nodes)): t.throughput for t in templates}
    kept = []
    for t in templates:
        counts: dict[str, int] = {}
        for n in t.nodes:
            counts[n] = counts.get(n, 0) + 1
        names = sorted(counts)
        dominated = False
        for sub in itertools.product(*(range(counts[n] + 1) for n in names)):
            if sum(sub) in (0, len(t.nodes)):
                continue
            sub_nodes = tuple(
                sorted(
                    itertools.chain.from_iterable([n] * c for n, c in zip(names, sub, strict=True))
                )
            )
            if by_key.get(sub_nodes, 0.0) >= t.throughput:
                dominated = True
                break
        if not dominated:
            kept.append(t)
    return kept, len(templates) - len(kept)
