"""Run Vidur (the reference simulator, PyPI `vidur` 0.0.26) offline on exactly the given requests.

A standalone program for `.vidur-venv` (built by `scripts/vidur_env`); it imports only the
standard library, Vidur and Vidur's own dependencies, never this project:

    .vidur-venv/bin/python solver/evaluation/vidur_runner.py simulate --requests REQ.csv \\
        --profiles solver/data/calibration/vidur-sim --pp 1 --tp 2 --scheduler sarathi \\
        --chunk-size 512 --batch-cap 128 --out OUT.json
    .vidur-venv/bin/python solver/evaluation/vidur_runner.py predict \\
        --profiles solver/data/calibration/vidur-sim --pp 1 --tp 2 --out OUT.json

What is run: Llama-2-70B (`meta-llama/Llama-2-70b-hf`) on A100-80GB (`a100`, network
`a100_dgx`), one replica of TP 2 x PP 1 or 2, Vidur's random-forest execution-time predictor,
Vidur's `sarathi` or `vllm` replica scheduler. Every other setting is Vidur's default except:

* profiling inputs: the predictor trains on the four files in `--profiles` (`mlp.csv`,
  `attention.csv`, `network-a100-dgx/all_reduce.csv`, `network-a100-dgx/send_recv.csv`) instead
  of downloading a profiling data set, and its look-up of ready-made predictions on the model hub
  fails at once (`HF_HUB_OFFLINE=1` as well; `WANDB_MODE=disabled`). The data set names it hashes
  into its cache keys are `local/<sha256 of the files>`, so editing a profile retrains.
* `prediction_max_tokens_per_request` = 16384 (Vidur: 2,097,152). It only sets how far Vidur
  tabulates its trained models before simulating (token counts 1..N, KV sizes 0..N in steps of
  256); values inside the table are unchanged. Vidur's own 2M-row tables take far longer to
  build and load than a run here; 16384 covers every batch of requests up to the 4096-token
  limit with any chunk up to 16384 - batch cap.
* output only: no metrics files, plots or Chrome trace (`write_metrics`, `store_plots`,
  `enable_chrome_trace` off); they never feed back into the simulation.
* `Request.restart` (preemption by recomputation when the KV cache runs out) is patched: as
  shipped it aborts the first run that preempts (see `_patch_restart`). How many restarts a run
  had is in the output's `restarts`.
* `--batch-cap` sets `batch_size_cap`, `--chunk-size` the sarathi `chunk_size`,
  `--max-tokens-in-batch` the vllm scheduler's prefill token budget (`max_tokens_in_batch`),
  `--max-tokens` the request generator's `max_tokens` (all default to Vidur's: 128, 512, 4096,
  4096). The vllm scheduler has no chunk: it ignores `--chunk-size`.

Trained predictor models and their tables go to `--cache` (default `.vidur-cache/` at the
repository root); a second run with the same profiles, TP and settings reads them back.

Requests: the CSV (`arrival_s,prompt_tokens,output_tokens`, one row per request) becomes a trace
file for Vidur's own trace-replay request generator with every scale factor 1, and the requests
it builds are checked against the CSV (same order, arrivals and lengths). Vidur counts the
first output token as produced by the prefill, so `output_tokens` is Vidur's
`num_decode_tokens`; a request with `prompt_tokens + output_tokens > max_tokens` is refused
(Vidur would silently shorten its prompt).

Mapping of Vidur's per-request state to our output (times in seconds of simulated time):

* `ttft_s` = `prefill_completed_at - arrived_at`: the end of the batch (on the last pipeline
  stage) that processed the prompt's last token, which also yields the first output token. This
  is Vidur's `prefill_e2e_time` metric; it includes queueing, scheduling delay and, under
  chunked prefill, every earlier chunk. A preempted request (Vidur restarts it, recomputing)
  keeps its first prefill completion time.
* `tpot_s` = `(completed_at - prefill_completed_at) / (output_tokens - 1)`: the mean time per
  output token after the first (0.0 for one-token outputs, which have no decode step, as our
  engine reports them; None only for a request that never finished). Vidur's own
  `decode_time_execution_plus_preemption_normalized` divides the same span by
  `num_decode_tokens` (which counts the first token), i.e. ours = Vidur's x N / (N - 1).
* `completed_s` = `completed_at`: when the last output token was produced.
* extra: `scheduled_s` (first time the request entered a batch), `num_restarts`.

`kv_capacity_tokens` is what Vidur's replica scheduler holds: `num_blocks x block_size`, where
Vidur sets `num_blocks` from its memory planner (80 x 2^30 bytes x (1 - memory_margin_fraction),
minus the fp16 weights of one stage's layers on one GPU, divided by the KV bytes per token of
those layers) rounded down to whole requests of `max_tokens` tokens. The planner's unrounded
figure is `kv_tokens_memory_planner` in `config`.

`predict` writes Vidur's execution-time predictor for single batches, as the simulator uses it:
`stage_ms` is the time of one batch on pipeline stage 0 (stage time = layers per stage x block
time + send/recv to the next stage when there is one; Vidur's simulator takes
`ExecutionTime.total_time`), `last_stage_ms` the same on the last stage. Rows: prefill of one
request of N tokens (no earlier context) and decode of B requests whose KV length (tokens
attended, the new one included, Vidur's `num_kv_tokens`) is C. Vidur looks attention up at
KV sizes rounded up to 256 (a decode batch at the mean of its requests' sizes) and a prefill
of N tokens at KV size N, both as built here. Components are per stage (ms,
layers x per-layer time): `mlp` (up, down projections and activation), `attention_proj` (QKV and
output projections), `attention_rope`, `attention_kernel` (prefill or decode attention),
`all_reduce` (two per layer, each the predicted NCCL time + 0.02 ms launch overhead), `norm`,
`add`, `send_recv` (stage 0 of PP 2 only), `cpu_overhead` (0: this Vidur release models no CPU
scheduling, sampling or input-preparation time) and, not counted by Vidur, `kv_cache_save`.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VIDUR_VERSION = "0.0.26"
MODEL = "meta-llama/Llama-2-70b-hf"
DEVICE = "a100"
NETWORK = "a100_dgx"
PREDICTION_MAX_TOKENS = 16384
COMPUTE_FILES = ("mlp.csv", "attention.csv")
NETWORK_FILES = ("network-a100-dgx/all_reduce.csv", "network-a100-dgx/send_recv.csv")
PREFILL_TOKENS = (512, 1024, 2048, 3072, 4096)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_CONTEXTS = (512, 1024, 2048, 4096)


class RunnerError(Exception):
    """A problem with the inputs, reported without a traceback."""


# --- offline set-up --------------------------------------------------------------------------


def _offline() -> None:
    """No network: these must be set before huggingface_hub is imported."""
    os.environ["WANDB_MODE"] = "disabled"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


def _stand_in(name: str, attrs: dict[str, Any]) -> None:
    """A module Vidur imports but never calls on our path (installing it is not worth it)."""
    try:
        __import__(name)
        return
    except ImportError:
        pass
    module = types.ModuleType(name)
    module.__dict__.update(attrs)

    def missing(attr: str) -> Any:
        raise RuntimeError(f"vidur_runner: {name}.{attr} is not installed in .vidur-venv")

    setattr(module, "__getattr__", missing)  # noqa: B010  (module-level __getattr__, PEP 562)
    sys.modules[name] = module


def _no_hub(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("model hub disabled by vidur_runner (offline); using local profiles")


def _file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


RESTARTS = {"after_prefill": 0, "during_prefill": 0}


def _patch_restart() -> None:
    """Fix two faults of `Request.restart` in vidur 0.0.26 (a preempted request is restarted and
    recomputed when the KV cache runs out), which otherwise abort any run that preempts:

    * it leaves the per-stage progress (`_num_stage_processed_tokens`,
      `_is_prefill_stage_complete`) of the first attempt in place, so the next prefill trips
      `assert self._num_stage_processed_tokens <= self.total_tokens`; reset here like the rest;
    * it makes the tokens processed so far the new prompt, right once the prefill is complete
      (prompt + tokens decoded so far are recomputed as one prefill) but wrong for a request
      caught between chunks (sarathi): its prompt would shrink to the chunks done (0 if none).
      Such a request keeps its prompt and output lengths here.
    """
    # Deferred: vidur is installed only in .vidur-venv, where this runs.
    from vidur.entities import Request

    def restart(self: Any) -> None:
        if self._is_prefill_complete:
            RESTARTS["after_prefill"] += 1
            total = self._num_prefill_tokens + self._num_decode_tokens
            self._num_prefill_tokens = self._num_processed_tokens
            self._num_decode_tokens = total - self._num_prefill_tokens
        else:
            RESTARTS["during_prefill"] += 1
        self._num_processed_tokens = 0
        self._num_stage_processed_tokens = 0
        self._num_processed_iterations = 0
        self._scheduled = False
        self._preempted = False
        self._completed = False
        self._is_prefill_complete = False
        self._is_prefill_stage_complete = False
        self._num_restarts += 1

    Request.restart = restart


def _load_vidur(profiles: Path, verbose: bool) -> types.SimpleNamespace:
    """Import Vidur with wandb and plotly_express stood in for, its logs on stderr, and its
    predictor reading `profiles` instead of the model hub."""
    _offline()
    # Only touched by Vidur's plots and wandb logging, both off here: `wandb.run` is read
    # (None: no run), everything else raises if ever reached.
    _stand_in("wandb", {"run": None})
    _stand_in("plotly_express", {})

    import vidur.logger  # noqa: F401  (sets up the "vidur" logger)

    log = logging.getLogger("vidur")
    for handler in log.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
            handler.flush = sys.stderr.flush  # type: ignore[method-assign]
            handler.setLevel(logging.INFO if verbose else logging.WARNING)

    # Deferred: vidur is installed only in .vidur-venv, where this runs.
    from vidur.execution_time_predictor import sklearn_execution_time_predictor as skl

    paths = [profiles / f for f in COMPUTE_FILES + NETWORK_FILES]
    for p in paths:
        if not p.is_file():
            raise RunnerError(f"profile file missing: {p}")

    def input_files(_self: Any) -> tuple[str, str, str, str]:
        return tuple(str(p) for p in paths)  # type: ignore[return-value]

    def no_hub_predictions(_self: Any) -> Any:
        _no_hub()

    skl.SklearnExecutionTimePredictor._get_input_files = input_files
    skl.SklearnExecutionTimePredictor._load_predictions_from_hf = no_hub_predictions
    skl.snapshot_download = _no_hub  # belt and braces: no code path may reach the hub
    # The predictor logs the refused look-up as an error on every run; it is expected here.
    logging.getLogger(skl.__name__).addFilter(
        lambda r: "Failed to load predictions from HF" not in r.getMessage()
    )

    _patch_restart()

    # Deferred: vidur is installed only in .vidur-venv, where this runs.
    import vidur.config as cfg

    return types.SimpleNamespace(
        cfg=cfg,
        compute_id=f"local/{_file_digest(paths[:2])}",
        network_id=f"local/{_file_digest(paths[2:])}",
    )


# --- configuration ---------------------------------------------------------------------------


def _predictor_config(v: types.SimpleNamespace, cache: Path) -> Any:
    return v.cfg.RandomForrestExecutionTimePredictorConfig(
        model_profiling_dataset=v.compute_id,
        network_profiling_dataset=v.network_id,
        prediction_max_tokens_per_request=PREDICTION_MAX_TOKENS,
        cache_dir=str(cache),
    )


def _replica_config(v: types.SimpleNamespace, pp: int, tp: int) -> Any:
    return v.cfg.ReplicaConfig(
        model_name=MODEL,
        num_pipeline_stages=pp,
        tensor_parallel_size=tp,
        device=DEVICE,
        network_device=NETWORK,
    )


def _summary(sim_config: Any, kv_capacity: int | None, planner_tokens: int) -> dict[str, Any]:
    cluster = sim_config.cluster_config
    rep, cache, sched = (
        cluster.replica_config,
        cluster.cache_config,
        cluster.replica_scheduler_config,
    )
    pred = sim_config.execution_time_predictor_config
    return {
        "model": rep.model_name,
        "device": rep.device,
        "network_device": rep.network_device,
        "num_replicas": cluster.num_replicas,
        "tensor_parallel_size": rep.tensor_parallel_size,
        "num_pipeline_stages": rep.num_pipeline_stages,
        "replica_scheduler": str(sched.get_type()),
        "batch_size_cap": sched.batch_size_cap,
        "chunk_size": getattr(sched, "chunk_size", None),
        "max_tokens_in_batch": getattr(sched, "max_tokens_in_batch", None),
        "request_max_tokens": sim_config.request_generator_config.max_tokens,
        "device_memory_gb": rep.device_config.total_memory_gb,
        "memory_margin_fraction": cache.memory_margin_fraction,
        "gpu_memory_utilization_unused_by_vidur": rep.gpu_memory_utilization,
        "block_size": cache.block_size,
        "num_blocks": None if cache.num_blocks is None else int(cache.num_blocks),
        "watermark_blocks_fraction": cache.watermark_blocks_fraction,
        "kv_capacity_tokens": kv_capacity,
        "kv_tokens_memory_planner": planner_tokens,
        "max_model_len": rep.model_config.max_model_len,
        "execution_time_predictor": str(pred.get_type()),
        "prediction_max_tokens_per_request": pred.prediction_max_tokens_per_request,
        "kv_cache_prediction_granularity": pred.kv_cache_prediction_granularity,
        "attention_decode_batching_overhead_fraction": pred.attention_decode_batching_overhead_fraction,
        "nccl_cpu_launch_overhead_ms": pred.nccl_cpu_launch_overhead_ms,
        "cpu_overhead_modelled": False,
        "profiling_datasets": [pred.model_profiling_dataset, pred.network_profiling_dataset],
        "cache_dir": pred.cache_dir,
        "seed": sim_config.seed,
    }


def _jsonable(obj: Any) -> Any:
    """Vidur's dataclass_to_dict output, made JSON-safe (enums and objects as strings)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        if isinstance(obj, float) and not math.isfinite(obj):
            return str(obj)
        return obj
    return str(obj)


