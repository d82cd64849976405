"""Boot specs and cloud-init user-data: how each node of a serving instance starts its vLLM stage.

`node_boots` turns a plan instance and its template into one `NodeBoot` per node: which vLLM
processes the node runs, their node ranks, GPUs, and the engine flags every rank shares. Then
`render_user_data` renders `templates/cloud-config.yaml.j2` (Jinja2, StrictUndefined) into
`#cloud-config` user-data. The head's private IP is a plain string here; the Pulumi program
passes it through `Output.apply`.

Runtime rules (stock vLLM 0.33: its multi-node serving and disaggregated-prefill docs):

- Every vLLM "node" runs the same number of ranks. A per-GPU layout is one process per GPU,
  each its own node rank with its GPU pinned by CUDA_VISIBLE_DEVICES. A uniform-TP layout is one
  process per node with TP = its GPUs.
- Node rank r hosts stage r. Rank 0 serves the HTTP API and is the torch.distributed master;
  the others run `--headless`.
- VLLM_PP_LAYER_PARTITION is identical everywhere, and so are all engine flags except
  `--node-rank` and `--headless`.
- Disaggregated prefill uses NixlConnector as kv_producer and decode as kv_consumer. Decode runs
  PP = 1. A vllm-router on the decode node is the model's endpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from pydantic import BaseModel, Field

from solver.errors import InputError
from solver.templates.serving_template import ServingTemplate
from solver.types import FROZEN

VLLM_VERSION = "0.33.0"  # pinned; tests check rendered flags against this version's parser
VLLM_ROUTER_VERSION = "0.1.17"
MASTER_PORT = 29501
PREFILL_PORT, DECODE_PORT = 8100, 8200  # internal vLLM HTTP ports of a PD pair
NIXL_PORT = 5600
TEMPLATES = Path(__file__).resolve().parents[1] / "templates"


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
    max_model_len: int = Field(gt=0)
    gpu_memory_utilization: float = Field(gt=0, le=1)
    processes: list[Process] = Field(min_length=1)
    master_addr: str = Field(description="Head node's private IP ('' on the head itself).")
    http_port: int = Field(description="Port of the vLLM HTTP API on rank 0.")
    api_port: int = Field(description="Public port: rank 0's API, or the router's.")
    hf_token_secret: str = Field(description="Secret-manager name of the Hugging Face token.")
    router: RouterSpec | None = None
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="Largest decode batch that meets the decode SLO."
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="Largest prefill batch that meets the prefill SLO."
    )

    @property
    def kv_role(self) -> str | None:
        return {"prefill": "kv_producer", "decode": "kv_consumer"}.get(self.phase)

    @property
    def is_head(self) -> bool:
        """Hosts node rank 0: stage 0, the HTTP API and the torch.distributed master."""
        return any(p.rank == 0 for p in self.processes)

    @property
    def model_dir(self) -> str:
        return f"/opt/coral/models/{self.model}"


def secret_name(cloud: str, name: str) -> str:
    """The token secret's name as each secret manager spells it (GCP allows no '/')."""
    return name.replace("/", "-") if cloud == "gcp" else name


