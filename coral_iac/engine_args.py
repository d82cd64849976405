"""What each vLLM process of a node is started with: the ports Coral's processes bind, the
engine flags every rank of an instance shares, the boot spec of one node (`NodeBoot`), and the
`vllm serve` and vllm-router command lines built from them (`vllm_argv`, `router_argv`).

`coral_iac/bootstrap.py` makes one `NodeBoot` per node of a plan instance and renders its
cloud-init, with the command lines built here. No Jinja2 and no Pulumi: the argv are plain lists,
which the tests also run against the pinned vLLM's own argument parser.
"""

from __future__ import annotations

import json
import math
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from solver.catalog.model_cards import ModelCard
from solver.catalog.offers import Catalog
from solver.catalog.vllm_support import unsupported_gpus
from solver.errors import InputError
from solver.plan_schema import Instance, Plan
from solver.types import FROZEN

MASTER_PORT = 29501
PREFILL_PORT, DECODE_PORT = 8100, 8200  # internal vLLM HTTP ports of a PD pair
NIXL_PORT = 5600
# Push mode on both sides: in 0.33.0 only NixlPushConnector lets a PP > 1 prefill write its layer
# slice into a PP = 1 decode (nixl/base_worker.py, "PP>1 (push mode)"); the pull NixlConnector
# keys remote agents per TP rank and cannot. The transfer mode is part of the NIXL compatibility
# hash (nixl/metadata.py), so prefill and decode must name the same connector.
KV_CONNECTOR = "NixlPushConnector"
# Each node downloads the weights before it starts vLLM, so a head may wait for a worker's whole
# download and load: the distributed timeout covers both at conservative rates, plus a margin.
DOWNLOAD_GB_PER_S = 0.1  # assumed sustained Hugging Face download per node (100 MB/s)
LOAD_GB_PER_S = 0.5  # assumed disk -> GPU load rate
TIMEOUT_MARGIN_S = 600  # torch.distributed's NCCL default (ParallelConfig docstring)


class Ports(BaseModel):
    """The ports Coral's processes bind on a node; all distinct from each other and the API's."""

    model_config = FROZEN
    api: int = Field(ge=1, le=65535, description="Public port: an aggregated head or the router.")
    prefill_http: int = Field(ge=1, le=65535)
    decode_http: int = Field(ge=1, le=65535)
    master: int = Field(ge=1, le=65535, description="torch.distributed master (the head).")
    nixl: int = Field(
        ge=1, le=65535, description="NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT)."
    )


def allocate_ports(api_port: int) -> Ports:
    """Internal ports at their defaults, each moved up past any port already taken, so no two
    processes of a node can collide whatever `deploy.api_port` is."""
    taken = {api_port}
    chosen: dict[str, int] = {}
    defaults = [
        ("prefill_http", PREFILL_PORT),
        ("decode_http", DECODE_PORT),
        ("master", MASTER_PORT),
        ("nixl", NIXL_PORT),
    ]
    for name, port in defaults:
        while port in taken:
            port += 1
        taken.add(port)
        chosen[name] = port
    return Ports(api=api_port, **chosen)


class EngineSettings(BaseModel):
    """Engine flags every node of one instance renders identically (vLLM resolves each node's
    config from its own flags; defaults derived from local GPU memory would differ)."""

    model_config = FROZEN
    max_model_len: int = Field(gt=0)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    dtype: Literal["bfloat16", "float16"]
    attention_backend: str | None = Field(
        default=None, description="Pinned for a P/D pair (the NIXL handshake compares it)."
    )
    gpu_memory_utilization: float = Field(gt=0, le=1)
    distributed_timeout_s: int = Field(gt=0)

    @model_validator(mode="after")
    def _batched_tokens_cover_sequences(self) -> EngineSettings:
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's SchedulerConfig check
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_num_seqs "
                f"({self.max_num_seqs})"
            )
        return self


def engine_precision(bf16: list[bool], sliding_window: bool) -> tuple[str, str]:
    """(dtype, attention backend) for a set of GPUs that must agree: bfloat16 unless one GPU
    lacks it (T4, V100), then float16 for all; FLASH_ATTN where every GPU has bf16 (Ampere or
    newer) and the model has no sliding-window layers, else TRITON_ATTN, which runs on all."""
    every = all(bf16)
    dtype = "bfloat16" if every else "float16"
    return dtype, "FLASH_ATTN" if every and not sliding_window else "TRITON_ATTN"


def instance_engine(
    *,
    card: ModelCard,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    bf16: list[bool],
    pair: bool,
    gpu_memory_utilization: float,
) -> EngineSettings:
    """The engine flags of one instance.

    Args:
        card: the model card (`max_context` caps --max-model-len: vLLM refuses more).
        max_model_len: the stack's `deploy.max_model_len`.
        max_num_seqs: the SLO-feasible decode batch the library assumed.
        max_num_batched_tokens: the SLO-feasible prefill batch (raised to max_num_seqs at
            least: vLLM requires batched tokens >= sequences).
        bf16: per GPU that must agree (the instance's, or all of a P/D model's), bf16 support.
        pair: a prefill/decode instance (pins the attention backend for the NIXL handshake).
        gpu_memory_utilization: the stack's `deploy.gpu_memory_utilization`.

    Returns:
        The settings every node of the instance renders.
    """
    dtype, backend = engine_precision(bf16, card.sliding_window is not None)
    return EngineSettings(
        max_model_len=min(max_model_len, card.max_context),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
        dtype=dtype,
        attention_backend=backend if pair else None,
        gpu_memory_utilization=gpu_memory_utilization,
        distributed_timeout_s=distributed_timeout_s(card.weight_bytes / 1e9),
    )


