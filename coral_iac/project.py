"""Where a Coral project keeps its files, relative to its root (the folder of `Pulumi.yaml`).

Like Pulumi, `coral` finds the root from any subfolder: the nearest folder upwards from the
working directory that holds `Pulumi.yaml`. Paths a stack names (demand files, traces) are
confined to the project.
"""

from __future__ import annotations

import os
from pathlib import Path

from solver.errors import InputError

PROJECT_FILE = "Pulumi.yaml"
STACKS_FOLDER = Path("stacks")  # `stackConfigDir` in Pulumi.yaml: Pulumi.<stack>.yaml files
LIBRARY_FOLDER = Path(".coral/library")  # serving-template libraries, one folder per stack


def project_root(start: Path | None = None) -> Path | None:
    """The nearest folder from `start` (default: the working directory) upwards that holds
    `Pulumi.yaml`, absolute; None outside any project."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / PROJECT_FILE).is_file():
            return folder
    return None


def project_path(folder: Path, start: Path | None = None) -> Path:
    """`folder` (relative to the project root) as seen from the working directory.

    At the root it is `folder` itself, so messages keep the short relative path; from a
    subfolder it is `../stacks`-style; outside any project, relative to the working directory.
    """
    if folder.is_absolute():
        return folder
    root = project_root(start)
    if root is None:
        return folder
    here = (start or Path.cwd()).resolve()
    return Path(os.path.relpath(root / folder, here))


def stacks_dir(start: Path | None = None) -> Path:
    """The project's stacks folder (`stacks/` under the root), from the working directory."""
    return project_path(STACKS_FOLDER, start)


def library_root(start: Path | None = None) -> Path:
    """The project's library cache (`.coral/library/` under the root), one folder per stack."""
    return project_path(LIBRARY_FOLDER, start)


def confined(path: Path, field: str, root: Path, allow_outside: bool = False) -> Path:
    """`path` if it resolves (symlinks followed) inside `root`, else an InputError.

    Args:
        path: a path from user input (absolute, or relative to the working directory).
        field: the key path or option it came from, for the message.
        root: the folder it must stay in (usually the project root).
        allow_outside: skip the check (an explicit CLI option such as `--allow-outside`).

    Returns:
        `path`, unchanged.

    Raises:
        InputError: the path leaves `root` (the message names the path, never its contents).
    """
    if allow_outside:
        return path
    resolved, top = path.resolve(), root.resolve()
    if resolved == top or top in resolved.parents:
        return path
    raise InputError(
        field,
        f"{path} is outside the project ({top}); Coral reads no file outside it",
        "move the file into the project (e.g. under stacks/) and give a path inside it",
    )
