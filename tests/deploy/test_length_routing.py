"""Length-aware routing (issue #16, Deliver 6): buckets cut at quantiles of the planning
workload, bucket streams that partition the model's stream, the shared miss budget, the
validator's checks, the HAProxy configuration (golden, `haproxy -c`) and the real proxy sending
each request to its bucket by Content-Length; `coral plan` end to end on a routed stack."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from coral_iac.cli.app import app
from coral_iac.gateway_config import gateway_upstreams, render_haproxy_config
from solver.errors import InputError
from solver.plan.length_routing import (
    decide,
    expand,
    fleet_for_plan,
    make_buckets,
    share_miss_budget,
)
from solver.plan.validator import plan_problems
from solver.plan_schema import LengthBucket, ModelAttainment, Plan, RoutingDecision
from solver.simulation.workload import model_trace
from solver.stack import LengthRouting, load_stack, parse_fleet
from tests.conftest import REPO
from tests.deploy.test_gateway import GOLDEN, make_plan, serving_keys
from tests.deploy.test_gateway_live import FakeVllm, _free_port, _wait_until_listening

runner = CliRunner()


def routed_dev(trace: str | None = "azure-conv-2023", q: tuple[float, ...] = (0.5,)):
    fleet = load_stack(REPO / "stacks", "dev")
    spec = fleet.models["phi-4"].model_copy(
        update={"workload_trace": trace, "length_routing": LengthRouting(split_quantiles=list(q))}
    )
    return fleet.model_copy(update={"models": {"phi-4": spec}})


@pytest.mark.parametrize("trace", ["azure-conv-2023", None])
def test_buckets_cut_the_planning_lengths_and_their_streams_partition_the_model(trace):
    fleet = routed_dev(trace, (0.5, 0.9))
    buckets = make_buckets(fleet, "phi-4", REPO)
    assert [b.name for b in buckets] == ["phi-4@b0", "phi-4@b1", "phi-4@b2"]
    assert sum(b.share for b in buckets) == pytest.approx(1, abs=1e-5)
    assert [round(b.share, 1) for b in buckets] == [0.5, 0.4, 0.1]
    means = [b.mean_prompt_tokens for b in buckets]
    assert means == sorted(means) and means[0] < fleet.models["phi-4"].mean_prompt_tokens
    assert buckets[1].min_body_bytes == int(buckets[0].max_prompt_tokens * 4)
    # Each bucket's verification stream is the model's, thinned to its prompts: together they
    # are the model's requests, each with its arrival time and length.
    routed = expand(fleet, {"phi-4": buckets})
    whole = model_trace(fleet.models["phi-4"], 0, "verify", 1_800, REPO)
    parts = [model_trace(routed.models[b.name], 0, "verify", 1_800, REPO) for b in buckets]
    for b, part in zip(buckets, parts, strict=True):
        assert part.prompt.min() > b.min_prompt_tokens
        assert b.max_prompt_tokens is None or part.prompt.max() <= b.max_prompt_tokens
    if trace is not None:  # a trace window is the same requests whatever the seed index
        assert sum(len(p) for p in parts) == len(whole)
        arrivals = np.sort(np.concatenate([p.arrival_s for p in parts]))
        assert np.allclose(arrivals, np.sort(whole.arrival_s), rtol=1e-9, atol=1e-6)
        assert np.array_equal(
            np.sort(np.concatenate([p.prompt for p in parts])), np.sort(whole.prompt)
        )


def test_a_cut_that_leaves_a_bucket_empty_names_the_key():
    fleet = routed_dev("azure-conv-2023", (0.5, 0.5000001))
    with pytest.raises(InputError, match=r"phi-4\.length_routing\.split_quantiles"):
        make_buckets(fleet, "phi-4", REPO)


@pytest.mark.parametrize("q", [[0.0], [0.5, 0.4], [1.0], [0.3, 0.3]])
def test_split_quantiles_must_increase_inside_0_1(q):
    with pytest.raises(ValueError, match="split_quantiles"):
        LengthRouting(split_quantiles=q)


def _bucket(i: int, lo: float, hi: float | None, share: float, target: float = 0.9):
    return LengthBucket(
        name=f"phi-4@b{i}",
        min_prompt_tokens=lo,
        max_prompt_tokens=hi,
        min_body_bytes=int(lo * 4),
        max_body_bytes=int(hi * 4) if hi is not None else None,
        share=share,
        mean_prompt_tokens=lo + 10,
        mean_output_tokens=100,
        target=target,
    )


def _with_attainment(planned: dict[str, float]) -> Plan:
    rows = [
        ModelAttainment(model=m, target=0.9, workload="w", planned=a, verified=a)
        for m, a in planned.items()
    ]
    return make_plan([]).model_copy(update={"attainment": rows})


@pytest.mark.parametrize(("short", "expected"), [(0.98, 0.82), (0.9, 0.9), (1.0, 0.8), (0.85, 0.9)])
def test_the_longest_bucket_takes_the_miss_budget_the_shorter_one_leaves(short, expected):
    buckets = [_bucket(0, 0, 1000, 0.5), _bucket(1, 1000, None, 0.5)]
    relaxed = share_miss_budget(buckets, _with_attainment({"phi-4@b0": short}), 0.9)
    assert relaxed[0] == buckets[0]
    assert relaxed[1].target == pytest.approx(expected, abs=1e-3)
    # The whole model still meets its target when each bucket meets its own.
    assert 0.5 * short + 0.5 * relaxed[1].target >= 0.9 - 1e-3 or relaxed[1].target == 0.9


def test_a_long_bucket_target_never_drops_below_half():
    buckets = [_bucket(0, 0, 1000, 0.9), _bucket(1, 1000, None, 0.1)]
    relaxed = share_miss_budget(buckets, _with_attainment({"phi-4@b0": 1.0}), 0.9)
    assert relaxed[1].target == 0.5


def _routed_plan(buckets: list[LengthBucket], rows, routed: bool = True) -> Plan:
    decision = RoutingDecision(
        model="phi-4",
        routed=routed,
        reason="test",
        one_pool_usd_per_hour=2.0,
        routed_usd_per_hour=2.0,
        one_pool_verified=None,
        routed_verified=None,
        buckets=buckets,
    )
    return make_plan(rows).model_copy(update={"routing": [decision]})


ROUTED_ROWS = [
    ("phi-4@b0", "aggregated", "l4x1", "l4x1", 1.0, 2),
    ("phi-4@b1", "aggregated", "l40sx1", "l40sx1", 2.0, 1),
]


@pytest.mark.parametrize(
    ("buckets", "rows", "problem"),
    [
        (
            [_bucket(0, 0, 1000, 0.5), _bucket(1, 900, None, 0.5)],
            ROUTED_ROWS,
            "do not cover every prompt length once",
        ),
        ([_bucket(0, 0, 1000, 0.5), _bucket(1, 1000, None, 0.3)], ROUTED_ROWS, "add up to 0.8"),
        (
            [_bucket(0, 0, 1000, 0.5), _bucket(1, 1000, None, 0.5)],
            [*ROUTED_ROWS, ("phi-4", "aggregated", "l4x1", "l4x1", 1.0, 1)],
            "routed by length, not one pool",
        ),
    ],
)
def test_the_validator_rejects_broken_routing(perf, buckets, rows, problem):
    fleet = routed_dev()
    routed = _routed_plan(buckets, rows)
    problems = plan_problems(routed, fleet.plan_scope(), perf.catalog, perf.cards)
    assert any(problem in p for p in problems), problems


def test_the_validator_rejects_routing_the_stack_did_not_ask_for(perf):
    fleet = load_stack(REPO / "stacks", "dev")  # no length_routing
    plan = _routed_plan([_bucket(0, 0, 1000, 0.5), _bucket(1, 1000, None, 0.5)], ROUTED_ROWS)
    problems = plan_problems(plan, fleet.plan_scope(), perf.catalog, perf.cards)
    assert any("does not ask for length routing" in p for p in problems), problems
    with pytest.raises(InputError, match="plan.routing"):
        fleet_for_plan(fleet.model_copy(update={"models": {}}), plan)


def test_a_stack_cannot_name_a_bucket_or_set_a_slice():
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())["config"]
    models = doc["coral:fleet"]["models"]
    bad = {**doc, "coral:fleet": {**doc["coral:fleet"], "models": {"phi-4@b0": models["phi-4"]}}}
    with pytest.raises(InputError, match=r"models\.phi-4@b0.*reserved"):
        parse_fleet(bad, "s")
    spec = {**models["phi-4"], "length_slice": {}}
    bad = {**doc, "coral:fleet": {**doc["coral:fleet"], "models": {"phi-4": spec}}}
    with pytest.raises(InputError, match=r"phi-4\.length_slice.*set by the planner"):
        parse_fleet(bad, "s")


BUCKETS = [_bucket(0, 0, 100, 0.5), _bucket(1, 100, None, 0.5)]  # 400 bytes


def routed_config(addresses: dict[str, str], port: int = 8000, interval_ms: int = 2000) -> str:
    plan = _routed_plan(
        BUCKETS, [*ROUTED_ROWS, ("qwen3-32b", "aggregated", "l40sx4", "l40sx4", 1.5, 1)]
    )
    upstreams = gateway_upstreams(plan, addresses)
    return render_haproxy_config(upstreams, "golden", port, interval_ms, buckets=plan.buckets())


def test_the_routed_gateway_configuration_matches_its_golden_file_and_haproxy_accepts_it(
    tmp_path,
):
    plan = _routed_plan(BUCKETS, ROUTED_ROWS)
    keys = [*serving_keys(plan), "qwen3-32b/aggregated/aws:us-east-2/l40sx4/0"]
    text = routed_config({k: f"10.0.0.{i + 1}:8000" for i, k in enumerate(keys)})
    path = GOLDEN / "length-routed" / "haproxy.cfg"
    if os.environ.get("CORAL_ACCEPT") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8"), f"{path} differs (CORAL_ACCEPT=1 to accept)"
    assert "req.hdr_val(content-length) le 400" in text
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text, encoding="utf-8")
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed: scripts/test installs it (scripts/debian_tools)"
    r = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0 and "[WARNING]" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_an_upstream_of_an_unknown_bucket_is_an_error():
    plan = _routed_plan(BUCKETS, ROUTED_ROWS)
    upstreams = gateway_upstreams(plan, {k: "10.0.0.1:8000" for k in serving_keys(plan)})
    with pytest.raises(InputError, match="no such length bucket"):
        render_haproxy_config(upstreams, "golden", 8000, 2000, buckets={})


def _post(port: int, path: str, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status


def test_the_real_proxy_sends_each_request_to_its_length_bucket(tmp_path):
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed: scripts/test installs it (scripts/debian_tools)"
    plan = _routed_plan(BUCKETS, ROUTED_ROWS)
    keys = [*serving_keys(plan), "qwen3-32b/aggregated/aws:us-east-2/l40sx4/0"]
    backends = {k: FakeVllm(k.split("/")[0].split("@")[0]) for k in keys}
    for b in backends.values():
        threading.Thread(target=b.serve_forever, args=(0.05,), daemon=True).start()
    port = _free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(routed_config({k: b.address for k, b in backends.items()}, port, 100))
    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=log)
    try:
        _wait_until_listening(port, proc)

        def body(words: int) -> bytes:
            return json.dumps(
                {"model": "phi-4", "messages": [{"role": "user", "content": "hi " * words}]}
            ).encode()

        short, long = body(20), body(200)
        assert len(short) <= 400 < len(long)
        statuses = [_post(port, "/phi-4/v1/chat/completions", short) for _ in range(30)]
        statuses += [_post(port, "/v1/chat/completions", long) for _ in range(20)]
        assert statuses == [200] * 50
        served = {k: len(b.served) for k, b in backends.items()}
        b0 = sum(n for k, n in served.items() if k.startswith("phi-4@b0/"))
        b1 = sum(n for k, n in served.items() if k.startswith("phi-4@b1/"))
        assert (b0, b1) == (30, 20), served  # short ones to b0, long ones to b1
        assert all(served[k] >= 10 for k in keys if k.startswith("phi-4@b0/"))  # both replicas
        assert sum(n for k, n in served.items() if k.startswith("qwen3")) == 0
        for b in backends.values():
            assert set(b.served) <= {b.model}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        for b in backends.values():
            b.kill()


def test_coral_plan_routes_a_model_by_length_end_to_end(tmp_path):
    """A one-model stack with `length_routing: always`: `coral plan` writes the buckets, their
    instances and the whole model's attainment; `coral simulate` replays each bucket on its own
    requests; `coral render` renders nodes that serve the model's own name; `coral preview`
    gives the model one gateway address."""
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    spec = doc["config"]["coral:fleet"]["models"]["phi-4"]
    spec["workload_trace"] = "azure-conv-2023"
    spec["length_routing"] = {"split_quantiles": [0.5], "mode": "always"}
    (tmp_path / "stacks").mkdir()
    (tmp_path / "Pulumi.yaml").write_text((REPO / "Pulumi.yaml").read_text())
    (tmp_path / "stacks" / "Pulumi.lr.yaml").write_text(yaml.safe_dump(doc))
    out = tmp_path / "plan.json"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = runner.invoke(app, ["plan", "--stack", "lr", "--out", str(out)])
        sim = runner.invoke(
            app, ["simulate", "--stack", "lr", "--plan", str(out), "--duration", "300", "--json"]
        )
        render = runner.invoke(app, ["render", "--stack", "lr", "--out", str(tmp_path / "ud")])
        preview = runner.invoke(app, ["preview", "--stack", "lr"])
    finally:
        os.chdir(cwd)
    assert r.exit_code == 0, r.output
    assert sim.exit_code == 0, sim.output
    assert set(json.loads(sim.output)["by_model"]) == {"phi-4@b0", "phi-4@b1"}
    assert render.exit_code == 0, render.output
    nodes = [f for f in (tmp_path / "ud").iterdir() if f.name.startswith("phi-4@")]
    assert nodes and all("--served-model-name phi-4 " in f.read_text() for f in nodes)
    assert preview.exit_code == 0, preview.output
    assert "phi-4: http://" in preview.output and "/phi-4/v1" in preview.output
    plan = Plan.model_validate_json(out.read_text())
    (decision,) = plan.routing
    assert decision.routed and [b.name for b in decision.buckets] == ["phi-4@b0", "phi-4@b1"]
    assert {i.model for i in plan.instances} == {"phi-4@b0", "phi-4@b1"}
    whole = next(a for a in plan.attainment if a.model == "phi-4")
    assert whole.verified is not None and whole.target == 0.9
    assert "phi-4@b0" in r.output and "length" in r.output


def _decided(
    one_usd, one_att, routed_usd, routed_att, mode="auto", previous=None, routed_replayed=None
):
    fleet = routed_dev()
    spec = fleet.models["phi-4"]
    routing = spec.length_routing.model_copy(update={"mode": mode})
    fleet = fleet.model_copy(
        update={"models": {"phi-4": spec.model_copy(update={"length_routing": routing})}}
    )
    buckets = [_bucket(0, 0, 1000, 0.5), _bucket(1, 1000, None, 0.5)]
    one = make_plan([("phi-4", "aggregated", "l4x1", "l4x1", 1.0, 1)]).model_copy(
        update={
            "cost_by_model": {"phi-4": {"aggregated": one_usd}},
            "attainment": [
                ModelAttainment(
                    model="phi-4", target=0.9, workload="w", planned=one_att, verified=one_att
                )
            ],
        }
    )
    routed = make_plan(ROUTED_ROWS).model_copy(
        update={
            "cost_by_model": {
                "phi-4@b0": {"aggregated": routed_usd / 2},
                "phi-4@b1": {"aggregated": routed_usd / 2},
            },
            "attainment": [
                ModelAttainment(
                    model=b.name,
                    target=0.9,
                    workload="w",
                    planned=routed_att,
                    verified=routed_att,
                    replayed=routed_replayed,
                    verified_requests=100,
                )
                for b in buckets
            ],
        }
    )
    return decide("phi-4", fleet, one, routed, buckets, previous)


@pytest.mark.parametrize(
    ("case", "routed", "reason"),
    [
        ((10.0, 0.95, 8.0, 0.93), True, "buckets save 20.0%"),
        ((10.0, 0.95, 12.0, 0.93), False, "buckets cost 20.0% more"),
        ((10.0, 0.95, 8.0, 0.85), False, "the buckets miss the target"),
        ((10.0, 0.80, 12.0, 0.93), True, "only the buckets meet the target"),
        ((10.0, 0.80, 8.0, 0.85), True, "neither meets the target; buckets closer"),
        ((10.0, 0.86, 8.0, 0.85), False, "neither meets the target; one pool closer"),
    ],
)
def test_the_planner_routes_only_when_buckets_meet_the_target_for_less(case, routed, reason):
    d = _decided(*case)
    assert d.routed is routed and reason in d.reason, d.reason
    assert d.one_pool_usd_per_hour == case[0] and d.routed_usd_per_hour == case[2]


def test_buckets_are_judged_by_the_lower_of_their_held_out_windows_and_the_whole_trace():
    """Buckets that verify 93% on the held-out windows but 85% on the whole trace miss the
    target: the decision, and the routed model's own row, go by the lower."""
    from solver.plan.length_routing import whole_model_rows

    d = _decided(10.0, 0.95, 8.0, 0.93, routed_replayed=0.85)
    assert not d.routed and d.reason == "the buckets miss the target"
    buckets = [_bucket(0, 0, 1000, 0.5), _bucket(1, 1000, None, 0.5)]
    rows = [
        ModelAttainment(
            model=b.name, target=0.9, workload="w", planned=0.93, verified=0.93,
            replayed=0.85, verified_requests=100,
        )  # fmt: skip
        for b in buckets
    ]
    plan = _routed_plan(buckets, ROUTED_ROWS).model_copy(update={"attainment": rows})
    (whole,) = [a for a in whole_model_rows(plan, routed_dev()) if a.model == "phi-4"]
    assert whole.replayed == pytest.approx(0.85) and whole.judged == pytest.approx(0.85)
    assert whole.short_by == pytest.approx(0.05)


