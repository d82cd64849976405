"""Simulator: a hand-computed three-request case, invariants, routing, traces."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.errors import InputError
from solver.simulation.simulator import decode_pass, engine_pass, simulate, smooth_wrr
from solver.simulation.traces import WorkloadShape, generate_trace, load_trace_csv
from tests.allocation_helpers import SMALL_FLEET, fleet, libraries, perf


@dataclass
class FixedInstance:
    """Stage times that are easy to compute by hand."""

    kv_capacity: int = 10_000
    max_running: int = 1 << 30
    max_prefill_tokens: int = 1 << 30

    def decode_round_ms(self, running: int) -> float:
        return 10.0 + running  # 11 ms for one sequence, 12 ms for two

    def prefill_ms(self, tokens: int) -> tuple[float, float]:
        return tokens * 0.1, tokens * 0.05  # (latency, period)


# (arrival or ready time s, prompt or context tokens, output tokens), a KV capacity, a running cap
REQUESTS = st.lists(
    st.tuples(st.floats(0, 5), st.integers(1, 400), st.integers(1, 50)), min_size=1, max_size=60
)


def test_decode_pass_by_hand():
    """A (ready 10 ms, 2 tokens), B and C (ready 35 ms, 1 and 3 tokens). A alone: rounds of
    11 ms, done at 10 + 2 x 11 = 32 ms. At 35 ms B and C join: a round of 12 ms; B is done at
    47 ms, C alone then: 47 -> 58 -> 69 ms."""
    inst = FixedInstance()
    first, finish, peak = decode_pass(
        inst, np.array([0.010, 0.035, 0.035]), np.array([102, 201, 103]), np.array([2, 1, 3])
    )
    assert first == pytest.approx([0.021, 0.047, 0.047])
    assert finish == pytest.approx([0.032, 0.047, 0.069])
    assert peak == 201 + 103


@dataclass
class FixedEngine:
    """A pipeline whose every stage takes 1 ms + 0.1 ms per token of the micro-batch (plus, to
    show interference, 0.01 ms per cached token of its decodes)."""

    stages: tuple[int, ...] = (1,)
    kv_capacity: int = 10_000

    def batch_stage_ms(
        self, tokens: int, decode_seqs: int, decode_context: float, prefill_pairs: float
    ) -> list[float]:
        return [1.0 + 0.1 * tokens] * len(self.stages)


def test_engine_chunks_prefill_and_shares_steps_with_decode_by_hand():
    """Chunk 100. A (t=0, prompt 150, 3 out): its first chunk of 100 runs 0-11 ms. B (t=1 ms,
    prompt 50, 2 out) waits. At 11 ms one step holds A's last 50 and B's 50: 11-22 ms, both
    first tokens at 22 ms. Then both decode in one step of 2 tokens (1.2 ms): B is done at
    23.2 ms; A decodes alone (1.1 ms): done at 24.3 ms."""
    first, finish, peak = engine_pass(
        FixedEngine(), np.array([0.0, 0.001]), np.array([150, 50]), np.array([3, 2]), 100, 8
    )
    assert first == pytest.approx([0.022, 0.022])
    assert finish == pytest.approx([0.0243, 0.0232])
    assert peak == 160 + 64  # 16-token blocks: A holds 10 (150 + a decode), B 4 (50 + 1)


def test_engine_keeps_one_micro_batch_per_stage_in_flight_by_hand():
    """Two stages of 11 ms for 100 tokens. A and B (t=0, 100-token prompts, 1 out each, chunk
    100): A enters stage 1 at 0, stage 2 at 11 ms (done 22 ms); B enters stage 1 when it frees
    at 11 ms, stage 2 at 22 ms: done 33 ms. A request is never in two micro-batches."""
    _, finish, _ = engine_pass(
        FixedEngine(stages=(1, 1)), np.array([0.0, 0.0]), np.array([100, 100]), np.array([1, 1]),
        100, 8,
    )  # fmt: skip
    assert finish == pytest.approx([0.022, 0.033])


def test_a_prefill_chunk_stalls_the_decodes_beside_it_for_its_whole_pipeline():
    """Regression: decode used to resume once a prefill left the first stage. A decodes (out 4)
    while B's 400-token prompt arrives: every step holding one of B's chunks takes both stages
    at the chunk's size, so A's TPOT rises with B's prompt, and by more on two stages than one."""

    def tpot(stages: tuple[int, ...], b_prompt: int) -> float:
        first, finish, _ = engine_pass(
            FixedEngine(stages=stages),
            np.array([0.0, 0.0005]),
            np.array([10, b_prompt]),
            np.array([4, 1]),
            200,
            8,
        )
        return float(finish[0] - first[0]) / 3

    assert tpot((1,), 400) > tpot((1,), 10)
    assert tpot((1, 1), 400) > tpot((1,), 400)


