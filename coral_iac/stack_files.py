"""Edit a stack file in place the way a person would: one key of `coral:fleet` changed, every
comment, order and layout of the rest kept (ruamel.yaml's round trip)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from solver.errors import InputError
from solver.io import read_text

FLEET = "coral:fleet"


# Block sequences under a key: indented by two (`  - x`, as the hand-written stacks are) or not
# (`- x`, as PyYAML writes).
LAYOUTS = ((2, 4, 2), (2, 2, 0))


def _load(text: str) -> tuple[YAML, Any]:
    """A round-trip YAML (comments, key order, flow mappings and quotes kept) in the file's own
    layout (of `LAYOUTS`, the one that writes back the most of its lines unchanged: a flow list
    the author wrapped by hand comes back on one line), and the loaded document."""
    lines = set(text.splitlines())
    best: tuple[int, YAML, Any] | None = None
    for mapping, sequence, offset in LAYOUTS:
        yaml = YAML()
        yaml.preserve_quotes = True
        yaml.width = 4096  # never re-wrap a long line the author wrote
        yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
        doc = yaml.load(text)
        out = io.StringIO()
        yaml.dump(doc, out)
        kept = len(lines & set(out.getvalue().splitlines()))
        if best is None or kept > best[0]:
            best = (kept, yaml, doc)
    assert best is not None
    return best[1], best[2]


def with_fleet_key(path: Path, key: str, value: Any) -> str:
    """The text of the stack file at `path` with `coral:fleet.<key>` set to `value` (plain
    dicts, lists and scalars), the rest as it was.

    Raises:
        InputError: the file has no `config: coral:fleet:` mapping.
    """
    yaml, doc = _load(read_text(path))
    fleet: Any = doc.get("config", {}).get(FLEET) if hasattr(doc, "get") else None
    if not hasattr(fleet, "get"):
        raise InputError(str(path), f"has no config: {FLEET}: mapping to write {key} into",
                         "write the stack's coral:fleet section first")  # fmt: skip
    fleet[key] = value
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue()


def round_trip(path: Path) -> str:
    """The stack file as this module writes it back unchanged (a test holds it to the file)."""
    yaml, doc = _load(read_text(path))
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue()
