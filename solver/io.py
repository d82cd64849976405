"""The only module in `solver/` that reads files: YAML and CSV loaders with field-naming errors."""

from __future__ import annotations

import csv
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from solver.errors import InputError

M = TypeVar("M", bound=BaseModel)


def data_path(name: str) -> Path:
    """Path of a data file shipped in `solver/data/`."""
    return Path(str(resources.files("solver") / "data" / name))


def read_yaml(path: Path) -> Any:
    """Parse a YAML file; a missing file or bad syntax is an InputError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(str(path), f"cannot read file ({exc.strerror})", "check the path") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(str(path), f"not valid YAML: {exc}", "fix the syntax") from exc


def validation_error(source: str, exc: ValidationError) -> InputError:
    """Turn pydantic's error into one InputError naming the first bad field by its path."""
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first["loc"]) or "<root>"
    more = len(exc.errors()) - 1
    problem = f"{first['msg']} (got {first.get('input')!r})"
    if more:
        problem += f"; and {more} more error(s)"
    return InputError(f"{source}: {loc}", problem, "correct this field in the file")


def parse_model(cls: type[M], data: Any, source: str) -> M:
    """Validate `data` into `cls`, reporting errors with the field path inside `source`."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(source, exc) from exc


def load_yaml_model(cls: type[M], path: Path) -> M:
    """Load a YAML file into a pydantic model."""
    return parse_model(cls, read_yaml(path), str(path))


def read_two_column_csv(path: Path) -> list[tuple[float, float]]:
    """Read a header-less two-column numeric CSV (x, ms); rows must be numbers.

    Raises:
        InputError: naming the file and line of a malformed row.
    """
    rows: list[tuple[float, float]] = []
    try:
        handle = path.open(encoding="utf-8", newline="")
    except OSError as exc:
        raise InputError(str(path), f"cannot read file ({exc.strerror})", "check the path") from exc
    with handle:
        for line_no, row in enumerate(csv.reader(handle), start=1):
            if not row or not "".join(row).strip():
                continue
            if len(row) != 2:
                raise InputError(
                    f"{path}:{line_no}",
                    f"expected 2 columns (x, ms_per_layer), got {len(row)}: {row}",
                    "write one 'x,ms' pair per line, no header",
                )
            try:
                rows.append((float(row[0]), float(row[1])))
            except ValueError as exc:
                raise InputError(
                    f"{path}:{line_no}",
                    f"not a number: {row}",
                    "write one 'x,ms' pair per line, no header",
                ) from exc
    return rows


def digest(obj: Any) -> str:
    """A short stable hash of a JSON-able value (keys sorted): names an input in hashes."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
