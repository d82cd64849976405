"""The GPU profiler on the CPU: tiny layers end to end, tables the solver reads, clear errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from coral_iac.cli.app import app
from solver.catalog.model_cards import load_model_cards
from solver.errors import InputError
from solver.performance.default_model import MEASURED_DIR_ENV, load_perf_model
from solver.performance.measured_tables import load_measured_dir
from solver.performance.profiler import suite
from solver.performance.profiler.cards import tiny_card
from solver.performance.profiler.command import measure
from solver.performance.profiler.device import gpu_id_for
from solver.performance.profiler.measure import MeasureSpec, run_grid
from solver.performance.profiler.record import MeasurementRecord
from solver.performance.profiler.vllm_engine import decode_step_ms, engine_kwargs, per_layer_ms

runner = CliRunner()


@pytest.fixture
def one_thread():
    """One intra-op thread: with spinning OpenMP threads a busy 2-core box times in 4 ms steps."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def measure_cli(tmp_path, *args):
    return runner.invoke(
        app,
        ["profile", "measure", "--tiny", "--out", str(tmp_path), "--repeats", "3", "--warmup", "1"]
        + list(args),
    )


@pytest.mark.parametrize(
    ("model", "phase", "sizes"),
    [
        ("llama3.1-70b", "decode", ["--batches", "1,4,16", "--context", "32"]),
        ("qwen3-235b-a22b", "prefill", ["--tokens", "16,64,128", "--context", "64"]),
        ("gpt-oss-20b", "decode", ["--batches", "1,8", "--context", "64"]),
    ],
    ids=["dense-decode", "moe-prefill", "sliding-window-moe-decode"],
)
def test_tiny_layer_end_to_end_parses_back(tmp_path, one_thread, model, phase, sizes):
    r = measure_cli(tmp_path, "--model", model, "--phase", phase, *sizes)
    assert r.exit_code == 0, r.output
    table = load_measured_dir(tmp_path).get(model, "cpux1", phase)
    want = [float(s) for s in sizes[1].split(",")]
    assert table is not None and list(table.x) == want and all(ms > 0 for ms in table.ms)
    record = MeasurementRecord.model_validate_json(
        (tmp_path / f"{model}__cpux1__{phase}.json").read_text()
    )
    assert record.torch_version == torch.__version__ and record.dtype == "float32"
    assert record.device == "cpu" and record.tp == 1 and "tiny" in record.method
    assert [p.ms_per_layer for p in record.points] == pytest.approx(list(table.ms), rel=1e-5)
    assert record.command.startswith(f"coral profile measure --model {model} --phase {phase}")


@pytest.mark.parametrize(
    ("phase", "small", "large", "context"),
    [("decode", 1, 512, 64), ("prefill", 16, 4096, 256)],
    ids=["decode-batch", "prefill-tokens"],
)
def test_timings_grow_with_batch_and_tokens(one_thread, phase, small, large, context):
    card = tiny_card(load_model_cards()["llama2-70b"])
    spec = MeasureSpec("llama2-70b", phase, (small, large), context, warmup=1, repeats=7)
    ms = {p.x: p.ms_per_layer for p in measure(card, spec).points}
    assert ms[large] > 2 * ms[small]


def test_measured_tables_drive_the_profile_table_via_env(tmp_path, one_thread, monkeypatch):
    """Item 4 end to end: a table measured as l4x1 wins over the analytical model for l4x1 only,
    in `coral profile table` and in every load_perf_model() caller via $CORAL_MEASURED_DIR."""
    r = measure_cli(
        tmp_path, "--model", "phi-4", "--phase", "decode", "--batches", "1,64", "--node", "l4x1"
    )
    assert r.exit_code == 0, r.output
    monkeypatch.setenv(MEASURED_DIR_ENV, str(tmp_path))
    perf = load_perf_model()
    assert perf.layer_time("phi-4", "l4x1", "decode", 8, 1024).source == "measured"
    assert perf.layer_time("phi-4", "l4x2", "decode", 8, 1024).source == "analytical"
    args = ["profile", "table", "--model", "phi-4", "--phase", "decode", "--budget-ms", "500"]
    table = runner.invoke(app, [*args, "--node", "l4x1", "--node", "l4x2", "--json"])
    sources = {e["node"]: e["source"] for e in json.loads(table.stdout)}
    assert sources == {"l4x1": "measured", "l4x2": "analytical"}


