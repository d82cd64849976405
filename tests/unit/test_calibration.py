"""The performance model against the measured Helix timings (solver/data/calibration/helix/)."""

from __future__ import annotations

import statistics

import pytest

from solver.catalog.model_cards import load_model_cards
from solver.catalog.offers import load_catalog
from solver.performance.calibration import all_abs_rel_errors, error_table, fit, load_calibration


def test_twelve_calibration_files_are_loaded(helix_files):
    assert len(helix_files) == 12
    assert {f.phase for f in helix_files} == {"prefill", "decode"}


@pytest.mark.parametrize(("phase", "target"), [("decode", 0.15), ("prefill", 0.20)])
def test_pooled_median_error_within_target(helix_files, phase, target):
    """Issue check: median |pred - meas| / meas over every point of every file of a phase."""
    errs = all_abs_rel_errors(
        helix_files, load_model_cards(), load_catalog(), load_calibration(), phase
    )
    assert statistics.median(errs) <= target


def test_no_file_median_above_30_percent(helix_files):
    rows = error_table(helix_files, load_model_cards(), load_catalog(), load_calibration())
    worst = max(rows, key=lambda r: r.median_abs_rel_error)
    assert worst.median_abs_rel_error <= 0.30, worst


def test_stored_fit_errors_match_recomputed(helix_files):
    """The error stored beside the factors is what the factors really give (no stale data)."""
    cal = load_calibration()
    rows = error_table(helix_files, load_model_cards(), load_catalog(), cal)
    for r in rows:
        assert r.median_abs_rel_error == pytest.approx(
            cal.fit_median_abs_rel_error[r.name], abs=1e-3
        ), r.name


def test_refit_reproduces_stored_factors(helix_files):
    """Running the fit again lands on the stored factors: the data file is the fit's output."""
    stored = load_calibration()
    refit = fit(helix_files, load_model_cards(), load_catalog())
    for gpu, eff in stored.gpus.items():
        for name, value in eff.model_dump().items():
            assert getattr(refit.gpus[gpu], name) == pytest.approx(value, rel=0.02, abs=0.01), (
                gpu,
                name,
            )


def test_a_wrong_factor_breaks_the_check(helix_files):
    """The error check can fail: halving A100 bandwidth efficiency pushes its decode error up."""
    cal = load_calibration()
    bad = cal.model_copy(
        update={
            "gpus": cal.gpus
            | {
                "a100-40gb": cal.gpus["a100-40gb"].model_copy(
                    update={"decode_mem": 0.3, "decode_compute": 0.15}
                )
            }
        }
    )
    rows = {r.name: r for r in error_table(helix_files, load_model_cards(), load_catalog(), bad)}
    assert rows["llama2-70b_a100_decode.csv"].median_abs_rel_error > 0.30