def test_mode_always_routes_whatever_it_costs():
    assert _decided(10.0, 0.95, 30.0, 0.93, mode="always").routed


def test_a_running_one_pool_is_kept_unless_buckets_save_more_than_switching_costs():
    # dev: K = 20 / 60 minutes; the buckets' three new instances (1 $/h each) cost 1.00 $/h of
    # start-up penalty, more than the 0.50 $/h they save; the running one pool costs none.
    running = make_plan([("phi-4", "aggregated", "l4x1", "l4x1", 1.0, 1)])
    cold = _decided(10.0, 0.95, 9.5, 0.93)
    warm = _decided(10.0, 0.95, 9.5, 0.93, previous=running)
    assert cold.routed and not warm.routed
    assert "less than replacing the running one pool costs" in warm.reason


def test_bucket_nodes_in_gcp_get_names_gcp_accepts(tmp_path, preview):
    """staging with routing forced: its buckets land in AWS and GCP; every GCP network tag,
    firewall and instance name is one GCP accepts (no '@'), labels name the bucket."""
    import re

    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.staging.yaml").read_text())
    routing = doc["config"]["coral:fleet"]["models"]["gpt-oss-20b"]["length_routing"]
    routing["mode"] = "always"
    (tmp_path / "demand").mkdir()
    (tmp_path / "demand" / "staging.yaml").write_text(
        (REPO / "stacks" / "demand" / "staging.yaml").read_text()
    )
    (tmp_path / "Pulumi.staging.yaml").write_text(yaml.safe_dump(doc))
    result = preview("staging", tmp_path)
    assert {d.model for d in result.plan.routing if d.routed} == {"gpt-oss-20b"}
    gcp_name = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
    nodes = result.of_type("gcp:compute/instance:Instance")
    assert nodes, "no GCP node: the test needs buckets in GCP"
    for r in nodes:
        assert gcp_name.match(r.inputs["name"]), r.inputs["name"]
        assert all(gcp_name.match(t) for t in r.inputs["tags"]), r.inputs["tags"]
    for r in result.of_type("gcp:compute/firewall:Firewall"):
        assert "@" not in r.name and all(gcp_name.match(t) for t in r.inputs.get("targetTags", []))
