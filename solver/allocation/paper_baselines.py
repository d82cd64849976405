"""The paper's baselines as the paper defines them (Sec. 5), beside today's stronger variants.

Both use single-node replicas only: a template of one node (its GPUs at TP inside the node), never
a chain of several nodes, as the paper's "2xL40S or 4xL4" (core) and "one 8xA100 or 8xH100 node
per replica" (extended) describe. Labelled `homo-paper` and `cauchy-paper` in plans.

- homo-paper: per model, in stack order and in isolation from the other models, greedily buys the
  most cost-efficient homogeneous single-node replica (`solver.allocation.baselines`'s Homo
  greedy on the single-node columns: best throughput per dollar for the model, falling back to
  the next node config only when availability runs out).
- cauchy-paper: disaggregated with phase-homogeneous replicas, by the paper's description of
  Cauchy (adapted): its resource-allocation ILP, whose objective is each model's cost for the
  capacity it needs. Coral's allocation ILP on the single-node columns with one node config per
  (model, phase) (`Problem.one_config_per_job`): prefill and decode choose their configs
  independently, one prefill replica may feed several decode replicas (the counts are free per
  phase), and costs are minimised jointly.

Under scarcity both follow Coral's rule for each model's served fraction (max-min fair across
models, then the most in total); the paper scales every model alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from solver.allocation.baselines import homo_solution, priorities
from solver.allocation.problem import Column, Problem, Solution
from solver.allocation.solve import solve_allocation
from solver.catalog.market import Market
from solver.errors import InputError
from solver.stack import AllocationSettings, ModelSpec
from solver.types import Job

PaperBaseline = Literal["homo-paper", "cauchy-paper"]


def single_node(col: Column) -> bool:
    """Whether the column's template is one node (no chain of nodes)."""
    return len(col.usage) == 1 and col.usage[0][1] == 1


def single_node_columns(columns: list[Column]) -> list[Column]:
    """The columns of single-node templates: the only replicas the paper's baselines run."""
    return [c for c in columns if single_node(c)]


def paper_baseline(
    method: PaperBaseline,
    models: Mapping[str, ModelSpec],
    allocation: AllocationSettings,
    market: Market,
    demand: dict[Job, float],
    columns: list[Column],
) -> tuple[list[Column], Solution]:
    """Run one of the paper's baselines on the single-node columns.

    Args:
        method: homo-paper or cauchy-paper.
        models: the stack's models (their order and priorities).
        allocation: the stack's allocation settings (colocation, budget).
        market: prices, availability and GPU pools.
        demand: capacity to buy per (model, phase) at a served fraction of 1.
        columns: every (template, region) column.

    Returns:
        The single-node columns, and the solution whose counts index into them.

    Raises:
        InputError: cauchy-paper with `allocation.colocate_phases` true (the paper's Cauchy
            places each phase on its own; it does not pair them per region).
    """
    cols = single_node_columns(columns)
    if method == "homo-paper":
        return cols, homo_solution(models, allocation, market, demand, cols)
    if allocation.colocate_phases and any(ph == "decode" for _, ph in demand):
        raise InputError(
            "coral:fleet.allocation.colocate_phases",
            "the cauchy-paper baseline picks each phase's node config and regions on its own, "
            "so it cannot keep a model's prefill and decode in one region",
            "set colocate_phases: false (the paper's formulation), or use --baseline cauchy",
        )
    problem = Problem(
        demand,
        cols,
        market,
        allocation,
        priorities=priorities(models),
        one_config_per_job=True,
    )
    return cols, solve_allocation(problem)
