"""Read a running fleet's latency and length histograms from Prometheus, per replica.

vLLM exports, per engine, histograms of each finished request's time to first token
(`vllm:time_to_first_token_seconds`), time per output token
(`vllm:request_time_per_output_token_seconds`), prompt and generation tokens
(`vllm:request_prompt_tokens`, `vllm:request_generation_tokens`). Over a window, for each
histogram, two instant queries to Prometheus's HTTP API:

    sum by (coral_replica, le) (increase(<histogram>_bucket{coral_replica!=""}[1h]))
    sum by (coral_replica) (increase(<histogram>_sum{coral_replica!=""}[1h]))

`coral_replica` is the scrape label carrying a node's `coral:replica` tag (the plan's instance
key; on GCP its label `coral-replica`, lowercased as GCP labels are); docs/calibration.md shows
the relabelling. What is read feeds `solver.operations.step_calibration`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from coral_iac.components import gcp_label
from coral_iac.demand_sources import URL_FIELD, query_data, vector_samples
from solver.errors import InputError
from solver.operations.step_calibration import Histogram, ReplicaMetrics
from solver.stack import PrometheusSource

HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "prompt_tokens": "vllm:request_prompt_tokens",
    "generation_tokens": "vllm:request_generation_tokens",
}


def window_seconds(window: str) -> float:
    """A Prometheus duration (`30m`, `1h`, `2d`) in seconds.

    Raises:
        InputError: not a number followed by s, m, h, d or w.
    """
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    number, unit = window[:-1], window[-1:]
    if not number.isdigit() or unit not in units or int(number) == 0:
        raise InputError("--window", f"not a Prometheus duration: {window!r}", "e.g. 1h or 30m")
    return float(int(number) * units[unit])


def histogram_queries(metric: str, label: str, window: str) -> tuple[str, str]:
    """The PromQL of a histogram's buckets and sum per replica over the window."""
    selector = f'{{{label}!=""}}'
    return (
        f"sum by ({label}, le) (increase({metric}_bucket{selector}[{window}]))",
        f"sum by ({label}) (increase({metric}_sum{selector}[{window}]))",
    )


def read_replica_metrics(
    settings: PrometheusSource,
    replicas: Iterable[str],
    window: str,
    replica_label: str = "coral_replica",
    client: httpx.Client | None = None,
) -> tuple[dict[str, ReplicaMetrics], list[str]]:
    """Each replica's histograms over `window` (replicas with no series are left out), and
    the queries asked.

    Raises:
        PrometheusUnreachable, InputError: as `query_data`; a sample that is not a number, or a
            bucket without its `le` label.
    """
    if client is None:
        with httpx.Client(timeout=settings.timeout_s) as own:
            return read_replica_metrics(settings, replicas, window, replica_label, own)
    seconds = window_seconds(window)
    # A node's label value is the key as tagged: as is on AWS, as GCP labels it on GCP.
    by_label = _label_values(replicas)
    hists: dict[str, dict[str, Histogram]] = {}
    queries: list[str] = []
    for name, metric in HISTOGRAMS.items():
        buckets_q, sum_q = histogram_queries(metric, replica_label, window)
        queries += [buckets_q, sum_q]
        buckets: dict[str, dict[float, float]] = {}
        for labels, value in vector_samples(query_data(settings, buckets_q, client), buckets_q):
            replica = by_label.get(labels.get(replica_label, ""))
            if replica is None:
                continue
            le = labels.get("le")
            if le is None:
                raise InputError(URL_FIELD, f"a sample of `{buckets_q}` has no le label: "
                                 f"{labels}", "check the metric is vLLM's histogram")  # fmt: skip
            bound = math.inf if le == "+Inf" else float(le)
            per = buckets.setdefault(replica, {})
            per[bound] = per.get(bound, 0.0) + value
        sums: dict[str, float] = {}
        for labels, value in vector_samples(query_data(settings, sum_q, client), sum_q):
            replica = by_label.get(labels.get(replica_label, ""))
            if replica is not None:
                sums[replica] = sums.get(replica, 0.0) + value
        for key, per_bound in buckets.items():
            hists.setdefault(key, {})[name] = Histogram.of_buckets(per_bound, sums.get(key, 0.0))
    out = {
        key: ReplicaMetrics(
            key,
            seconds,
            h.get("ttft"),
            h.get("tpot"),
            h.get("prompt_tokens"),
            h.get("generation_tokens"),
        )
        for key, h in sorted(hists.items())
    }
    return out, queries


def _label_values(replicas: Iterable[str]) -> dict[str, str]:
    """Label value -> instance key: a node's label is the key as tagged, as is on AWS and as
    GCP labels it (`gcp_label`) on GCP."""
    out: dict[str, str] = {}
    for key in replicas:
        out[key] = key
        out.setdefault(gcp_label(key), key)
    return out


def metrics_from_exposition(
    text: str, replicas: Iterable[str], window: str, replica_label: str = "coral_replica"
) -> dict[str, ReplicaMetrics]:
    """Each replica's histograms from a recorded exposition (the text of vLLM's `/metrics`, or
    of Prometheus's `/federate`, whose series carry the replica label): the counters as they
    stand, so `window` is the time they cover (since the replicas started, for a recording of
    fresh ones). Series of other metrics, or without the label, are ignored.

    Raises:
        InputError: text that is not the Prometheus exposition format.
    """
    seconds = window_seconds(window)
    by_label = _label_values(replicas)
    wanted = {metric: name for name, metric in HISTOGRAMS.items()}
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    sums: dict[tuple[str, str], float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise InputError("--metrics", f"not the Prometheus exposition format: {e}",
                         "pass the text of a /metrics or /federate endpoint") from e  # fmt: skip
    for family in families:
        name = wanted.get(family.name)
        if name is None:
            continue
        for sample in family.samples:
            replica = by_label.get(sample.labels.get(replica_label, ""))
            if replica is None:
                continue
            if sample.name.endswith("_bucket"):
                le = sample.labels.get("le", "+Inf")
                bound = math.inf if le == "+Inf" else float(le)
                per = buckets.setdefault((replica, name), {})
                per[bound] = per.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                sums[(replica, name)] = sums.get((replica, name), 0.0) + sample.value
    hists: dict[str, dict[str, Histogram]] = {}
    for (key, name), per_bound in buckets.items():
        hists.setdefault(key, {})[name] = Histogram.of_buckets(per_bound, sums.get((key, name), 0.0))
    return {
        key: ReplicaMetrics(key, seconds, h.get("ttft"), h.get("tpot"), h.get("prompt_tokens"),
                            h.get("generation_tokens"))  # fmt: skip
        for key, h in sorted(hists.items())
    }
