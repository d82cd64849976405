"""Demand sources with I/O: the Prometheus client, and `resolve_demand` for plan and program.

`resolve_demand(fleet, stack, stacks_dir)` is what `coral plan` and the Pulumi program call: it
reads the stack's `demand_source` and returns the fleet with each model's demand replaced by the
source's figures. The pure rules (headroom, floors, fallbacks) are in
`solver/operations/demand_rules.py`; this module only reads files and asks Prometheus's HTTP API
(`GET /api/v1/query`, an instant query) for `rate()` of vLLM's counters
`vllm:prompt_tokens_total` and `vllm:generation_tokens_total`.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from coral_iac.project import confined, project_root
from solver.catalog.offers import load_catalog
from solver.catalog.user_models import stack_cards
from solver.errors import InputError, mask_credentials
from solver.operations.demand_rules import (
    GENERATION_METRIC,
    PROMPT_METRIC,
    DemandFile,
    DemandReport,
    MeasuredRates,
    config_demand,
    file_demand,
    load_demand_file,
    rate_query,
    rates_demand,
    with_floors,
)
from solver.operations.step_calibration import Histogram, fit_lengths
from solver.stack import (
    MAX_MEAN_TOKENS,
    MAX_TOKENS_PER_S,
    Demand,
    FleetConfig,
    MeasuredLengths,
    PhaseTokens,
    PrometheusSource,
    demand_bound_problem,
)
from solver.validation import check_fleet

log = logging.getLogger(__name__)
URL_FIELD = "coral:fleet.demand_source.prometheus.url"


class PrometheusUnreachable(InputError):
    """Prometheus did not answer at all (connection refused, DNS, timeout)."""


def demand_file_path(fleet: FleetConfig, stack: str, stacks_dir: Path) -> Path:
    """The stack's demand file: `demand_source.file` or `demand/<stack>.yaml`, under stacks/.

    Raises:
        InputError: the path leaves the project (an absolute path, `..`, or a symlink out): a
            stack file must not make Coral read, or print, a file such as a private key.
    """
    path = stacks_dir / (fleet.demand_source.file or f"demand/{stack}.yaml")
    root = project_root(stacks_dir) or stacks_dir.resolve().parent
    return confined(path, "coral:fleet.demand_source.file", root)


UNREACHABLE_FIX = (
    "check the URL and that this machine can reach it; to ask another Prometheus, set "
    "CORAL_PROMETHEUS_URL=URL (read by `coral plan` and the Pulumi program) or pass "
    "--prometheus URL to `coral demand show` or `coral demand refresh`; or set "
    "demand_source.prometheus.on_unreachable: file to plan on the stack's demand file"
)


def query_vector(
    settings: PrometheusSource, promql: str, client: httpx.Client | None = None
) -> dict[str, float]:
    """One instant query; returns {model label value: sample value}, each a finite rate >= 0.

    Raises:
        PrometheusUnreachable: no answer from the server (the message names the URL).
        InputError: an HTTP error status, a Prometheus error, a result that is not a vector,
            or a sample that is not a finite number >= 0 (NaN, +Inf: named with its model).
    """
    url = settings.url.rstrip("/") + "/api/v1/query"
    data = query_data(settings, promql, client)
    return _vector(data, settings.model_label, f"Prometheus at {url}", promql)


def query_data(settings: PrometheusSource, promql: str, client: httpx.Client | None = None) -> Any:
    """One instant query's `data` (Prometheus's HTTP API answer, status checked).

    Raises:
        PrometheusUnreachable: no answer from the server (the message names the URL).
        InputError: an HTTP error status or a Prometheus error, with the query.
    """
    url = settings.url.rstrip("/") + "/api/v1/query"
    if client is None:
        with httpx.Client(timeout=settings.timeout_s) as own:
            return query_data(settings, promql, own)
    try:
        response = client.get(url, params={"query": promql})
    except httpx.TransportError as e:
        raise PrometheusUnreachable(
            URL_FIELD,
            f"cannot reach Prometheus at {url} ({type(e).__name__}: {e})",
            UNREACHABLE_FIX,
        ) from e
    except httpx.HTTPError as e:  # e.g. too many redirects
        raise InputError(
            URL_FIELD,
            f"Prometheus at {url} gave no answer to `{promql}` ({type(e).__name__}: {e})",
            "check the URL points at Prometheus itself (not Grafana or a login page)",
        ) from e
    body = _json(response)
    if response.status_code != 200 or body.get("status") != "success":
        reason = body.get("error") or response.text[:200]
        raise InputError(
            URL_FIELD,
            f"Prometheus at {url} answered HTTP {response.status_code} to `{promql}`: {reason}",
            "check the URL points at Prometheus itself (not Grafana) and the query's labels",
        )
    return body.get("data")


def _vector(data: Any, label: str, source: str, promql: str) -> dict[str, float]:
    """An instant vector's samples summed per value of `label` (samples without it skipped).

    Raises:
        InputError: not a vector of `{metric: {...}, value: [time, "number"]}` samples, or a
            rate that is not a finite number >= 0.
    """
    result = data.get("result", []) if isinstance(data, dict) else None
    if (
        not isinstance(data, dict)
        or data.get("resultType") != "vector"
        or not isinstance(result, list)
    ):
        raise InputError(
            URL_FIELD,
            f"expected a vector from `{promql}`, got {data!r:.200}",
            "check the URL points at Prometheus's HTTP API",
        )
    out: dict[str, float] = {}
    for sample in result:
        metric = sample.get("metric") if isinstance(sample, dict) else None
        value = sample.get("value") if isinstance(sample, dict) else None
        model = metric.get(label) if isinstance(metric, dict) else None
        if model is None and isinstance(metric, dict):
            continue
        if not (isinstance(model, str) and isinstance(value, list) and len(value) == 2):
            raise InputError(
                URL_FIELD,
                f"{source} answered `{promql}` with a sample that is not "
                f'{{metric: {{{label}: ...}}, value: [time, "number"]}}: {sample!r:.200}',
                "check the URL points at Prometheus's HTTP API",
            )
        out[model] = out.get(model, 0.0) + _rate(value[1], model, source, promql)
    return out


def _rate(text: Any, model: str, source: str, promql: str) -> float:
    """A sample's value: a finite number >= 0, as rate() of a counter is.

    Raises:
        InputError: NaN, +Inf, a negative number or not a number, named with its model.
    """
    try:
        rate = float(text) if isinstance(text, str | int | float) else math.nan
    except ValueError:
        rate = math.nan
    if math.isfinite(rate) and rate >= 0:
        return rate
    raise InputError(
        URL_FIELD,
        f"{source} answered {text!r:.40} tokens/s for model {model} to `{promql}`; a rate of "
        "vLLM's token counters is a finite number >= 0",
        f"check the series of {model} in Prometheus (a recording rule or relabelling that "
        "divides by zero gives NaN or Inf); meanwhile give the model demand by hand "
        "(demand_source kind: file)",
    )


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def measure_rates(settings: PrometheusSource, client: httpx.Client | None = None) -> MeasuredRates:
    """Prompt and generated tokens/s per model over the window (see `solver.operations.demand_rules.rate_query`),
    and the lengths served (`measure_lengths`)."""
    if client is None:
        with httpx.Client(timeout=settings.timeout_s) as own:
            return measure_rates(settings, own)
    prompt_q = rate_query(PROMPT_METRIC, settings, skip_phase="decode")
    generation_q = rate_query(GENERATION_METRIC, settings, skip_phase="prefill")
    prompt = query_vector(settings, prompt_q, client)
    generation = query_vector(settings, generation_q, client)
    lengths, length_queries = measure_lengths(settings, client)
    return MeasuredRates(
        prompt_tokens_per_s=prompt,
        generation_tokens_per_s=generation,
        queries=[prompt_q, generation_q, *length_queries],
        lengths=lengths,
    )


# vLLM's per-request token histograms, and the phase whose nodes repeat them (a decode node of a
# disaggregated pair counts every prompt again, a prefill node one generated token each).
LENGTH_HISTOGRAMS = (
    ("prompt", "vllm:request_prompt_tokens", "decode"),
    ("output", "vllm:request_generation_tokens", "prefill"),
)
MIN_LENGTH_REQUESTS = 50  # finished requests a model needs for its lengths to be measured


def measure_lengths(
    settings: PrometheusSource, client: httpx.Client
) -> tuple[dict[str, MeasuredLengths], list[str]]:
    """Per model, the lengths its fleet served over the window: the means of vLLM's prompt and
    generation token histograms (their sums over their counts) and the sigma of the lognormal
    that makes their buckets most likely (`fit_lengths`); a model with fewer than
    MIN_LENGTH_REQUESTS requests, or without the histograms (an older vLLM), gets none; a
    sample that is not a number >= 0 is left out (the demand's own rates are checked strictly).
    Returns them and the queries asked."""
    label, window = settings.model_label, settings.window
    hists: dict[str, dict[str, Histogram]] = {}
    queries: list[str] = []
    for name, metric, skip in LENGTH_HISTOGRAMS:
        selector = f'{{{settings.phase_label}!="{skip}"}}'
        buckets_q = f"sum by ({label}, le) (increase({metric}_bucket{selector}[{window}]))"
        sum_q = f"sum by ({label}) (increase({metric}_sum{selector}[{window}]))"
        queries += [buckets_q, sum_q]
        buckets: dict[str, dict[float, float]] = {}
        data = query_data(settings, buckets_q, client)
        for labels, value in vector_samples(data, buckets_q, strict=False):
            model, le = labels.get(label), labels.get("le")
            if model is None or le is None:
                continue
            bound = math.inf if le == "+Inf" else float(le)
            per = buckets.setdefault(model, {})
            per[bound] = per.get(bound, 0.0) + value
        sums: dict[str, float] = {}
        data = query_data(settings, sum_q, client)
        for labels, value in vector_samples(data, sum_q, strict=False):
            if (model := labels.get(label)) is not None:
                sums[model] = sums.get(model, 0.0) + value
        for model, per in buckets.items():
            hists.setdefault(model, {})[name] = Histogram.of_buckets(per, sums.get(model, 0.0))
    url = mask_credentials(settings.url)
    out = {}
    for model, h in sorted(hists.items()):
        prompt, output = h.get("prompt"), h.get("output")
        if prompt is None or output is None or min(prompt.count, output.count) < MIN_LENGTH_REQUESTS:
            continue
        p, o = fit_lengths(prompt), fit_lengths(output)
        if not all(math.isfinite(x) and x >= 1 for x in (p.mean, o.mean)):
            continue
        out[model] = MeasuredLengths(
            mean_prompt_tokens=round(min(p.mean, MAX_MEAN_TOKENS)),
            mean_output_tokens=round(min(o.mean, MAX_MEAN_TOKENS)),
            prompt_sigma=round(p.sigma, 2),
            output_sigma=round(o.sigma, 2),
            requests=int(round(output.count)),
            source=f"Prometheus {url}: vLLM's token histograms over {window}",
        )
    return out, queries


def vector_samples(
    data: Any, promql: str, strict: bool = True
) -> list[tuple[dict[str, str], float]]:
    """An instant vector's (labels, value) samples; with `strict` False, a sample that is not a
    finite number >= 0 is left out instead of refused.

    Raises:
        InputError: not a vector, or (strict) a value that is not a finite number >= 0.
    """
    result = data.get("result") if isinstance(data, dict) else None
    if (
        not isinstance(data, dict)
        or data.get("resultType") != "vector"
        or not isinstance(result, list)
    ):
        raise InputError(URL_FIELD, f"expected a vector from `{promql}`, got {data!r:.200}",
                         "check the URL points at Prometheus's HTTP API")  # fmt: skip
    out = []
    for sample in result:
        metric = sample.get("metric") if isinstance(sample, dict) else None
        value = sample.get("value") if isinstance(sample, dict) else None
        try:
            number = float(value[1]) if isinstance(value, list) and len(value) == 2 else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not isinstance(metric, dict) or not math.isfinite(number) or number < 0:
            if not strict:
                continue
            raise InputError(URL_FIELD, f"`{promql}` answered a sample that is not "
                             f"{{metric: {{...}}, value: [time, \"number >= 0\"]}}: {sample!r:.200}",
                             "check the series in Prometheus")  # fmt: skip
        out.append(({str(k): str(v) for k, v in metric.items()}, number))
    return out


def demand_report(
    fleet: FleetConfig,
    stack: str,
    stacks_dir: Path,
    prometheus_url: str | None = None,
    client: httpx.Client | None = None,
) -> DemandReport:
    """Resolve every model's demand from the stack's source, with origins and warnings.

    A prometheus source that cannot be reached fails, unless `on_unreachable: file`: then the
    stack's demand file (the last `coral demand refresh --write`) is used, with a warning.

    Raises:
        InputError: the source cannot give a model its demand (the message says which and why).
    """
    source = fleet.demand_source
    if source.kind == "config":
        return config_demand(fleet.models)
    path = demand_file_path(fleet, stack, stacks_dir)
    if source.kind == "file":
        return _file_demand(fleet, path)
    assert source.prometheus is not None  # the schema requires it for kind prometheus
    settings = with_prometheus_url(source.prometheus, prometheus_url)
    try:
        return _rates_demand(fleet, measure_rates(settings, client), settings)
    except PrometheusUnreachable as e:
        if settings.on_unreachable != "file":
            raise
        report = _file_demand(fleet, path)
        warning = f"{e.problem}: using the last refreshed demand in {path}"
        report = report.model_copy(
            update={"kind": "prometheus", "warnings": [warning, *report.warnings]}
        )
        return with_floors(fleet.models, report, settings)


def _file_demand(fleet: FleetConfig, path: Path) -> DemandReport:
    """`file_demand` of the stack's demand file, each figure first checked in its model's units.

    Raises:
        InputError: as `load_demand_file`; a figure above the demand bounds once converted
            (e.g. an aggregated model's tokens/s as requests/s), named by its key path.
    """
    doc = load_demand_file(path)
    for model, demand in sorted(doc.demand.items()):
        spec = fleet.models.get(model)
        if spec is not None and (problem := demand_bound_problem(spec, demand)):
            raise InputError(f"{path}: demand.{model}", problem, "correct the figure in the file")
    return file_demand(fleet.models, doc, str(path))


def _rates_demand(
    fleet: FleetConfig, rates: MeasuredRates, settings: PrometheusSource
) -> DemandReport:
    """`rates_demand`, each measured rate times the headroom first checked against the bounds.

    Raises:
        InputError: a model whose measured demand is above the demand bounds (a query that sums
            series it should not, most likely), named with its query.
    """
    url = mask_credentials(settings.url)
    for query, per_model in zip(
        rates.queries, (rates.prompt_tokens_per_s, rates.generation_tokens_per_s), strict=False
    ):
        for model, rate in sorted(per_model.items()):
            if rate * settings.headroom > MAX_TOKENS_PER_S:
                raise InputError(
                    URL_FIELD,
                    f"Prometheus at {url} measured {rate:.3g} tokens/s for {model} (`{query}`), "
                    f"x headroom {settings.headroom:g}: above the {MAX_TOKENS_PER_S:.0e} tokens/s "
                    "a demand may be",
                    "check that the query's labels select only vLLM's counters of this fleet",
                )
    for model, spec in sorted(fleet.models.items()):
        seen = PhaseTokens(
            prefill=rates.prompt_tokens_per_s.get(model, 0.0) * settings.headroom,
            decode=rates.generation_tokens_per_s.get(model, 0.0) * settings.headroom,
        )
        if problem := demand_bound_problem(spec, Demand(tokens_per_s=seen)):
            raise InputError(
                URL_FIELD,
                f"Prometheus at {url} measured for {model}: {problem}",
                "check that the query's labels select only vLLM's counters of this fleet",
            )
    return rates_demand(fleet.models, rates, settings)


URL_ENV = "CORAL_PROMETHEUS_URL"


def with_prometheus_url(settings: PrometheusSource, url: str | None) -> PrometheusSource:
    """The settings with another Prometheus URL: `url` (e.g. --prometheus), else the
    CORAL_PROMETHEUS_URL environment variable (one override for the CLI and the program, e.g.
    from a CI runner inside the fleet's network), else the stack's."""
    field = "--prometheus" if url else URL_ENV
    url = url or os.environ.get(URL_ENV)
    if not url:
        checked_url(settings.url, URL_FIELD)
        return settings
    return settings.model_copy(update={"url": checked_url(url, field)})


def checked_url(url: str, field: str) -> str:
    """`url` if it is an http(s) URL with a host (what Prometheus's API needs).

    Raises:
        InputError: naming `field` (the option or environment variable) and the bad URL.
    """
    try:
        parsed = httpx.URL(url)
        ok = parsed.scheme in ("http", "https") and bool(parsed.host)
    except (httpx.InvalidURL, TypeError, ValueError):
        ok = False
    if not ok:
        raise InputError(
            field,
            f"not an http(s) URL with a host: {url!r:.200}",
            "give Prometheus's base URL, e.g. http://prometheus.internal:9090",
        )
    return url


def resolve_demand(
    fleet: FleetConfig,
    stack: str,
    stacks_dir: Path,
    warn: Callable[[str], None] | None = None,
) -> FleetConfig:
    """The fleet with each model's demand from its demand source; warnings go to `warn`.

    What `coral plan` and the Pulumi program call (`warn`: the CLI's console, or
    `pulumi.log.warn`; default: this module's logger). Being the first step of both, it also
    checks the fleet against the catalog and model cards (`solver.validation.check_fleet`).

    Raises:
        InputError: as `demand_report` and `check_fleet`.
    """
    check_fleet(fleet, load_catalog(), stack_cards(fleet.model_cards))  # fail early, with paths
    report = demand_report(fleet, stack, stacks_dir)
    for line in report.warnings:
        (warn or log.warning)(line)
    return fleet.model_copy(update={"models": report.apply(fleet.models)})


def refresh_file(
    fleet: FleetConfig,
    stack: str,
    prometheus_url: str | None = None,
    client: httpx.Client | None = None,
    now: dt.datetime | None = None,
) -> tuple[DemandFile, list[str], DemandReport]:
    """Measure demand now (never falling back to the file) and build the demand file.

    Returns the file, its header comment lines and the report behind it.

    Raises:
        InputError: the stack has no prometheus source, or Prometheus cannot be read.
    """
    settings = fleet.demand_source.prometheus
    if settings is None:
        raise InputError(
            "coral:fleet.demand_source.kind",
            f"stack {stack} has demand source '{fleet.demand_source.kind}', not prometheus",
            "only a prometheus source is refreshed; edit a file source by hand",
        )
    settings = with_prometheus_url(settings, prometheus_url)
    rates = measure_rates(settings, client)
    report = _rates_demand(fleet, rates, settings)
    url = mask_credentials(settings.url)  # the file may be committed: no password in it
    when = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).replace(microsecond=0)
    doc = DemandFile(
        source=f"coral demand refresh: Prometheus {url}, rate over {settings.window} "
        f"x headroom {settings.headroom:g}, floors applied",
        retrieved_utc=when,
        demand={m.model: m.demand for m in report.models},
        lengths=report.lengths,
    )
    header = [
        f"Demand for stack {stack}, written by `coral demand refresh` at "
        f"{when.strftime('%Y-%m-%dT%H:%M:%SZ')}.",
        f"Source: Prometheus {url}, window {settings.window}, headroom {settings.headroom:g}.",
        *(f"Query: {q}" for q in rates.queries),
        f"Lengths measured for {len(report.lengths)} of {len(fleet.models)} models "
        f"({', '.join(sorted(report.lengths)) or 'none'}): the planner draws their requests "
        "from them in place of the workload's named shape.",
        *(f"{m.model}: {m.origin}" for m in report.models if m.origin != "prometheus"),
    ]
    return doc, header, report
