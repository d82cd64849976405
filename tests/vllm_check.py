"""Run vLLM's own start-up validation on rendered `vllm serve` command lines (no GPU, no network).

Runs inside `.vllm-venv` (scripts/vllm_env: the pinned wheel, its config-time dependencies and
a CPU torch), never in the project's venv: `python tests/vllm_check.py < nodes.json`. Each input
item is one process: {"id", "argv" (after `vllm serve`), "partition" (VLLM_PP_LAYER_PARTITION)}.
For each it does what `vllm serve` does before it touches a GPU:

1. `make_arg_parser(FlexibleArgumentParser())` parses the argv (vllm/entrypoints/common/cli_args.py);
2. `validate_parsed_serve_args(args)` (same file);
3. `AsyncEngineArgs.from_cli_args(args).create_engine_config(headless=args.headless)`
   (vllm/engine/arg_utils.py): the model's config.json, max-model-len against the model's
   limit, batch limits, parallel sizes and --nnodes/--node-rank, the KV-transfer config;
4. `get_pp_indices(layers, stage, pp)` for every stage under the rendered partition
   (vllm/distributed/utils.py), as each worker does when it builds its layers.

It prints one JSON object per process: {"id", "ok", "error"} and, when ok, the engine settings
the tests compare across the nodes of an instance ("settings") and the layer ranges ("stages").
Set VLLM_TARGET_DEVICE=cpu and HF_HUB_OFFLINE=1 in its environment.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def _settings(config) -> dict:
    """The resolved engine settings every node of one instance must agree on."""
    model, sched, par = config.model_config, config.scheduler_config, config.parallel_config
    kv = config.kv_transfer_config
    return {
        "dtype": str(model.dtype),
        "max_model_len": model.max_model_len,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "tensor_parallel_size": par.tensor_parallel_size,
        "pipeline_parallel_size": par.pipeline_parallel_size,
        "nnodes": par.nnodes,
        "distributed_timeout_seconds": par.distributed_timeout_seconds,
        "kv_connector": kv.kv_connector if kv else None,
        "kv_role": kv.kv_role if kv else None,
        "layers": model.hf_config.num_hidden_layers,
    }


def _check(item: dict, parser, engine_args_cls, validate, get_pp_indices) -> dict:
    os.environ["VLLM_PP_LAYER_PARTITION"] = item["partition"]
    args = parser.parse_args(item["argv"])
    validate(args)
    if args.model_tag is not None:  # what `vllm serve MODEL` does (vllm/entrypoints/cli/serve.py)
        args.model = args.model_tag
    config = engine_args_cls.from_cli_args(args).create_engine_config(headless=args.headless)
    settings = _settings(config)
    pp, layers = settings["pipeline_parallel_size"], settings["layers"]
    stages = [list(get_pp_indices(layers, rank, pp)) for rank in range(pp)]
    return {"settings": settings, "stages": stages}


def main() -> int:
    items = json.load(sys.stdin)
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        from vllm.distributed.utils import get_pp_indices
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser())
        parser.exit_on_error = False
    out = []
    for item in items:
        try:
            with contextlib.redirect_stdout(quiet):
                result = _check(
                    item, parser, AsyncEngineArgs, validate_parsed_serve_args, get_pp_indices
                )
            out.append({"id": item["id"], "ok": True, "error": "", **result})
        except (Exception, SystemExit) as e:  # noqa: BLE001 - report vLLM's own message
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            out.append({"id": item["id"], "ok": False, "error": last})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
