"""`coral calibrate` through the CLI, on recorded expositions of a fleet whose steps are slower
than modelled by a known factor (`recorded_fleet`), on the committed AWS and GCP dev stacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.cli.plan import load_plan
from coral_iac.components import gcp_label
from solver.errors import InputError
from solver.operations.step_calibration import Histogram, replica_facts
from solver.performance.default_model import load_perf_model
from solver.serving.instance_model import InstanceModel
from solver.serving.library import input_hashes
from solver.stack import load_stack
from tests.conftest import REPO
from tests.operations.recorded_fleet import record

RATE = 0.5  # requests/s per replica: half the dev stacks' demand, so 1.5x slower steps still keep up
SECONDS = 1200.0
runner = CliRunner()


def project(root: Path, stack: str) -> Path:
    """A scratch project holding one committed stack."""
    shutil.copy(REPO / "Pulumi.yaml", root / "Pulumi.yaml")
    (root / "stacks").mkdir(exist_ok=True)
    shutil.copy(REPO / "stacks" / f"Pulumi.{stack}.yaml", root / "stacks")
    return root


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict[str, Path]:
    """plan.json of dev (AWS) and dev-gcp (GCP), from `coral plan --out`."""
    out = {}
    for stack in ("dev", "dev-gcp"):
        root = tmp_path_factory.mktemp(stack)
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(project(root, stack))
            plan = root / "plan.json"
            r = runner.invoke(app, ["plan", "--stack", stack, "--out", str(plan),
                                    "--library", str(root / "lib")])  # fmt: skip
            assert r.exit_code == 0, r.output
        out[stack] = plan
    return out


def exposition(stack: str, plan: Path, slowdown: float, seconds: float = SECONDS, **kw) -> str:
    fleet = load_stack(REPO / "stacks", stack)
    perf = load_perf_model()
    facts = replica_facts(load_plan(plan), fleet.models, perf, perf)
    context = perf.card("phi-4").max_context
    label = gcp_label if stack == "dev-gcp" else str
    return record(facts, {f.replica: RATE for f in facts}, seconds, slowdown, context,
                  label=label, **kw)  # fmt: skip


def calibrate(stack: str, plan: Path, metrics: Path, window: str, *extra: str):
    return runner.invoke(app, ["calibrate", "--stack", stack, "--plan", str(plan), "--metrics",
                               str(metrics), "--window", window, *extra])  # fmt: skip


@pytest.mark.parametrize(("stack", "slowdown"), [("dev", 1.5), ("dev-gcp", 1.5), ("dev", 1.0)])
def test_a_recorded_slowdown_is_fitted_back(planned, tmp_path, monkeypatch, stack, slowdown):
    """Replicas serving the real Azure trace with every step `slowdown` x slower: each (GPU,
    model, phase) correction comes out within 0.1 of it, and the calibrated model predicts the
    measured means within 10% (p50s, read through vLLM's coarse buckets, within 25%) where the
    uncalibrated one (at 1.5x) misses the mean by more than 20%."""
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(exposition(stack, planned[stack], slowdown))
    monkeypatch.chdir(project(tmp_path, stack))
    r = calibrate(stack, planned[stack], metrics, "20m", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    # One replica per phase, each on one GPU type: a correction each.
    assert sorted(c["phase"] for c in data["corrections"]) == ["decode", "prefill"]
    for c in data["corrections"]:
        assert c["factor"] == pytest.approx(slowdown, abs=0.1), c
        assert c["low"] < c["factor"] < c["high"] and c["requests"] >= 500
    for row in data["replicas"]:
        for q in row["quantiles"].values():
            assert q["predicted_mean_ms"] == pytest.approx(q["measured_mean_ms"], rel=0.10), row
            assert q["predicted_p50_ms"] == pytest.approx(q["measured_p50_ms"], rel=0.25), row
            if slowdown == 1.5:
                assert q["uncalibrated_mean_ms"] < 0.8 * q["measured_mean_ms"], row


def test_write_stores_the_corrections_and_the_next_plan_uses_them(planned, tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(exposition("dev", planned["dev"], 1.5))
    monkeypatch.chdir(project(tmp_path, "dev"))
    before = (tmp_path / "stacks" / "Pulumi.dev.yaml").read_text()
    r = calibrate("dev", planned["dev"], metrics, "20m", "--write", "--plot", str(tmp_path / "p.png"))
    assert r.exit_code == 0, r.output
    assert "Wrote 2 corrections to" in r.output and (tmp_path / "p.png").stat().st_size > 10_000
    after = (tmp_path / "stacks" / "Pulumi.dev.yaml").read_text()
    # Every line of the file as it was, comments included, still there and in order.
    kept = iter(after.splitlines())
    assert all(any(line == k for k in kept) for line in before.splitlines())
    fleet = load_stack(tmp_path / "stacks", "dev")
    assert fleet.calibration is not None and fleet.calibration.window == "20m"
    assert "recorded exposition metrics.txt" in fleet.calibration.source
    factors = fleet.step_corrections()
    assert set(factors) == {("l40s", "phi-4", "prefill"), ("l40s", "phi-4", "decode")}
    assert all(v == pytest.approx(1.5, abs=0.1) for v in factors.values())
    # The library hash covers them: a library built before is stale.
    old = load_stack(REPO / "stacks", "dev")
    plain, corrected = load_perf_model(), load_perf_model(corrections=factors)
    for phase in ("prefill", "decode"):
        a = input_hashes(plain, old.library_scope(), "phi-4", phase)
        b = input_hashes(corrected, fleet.library_scope(), "phi-4", phase)
        assert a != b and set(b) - set(a) == {"step_corrections"}
    # The next plan sizes the fleet for the slower steps: it costs more.
    plan2 = tmp_path / "plan2.json"
    r = runner.invoke(app, ["plan", "--stack", "dev", "--out", str(plan2),
                            "--library", str(tmp_path / "lib")])  # fmt: skip
    assert plan2.exists(), r.output
    cost = json.loads(planned["dev"].read_text())["hourly_cost_usd"]
    assert json.loads(plan2.read_text())["hourly_cost_usd"] > 1.3 * cost
    # Calibrating again replaces them (factors are measured against the uncorrected model).
    r = calibrate("dev", planned["dev"], metrics, "20m", "--write")
    assert r.exit_code == 0, r.output
    again = load_stack(tmp_path / "stacks", "dev").step_corrections()
    assert again == pytest.approx(factors, abs=0.02)


@pytest.mark.parametrize(
    ("make", "window", "reason"),
    [
        (lambda s, p: "", "20m", "Prometheus has no series for it"),
        (lambda s, p: exposition(s, p, 1.5, seconds=60), "60s", "fewer than the 50 a fit needs"),
        (lambda s, p: exposition(s, p, 1.5, noise=1.0), "20m", "the model's shape, not its speed"),
    ],
    ids=["empty", "too-few", "noisy"],
)
def test_thin_or_noisy_data_is_refused_and_nothing_written(
    planned, tmp_path, monkeypatch, make, window, reason
):
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(make("dev", planned["dev"]))
    monkeypatch.chdir(project(tmp_path, "dev"))
    before = (tmp_path / "stacks" / "Pulumi.dev.yaml").read_text()
    r = calibrate("dev", planned["dev"], metrics, window, "--write")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert reason in text and "No correction fitted." in text, text
    assert "Nothing fitted: the stack file is unchanged." in text
    assert (tmp_path / "stacks" / "Pulumi.dev.yaml").read_text() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--window", "an hour"], "--window: not a Prometheus duration"),
        (["--prometheus", "http://prom:9090"], "--metrics: given with --prometheus"),
    ],
)
def test_bad_options_are_named(planned, tmp_path, monkeypatch, args, message):
    metrics = tmp_path / "m.txt"
    metrics.write_text("")
    monkeypatch.chdir(project(tmp_path, "dev"))
    r = runner.invoke(app, ["calibrate", "--stack", "dev", "--plan", str(planned["dev"]),
                            "--metrics", str(metrics), *args])  # fmt: skip
    assert r.exit_code == 1 and message in " ".join(r.output.split()), r.output


def test_a_stack_without_prometheus_asks_for_one(planned, tmp_path, monkeypatch):
    monkeypatch.chdir(project(tmp_path, "dev"))  # demand_source: config
    r = runner.invoke(app, ["calibrate", "--stack", "dev", "--plan", str(planned["dev"])])
    assert r.exit_code == 1
    assert "pass --prometheus URL, or --metrics FILE" in " ".join(r.output.split())


def test_histogram_quantile_reads_buckets_as_prometheus_does():
    # 10 observations <= 1, 30 in (1, 2], 60 in (2, 4], none above: 100 in all.
    h = Histogram((1.0, 2.0, 4.0, float("inf")), (10.0, 40.0, 100.0, 100.0), 250.0)
    assert h.quantile(0.05) == pytest.approx(0.5)  # the first bucket starts at 0
    assert h.quantile(0.25) == pytest.approx(1.5)  # rank 25: halfway through (1, 2]
    assert h.quantile(0.7) == pytest.approx(3.0)  # rank 70: halfway through (2, 4]
    assert h.mean == 2.5
    tail = Histogram((1.0, float("inf")), (10.0, 100.0), 500.0)
    assert tail.quantile(0.5) == float("inf")  # in the +Inf bucket: not placed


def test_a_correction_scales_its_steps_only(perf):
    from tests.factories import single_node_template

    fleet = load_stack(REPO / "stacks", "dev")
    spec = fleet.models["phi-4"]
    t = single_node_template("phi-4", "l40sx1", perf.card("phi-4").layers)
    t = t.model_copy(update={"phase": "aggregated", "unit": "requests/s"})
    plain = InstanceModel(perf, t, 2000, 1000)
    for corrections, pre, dec in (
        ({("l40s", "phi-4", "prefill"): 2.0}, 2.0, 1.0),
        ({("l40s", "phi-4", "decode"): 1.5}, 1.0, 1.5),
        ({("l40s", "phi-4", "aggregated"): 1.25}, 1.25, 1.25),
        ({("l4", "phi-4", "aggregated"): 3.0}, 1.0, 1.0),  # another GPU type
        ({("l40s", "qwen3-32b", "aggregated"): 3.0}, 1.0, 1.0),  # another model
    ):
        slow = InstanceModel(load_perf_model(corrections=corrections), t, 2000, 1000)
        assert slow.batch_stage_ms(512, 0, 0.0, 512 * 512)[0] == pytest.approx(
            pre * plain.batch_stage_ms(512, 0, 0.0, 512 * 512)[0]
        )
        assert slow.batch_stage_ms(32, 32, 1500.0, 0.0)[0] == pytest.approx(
            dec * plain.batch_stage_ms(32, 32, 1500.0, 0.0)[0]
        )
        assert slow.decode_round_ms(32) == pytest.approx(dec * plain.decode_round_ms(32))
        assert slow.prefill_ms(1024)[0] == pytest.approx(pre * plain.prefill_ms(1024)[0])
    assert spec.serving == "disaggregated"


@pytest.mark.parametrize(
    ("correction", "field"),
    [
        ({"gpu": "l41s", "model": "phi-4"}, "coral:fleet.calibration.corrections[0].gpu"),
        ({"gpu": "l40s", "model": "phi-5"}, "coral:fleet.calibration.corrections[0].model"),
    ],
)
def test_a_correction_of_an_unknown_gpu_or_model_is_named(tmp_path, correction, field):
    import yaml

    from solver.catalog.offers import load_catalog
    from solver.validation import check_fleet

    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    doc["config"]["coral:fleet"]["calibration"] = {
        "source": "test", "window": "1h", "measured_utc": "2026-12-07T00:00:00Z",
        "corrections": [correction | {"phase": "prefill", "factor": 1.2, "low": 1.1,
                                      "high": 1.3, "requests": 100}],
    }  # fmt: skip
    (tmp_path / "Pulumi.x.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError) as e:
        fleet = load_stack(tmp_path, "x")
        check_fleet(fleet, load_catalog(), load_perf_model().cards)
    assert field in str(e.value)


@pytest.mark.slow  # about 80 s of replays on 2 cores; the serving test splits a real replica
def test_an_aggregated_replica_whose_phases_are_off_apart_is_split(perf):
    """A replica serving the Azure trace aggregated whose steps with prompt tokens take 1.2x
    and whose steps of decodes alone take 2x their modelled time: one factor cannot hold both
    TTFT and TPOT, so the fit splits them, and gets each back within 0.15."""
    from unittest import mock

    from coral_iac.fleet_metrics import metrics_from_exposition
    from solver.operations.step_calibration import ReplicaFacts, fit_replica
    from tests.factories import single_node_template
    from tests.operations import recorded_fleet
    from tests.operations.recorded_fleet import replica_requests

    spec = load_stack(REPO / "stacks", "dev").models["phi-4"]
    t = single_node_template("phi-4", "l40sx1", perf.card("phi-4").layers)
    t = t.model_copy(update={"phase": "aggregated", "unit": "requests/s"})
    inst = InstanceModel.serving(perf, t, spec.model_copy(update={"serving": "aggregated"}))
    key = "phi-4/aggregated/aws:us-east-2/l40sx1/0"
    facts = ReplicaFacts(key, "phi-4", "aggregated", ("l40s",), inst)
    batch, decode = InstanceModel.batch_stage_ms, InstanceModel.decode_round_ms

    def by_phase(self, tokens, seqs, ctx, pairs):  # type: ignore[no-untyped-def]
        k = 1.2 if pairs > 0 else 2.0
        return [k * ms for ms in batch(self, tokens, seqs, ctx, pairs)]

    assert replica_requests(0.5, 60, 1).arrival_s.size > 0
    with mock.patch.multiple(InstanceModel, batch_stage_ms=by_phase,
                             decode_round_ms=lambda self, n: 2.0 * decode(self, n)):  # fmt: skip
        text = recorded_fleet.record([facts], {key: 0.5}, SECONDS, 1.0, 16384)
    metrics = metrics_from_exposition(text, [key], "20m")
    fit = fit_replica(facts, metrics[key], 16384)
    assert hasattr(fit, "factors"), fit
    assert set(fit.factors) == {"prefill", "decode"}, fit  # type: ignore[union-attr]
    assert fit.factors["prefill"][0] == pytest.approx(1.2, abs=0.15), fit.factors  # type: ignore[union-attr]
    assert fit.factors["decode"][0] == pytest.approx(2.0, abs=0.15), fit.factors  # type: ignore[union-attr]
