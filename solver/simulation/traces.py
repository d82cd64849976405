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

Real traces: `load_trace_csv` reads `timestamp,prompt_tokens,output_tokens` rows (seconds; a
header row is optional), e.g. converted from https://github.com/Azure/AzurePublicDataset.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


@dataclass(frozen=True)
class Trace:
    arrival_s: np.ndarray  # float64, non-decreasing
    prompt: np.ndarray  # int64 >= 1
    output: np.ndarray  # int64 >= 1

    def __len__(self) -> int:
        return len(self.arrival_s)


def generate_trace(
    rate_per_s: float,
    duration_s: float,
    mean_prompt: float,
    mean_output: float,
    workload: str = "",
    seed: int = 0,
    max_tokens: int = 32_768,
    shape: WorkloadShape | None = None,
) -> Trace:
    """Requests over [0, duration) at `rate_per_s` on average, shaped like `workload` (or an
    explicit `shape`; sigma 0 gives fixed lengths)."""
    shape = shape or SHAPES.get(workload, DEFAULT_SHAPE)
    rng = np.random.default_rng(seed)
    n_guess = int(rate_per_s * duration_s * 1.5 + 100)
    k = 1.0 / shape.arrival_cv**2  # Gamma shape for the wanted CV; mean gap 1/rate
    gaps = rng.gamma(k, 1.0 / (k * rate_per_s), n_guess) if rate_per_s > 0 else np.array([])
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < duration_s]
    n = len(arrivals)
    return Trace(
        arrivals,
        _lognormal(rng, mean_prompt, shape.prompt_sigma, n, max_tokens),
        _lognormal(rng, mean_output, shape.output_sigma, n, max_tokens),
    )


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int, cap: int) -> np.ndarray:
    mu = np.log(mean) - sigma**2 / 2  # so that E[X] = mean
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)


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
