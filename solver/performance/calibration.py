"""Fit the performance model's efficiency factors to measured per-layer timings.

Data: the Helix artifact's per-layer CSVs (vendored in `solver/data/calibration/helix/` with their
Apache-2.0 licence and source): prefill and decode of Llama-2-70B and LLaMA-1-30B on single
A100-40GB, L4 and T4 GPUs. Fitted per GPU type: decode memory and compute efficiency, prefill
compute efficiency and a per-layer overhead for each phase. Fitted once for all files: the decode
context and the prefill prompt length Helix's profiler used, which its files do not record. The
fit minimises squared log error (relative error) with scipy's bounded least squares; the median of
the fitted GPUs' factors is the default for GPU types with no measurements (H100, L40S, A10G,
V100, A100-80GB), which is an extrapolation and is reported as such.
"""

from __future__ import annotations

import datetime as dt
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.optimize import least_squares

from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import Catalog
from solver.errors import InputError
from solver.io import data_path, load_yaml_model, read_two_column_csv
from solver.performance.analytical import (
    PERF_MODEL_VERSION,
    Efficiency,
    PerfSettings,
    analytical_layer_ms,
)
from solver.performance.perf_model import Calibration
from solver.types import Phase

# Helix file prefixes -> our ids. Helix's GPUs are single-GPU Google Cloud VMs.
HELIX_GPUS = {"a100": "a100-40gb", "l4": "l4", "t4": "t4"}
HELIX_PHASES: dict[str, Phase] = {"prompt": "prefill", "decode": "decode"}
HELIX_SOURCE = "Helix-ASPLOS25 per-layer timings (Apache-2.0), solver/data/calibration/helix/"
EFF_FIELDS = list(Efficiency.model_fields)


@dataclass(frozen=True)
class CalibrationFile:
    """One measured file: which model, GPU and phase, and its (x, ms) points (x > 0). `context`
    is the decode context or prefill prompt length it was measured at, when the file says
    (the profiler's sidecar); Helix's files do not, so the fit estimates theirs."""

    name: str
    model: str
    gpu: str
    phase: Phase
    points: tuple[tuple[float, float], ...]
    context: float | None = None


def helix_data_dir() -> Path:
    """The packaged folder of Helix per-layer CSVs (the default calibration data)."""
    return data_path("calibration/helix")


def load_helix_dir(directory: Path) -> list[CalibrationFile]:
    """Load `<model>_<gpu>_<prompt|decode>.csv` files from the Helix calibration folder."""
    if not directory.is_dir():
        raise InputError(str(directory), "calibration folder not found", "pass --data DIR")
    out = []
    for path in sorted(directory.glob("*.csv")):
        model, gpu, phase = path.stem.split("_")
        if gpu not in HELIX_GPUS or phase not in HELIX_PHASES:
            raise InputError(str(path), "unexpected file name", "<model>_<a100|l4|t4>_<phase>.csv")
        pts = tuple((x, ms) for x, ms in read_two_column_csv(path) if x > 0)
        out.append(CalibrationFile(path.name, model, HELIX_GPUS[gpu], HELIX_PHASES[phase], pts))
    if not out:
        raise InputError(str(directory), "no CSV files", "pass the Helix calibration folder")
    return out


def load_profiler_dir(directory: Path, catalog: Catalog) -> list[CalibrationFile]:
    """Measured tables written by `coral profile measure` (`<model>__<node>__<phase>.csv`
    with its JSON sidecar), for GPUs of the catalog measured one GPU per layer (TP 1).

    Raises:
        InputError: no tables, a table without its sidecar, a smoke (toy-layer) table, a node
            the catalog lacks, or a TP > 1 table (the fit is per GPU).
    """
    import json

    from solver.performance.measured_tables import parse_table_name

    if not directory.is_dir():
        raise InputError(str(directory), "not a directory", "pass the folder of measured tables")
    out = []
    for path in sorted(directory.glob("*.csv")):
        model, node, phase = parse_table_name(path)
        sidecar = path.with_suffix(".json")
        if not sidecar.exists():
            raise InputError(
                str(sidecar), "missing: it records the context", "keep the profiler's JSON"
            )
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
        if "smoke" in str(meta.get("method", "")):
            raise InputError(
                str(path), "a smoke-test table (toy layer), not data", "measure on a real GPU"
            )
        if int(meta.get("tp", 1)) != 1 or node not in catalog.node_configs:
            raise InputError(
                str(path),
                f"node {node} (TP {meta.get('tp', 1)}): the fit needs one-GPU tables of a "
                "catalog GPU",
                "measure with --tp 1 and add the GPU to solver/data/gpus.yaml",
            )
        pts = tuple((x, ms) for x, ms in read_two_column_csv(path) if x > 0)
        gpu = catalog.node(node).gpu_id
        context = float(meta["context_tokens"])
        out.append(CalibrationFile(path.name, model, gpu, phase, pts, context))  # type: ignore[arg-type]
    if not out:
        raise InputError(str(directory), "no CSV files", "pass the profiler's output folder")
    return out


