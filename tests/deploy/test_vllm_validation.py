"""vLLM 0.33.0's own start-up checks on every rendered node: the golden files and every committed
deployable stack rendered through `coral render` (tests/vllm_check.py in `.vllm-venv`).

On top of vLLM's checks, rules vLLM does not make at config time, each from the wheel's source:
- no empty pipeline stage and PP <= layers: `get_pp_indices` (vllm/distributed/utils.py) accepts
  a 0 entry, and the stage then builds no layer;
- every node of an instance resolves the same engine settings: `--nnodes` ranks are one engine
  (vllm/engine/arg_utils.py, create_engine_config), each node parsing its own flags;
- dtype, attention backend and connector equal across a prefill/decode pair: the NIXL handshake
  hashes them (compute_nixl_compatibility_hash in
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py) and refuses a mismatch.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
from typer.testing import CliRunner

from coral_iac.cli.app import app
from solver.catalog.model_cards import load_model_cards
from tests.conftest import REPO, committed_library, committed_stacks
from tests.vllm_nodes import Proc, processes, run_vllm_checks, write_models

GOLDEN = REPO / "tests" / "golden" / "bootstrap"
DEPLOYABLE = ["dev", "dev-gcp", "staging", "prod", "spot"]  # the deploy stacks; test_deploy_cli: the paper ones
PER_NODE = {"--node-rank", "--headless", "--host", "--port"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def stack_nodes(tmp_path_factory, monkeypatch_module) -> dict[str, list[Proc]]:
    """Every deployable stack previewed and rendered through the CLI, as the pull-request
    preview job runs it; stack -> its processes."""
    monkeypatch_module.chdir(REPO)
    root = tmp_path_factory.mktemp("stacks")
    runner = CliRunner()
    out: dict[str, list[Proc]] = {}
    for stack in DEPLOYABLE:
        library = ["--library", str(committed_library(stack))]  # a folder per stack, as by default
        r = runner.invoke(app, ["preview", "--stack", stack, *library])
        assert r.exit_code == 0, f"coral preview --stack {stack}:\n{r.output}"
        assert "$/hour" in r.stdout, r.stdout
        folder = root / stack
        r = runner.invoke(app, ["render", "--stack", stack, "--out", str(folder), *library])
        assert r.exit_code == 0, f"coral render --stack {stack}:\n{r.output}"
        files = sorted(folder.glob("*.yaml"))
        assert files and all(f.read_text().startswith("#cloud-config") for f in files)
        out[stack] = [p for f in files for p in processes(f)]
        assert out[stack], f"{stack}: no vllm serve process rendered"
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def golden_nodes() -> list[Proc]:
    return [p for f in sorted(GOLDEN.glob("*/node*.yaml")) for p in processes(f)]


def _by_instance(procs: list[Proc]) -> dict[str, list[Proc]]:
    groups: dict[str, list[Proc]] = defaultdict(list)
    for p in procs:
        groups[p.instance].append(p)
    return groups


def _own_rules(procs: list[Proc], results: dict[str, dict]) -> list[str]:
    """The checks vLLM does not make (module docstring); one message per broken rule."""
    problems = []
    layers = {m: c.layers for m, c in load_model_cards().items()}
    for key, group in _by_instance(procs).items():
        res = [results[p.id] for p in group]
        for p, r in zip(group, res, strict=True):
            if any(end <= start for start, end in r["stages"]):
                problems.append(f"{p.id}: an empty pipeline stage {r['stages']}")
            if len(r["stages"]) > layers[p.model]:
                problems.append(f"{p.id}: PP {len(r['stages'])} > {layers[p.model]} layers")
        if any(r["settings"] != res[0]["settings"] for r in res):
            problems.append(f"{key}: nodes resolve different engine settings")
        shared = [[a for a in _engine_flags(p.argv)] for p in group]
        if any(s != shared[0] for s in shared):
            problems.append(f"{key}: nodes render different engine flags")
    return problems


def _engine_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv[1:], 1):
        if skip:
            skip = False
            continue
        if a in PER_NODE:
            skip = a != "--headless" and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


def _pair_rules(procs: list[Proc], results: dict[str, dict]) -> list[str]:
    """dtype, attention backend and KV connector equal over a model's prefill and decode."""
    problems = []
    by_model: dict[tuple[str, str], set] = defaultdict(set)
    for p in procs:
        kv = results[p.id]["settings"]["kv_connector"]
        if kv is None:
            continue
        backend = (
            p.argv[p.argv.index("--attention-backend") + 1]
            if ("--attention-backend" in p.argv)
            else None
        )
        # a stack's nodes share its name; a golden pair's two folders are one pair
        where = p.id.split("/")[0].removesuffix("-prefill").removesuffix("-decode")
        by_model[(where, p.model)].add((results[p.id]["settings"]["dtype"], backend, kv))
    for (where, model), seen in by_model.items():
        if len(seen) > 1:
            problems.append(f"{where} {model}: prefill/decode disagree on {sorted(seen)}")
    return problems


def _assert_all_pass(procs: list[Proc], models) -> None:
    results = run_vllm_checks(procs, models)
    failed = {k: r["error"] for k, r in results.items() if not r["ok"]}
    assert not failed, "vLLM 0.33.0 refuses:\n" + "\n".join(f"{k}: {v}" for k, v in failed.items())
    problems = _own_rules(procs, results) + _pair_rules(procs, results)
    assert not problems, "\n".join(problems)


