"""Shared fixtures: the shipped data, loaded once per session."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from coral_iac.preview import PreviewResult, preview_stack
from coral_iac.program import ProgramOptions, utc_now
from solver.performance.calibration import CalibrationFile, helix_data_dir, load_helix_dir
from solver.performance.default_model import load_perf_model
from solver.performance.perf_model import PerfModel
from solver.plan_schema import Plan

REPO = Path(__file__).resolve().parents[1]
HELIX_DIR = helix_data_dir()  # vendored: the repo reads nothing outside itself
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def committed_stacks() -> list[str]:
    """Every committed stack's name (stacks/Pulumi.<name>.yaml), sorted."""
    return sorted(
        p.name[len("Pulumi.") : -len(".yaml")] for p in (REPO / "stacks").glob("Pulumi.*.yaml")
    )


@pytest.fixture(scope="session")
def perf() -> PerfModel:
    return load_perf_model()


@pytest.fixture(scope="session")
def helix_files() -> list[CalibrationFile]:
    return load_helix_dir(HELIX_DIR)


@pytest.fixture
def preview(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., PreviewResult]:
    """`preview_stack` with one library cache for the whole session, outside the repository;
    `now` fakes the clock (consecutive deploys), `rebuild_stale` rebuilds a stale library,
    `health_report` is what the gateway last published."""
    library_root = tmp_path_factory.getbasetemp() / "library"

    def run(
        stack: str,
        stacks_dir: Path,
        previous: Plan | None = None,
        previous_outputs: dict[str, Any] | None = None,
        now: datetime | None = None,
        rebuild_stale: bool = False,
        not_offered: set[tuple[str, str]] | None = None,
        health_report: str | None = None,
    ) -> PreviewResult:
        clock = (lambda: now) if now is not None else utc_now
        options = ProgramOptions(stacks_dir, library_root, None, rebuild_stale, clock)
        return preview_stack(
            stack, options, previous, previous_outputs, not_offered, health_report
        )

    return run
