"""Small serving templates and stack pieces built by hand for tests."""

from __future__ import annotations

from solver.serving.serving_template import ServingTemplate, Stage, StageMember


def data_parallel_template(model: str, layers: int) -> ServingTemplate:
    """Two l40sx1 nodes sharing one stage (general mode's data parallelism)."""
    return ServingTemplate(
        key="l40sx1*2",
        model=model,
        phase="prefill",
        mode="general",
        nodes=["l40sx1", "l40sx1"],
        stages=[
            Stage(
                layers=layers,
                members=[StageMember(node=0, gpus=[0], tp=1), StageMember(node=1, gpus=[0], tp=1)],
            )
        ],
        throughput=1.0,
        unit="tokens/s",
        stage_budget_ms=[1.0],
    )


def single_node_template(model: str, node: str, layers: int) -> ServingTemplate:
    """One node holding every layer in one process (TP over all its GPUs)."""
    gpus = int(node.rsplit("x", 1)[1])
    return ServingTemplate(
        key=node,
        model=model,
        phase="prefill",
        mode="vllm",
        nodes=[node],
        stages=[
            Stage(layers=layers, members=[StageMember(node=0, gpus=list(range(gpus)), tp=gpus)])
        ],
        throughput=1.0,
        unit="tokens/s",
        stage_budget_ms=[1.0],
    )


# phi-4 as a stack declares it, with the paper's SLOs and mean lengths (Azure 2023 conversation).
PHI4_SPEC: dict[str, object] = {
    "slo_ms": {"prefill": 1200, "decode": 60},
    "mean_prompt_tokens": 1020,
    "mean_output_tokens": 129,
}
