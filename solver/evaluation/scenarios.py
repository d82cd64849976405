"""The paper's Sec. 6 scenarios as stacks, and one method planned on one as `coral plan` plans.

A scenario is a committed stack (or a derived one) in one of two variants:

- paper: the stack in the paper's template space (`library.mode: paper`) on the paper market
  (`market: paper`, Table 1 prices), against the paper's baselines homo-paper and cauchy-paper;
- ours: the stack as committed (its mode, the real catalog), against today's homo and cauchy.

The core large-heavy and small-heavy scenarios have no committed stack: they are paper-core with
its 30 requests/s split 80% to qwen3-32b (phi-4) and 10% to each other model, the rule of
`scripts/make_scenario_stacks.py`. paper-helix's paper variant keeps its AWS prices (Table 1 has
no V100, T4 or A100-40GB; the paper used AWS us-east-2 prices there). A scarce stack's GPU pools
are made exhaustive in the paper variant (`exhaustive_pools`).

`plan_recorded` runs `plan_with_library`'s steps (libraries, closed loop and verification,
Coral's searches over restrictions of its templates, validation) for any method and also returns
what the LP relaxation needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from solver.catalog.market import build_market
from solver.catalog.offers import Catalog
from solver.evaluation.paper_results import paper_results
from solver.performance.perf_model import PerfModel
from solver.plan.demand import stack_demand
from solver.plan.planner import libraries_for, plan_to_targets
from solver.plan.validator import validate_plan
from solver.plan_schema import Method, Plan, template_ref
from solver.serving.library import Library
from solver.stack import FleetConfig, GpuPool, load_stack
from solver.types import Job

VARIANTS: dict[str, tuple[Method, ...]] = {
    "paper": ("coral", "homo-paper", "cauchy-paper"),
    "ours": ("coral", "homo", "cauchy"),
}
BASELINES = {"paper": ("homo-paper", "cauchy-paper"), "ours": ("homo", "cauchy")}
# The paper's N_max is 6. In paper mode on the paper market (20 node configs) paper-extended
# has 557,694 multisets per phase (vs 177,398 in vllm mode on the real catalog); measured on the
# 2 shared cores: qwen3-32b prefill (68,764) took 318 s and its coupled decode placed about 70
# multisets/s, so the whole library would take hours. By default the extended paper-setup
# library stops at 4 nodes per template (32,481 per phase). The baselines' single-node templates
# are all in it, so this only takes templates away from Coral: its ratios there are lower
# bounds on the full space's. `--paper-n-max extended=6` builds the paper's whole space.
PAPER_N_MAX = {"extended": 4}
SETUPS = ("core", "extended", "helix")


@dataclass(frozen=True)
class Scenario:
    """One row group of the table: a stack (or a derived one) and the paper's ratios.

    `paper`: per baseline ("homo", "cauchy"; "helix" for Sec. 6.6), the paper's
    {"cost": method $ / Coral $, "goodput": Coral goodput / method goodput, "text": as stated}
    (`solver/data/paper_results.yaml`).
    """

    key: str
    setup: str
    stack: str
    heavy: tuple[str, ...] = ()
    paper: dict[str, dict[str, Any]] = field(default_factory=dict)


# (key, setup, stack, heavy models): the paper's scenarios on our stacks.
_SCENARIOS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("core/default", "core", "paper-core", ()),
    ("core/scarce", "core", "paper-core-scarce", ()),
    ("core/large-heavy", "core", "paper-core", ("qwen3-32b",)),
    ("core/small-heavy", "core", "paper-core", ("phi-4",)),
    ("extended/default", "extended", "paper-extended", ()),
    ("extended/scarce", "extended", "paper-extended-scarce", ()),
    ("extended/large-heavy", "extended", "paper-extended-large-heavy", ()),
    ("extended/small-heavy", "extended", "paper-extended-small-heavy", ()),
    ("helix", "helix", "paper-helix", ()),
)
SCENARIO_KEYS = tuple(key for key, *_ in _SCENARIOS)


@cache
def scenarios() -> tuple[Scenario, ...]:
    """Every scenario, in the table's order, with the paper's claims."""
    reported = paper_results()
    return tuple(
        Scenario(key, setup, stack, heavy, reported.claims(key))
        for key, setup, stack, heavy in _SCENARIOS
    )


def scenario(key: str) -> Scenario:
    """The scenario named `key` (one of SCENARIO_KEYS)."""
    return next(s for s in scenarios() if s.key == key)


def scenario_of_stack(stack: str) -> str | None:
    """The scenario a committed stack is as committed (no heavy split), or None."""
    return next((k for k, _, s, heavy in _SCENARIOS if s == stack and not heavy), None)


def gpu_range(setup: str) -> str:
    """The paper's GPU count for a setup, as stated ("20-40")."""
    return paper_results().gpus[setup].text


# ---------------------------------------------------------------- stacks


def paper_variant(fleet: FleetConfig, keep_market: bool = False) -> FleetConfig:
    """The stack in the paper's template space, on the paper's market (unless `keep_market`)."""
    library = fleet.library.model_copy(update={"mode": "paper"})
    if keep_market:
        return fleet.model_copy(update={"library": library})
    market = fleet.market.model_copy(update={"kind": "paper"})
    return fleet.model_copy(update={"library": library, "market": market})


