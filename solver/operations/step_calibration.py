"""Fit the performance model's step times to what the running fleet measured: vLLM's own metrics.

Per replica (`ReplicaMetrics`), over a window: vLLM's histograms of time to first token and of
each request's time per output token, of prompt and generation tokens, as Prometheus keeps them
(cumulative counts at upper bounds `le`). The replica's plan gives its model, phase, GPU types
and the engine settings it runs with (`InstanceModel`, the caps the Pulumi program passed).

**The replay.** The window's load goes through the project's engine model of that replica
(`solver.simulation.simulator.engine_pass`; a prefill replica ends each request at its first
token, a decode replica runs `decode_pass`): Poisson arrivals at the measured rate, prompt and
output lengths drawn from the measured token histograms themselves (`sample_lengths`). Every
step takes `k_prefill` times its modelled time when it carries prompt tokens and `k_decode`
times when it runs decodes alone, the rule `PerfModel.step_factor` applies in planning.

**The fit.** One factor per replica (`k_prefill = k_decode`), from TTFT for a prefill replica,
TPOT for a decode replica, both for an aggregated one. The predicted latencies go through the
measured histogram's own buckets, and both are read with Prometheus's `histogram_quantile` rule
(linear within a bucket), so the buckets' coarseness biases prediction and measurement alike.
The log factor minimises the weighted squared log ratios of predicted to measured mean (exact:
the histogram's sum over its count), p50 and p90, each weighted by the inverse of its sampling
variance plus `STAT_FLOOR`; the replay keeps one seed, so the objective moves only with the
factor. The 95% interval is the delta method's: the statistics' variances (the measured counts
resampled, the replayed requests resampled) through the fit's gradient. An aggregated replica
whose one factor leaves TTFT and TPOT off in opposite directions is fitted again with its two
step kinds apart (`_split_fit`), kept when both intervals hold.

**Refusals** (`Refusal`, with the reason in words): no finished request; fewer than
`MIN_REQUESTS`; a quantile in the +Inf bucket (beyond what the buckets resolve); a factor at the
search's bounds (the model is off by more than calibration should absorb); a fit that still
misses a measured quantile by more than `MAX_MISFIT` (the model's shape is wrong, not its
scale); a 95% interval wider than `MAX_HALF_WIDTH` of the factor (too noisy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize, minimize_scalar
from scipy.special import ndtr

from solver.performance.perf_model import PerfModel
from solver.plan_schema import Plan, template_ref
from solver.serving.instance_model import InstanceModel
from solver.simulation.simulator import decode_pass, engine_pass
from solver.simulation.traces import cap_lengths
from solver.stack import ModelSpec

MIN_REQUESTS = 50  # finished requests a replica needs in the window to be fitted at all
MAX_HALF_WIDTH = 0.15  # the 95% interval may reach at most 15% either side of the factor
MAX_MISFIT = 0.25  # a fitted quantile still off by more than 25%: the model's shape is wrong
FACTOR_BOUNDS = (0.2, 5.0)  # a correction outside this is a model to fix, not to calibrate
REPLAY_MIN, REPLAY_MAX = 2000, 4000  # requests replayed per evaluation
RESAMPLES = 200  # multinomial resamples of the measured histograms for the interval
QUANTILES = (0.5, 0.9)
SEED = 0


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram over a window: cumulative counts at increasing upper bounds (the
    last +Inf), their sum and count (as `increase()` of `_bucket`, `_sum`, `_count` gives)."""

    upper: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float  # the observations' sum

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count > 0 else math.nan

    def counts(self) -> np.ndarray:
        """Observations per bucket (not cumulative), each >= 0."""
        return np.maximum(0.0, np.diff(np.array((0.0, *self.cumulative))))

    def quantile(self, q: float) -> float:
        """`histogram_quantile(q)` as Prometheus computes it: linear within the bucket that holds
        rank q x count, the first bucket's lower bound 0; +Inf when the rank is in the +Inf
        bucket, NaN for an empty histogram."""
        return _quantile(np.array(self.upper), np.array(self.cumulative), q)

    @classmethod
    def of_buckets(cls, counts: Mapping[float, float], total: float) -> Histogram:
        """From cumulative counts by upper bound (as Prometheus's `le` series give them), made
        non-decreasing: `increase()` extrapolates each series apart."""
        upper = sorted(counts)
        cumulative = np.maximum.accumulate([counts[b] for b in upper])
        return cls(tuple(upper), tuple(cumulative.tolist()), total)

    @classmethod
    def of(cls, values: np.ndarray, upper: Sequence[float] | np.ndarray) -> Histogram:
        """The histogram vLLM would record of `values` in buckets `upper` (its last +Inf)."""
        bounds = np.array(upper, dtype=np.float64)
        cumulative = [float(np.count_nonzero(values <= b)) for b in bounds]
        return cls(tuple(bounds.tolist()), tuple(cumulative), float(np.sum(values)))


