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
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
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
    # Deferred to when the command runs: the solver modules behind it (numpy,
    # pydantic, OR-Tools) would slow the start of every coral command.
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
    """A `FittedTable` filled in one call.

    Args:
        title: the table's title.
        columns: (header, justify) per column: "left" or "right".
        rows: the cells, one list per row, as text.

    Returns:
        The table, ready for `out.print`.
    """
    table = FittedTable(title=title)
    for header, justify in columns:
        table.add_column(header, justify=justify)
    for r in rows:
        table.add_row(*r)
    return table


class FittedTable(Table):
    """A table that never cuts a word: laid out at print time for the console's width (a
    terminal, or COLUMNS in a CI log or a pipe).

    Where every column fits on one line it prints as Rich would. Otherwise each column keeps
    at least its longest word (an id such as `gcp:us-central1` or `l40sx1*3` stays whole), the
    widest columns give up width first, and cells wrap at spaces. Where even that is too
    wide, each row prints as lines of `column: value` instead (`_as_records`). A word longer
    than the whole width folds onto the next line; nothing ends in "...".
    """

    def add_column(self, header: RenderableType = "", *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("overflow", "fold")
        super().add_column(header, *args, **kwargs)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = fitted_widths(self, options.max_width)
        if widths is None:
            yield _as_records(self)
            return
        saved = [column.width for column in self.columns]
        for column, width in zip(self.columns, widths, strict=True):
            column.width = width if width is not None else column.width
        try:
            yield from super().__rich_console__(console, options)
        finally:
            for column, width in zip(self.columns, saved, strict=True):
                column.width = width


def fitted_widths(table: Table, width: int) -> list[int | None] | None:
    """Content width per column so `table` fits in `width` with no word cut ([None, ...]:
    it fits as it is), or None when even each column's longest word does not fit."""
    columns = table.columns
    texts = [[_plain(column.header), *map(_plain, column.cells)] for column in columns]
    natural = [max(cell_len(line) for t in cells for line in t.split("\n")) for cells in texts]
    floor = [max((cell_len(w) for t in cells for w in t.split()), default=1) for cells in texts]
    room = width - _frame_width(table)
    if sum(natural) <= room:
        return [None] * len(columns)
    if sum(floor) > room:
        return None
    widths = list(natural)
    while sum(widths) > room:  # the widest column that may still shrink gives up one cell
        i = max((k for k in range(len(widths)) if widths[k] > floor[k]), key=lambda k: widths[k])
        widths[i] -= 1
    return list(widths)


def _frame_width(table: Table) -> int:
    """Cells a table's borders and padding take (as `rich.table.Table` lays them out)."""
    _, right, _, left = table.padding
    n = len(table.columns)
    padding = (left + right) * n - (0 if table.pad_edge else left + right)
    lines = (n - 1 + (2 if table.show_edge else 0)) if table.box else 0
    return padding + lines


def _plain(cell: RenderableType) -> str:
    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(cell).plain if isinstance(cell, str) else str(cell)


def _as_records(table: Table) -> Group:
    """Each row as its first cell, then `column: value` lines: a table too wide for the
    console even with every column at its longest word."""
    headers = [_plain(column.header) for column in table.columns]
    cells = [list(column.cells) for column in table.columns]
    lines: list[Text] = []
    if table.title:
        lines.append(Text(_plain(table.title), style="table.title", overflow="fold"))
    for row in zip(*cells, strict=True):
        first = _text(row[0])
        first.stylize("bold")
        lines.append(first)
        for header, cell in zip(headers[1:], row[1:], strict=True):
            value = _text(cell)
            if value.plain.strip() in ("", "-"):
                continue
            value = Text("; ").join(value.split("\n"))
            lines.append(Text.assemble(f"  {header}: " if header else "  ", value))
    for line in lines:
        line.overflow = "fold"
    return Group(*lines)


def _text(cell: RenderableType) -> Text:
    if isinstance(cell, Text):
        return cell.copy()
    return Text.from_markup(cell) if isinstance(cell, str) else Text(str(cell))


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