def test_every_golden_and_committed_stack_node_passes_vllm_checks(models, stack_nodes):
    """One subprocess (vLLM's import costs 5-13 s) for every golden file and stack node."""
    procs = golden_nodes() + [p for s in DEPLOYABLE for p in stack_nodes[s]]
    for stack, nodes in stack_nodes.items():
        for p in nodes:
            p.id = f"{stack}/{p.id}"
    _assert_all_pass(procs, models)


def _set(p: Proc, flag: str, value: str) -> Proc:
    q = copy.deepcopy(p)
    if flag in q.argv:
        q.argv[q.argv.index(flag) + 1] = value
    else:
        q.argv += [flag, value]
    q.id += f"+{flag}={value}"
    return q


def test_mutations_fail_with_vllms_own_message(models):
    """A broken flag makes vLLM itself refuse the node, with its message."""
    procs = golden_nodes()
    qwen = next(p for p in procs if p.model == "qwen3-32b" and "--headless" not in p.argv)
    pp = next(p for p in procs if p.partition.count(",") >= 1)
    cases = {
        "max-model-len": (_set(qwen, "--max-model-len", "65536"), "max_model_len (65536)"),
        "batch": (
            _set(_set(qwen, "--max-num-seqs", "512"), "--max-num-batched-tokens", "256"),
            "must be greater than or equal to max_num_seqs",
        ),
        "tp": (_set(qwen, "--tensor-parallel-size", "3"), "divisible by tensor parallel size"),
        "partition": (copy.deepcopy(pp), "does not match num_hidden_layers"),
        "connector": (
            _set(
                qwen,
                "--kv-transfer-config",
                '{"kv_connector":"NixlPushConnector","kv_role":"kv_prod"}',
            ),
            "kv_role",
        ),
    }
    parts = [int(x) for x in pp.partition.split(",")]
    cases["partition"][0].partition = ",".join(map(str, [parts[0] + 1, *parts[1:]]))
    cases["partition"][0].id += "+partition"
    results = run_vllm_checks([c for c, _ in cases.values()], models)
    for name, (proc, message) in cases.items():
        r = results[proc.id]
        assert not r["ok"], f"{name}: vLLM accepted {proc.argv}"
        assert message in r["error"], f"{name}: {r['error']}"


def test_own_rules_catch_what_vllm_accepts(models):
    """vLLM accepts an empty stage (a 0 in the partition) and nodes of one instance that differ;
    our rules refuse both, and a P/D pair whose dtypes differ."""
    procs = [p for p in golden_nodes() if p.id.startswith("uniform-tp-multi-node/")]
    assert len(procs) == 2
    empty = copy.deepcopy(procs)
    for p in empty:
        p.partition = "80,0"
        p.id += "+empty"
    differ = copy.deepcopy(procs)
    differ[1] = _set(differ[1], "--max-num-seqs", "128")
    pair = [
        p
        for p in golden_nodes()
        if p.id.startswith("disaggregated-") and "--headless" not in p.argv
    ]
    pair[0] = _set(pair[0], "--dtype", "float16")
    results = run_vllm_checks(empty + differ + pair + procs[1:], models)  # one import
    assert all(r["ok"] for r in results.values()), results
    assert any("empty pipeline stage" in m for m in _own_rules(empty, results))
    assert any("different engine settings" in m for m in _own_rules(differ, results))
    assert any("disagree" in m for m in _pair_rules(pair, results))
    assert not _own_rules(procs, results)


STACKS = committed_stacks()
# Benchmark stacks: heavy plans (minutes per command), run by scripts/test_slow. paper-helix is
# refused by design (general placements): test_deploy_cli asserts its message.
PAPER = [s for s in STACKS if s not in DEPLOYABLE and s != "paper-helix"]
REFUSED = "Coral cannot deploy this plan"


@pytest.mark.slow
@pytest.mark.parametrize("stack", PAPER)
def test_paper_stack_renders_nodes_vllm_accepts_or_is_refused_with_the_fix(
    stack, models, tmp_path_factory, monkeypatch
):
    """Every other committed stack through `coral preview` and `coral render`: either both exit
    0 and every rendered node passes vLLM's checks and ours, or both exit 1 with the program's
    refusal and its fix (a disaggregated model without both phases in one region when
    colocate_phases is false, an SLO attainment below target); never a crash."""
    monkeypatch.chdir(REPO)
    library = ["--library", str(committed_library(stack))]
    out = tmp_path_factory.mktemp(stack)
    runner = CliRunner()
    preview = runner.invoke(app, ["preview", "--stack", stack, *library])
    render = runner.invoke(app, ["render", "--stack", stack, "--out", str(out), *library])
    if preview.exit_code == 1:
        for r in (preview, render):
            assert r.exit_code == 1 and REFUSED in r.output, r.output
            assert "Traceback" not in r.output, r.output
        return
    assert preview.exit_code == 0 and "$/hour" in preview.stdout, preview.output
    assert render.exit_code == 0, render.output
    procs = [p for f in sorted(out.glob("*.yaml")) for p in processes(f)]
    assert procs, f"{stack}: no vllm serve process rendered"
    _assert_all_pass(procs, models)
