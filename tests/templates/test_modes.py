"""Library modes and market sources are strategy objects chosen once from the stack setting.

The stack names them (`library.mode`: vllm, general, paper; `market`: catalog, paper); an unknown
name fails when the stack is parsed, naming the field and the values there are. The stages call
the chosen object (`fleet.library.strategy`, `market_source(fleet.market_scope())`) and never compare the names:
a test reads the source of `solver` and `coral_iac` with `ast` to keep it so.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from solver.catalog.market import MARKET_SOURCES, CatalogMarket, PaperMarket, market_source
from solver.catalog.market_settings import MarketKind
from solver.errors import InputError
from solver.modes import (
    LIBRARY_MODES,
    GeneralMode,
    LibraryMode,
    PaperMode,
    VllmMode,
    library_mode,
)
from solver.serving.candidates import RowSource
from solver.serving.enumeration import best_candidate
from solver.stack import FleetConfig, load_stack, parse_fleet
from solver.types import Mode
from tests.conftest import REPO

DEV = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())["config"]
SOURCE = "stacks/Pulumi.dev.yaml"


def dev(library: dict[str, Any] | None = None, market: Any = None) -> FleetConfig:
    config = copy.deepcopy(DEV)
    if library is not None:
        config["coral:fleet"]["library"] = library
    if market is not None:
        config["coral:fleet"]["market"] = market
    return parse_fleet(config, SOURCE)


def test_one_strategy_per_name_and_the_stack_chooses_it():
    assert list(LIBRARY_MODES) == list(get_args(Mode))
    assert set(MARKET_SOURCES) == set(get_args(MarketKind))
    for name, cls in (("vllm", VllmMode), ("general", GeneralMode), ("paper", PaperMode)):
        fleet = dev(library={"mode": name})
        assert type(fleet.library.strategy) is cls and fleet.library.strategy.name == name
        assert library_mode(name) is fleet.library.strategy
        assert type(dev().with_mode(name).library.strategy) is cls
    assert type(dev().library.strategy) is VllmMode  # the default
    assert type(market_source(dev().market_scope())) is CatalogMarket
    assert type(market_source(dev(market="paper").market_scope())) is PaperMarket


@pytest.mark.parametrize(
    ("library", "market", "field", "allowed"),
    [
        ({"mode": "helix"}, None, "library.mode", "'vllm', 'general' or 'paper'"),
        ({"mode": "Paper"}, None, "library.mode", "'vllm', 'general' or 'paper'"),
        (None, "papr", "market.kind", "'catalog' or 'paper'"),
    ],
)
def test_an_unknown_name_fails_at_the_stack_parse_naming_the_field_and_the_values(
    library, market, field, allowed
):
    with pytest.raises(InputError) as exc:
        dev(library=library, market=market)
    text = str(exc.value)
    assert SOURCE in text and f"coral:fleet: {field}:" in text and allowed in text


def test_an_unknown_mode_option_names_the_option_and_the_modes():
    with pytest.raises(InputError) as exc:
        dev().with_mode("helix")
    assert str(exc.value).startswith("--mode: unknown mode 'helix'")
    assert "use vllm, general or paper" in str(exc.value)
    with pytest.raises(InputError, match="coral:fleet.library.mode: unknown mode 'x'"):
        library_mode("x")


def test_only_vllm_deploys_and_the_others_say_why():
    assert VllmMode().deployable and VllmMode().deploy_problem() is None
    for mode in (GeneralMode(), PaperMode()):
        problem = mode.deploy_problem()
        assert not mode.deployable and problem is not None
        assert problem.startswith(f"coral:fleet.library.mode is '{mode.name}'")
        assert "set mode: vllm" in problem


def test_only_paper_decode_is_coupled():
    for mode in LIBRARY_MODES.values():
        for phase in ("prefill", "decode", "aggregated"):
            assert mode.coupled_decode(phase) == (mode.name == "paper" and phase == "decode")


class Searches:
    """A `PlacementSearches` that names the search each method stands for."""

    def __init__(self, decode: bool, node_count: int, one_gpu_count: bool) -> None:
        self.decode, self.node_count, self.one_gpu_count = decode, node_count, one_gpu_count

    def set_partition(self) -> str:
        return "set_partition"

    def paper(self) -> str:
        return "paper"

    def per_gpu_chain(self, label: Mode, decode_pp1: bool) -> str:
        return f"per_gpu_chain({label}, decode_pp1={decode_pp1})"

    def per_node_chain(self, label: Mode) -> str:
        return f"per_node_chain({label})"


@pytest.mark.parametrize(
    ("mode", "searches", "expected"),
    [
        (
            VllmMode(),
            Searches(False, 2, True),
            ["per_gpu_chain(vllm, decode_pp1=True)", "per_node_chain(vllm)"],
        ),
        (VllmMode(), Searches(False, 2, False), ["per_gpu_chain(vllm, decode_pp1=True)"]),
        (
            VllmMode(),
            Searches(True, 1, True),
            ["per_gpu_chain(vllm, decode_pp1=True)", "per_node_chain(vllm)"],
        ),
        (VllmMode(), Searches(True, 2, True), []),  # vLLM's disaggregated decode runs PP=1
        (
            GeneralMode(),
            Searches(True, 2, True),
            ["set_partition", "per_gpu_chain(general, decode_pp1=False)"],
        ),
        (PaperMode(), Searches(True, 3, False), ["paper"]),
    ],
)
def test_each_mode_picks_the_searches_of_its_space(mode: LibraryMode, searches, expected):
    assert mode.candidates(searches) == expected


def test_best_candidate_takes_the_strategy_or_its_name(perf):
    fleet = load_stack(REPO / "stacks", "dev")
    model = next(iter(fleet.models))
    rows = RowSource(perf, model, "prefill", fleet.models[model], ["l4x1", "l40sx1"])
    for mode in LIBRARY_MODES.values():
        by_strategy = best_candidate(rows, ("l40sx1",), mode)
        assert by_strategy is not None and by_strategy.mode == mode.name
        assert best_candidate(rows, ("l40sx1",), mode.name) == by_strategy


# ----------------------------------------------------------------- no mode names compared

ROOTS = ("solver", "coral_iac")
MODE_MODULE = Path("solver/modes.py")  # the one place that may name a mode in a comparison
PAPER = "paper"
# Packages whose "paper" names something other than a mode: the paper's evaluation (beside the
# pipeline; no stage imports it) compares its set-up variants, paper or ours, each a stack it
# builds through the settings. Comparisons of the settings themselves are checked there too.
OTHER_PAPERS = (Path("solver/evaluation"),)
SETTINGS = {("library", "mode"), ("market", "kind")}  # fleet.library.mode, fleet.market.kind


def _names(node: ast.expr) -> list[str]:
    """The string constants an operand holds: itself, or the items of a literal collection."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for item in node.elts for s in _names(item)]
    return []