class CalibrationData(BaseModel):
    """`solver/data/calibration.yaml`: fitted factors and the fit's provenance."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1]
    perf_model_version: str
    fitted_on: dt.date
    command: str = Field(description="Command that regenerates this file.")
    data: str = Field(description="Measurements the fit used, with licence.")
    decode_context_tokens: float = Field(gt=0, description="Fitted context of Helix's decode runs.")
    prefill_prompt_tokens: float = Field(gt=0, description="Fitted prompt length of its prefill.")
    gpus: dict[str, Efficiency]
    default: Efficiency = Field(description="Median of the fitted GPUs: for unmeasured GPU types.")
    fit_median_abs_rel_error: dict[str, float] = Field(description="Per file, at fit time.")

    def calibration(self) -> Calibration:
        return Calibration(self.gpus, self.default, f"{self.data}; fitted {self.fitted_on}")


def load_calibration(path: Path | None = None) -> CalibrationData:
    return load_yaml_model(CalibrationData, path or data_path("calibration.yaml"))


def predict_ms(
    card: ModelCard,
    catalog: Catalog,
    eff: Efficiency,
    f: CalibrationFile,
    decode_ctx: float,
    prompt_len: float,
    settings: PerfSettings,
) -> np.ndarray:
    node = catalog.node(f"{f.gpu}x1")
    ctx = f.context if f.context is not None else decode_ctx if f.phase == "decode" else prompt_len
    return np.array(
        [analytical_layer_ms(card, node, eff, 1, f.phase, x, ctx, settings) for x, _ in f.points]
    )


def _unpack(theta: np.ndarray, gpus: list[str]) -> tuple[dict[str, Efficiency], float, float]:
    n = len(EFF_FIELDS)
    effs = {
        g: Efficiency(**dict(zip(EFF_FIELDS, theta[i * n : (i + 1) * n], strict=True)))
        for i, g in enumerate(gpus)
    }
    return effs, float(theta[-2]), float(theta[-1])


def fit(
    files: list[CalibrationFile],
    cards: dict[str, ModelCard],
    catalog: Catalog,
    settings: PerfSettings | None = None,
    source: str = HELIX_SOURCE,
    command: str = "coral profile calibrate --write",
) -> CalibrationData:
    """Fit efficiencies per GPU and the two shared unknowns; returns the data file's content."""
    settings = settings or PerfSettings()
    gpus = sorted({f.gpu for f in files})
    # Order matches Efficiency's fields: decode_mem, decode_compute, decode_overhead_ms,
    # prefill_compute, prefill_overhead_ms; then decode context and prefill prompt length.
    x0 = np.array([0.7, 0.5, 0.1, 0.5, 0.1] * len(gpus) + [1024.0, 1024.0])
    lo = np.array([0.05, 0.05, 0.0, 0.05, 0.0] * len(gpus) + [64.0, 64.0])
    hi = np.array([1.0, 1.0, 5.0, 1.0, 5.0] * len(gpus) + [8192.0, 8192.0])

    def residuals(theta: np.ndarray) -> np.ndarray:
        effs, ctx, plen = _unpack(theta, gpus)
        res = []
        for f in files:
            pred = predict_ms(cards[f.model], catalog, effs[f.gpu], f, ctx, plen, settings)
            meas = np.array([ms for _, ms in f.points])
            res.append(np.log(pred / meas))
        return np.concatenate(res)

    sol = least_squares(residuals, x0, bounds=(lo, hi), method="trf")
    effs, ctx, plen = _unpack(sol.x, gpus)
    effs = {g: _rounded(e) for g, e in effs.items()}
    default = _rounded(
        Efficiency(
            **{k: statistics.median(getattr(e, k) for e in effs.values()) for k in EFF_FIELDS}
        )
    )
    data = CalibrationData(
        schema_version=1,
        perf_model_version=PERF_MODEL_VERSION,
        fitted_on=dt.date.today(),
        command=command,
        data=source,
        decode_context_tokens=round(ctx, 1),
        prefill_prompt_tokens=round(plen, 1),
        gpus=effs,
        default=default,
        fit_median_abs_rel_error={},
    )
    errors = {
        r.name: round(r.median_abs_rel_error, 4)
        for r in error_table(files, cards, catalog, data, settings)
    }
    return data.model_copy(update={"fit_median_abs_rel_error": errors})


def _rounded(e: Efficiency) -> Efficiency:
    return Efficiency(**{k: round(getattr(e, k), 4) for k in EFF_FIELDS})


@dataclass(frozen=True)
class FileError:
    name: str
    phase: Phase
    points: int
    median_abs_rel_error: float
    max_abs_rel_error: float


def error_table(
    files: list[CalibrationFile],
    cards: dict[str, ModelCard],
    catalog: Catalog,
    data: CalibrationData,
    settings: PerfSettings | None = None,
) -> list[FileError]:
    """Per-file |predicted - measured| / measured over every point, with the stored factors."""
    settings = settings or PerfSettings()
    rows = []
    for f in files:
        eff = data.gpus.get(f.gpu, data.default)
        pred = predict_ms(
            cards[f.model],
            catalog,
            eff,
            f,
            data.decode_context_tokens,
            data.prefill_prompt_tokens,
            settings,
        )
        meas = np.array([ms for _, ms in f.points])
        rel = np.abs(pred - meas) / meas
        rows.append(FileError(f.name, f.phase, len(rel), float(np.median(rel)), float(rel.max())))
    return rows


def all_abs_rel_errors(
    files: list[CalibrationFile],
    cards: dict[str, ModelCard],
    catalog: Catalog,
    data: CalibrationData,
    phase: Phase,
    settings: PerfSettings | None = None,
) -> list[float]:
    """Every point's relative error for one phase (the issue's pooled median check)."""
    settings = settings or PerfSettings()
    out: list[float] = []
    for f in files:
        if f.phase != phase:
            continue
        eff = data.gpus.get(f.gpu, data.default)
        pred = predict_ms(
            cards[f.model],
            catalog,
            eff,
            f,
            data.decode_context_tokens,
            data.prefill_prompt_tokens,
            settings,
        )
        out.extend(abs(p - m) / m for p, (_, m) in zip(pred, f.points, strict=True))
    return out
