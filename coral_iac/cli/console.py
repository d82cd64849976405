"""What every `coral` command shares: the consoles, JSON output, and clean error exits.

Human output goes to stderr (Rich), machine output (`--json`) to stdout.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.text import Text

from coral_iac.project import LIBRARY_FOLDER, STACKS_FOLDER
from solver.errors import CoralError

# Errors and warnings are not hard-wrapped, so a path or command in them stays copyable.
err = Console(stderr=True, soft_wrap=True)
out = Console()
F = TypeVar("F", bound=Callable[..., Any])
STACKS_DIR = STACKS_FOLDER  # relative to the Pulumi project, where `coral` runs
LIBRARY_ROOT = LIBRARY_FOLDER  # the default library cache, one folder per stack


def reports_errors(fn: F) -> F:
    """Turn CoralError into a clean message on stderr and exit code 1 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CoralError as exc:
            # The message is plain text: markup would eat brackets, e.g. `coral-iac[profile]`.
            err.print(Text.assemble(("Error:", "bold red"), " ", str(exc)), highlight=False)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def warn(line: str) -> None:
    """A warning on stderr, as plain text (markup would eat brackets in it)."""
    err.print(Text.assemble(("Warning:", "yellow"), " ", line), highlight=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def progress_bar() -> Progress:
    """The bar long commands show on stderr: description, bar, done/total, elapsed."""
    return Progress(
        "{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


# A shared option of `coral profile` and `coral templates`.
MeasuredOpt = Annotated[
    Path | None,
    typer.Option(
        "--measured",
        help="Folder of measured tables (<model>__<node>__<phase>.csv) that replace "
        "the analytical model where present (default: $CORAL_MEASURED_DIR when set).",
    ),
]