def _is_setting(node: ast.expr) -> bool:
    """`<anything>.library.mode` or `<anything>.market.kind`."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and (node.value.attr, node.attr) in SETTINGS
    )


def mode_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, why) for each comparison with the literal "paper" (`==`, `!=`, `in`, a `match`
    case), and each comparison of the stack's mode or market setting with anything."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(PAPER in _names(o) for o in operands):
                out.append((node.lineno, 'compares with "paper"'))
            elif any(_is_setting(o) for o in operands):
                out.append((node.lineno, "compares library.mode or market.kind"))
        elif isinstance(node, ast.Match) and _is_setting(node.subject):
            out.append((node.lineno, "matches on library.mode or market.kind"))
        elif isinstance(node, ast.MatchValue) and PAPER in _names(node.value):
            out.append((node.lineno, 'matches "paper"'))
    return out


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('if fleet.library.mode == "paper":\n    pass\n', 1),
        ('x = kind != "paper"\n', 1),
        ('x = mode in ("vllm", "paper")\n', 1),
        ('x = "paper" == m\n', 1),
        ("x = self.fleet.library.mode != wanted\n", 1),
        ("x = fleet.market.kind is None\n", 1),
        ('match m:\n    case "paper":\n        pass\n', 1),
        ("match fleet.library.mode:\n    case x:\n        pass\n", 1),
        ('x = f.runtime == "vllm"\n', 0),  # the runtime is not a mode
        ('name: str = "paper"\nd = {"paper": 1}\n', 0),  # naming it is not comparing
        ('x = spec.length_routing.mode == "auto"\n', 0),
    ],
)
def test_the_checker_on_examples(source, found):
    assert len(mode_comparisons(source)) == found


def test_no_stage_compares_mode_names():
    """Each stage asks the strategy (`fleet.library.strategy`, `market_source(fleet.market_scope())`); only
    `solver/modes.py` (and `solver.catalog.market`'s table of sources) name the choices."""
    files = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    assert len(files) > 100
    problems = [
        f"{path.relative_to(REPO)}:{line}: {why}"
        for path in files
        if path.relative_to(REPO) != MODE_MODULE
        for line, why in mode_comparisons(path.read_text(encoding="utf-8"))
        if not (
            PAPER in why and any(path.relative_to(REPO).is_relative_to(o) for o in OTHER_PAPERS)
        )
    ]
    assert not problems, "call the mode's strategy instead:\n" + "\n".join(problems)
