"""What a simulation gives back: per-request times per model, and the summary people read
(requests, goodput, SLO attainment, TTFT and TPOT percentiles).

With admission control (`solver.simulation.admission`), a result's arrays hold the admitted
requests only and `shed` counts the others: `requests` and `slo_attainment` in the summary are
the admitted ones'; `offered`, `shed` and `offered_attainment` (shed requests counted as misses)
are added where any was shed."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ModelResult:
    model: str
    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    output: np.ndarray
    slo_ttft_ms: float
    slo_tpot_ms: float
    max_kv_used: dict[str, int] = field(default_factory=dict)  # instance -> peak KV tokens
    prefill_done_s: np.ndarray | None = None  # disaggregated: when prefill finished
    retried: int = 0  # requests cut by a spot preemption and retried on another instance
    shed: int = 0  # requests the gateway's admission control answered 429 (not in the arrays)
    capped: int = 0  # offered requests whose lengths the model's context cut (Trace.capped)

    @property
    def ttft_ms(self) -> np.ndarray:
        return np.asarray((self.first_token_s - self.arrival_s) * 1e3, dtype=np.float64)

    @property
    def tpot_ms(self) -> np.ndarray:
        steps = np.maximum(self.output - 1, 1)
        with np.errstate(invalid="ignore"):  # unfinished requests: inf - inf
            gap = (self.finish_s - self.first_token_s) * 1e3 / steps
        tpot = np.where(self.output > 1, gap, 0.0)
        return np.asarray(tpot, dtype=np.float64)

    @property
    def met(self) -> np.ndarray:
        done = np.isfinite(self.finish_s)
        met = done & (self.ttft_ms <= self.slo_ttft_ms) & (self.tpot_ms <= self.slo_tpot_ms)
        return np.asarray(met, dtype=bool)

    @property
    def offered(self) -> int:
        """Requests sent: the admitted ones (the arrays) and the shed ones."""
        return len(self.arrival_s) + self.shed

    @property
    def admitted_attainment(self) -> float:
        """Share of the admitted requests meeting both SLOs (1 when none was admitted)."""
        return float(self.met.mean()) if len(self.met) else 1.0

    @property
    def offered_attainment(self) -> float:
        """Share of every request sent, shed ones included (as misses), meeting both SLOs."""
        return float(self.met.sum()) / self.offered if self.offered else 1.0

    @property
    def shed_share(self) -> float:
        """Share of the requests sent that the gateway shed."""
        return self.shed / self.offered if self.offered else 0.0


@dataclass
class SimResult:
    duration_s: float
    models: dict[str, ModelResult]

    def summary(self) -> dict[str, object]:
        """Totals over all models plus one entry per model (JSON-ready)."""

        def pct(values: np.ndarray, q: float, digits: int) -> float | None:
            finite = values[np.isfinite(values)]
            return round(float(np.percentile(finite, q)), digits) if len(finite) else None

        def stats(rs: list[ModelResult]) -> dict[str, float | int | None]:
            ttft = np.concatenate([r.ttft_ms for r in rs])
            tpot = np.concatenate([r.tpot_ms[r.output > 1] for r in rs])
            met = np.concatenate([r.met for r in rs])
            finished = np.concatenate([np.isfinite(r.finish_s) for r in rs])
            good = sum(float(r.output[r.met].sum()) for r in rs)
            return {
                "requests": int(len(met)),
                "finished": int(finished.sum()),
                "goodput_tokens_per_s": round(good / self.duration_s, 3),
                "slo_attainment": round(float(met.mean()), 4) if len(met) else 1.0,
                "ttft_p50_ms": pct(ttft, 50, 2),
                "ttft_p99_ms": pct(ttft, 99, 2),
                "tpot_p50_ms": pct(tpot, 50, 3),
                "tpot_p99_ms": pct(tpot, 99, 3),
            }

        out: dict[str, object] = dict(stats(list(self.models.values())))
        by_model = {m: stats([r]) for m, r in sorted(self.models.items())}
        if any(r.shed for r in self.models.values()):  # only where admission control shed some
            rs = list(self.models.values())
            offered = sum(r.offered for r in rs)
            out.update(
                offered=offered,
                shed=sum(r.shed for r in rs),
                offered_attainment=round(sum(float(r.met.sum()) for r in rs) / offered, 4),
            )
            for m, r in self.models.items():
                by_model[m].update(
                    offered=r.offered,
                    shed=r.shed,
                    offered_attainment=round(r.offered_attainment, 4),
                )
        for m, r in self.models.items():  # only where the model's context cut some
            if r.capped:
                by_model[m]["capped"] = r.capped
        if any(r.retried for r in self.models.values()):  # only where preemptions cut some
            out["retried"] = sum(r.retried for r in self.models.values())
            for m, r in self.models.items():
                by_model[m]["retried"] = r.retried
        out["by_model"] = by_model
        return out
