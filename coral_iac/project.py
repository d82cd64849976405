"""Where a Coral project keeps its files, relative to its root (the folder of `Pulumi.yaml`)."""

from __future__ import annotations

from pathlib import Path

STACKS_FOLDER = Path("stacks")  # `stackConfigDir` in Pulumi.yaml: Pulumi.<stack>.yaml files
LIBRARY_FOLDER = Path(".coral/library")  # serving-template libraries, one folder per stack
