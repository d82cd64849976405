"""Build the default performance model from the shipped data files (and optional measured tables)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from solver.catalog.model_cards import ModelCard, ModelId
from solver.catalog.offers import Catalog, load_catalog
from solver.catalog.user_models import stack_cards
from solver.performance.analytical import PerfSettings
from solver.performance.calibration import load_calibration
from solver.performance.measured_tables import MeasuredTables, load_measured_dir
from solver.performance.perf_model import DEFAULT_RUNTIME, PerfModel

MEASURED_DIR_ENV = "CORAL_MEASURED_DIR"


def load_perf_model(
    measured_dir: Path | None = None,
    catalog: Catalog | None = None,
    settings: PerfSettings | None = None,
    runtime: str = DEFAULT_RUNTIME,
    cards: Mapping[ModelId, ModelCard] | None = None,
    corrections: Mapping[tuple[str, str, str], float] | None = None,
) -> PerfModel:
    """The shipped catalog, model cards and calibration; measured tables win where present.

    Args:
        measured_dir: folder of measured tables; default $CORAL_MEASURED_DIR when set, so every
            command (plan, bench, library builds) uses the same measurements.
        catalog: the catalog (default: the shipped one).
        settings: model settings (default: `PerfSettings()`).
        runtime: the serving runtime whose fixed costs apply: `vllm` (default; every plan,
            template and simulation) or `helix` (Helix's files; A100-40GB, L4 and T4 only).
        cards: a stack's own model cards (`FleetConfig.model_cards`), beside the shipped ones.
        corrections: a stack's measured step-time corrections, (GPU type, model, phase) ->
            factor (`FleetConfig.step_corrections()`, written by `coral calibrate --write`).

    Returns:
        The performance model.

    Raises:
        InputError: an unknown runtime, a catalog GPU without factors or a derivation, or a
            stack card that reuses a built-in id.
    """
    if measured_dir is None and os.environ.get(MEASURED_DIR_ENV):
        measured_dir = Path(os.environ[MEASURED_DIR_ENV])
    catalog = catalog or load_catalog()
    calibration = load_calibration().calibration(list(catalog.gpus))
    calibration.runtime(runtime)  # an unknown name fails here, not at the first layer time
    return PerfModel(
        catalog=catalog,
        cards=stack_cards(cards or {}),
        calibration=calibration,
        settings=settings or PerfSettings(),
        measured=load_measured_dir(measured_dir) if measured_dir else MeasuredTables(),
        runtime=runtime,
        corrections=dict(corrections or {}),
    )