def _quantile(upper: np.ndarray, cumulative: np.ndarray, q: float) -> float:
    total = cumulative[-1] if len(cumulative) else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    b = int(np.searchsorted(cumulative, rank, side="left"))
    if b >= len(upper) or math.isinf(upper[b]):
        return math.inf
    lo, below = (0.0, 0.0) if b == 0 else (float(upper[b - 1]), float(cumulative[b - 1]))
    inside = float(cumulative[b]) - below
    if inside <= 0:
        return float(upper[b])
    return lo + (float(upper[b]) - lo) * (rank - below) / inside


@dataclass(frozen=True)
class ReplicaMetrics:
    """What vLLM measured on one replica over the window."""

    replica: str  # the plan's instance key (the node's coral:replica tag)
    window_s: float
    ttft: Histogram | None
    tpot: Histogram | None  # vllm:request_time_per_output_token_seconds (per request)
    prompt_tokens: Histogram | None
    generation_tokens: Histogram | None

    @property
    def requests(self) -> float:
        """Finished requests in the window (the TTFT histogram counts each once)."""
        for h in (self.ttft, self.tpot, self.prompt_tokens):
            if h is not None and h.count > 0:
                return h.count
        return 0.0


@dataclass(frozen=True)
class ReplicaFacts:
    """What the plan says of the replica: model, phase, GPU types, and its engine model with
    the engine settings it runs with."""

    replica: str
    model: str
    phase: str  # prefill, decode or aggregated
    gpus: tuple[str, ...]
    instance: InstanceModel


@dataclass(frozen=True)
class LengthFit:
    mean: float
    sigma: float


def fit_lengths(h: Histogram) -> LengthFit:
    """A lognormal with the histogram's mean and the sigma (0 to 3) that makes its bucket counts
    most likely (multinomial likelihood; a histogram of one bucket gives sigma near 0)."""
    counts = h.counts()
    upper = np.array(h.upper)
    mean = h.mean

    def nll(sigma: float) -> float:
        mu = math.log(mean) - sigma * sigma / 2
        with np.errstate(divide="ignore"):
            z = (np.log(upper) - mu) / max(sigma, 1e-9)
        cdf = ndtr(z)
        p = np.diff(np.concatenate(([0.0], cdf)))
        return float(-np.sum(counts * np.log(np.maximum(p, 1e-12))))

    best = minimize_scalar(nll, bounds=(1e-3, 3.0), method="bounded")
    return LengthFit(mean, float(best.x))


@dataclass(frozen=True)
class Replay:
    """The window's load as replayed: rate, lengths, and the requests drawn from them."""

    rate_per_s: float
    prompt: LengthFit
    output: LengthFit
    arrival_s: np.ndarray
    prompts: np.ndarray
    outputs: np.ndarray


