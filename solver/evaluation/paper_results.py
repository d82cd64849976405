"""The paper's reported numbers (`solver/data/paper_results.yaml`), typed and checked.

Every number our evaluation sets beside the paper's comes from that one file, each with its
source in the paper and the date it was read. `paper_results()` loads it once per process;
`PaperResults.claims` gives a scenario's claims in the shape the comparison table stores
(`{"homo": {"cost", "goodput", "text"}, ...}`), `PaperResults.summary` the one line
`coral bench` prints beside a stack's ratios.
"""

from __future__ import annotations

import datetime
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from solver.io import data_path, load_yaml_model

FILE = "paper_results.yaml"
BASELINE_NAMES = {"homo": "Homo", "cauchy": "Cauchy"}


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Sourced(_Model):
    """Where in the paper a value is stated, and when it was read into the repository."""

    source: str = Field(min_length=1)
    retrieved: datetime.date


class Value(Sourced):
    value: float


class Text(Sourced):
    text: str = Field(min_length=1)


class Claim(Sourced):
    """One baseline against Coral: `cost` is the baseline's $/hour over Coral's (or, as the
    paper may state it, `coral_cost`: Coral's over the baseline's); `goodput` Coral's goodput
    over the baseline's; `text` the claim in the paper's words."""

    cost: float | None = Field(default=None, gt=0)
    coral_cost: float | None = Field(default=None, gt=0)
    goodput: float | None = Field(default=None, gt=0)
    text: str = Field(min_length=1)

    @model_validator(mode="after")
    def _one_cost(self) -> Claim:
        if (self.cost is None) == (self.coral_cost is None):
            raise ValueError("give one of cost (baseline over Coral) and coral_cost")
        return self

    @property
    def baseline_over_coral(self) -> float:
        """The baseline's $/hour over Coral's."""
        return self.cost if self.cost is not None else 1.0 / (self.coral_cost or 1.0)

    def row(self) -> dict[str, Any]:
        """The table's shape: {"cost", "goodput", "text"}."""
        return {"cost": self.baseline_over_coral, "goodput": self.goodput, "text": self.text}


class Scenario(_Model):
    homo: Claim
    cauchy: Claim
    solve_seconds: Value | None = None  # the paper's allocation solve time, where stated


class Helix(_Model):
    """Sec. 6.6: Coral against Helix, which rents its whole cluster."""

    text: str = Field(min_length=1)
    cost_vs_helix: Value  # Coral's cost relative to Helix's, -0.21: 21% less
    throughput_vs_helix: Value
    coral_gpus: Value
    cluster_gpus: Value

    def claim(self) -> dict[str, Any]:
        """The table's helix row: Helix's $/hour over Coral's, Coral's throughput over Helix's."""
        return {
            "cost": 1.0 / (1.0 + self.cost_vs_helix.value),
            "goodput": 1.0 + self.throughput_vs_helix.value,
            "text": self.text,
        }


class Plan(Sourced):
    nodes: list[str] = Field(min_length=1)


class Fig1a(_Model):
    """Sec. 1 / Fig. 1a: tokens/s per USD of the best mixed plan and of pure H100 ones."""

    mixed: Value
    pure_h100: list[Value] = Field(min_length=1)
    plan: Plan

    def numbers(self) -> dict[str, Any]:
        """{"mixed": 526.0, "pure_h100": [...]}, as the figures print them."""
        return {"mixed": self.mixed.value, "pure_h100": [v.value for v in self.pure_h100]}


class Paper(_Model):
    authors: str
    arxiv: str


class PaperResults(_Model):
    schema_version: Literal[1]
    paper: Paper
    gpus: dict[str, Text]  # per setup: core, extended, helix
    scenarios: dict[str, Scenario]
    helix: Helix
    fig1a: Fig1a

    def claims(self, key: str) -> dict[str, dict[str, Any]]:
        """A scenario's claims per baseline ({} for a scenario the paper does not report)."""
        if key == "helix":
            return {"helix": self.helix.claim()}
        sc = self.scenarios.get(key)
        return {} if sc is None else {"homo": sc.homo.row(), "cauchy": sc.cauchy.row()}

    def summary(self, key: str, with_solve_time: bool = False) -> str:
        """One line: "Homo: 1.62x cheaper; Cauchy: 1.60x cheaper" (and the solve time)."""
        sc = self.scenarios.get(key)
        if sc is None:
            return ""
        parts = [f"{BASELINE_NAMES[b]}: {getattr(sc, b).text}" for b in BASELINE_NAMES]
        if with_solve_time and sc.solve_seconds is not None:
            parts.append(f"solve {sc.solve_seconds.value:g} s")
        return "; ".join(parts)


@cache
def paper_results(path: Path | None = None) -> PaperResults:
    """The shipped file (or `path`), loaded and checked once.

    Raises:
        InputError: the file is missing, not YAML, or a field is wrong (named).
    """
    return load_yaml_model(PaperResults, path or data_path(FILE))
