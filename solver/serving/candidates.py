"""What every library mode's placement search works on: the T̂ rows of one (model, phase)
(`RowSource`), a placed node multiset (`Candidate`), and mode `general`'s own space (every node
whole in a stage, `general_candidate`), which mode `paper` (`solver.serving.paper_mode`)
shares. `solver.serving.enumeration` picks each multiset's best candidate over the modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from solver.modes import GeneralMode
from solver.performance.analytical import valid_tp_degrees
from solver.performance.perf_model import PerfModel
from solver.serving.placement_search import Placement, place_chain, place_fast
from solver.stack import ModelSpec
from solver.types import LibPhase, Mode


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


def general_candidate(rows: RowSource, nodes: tuple[str, ...]) -> Candidate | None:
    """Best placement of one multiset in the paper's space (mode `general` adds vLLM's chains):
    any set partition of the nodes into stages, DP inside a stage, each node whole at its best
    TP degree; None when nothing fits the budgets."""
    labels = tuple(sorted(set(nodes)).index(n) for n in nodes)
    stage_counts = range(1, len(nodes) + 1)
    tables = {s: rows.rows_for(nodes, s) for s in stage_counts}
    last = {s: rows.rows_for(nodes, s, last=True) for s in stage_counts}
    placement = place_fast(tables, rows.layers, labels, last=last)
    if placement is None:
        return None
    return whole_node_candidate(rows, nodes, placement, GeneralMode.name)


def whole_node_candidate(
    rows: RowSource, nodes: tuple[str, ...], placement: Placement, mode: Mode
) -> Candidate:
    """`placement` with every node serving its stage whole, at the TP degree its profile entry
    chose (the paper's space, and `general`'s part of it)."""
    s_count = len(placement.stages)
    tps = {
        k: rows.chosen_tp(nodes[k], s_count, j, last=i == s_count - 1)
        for i, (members, j) in enumerate(zip(placement.stages, placement.layers, strict=True))
        for k in members
    }
    procs = tuple(
        (k, tuple(range(rows.perf.catalog.node(n).gpu_count)), tps[k]) for k, n in enumerate(nodes)
    )
    return Candidate(nodes, mode, placement, procs)
