"""Fit the performance model's efficiency factors to measured per-layer timings; load the data file.

Data: the Helix artifact's per-layer CSVs (vendored in `solver/data/calibration/helix/` with their
Apache-2.0 licence and source): prefill and decode of Llama-2-70B and LLaMA-1-30B on single
A100-40GB, L4 and T4 GPUs, measured under Helix's own runtime (vLLM 0.4 in eager mode, one engine
step per layer). Fitted per GPU type: decode memory and compute efficiency and prefill compute
efficiency (properties of the GPU), and the `helix` runtime's per-layer overhead for each phase
(a property of that runtime on that machine: host and eager launch cost differ by machine). Fitted
once for all files: the decode context and the prefill prompt length Helix's profiler used, which
its files do not record. The fit minimises squared log error (relative error) with scipy's bounded
least squares. GPU types without measurements get a measured chip's factors through an explicit,
documented derivation in the data file (`derived`), never a generic default.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field
from scipy.optimize import least_squares

from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import Catalog
from solver.errors import InputError
from solver.io import data_path, load_yaml_model, read_two_column_csv
from solver.performance.analytical import (
    PERF_MODEL_VERSION,
    AllReduceFit,
    Efficiency,
    KernelFactors,
    LayerOverhead,
    NodeCosts,
    Overheads,
    Runtime,
    analytical_layer_ms,
)
from solver.performance.operator_tables import shipped_operator_tables
from solver.performance.perf_model import Calibration
from solver.types import Phase

# Helix file prefixes -> our ids. Helix's GPUs are single-GPU Google Cloud VMs.
HELIX_GPUS = {"a100": "a100-40gb", "l4": "l4", "t4": "t4"}
HELIX_PHASES: dict[str, Phase] = {"prompt": "prefill", "decode": "decode"}
HELIX_SOURCE = "Helix-ASPLOS25 per-layer timings (Apache-2.0), solver/data/calibration/helix/"
# The factors the Helix fit adjusts; a GPU's GEMM latency is an input to it (Vidur-measured or
# derived), so the fitted per-layer overheads are what the Helix runtime adds on top.
EFF_FIELDS = ["decode_mem", "decode_compute", "prefill_compute"]


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
    # The runtime the file was measured under: Helix's files pay Helix's per-layer cost (fitted);
    # a `coral profile measure` table times layers alone, as the vllm runtime's per-layer cost
    # (none under CUDA graphs) assumes, so its fit has no free overhead term.
    runtime: Literal["helix", "vllm"] = "helix"
    source: str = HELIX_SOURCE


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
        source = (
            HELIX_SOURCE
            if directory == helix_data_dir()
            else f"Helix-format per-layer timings, {directory}"
        )
        out.append(
            CalibrationFile(
                path.name, model, HELIX_GPUS[gpu], HELIX_PHASES[phase], pts, source=source
            )
        )
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

    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
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
        out.append(
            CalibrationFile(
                path.name, model, gpu, phase, pts, context,  # type: ignore[arg-type]
                runtime="vllm", source=f"coral profile measure tables, {directory}",
            )
        )  # fmt: skip
    if not out:
        raise InputError(str(directory), "no CSV files", "pass the profiler's output folder")
    return out


class GpuFactors(Efficiency):
    """A GPU type's own fitted factors, with the measurements they come from."""

    source: str = Field(description="The fit and the data it used.")
    gemm_latency_source: str = Field(
        default="", description="Where gemm_latency_ms comes from (measured, or derived and why)."
    )


class Derivation(BaseModel):
    """An unmeasured GPU takes a measured chip's factors, as fractions of its OWN peaks."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    from_gpu: str = Field(alias="from", description="The measured (or derived) GPU type.")
    why: str = Field(description="Why that chip: architecture / chip family.")
    source: str = Field(description="Provenance of the derivation.")


class Interconnect(BaseModel):
    """All-reduce fits of one interconnect, per TP degree."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    source: str = Field(description="Measurements behind the numbers.")
    note: str = Field(default="", description="Uncertainty and derivations.")
    tp: dict[int, AllReduceFit] = Field(description="Per TP degree (2, 4, 8).")


