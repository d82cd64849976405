"""How big each node's root disk must be: the model files `hf download` fetches, the runtime venv
and the stack's headroom.

`coral_iac/data/model_files.yaml` records, per model card, the bytes of the repository's
safetensors weights with the source of the number (an index's `metadata.total_size` or the Hub's
parameter count), plus an allowance for the config and tokenizer files and the venv. A model
whose size could not be sourced falls back to the card's weight bytes x 1.1, labelled
`estimate` there.
"""

from __future__ import annotations

import datetime as dt
import math
from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from solver.catalog.model_cards import ModelCard
from solver.catalog.user_models import UserModelCard
from solver.errors import InputError
from solver.io import parse_model, read_yaml
from solver.types import FROZEN

MODEL_FILES = Path(__file__).resolve().parent / "data" / "model_files.yaml"
ESTIMATE_FACTOR = 1.1  # the labelled estimate for a model without a sourced size


class ModelFiles(BaseModel):
    """One model card's downloaded files."""

    model_config = FROZEN
    hf_repo: str
    kind: Literal["index_total_size", "hub_parameters", "estimate"]
    safetensors_bytes: int | None = Field(gt=0, description="None only for an estimate.")
    evidence: str = Field(min_length=1)
    source: str = Field(min_length=1)
    retrieved: dt.date

    @model_validator(mode="after")
    def _bytes_unless_estimate(self) -> ModelFiles:
        if (self.safetensors_bytes is None) != (self.kind == "estimate"):
            raise ValueError("safetensors_bytes is null exactly when kind is estimate")
        return self


class ModelFilesFile(BaseModel):
    model_config = FROZEN
    schema_version: Literal[1]
    non_weight_allowance_bytes: int = Field(ge=0)
    runtime_gb: int = Field(ge=0, description="The vLLM venv and uv's cache on the root disk.")
    models: dict[str, ModelFiles]


@cache
def load_model_files(path: Path = MODEL_FILES) -> ModelFilesFile:
    """Parse `coral_iac/data/model_files.yaml` (or `path`)."""
    return parse_model(ModelFilesFile, read_yaml(path), str(path))


def download_bytes(
    model: str, hf_repo: str, weight_bytes: float, files: ModelFilesFile | None = None
) -> int:
    """Bytes `hf download` writes for a model card: its safetensors plus the config/tokenizer
    allowance, or the card's weights x 1.1 where no size is sourced.

    Args:
        model: the model card's id.
        hf_repo: the repository the card downloads (must be the one the sizes are of).
        weight_bytes: the card's weight bytes (ModelCard.weight_bytes), for the estimate.
        files: the parsed data file (default: coral_iac/data/model_files.yaml).

    Raises:
        InputError: the card has no entry in model_files.yaml, or names another repository.
    """
    files = files or load_model_files()
    entry = files.models.get(model)
    if entry is None:
        raise InputError(
            f"coral_iac/data/model_files.yaml models.{model}",
            "no downloaded-file size recorded for this model card",
            "add its hf_repo and safetensors_bytes (model.safetensors.index.json "
            "metadata.total_size) with source and date",
            suggestions=sorted(files.models),
        )
    if entry.hf_repo != hf_repo:
        raise InputError(
            f"coral_iac/data/model_files.yaml models.{model}.hf_repo",
            f"'{entry.hf_repo}' but the model card downloads '{hf_repo}'",
            "record the sizes of the repository the card names",
        )
    if entry.safetensors_bytes is None:
        return math.ceil(weight_bytes * ESTIMATE_FACTOR)
    return entry.safetensors_bytes + files.non_weight_allowance_bytes


def root_disk_gb(
    model: str,
    hf_repo: str,
    weight_bytes: float,
    headroom_gb: int,
    files: ModelFilesFile | None = None,
) -> int:
    """A node's root disk, GB: ceil(downloaded files) + the runtime venv + `deploy.disk_headroom_gb`
    (the image, logs and slack)."""
    files = files or load_model_files()
    size = download_bytes(model, hf_repo, weight_bytes, files)
    return math.ceil(size / 1e9) + files.runtime_gb + headroom_gb


def card_disk_gb(
    model: str, card: ModelCard, headroom_gb: int, files: ModelFilesFile | None = None
) -> int:
    """`root_disk_gb` for any card: a built-in one's files are in this data file, a stack's own
    card brings them (the `safetensors_bytes` it declares, else the labelled estimate)."""
    files = files or load_model_files()
    if isinstance(card, UserModelCard):
        declared = card.safetensors_bytes
        entry = ModelFiles(
            hf_repo=card.hf_repo,
            kind="estimate" if declared is None else "index_total_size",
            safetensors_bytes=declared,
            evidence="the stack's model_cards",
            source=card.source,
            retrieved=card.retrieved,
        )
        files = files.model_copy(update={"models": files.models | {model: entry}})
    return root_disk_gb(model, card.hf_repo, card.weight_bytes, headroom_gb, files)
