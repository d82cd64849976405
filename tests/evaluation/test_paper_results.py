"""The paper's reported numbers live in one data file (`solver/data/paper_results.yaml`), each
with its source and the date it was read, and every report reads them from there: the comparison
table's scenarios, `coral bench`'s headline, the Helix and Fig. 1a numbers. No Python source
types them again."""

from __future__ import annotations

import ast
import datetime
import re
from pathlib import Path

import pytest
import yaml

from coral_iac.cli.bench import headline, paper_claim
from solver.errors import InputError
from solver.evaluation.paper_results import FILE, paper_results
from solver.evaluation.scenarios import SCENARIO_KEYS, scenarios
from solver.io import data_path
from tests.conftest import REPO


def test_every_value_has_a_source_and_a_retrieval_date() -> None:
    r = paper_results()
    assert r.paper.arxiv == "2605.04357"
    sourced = [
        *(c for sc in r.scenarios.values() for c in (sc.homo, sc.cauchy, sc.solve_seconds) if c),
        *r.gpus.values(),
        r.helix.cost_vs_helix,
        r.helix.throughput_vs_helix,
        r.helix.coral_gpus,
        r.helix.cluster_gpus,
        r.fig1a.mixed,
        *r.fig1a.pure_h100,
        r.fig1a.plan,
    ]
    for value in sourced:
        assert re.match(r"(Sec\.|Table|Fig\.)", value.source), value
        assert datetime.date(2026, 1, 1) <= value.retrieved <= datetime.date.today()


def test_every_scenario_carries_the_papers_claims() -> None:
    assert [s.key for s in scenarios()] == list(SCENARIO_KEYS)
    for sc in scenarios():
        assert set(sc.paper) == ({"helix"} if sc.key == "helix" else {"homo", "cauchy"}), sc.key
    by = {s.key: s.paper for s in scenarios()}
    assert by["core/default"]["homo"] == {"cost": 1.62, "goodput": None, "text": "1.62x cheaper"}
    # Stated the other way round in the paper: Coral costs 1.52x Homo's, 21% less than Helix's.
    assert by["extended/scarce"]["homo"]["cost"] == 1 / 1.52
    assert by["helix"]["helix"]["cost"] == 1 / 0.79
    assert by["helix"]["helix"]["goodput"] == 1.26


def test_coral_bench_prints_the_papers_claims_beside_a_scenario_stack() -> None:
    assert paper_claim("paper-core") == "Homo: 1.62x cheaper; Cauchy: 1.60x cheaper"
    assert "7.64x goodput" in paper_claim("paper-extended-scarce")
    assert paper_claim("dev") == paper_claim("paper-helix") == ""
    rows = [
        {"stack": "paper-core", "mode": "vllm", "method": m, "usd_per_hour": 10.0}
        | {"served": 1.0, "goodput": 100.0}
        for m in ("coral", "homo", "cauchy")
    ]
    line = next(x for x in headline(rows) if x.startswith("| paper-core |"))
    assert line.endswith("| Homo: 1.62x cheaper; Cauchy: 1.60x cheaper |")


def test_a_value_without_its_source_is_refused(tmp_path: Path) -> None:
    doc = yaml.safe_load(data_path(FILE).read_text(encoding="utf-8"))
    del doc["scenarios"]["core/default"]["homo"]["source"]
    path = tmp_path / FILE
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    with pytest.raises(InputError, match=r"scenarios\.core/default\.homo\.source"):
        paper_results.__wrapped__(path)


def _typed_numbers() -> set[float]:
    r = paper_results()
    claims = [c for sc in r.scenarios.values() for c in (sc.homo, sc.cauchy)]
    numbers = {v for c in claims for v in (c.cost, c.coral_cost, c.goodput) if v not in (None, 1.0)}
    numbers |= {sc.solve_seconds.value for sc in r.scenarios.values() if sc.solve_seconds}
    numbers |= {r.fig1a.mixed.value, *(v.value for v in r.fig1a.pure_h100)}
    numbers |= {abs(r.helix.cost_vs_helix.value), r.helix.throughput_vs_helix.value}
    return {float(n) for n in numbers if n is not None}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            found.add(id(body[0].value))
    return found


def test_no_python_source_types_the_papers_numbers_again() -> None:
    """Not as a number, and not inside a string such as "1.62x" (docstrings may quote them).
    As numbers only the distinctive ones are looked for (three significant digits, not a
    multiple of 0.25 below 100): 1.1 or 1.25 are common constants."""
    numbers = _typed_numbers()
    distinctive = {
        n
        for n in numbers
        if len(f"{n:g}".replace(".", "").lstrip("0")) >= 3 and (n * 4 % 1 or n >= 100)
    }
    pattern = re.compile(
        r"(?<![\d.])(" + "|".join(re.escape(f"{n:g}") for n in sorted(numbers)) + r")x"
    )
    found = []
    for root in ("solver", "coral_iac", "scripts"):
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Constant) or id(node) in docs:
                    continue
                v = node.value
                number = isinstance(v, int | float) and not isinstance(v, bool)
                if number and float(v) in distinctive:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {v}")
                if isinstance(v, str) and pattern.search(v):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {v!r}")
    assert not found, "type these in solver/data/paper_results.yaml instead:\n" + "\n".join(found)
