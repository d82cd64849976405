"""The paper's baselines (homo-paper, cauchy-paper) never chain nodes: every replica is one node;
Homo puts a model on one node config, Cauchy picks each phase's config by its own cost
efficiency, one prefill replica feeding several decode replicas."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from coral_iac.cli.app import app
from solver.allocation.baselines import homo_solution
from solver.allocation.paper_baselines import paper_baseline, single_node_columns
from solver.allocation.problem import Column
from solver.catalog.market import Market
from solver.errors import InputError
from solver.plan.planner import plan_stack
from solver.plan.validator import validate_plan
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf

R = ("aws", "r")
PRE, DEC = ("phi-4", "prefill"), ("phi-4", "decode")


def hand_built(
    avail_x: int = 50, avail_y: int = 50, **allocation: Any
) -> tuple[Any, Market, list[Column]]:
    """Node configs x (1 $/h) and y (2 $/h), one region. Prefill: x 100, y 100 units per node;
    decode: x 10, y 100. A chain of two x nodes serves 1000 prefill units for 2 $/h (too good:
    only a chained replica could use it)."""
    f = fleet(
        models={"phi-4": SMALL_FLEET["models"]["phi-4"]},
        allocation={"colocate_phases": False} | allocation,
    )
    market = Market(
        price={(R, "x"): 1.0, (R, "y"): 2.0},
        available={(R, "x"): avail_x, (R, "y"): avail_y},
        gpu_pools={},
        gpu_of={"x": ("gx", 1), "y": ("gy", 1)},
    )

    def col(job: tuple[str, str], node: str, n: int, tput: float) -> Column:
        template = SimpleNamespace(throughput=tput, key=f"{node}*{n}")
        return Column(job, R, template, n * market.price[(R, node)], ((node, n),))  # type: ignore[arg-type]

    columns = [
        col(PRE, "x", 1, 100),
        col(PRE, "y", 1, 100),
        col(PRE, "x", 2, 1000),
        col(DEC, "x", 1, 10),
        col(DEC, "y", 1, 100),
    ]
    return f, market, columns


def bought(columns: list[Column], counts: dict[int, int]) -> dict[tuple[str, str, int], int]:
    """(phase, node config, nodes per replica) -> replicas."""
    out: dict[tuple[str, str, int], int] = {}
    for i, n in counts.items():
        node, k = columns[i].usage[0]
        out[(columns[i].job[1], node, k)] = out.get((columns[i].job[1], node, k), 0) + n
    return out


def test_todays_homo_chains_nodes_and_the_paper_baselines_do_not():
    f, market, columns = hand_built()
    demand = {PRE: 1000.0, DEC: 30.0}  # x is Homo's config; its best prefill is the chain
    today = homo_solution(f.models, f.allocation, market, demand, columns)
    assert any(columns[i].usage[0][1] > 1 for i in today.counts)  # the x*2 chain
    for method in ("homo-paper", "cauchy-paper"):
        cols, s = paper_baseline(method, f.models, f.allocation, market, demand, columns)  # type: ignore[arg-type]
        assert s.fraction == 1 and cols == single_node_columns(columns)
        assert all(cols[i].usage[0][1] == 1 for i in s.counts)


def test_cauchy_picks_each_phase_and_one_prefill_feeds_several_decodes():
    """Prefill is cheapest per unit on x, decode on y: Cauchy splits them (1 x + 3 y = 7 $/h);
    Homo keeps the model on one config, the one best for both phases together (y: 8 $/h)."""
    f, market, columns = hand_built()
    demand = {PRE: 100.0, DEC: 300.0}
    cols, cauchy = paper_baseline("cauchy-paper", f.models, f.allocation, market, demand, columns)
    assert bought(cols, cauchy.counts) == {("prefill", "x", 1): 1, ("decode", "y", 1): 3}
    cols, homo = paper_baseline("homo-paper", f.models, f.allocation, market, demand, columns)
    assert bought(cols, homo.counts) == {("prefill", "y", 1): 1, ("decode", "y", 1): 3}


def test_cauchy_serves_what_the_nodes_allow_on_one_config_per_phase():
    """Two y nodes and one x: decode gets 2 x 100 on y, prefill the x; 300 decode units cannot
    be met, so 2/3 of demand is served, and the binding names the full slots. Decode cannot
    add the x node to its y nodes: one node config per phase (Cauchy's ILP)."""
    f, market, columns = hand_built(avail_x=1, avail_y=2)
    cols, s = paper_baseline(
        "cauchy-paper", f.models, f.allocation, market, {PRE: 100.0, DEC: 300.0}, columns
    )
    assert s.fraction == pytest.approx(2 / 3, abs=1e-3) and s.fraction <= 2 / 3
    assert bought(cols, s.counts) == {("prefill", "x", 1): 1, ("decode", "y", 1): 2}
    assert any(b.startswith("aws:r y: all 2 available nodes are in use") for b in s.binding)


def test_cauchy_paper_refuses_colocated_phases():
    f, market, columns = hand_built(colocate_phases=True)
    with pytest.raises(InputError, match="colocate_phases.*cauchy-paper|cauchy-paper.*region"):
        paper_baseline(
            "cauchy-paper", f.models, f.allocation, market, {PRE: 100.0, DEC: 300.0}, columns
        )


@pytest.mark.parametrize("method", ["homo-paper", "cauchy-paper"])
def test_paper_baselines_on_a_real_library_use_single_node_replicas(method):
    """The small stack's vLLM libraries hold chains of up to 3 nodes; the plans use none."""
    assert any(len(t.nodes) > 1 for lib in libraries().values() for t in lib.templates)
    f = fleet(allocation={"colocate_phases": False})
    p = plan_stack("test", f, perf().catalog, libraries(), method=method)
    p = validate_plan(p, f.plan_scope(), perf().catalog, perf().cards)
    assert p.method == method and p.served_fraction == 1 and p.instances
    assert all(len(i.nodes) == 1 for i in p.instances)


def test_cli_lists_the_paper_baselines():
    r = CliRunner().invoke(app, ["plan", "--stack", "dev", "--baseline", "helix"])
    assert r.exit_code != 0
    assert "homo-paper" in r.output and "cauchy-paper" in r.output
