"""Build the default performance model from the shipped data files (and optional measured tables)."""

from __future__ import annotations

from pathlib import Path

from solver.calibration import load_calibration
from solver.catalog import Catalog, load_catalog
from solver.measured import MeasuredTables, load_measured_dir
from solver.model_cards import load_model_cards
from solver.perf import PerfSettings
from solver.profile import PerfModel


def load_perf_model(
    measured_dir: Path | None = None,
    catalog: Catalog | None = None,
    settings: PerfSettings | None = None,
) -> PerfModel:
    """The shipped catalog, model cards and calibration; measured tables win where present."""
    return PerfModel(
        catalog=catalog or load_catalog(),
        cards=load_model_cards(),
        calibration=load_calibration().calibration(),
        settings=settings or PerfSettings(),
        measured=load_measured_dir(measured_dir) if measured_dir else MeasuredTables(),
    )
