"""Reading and writing files for every stage, with errors that name the file and the field.

`read_yaml` / `parse_yaml` (alias bombs refused before they expand), `load_yaml_model` and
`parse_model` (a pydantic model with key-path errors and number bounds), `read_text`,
`read_two_column_csv` (measured tables), `data_path` (the shipped `solver/data/`), `digest`,
and `write_atomic` / `check_replaceable` (a file is replaced whole, never a read-only one).
Most of `solver/` reads its YAML and text through here. Formats of their own are read where
they are defined: library files (`templates/library.py`, the format in `library_format.py`),
the capacity cache (`plan/attainment.py`), trace CSVs (`simulation/traces.py`), and Vidur's and
Helix's measurement files (`performance/vidur.py`, `kernel_fit.py`, `operator_tables.py`,
`calibration.py`); the profiler writes its own tables (`performance/profiler/`). Nothing reads
a file at import time.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import json
import math
import os
import stat
import tempfile
from importlib import resources
from pathlib import Path
from types import UnionType
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from solver.errors import InputError

M = TypeVar("M", bound=BaseModel)
# libyaml's parser when PyYAML was built with it (same results, ~10x faster on the catalog).
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def data_path(name: str) -> Path:
    """Path of a data file shipped in `solver/data/`."""
    return Path(str(resources.files("solver") / "data" / name))


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents.

    Raises:
        InputError: the file cannot be read, or is not UTF-8 (the message names the byte
            offset, never the file's contents).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(str(path), f"cannot read file ({exc.strerror})", "check the path") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            str(path),
            f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
            "save the file as UTF-8",
        ) from exc


def read_yaml(path: Path) -> Any:
    """Parse a YAML file; a missing file, bad syntax, bad encoding or a key given twice in one
    mapping is an InputError naming the file (and the key path)."""
    return parse_yaml(read_text(path), str(path))


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text, rejecting a mapping that names one key twice (YAML's last-wins rule
    would silently drop the first value) and aliases that expand without bound.

    Raises:
        InputError: bad syntax, a duplicate key (named by its key path and line), aliases that
            expand to more than `MAX_ALIAS_NODES` nodes or nest deeper than `MAX_YAML_DEPTH`,
            or an alias inside its own anchor.
    """
    loader = _LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        checked = _NodeCheck(source)
        checked.walk(node, "", 0)
        try:
            return loader.construct_document(node)
        except (ValueError, TypeError, OverflowError) as exc:  # e.g. a date that does not exist
            raise checked.unreadable() from exc
    except yaml.YAMLError as exc:
        raise InputError(source, f"not valid YAML: {_yaml_problem(exc)}", "fix the syntax") from exc
    finally:
        loader.dispose()


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's problem and position, without the snippet of the file it quotes (a file read by
    mistake, e.g. a key, must not reach a CI log)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"{exc.problem or exc.context or 'syntax error'}{where}"
    return type(exc).__name__


# An alias repeats its anchor's whole subtree, so anchors made of aliases of anchors grow
# exponentially ("billion laughs": 9 aliases over 9 levels are 400 million nodes in 1 KB). A
# stack or data file uses a few aliases of a few nodes each; these bounds are far above that,
# and are checked on the composed nodes, before anything is expanded.
MAX_ALIAS_NODES = 50_000  # nodes the file's aliases add when expanded
MAX_YAML_DEPTH = 100  # nesting of the expanded document (a stack nests about 6 deep)
_ALIAS_FIX = "write the repeated values out, or use fewer aliases of anchors that hold aliases"