def test_engine_preempts_when_the_kv_cache_fills_and_still_finishes_everything():
    """Paged KV: 8 blocks of 16 tokens. Two requests of 40 + 40 tokens need 5 blocks each at
    the end; both are admitted (3 blocks each at first), then one is preempted and recomputed,
    and both finish, with the peak within the capacity."""
    first, finish, peak = engine_pass(
        FixedEngine(kv_capacity=128), np.array([0.0, 0.0]), np.array([40, 40]), np.array([40, 40]),
        512, 8,
    )  # fmt: skip
    assert np.all(np.isfinite(finish)) and np.all(finish > first)
    assert peak <= 128


@settings(max_examples=60, deadline=None, derandomize=True)
@given(REQUESTS, st.integers(300, 3000), st.integers(1, 64))
def test_decode_invariants(reqs, capacity, max_running):
    """Time never goes back, each request finishes once, KV never exceeds the capacity."""
    inst = FixedInstance(kv_capacity=capacity, max_running=max_running)
    reqs.sort()
    ready = np.array([r[0] for r in reqs])
    context = np.array([r[1] + r[2] for r in reqs])
    tokens = np.array([r[2] for r in reqs])
    first, finish, peak = decode_pass(inst, ready, context, tokens)
    fits = context <= capacity
    assert np.all(np.isfinite(finish[fits]))
    assert np.all(first[fits] > ready[fits]) and np.all(finish[fits] >= first[fits])
    assert np.all(np.isinf(finish[~fits]))
    assert peak <= capacity
    # each round is at least 11 ms, so a request needing k tokens takes at least 11k ms
    assert np.all(finish[fits] - ready[fits] >= tokens[fits] * 0.011 - 1e-9)


def test_two_prompts_that_do_not_fit_together_both_finish():
    """Regression: two long prompts that fit the KV cache alone but not together preempted
    each other forever on a two-stage pipeline (each in flight while the other needed blocks).
    The earliest admitted is never preempted by a later one, so both finish, one after the
    other."""
    first, finish, peak = engine_pass(
        FixedEngine(stages=(1, 1), kv_capacity=4096), np.array([0.0, 0.0]),
        np.array([3000, 2500]), np.array([1, 1]), 512, 8,
    )  # fmt: skip
    assert np.all(np.isfinite(finish)) and finish[0] < finish[1]
    assert peak <= 4096