def heavy_variant(fleet: FleetConfig, heavy: tuple[str, ...]) -> FleetConfig:
    """The same total requests/s, 80% split equally over `heavy`, 20% over the other models."""
    rates = {m: s.demand.requests_per_s or 0.0 for m, s in fleet.models.items() if s.demand}
    total, light = sum(rates.values()), [m for m in fleet.models if m not in heavy]
    models = {}
    for m, spec in fleet.models.items():
        share = 0.8 / len(heavy) if m in heavy else 0.2 / len(light)
        assert spec.demand is not None, f"{m}: the paper stacks give requests/s"
        demand = spec.demand.model_copy(update={"requests_per_s": round(total * share, 4)})
        models[m] = spec.model_copy(update={"demand": demand})
    return fleet.model_copy(update={"models": models})


def scale_demand(fleet: FleetConfig, k: float) -> FleetConfig:
    """Every model's requests/s times `k` (`--demand-scale`: plans at another GPU count).

    Raises:
        ValueError: a model's demand is not given in requests/s.
    """
    if k == 1.0:
        return fleet
    models = {}
    for m, spec in fleet.models.items():
        if spec.demand is None or spec.demand.requests_per_s is None:
            raise ValueError(f"{m}: --demand-scale needs requests_per_s demand")
        demand = spec.demand.model_copy(update={"requests_per_s": spec.demand.requests_per_s * k})
        models[m] = spec.model_copy(update={"demand": demand})
    return fleet.model_copy(update={"models": models})


def scenario_name(sc: Scenario) -> str:
    """The stack name a scenario plans under (a heavy variant's says which models are heavy)."""
    return sc.stack + ("-" + "-".join(sc.heavy) + "-heavy" if sc.heavy else "")


def scenario_fleet(
    sc: Scenario, variant: str, stacks: Path, catalog: Catalog, n_max: int | None = None
) -> FleetConfig:
    """The scenario's stack (from the folder `stacks`) in `variant`; `n_max`: the paper
    variant's library N_max."""
    fleet = load_stack(stacks, sc.stack)
    if sc.heavy:
        fleet = heavy_variant(fleet, sc.heavy)
    if variant == "paper":
        fleet = paper_variant(fleet, keep_market=sc.setup == "helix")
        if sc.setup == "helix":  # one region: colocation binds nothing; cauchy-paper refuses it
            allocation = fleet.allocation.model_copy(update={"colocate_phases": False})
            fleet = fleet.model_copy(update={"allocation": allocation})
        if n_max is not None:
            library = fleet.library.model_copy(update={"n_max": n_max})
            fleet = fleet.model_copy(update={"library": library})
        fleet = exhaustive_pools(fleet, catalog)
    return fleet


def exhaustive_pools(fleet: FleetConfig, catalog: Catalog) -> FleetConfig:
    """A scarce stack's GPU pools as the only GPUs there are: a (region, GPU) the stack's pools
    leave out gets a pool of 0. The pools list what the real catalog sells there; the paper
    market sells H100 and A100 in every region, and without this those unlisted pairs keep the
    market's ample availability, so the scarce paper-setup plans matched the default ones."""
    if not fleet.gpu_pools:
        return fleet
    market = build_market(fleet.market_scope(), catalog)
    listed = {((p.cloud, p.region), p.gpu) for p in fleet.gpu_pools}
    sold = sorted({(region, market.gpu_of[node][0]) for region, node in market.price})
    extra = [
        GpuPool(cloud=region[0], region=region[1], gpu=gpu, gpus=0)
        for region, gpu in sold
        if (region, gpu) not in listed
    ]
    return fleet.model_copy(update={"gpu_pools": [*fleet.gpu_pools, *extra]})


def library_dir(cache: Path, fleet: FleetConfig, setup: str, variant: str) -> Path:
    """One library folder per setup, variant and N_max (scenarios of a setup share it)."""
    return cache / f"{setup}__{variant}__n{fleet.library.n_max}"


def cluster_cost(fleet: FleetConfig, perf: PerfModel) -> float:
    """$/hour of every node the stack makes available (Helix rents its whole cluster)."""
    market = build_market(fleet.market_scope(), perf.catalog)
    return sum(market.price[s] * n for s, n in market.available.items())


# ---------------------------------------------------------------- planning


@dataclass
class Planned:
    plan: Plan
    factors: dict[str, float]  # the capacity factors the returned plan was solved with
    libs: dict[Job, Library]
    seconds: float


def plan_recorded(
    name: str,
    fleet: FleetConfig,
    perf: PerfModel,
    directory: Path,
    method: Method,
    workers: int,
    root: Path,
) -> Planned:
    """`plan_with_library`'s steps (libraries, closed loop and verification, validation), also
    returning the capacity factors of the round the loop kept, for the LP relaxation. `root`:
    the project folder relative trace paths are read from."""
    t0 = time.perf_counter()
    libs = libraries_for(
        perf,
        fleet,
        list(stack_demand(fleet.models)),
        directory,
        True,
        workers,
        stack=name,
        force=True,
    )
    rounds: list[tuple[Plan, dict[str, float]]] = []
    plan = plan_to_targets(
        name,
        fleet,
        perf,
        libs,
        method=method,
        root=root,
        cache=directory,
        workers=workers,
        on_solve=lambda plan, factors: rounds.append((plan, factors)),
    )
    factors = next(
        (
            f
            for p, f in reversed(rounds)
            if p.instances == plan.instances and p.capacity_factors == plan.capacity_factors
        ),
        rounds[-1][1],
    )
    library = {
        template_ref(m, ph, t.key): t for (m, ph), lib in libs.items() for t in lib.templates
    }
    plan = validate_plan(plan, fleet.plan_scope(), perf.catalog, perf.cards, library)
    return Planned(plan, factors, libs, time.perf_counter() - t0)
