"""A stand-in prefill or decode server whose API-key check is vLLM 0.33.0's own (no GPU).

Runs inside `.vllm-venv` (scripts/vllm_env): `python tests/vllm_pd_worker.py PORT LOG ARGV_JSON`.
ARGV_JSON is the rendered `vllm serve` argument list of the node's process; it is parsed with
vLLM's own parser, and the app gets vLLM's own middleware from those arguments and the
environment (`init_entrypoints_middleware`: `--api-key`, else `VLLM_API_KEY`), exactly as
`vllm serve` registers it. Behind it, /health, /metrics, /v1/models, /v1/completions and
/v1/chat/completions answer like vLLM's server in a P/D pair (a prefill returns
`kv_transfer_params`). Every request that passes the middleware is logged to LOG as one JSON
line: method, path and the Authorization header it carried. Set VLLM_TARGET_DEVICE=cpu and
HF_HUB_OFFLINE=1 in its environment, as for tests/vllm_check.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
from vllm.utils.argparse_utils import FlexibleArgumentParser


def build(argv: list[str], log: str) -> FastAPI:
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    app = FastAPI()
    init_entrypoints_middleware(args, app, ())
    model = args.served_model_name[0] if args.served_model_name else args.model_tag

    def record(request: Request) -> None:
        entry = {
            "method": request.method,
            "path": request.url.path,
            "auth": request.headers.get("authorization"),
        }
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    @app.get("/health")
    async def health(request: Request) -> PlainTextResponse:
        record(request)
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        record(request)
        return PlainTextResponse("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        record(request)
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    async def answer(request: Request, kind: str) -> dict[str, Any]:
        record(request)
        body = await request.json()
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": "hi"}
        else:
            choice["text"] = "hi"
        out: dict[str, Any] = {
            "id": "cmpl-1",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "model": body.get("model", model),
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):  # the router's prefill call: hand the KV over
            out["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "prefill-0",
                "remote_block_ids": [1],
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
            }
        return out

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        return await answer(request, "text")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        return await answer(request, "chat")

    return app


def main() -> None:
    port, log, argv = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    uvicorn.run(build(argv, log), host="127.0.0.1", port=port, log_level="error")


if __name__ == "__main__":
    main()
