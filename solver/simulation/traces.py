"""Request traces: generated ones shaped like the paper's workloads, or real ones from CSV.

A trace is arrival times (seconds), prompt lengths and output lengths (tokens), as numpy arrays.

Generated traces draw arrivals from a Gamma renewal process with the model's rate, so the
coefficient of variation (CV) of inter-arrival gaps sets burstiness (CV 1 = Poisson). Lengths are
lognormal, with their mean at the stack's `mean_prompt_tokens` / `mean_output_tokens`. The shape
parameters are assumptions, chosen to match published descriptions; they are not fits. A stack's
plain "Azure Code" / "Azure Conversation" workload is the packaged trace itself
(`workload.TRACE_SHAPES`); these lognormal stand-ins miss its tails and bursts
(docs/slo-attainment.md says by how much):

| workload | arrival CV | prompt sigma | output sigma | source of the shape |
|---|---|---|---|---|
| Azure Code (lognormal) | 1.0 | 0.8 | 1.0 | Patel et al., Splitwise (ISCA 2024), Fig. 3, Azure LLM inference trace 2023: long prompts, very short outputs |
| Azure Conversation (lognormal) | 1.0 | 0.9 | 0.9 | same source: medium prompts and outputs |
| BurstGPT | 2.0 | 1.0 | 1.0 | Wang et al., BurstGPT (2024): bursty arrivals, heavy-tailed lengths |

**Lengths: one distribution, capped only at the model's context.** `LengthDistribution` is the
only source of generated lengths: its `sample` gives the requests of `generate_trace` (the closed
loop's, verification's and `coral simulate`'s), its `quantiles` the capacity model's sample
(`workload.planning_workload`), so the two cannot differ. Lengths are whole tokens, at least 1.
With the model's context (its card's `max_context`) a request is capped as vLLM serves it: the
prompt at `max_context - 1` (vLLM refuses a prompt that leaves no room for one output token; the
client is taken to truncate it), the output at `max_context - prompt` (generation stops when
the context is full), so prompt + output <= max_context. Without a context nothing is capped.
Every capped request is counted (`Trace.capped`; `Workload.capped_share`, from
`LengthDistribution.capped_share`, for the planning sample) and `cap_note` words
it for the output, so a cap that bites is never silent. Prompt and output are drawn
independently, so a capped output exceeds x with probability P(drawn output > x) x P(prompt <
max_context - x), which `quantiles` inverts: the planning sample matches the requests also
where the cap bites. `cap_lengths` is the rule itself, for a trace's recorded requests too.

Real traces: `load_trace_csv` reads `timestamp,prompt_tokens,output_tokens` rows (seconds; a
header row is optional), e.g. converted from https://github.com/Azure/AzurePublicDataset.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np
from scipy.special import ndtr, ndtri

from solver.errors import InputError


@dataclass(frozen=True)
class WorkloadShape:
    arrival_cv: float
    prompt_sigma: float
    output_sigma: float


SHAPES = {
    "Azure Code (lognormal)": WorkloadShape(1.0, 0.8, 1.0),
    "Azure Conversation (lognormal)": WorkloadShape(1.0, 0.9, 0.9),
    "BurstGPT": WorkloadShape(2.0, 1.0, 1.0),
}
DEFAULT_SHAPE = WorkloadShape(1.0, 0.9, 0.9)
# Bisection steps for a capped output quantile: each halves the interval [1, uncapped
# quantile], so 60 leave it below 1e-12 tokens for any length a float64 holds to a token.
QUANTILE_STEPS = 60
# Prompt quantiles `capped_share` integrates an output's chance of being cut over: on the shapes
# of tests/simulation/test_generated_lengths.py 10,000 midpoints are within 1% (8e-6 absolute)
# of 2,000,000, under the binomial noise of a share sampled from 100,000 requests (1e-4).
CAPPED_SHARE_POINTS = 10_000


def shape_of(workload: str) -> WorkloadShape:
    """The generated shape of a `workload` name (`SHAPES`; unknown names get `DEFAULT_SHAPE`)."""
    return SHAPES.get(workload, DEFAULT_SHAPE)


@dataclass(frozen=True)
class Trace:
    arrival_s: np.ndarray  # float64, non-decreasing
    prompt: np.ndarray  # int64 >= 1
    output: np.ndarray  # int64 >= 1
    capped: int = 0  # requests the model's context cut (LengthDistribution); 0 for a real trace

    def __len__(self) -> int:
        return len(self.arrival_s)


@dataclass(frozen=True)
class LengthDistribution:
    """Prompt and output lengths of generated requests: independent lognormals with the declared
    means (sigma 0: fixed lengths), capped only at `max_context` (None: not capped; the module
    doc gives the rule). Both the requests (`sample`) and the capacity model's sample
    (`quantiles`) come from here.

    Raises:
        InputError: a context too short for a one-token prompt and a one-token output.
    """

    mean_prompt: float
    mean_output: float
    prompt_sigma: float
    output_sigma: float
    max_context: int | None = None

    def __post_init__(self) -> None:
        if self.max_context is not None and self.max_context < 2:
            raise InputError(
                "max_context",
                f"{self.max_context} tokens hold no one-token prompt with a one-token output",
                "pass the model card's max_context (at least 2 tokens), or None not to cap",
            )

    @classmethod
    def of(
        cls,
        mean_prompt: float,
        mean_output: float,
        shape: WorkloadShape,
        max_context: int | None = None,
    ) -> LengthDistribution:
        return cls(mean_prompt, mean_output, shape.prompt_sigma, shape.output_sigma, max_context)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, int]:
        """n requests' (prompt, output) lengths, int64, and how many the context capped. Draws
        n prompts, then n outputs from `rng`, so where nothing is capped the lengths are those
        of the same seed before the cap existed."""
        prompt = _draw(rng, self.mean_prompt, self.prompt_sigma, n)
        output = _draw(rng, self.mean_output, self.output_sigma, n)
        return cap_lengths(prompt, output, self.max_context)

    def quantiles(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The prompt and the output lengths at probabilities `q` (float64, not rounded; each
        sorted for sorted `q`). A capped output quantile solves `1 - P(drawn output > x) *
        P(prompt < max_context - x) = q` by bisection; one the cap lowers by less than half a
        token (a sampled request, whole tokens, would not differ) is left as drawn, so a
        context far above the lengths leaves the quantiles as they were before the cap."""
        z = np.array([NormalDist().inv_cdf(float(x)) for x in q])
        prompt = _lognormal_at(self.mean_prompt, self.prompt_sigma, z)
        output = _lognormal_at(self.mean_output, self.output_sigma, z)
        ctx = self.max_context
        if ctx is None:
            return prompt, output
        capped_prompt = np.minimum(prompt, ctx - 1.0)
        lo, hi = np.ones_like(output), np.minimum(output, ctx - 1.0)
        for _ in range(QUANTILE_STEPS):
            mid = (lo + hi) / 2
            below = 1.0 - self._output_exceeds(mid) < np.asarray(q, dtype=np.float64)
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        capped_output = np.where(output - hi >= 0.5, np.maximum(1.0, hi), output)
        # Sorted like the uncapped quantiles (a kept one may lie under half a token above a
        # capped neighbour's).
        return capped_prompt, np.sort(capped_output)

    def capped_share(self) -> float:
        """The share of requests the cap cuts: those whose prompt reaches max_context - 1,
        plus those of a shorter prompt p whose output exceeds max_context - p, the latter
        integrated by the midpoint rule over CAPPED_SHARE_POINTS prompt quantiles below the
        cap; 0 without a context."""
        ctx = self.max_context
        if ctx is None:
            return 0.0
        fits = float(_lognormal_cdf(self.mean_prompt, self.prompt_sigma, np.array([ctx - 1.0]))[0])
        u = fits * (np.arange(CAPPED_SHARE_POINTS) + 0.5) / CAPPED_SHARE_POINTS
        if self.prompt_sigma == 0:
            prompt = np.full(CAPPED_SHARE_POINTS, float(self.mean_prompt))
        else:
            prompt = _lognormal_at(self.mean_prompt, self.prompt_sigma, ndtri(u))
        output_cut = 1.0 - _lognormal_cdf(self.mean_output, self.output_sigma, ctx - prompt)
        return (1.0 - fits) + fits * float(np.mean(output_cut))

    def _output_exceeds(self, x: np.ndarray) -> np.ndarray:
        """P(capped output > x) for 1 <= x < max_context: the drawn output above x and the
        (capped) prompt leaving more than x tokens of the context."""
        assert self.max_context is not None
        drawn = 1.0 - _lognormal_cdf(self.mean_output, self.output_sigma, x)
        room = _lognormal_cdf(self.mean_prompt, self.prompt_sigma, self.max_context - x)
        return np.asarray(drawn * room, dtype=np.float64)