def node_boots(
    *,
    template: ServingTemplate,
    layers: int,
    cloud: Literal["aws", "gcp"],
    region: str,
    stack: str,
    replica_key: str,
    hf_repo: str,
    disaggregated: bool,
    max_model_len: int,
    api_port: int,
    hf_token_secret: str,
    gpu_memory_utilization: float = 0.9,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> list[NodeBoot]:
    """One boot spec per node of the template (master_addr left '' for the Pulumi program).

    Raises:
        InputError: a placement stock vLLM cannot run (data parallel in a stage, mixed TP, a
            layer split that does not sum to the model, or multi-stage disaggregated decode).
    """
    where = f"template {template.key} ({template.model} {template.phase})"
    if any(len(s.members) != 1 for s in template.stages):
        raise InputError(
            where,
            "a stage has several members (data parallel), which stock vLLM cannot run",
            "plan with `library: {mode: vllm}` in the stack",
        )
    tps = {s.members[0].tp for s in template.stages}
    if len(tps) != 1:
        raise InputError(where, f"stages use TP sizes {sorted(tps)}", "use mode vllm")
    if sum(s.layers for s in template.stages) != layers:
        raise InputError(
            where,
            f"layer split {template.layer_partition} != {layers} layers",
            "rebuild the library",
        )
    if disaggregated and template.phase == "decode" and len(template.stages) > 1:
        raise InputError(
            where, "disaggregated decode must run PP=1 (NixlConnector)", "use mode vllm"
        )
    tp = tps.pop()
    procs: dict[int, list[Process]] = {}
    for rank, stage in enumerate(template.stages):
        member = stage.members[0]
        procs.setdefault(member.node, []).append(Process(rank=rank, gpus=member.gpus))
    phase = template.phase if disaggregated else "aggregated"
    http_port = {"prefill": PREFILL_PORT, "decode": DECODE_PORT}.get(phase, api_port)
    return [
        NodeBoot(
            cloud=cloud,
            region=region,
            stack=stack,
            replica_key=replica_key,
            node_index=k,
            model=template.model,
            hf_repo=hf_repo,
            phase=phase,
            nnodes=len(template.stages),
            tp=tp,
            layer_partition=template.layer_partition,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            processes=procs.get(k, []),
            master_addr="",
            http_port=http_port,
            api_port=api_port,
            hf_token_secret=secret_name(cloud, hf_token_secret),
            max_num_seqs=max_num_seqs if phase != "prefill" else None,
            max_num_batched_tokens=max_num_batched_tokens if phase != "decode" else None,
        )
        for k in range(len(template.nodes))
        if procs.get(k)
    ]


def vllm_argv(boot: NodeBoot, process: Process, master_addr: str) -> list[str]:
    """`vllm serve` arguments of one process; identical across ranks but rank and headless."""
    argv = [
        boot.model_dir,
        "--served-model-name",
        boot.model,
        "--tensor-parallel-size",
        str(boot.tp),
        "--pipeline-parallel-size",
        str(boot.nnodes),
        "--max-model-len",
        str(boot.max_model_len),
        "--gpu-memory-utilization",
        f"{boot.gpu_memory_utilization:g}",
    ]
    if boot.max_num_seqs is not None:  # batches past these sizes would break the SLO
        argv += ["--max-num-seqs", str(boot.max_num_seqs)]
    if boot.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(boot.max_num_batched_tokens)]
    if boot.nnodes > 1:
        argv += [
            "--nnodes",
            str(boot.nnodes),
            "--node-rank",
            str(process.rank),
            "--master-addr",
            master_addr,
            "--master-port",
            str(MASTER_PORT),
            "--distributed-executor-backend",
            "mp",
        ]
    if boot.kv_role is not None:
        config = {"kv_connector": "NixlConnector", "kv_role": boot.kv_role}
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    if process.rank == 0:
        argv += ["--host", "0.0.0.0", "--port", str(boot.http_port)]
    else:
        argv += ["--headless"]
    return argv


def router_argv(router: RouterSpec, api_port: int) -> list[str]:
    argv = ["--vllm-pd-disaggregation", "--policy", "round_robin"]
    for url in router.prefill_urls:
        argv += ["--prefill", url]
    for url in router.decode_urls:
        argv += ["--decode", url]
    return argv + ["--host", "0.0.0.0", "--port", str(api_port)]


def template_environment(folder: Path) -> Environment:
    """Jinja2 as every Coral template renders: StrictUndefined (a missing value is an error,
    never an empty string), no autoescape (YAML, shell and HAProxy, not HTML), shell filters."""
    env = Environment(
        loader=FileSystemLoader(folder),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # noqa: S701 - renders YAML, shell and HAProxy, not HTML
    )
    env.filters["shell_array"] = lambda items: " ".join(_shell_quote(x) for x in items)
    env.filters["shell_quote"] = _shell_quote
    return env


def _environment() -> Environment:
    return template_environment(TEMPLATES)


MASTER_ADDR_VAR = (
    "${MASTER_ADDR}"  # resolved at boot: the head's IP, or this node's own on the head
)


def _shell_quote(text: str) -> str:
    """Single-quote for bash unless the word is plainly safe (keeps scripts readable)."""
    if text == MASTER_ADDR_VAR:
        return f'"{text}"'
    if text and all(c.isalnum() or c in "-_./:,=@" for c in text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def render_start_script(boot: NodeBoot) -> str:
    """The per-node start script (run by systemd once per process index)."""
    return (
        _environment()
        .get_template("node-start.sh.j2")
        .render(
            boot=boot,
            vllm_version=VLLM_VERSION,
            router_version=VLLM_ROUTER_VERSION,
            nixl_port=NIXL_PORT,
            argvs=[vllm_argv(boot, p, MASTER_ADDR_VAR) for p in boot.processes],
            router=router_argv(boot.router, boot.api_port) if boot.router else None,
        )
    )


def render_user_data(boot: NodeBoot, master_addr: str) -> str:
    """`#cloud-config` user-data of one node."""
    return (
        _environment()
        .get_template("cloud-config.yaml.j2")
        .render(
            boot=boot,
            vllm_version=VLLM_VERSION,
            router=boot.router,
            master_addr=master_addr,
            start_script=render_start_script(boot),
            drain_script=_environment().get_template("node-drain.sh.j2").render(boot=boot),
        )
    )