class _NodeCheck:
    """One pass over a composed YAML document, visiting each node once: a mapping with one key
    twice, and what the aliases would expand to (each node's expanded size and height are
    memoized, so an alias costs O(1) however large its anchor)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.size: dict[int, int] = {}  # id(node) -> nodes once expanded
        self.height: dict[int, int] = {}  # id(node) -> levels below it once expanded
        self.open: set[int] = set()  # nodes being walked (an alias to one is a cycle)
        self.alias_nodes = 0  # nodes the aliases add so far
        self.scalars: list[tuple[str, yaml.ScalarNode]] = []  # (path, node), each node once

    def walk(self, node: yaml.Node, path: str, depth: int) -> int:
        """Check `node` at `path` (`depth` levels down); returns its expanded size."""
        key = id(node)
        if key in self.open:
            raise InputError(
                self._where(path),
                "an alias refers to the node that contains it (the document would be infinite)",
                "remove the alias, or point it at an anchor outside this node",
            )
        if key in self.size:  # reached again: an alias, repeating the whole subtree
            self.alias_nodes += self.size[key]
            self._check_bounds(path, depth + self.height[key])
            return self.size[key]
        self._check_bounds(path, depth)
        self.open.add(key)
        children = list(self._children(node, path))
        size = 1 + sum(self.walk(child, where, depth + 1) for where, child in children)
        self.open.discard(key)
        self.size[key] = size
        self.height[key] = 1 + max((self.height[id(c)] for _, c in children), default=-1)
        return size

    def _children(self, node: yaml.Node, path: str) -> list[tuple[str, yaml.Node]]:
        if isinstance(node, yaml.ScalarNode):
            self.scalars.append((path, node))
        if isinstance(node, yaml.SequenceNode):
            return [(f"{path}[{i}]", item) for i, item in enumerate(node.value)]
        if not isinstance(node, yaml.MappingNode):
            return []
        seen: dict[str, int] = {}
        out: list[tuple[str, yaml.Node]] = []
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "<complex key>"
            where = f"{path}.{key}" if path else key
            line = key_node.start_mark.line + 1
            if key in seen and key != "<<":
                raise InputError(
                    self._where(where),
                    f"key '{key}' given twice in one mapping (lines {seen[key]} and {line})",
                    "keep one of the two: YAML would silently use only the last",
                )
            seen[key] = line
            out += [(where, key_node), (where, value_node)]
        return out

    def unreadable(self) -> InputError:
        """The error for the first scalar PyYAML cannot construct (`!!int abc`, a date that does
        not exist, an integer of more than 4300 digits), named by its path and line."""
        constructor = yaml.constructor.SafeConstructor()
        for path, node in self.scalars:
            try:
                constructor.construct_object(node)
            except (ValueError, TypeError, OverflowError, yaml.YAMLError) as exc:
                kind = node.tag.rsplit(":", 1)[-1]
                reason = "more than 4300 digits" if "integer string" in str(exc) else str(exc)
                return InputError(
                    f"{self._where(path)} (line {node.start_mark.line + 1})",
                    f"{node.value!r:.40} is not a valid {kind} ({reason[:100]})",
                    "correct the value, or quote it to keep it as text",
                )
        return InputError(self.source, "a value YAML cannot read", "correct the value")

    def _where(self, path: str) -> str:
        short = path if len(path) <= 80 else f"{path[:77]}..."  # deep paths repeat [0][0]...
        return f"{self.source}: {short or '<root>'}"

    def _check_bounds(self, path: str, depth: int) -> None:
        if self.alias_nodes > MAX_ALIAS_NODES:
            raise InputError(
                self._where(path),
                f"aliases expand to more than {MAX_ALIAS_NODES:,} nodes (anchors that repeat "
                "anchors grow exponentially); refused before expanding them",
                _ALIAS_FIX,
            )
        if depth > MAX_YAML_DEPTH:
            raise InputError(
                self._where(path),
                f"nested more than {MAX_YAML_DEPTH} levels deep (aliases included)",
                _ALIAS_FIX if self.alias_nodes else "flatten the nesting",
            )


def validation_error(
    source: str, exc: ValidationError, cls: type[BaseModel] | None = None
) -> InputError:
    """Turn pydantic's error into one InputError naming the first bad field by its path.

    An unknown key (most often a typo) is reported first, with the closest keys `cls` allows
    there. The bad value is quoted only when it is a short scalar: a whole mapping, or a file's
    contents read as one string, never reaches the message.
    """
    errors = exc.errors()
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    first = extra[0] if extra else errors[0]
    loc = key_path(first["loc"]) or "<root>"
    more = f"; and {len(errors) - 1} more error(s)" if len(errors) > 1 else ""
    if extra:
        key = str(first["loc"][-1])
        known = _keys_at(cls, first["loc"][:-1]) if cls else []
        return InputError(
            f"{source}: {loc}",
            f"unknown key '{key}'{more}",
            f"use one of: {', '.join(known)}" if known else "remove it, or fix its spelling",
            difflib.get_close_matches(key, known, n=3, cutoff=0.6),
        )
    value = first.get("input")
    # A missing key's or a whole mapping's rule's input is the mapping: quoting adds nothing.
    whole = first["type"] == "missing" or (
        first["type"] == "value_error" and isinstance(value, dict)
    )
    quoted = "" if whole else _quoted_input(value, bool(loc))
    field = _field_at(cls, first["loc"]) if cls else None
    fix = "add this key" if first["type"] == "missing" else "correct this field in the file"
    if field is not None and field.description:
        fix += f"; {first['loc'][-1]}: {field.description.rstrip('.')}"
    return InputError(f"{source}: {loc}", f"{first['msg']}{quoted}{more}", fix)


def key_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a key path: `("regions", 0, "region")` -> `regions[0].region`."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _keys_at(cls: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys the model at `loc` inside `cls` allows (its fields), or [] if none is there."""
    found = _annotation_at(cls, loc)
    annotation = _model_or_container(found[0]) if found else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return sorted(f.alias or name for name, f in annotation.model_fields.items())
    return []