class KernelFit(KernelFactors):
    """A GPU type's attention and elementwise factors, with what they were fitted on."""

    source: str = Field(description="The fit and the data it used (or what was derived).")


class KernelDerivation(BaseModel):
    """A GPU type whose kernels were not timed takes a timed chip's factors (as fractions of its
    own peaks)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    from_gpu: str = Field(alias="from", description="The GPU type whose kernel factors apply.")
    why: str = Field(description="Why that chip.")


class Kernels(BaseModel):
    """Attention and elementwise kernel factors (`scripts/apply_vidur_fit.py` writes them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    source: str = Field(description="The measurements and the fitted forms.")
    fit_median_abs_rel_error: dict[str, float] = Field(description="Per fitted group.")
    gpus: dict[str, KernelFit] = Field(
        description="GPU types with fitted (or partly fitted) kernels."
    )
    derived: dict[str, KernelDerivation] = Field(description="The others: nearest timed chip.")

    def resolve(self, gpu: str) -> tuple[KernelFactors, str]:
        """The GPU's kernel factors and where they come from.

        Raises:
            InputError: the GPU has neither its own kernel factors nor a derivation to one.
        """
        if gpu not in self.gpus:
            d = self.derived.get(gpu)
            if d is None or d.from_gpu not in self.gpus:
                raise InputError(
                    f"kernels.derived.{gpu}",
                    f"GPU '{gpu}' has no attention/elementwise kernel factors",
                    "add it under kernels.derived: in solver/data/calibration.yaml, naming a GPU "
                    "under kernels.gpus:",
                )
            fit = self.gpus[d.from_gpu]
            return _kernel_factors(fit), f"derived from {d.from_gpu} ({d.why}) <- {fit.source}"
        return _kernel_factors(self.gpus[gpu]), self.gpus[gpu].source


def _kernel_factors(fit: KernelFit) -> KernelFactors:
    return KernelFactors(**fit.model_dump(include=set(KernelFactors.model_fields)))


class HelixFit(BaseModel):
    """Provenance of the Helix fit: what `coral profile calibrate --write` regenerates."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    fitted_on: dt.date
    command: str = Field(description="Command that regenerates the fitted sections.")
    data: str = Field(description="Measurements the fit used, with licence.")
    runtime: Literal["helix"] = Field(description="The runtime the files were measured under.")
    decode_context_tokens: float = Field(gt=0, description="Fitted context of Helix's decode runs.")
    prefill_prompt_tokens: float = Field(gt=0, description="Fitted prompt length of its prefill.")
    fit_median_abs_rel_error: dict[str, float] = Field(description="Per file, at fit time.")


class CalibrationData(BaseModel):
    """`solver/data/calibration.yaml`: GPU factors (own or derived), runtimes, all-reduce fits.

    `coral profile calibrate --write` rewrites `helix_fit`, the fitted GPUs' entries in `gpus`
    and `runtimes.helix.per_gpu`; it keeps everything else (derivations, the vllm runtime, the
    all-reduce fits, factors fitted elsewhere such as Vidur's).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[2]
    perf_model_version: str
    helix_fit: HelixFit
    gpus: dict[str, GpuFactors] = Field(description="GPU types with their own measurements.")
    derived: dict[str, Derivation] = Field(description="GPU types without: nearest measured.")
    runtimes: dict[str, Runtime]
    allreduce: dict[str, Interconnect] = Field(description="Keyed by gpus.yaml `interconnect`.")
    kernels: Kernels = Field(description="Attention and elementwise kernels per GPU type.")

    @property
    def decode_context_tokens(self) -> float:
        return self.helix_fit.decode_context_tokens

    @property
    def prefill_prompt_tokens(self) -> float:
        return self.helix_fit.prefill_prompt_tokens

    @property
    def fit_median_abs_rel_error(self) -> dict[str, float]:
        return self.helix_fit.fit_median_abs_rel_error

    def resolve(self, gpu: str, seen: tuple[str, ...] = ()) -> tuple[Efficiency, str]:
        """The GPU's factors and where they come from (its own fit, or a derivation chain).

        Raises:
            InputError: a derivation whose source has no factors, a cycle, or an unknown GPU.
        """
        if gpu in self.gpus:
            own = self.gpus[gpu]
            return Efficiency(**own.model_dump(include=set(Efficiency.model_fields))), own.source
        if gpu not in self.derived or gpu in seen:
            chain = " <- ".join((*seen, gpu))
            raise InputError(
                f"derived.{seen[-1]}.from" if seen else f"gpus.{gpu}",
                f"GPU '{seen[0] if seen else gpu}' derives its factors from '{gpu}', which has "
                f"no factors ({chain})"
                if seen
                else f"GPU '{gpu}' has no factors and no derivation",
                "add the source GPU's factors under gpus: in solver/data/calibration.yaml, or "
                "derive from a measured GPU",
            )
        d = self.derived[gpu]
        eff, origin = self.resolve(d.from_gpu, (*seen, gpu))
        return eff, f"derived from {d.from_gpu} ({d.why}; {d.source}) <- {origin}"

    def calibration(self, gpu_ids: list[str] | None = None) -> Calibration:
        """Resolve every GPU (those of `gpu_ids` too, so a GPU without factors fails here)."""
        names = sorted({*self.gpus, *self.derived, *(gpu_ids or [])})
        resolved = {g: self.resolve(g) for g in names}
        kernels = {g: self.kernels.resolve(g) for g in names}
        return Calibration(
            gpus={g: eff for g, (eff, _) in resolved.items()},
            origin={g: origin for g, (_, origin) in resolved.items()},
            kernels={g: k for g, (k, _) in kernels.items()},
            runtimes=dict(self.runtimes),
            allreduce={k: dict(v.tp) for k, v in self.allreduce.items()},
            provenance=f"{self.helix_fit.data}; fitted {self.helix_fit.fitted_on}",
            operators=shipped_operator_tables(),
        )


CALIBRATION_HEADER = (
    "# Calibration of the performance model (solver/performance/calibration.py: CalibrationData)."
    "\n# `coral profile calibrate --write` regenerates helix_fit, the Helix-fitted GPUs under "
    "gpus: and\n# runtimes.helix.per_gpu, and keeps the rest (derived, runtimes.vllm, allreduce, "
    "factors fitted\n# elsewhere: Vidur's GEMM and all-reduce fits, written by "
    "scripts/apply_vidur_fit.py). Every\n# number names its source.\n"
)


def dump_calibration(data: CalibrationData) -> str:
    """The data file's text: the header, then the YAML (aliases as written, e.g. `from`)."""
    body = yaml.safe_dump(data.model_dump(mode="json", by_alias=True), sort_keys=False, width=100)
    return CALIBRATION_HEADER + body


def load_calibration(path: Path | None = None) -> CalibrationData:
    """The calibration data file (default: the shipped `solver/data/calibration.yaml`)."""
    return load_yaml_model(CalibrationData, path or data_path("calibration.yaml"))


def file_costs(
    f: CalibrationFile, eff: Efficiency, helix_layer: LayerOverhead | None, data: CalibrationData
) -> NodeCosts:
    """Costs a file's measurements include: the helix runtime's per-layer cost (`helix_layer`)
    for Helix's files, the vllm runtime's per-layer cost for profiler tables; the GPU's
    attention and elementwise kernels as the data file resolves them."""
    kernels, _ = data.kernels.resolve(f.gpu)
    if f.runtime == "vllm":
        vllm = data.runtimes["vllm"]
        layer = LayerOverhead(
            decode_layer_ms=vllm.decode_layer_ms or 0.0,
            prefill_layer_ms=vllm.prefill_layer_ms or 0.0,
        )
        return helix_costs(eff, layer, kernels)
    if helix_layer is None:
        raise InputError(f"runtimes.helix.per_gpu.{f.gpu}", "missing", "refit with --write")
    return helix_costs(eff, helix_layer, kernels)


def helix_costs(eff: Efficiency, layer: LayerOverhead, kernels: KernelFactors) -> NodeCosts:
    """Costs of a one-GPU node under the helix runtime (no per-step cost: each layer is a step)."""
    overheads = Overheads(
        decode_layer_ms=layer.decode_layer_ms,
        prefill_layer_ms=layer.prefill_layer_ms,
        decode_step_ms=0.0,
        prefill_step_ms=0.0,
    )
    return NodeCosts(eff=eff, overheads=overheads, kernels=kernels)


def predict_ms(
    card: ModelCard,
    catalog: Catalog,
    costs: NodeCosts,
    f: CalibrationFile,
    decode_ctx: float,
    prompt_len: float,
) -> np.ndarray:
    """The model's ms per layer at each of the file's sizes, on one GPU (TP 1)."""
    node = catalog.node(f"{f.gpu}x1")
    ctx = f.context if f.context is not None else decode_ctx if f.phase == "decode" else prompt_len
    return np.array(
        [analytical_layer_ms(card, node, costs, 1, f.phase, x, ctx) for x, _ in f.points]
    )


FIT_FIELDS = [*EFF_FIELDS, "decode_layer_ms", "prefill_layer_ms"]


def _unpack(
    theta: np.ndarray, gpus: list[str], gemm_latency_ms: dict[str, float]
) -> tuple[dict[str, tuple[Efficiency, LayerOverhead]], float, float]:
    n = len(FIT_FIELDS)
    out = {}
    for i, g in enumerate(gpus):
        v = dict(zip(FIT_FIELDS, theta[i * n : (i + 1) * n], strict=True))
        eff = Efficiency(**{k: v[k] for k in EFF_FIELDS}, gemm_latency_ms=gemm_latency_ms[g])
        out[g] = (eff, LayerOverhead(decode_layer_ms=v["decode_layer_ms"],
                                     prefill_layer_ms=v["prefill_layer_ms"]))  # fmt: skip
    return out, float(theta[-2]), float(theta[-1])


def fit(
    files: list[CalibrationFile],
    cards: dict[str, ModelCard],
    catalog: Catalog,
    base: CalibrationData | None = None,
    source: str = HELIX_SOURCE,
    command: str = "coral profile calibrate --write",
) -> CalibrationData:
    """Fit efficiencies and the helix runtime's per-layer overheads per GPU, and the two shared
    unknowns, under the helix runtime; returns `base` (default: the shipped file) with the
    fitted sections replaced and everything else kept."""
    base = base or load_calibration()
    gpus = sorted({f.gpu for f in files})
    latency = {g: base.gpus[g].gemm_latency_ms if g in base.gpus else 0.0 for g in gpus}
    # Per GPU, in FIT_FIELDS order: decode_mem, decode_compute, prefill_compute, decode and
    # prefill overhead per layer (helix runtime); then decode context and prefill prompt length.
    x0 = np.array([0.7, 0.5, 0.5, 0.1, 0.1] * len(gpus) + [1024.0, 1024.0])
    lo = np.array([0.05, 0.05, 0.05, 0.0, 0.0] * len(gpus) + [64.0, 64.0])
    hi = np.array([1.0, 1.0, 1.0, 5.0, 5.0] * len(gpus) + [8192.0, 8192.0])

    def residuals(theta: np.ndarray) -> np.ndarray:
        fitted, ctx, plen = _unpack(theta, gpus, latency)
        res = []
        for f in files:
            eff, layer = fitted[f.gpu]
            pred = predict_ms(
                cards[f.model], catalog, file_costs(f, eff, layer, base), f, ctx, plen
            )
            res.append(np.log(pred / np.array([ms for _, ms in f.points])))
        return np.concatenate(res)

    sol = least_squares(residuals, x0, bounds=(lo, hi), method="trf")
    fitted, ctx, plen = _unpack(sol.x, gpus, latency)
    sources = {g: "; ".join(sorted({f.source for f in files if f.gpu == g})) for g in gpus}
    helix_gpus = {f.gpu for f in files if f.runtime == "helix"}
    fit_of = _FitResult(fitted, sources, helix_gpus, ctx, plen)
    data = _with_fit(base, fit_of, source, command, {})
    errors = {
        r.name: round(r.median_abs_rel_error, 4) for r in error_table(files, cards, catalog, data)
    }
    return _with_fit(base, fit_of, source, command, errors)


@dataclass(frozen=True)
class _FitResult:
    fitted: dict[str, tuple[Efficiency, LayerOverhead]]
    sources: dict[str, str]  # GPU -> the measurements its factors come from
    helix_gpus: set[str]  # GPUs with Helix files: only they get a fitted helix overhead
    ctx: float
    plen: float


def _r4(m: BaseModel) -> dict[str, float]:
    return {k: round(v, 4) for k, v in m.model_dump().items()}


def _with_fit(
    base: CalibrationData, res: _FitResult, source: str, command: str, errors: dict[str, float]
) -> CalibrationData:
    fitted = res.fitted
    gpus = dict(base.gpus) | {
        g: GpuFactors(
            **_r4(eff),
            source=f"fit: {res.sources[g]}",
            gemm_latency_source=base.gpus[g].gemm_latency_source if g in base.gpus else "",
        )
        for g, (eff, _) in fitted.items()
    }
    helix = base.runtimes["helix"]
    per_gpu = dict(helix.per_gpu) | {
        g: LayerOverhead(**_r4(lay)) for g, (_, lay) in fitted.items() if g in res.helix_gpus
    }
    return base.model_copy(
        update={
            "perf_model_version": PERF_MODEL_VERSION,
            "helix_fit": HelixFit(
                fitted_on=dt.date.today(),
                command=command,
                data=source,
                runtime="helix",
                decode_context_tokens=round(res.ctx, 1),
                prefill_prompt_tokens=round(res.plen, 1),
                fit_median_abs_rel_error=errors,
            ),
            "gpus": dict(sorted(gpus.items())),
            "derived": {g: d for g, d in base.derived.items() if g not in fitted},
            "runtimes": base.runtimes | {"helix": helix.model_copy(update={"per_gpu": per_gpu})},
        }
    )


@dataclass(frozen=True)
class FileError:
    name: str
    phase: Phase
    points: int
    median_abs_rel_error: float
    max_abs_rel_error: float


def _file_pred(
    f: CalibrationFile, cards: dict[str, ModelCard], catalog: Catalog, data: CalibrationData
) -> np.ndarray:
    """The stored factors' prediction for one file, under the runtime it was measured with."""
    cal = data.calibration()
    helix_layer = None
    if f.runtime == "helix":
        layer = data.runtimes["helix"].overheads("helix", f.gpu)
        helix_layer = LayerOverhead(
            decode_layer_ms=layer.decode_layer_ms, prefill_layer_ms=layer.prefill_layer_ms
        )
    costs = file_costs(f, cal.for_gpu(f.gpu), helix_layer, data)
    return predict_ms(
        cards[f.model], catalog, costs, f, data.decode_context_tokens, data.prefill_prompt_tokens
    )


def error_table(
    files: list[CalibrationFile],
    cards: dict[str, ModelCard],
    catalog: Catalog,
    data: CalibrationData,
) -> list[FileError]:
    """Per-file |predicted - measured| / measured over every point, with the stored factors
    under the helix runtime (the one the files were measured with)."""
    rows = []
    for f in files:
        pred = _file_pred(f, cards, catalog, data)
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
) -> list[float]:
    """Every point's relative error for one phase (the pooled median check)."""
    out: list[float] = []
    for f in files:
        if f.phase != phase:
            continue
        pred = _file_pred(f, cards, catalog, data)
        out.extend(abs(p - m) / m for p, (_, m) in zip(pred, f.points, strict=True))
    return out
