"""Boot specs and cloud-init user-data: how each node of a serving instance starts its vLLM stage.

`node_boots` turns a plan instance and its template into one `NodeBoot` per node: which vLLM
processes the node runs, their node ranks, GPUs, and the engine flags every rank shares (the
spec, the engine flags and the `vllm serve` / vllm-router argv are in
`coral_iac/engine_args.py`). Then `render_user_data` renders `templates/cloud-config.yaml.j2`
(Jinja2, StrictUndefined) into `#cloud-config` user-data. The head's private IP is a plain
string here; the Pulumi program passes it through `Output.apply`.

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

from pathlib import Path
from typing import Literal

import yaml
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from coral_iac.engine_args import (
    KV_CONNECTOR,
    MASTER_PORT,
    EngineSettings,
    NodeBoot,
    Process,
    allocate_ports,
    router_argv,
    vllm_argv,
)
from solver.errors import InputError
from solver.serving.serving_template import ServingTemplate
from solver.types import base_model

VLLM_VERSION = "0.33.0"  # pinned; tests run this version's own checks on every rendered node
VLLM_ROUTER_VERSION = "0.1.17"
TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
IMAGES = Path(__file__).resolve().parent / "data" / "images.yaml"
UV_VERSION = "0.13.9"  # installs the runtime Python where the image's is too old
# What `hf download` fetches: weights, config and tokenizer files only.
DOWNLOAD_INCLUDE = ["*.safetensors", "*.json", "tokenizer*", "*.tiktoken", "*.model", "*.txt"]
DOWNLOAD_EXCLUDE = ["original/*", "metal/*", "*.gguf"]
# A spot node's interruption handler (templates/node-interruption.sh.j2): how often it asks the
# metadata service, the notice each cloud gives before it takes the node back (EC2's
# instance-action two minutes ahead; GCE's preemption 30 s), and the most its drain may wait
# within that notice, leaving the rest for the poll, the firewall rule and stopping vLLM.
INTERRUPTION_POLL_S = 5
SPOT_NOTICE_S = {"aws": 120, "gcp": 30}
SPOT_DRAIN_S = {"aws": 90, "gcp": 20}


def secret_name(cloud: str, name: str) -> str:
    """The token secret's name as each secret manager spells it (GCP allows no '/')."""
    return name.replace("/", "-") if cloud == "gcp" else name


def slug(text: str) -> str:
    """A logical-name-safe, stable form of a key (replica keys contain / : * +): the names of a
    replica's Pulumi resources and of its HAProxy server."""
    return text.replace("/", ".").replace(":", "-").replace("*", "x").replace("+", "_")


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
    engine: EngineSettings,
    api_port: int,
    hf_token_secret: str,
    api_key_secret: str | None = None,
    market: Literal["on-demand", "spot"] = "on-demand",
) -> list[NodeBoot]:
    """One boot spec per node of the template (master_addr left '' for the Pulumi program).

    Args:
        template: the serving template the instance realises.
        layers: the model's layer count (the partition must sum to it).
        cloud: where the nodes run.
        region: the nodes' region.
        stack: the Pulumi stack name.
        replica_key: the plan's stable instance key.
        hf_repo: the Hugging Face repository of the weights.
        disaggregated: prefill/decode run apart (KV transfer over NIXL).
        engine: the engine flags every node of the instance shares.
        api_port: the stack's public API port (`deploy.api_port`).
        hf_token_secret: secret-manager name of the Hugging Face token.
        api_key_secret: secret-manager name of the API key every vLLM head requires,
            aggregated and prefill/decode alike; a decode node's vllm-router gets it as
            OPENAI_API_KEY (read at boot, never in user-data). The program sets it
            (`deploy.api_key_secret`) only for a fleet without a gateway, which checks it alone.
        market: the plan instance's market; a spot instance's nodes run the interruption
            handler (`render_interruption_script`).

    Returns:
        One `NodeBoot` per node that runs vLLM processes.

    Raises:
        InputError: a placement stock vLLM cannot run (data parallel in a stage, mixed TP, a
            layer split that does not sum to the model or leaves a stage empty, or
            multi-stage disaggregated decode).
    """
    _check_runnable(template, layers, disaggregated)
    procs: dict[int, list[Process]] = {}
    for rank, stage in enumerate(template.stages):
        member = stage.members[0]
        procs.setdefault(member.node, []).append(Process(rank=rank, gpus=member.gpus))
    phase = template.phase if disaggregated else "aggregated"
    return [
        NodeBoot(
            cloud=cloud,
            region=region,
            stack=stack,
            replica_key=replica_key,
            node_index=k,
            model=base_model(template.model),  # a length bucket serves its model's own name
            hf_repo=hf_repo,
            phase=phase,
            nnodes=len(template.stages),
            tp=template.stages[0].members[0].tp,
            layer_partition=template.layer_partition,
            engine=engine,
            processes=procs[k],
            master_addr="",
            ports=allocate_ports(api_port),
            hf_token_secret=secret_name(cloud, hf_token_secret),
            api_key_secret=secret_name(cloud, api_key_secret) if api_key_secret else None,
            market=market,
        )
        for k in range(len(template.nodes))
        if procs.get(k)
    ]


