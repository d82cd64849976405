"""Measured per-layer timing tables that replace the analytical model where they exist.

Format (same as the Helix calibration files): one header-less CSV per (model, node config, phase),
two columns: x (prefill: prompt tokens in the batch; decode: batch size in sequences) and
milliseconds per layer. Files are named `<model>__<node>__<phase>.csv`, e.g.
`llama2-70b__l4x1__decode.csv`. A decode table holds the context its benchmark used; lookups
interpolate linearly between points and refuse sizes outside the measured range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from solver.catalog.offers import split_node_id
from solver.errors import InputError
from solver.io import read_two_column_csv

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class MeasuredTable:
    """Points (x, ms per layer), x strictly increasing, x > 0."""

    x: tuple[float, ...]
    ms: tuple[float, ...]
    source: str

    @classmethod
    def from_points(cls, points: list[tuple[float, float]], source: str) -> MeasuredTable:
        pts = sorted((x, ms) for x, ms in points if x > 0)
        if len(pts) < 2:
            raise InputError(source, "needs at least 2 rows with x > 0", "measure more sizes")
        xs = [p[0] for p in pts]
        if len(set(xs)) != len(xs):
            raise InputError(source, "repeated x values", "keep one row per batch size")
        if any(ms <= 0 for _, ms in pts):
            raise InputError(source, "a time is <= 0 ms", "check the measurement")
        return cls(tuple(xs), tuple(p[1] for p in pts), source)

    @property
    def max_x(self) -> float:
        return self.x[-1]

    def ms_at(self, size: float) -> float | None:
        """Interpolated ms per layer, or None when `size` is outside the measured range.

        Below the first point the first point's time is used: conservative, since a smaller
        batch is never slower than a larger one.
        """
        if size > self.max_x:
            return None
        return float(np.interp(size, self.x, self.ms))


@dataclass
class MeasuredTables:
    """All measured tables, keyed by (model, node config, phase)."""

    tables: dict[tuple[str, str, str], MeasuredTable] = field(default_factory=dict)

    def get(self, model: str, node: str, phase: str) -> MeasuredTable | None:
        return self.tables.get((model, node, phase))

    def __len__(self) -> int:
        return len(self.tables)


def parse_table_name(path: Path) -> tuple[str, str, str]:
    parts = path.stem.split("__")
    if len(parts) != 3 or parts[2] not in PHASES:
        raise InputError(
            str(path),
            "file name is not <model>__<node>__<phase>.csv",
            "rename it, e.g. llama2-70b__l4x1__decode.csv (phase: prefill or decode)",
        )
    split_node_id(parts[1])
    return parts[0], parts[1], parts[2]


def load_measured_dir(directory: Path) -> MeasuredTables:
    """Load every `*.csv` in `directory` as a measured table."""
    if not directory.is_dir():
        raise InputError(str(directory), "not a directory", "pass the folder of measured CSVs")
    out = MeasuredTables()
    for path in sorted(directory.glob("*.csv")):
        key = parse_table_name(path)
        out.tables[key] = MeasuredTable.from_points(read_two_column_csv(path), str(path))
    return out