def sample_lengths(h: Histogram, n: int, rng: np.random.Generator) -> np.ndarray:
    """n whole-token lengths drawn from a length histogram itself: a bucket by its share of
    the count, a length log-uniform within it (the +Inf bucket at its lower bound), all scaled
    so that their mean is the histogram's (its sum over its count: exact)."""
    counts = h.counts()
    upper = np.array(h.upper)
    lower = np.concatenate(([1.0], np.maximum(1.0, upper[:-1])))
    top = np.where(np.isinf(upper), lower, np.maximum(upper, lower))
    b = rng.choice(len(counts), size=n, p=counts / counts.sum())
    u = rng.random(n)
    x = np.exp(np.log(lower[b]) + u * (np.log(top[b]) - np.log(lower[b])))
    x *= h.mean / float(np.mean(x))
    return np.asarray(np.maximum(1, np.rint(x)), dtype=np.int64)


def replay_of(metrics: ReplicaMetrics, phase: str, max_context: int | None) -> Replay:
    """The load to replay: Poisson arrivals at the measured rate, lengths drawn from the
    measured token histograms (`sample_lengths`; `fit_lengths` says what lognormal they
    resemble, for the report)."""
    assert metrics.prompt_tokens is not None and metrics.generation_tokens is not None
    rate = metrics.requests / metrics.window_s
    prompt = fit_lengths(metrics.prompt_tokens)
    output = LengthFit(1.0, 0.0) if phase == "prefill" else fit_lengths(metrics.generation_tokens)
    # The window's own count where it can (an overloaded replica's queue grows with time), at
    # least REPLAY_MIN for steady quantiles, at most REPLAY_MAX for the time a replay takes.
    n = min(REPLAY_MAX, max(REPLAY_MIN, int(metrics.requests)))
    rng = np.random.default_rng(SEED)
    arrival = np.cumsum(rng.exponential(1.0 / rate, n))
    prompts = sample_lengths(metrics.prompt_tokens, n, rng)
    outputs = (
        np.ones(n, dtype=np.int64)
        if phase == "prefill"
        else sample_lengths(metrics.generation_tokens, n, rng)
    )
    prompts, outputs, _ = cap_lengths(prompts, outputs, max_context)
    return Replay(rate, prompt, output, arrival, prompts, outputs)


class ScaledSteps:
    """An instance whose steps take `k_prefill` x their modelled time when they carry prompt
    tokens and `k_decode` x when they run decodes alone (what the simulator's passes ask)."""

    def __init__(self, inst: InstanceModel, k_prefill: float, k_decode: float) -> None:
        self.inst, self.k_prefill, self.k_decode = inst, k_prefill, k_decode
        self.stages = inst.stages
        self.kv_capacity = inst.kv_capacity
        self.max_running = inst.max_running
        self.max_batched_tokens = inst.max_batched_tokens

    def batch_stage_ms(
        self, tokens: int, decode_seqs: int, decode_context: float, prefill_pairs: float
    ) -> list[float]:
        k = self.k_prefill if prefill_pairs > 0 else self.k_decode
        return [k * ms for ms in self.inst.batch_stage_ms(tokens, decode_seqs, decode_context,
                                                          prefill_pairs)]  # fmt: skip

    def decode_round_ms(self, running: int) -> float:
        return self.k_decode * self.inst.decode_round_ms(running)