@settings(max_examples=60, deadline=None, derandomize=True)
@given(REQUESTS, st.integers(300, 3000), st.integers(1, 64), st.sampled_from([64, 256, 2048]))
def test_engine_invariants(reqs, capacity, max_running, chunk):
    """Every request that fits gets its first token after arrival and finishes once, after it;
    one that can never fit is left unfinished; KV never exceeds the capacity; output tokens after
    the first take at least a step each."""
    inst = FixedEngine(kv_capacity=capacity)
    reqs.sort()
    arrival = np.array([r[0] for r in reqs])
    prompt = np.array([r[1] for r in reqs])
    output = np.array([r[2] for r in reqs])
    first, finish, peak = engine_pass(inst, arrival, prompt, output, chunk, max_running)
    fits = -(-(prompt + output) // 16) * 16 <= capacity
    assert np.all(np.isfinite(finish[fits])) and np.all(np.isinf(finish[~fits]))
    assert np.all(first[fits] > arrival[fits]) and np.all(finish[fits] >= first[fits])
    assert peak <= capacity
    assert np.all(finish[fits] - first[fits] >= (output[fits] - 1) * 0.0011 - 1e-9)


def test_weighted_round_robin_follows_template_throughput():
    route = smooth_wrr([3.0, 1.0, 2.0], 600)
    assert np.bincount(route).tolist() == [300, 100, 200]
    # nginx smooth WRR by hand: current weights (3,1,2) -> pick 0 -> (-3,1,2) -> (0,2,4) pick 2
    # -> (3,3,0) pick 0 (tie: lowest) -> (0,4,2) pick 1 -> (3,-1,4) pick 2 -> (6,0,0) pick 0
    assert route[:6].tolist() == [0, 2, 0, 1, 2, 0]


def test_generated_traces_have_the_asked_rate_and_means():
    t = generate_trace(20, 600, 1000, 100, "BurstGPT", seed=1)
    assert len(t) / 600 == pytest.approx(20, rel=0.1)
    assert t.prompt.mean() == pytest.approx(1000, rel=0.1)
    assert t.output.mean() == pytest.approx(100, rel=0.1)
    assert np.all(np.diff(t.arrival_s) >= 0)
    gaps = np.diff(t.arrival_s)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.2)  # bursty, as configured


def test_trace_csv_round_trip_and_errors(tmp_path: Path):
    f = tmp_path / "t.csv"
    f.write_text("timestamp,prompt_tokens,output_tokens\n1.5,100,20\n0.5,50,10\n")
    t = load_trace_csv(f)
    assert t.arrival_s.tolist() == [0.5, 1.5] and t.prompt.tolist() == [50, 100]
    f.write_text("0.5,50\n")
    with pytest.raises(InputError, match="t.csv:1"):
        load_trace_csv(f)


def test_a_plan_simulated_below_capacity_meets_its_slos():
    """At half the planned demand, with the request shape the plan assumed (Poisson arrivals,
    every request at the mean lengths), queues stay short and requests meet both SLOs. With
    heavy-tailed prompts, long prompts miss a fixed TTFT SLO at any load: see docs/simulator.md."""
    f = fleet()
    from solver.plan.planner import plan_stack

    plan = plan_stack("test", f, perf().catalog, libraries())
    traces = {
        m: generate_trace(
            spec.demand.requests_per_s / 2,
            300,
            spec.mean_prompt_tokens,
            spec.mean_output_tokens,
            seed=i,
            shape=WorkloadShape(arrival_cv=1.0, prompt_sigma=0.0, output_sigma=0.0),
        )
        for i, (m, spec) in enumerate(sorted(f.models.items()))
    }
    s = simulate(plan, f.models, perf(), traces, 300).summary()
    assert s["finished"] == s["requests"] > 0
    assert s["slo_attainment"] >= 0.95
    assert s["goodput_tokens_per_s"] > 0
    for m, spec in SMALL_FLEET["models"].items():
        assert s["by_model"][m]["tpot_p50_ms"] <= spec["slo_ms"]["decode"]
    assert math.isfinite(s["ttft_p99_ms"])


def test_a_prompt_no_prefill_instance_can_hold_is_a_miss_not_a_crash():
    """Regression: a prompt larger than the prefill instances' KV cache never finishes prefill
    (inf); the decode pass used to take its inf ready time and fail. It is now a miss."""
    f = fleet()
    from solver.plan.planner import plan_stack

    plan = plan_stack("test", f, perf().catalog, libraries())
    model, spec = sorted(f.models.items())[0]
    base = generate_trace(
        spec.demand.requests_per_s / 2, 60, spec.mean_prompt_tokens, spec.mean_output_tokens,
        shape=WorkloadShape(arrival_cv=1.0, prompt_sigma=0.0, output_sigma=0.0),
    )  # fmt: skip
    huge = base.prompt.copy()
    huge[0] = 10_000_000
    traces = {model: type(base)(base.arrival_s, huge, base.output)}
    r = simulate(plan, f.models, perf(), traces, 60).models[model]
    assert np.isinf(r.finish_s[0]) and not r.met[0]
    assert np.isfinite(r.finish_s[1:]).all()


