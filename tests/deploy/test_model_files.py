"""Root disks sized from the files `hf download` fetches (coral_iac/data/model_files.yaml)."""

from __future__ import annotations

import math

import pytest

from coral_iac.model_files import (
    ESTIMATE_FACTOR,
    ModelFilesFile,
    download_bytes,
    load_model_files,
    root_disk_gb,
)
from solver.catalog.model_cards import load_model_cards
from solver.errors import InputError
from tests.conftest import REPO

CARDS = load_model_cards()
FILES = load_model_files()


def test_every_model_card_has_its_repositorys_file_sizes():
    assert set(FILES.models) == set(CARDS)
    for model, card in CARDS.items():
        entry = FILES.models[model]
        assert entry.hf_repo == card.hf_repo, model
        assert entry.source and entry.evidence and entry.retrieved, model


def test_sourced_sizes_agree_with_the_cards_parameter_count():
    """Each sourced total_size is within 1% of what the card's config implies (a wrong copy of
    an index, or a card reading the wrong repository, would not be)."""
    for model, entry in FILES.models.items():
        if entry.safetensors_bytes is not None:
            ratio = entry.safetensors_bytes / CARDS[model].weight_bytes
            assert 0.99 < ratio < 1.01, (model, ratio)


def test_only_the_unsourced_model_keeps_the_estimate():
    estimates = {m for m, e in FILES.models.items() if e.kind == "estimate"}
    assert estimates == {"llama1-30b"}
    card = CARDS["llama1-30b"]
    got = download_bytes("llama1-30b", card.hf_repo, card.weight_bytes)
    assert got == math.ceil(card.weight_bytes * ESTIMATE_FACTOR)


@pytest.mark.parametrize("model", sorted(CARDS))
def test_the_disk_holds_the_files_the_venv_and_the_headroom(model):
    card = CARDS[model]
    files = download_bytes(model, card.hf_repo, card.weight_bytes)
    entry = FILES.models[model]
    if entry.safetensors_bytes is not None:
        assert files == entry.safetensors_bytes + FILES.non_weight_allowance_bytes
    disk = root_disk_gb(model, card.hf_repo, card.weight_bytes, 100)
    assert disk * 1e9 >= files + (FILES.runtime_gb + 100) * 1e9
    assert disk == math.ceil(files / 1e9) + FILES.runtime_gb + 100


def test_a_missing_entry_or_another_repository_is_an_error_naming_the_key():
    card = CARDS["phi-4"]
    with pytest.raises(InputError, match=r"model_files.yaml models.phi-5"):
        download_bytes("phi-5", card.hf_repo, card.weight_bytes)
    with pytest.raises(InputError, match=r"models.phi-4.hf_repo"):
        download_bytes("phi-4", "someone/else", card.weight_bytes)


def test_a_size_is_null_exactly_for_an_estimate():
    doc = FILES.model_dump(mode="json")
    doc["models"]["phi-4"]["safetensors_bytes"] = None
    with pytest.raises(ValueError, match="null exactly when kind is estimate"):
        ModelFilesFile.model_validate(doc)


def test_rendered_nodes_get_the_sized_disk(preview):
    result = preview("dev", REPO / "stacks")
    nodes = [
        n
        for n in result.of_type("aws:ec2/instance:Instance")
        if "coral:replica" in n.inputs["tags"]
    ]
    assert nodes
    headroom = 100  # dev keeps deploy.disk_headroom_gb's default
    for node in nodes:
        model = node.inputs["tags"]["coral:model"]
        card = CARDS[model]
        size = node.inputs["rootBlockDevice"]["volumeSize"]
        assert size * 1e9 >= download_bytes(model, card.hf_repo, card.weight_bytes)
        assert size == root_disk_gb(model, card.hf_repo, card.weight_bytes, headroom)