def cap_lengths(
    prompt: np.ndarray, output: np.ndarray, max_context: int | None
) -> tuple[np.ndarray, np.ndarray, int]:
    """Requests' lengths as a model with `max_context` tokens of context serves them (the
    module doc's rule: the prompt at max_context - 1, the output at what the context leaves),
    and how many were cut; unchanged without a context. Generated and recorded requests alike."""
    if max_context is None:
        return prompt, output, 0
    capped_prompt = np.minimum(prompt, max_context - 1)
    capped_output = np.minimum(output, max_context - capped_prompt)
    capped = int(np.count_nonzero((capped_prompt < prompt) | (capped_output < output)))
    return capped_prompt, capped_output, capped


def _mu(mean: float, sigma: float) -> float:
    return float(np.log(mean) - sigma**2 / 2)  # so that E[X] = mean


def _draw(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    """n whole-token lengths, at least 1, lognormal with mean `mean`."""
    return np.maximum(1, np.rint(rng.lognormal(_mu(mean, sigma), sigma, n))).astype(np.int64)


def _lognormal_at(mean: float, sigma: float, z: np.ndarray) -> np.ndarray:
    """Lengths at standard-normal scores `z` (at least 1 token)."""
    return np.asarray(np.maximum(1.0, np.exp(_mu(mean, sigma) + sigma * z)), dtype=np.float64)


def _lognormal_cdf(mean: float, sigma: float, x: np.ndarray) -> np.ndarray:
    """P(length < x) (sigma 0: the length is `mean`)."""
    if sigma == 0:
        return np.asarray(mean < x, dtype=np.float64)
    with np.errstate(divide="ignore"):
        z = (np.log(np.maximum(x, 0.0)) - _mu(mean, sigma)) / sigma
    return np.asarray(ndtr(z), dtype=np.float64)


def cap_note(capped: int, total: int, max_context: int | None) -> str | None:
    """The line that says the context cut some requests, e.g. "capped at the model's
    131,072-token context: 12 of 3,600 requests"; None when none was."""
    if capped == 0 or max_context is None:
        return None
    return f"capped at the model's {max_context:,}-token context: {capped:,} of {total:,} requests"


def generate_trace(
    rate_per_s: float,
    duration_s: float,
    mean_prompt: float,
    mean_output: float,
    workload: str = "",
    seed: int = 0,
    max_context: int | None = None,
    shape: WorkloadShape | None = None,
) -> Trace:
    """Requests over [0, duration) at `rate_per_s` on average, shaped like `workload` (or an
    explicit `shape`; sigma 0 gives fixed lengths), lengths from `LengthDistribution`: capped
    at `max_context` (the model card's), not capped without one."""
    shape = shape or shape_of(workload)
    lengths = LengthDistribution.of(mean_prompt, mean_output, shape, max_context)
    rng = np.random.default_rng(seed)
    n_guess = int(rate_per_s * duration_s * 1.5 + 100)
    k = 1.0 / shape.arrival_cv**2  # Gamma shape for the wanted CV; mean gap 1/rate
    gaps = rng.gamma(k, 1.0 / (k * rate_per_s), n_guess) if rate_per_s > 0 else np.array([])
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < duration_s]
    prompt, output, capped = lengths.sample(rng, len(arrivals))
    return Trace(arrivals, prompt, output, capped)


def load_trace_csv(path: Path) -> Trace:
    """Rows of timestamp (s), prompt tokens, output tokens; sorted by time on load.

    Raises:
        InputError: a missing file or a row that is not three positive numbers.
    """
    if not path.exists():
        raise InputError(str(path), "no such trace file", "pass a CSV of timestamp,prompt,output")
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, row in enumerate(csv.reader(f), start=1):
            if not row or (i == 1 and not row[0].replace(".", "", 1).isdigit()):
                continue  # blank line or header
            try:
                t, p, o = float(row[0]), int(float(row[1])), int(float(row[2]))
            except (ValueError, IndexError) as e:
                raise InputError(
                    f"{path}:{i}", f"not timestamp,prompt,output: {row}", "fix the row"
                ) from e
            if t < 0 or p < 1 or o < 1:
                raise InputError(
                    f"{path}:{i}", f"negative time or empty request: {row}", "fix the row"
                )
            rows.append((t, p, o))
    data = np.array(sorted(rows), dtype=np.float64).reshape(-1, 3)
    return Trace(data[:, 0], data[:, 1].astype(np.int64), data[:, 2].astype(np.int64))