def _field_at(cls: type[BaseModel], loc: tuple[int | str, ...]) -> FieldInfo | None:
    """The field of `cls` at `loc` (None when `loc` ends in a list item or leaves the model)."""
    found = _annotation_at(cls, loc)
    return found[1] if found else None


def _annotation_at(
    cls: type[BaseModel], loc: tuple[int | str, ...]
) -> tuple[Any, FieldInfo | None] | None:
    """The annotation at `loc` inside `cls`, and the field that declares it (None for an item
    of a list or dict); None if `loc` leaves the model."""
    annotation: Any = cls
    field: FieldInfo | None = None
    for part in loc:
        annotation = _model_or_container(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation = field.annotation
        elif get_origin(annotation) in (list, tuple, dict) and get_args(annotation):
            annotation, field = get_args(annotation)[-1], None
        else:
            return None
    return annotation, field


def _model_or_container(annotation: Any) -> Any:
    """`X | None` -> X; a union of a model and others -> the model."""
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if models else (args[0] if len(args) == 1 else annotation)
    return annotation


def _quoted_input(value: Any, nested: bool) -> str:
    if isinstance(value, dict | list | tuple):
        return f" (got a {type(value).__name__})"
    if isinstance(value, int) and value.bit_length() > 128:  # str() refuses > 4300 digits
        return f" (got an integer of {value.bit_length()} bits)"
    text = repr(value)
    if not nested or len(text) > 40 or "\n" in str(value):
        return f" (got a {type(value).__name__} of {len(str(value))} characters)"
    return f" (got {text})"


def parse_model(cls: type[M], data: Any, source: str) -> M:
    """Validate `data` into `cls`, reporting errors with the field path inside `source`.

    Stricter than pydantic's lax mode where lax mode loses meaning: a boolean where a number is
    expected (YAML reads `yes` as true, which would become 1.0) and a non-finite number
    (`.inf`, `.nan`, "inf") are errors naming the field.
    """
    if data is None:
        raise InputError(source, "is empty", f"give it {expected_keys(cls)}")
    check_numbers(cls, data, source)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(source, exc, cls) from exc


def check_numbers(cls: type[BaseModel], data: Any, source: str) -> None:
    """Reject booleans and non-finite values given for a number field of `cls`, recursively.

    Raises:
        InputError: naming the field's path, the value and the fix.
    """
    if not isinstance(data, dict):
        return
    for name, field in cls.model_fields.items():
        key = field.alias or name
        if key in data:
            _check_value(field.annotation, data[key], key, source)


def _check_value(annotation: Any, value: Any, where: str, source: str) -> None:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, UnionType):
        text_too = str in args or bool in args  # "inf" or true may be meant as text or a flag
        for arg in args:
            if not (text_too and arg in (float, int)):
                _check_value(arg, value, where, source)
    elif annotation in (float, int):
        _check_number(value, where, source)
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if isinstance(value, dict):
            for name, field in annotation.model_fields.items():
                key = field.alias or name
                if key in value:
                    _check_value(field.annotation, value[key], f"{where}.{key}", source)
    elif origin in (list, tuple) and isinstance(value, list) and args:
        for i, item in enumerate(value):
            _check_value(args[0], item, f"{where}[{i}]", source)
    elif origin is dict and isinstance(value, dict) and len(args) == 2:
        for k, item in value.items():
            _check_value(args[1], item, f"{where}.{k}", source)