# --- simulate --------------------------------------------------------------------------------


def _read_requests(path: Path) -> list[tuple[float, int, int]]:
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise RunnerError(f"cannot read {path}: {exc.strerror}") from exc
    out = []
    for i, row in enumerate(rows, start=2):
        try:
            a, p, o = float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RunnerError(
                f"{path}:{i}: need columns arrival_s,prompt_tokens,output_tokens ({exc})"
            ) from exc
        if not (math.isfinite(a) and a >= 0 and p >= 1 and o >= 1):
            raise RunnerError(
                f"{path}:{i}: need arrival_s >= 0, prompt_tokens >= 1, output_tokens >= 1"
            )
        out.append((a, p, o))
    if not out:
        raise RunnerError(f"{path}: no requests")
    return out


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    requests = _read_requests(args.requests)
    too_long = [i for i, (_, p, o) in enumerate(requests) if p + o > args.max_tokens]
    if too_long:
        raise RunnerError(
            f"{len(too_long)} requests exceed --max-tokens {args.max_tokens} (prompt + output), "
            f"first at row {too_long[0] + 2}; Vidur would shorten their prompts"
        )
    if args.scheduler == "sarathi" and args.chunk_size + args.batch_cap > PREDICTION_MAX_TOKENS:
        raise RunnerError(f"--chunk-size + --batch-cap must be <= {PREDICTION_MAX_TOKENS}")

    v = _load_vidur(args.profiles, args.verbose)
    cfg = v.cfg
    # Deferred: vidur is installed only in .vidur-venv, where this runs.
    from vidur.entities import Request
    from vidur.events import RequestArrivalEvent
    from vidur.simulator import Simulator
    from vidur.utils.memory_planner import MemoryPlanner
    from vidur.utils.random import set_seeds

    workdir = Path(tempfile.mkdtemp(prefix="vidur-run-"))
    try:
        trace = workdir / "trace.csv"
        with trace.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
            for a, p, o in requests:
                w.writerow(["1970-01-01", repr(a), p, o])

        if args.scheduler == "sarathi":
            sched = cfg.SarathiSchedulerConfig(
                batch_size_cap=args.batch_cap, chunk_size=args.chunk_size
            )
        else:
            sched = cfg.VllmSchedulerConfig(
                batch_size_cap=args.batch_cap, max_tokens_in_batch=args.max_tokens_in_batch
            )
        sim_config = cfg.SimulationConfig(
            seed=args.seed,
            log_level="info" if args.verbose else "warning",
            cluster_config=cfg.ClusterConfig(
                num_replicas=1,
                replica_config=_replica_config(v, args.pp, args.tp),
                replica_scheduler_config=sched,
            ),
            request_generator_config=cfg.TraceRequestGeneratorConfig(
                trace_file=str(trace),
                date="1970-01-01",
                prefill_scale_factor=1,
                decode_scale_factor=1,
                time_scale_factor=1,
                max_tokens=args.max_tokens,
            ),
            execution_time_predictor_config=_predictor_config(v, args.cache),
            metrics_config=cfg.MetricsConfig(
                write_metrics=False,
                store_plots=False,
                enable_chrome_trace=False,
                output_dir=str(workdir / "vidur-output"),
            ),
        )
        set_seeds(sim_config.seed)  # as vidur.main does

        replayed: list[Request] = []

        class Replay(Simulator):  # type: ignore[misc]
            """Vidur's simulator, keeping the requests it builds so we can read them back."""

            def _init_event_queue(self) -> None:
                replayed.extend(self._request_generator.generate())
                for request in replayed:
                    self._add_event(RequestArrivalEvent(request.arrived_at, request))

        started = time.perf_counter()
        sim = Replay(sim_config)
        setup_s = time.perf_counter() - started
        for req, (a, p, o) in zip(replayed, requests, strict=True):
            moved = abs(req.arrived_at - a) > 1e-9 * max(1.0, a)  # CSV float parsing only
            if moved or req.num_prefill_tokens != p or req.num_decode_tokens != o:
                raise RunnerError(
                    f"Vidur's trace replay changed a request: {(a, p, o)} became "
                    f"{(req.arrived_at, req.num_prefill_tokens, req.num_decode_tokens)}"
                )
        replica = next(iter(sim.scheduler._replica_schedulers.values()))
        cache = sim_config.cluster_config.cache_config
        kv_capacity = int(cache.num_blocks * cache.block_size)
        planner = MemoryPlanner(sim_config.cluster_config.replica_config, cache)
        planner_tokens = int(planner.get_max_kv_cache_size_in_tokens())
        started = time.perf_counter()
        sim.run()
        run_s = time.perf_counter() - started
        assert replica.is_empty()

        rows = []
        for req, (a, p, o) in zip(replayed, requests, strict=True):
            first = req._prefill_completed_at if req._prefill_completed_at else None
            done = req._completed_at if req.completed else None
            rows.append(
                {
                    "arrival_s": a,
                    "prompt_tokens": p,
                    "output_tokens": o,
                    "ttft_s": None if first is None else first - a,
                    "tpot_s": (
                        None
                        if first is None or done is None
                        else (done - first) / (o - 1)
                        if o > 1
                        else 0.0
                    ),
                    "completed_s": done,
                    "scheduled_s": req._scheduled_at if req.scheduled or req.completed else None,
                    "num_restarts": req.num_restarts,
                }
            )
        # Deferred: vidur is installed only in .vidur-venv, where this runs.
        from vidur.config.utils import dataclass_to_dict

        summary = _summary(sim_config, kv_capacity, planner_tokens)
        summary["vidur"] = _jsonable(dataclass_to_dict(sim_config))
        return {
            "requests": rows,
            "kv_capacity_tokens": kv_capacity,
            "config": summary,
            "restarts": dict(RESTARTS),
            "timing_s": {"setup_incl_predictor": round(setup_s, 3), "simulate": round(run_s, 3)},
            "vidur_version": VIDUR_VERSION,
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --- predict ---------------------------------------------------------------------------------


def predict(args: argparse.Namespace) -> dict[str, Any]:
    v = _load_vidur(args.profiles, args.verbose)
    cfg = v.cfg
    # Deferred: vidur is installed only in .vidur-venv, where this runs.
    from vidur.entities import Batch
    from vidur.execution_time_predictor import ExecutionTimePredictorRegistry
    from vidur.types import ReplicaId
    from vidur.utils.memory_planner import MemoryPlanner

    replica_config = _replica_config(v, args.pp, args.tp)
    cache_config = cfg.CacheConfig()
    pred_config = _predictor_config(v, args.cache)
    started = time.perf_counter()
    predictor = ExecutionTimePredictorRegistry.get(
        pred_config.get_type(),
        predictor_config=pred_config,
        replica_config=replica_config,
        cache_config=cache_config,
    )
    setup_s = time.perf_counter() - started
    replica = ReplicaId(1)

    def stage(
        q: list[int], kv: list[int], stage_id: int
    ) -> tuple[float, dict[str, float], dict[str, float]]:
        batch = Batch(replica, [None] * len(q), q, kv)
        t = predictor.get_execution_time(batch, stage_id)
        n = t.num_layers
        per_layer = {
            "mlp_up_proj": t.mlp_layer_up_proj_execution_time,
            "mlp_down_proj": t.mlp_layer_down_proj_execution_time,
            "mlp_act": t.mlp_layer_act_execution_time,
            "attn_pre_proj": t.attention_layer_pre_proj_execution_time,
            "attn_post_proj": t.attention_layer_post_proj_execution_time,
            "attn_rope": t.attention_rope_execution_time,
            "attn_prefill": t.attention_prefill_execution_time,
            "attn_decode": t.attention_decode_execution_time,
            "all_reduce_each": t.tensor_parallel_communication_time,
            "input_layernorm": t.attn_norm_time,
            "post_attention_layernorm": t.mlp_norm_time,
            "add": t.add_time,
            "attn_kv_cache_save": t.attention_kv_cache_save_execution_time,
        }
        p = per_layer
        components = {
            "mlp": n * (p["mlp_up_proj"] + p["mlp_down_proj"] + p["mlp_act"]),
            "attention_proj": n * (p["attn_pre_proj"] + p["attn_post_proj"]),
            "attention_rope": n * p["attn_rope"],
            "attention_kernel": n * (p["attn_prefill"] + p["attn_decode"]),
            "all_reduce": n * 2 * p["all_reduce_each"],
            "norm": n * (p["input_layernorm"] + p["post_attention_layernorm"]),
            "add": n * p["add"],
            "send_recv": t.pipeline_parallel_communication_time,
            "cpu_overhead": 0.0,
        }
        total = t.total_time * 1e3
        counted = sum(components.values())
        assert abs(counted - total) <= 1e-6 * max(1.0, total), (counted, total)
        components["kv_cache_save_not_counted"] = n * p["attn_kv_cache_save"]
        return total, components, per_layer

    rows = []
    cases = [("prefill", n, 0, [n], [n]) for n in PREFILL_TOKENS]
    cases += [("decode", b, c, [1] * b, [c] * b) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    last = args.pp - 1
    for phase, size, context, q, kv in cases:
        total, components, per_layer = stage(q, kv, 0)
        last_total = stage(q, kv, last)[0] if last else total
        row: dict[str, Any] = {"phase": phase}
        row["tokens" if phase == "prefill" else "batch"] = size
        row |= {
            "context": context,
            "stage_ms": round(total, 6),
            "last_stage_ms": round(last_total, 6),
            "layers_per_stage": replica_config.num_layers_per_pipeline_stage,
            "components": {k: round(x, 6) for k, x in components.items()},
            "per_layer_ms": {k: round(x, 6) for k, x in per_layer.items()},
        }
        rows.append(row)
    planner_tokens = int(
        MemoryPlanner(replica_config, cache_config).get_max_kv_cache_size_in_tokens()
    )
    slots = planner_tokens // args.max_tokens
    kv_capacity = slots * (args.max_tokens // cache_config.block_size) * cache_config.block_size
    return {
        "rows": rows,
        "kv_capacity_tokens": kv_capacity,
        "config": {
            "model": MODEL,
            "device": DEVICE,
            "network_device": NETWORK,
            "tensor_parallel_size": args.tp,
            "num_pipeline_stages": args.pp,
            "num_layers_per_pipeline_stage": replica_config.num_layers_per_pipeline_stage,
            "device_memory_gb": replica_config.device_config.total_memory_gb,
            "memory_margin_fraction": cache_config.memory_margin_fraction,
            "block_size": cache_config.block_size,
            "request_max_tokens": args.max_tokens,
            "kv_tokens_memory_planner": planner_tokens,
            "cpu_overhead_modelled": False,
            "units": "ms; stage_ms and components per pipeline stage, per_layer_ms per layer",
            "predictor": _jsonable(predictor.to_dict()),
            "predictor_config": _jsonable(pred_config.__dict__),
        },
        "timing_s": {"predictor_setup": round(setup_s, 3)},
        "vidur_version": VIDUR_VERSION,
    }


# --- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--profiles", type=Path, required=True, help="Vidur's profiling folder.")
        p.add_argument("--pp", type=int, choices=(1, 2), required=True)
        p.add_argument("--tp", type=int, choices=(2,), required=True)
        p.add_argument("--cache", type=Path, default=ROOT / ".vidur-cache",
                       help="Where Vidur keeps trained predictor models (default .vidur-cache/).")  # fmt: skip
        p.add_argument("--max-tokens", type=int, default=4096,
                       help="Vidur's request max_tokens (KV slots and the length limit).")  # fmt: skip
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--verbose", action="store_true", help="Vidur's INFO logs on stderr.")

    s = sub.add_parser("simulate", help="Vidur's simulator on the given requests.")
    common(s)
    s.add_argument("--requests", type=Path, required=True)
    s.add_argument("--scheduler", choices=("sarathi", "vllm"), required=True)
    s.add_argument("--chunk-size", type=int, default=512, help="sarathi chunk_size.")
    s.add_argument("--batch-cap", type=int, default=128, help="batch_size_cap.")
    s.add_argument("--max-tokens-in-batch", type=int, default=4096,
                   help="vllm scheduler's prefill token budget.")  # fmt: skip
    s.add_argument("--seed", type=int, default=42)
    p = sub.add_parser("predict", help="Vidur's per-stage batch times.")
    common(p)
    args = parser.parse_args(argv)
    args.cache = args.cache.resolve()
    args.profiles = args.profiles.resolve()
    try:
        result = simulate(args) if args.command == "simulate" else predict(args)
    except RunnerError as exc:
        print(f"vidur_runner: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
