"""The paper's template space (Sec. 4.2): one stage per node, TP inside a node, DP in a stage.

Runtime mode `paper` places a node multiset exactly as the paper's per-template ILP allows:

- every node is assigned whole to exactly one pipeline stage (a set partition of the nodes);
- inside a node, its GPUs serve the stage with tensor parallelism (the profile entry's TP degree,
  the best valid one for that layer count; a node never splits across stages);
- several nodes in one stage split its load (data parallelism: their T̂ add up);
- every phase may span several nodes, decode included (multi-node decode);
- the per-stage budget is the phase's SLO / S.

Unlike `general`, it has no per-GPU TP=1 chains (one vLLM process per GPU, several stages inside
a node), which the paper's space does not contain. Templates of this mode are for evaluation and
simulation: stock vLLM runs one TP size per pipeline and PP=1 on the disaggregated decode side,
so it cannot run data-parallel stages, mixed TP degrees or multi-node decode pipelines.
"""

from __future__ import annotations

from dataclasses import replace

from solver.templates.enumeration import Candidate, RowSource, _general
from solver.types import Mode

PAPER_MODE: Mode = "paper"


def paper_candidate(rows: RowSource, nodes: tuple[str, ...]) -> Candidate | None:
    """Best placement of one multiset in the paper's space; None when nothing fits the budgets.

    Args:
        rows: the (model, phase) T̂ rows.
        nodes: the node multiset, in sorted order.

    Returns:
        The throughput-optimal set partition of the nodes into stages (every node whole, at the
        TP degree its profile entry chose), labelled mode `paper`; None if no partition has
        positive throughput.
    """
    found = _general(rows, nodes)
    return None if found is None else replace(found, mode=PAPER_MODE)