def _check_number(value: Any, where: str, source: str) -> None:
    if isinstance(value, bool):
        raise InputError(
            f"{source}: {where}",
            f"expected a number, got the boolean {str(value).lower()} (YAML reads yes/no/on/off "
            "as booleans)",
            "write a number, e.g. 100",
        )
    try:
        number = float(value) if isinstance(value, int | float | str) else 0.0
    except (ValueError, OverflowError):
        return  # not a number at all: pydantic names it
    if not math.isfinite(number):
        raise InputError(
            f"{source}: {where}",
            f"must be a finite number{_quoted_input(value, nested=True)}",
            "write a finite number (no .inf or .nan)",
        )


def expected_keys(cls: type[BaseModel]) -> str:
    """What a mapping for `cls` holds, in words: `a mapping with the keys a, b (optional: c)`."""
    fields = cls.model_fields.items()
    required = [f.alias or name for name, f in fields if f.is_required()]
    optional = [f.alias or name for name, f in fields if not f.is_required()]
    text = "a mapping with the keys " + ", ".join(required) if required else "a mapping"
    return text + (f" (optional: {', '.join(optional)})" if optional else "")


def load_yaml_model(cls: type[M], path: Path) -> M:
    """Load a YAML file into a pydantic model.

    Raises:
        InputError: as `read_yaml` and `parse_model`; an empty file (or one of only comments)
            says so, with the keys it must hold.
    """
    data = read_yaml(path)
    if data is None:
        raise InputError(
            str(path),
            "the file is empty (no YAML, or only comments)",
            f"write {expected_keys(cls)}",
        )
    return parse_model(cls, data, str(path))


def read_two_column_csv(path: Path) -> list[tuple[float, float]]:
    """Read a header-less two-column numeric CSV (x, ms); rows must be numbers.

    Raises:
        InputError: naming the file and line of a malformed row.
    """
    rows: list[tuple[float, float]] = []
    for line_no, row in enumerate(csv.reader(read_text(path).splitlines()), start=1):
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


def check_replaceable(path: Path) -> None:
    """Refuse an output file coral must not write: a folder, a file in a folder it cannot
    write, or a read-only file. A file with no write bit for anyone (chmod 444) is refused
    even where the user could replace it (root, or the folder's owner): coral never swaps a
    file marked read-only for a new one.

    Raises:
        InputError: naming the path, what is wrong and what to do.
    """
    if path.is_dir():
        raise InputError(str(path), "is a folder", "give a file path, e.g. plan.json")
    folder = path.parent if str(path.parent) else Path(".")
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(str(path), f"its folder {folder} is not writable", "give another path")
    if not path.exists():
        return
    mode = path.stat().st_mode
    if not os.access(path, os.W_OK) or not mode & 0o222:
        raise InputError(
            str(path),
            f"is read-only ({stat.filemode(mode)}): coral does not replace it",
            f"make it writable (chmod u+w {path}), or give another path",
        )


def write_atomic(path: Path, content: str | bytes) -> None:
    """Write a file all at once: to a temporary file beside it, then renamed over it.

    A reader (or a crash, or Ctrl-C) sees the old file or the new one, never half of one; the
    old file is untouched when writing fails, and a replaced file keeps its mode. Missing parent
    folders are created.

    Raises:
        InputError: the file or its folder cannot be written (`check_replaceable`: a folder, a
            read-only file).
    """
    data = content.encode("utf-8") if isinstance(content, str) else content
    check_replaceable(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise InputError(
            str(path), f"cannot write here ({exc.strerror})", "choose a writable path"
        ) from exc
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # A file replaced keeps its mode (a plan kept 0600 stays so); a new one gets the umask's.
        mode = path.stat().st_mode & 0o7777 if path.is_file() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise InputError(
                str(path), f"cannot write here ({exc.strerror})", "choose a writable path"
            ) from exc
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
