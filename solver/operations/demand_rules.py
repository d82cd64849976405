"""Demand sources, pure part: the stack config, a demand file, measured token rates.

Each source turns a stack's `coral:fleet` into a `DemandReport`: every model's demand and where
it came from. `DemandReport.apply` gives the models with those figures, which is what `coral plan`
and the Pulumi program solve for. Measured rates come in as data (`MeasuredRates`); the
Prometheus client that measures them lives in `coral_iac/demand_sources.py`, since `solver/`
does no network I/O. The demand file format (`stacks/demand/<stack>.yaml`):

    source: where the figures come from, and when   # required, like every outside number
    retrieved_utc: 2026-11-29T12:00:00Z             # optional
    demand:
      <model>: {requests_per_s: N}  or  {tokens_per_s: {prefill: N, decode: N}}
    lengths:                                        # optional: written by `coral demand refresh`
      <model>: {mean_prompt_tokens: N, mean_output_tokens: N, prompt_sigma: S, output_sigma: S,
                requests: N, source: ...}
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, Field

from solver.errors import InputError
from solver.io import load_yaml_model
from solver.stack import Demand, MeasuredLengths, ModelSpec, PhaseTokens, PrometheusSource
from solver.types import FROZEN, LibPhase

PROMPT_METRIC = "vllm:prompt_tokens_total"
GENERATION_METRIC = "vllm:generation_tokens_total"


class DemandFile(BaseModel):
    """`stacks/demand/<stack>.yaml`: per-model demand with its source."""

    model_config = FROZEN
    source: str = Field(min_length=1, description="Where the figures come from, and when.")
    retrieved_utc: dt.datetime | None = Field(default=None, description="When measured (UTC).")
    demand: dict[str, Demand] = Field(min_length=1, description="Model -> its demand.")
    lengths: dict[str, MeasuredLengths] = Field(
        default_factory=dict, description="Model -> the lengths its fleet served."
    )


class ModelDemand(BaseModel):
    """One model's resolved demand and where it came from."""

    model_config = FROZEN
    model: str
    demand: Demand
    origin: str = Field(description="config, file, prometheus or floor.")
    detail: str = Field(description="The file, the query, or why a fallback was taken.")


class DemandReport(BaseModel):
    """Every model's resolved demand, plus what the source said that the stack does not use."""

    model_config = FROZEN
    kind: str
    models: list[ModelDemand]
    warnings: list[str] = Field(default_factory=list)
    unknown_models: list[str] = Field(
        default_factory=list, description="Models the source has and the stack does not serve."
    )
    lengths: dict[str, MeasuredLengths] = Field(
        default_factory=dict, description="Model -> the lengths its fleet served (measured)."
    )

    def apply(self, specs: Mapping[str, ModelSpec]) -> dict[str, ModelSpec]:
        """The stack's models (`specs`, by name) with each one's demand replaced by this
        report's figure, and its mean lengths and their spread by the measured ones."""
        given = {m.model: m.demand for m in self.models}
        out = {}
        for name, spec in specs.items():
            update: dict[str, object] = {"demand": given.get(name, spec.demand)}
            if (lengths := self.lengths.get(name)) is not None:
                update |= {
                    "mean_prompt_tokens": lengths.mean_prompt_tokens,
                    "mean_output_tokens": lengths.mean_output_tokens,
                    "measured_lengths": lengths,
                }
            out[name] = spec.model_copy(update=update)
        return out


class MeasuredRates(BaseModel):
    """Tokens/s per model as measured (prompt and generated), with the query that measured them."""

    model_config = FROZEN
    prompt_tokens_per_s: dict[str, float]
    generation_tokens_per_s: dict[str, float]
    queries: list[str] = Field(description="The PromQL the figures come from.")
    lengths: dict[str, MeasuredLengths] = Field(
        default_factory=dict, description="Model -> lengths from vLLM's token histograms."
    )


def config_demand(specs: Mapping[str, ModelSpec]) -> DemandReport:
    """Each model's `demand` from the stack config itself.

    Raises:
        InputError: a model without demand.
    """
    return DemandReport(
        kind="config",
        models=[
            ModelDemand(model=m, demand=_config_figure(m, spec), origin="config", detail="")
            for m, spec in sorted(specs.items())
        ],
    )


def _config_figure(model: str, spec: ModelSpec, why: str = "") -> Demand:
    if spec.demand is None:
        raise InputError(
            f"coral:fleet.models.{model}.demand",
            "no demand" + (f" ({why})" if why else ""),
            "add `demand: {requests_per_s: N}` to the model, or give it in the demand source",
        )
    return spec.demand


def load_demand_file(path: Path) -> DemandFile:
    """Read and validate a demand file.

    Raises:
        InputError: missing file, bad YAML, or a field that fails validation (named).
    """
    if not path.exists():
        raise InputError(
            str(path),
            "no demand file",
            "write it (see docs/operations.md), or run `coral demand refresh --write`",
        )
    return load_yaml_model(DemandFile, path)


def file_demand(specs: Mapping[str, ModelSpec], doc: DemandFile, path: str) -> DemandReport:
    """Demand from a demand file; a model it lacks keeps its config demand, with a warning.

    Raises:
        InputError: a model neither the file nor the config gives demand for.
    """
    models, warnings = [], []
    for m, spec in sorted(specs.items()):
        if m in doc.demand:
            # In the model's own units (an aggregated model's tokens/s become requests/s).
            demand = _as_demand(spec, phase_figures(spec, doc.demand[m]))
            models.append(ModelDemand(model=m, demand=demand, origin="file", detail=path))
            continue
        figure = _config_figure(m, spec, f"{path} has no entry for it")
        warnings.append(f"{path} has no demand for {m}: using its config demand")
        models.append(ModelDemand(model=m, demand=figure, origin="config", detail="not in file"))
    unknown = sorted(set(doc.demand) - set(specs))
    warnings += [f"{path} gives demand for {m}, which the stack does not serve" for m in unknown]
    lengths = {m: x for m, x in doc.lengths.items() if m in specs}
    return DemandReport(kind="file", models=models, warnings=warnings, unknown_models=unknown,
                        lengths=lengths)  # fmt: skip