def test_without_torch_the_command_says_to_install_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    r = measure_cli(tmp_path, "--model", "phi-4", "--phase", "decode")
    assert r.exit_code == 1
    assert "pip install 'coral-iac[profile]'" in r.output and "torch" in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--phase", "prefill", "--tokens", "64,100", "--context", "64"], "--tokens: \\[100\\]"),
        (["--phase", "decode", "--batches", "8"], "at least 2 sizes"),
        (["--phase", "decode", "--batches", "1,x"], "--batches: not a comma-separated"),
        (["--phase", "decode", "--tp", "3"], "--tp: TP 3 must divide"),
        (["--phase", "decode", "--engine", "vllm"], "vLLM is not installed"),
        (["--phase", "decode", "--engine", "tensorrt"], "unknown engine"),
        (["--phase", "decode", "--node", "h100"], "malformed node id"),
    ],
    ids=["prefill-not-whole-prompts", "one-size", "not-a-number", "tp-not-dividing",
         "no-vllm", "unknown-engine", "bad-node"],
)  # fmt: skip
def test_bad_input_names_the_option(tmp_path, args, message):
    r = measure_cli(tmp_path, "--model", "phi-4", *args)
    assert r.exit_code == 1
    assert re.search(message, r.output), r.output


@pytest.mark.parametrize(
    ("name", "gpu"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("Tesla T4", "t4"),
        ("cpu", "cpu"),
    ],
)
def test_device_names_map_to_catalog_gpu_ids(name, gpu):
    assert gpu_id_for(name) == gpu


def test_unknown_gpu_asks_for_node():
    with pytest.raises(InputError, match="--node"):
        gpu_id_for("NVIDIA B200")


def test_grid_stops_at_budget_and_out_of_memory():
    def fake(size):
        if size == 64:
            raise torch.OutOfMemoryError("fake")
        return (float(size), float(size), float(size))

    oom = run_grid(fake, [1, 8, 64, 512], None)
    assert [p.x for p in oom.points] == [1, 8] and "out of device memory at 64" in oom.notes[0]
    spent = run_grid(lambda s: (1.0, 1.0, 1.0), [4, 1, 2, 8], budget_s=0)
    assert [p.x for p in spent.points] == [1, 2] and "[4, 8] skipped" in spent.notes[0]


def test_vllm_engine_arguments_load_no_weights():
    spec = MeasureSpec("phi-4", "decode", (1, 64), context=1024, tp=2)
    kw = engine_kwargs("microsoft/phi-4", 6, spec)
    assert kw["load_format"] == "dummy" and kw["hf_overrides"] == {"num_hidden_layers": 6}
    assert kw["skip_tokenizer_init"] and not kw["enable_prefix_caching"]
    assert kw["tensor_parallel_size"] == 2 and kw["max_num_seqs"] == 64
    assert kw["max_model_len"] > 1024 and kw["max_num_batched_tokens"] >= 64 * 1024


def test_vllm_per_layer_time_is_the_difference_over_layers():
    assert per_layer_ms(10.0, 22.0, 2, 6) == pytest.approx(3.0)
    assert decode_step_ms(100.0, 260.0, 16) == pytest.approx(10.0)
    with pytest.raises(InputError, match="not more than"):
        per_layer_ms(10.0, 9.0, 2, 6)
    with pytest.raises(InputError, match="1 <= L1 < L2"):
        per_layer_ms(10.0, 22.0, 6, 2)


def test_suite_smoke_writes_every_phase_and_a_summary(tmp_path, one_thread, capsys):
    assert suite.main(["--smoke", "--out", str(tmp_path), "--model", "gpt-oss-20b"]) == 0
    tables = load_measured_dir(tmp_path)
    assert {key[2] for key in tables.tables} == {"decode", "prefill"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["ok", "ok"] and summary["smoke"]
    assert "[2/2] gpt-oss-20b prefill: ok" in capsys.readouterr().out


def test_suite_past_its_deadline_skips_and_fails(tmp_path):
    assert suite.main(["--smoke", "--out", str(tmp_path), "--deadline-s", "0"]) == 1
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert len(runs) == 16 and {r["status"] for r in runs} == {"skipped"}


def test_profile_gpu_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "scripts/test installs shellcheck (scripts/debian_tools)"
    script = Path(__file__).parents[2] / "scripts" / "profile_gpu"
    r = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
