"""Shared fixtures: the shipped data, loaded once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from solver.calibration import CalibrationFile, load_helix_dir
from solver.defaults import load_perf_model
from solver.profile import PerfModel

REPO = Path(__file__).resolve().parents[1]
HELIX_DIR = REPO.parent / "shared" / "calibration" / "helix"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def perf() -> PerfModel:
    return load_perf_model()


@pytest.fixture(scope="session")
def helix_files() -> list[CalibrationFile]:
    return load_helix_dir(HELIX_DIR)