def predict(
    inst: InstanceModel, phase: str, replay: Replay, k_prefill: float, k_decode: float
) -> tuple[np.ndarray, np.ndarray]:
    """Each replayed request's (TTFT, TPOT) in seconds, vLLM's definitions: TPOT is the time
    from the first token to the last over the tokens after the first (0 for one token); a
    request the replica never finishes gets +inf."""
    scaled = ScaledSteps(inst, k_prefill, k_decode)
    arrival = replay.arrival_s
    outputs = np.ones_like(replay.prompts) if phase == "prefill" else replay.outputs
    if phase == "decode":
        context = replay.prompts + outputs
        first, finish, _ = decode_pass(scaled, arrival, context, outputs)  # type: ignore[arg-type]
    else:
        first, finish, _ = engine_pass(
            scaled,  # type: ignore[arg-type]
            arrival,
            replay.prompts,
            outputs,
            inst.max_batched_tokens,
            inst.max_running,
        )
    ttft = first - arrival
    steps = np.maximum(outputs - 1, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(steps > 0, (finish - first) / np.maximum(steps, 1), 0.0)
    return ttft, np.where(np.isfinite(finish), tpot, np.inf)


@dataclass(frozen=True)
class Quantiles:
    """A latency's statistics (s), measured and predicted: its mean (the histogram's sum over
    its count: exact), p50 and p90 (both read through the measured buckets)."""

    metric: str  # ttft or tpot
    measured: tuple[float, float, float]  # mean, p50, p90
    predicted: tuple[float, float, float]  # at the fitted factor
    uncalibrated: tuple[float, float, float]  # at factor 1


@dataclass(frozen=True)
class ReplicaFit:
    """One replica's step factors and their 95% intervals."""

    replica: str
    model: str
    phase: str
    gpus: tuple[str, ...]
    requests: int
    # Replica phase -> (factor, low, high): its steps' time over the model's. An aggregated
    # replica's prompt and decode steps fitted apart have `prefill` and `decode` instead.
    factors: dict[str, tuple[float, float, float]]
    quantiles: list[Quantiles] = field(default_factory=list)
    replay: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    replica: str
    model: str
    phase: str
    gpus: tuple[str, ...]
    requests: int
    reason: str
    quantiles: list[Quantiles] = field(default_factory=list)


# The measured latencies that set a replica's factor, per replica phase. An aggregated replica
# has one factor for all its steps unless they disagree (`_phases_disagree`): under load most
# steps mix prompt chunks and decodes, and factors apart are barely identifiable (in a replay
# at a known 1.5x, prefill and decode factors came out 1.59 and 1.38, intervals +-8-12%).
FITTED: Mapping[str, tuple[str, ...]] = {
    "prefill": ("ttft",),
    "decode": ("tpot",),
    "aggregated": ("ttft", "tpot"),
}


def fit_replica(
    facts: ReplicaFacts, metrics: ReplicaMetrics, max_context: int | None
) -> ReplicaFit | Refusal:
    """The replica's step factors (module doc), or why it cannot be fitted."""
    fitted = FITTED[facts.phase]
    n = int(round(metrics.requests))

    def refuse(reason: str, quantiles: list[Quantiles] | None = None) -> Refusal:
        return Refusal(facts.replica, facts.model, facts.phase, facts.gpus, n, reason,
                       quantiles or [])  # fmt: skip

    if n == 0:
        return refuse("no finished request in the window (is the replica serving, and scraped?)")
    if n < MIN_REQUESTS:
        return refuse(f"{n} finished requests in the window, fewer than the {MIN_REQUESTS} a fit "
                      "needs: use a longer --window")  # fmt: skip
    hists: dict[str, Histogram] = {}
    for metric, h in (("ttft", metrics.ttft), ("tpot", metrics.tpot)):
        if metric not in fitted:
            continue
        if h is None or h.count < MIN_REQUESTS:
            return refuse(f"vLLM's {metric.upper()} histogram has "
                          f"{0 if h is None else int(h.count)} observations in the window")  # fmt: skip
        hists[metric] = h
    if metrics.prompt_tokens is None or metrics.generation_tokens is None:
        return refuse("vLLM's prompt or generation token histogram is missing")
    measured = {m: measured_stats(hists[m]) for m in fitted}
    for metric, values in measured.items():
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            return refuse(f"measured {metric.upper()} mean/p50/p90 "
                          f"{', '.join(f'{v:.3g}' for v in values)} s: a quantile beyond the "
                          "histogram's last finite bucket (or at 0) cannot be fitted")  # fmt: skip
    replay = replay_of(metrics, facts.phase, max_context)

    replayed: dict[tuple[float, float], dict[str, np.ndarray]] = {}

    def latencies(log_k: float, log_decode: float | None = None) -> dict[str, np.ndarray]:
        """The replay at these factors, run once per pair (the fit, its checks and its
        interval ask the same points again)."""
        key = (log_k, log_k if log_decode is None else log_decode)
        if key not in replayed:
            k, kd = (math.exp(v) for v in key)
            replayed[key] = dict(zip(
                ("ttft", "tpot"), predict(facts.instance, facts.phase, replay, k, kd), strict=True
            ))  # fmt: skip
        return replayed[key]

    def stats_at(log_k: float, log_decode: float | None = None) -> dict[str, np.ndarray]:
        lat = latencies(log_k, log_decode)
        return {m: predicted_stats(lat[m], hists[m].upper) for m in fitted}

    def residuals(log_k: float, log_decode: float | None = None) -> np.ndarray:
        pred = stats_at(log_k, log_decode)
        return np.concatenate(
            [np.log(np.clip(pred[m], 1e-9, 1e9) / measured[m]) for m in fitted]
        )

    # Each statistic weighted by its sampling variance, measured and replayed, at factor 1 (a
    # coarse bucket's quantile counts for little, the exact mean for much).
    variance = _variances(fitted, hists, latencies(0.0))
    weights = 1.0 / (variance + STAT_FLOOR**2)
    lo, hi = math.log(FACTOR_BOUNDS[0]), math.log(FACTOR_BOUNDS[1])
    best = minimize_scalar(lambda x: float(np.sum(weights * residuals(x) ** 2)), bounds=(lo, hi),
                           method="bounded", options={"xatol": 1e-3})  # fmt: skip
    x = float(best.x)
    base, pred = stats_at(0.0), stats_at(x)
    quantiles = [
        Quantiles(m, _three(measured[m]), _three(pred[m]), _three(base[m]))
        for m in fitted
    ]
    factor = math.exp(x)

    def fitted_replica(
        factors: dict[str, tuple[float, float, float]], quantiles: list[Quantiles]
    ) -> ReplicaFit:
        return ReplicaFit(
            facts.replica, facts.model, facts.phase, facts.gpus, n, factors, quantiles,
            {"rate_per_s": replay.rate_per_s, "mean_prompt": replay.prompt.mean,
             "prompt_sigma": replay.prompt.sigma, "mean_output": replay.output.mean,
             "output_sigma": replay.output.sigma, "replayed": float(len(replay.arrival_s))},
        )  # fmt: skip

    if facts.phase == "aggregated" and _phases_disagree(residuals(x)):
        split = _split_fit(residuals, stats_at, latencies, weights, fitted, hists, x, lo, hi)
        if split is not None:
            factors, pred = split
            return fitted_replica(factors, [
                Quantiles(m, _three(measured[m]), _three(pred[m]), _three(base[m]))
                for m in fitted
            ])  # fmt: skip
    if x <= lo + 0.02 or x >= hi - 0.02:
        return refuse(f"the factor reached the search's bounds {FACTOR_BOUNDS[0]:g}-"
                      f"{FACTOR_BOUNDS[1]:g}x: the model is off by more than a calibration "
                      "should absorb", quantiles)  # fmt: skip
    misfit = float(np.max(np.abs(residuals(x))))
    if misfit > math.log(1 + MAX_MISFIT):
        return refuse(f"at the best factor ({factor:.2f}) a measured statistic is still "
                      f"{math.exp(misfit):.2f}x off: the model's shape, not its speed, disagrees "
                      "with the replica", quantiles)  # fmt: skip
    # d(residuals)/d(log k), central differences over +-DIFF_STEP
    jac = (residuals(x + DIFF_STEP) - residuals(x - DIFF_STEP)) / (2 * DIFF_STEP)
    sigma = _delta_sigma(jac, weights, _variances(fitted, hists, latencies(x)))
    low = factor * math.exp(-1.96 * sigma) if sigma is not None else 0.0
    high = factor * math.exp(1.96 * sigma) if sigma is not None else math.inf
    if sigma is None or math.exp(1.96 * sigma) - 1 > MAX_HALF_WIDTH:
        width = "unbounded" if sigma is None else f"{low:.2f}-{high:.2f}"
        return refuse(f"too noisy: the 95% interval of the factor {factor:.2f} ({width}) is wider "
                      f"than +-{MAX_HALF_WIDTH:.0%}; use a longer --window or more load",
                      quantiles)  # fmt: skip
    return fitted_replica({facts.phase: (factor, low, high)}, quantiles)


SPLIT_AT = 0.10  # one factor leaves TTFT and TPOT this far off, in opposite directions: split


def _phases_disagree(residuals: np.ndarray) -> bool:
    """Whether one factor leaves an aggregated replica's TTFT (the first three statistics) and
    TPOT (the last three) off by more than SPLIT_AT in opposite directions, by their means and
    p50s: its prompt steps and its decode steps are off by different factors."""
    ttft, tpot = residuals[[0, 1]], residuals[[3, 4]]
    bound = math.log(1 + SPLIT_AT)
    return bool(
        (np.all(ttft > 0) and np.all(tpot < 0) or np.all(ttft < 0) and np.all(tpot > 0))
        and max(np.max(np.abs(ttft)), np.max(np.abs(tpot))) > bound
    )


def _split_fit(
    residuals: Callable[..., np.ndarray],
    stats_at: Callable[..., dict[str, np.ndarray]],
    latencies: Callable[..., dict[str, np.ndarray]],
    weights: np.ndarray,
    fitted: Sequence[str],
    hists: Mapping[str, Histogram],
    x: float,
    lo: float,
    hi: float,
) -> tuple[dict[str, tuple[float, float, float]], dict[str, np.ndarray]] | None:
    """An aggregated replica's steps with prompt tokens and its steps of decodes alone fitted
    apart (the weighted least squares of `fit_replica` over two log factors, from the one
    factor `x`), with their delta-method intervals: kept only when both intervals are within
    MAX_HALF_WIDTH, both factors inside the bounds, and the fit is closer; else None (the one
    factor stands). Under load most steps mix the two, and the split is not identified."""
    def loss(v: np.ndarray) -> float:
        return float(np.sum(weights * residuals(float(v[0]), float(v[1])) ** 2))

    best = minimize(loss, np.array([x, x]), method="Nelder-Mead",
                    options={"xatol": 2e-3, "fatol": 1e-4, "maxiter": 80})  # fmt: skip
    xp, xd = (float(v) for v in best.x)
    if not (lo + 0.02 < xp < hi - 0.02 and lo + 0.02 < xd < hi - 0.02):
        return None
    if best.fun >= 0.5 * loss(np.array([x, x])):
        return None
    jac = np.column_stack([
        (residuals(xp + DIFF_STEP, xd) - residuals(xp - DIFF_STEP, xd)) / (2 * DIFF_STEP),
        (residuals(xp, xd + DIFF_STEP) - residuals(xp, xd - DIFF_STEP)) / (2 * DIFF_STEP),
    ])  # fmt: skip
    variance = _variances(fitted, hists, latencies(xp, xd))
    if not np.all(np.isfinite(variance)):
        return None
    info = jac.T @ (weights[:, None] * jac)
    if abs(np.linalg.det(info)) < 1e-9:
        return None
    inv = np.linalg.inv(info)
    wj = weights[:, None] * jac
    cov = inv @ (wj.T @ (variance[:, None] * wj)) @ inv
    sigmas = np.sqrt(np.maximum(np.diag(cov), 0.0))
    if np.any(np.exp(1.96 * sigmas) - 1 > MAX_HALF_WIDTH):
        return None
    factors = {
        phase: (math.exp(v), math.exp(v - 1.96 * sd), math.exp(v + 1.96 * sd))
        for phase, v, sd in (("prefill", xp, sigmas[0]), ("decode", xd, sigmas[1]))
    }
    return factors, stats_at(xp, xd)


DIFF_STEP = 0.05  # log-factor step of the Jacobian's central differences
# Each statistic's least relative error: how closely a histogram's buckets and a replay's
# assumptions (Poisson arrivals, lognormal lengths) can be held to, whatever the sample size.
STAT_FLOOR = 0.02


def _three(values: np.ndarray) -> tuple[float, float, float]:
    mean, p50, p90 = (float(v) for v in values)
    return mean, p50, p90


def measured_stats(h: Histogram) -> np.ndarray:
    """Mean, p50 and p90 of a measured histogram."""
    return np.array([h.mean, *(h.quantile(q) for q in QUANTILES)])


def predicted_stats(latency: np.ndarray, upper: Sequence[float] | np.ndarray) -> np.ndarray:
    """Mean, p50 and p90 of replayed latencies as vLLM would record them: finished requests
    only (vLLM observes a request when it finishes), quantiles through the measured buckets."""
    done = latency[np.isfinite(latency)]
    if not len(done):
        return np.array([math.inf] * (1 + len(QUANTILES)))
    h = Histogram.of(done, upper)
    return np.array([float(np.mean(done)), *(h.quantile(q) for q in QUANTILES)])


def _variances(
    fitted: Sequence[str], hists: Mapping[str, Histogram], replayed: Mapping[str, np.ndarray]
) -> np.ndarray:
    """The sampling variance of each residual (log mean, log p50, log p90 per metric): the
    measured side's (its counts resampled, each observation uniform within its bucket for the
    mean) plus the replay's (its requests resampled)."""
    rng = np.random.default_rng(SEED)
    out = []
    for m in fitted:
        h = hists[m]
        upper = np.array(h.upper)
        counts = h.counts()
        stats = measured_stats(h)
        # Measured: the mean's variance from the buckets (mid-points, plus a uniform's spread
        # within each; the +Inf bucket at its lower bound), the quantiles' by resampling.
        lower = np.concatenate(([0.0], upper[:-1]))
        top = np.where(np.isinf(upper), lower, upper)
        mid, width = (lower + top) / 2, top - lower
        p = counts / counts.sum()
        second = float(np.sum(p * (mid**2 + width**2 / 12)))
        var_mean = max(0.0, second - float(np.sum(p * mid)) ** 2) / counts.sum()
        sample = rng.multinomial(int(round(counts.sum())), p, RESAMPLES)
        q_draws = np.array([[_quantile(upper, np.cumsum(s), q) for q in QUANTILES] for s in sample])
        with np.errstate(divide="ignore", invalid="ignore"):
            var_q = np.var(np.log(q_draws), axis=0)
        measured_var = np.concatenate(([var_mean / stats[0] ** 2], var_q))
        # Replayed: resample its requests.
        lat = replayed[m][np.isfinite(replayed[m])]
        draws = np.array([
            predicted_stats(rng.choice(lat, len(lat)), upper) for _ in range(RESAMPLES // 4)
        ])  # fmt: skip
        with np.errstate(divide="ignore", invalid="ignore"):
            replay_var = np.var(np.log(draws), axis=0)
        out.append(measured_var + replay_var)
    return np.asarray(np.nan_to_num(np.concatenate(out), nan=np.inf, posinf=np.inf), dtype=float)


def _delta_sigma(jac: np.ndarray, weights: np.ndarray, variance: np.ndarray) -> float | None:
    """Standard deviation of the fitted log factor by the delta method: x* = argmin sum w r^2
    moves by (sum w J e) / (sum w J^2) for errors e of variances `variance`. None when the
    factor does not move the prediction (the interval is unbounded)."""
    wj = weights * jac
    info = float(np.sum(wj * jac))
    if info < 1e-6 or not np.all(np.isfinite(variance[wj != 0])):
        return None
    return math.sqrt(float(np.sum(np.where(wj != 0, wj**2 * variance, 0.0)))) / info


@dataclass(frozen=True)
class StepCorrectionFit:
    """One (GPU type, model, replica phase) correction, pooled over its replicas."""

    gpu: str
    model: str
    phase: str  # prefill, decode or aggregated
    factor: float
    low: float
    high: float
    requests: int
    replicas: tuple[str, ...]


def pool(fits: Sequence[ReplicaFit]) -> tuple[list[StepCorrectionFit], list[str]]:
    """Per (GPU type, model, replica phase): the replicas on that GPU type alone, their log factors
    averaged by inverse variance. Returns the corrections and a line for each replica that
    spans several GPU types (its factor is the whole replica's, not one GPU's: not stored)."""
    groups: dict[tuple[str, str, str], list[tuple[ReplicaFit, float, float]]] = {}
    notes = []
    for f in fits:
        if len(set(f.gpus)) != 1:
            notes.append(f"{f.replica}: spans {', '.join(sorted(set(f.gpus)))}; its factor is the "
                         "whole replica's, so it is shown but not stored (a correction per GPU "
                         "type needs a replica on that GPU alone)")  # fmt: skip
            continue
        for phase, (k, lo, hi) in f.factors.items():
            sigma = max((math.log(hi) - math.log(lo)) / (2 * 1.96), 1e-6)
            groups.setdefault((f.gpus[0], f.model, phase), []).append((f, math.log(k), sigma))
    out = []
    for (gpu, model, phase), rows in sorted(groups.items()):
        w = np.array([1 / s**2 for _, _, s in rows])
        mean = float(np.sum(w * np.array([x for _, x, _ in rows])) / np.sum(w))
        sigma = float(1 / math.sqrt(np.sum(w)))
        out.append(StepCorrectionFit(
            gpu, model, phase, math.exp(mean), math.exp(mean - 1.96 * sigma),
            math.exp(mean + 1.96 * sigma), sum(f.requests for f, _, _ in rows),
            tuple(sorted(f.replica for f, _, _ in rows)),
        ))  # fmt: skip
    return out, notes


def calibrate(
    facts: Sequence[ReplicaFacts],
    metrics: Mapping[str, ReplicaMetrics],
    max_context: Callable[[str], int | None],
    progress: Callable[[str], None] | None = None,
) -> list[ReplicaFit | Refusal]:
    """`fit_replica` of every replica of the plan (a replica without metrics is refused)."""
    out: list[ReplicaFit | Refusal] = []
    for f in facts:
        if progress:
            progress(f.replica)
        m = metrics.get(f.replica)
        if m is None:
            out.append(Refusal(f.replica, f.model, f.phase, f.gpus, 0,
                               "Prometheus has no series for it (scraped with its coral_replica "
                               "label?)"))  # fmt: skip
            continue
        out.append(fit_replica(f, m, max_context(f.model)))
    return out


def replica_facts(
    plan: Plan, models: Mapping[str, ModelSpec], base: PerfModel, deployed: PerfModel
) -> list[ReplicaFacts]:
    """Every instance of the plan as the fit replays it: its steps timed by `base` (the
    performance model without the fleet's corrections, so a factor is absolute) and its batch
    caps as the Pulumi program set them, from `deployed` (the model with the stack's
    corrections, as the program ran)."""
    out = []
    engines: dict[str, InstanceModel] = {}
    for inst in sorted(plan.instances, key=lambda i: i.key):
        ref = template_ref(inst.model, inst.phase, inst.template)
        if ref not in engines:
            template, spec = plan.templates[ref], models[inst.model]
            caps = InstanceModel.serving(deployed, template, spec)
            engine = InstanceModel.serving(base, template, spec)
            engine.max_running, engine.max_batched_tokens = caps.max_running, caps.max_batched_tokens
            engine.max_prefill_tokens = caps.max_prefill_tokens
            engines[ref] = engine
        gpus = tuple(base.catalog.node(n).gpu_id for n in plan.templates[ref].nodes)
        out.append(ReplicaFacts(inst.key, inst.model, inst.phase, gpus, engines[ref]))
    return out