def test_cli_simulate_json(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from coral_iac.cli.app import app
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    runner = CliRunner()
    plan_file = tmp_path / "plan.json"
    lib = tmp_path / "lib"
    r = runner.invoke(
        app, ["plan", "--stack", "dev", "--library", str(lib), "--out", str(plan_file)]
    )
    assert r.exit_code == 0, r.output
    # Every phase says it has begun: the capacity model, each round, the verification.
    for line in ("capacity model: the SLO capacity of", "round 0:", "verifying the plan on 30 min"):
        assert f"SLO closed loop, {line}" in r.output, r.output
    r = runner.invoke(
        app, ["simulate", "--stack", "dev", "--plan", str(plan_file), "--duration", "120", "--json"]
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    for key in (
        "goodput_tokens_per_s",
        "slo_attainment",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
    ):
        assert key in data
    assert data["requests"] == data["finished"] > 0
    assert "retried" not in data
    # A trace of outages: every instance of the plan down from 40 s to 70 s. The requests in
    # flight then are retried once they are back, and fewer requests meet their SLOs.
    keys = [i["key"] for i in json.loads(plan_file.read_text())["instances"]]
    outages = tmp_path / "outages.csv"
    outages.write_text("instance,down_s,up_s\n" + "".join(f"{k},40,70\n" for k in keys))
    cut = ["simulate", "--stack", "dev", "--plan", str(plan_file), "--duration", "120"]
    r = runner.invoke(app, [*cut, "--json", "--outages", str(outages)])
    assert r.exit_code == 0, r.output
    lost = json.loads(r.stdout)
    assert lost["retried"] > 0 and lost["slo_attainment"] < data["slo_attainment"]
    r = runner.invoke(app, [*cut, "--outages", str(outages), "--preemptions", "2"])
    assert r.exit_code != 0 and "give --outages or --preemptions, not both" in r.output
    r = runner.invoke(
        app,
        ["simulate", "--stack", "dev", "--plan", str(plan_file), "--duration", "120"]
        + ["--capacity", "--json"],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert rows and all(set(row) >= {"template", "library", "simulated", "ratio"} for row in rows)
    # Three times the demand: the gateway's admission control sheds the excess, and says so.
    r = runner.invoke(app, [*cut, "--load", "3", "--json"])
    gated = json.loads(r.stdout)["by_model"]["phi-4"]
    assert gated["shed"] > 0 and gated["offered"] == gated["requests"] + gated["shed"]
    assert gated["offered_attainment"] < gated["slo_attainment"]
    r = runner.invoke(app, [*cut, "--load", "3", "--json", "--no-admission"])
    flooded = json.loads(r.stdout)["by_model"]["phi-4"]
    assert "shed" not in flooded and flooded["requests"] == gated["offered"]
    assert flooded["slo_attainment"] < gated["slo_attainment"]
    r = runner.invoke(app, [*cut, "--load", "3"])
    assert "SLO met of admitted" in r.output and "behind the gateway's admission" in r.output
    # A trace replay: whole by default, cut by --duration; goodput per the span replayed.
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "phi-4.csv").write_text(
        "timestamp,prompt_tokens,output_tokens\n" + "".join(f"{t},500,50\n" for t in range(200))
    )
    replay = ["simulate", "--stack", "dev", "--plan", str(plan_file), "--trace-dir", str(traces)]
    whole = json.loads(runner.invoke(app, [*replay, "--json"]).stdout)
    part = json.loads(runner.invoke(app, [*replay, "--json", "--duration", "50"]).stdout)
    assert (whole["duration_s"], whole["requests"]) == (199, 200)
    assert (part["duration_s"], part["requests"]) == (50, 50)
    assert part["goodput_tokens_per_s"] == pytest.approx(whole["goodput_tokens_per_s"], rel=0.1)


def test_a_data_parallel_stage_splits_the_batch_and_adds_kv_capacity():
    from solver.serving.instance_model import InstanceModel
    from tests.factories import data_parallel_template, single_node_template

    pm = perf()
    two = InstanceModel(pm, data_parallel_template("phi-4", 40), 1000, 1000)
    one = InstanceModel(pm, single_node_template("phi-4", "l40sx1", 40), 1000, 1000)
    # Two identical members: each takes half the batch, and together hold twice the KV.
    assert two.kv_capacity == 2 * one.kv_capacity
    assert two.prefill_ms(4096) == one.prefill_ms(2048)
    assert two.decode_round_ms(64) == one.decode_round_ms(32)
    assert two.decode_round_ms(64) < one.decode_round_ms(64)


def test_cli_bench_writes_report_and_plots(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from coral_iac.cli.app import app
    from tests.conftest import REPO

    (tmp_path / "stacks").symlink_to(REPO / "stacks")  # the library cache lands in tmp_path
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench"
    r = CliRunner().invoke(app, ["bench", "--stack", "dev", "--mode", "vllm", "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = (out / "report.md").read_text()
    methods = ("coral", "homo", "cauchy", "coral-one-gpu-type")
    for method in methods:
        assert report.count(f"| dev | vllm | {method} |") == 1
    headline = report.split("## Headline ratios")[1]
    assert headline.count("| dev | vllm |") == 1
    rows = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in rows} == set(methods)
    for row in rows:  # equal attainment: every method planned and verified to dev's 0.9
        assert row["worst_model"] >= 0.9 and not row["below_target"], row
    # A restriction of Coral's templates: never cheaper at the same targets
    by = {r["method"]: r for r in rows}
    assert by["coral-one-gpu-type"]["usd_per_hour"] >= by["coral"]["usd_per_hour"]
    for png in ("cost_by_model.png", "goodput.png", "solve_time.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_headline_says_a_baseline_that_serves_nothing():
    """A baseline that buys nothing has no cost ratio (0.00x would read as free) but 'serves
    nothing'; one that serves some models in full and another not at all (its least served
    share is 0: paper-extended-scarce's Cauchy) keeps its ratio."""
    from coral_iac.cli.bench import headline

    def row(method, usd, served, goodput, serves_any):
        return {
            "stack": "s",
            "mode": "vllm",
            "method": method,
            "usd_per_hour": usd,
            "served": served,
            "serves_any": serves_any,
            "goodput": goodput,
        }

    rows = [
        row("coral", 7.35, 1.0, 138.0, True),
        row("homo", 0.0, 0.0, 0.0, False),
        row("cauchy", 14.7, 0.0, 138.0, True),
    ]
    line = next(x for x in headline(rows) if x.startswith("| s |"))
    assert line.split(" | ")[2:4] == ["serves nothing", "2.00x"]


def test_epochs_count_start_up_time_and_replan_against_the_running_plan():
    from solver.plan.epochs import run_epochs

    f = fleet()
    # cold start, start-up as long as the epoch: nothing new serves in epoch 0; epoch 1 keeps
    # the plan
    results = run_epochs(
        "test", f, perf(), libraries(), [1.0, 1.0], epoch_s=60, startup_s=60, cold_start=True
    )
    assert results[0].added > 0 and results[0].goodput_tokens_per_s == 0
    assert results[1].added == results[1].removed == 0
    assert results[1].goodput_tokens_per_s > 0
    assert results[1].startup_penalty_usd_per_hour == pytest.approx(0, abs=1e-6)
    # scarcer availability in a later epoch serves less, and says so
    scarce = run_epochs("test", f, perf(), libraries(), [1.0, 0.0], epoch_s=60, startup_s=0)
    assert scarce[1].served_fraction < 1 and scarce[1].removed > 0
    # warm start (the default): the first epoch's fleet is serving from the start
    warm = run_epochs("test", f, perf(), libraries(), [1.0], epoch_s=60, startup_s=60)
    assert warm[0].goodput_tokens_per_s > 0


def test_library_and_simulator_agree_on_each_templates_capacity():
    """Each template driven alone past its capacity sustains its library throughput (10%)."""
    from solver.plan.planner import plan_stack
    from solver.simulation.simulator import capacity_check

    f = fleet()
    plan = plan_stack("test", f, perf().catalog, libraries())
    rows = capacity_check(plan, f.models, perf(), duration_s=300)
    assert {r["phase"] for r in rows} == {"prefill", "decode"}
    for r in rows:
        assert 0.9 <= r["ratio"] <= 1.05, r


def test_a_decode_pipeline_holds_kv_for_every_micro_batch_in_flight():
    """With S micro-batches in flight a stage may give each only 1/S of its KV cache."""
    pm = perf()
    one = {e.layers: e for e in pm.profile_table("phi-4", "decode", 500, ["l4x1"], 4000)}
    four = {
        e.layers: e for e in pm.profile_table("phi-4", "decode", 500, ["l4x1"], 4000, in_flight=4)
    }
    assert four.keys() < one.keys()  # deep stages no longer fit a sequence per micro-batch
    held = pm.card("phi-4").kv_tokens_held(4000)
    for j, e in four.items():
        assert e.batch <= e.kv_capacity_tokens // (4 * held)
        assert e.batch <= one[j].batch
    assert any(e.batch < one[j].batch for j, e in four.items())


def test_cli_bench_reports_a_failed_solve_and_goes_on(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import solver.plan.planner as planner_module
    from coral_iac.cli.app import app
    from solver.errors import InputError
    from tests.conftest import REPO

    (tmp_path / "stacks").symlink_to(REPO / "stacks")
    monkeypatch.chdir(tmp_path)
    real = planner_module.plan_stack

    def flaky(*args, method="coral", **kwargs):
        if method == "cauchy":
            raise InputError("allocation", "the cost solve ended not solved", "raise the limit")
        return real(*args, method=method, **kwargs)

    monkeypatch.setattr(planner_module, "plan_stack", flaky)
    out = tmp_path / "bench"
    r = CliRunner().invoke(app, ["bench", "--stack", "dev", "--mode", "vllm", "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = (out / "report.md").read_text()
    assert "| dev | vllm | cauchy | failed |" in report
    assert "| dev | vllm | coral | failed |" not in report
    assert "- dev vllm cauchy: allocation: the cost solve ended not solved" in report


def test_cli_bench_runs_on_a_gcp_stack(tmp_path, monkeypatch):
    """`coral bench` through the CLI on dev-gcp: every method reported, Coral verified to the
    stack's target; Homo too, since it spends the budget as it buys (the most efficient
    config's pair costs more than dev-gcp's budget, and it used to serve nothing)."""
    from typer.testing import CliRunner

    from coral_iac.cli.app import app
    from tests.conftest import REPO

    (tmp_path / "stacks").symlink_to(REPO / "stacks")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "bench"
    args = ["bench", "--stack", "dev-gcp", "--mode", "vllm", "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    report = (out / "report.md").read_text()
    for method in ("coral", "homo", "cauchy", "coral-one-gpu-type"):
        assert report.count(f"| dev-gcp | vllm | {method} |") == 1
    by = {row["method"]: row for row in json.loads((out / "results.json").read_text())}
    assert by["coral"]["worst_model"] >= 0.9 and not by["coral"]["below_target"]
    assert by["coral-one-gpu-type"]["usd_per_hour"] >= by["coral"]["usd_per_hour"] > 0
    assert by["homo"]["served"] == 1 and by["homo"]["usd_per_hour"] <= 10
