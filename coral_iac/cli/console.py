"""What every `coral` command shares: the consoles, JSON output, and clean error exits.

Human output goes to stderr (Rich), machine output (`--json`) to stdout.
"""

from __future__ import annotations

import functools
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from coral_iac import project
from coral_iac.project import LIBRARY_FOLDER, STACKS_FOLDER
from solver.errors import CoralError, InputError

# Errors and warnings are not hard-wrapped, so a path or command in them stays copyable.
err = Console(stderr=True, soft_wrap=True)
out = Console()
F = TypeVar("F", bound=Callable[..., Any])
# Relative to the project root. Commands use `stacks_dir()` and `library_root()`, which find
# the root from any subfolder (the nearest Pulumi.yaml upwards), as Pulumi does.
STACKS_DIR = STACKS_FOLDER
LIBRARY_ROOT = LIBRARY_FOLDER


def stacks_dir() -> Path:
    """The project's stacks folder, from the working directory (any subfolder of the project)."""
    return project.stacks_dir()


def library_root() -> Path:
    """The project's library cache (one folder per stack), from the working directory."""
    return project.library_root()


def load_stack_named(stack: str) -> Any:
    """The stack's `FleetConfig`, its name checked as Pulumi would and found from any subfolder.

    Raises:
        InputError: a name Pulumi rejects, no stacks folder (not inside a Coral project), an
            unknown stack (with the known ones), or a bad stack file.
    """
    from solver.stack import load_stack
    from solver.validation import check_stack_name

    check_stack_name(stack)
    folder = stacks_dir()
    if not folder.is_dir():
        raise InputError(
            "--stack",
            f"no stacks folder {folder} (no {project.PROJECT_FILE} in {Path.cwd()} or above it)",
            "run coral inside a Coral project (a folder with Pulumi.yaml and stacks/)",
        )
    return load_stack(folder, stack)


def reports_errors(fn: F) -> F:
    """Turn CoralError into a clean message on stderr and exit code 1 (no traceback); an
    interrupt into one line and 128 + the signal's number, as a shell reports it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CoralError as exc:
            # The message is plain text: markup would eat brackets, e.g. `coral-iac[profile]`.
            err.print(Text.assemble(("Error:", "bold red"), " ", str(exc)), highlight=False)
            raise typer.Exit(1) from None
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM during a build (`Terminated`)
            signum = int(getattr(exc, "signum", signal.SIGINT))
            err.print(f"Interrupted ({signal.Signals(signum).name}).", highlight=False)
            raise typer.Exit(128 + signum) from None

    return wrapper  # type: ignore[return-value]


def warn(line: str) -> None:
    """A warning on stderr, as plain text (markup would eat brackets in it)."""
    err.print(Text.assemble(("Warning:", "yellow"), " ", line), highlight=False)


def wrapping_table(title: str, columns: list[tuple[str, str]], rows: list[list[str]]) -> Table:
    """A table whose cells wrap (fold) instead of ending in "..." on a narrow terminal or in a
    CI log: an identifier (a region, a node config) may take two lines, never lose its end.

    Args:
        title: the table's title.
        columns: (header, justify) per column: "left" or "right".
        rows: the cells, one list per row, as text.

    Returns:
        The table, ready for `out.print`.
    """
    table = Table(title=title)
    for header, justify in columns:
        table.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        table.add_row(*r)
    return table


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def progress_bar() -> Progress | PlainProgress:
    """The bar long commands show on stderr: description, bar, done/total, elapsed.

    When stderr is not a terminal (CI logs, a pipe), plain lines instead: a redrawn bar would
    print nothing there until the end.
    """
    if not err.is_terminal:
        return PlainProgress()
    return Progress(
        "{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


class PlainProgress:
    """Progress as plain lines on stderr ("templates phi-4 prefill: 512/2048 (25%)"), one per
    quarter done and one at the end; the subset of `rich.progress.Progress` commands use."""

    STEPS = 4

    def __init__(self) -> None:
        self.tasks: dict[int, list[Any]] = {}  # id -> [description, total, done, quarters shown]

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **_: Any) -> TaskID:
        self.tasks[len(self.tasks)] = [description, total, 0.0, 0]
        return TaskID(len(self.tasks) - 1)

    def update(
        self, task: int, completed: float | None = None, total: float | None = None, **_: Any
    ) -> None:
        entry = self.tasks[task]
        if total is not None:
            entry[1] = total
        if completed is not None:
            entry[2] = completed
        self._report(entry)

    def advance(self, task: int, advance: float = 1) -> None:
        self.update(task, completed=self.tasks[task][2] + advance)

    def _report(self, entry: list[Any]) -> None:
        description, total, done, shown = entry
        if not total:
            return
        quarter = min(self.STEPS, int(self.STEPS * done / total))
        if quarter > shown:
            entry[3] = quarter
            err.print(
                f"{description}: {done:g}/{total:g} ({100 * done / total:.0f}%)",
                highlight=False,
                markup=False,
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