def _check_runnable(template: ServingTemplate, layers: int, disaggregated: bool) -> None:
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
    if sum(s.layers for s in template.stages) != layers or any(
        s.layers < 1 for s in template.stages
    ):
        raise InputError(
            where,
            f"layer split {template.layer_partition} != {layers} layers, or a stage is empty",
            "rebuild the library",
        )
    if disaggregated and template.phase == "decode" and len(template.stages) > 1:
        raise InputError(
            where,
            f"disaggregated decode must run PP=1 ({KV_CONNECTOR} consumers reject PP > 1)",
            "use mode vllm",
        )


def runtime_python(cloud: str) -> str:
    """The Python the node's vLLM venv runs: the image's own when it meets the wheel's
    Requires-Python, else the one uv installs (coral_iac/data/images.yaml)."""
    doc = yaml.safe_load(IMAGES.read_text(encoding="utf-8"))
    image = doc["images"][cloud]["default"]
    return str(image.get("runtime_python", image["python"]))


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


def _shell_quote(value: object) -> str:
    """Single-quote for bash unless the word is plainly safe (keeps scripts readable)."""
    text = str(value)
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
            nixl_port=boot.ports.nixl,
            master_port=MASTER_PORT,
            node_stages=",".join(str(p.rank) for p in boot.processes),
            download_include=DOWNLOAD_INCLUDE,
            download_exclude=DOWNLOAD_EXCLUDE,
            argvs=[vllm_argv(boot, p, MASTER_ADDR_VAR) for p in boot.processes],
            router=router_argv(boot.router, boot.ports.api) if boot.router else None,
        )
    )


def interruption_ports(boot: NodeBoot) -> list[int]:
    """The ports other hosts open new connections to on this node, which its interruption
    handler closes on notice: on the head, the public port where the gateway connects (an
    aggregated vLLM, or a decode node's vllm-router, whose own decode vLLM it reaches on
    loopback), or a prefill's vLLM port, where the decode routers connect. None on a node
    without rank 0: its ranks talk to the head (torch.distributed, NCCL) until the end."""
    if not boot.is_head:
        return []
    return [boot.ports.api if boot.router else boot.http_port]


def vllm_units(boot: NodeBoot) -> list[str]:
    """The node's systemd units: one `coral-vllm@<k>` per process, and the router's."""
    units = [f"coral-vllm@{k}.service" for k in range(len(boot.processes))]
    return units + (["coral-vllm@router.service"] if boot.router else [])


def render_interruption_script(boot: NodeBoot) -> str:
    """A spot node's interruption handler, for its cloud's metadata service and notice."""
    return (
        _environment()
        .get_template("node-interruption.sh.j2")
        .render(
            boot=boot,
            poll_s=INTERRUPTION_POLL_S,
            notice_s=SPOT_NOTICE_S[boot.cloud],
            drain_s=SPOT_DRAIN_S[boot.cloud],
            ports=interruption_ports(boot),
            units=vllm_units(boot),
        )
    )


def render_user_data(boot: NodeBoot, master_addr: str) -> str:
    """`#cloud-config` user-data of one node (a spot node's adds its interruption handler)."""
    return (
        _environment()
        .get_template("cloud-config.yaml.j2")
        .render(
            boot=boot,
            vllm_version=VLLM_VERSION,
            python=runtime_python(boot.cloud),
            uv_version=UV_VERSION,
            router=boot.router,
            master_addr=master_addr,
            start_script=render_start_script(boot),
            drain_script=_environment().get_template("node-drain.sh.j2").render(boot=boot),
            interruption_script=render_interruption_script(boot) if boot.is_spot else "",
            drain_s=SPOT_DRAIN_S[boot.cloud],
        )
    )