def phase_figures(spec: ModelSpec, demand: Demand) -> dict[LibPhase, float]:
    """A demand in the model's library units (tokens/s per phase, or requests/s if aggregated).

    Tokens/s for an aggregated model become requests/s at its mean request shape: the larger of
    prompt tokens / mean prompt and output tokens / mean output.
    """
    if spec.serving == "aggregated" and demand.tokens_per_s is not None:
        t = demand.tokens_per_s
        rps = max(t.prefill / spec.mean_prompt_tokens, t.decode / spec.mean_output_tokens)
        return {"aggregated": rps}
    return spec.model_copy(update={"demand": demand}).phase_demand()


def _as_demand(spec: ModelSpec, figures: dict[LibPhase, float]) -> Demand:
    if spec.serving == "aggregated":
        return Demand(requests_per_s=round(figures["aggregated"], 6))
    return Demand(
        tokens_per_s=PhaseTokens(
            prefill=round(figures["prefill"], 3), decode=round(figures["decode"], 3)
        )
    )


def _floor(settings: PrometheusSource, model: str) -> Demand | None:
    return settings.model_floors.get(model, settings.floor)


def rates_demand(
    specs: Mapping[str, ModelSpec], rates: MeasuredRates, settings: PrometheusSource
) -> DemandReport:
    """Measured tokens/s times the headroom, raised to the floor, per model.

    A model with no samples (a new one, or one whose servers are down) falls back to its config
    demand, else its floor, with a warning naming it; floors hold in every case. Models measured
    but not in the stack are reported, not dropped silently.

    Raises:
        InputError: a model with no samples, no floor and no config demand.
    """
    measured = set(rates.prompt_tokens_per_s) | set(rates.generation_tokens_per_s)
    models, warnings = [], []
    for m, spec in sorted(specs.items()):
        if m in measured:
            models.append(_measured(m, spec, rates, settings))
            continue
        floor = _floor(settings, m)
        if spec.demand is None and floor is not None:
            figure, origin = _as_demand(spec, phase_figures(spec, floor)), "floor"
        else:
            figure, origin = _config_figure(m, spec, "no samples and no floor"), "config"
        models.append(ModelDemand(model=m, demand=figure, origin=origin, detail="no samples"))
        warnings.append(f"Prometheus has no samples for {m}: using its {origin} demand")
    unknown = sorted(measured - set(specs))
    warnings += [f"Prometheus serves {m}, which the stack does not: not planned" for m in unknown]
    report = DemandReport(
        kind="prometheus", models=models, warnings=warnings, unknown_models=unknown,
        lengths={m: x for m, x in rates.lengths.items() if m in specs},
    )  # fmt: skip
    return with_floors(specs, report, settings)


def _measured(
    model: str, spec: ModelSpec, rates: MeasuredRates, settings: PrometheusSource
) -> ModelDemand:
    """One measured model: prompt and output tokens/s times the headroom."""
    seen = PhaseTokens(
        prefill=rates.prompt_tokens_per_s.get(model, 0.0) * settings.headroom,
        decode=rates.generation_tokens_per_s.get(model, 0.0) * settings.headroom,
    )
    figures = phase_figures(spec, Demand(tokens_per_s=seen))
    detail = f"{' and '.join(rates.queries)} x {settings.headroom:g}"
    return ModelDemand(
        model=model, demand=_as_demand(spec, figures), origin="prometheus", detail=detail
    )


def with_floors(
    specs: Mapping[str, ModelSpec], report: DemandReport, settings: PrometheusSource
) -> DemandReport:
    """Each model's figure raised to its floor, phase by phase, whatever the figure's source."""
    models = []
    for md in report.models:
        floor = _floor(settings, md.model)
        spec = specs[md.model]
        have = phase_figures(spec, md.demand)
        low = have if floor is None else phase_figures(spec, floor)
        if all(low[p] <= have[p] for p in have):
            models.append(md)
            continue
        figures = {p: max(have[p], low[p]) for p in have}
        update = {"demand": _as_demand(spec, figures), "origin": f"{md.origin}+floor"}
        models.append(md.model_copy(update=update))
    return report.model_copy(update={"models": models})


def rate_query(metric: str, settings: PrometheusSource, skip_phase: str) -> str:
    """PromQL: per-model rate of one vLLM counter, off the nodes of the phase that repeats it.

    In disaggregated serving a decode node also counts each prompt, and a prefill node the one
    token it generates, so prompt tokens are summed off decode nodes and output tokens off
    prefill nodes (by `phase_label`).
    """
    selector = f'{{{settings.phase_label}!="{skip_phase}"}}'
    return f"sum by ({settings.model_label}) (rate({metric}{selector}[{settings.window}]))"


def demand_file_text(doc: DemandFile, header: list[str]) -> str:
    """Deterministic YAML for a demand file: header comment lines, then sorted models."""
    data = doc.model_dump(mode="json", exclude_none=True)
    data["demand"] = {
        m: doc.demand[m].model_dump(mode="json", exclude_none=True) for m in sorted(doc.demand)
    }
    if doc.lengths:
        data["lengths"] = {m: doc.lengths[m].model_dump(mode="json") for m in sorted(doc.lengths)}
    else:
        data.pop("lengths", None)
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)
    return "".join(f"# {line}\n" for line in header) + body
