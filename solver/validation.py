"""Checks of user input that need more than one field or file: stack names, the stack against
the catalog and the model cards. (The stack's own lists are checked by `FleetConfig` itself:
`solver.stack.check_lists`.)"""

from __future__ import annotations

import re
from collections.abc import Mapping

from solver.catalog.market import Market, build_market, check_something_available
from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import Catalog
from solver.errors import InputError, unknown_value
from solver.stack import FleetConfig

# What `pulumi stack init` accepts for a stack's own name (no org/project prefix): letters,
# digits, '-', '_' and '.', at most 100 characters.
STACK_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
STACK_NAME_MAX = 100


def check_stack_name(name: str, field: str = "--stack") -> str:
    """`name` if Pulumi would accept it as a stack name.

    Args:
        name: the stack name, e.g. from `--stack`.
        field: the option or key it came from, for the message.

    Returns:
        The name, unchanged.

    Raises:
        InputError: empty, longer than 100 characters, or a character Pulumi rejects (a '/'
            would also leave the stacks folder).
    """
    if STACK_NAME.match(name) and name not in (".", ".."):
        return name
    if len(name) > STACK_NAME_MAX:
        problem = f"stack name of {len(name)} characters (Pulumi allows {STACK_NAME_MAX})"
    elif not name:
        problem = "empty stack name"
    else:
        bad = sorted({c for c in name if not re.match(r"[A-Za-z0-9_.-]", c)}) or [name]
        problem = f"stack name {name!r} has characters Pulumi rejects: {' '.join(map(repr, bad))}"
    raise InputError(
        field,
        problem,
        "use letters, digits, '-', '_' and '.', at most 100 characters (e.g. dev)",
    )


def check_models_against_cards(fleet: FleetConfig, cards: Mapping[str, ModelCard]) -> None:
    """Every model of the stack has a card, and its mean request fits the model's context.

    Args:
        fleet: the stack's fleet.
        cards: the model cards by id (`load_model_cards()`).

    Raises:
        InputError: an unknown model id (with the closest ids), or a mean prompt plus output
            longer than the card's `max_context` (named by its key path).
    """
    for model, spec in fleet.models.items():
        if model not in cards:
            raise unknown_value(f"coral:fleet.models.{model}", model, cards, "model")
        context = cards[model].max_context
        total = spec.mean_prompt_tokens + spec.mean_output_tokens
        if total > context:
            raise InputError(
                f"coral:fleet.models.{model}.mean_prompt_tokens",
                f"mean prompt {spec.mean_prompt_tokens:g} + output {spec.mean_output_tokens:g} "
                f"tokens = {total:g}, above the model's context of {context} tokens",
                f"use a workload whose requests fit {context} tokens "
                "(`coral catalog models` lists each model's context)",
            )


def check_node_configs(fleet: FleetConfig, catalog: Catalog) -> None:
    """Every node config names a known GPU type and a GPU count (`l4x1`, `h100x8`).

    Raises:
        InputError: naming `coral:fleet.node_configs[i]`, with the closest known configs.
    """
    for i, node in enumerate(fleet.node_configs):
        try:
            catalog.node(node)
        except InputError as exc:
            raise InputError(
                f"coral:fleet.node_configs[{i}]", exc.problem, exc.fix, exc.suggestions
            ) from exc


def check_gpu_pools(fleet: FleetConfig, catalog: Catalog) -> None:
    """Every GPU pool names a GPU type one of the stack's node configs uses: a pool of another
    type (a typo such as `l40` for `l40s`) would limit nothing, silently.

    Raises:
        InputError: naming `coral:fleet.gpu_pools[i].gpu`, with the closest GPU types.
    """
    used = sorted({catalog.node(n).gpu_id for n in fleet.node_configs})
    for i, pool in enumerate(fleet.gpu_pools):
        field = f"coral:fleet.gpu_pools[{i}].gpu"
        if pool.gpu not in catalog.gpus:
            raise unknown_value(field, pool.gpu, catalog.gpus, "GPU type")
        if pool.gpu not in used:
            raise InputError(
                field,
                f"no node config of node_configs has {pool.gpu} GPUs: this pool limits nothing",
                f"pool one of the stack's GPU types ({', '.join(used)}), or add a {pool.gpu} "
                "node config",
            )


def check_fleet(fleet: FleetConfig, catalog: Catalog, cards: Mapping[str, ModelCard]) -> None:
    """A parsed stack against the catalog and the model cards, before anything is built.

    Known node configs, GPU pools of the stack's GPU types, regions the catalog sells in (or the
    stack prices), some node available somewhere, known models whose mean request fits their
    context: each error names its key path (`coral:fleet.regions[0].region`) instead of
    surfacing later as an empty plan or an error without a path.

    Raises:
        InputError: the first problem found.
    """
    check_node_configs(fleet, catalog)
    check_gpu_pools(fleet, catalog)
    for i, c in enumerate(fleet.calibration.corrections if fleet.calibration else []):
        if c.gpu not in catalog.gpus:
            raise unknown_value(
                f"coral:fleet.calibration.corrections[{i}].gpu", c.gpu, catalog.gpus, "GPU type"
            )
    scope = fleet.market_scope()
    market = build_market(scope, catalog)
    check_something_available(market, scope)  # also checks the regions
    check_spot_sold(fleet, market)
    check_models_against_cards(fleet, cards)


def check_spot_sold(fleet: FleetConfig, market: Market) -> None:
    """With spot allowed, some node config of the stack sells as spot in one of its regions:
    else every plan would be on-demand while the stack says spot.

    Raises:
        InputError: naming `coral:fleet.allocation.spot.enabled`.
    """
    if fleet.allocation.spot.enabled and not market.spot:
        raise InputError(
            "coral:fleet.allocation.spot.enabled",
            "no node config of the stack sells as spot in its regions (the catalog has no "
            "spot price for them; `coral catalog show` lists spot $/hour)",
            "add a region or node config that sells spot, or set enabled: false",
        )
