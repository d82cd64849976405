"""`coral plan`'s "even with every available node to itself" line: the most a job could be served
alone counts each node once, shared among the job's own templates (the line once added up
every template's best, as if each had all the nodes, and claimed more than the plan could
ever serve)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from solver.allocation.explain import _alone_throughput


def column(throughput: float, usage: tuple[tuple[str, int], ...], region: str = "r1") -> object:
    return SimpleNamespace(region=region, usage=usage, template=SimpleNamespace(throughput=throughput))


def market(available: dict[tuple[str, str], int], pools: dict[tuple[str, str], int] | None = None):
    gpu_of = {"l4x1": ("l4", 1), "l4x4": ("l4", 4), "h100x1": ("h100", 1)}
    return SimpleNamespace(available=available, gpu_of=gpu_of, gpu_pools=pools or {})


def test_templates_on_the_same_nodes_share_them():
    cols = [column(10.0, (("l4x1", 1),)), column(12.0, (("l4x1", 1),))]
    # Four l4x1 nodes: four instances of the better template, not four of each.
    assert _alone_throughput(cols, market({("r1", "l4x1"): 4})) == pytest.approx(48.0)


def test_templates_on_different_nodes_add_up_and_pools_bind():
    cols = [column(10.0, (("l4x1", 1),)), column(30.0, (("h100x1", 1),))]
    m = market({("r1", "l4x1"): 4, ("r1", "h100x1"): 2})
    assert _alone_throughput(cols, m) == pytest.approx(40.0 + 60.0)
    # An l4 GPU pool of 2 caps the l4 nodes below their availability.
    pooled = market({("r1", "l4x1"): 4, ("r1", "h100x1"): 2}, {("r1", "l4"): 2})
    assert _alone_throughput(cols, pooled) == pytest.approx(20.0 + 60.0)
