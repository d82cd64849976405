"""A plan's attainment if every engine step is slower than modelled (`simulate`'s
`step_scale`): computed by a change of clock, checked against slowing every step of the
simulator itself."""

from __future__ import annotations

import pytest

from solver.performance.default_model import load_perf_model
from solver.plan import attainment
from solver.serving.instance_model import InstanceModel
from solver.simulation.admission import admission_limits
from solver.simulation.simulator import simulate
from solver.simulation.workload import model_contexts
from tests.simulation.test_admission import AGG, make_plan, spec


def test_slower_steps_by_a_change_of_clock_match_slowing_every_step(monkeypatch):
    perf = load_perf_model()
    plan = make_plan(AGG)  # three instances of 2 requests/s each
    models = {"phi-4": spec(5.0)}
    sims = attainment.Simulations(perf, None)
    k = 1.3

    def behind_the_gateway(step_scale: float) -> float:
        r = sims.run(plan, models, "verify", 600.0, offered=1.0, step_scale=step_scale)
        return r["phi-4"].admitted_attainment

    by_clock, as_modelled = behind_the_gateway(k), behind_the_gateway(1.0)
    # The same requests through the same gateway on the real clock, every engine step k x as
    # long as the model says.
    contexts = model_contexts(models, perf.cards)
    traces, window = attainment._traces(models, "verify", 600.0, plan, None, contexts, 1.0)
    limits = admission_limits(plan, models)
    normal = simulate(plan, models, perf, traces, window, admission=limits).models["phi-4"]
    batch, rounds = InstanceModel.batch_stage_ms, InstanceModel.decode_round_ms
    monkeypatch.setattr(
        InstanceModel, "batch_stage_ms", lambda self, *a: [k * ms for ms in batch(self, *a)]
    )
    monkeypatch.setattr(InstanceModel, "decode_round_ms", lambda self, n: k * rounds(self, n))
    slowed = simulate(plan, models, perf, traces, window, admission=limits).models["phi-4"]
    assert as_modelled == pytest.approx(normal.admitted_attainment, abs=1e-9)
    assert by_clock == pytest.approx(slowed.admitted_attainment, abs=1e-9)  # exact
    assert by_clock < as_modelled - 0.05  # at 5 of its 6 requests/s, 1.3x slower steps bite
