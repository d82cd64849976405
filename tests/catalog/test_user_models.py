"""Bring your own model: a card read from a Hugging Face config.json, used by every stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coral_iac.cli.app import app
from solver.catalog.model_cards import load_model_cards
from solver.catalog.user_models import card_fields
from solver.errors import InputError
from solver.stack import load_stack
from tests.conftest import REPO, committed_stacks

# The architecture keys of the published config.json files the built-in cards were read from
# (solver/data/models.yaml names each source): a reader of config.json must give those cards.
PHI_4 = {
    "architectures": ["Phi3ForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 17920,
    "max_position_embeddings": 16384,
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 10,
    "torch_dtype": "bfloat16",
    "vocab_size": 100352,
}
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,  # the dense MLP size; every layer here is MoE
    "max_position_embeddings": 40960,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 94,
    "num_key_value_heads": 4,
    "sliding_window": None,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "torch_dtype": "bfloat16",
    "vocab_size": 201088,
}


@pytest.mark.parametrize(
    ("model", "config"),
    [("phi-4", PHI_4), ("qwen3-235b-a22b", QWEN3_235B), ("gpt-oss-20b", GPT_OSS_20B)],
)
def test_a_published_config_gives_the_built_in_card(model, config):
    """Dense, MoE (its per-expert MLP, not the dense size) and sliding-window layouts."""
    fields = card_fields(config, "here")
    card = load_model_cards()[model]
    assert {name: getattr(card, name) for name in fields} == fields


def test_a_config_without_a_needed_key_names_it():
    config = {k: v for k, v in PHI_4.items() if k != "num_hidden_layers"}
    with pytest.raises(InputError, match="no layers: none of num_hidden_layers"):
        card_fields(config, "coral:fleet.model_cards.mine.config")
    with pytest.raises(InputError, match="weight dtype 'int4'") as exc:
        card_fields(PHI_4 | {"torch_dtype": "int4"}, "here")
    assert "weight_bytes_per_param" in exc.value.fix


def project(tmp_path: Path, cards: dict, stack: str = "mine") -> Path:
    """A Coral project whose stack (`mine`) is dev serving `my-phi` (phi-4's config) instead."""
    root = tmp_path / "project"
    (root / "stacks" / "models").mkdir(parents=True)
    (root / "Pulumi.yaml").write_text((REPO / "Pulumi.yaml").read_text())
    (root / "stacks" / "models" / "config.json").write_text(json.dumps(PHI_4))
    doc = yaml.safe_load((REPO / "stacks" / "Pulumi.dev.yaml").read_text())
    fleet = doc["config"]["coral:fleet"]
    fleet["models"] = {"my-phi": fleet["models"]["phi-4"]}
    fleet["model_cards"] = cards
    (root / "stacks" / f"Pulumi.{stack}.yaml").write_text(yaml.safe_dump(doc))
    return root


MY_PHI = {
    "my-phi": {
        "config": "models/config.json",
        "hf_repo": "my-org/my-phi",
        "retrieved": "2026-11-30",
        "safetensors_bytes": 29_319_296_000,
    }
}


def test_stack_cards_are_read_and_checked(tmp_path):
    stacks = project(tmp_path, MY_PHI) / "stacks"
    card = load_stack(stacks, "mine").model_cards["my-phi"]
    assert card.layers == 40 and card.hf_repo == "my-org/my-phi"
    assert card.source == "config.json of my-org/my-phi" and card.display_name == "my-phi"
    clash = stacks.parent.parent / "clash"
    with pytest.raises(InputError, match="config: .*missing.json"):
        load_stack(project(clash, {"my-phi": MY_PHI["my-phi"] | {"config": "missing.json"}})
                   / "stacks", "mine")  # fmt: skip


def test_the_cli_lists_plans_and_refuses_a_built_in_id(tmp_path, monkeypatch):
    """Through the user's door: `coral catalog models --stack`, then `coral plan` plans the
    stack's own model exactly as the built-in card it copies (same architecture, same plan)."""
    runner = CliRunner()
    monkeypatch.chdir(project(tmp_path, MY_PHI))
    listed = runner.invoke(app, ["catalog", "models", "--stack", "mine", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {r["id"]: r for r in json.loads(listed.stdout)}
    assert rows["my-phi"]["card"] == "stack mine" and rows["phi-4"]["card"] == "built-in"
    mine = runner.invoke(app, ["plan", "--stack", "mine", "--json"])
    assert mine.exit_code == 0, mine.output
    monkeypatch.chdir(REPO)
    dev = runner.invoke(app, ["plan", "--stack", "dev", "--json"])
    assert dev.exit_code == 0, dev.output
    mine_plan, dev_plan = json.loads(mine.stdout), json.loads(dev.stdout)
    assert mine_plan["hourly_cost_usd"] == dev_plan["hourly_cost_usd"]
    assert sorted(i["template"] for i in mine_plan["instances"]) == sorted(
        i["template"] for i in dev_plan["instances"]
    )

    monkeypatch.chdir(project(tmp_path / "b", {"phi-4": MY_PHI["my-phi"]}))
    refused = runner.invoke(app, ["catalog", "models", "--stack", "mine"])
    assert refused.exit_code == 1 and "is a built-in model id" in refused.output


def test_the_program_renders_nodes_that_download_the_stacks_model(tmp_path, preview):
    """The Pulumi program (under mocks) declares nodes that download the card's repository,
    their disks sized from the declared safetensors bytes (smaller than the weights x 1.1
    estimate a card without them gets)."""
    disks = {}
    for name, card in (("declared", MY_PHI["my-phi"]), ("estimate", MY_PHI["my-phi"] | {})):
        if name == "estimate":
            card = {k: v for k, v in card.items() if k != "safetensors_bytes"}
        # One stack name each: the session's library cache is per stack name.
        result = preview(name, project(tmp_path / name, {"my-phi": card}, name) / "stacks")
        nodes = result.of_type("aws:ec2/instance:Instance")
        serving = [n for n in nodes if n.inputs["tags"].get("coral:model") == "my-phi"]
        assert serving
        for node in serving:
            assert "my-org/my-phi" in node.inputs["userData"]
        disks[name] = {n.inputs["rootBlockDevice"]["volumeSize"] for n in serving}
    assert max(disks["declared"]) < min(disks["estimate"])


@pytest.mark.parametrize("stack", committed_stacks())
def test_catalog_models_lists_the_built_in_cards_for_every_committed_stack(stack, monkeypatch):
    monkeypatch.chdir(REPO)
    r = CliRunner().invoke(app, ["catalog", "models", "--stack", stack, "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert {row["id"] for row in rows} == set(load_model_cards())
    assert {row["card"] for row in rows} == {"built-in"}