def precision_group_bf16(plan: Plan, inst: Instance, catalog: Catalog) -> list[bool]:
    """bf16 support of every GPU that must share `inst`'s dtype: its own nodes' GPUs, or for a
    prefill/decode instance every prefill and decode instance of its model in the plan (a
    router may pair any of them).

    Raises:
        InputError: the instance uses a GPU the pinned vLLM build cannot run (V100; `coral
            plan` refuses such a stack first, solver/catalog/vllm_support.py).
    """
    refused = unsupported_gpus(inst.nodes)
    if refused:
        raise InputError(
            f"plan instance {inst.key}",
            "; ".join(f"node config {node}: {why}" for node, why in refused.items()),
            f"remove {', '.join(refused)} from coral:fleet.node_configs and plan again",
        )
    group = (
        [inst]
        if inst.phase == "aggregated"
        else [i for i in plan.instances if i.model == inst.model and i.phase != "aggregated"]
    )
    return [catalog.node(n).gpu.bf16 for i in group for n in i.nodes]


def distributed_timeout_s(weights_gb: float) -> int:
    """--distributed-timeout-seconds: one node's download plus load, plus the NCCL default."""
    return int(
        math.ceil(weights_gb / DOWNLOAD_GB_PER_S + weights_gb / LOAD_GB_PER_S) + TIMEOUT_MARGIN_S
    )


class Process(BaseModel):
    """One vLLM process: its node rank (= pipeline stage) and the GPUs it sees."""

    model_config = FROZEN
    rank: int = Field(ge=0)
    gpus: list[int]


class RouterSpec(BaseModel):
    """vllm-router in front of a disaggregated pair (runs on the decode node)."""

    model_config = FROZEN
    prefill_urls: list[str] = Field(min_length=1)
    decode_urls: list[str] = Field(min_length=1)


class NodeBoot(BaseModel):
    """Everything one node's user-data needs (no secrets: the HF token is fetched at boot)."""

    model_config = FROZEN
    cloud: Literal["aws", "gcp"]
    region: str
    stack: str
    replica_key: str
    node_index: int
    model: str
    hf_repo: str
    phase: Literal["prefill", "decode", "aggregated"]
    nnodes: int = Field(ge=1, description="vLLM nodes (ranks / TP) in this replica.")
    tp: int = Field(ge=1)
    layer_partition: str
    engine: EngineSettings
    processes: list[Process] = Field(min_length=1)
    master_addr: str = Field(description="Head node's private IP ('' on the head itself).")
    ports: Ports
    hf_token_secret: str = Field(description="Secret-manager name of the Hugging Face token.")
    api_key_secret: str | None = Field(
        default=None, description="Secret-manager name of the API key (None: no key)."
    )
    router: RouterSpec | None = None
    market: Literal["on-demand", "spot"] = Field(
        default="on-demand",
        description="spot: the cloud may take the node back, so it runs the interruption "
        "handler (templates/node-interruption.sh.j2).",
    )

    @property
    def is_spot(self) -> bool:
        return self.market == "spot"

    @property
    def kv_role(self) -> str | None:
        return {"prefill": "kv_producer", "decode": "kv_consumer"}.get(self.phase)

    @property
    def http_port(self) -> int:
        """Port of rank 0's vLLM HTTP API: internal behind a P/D router, else the API port."""
        return {"prefill": self.ports.prefill_http, "decode": self.ports.decode_http}.get(
            self.phase, self.ports.api
        )

    @property
    def is_head(self) -> bool:
        """Hosts node rank 0: stage 0, the HTTP API and the torch.distributed master."""
        return any(p.rank == 0 for p in self.processes)

    @property
    def model_dir(self) -> str:
        return f"/opt/coral/models/{self.model}"


def vllm_argv(boot: NodeBoot, process: Process, master_addr: str) -> list[str]:
    """`vllm serve` arguments of one process; identical across ranks but rank and headless."""
    e = boot.engine
    argv = [
        boot.model_dir,
        "--served-model-name",
        boot.model,
        "--tensor-parallel-size",
        str(boot.tp),
        "--pipeline-parallel-size",
        str(boot.nnodes),
        "--max-model-len",
        str(e.max_model_len),
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--dtype",
        e.dtype,
        "--gpu-memory-utilization",
        f"{e.gpu_memory_utilization:g}",
        "--distributed-timeout-seconds",
        str(e.distributed_timeout_s),
    ]
    if e.attention_backend is not None:
        argv += ["--attention-backend", e.attention_backend]
    if boot.nnodes > 1:
        argv += [
            "--nnodes",
            str(boot.nnodes),
            "--node-rank",
            str(process.rank),
            "--master-addr",
            master_addr,
            "--master-port",
            str(boot.ports.master),
            "--distributed-executor-backend",
            "mp",
        ]
    if boot.kv_role is not None:
        config = {"kv_connector": KV_CONNECTOR, "kv_role": boot.kv_role}
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    if process.rank == 0:
        argv += ["--host", "0.0.0.0", "--port", str(boot.http_port)]
    else:
        argv += ["--headless"]
    return argv


def router_argv(router: RouterSpec, api_port: int) -> list[str]:
    """vllm-router's arguments but the prefills: the start script adds those that answer
    /health (templates/node-start.sh.j2, serve_router)."""
    argv = ["--vllm-pd-disaggregation", "--policy", "round_robin"]
    for url in router.decode_urls:
        argv += ["--decode", url]
    return argv + ["--host", "0.0.0.0", "--port", str(api_port)]
