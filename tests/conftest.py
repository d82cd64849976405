"""Shared fixtures: the shipped data, loaded once per session."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from typer.testing import CliRunner

from coral_iac.preview import PreviewResult, preview_stack
from coral_iac.program import ProgramOptions, utc_now
from solver.performance.calibration import CalibrationFile, helix_data_dir, load_helix_dir
from solver.performance.default_model import load_perf_model
from solver.performance.perf_model import PerfModel
from solver.plan_schema import Plan

REPO = Path(__file__).resolve().parents[1]
HELIX_DIR = helix_data_dir()  # vendored: the repo reads nothing outside itself
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def committed_stacks() -> list[str]:
    """Every committed stack's name (stacks/Pulumi.<name>.yaml), sorted."""
    return sorted(
        p.name[len("Pulumi.") : -len(".yaml")] for p in (REPO / "stacks").glob("Pulumi.*.yaml")
    )


def _inputs_digest() -> str:
    """A digest of everything a committed stack's libraries are built from: the solver's code and
    data and the stack files. A change to any of them starts a new cache folder, so a cached
    library is never one an older checkout built (its own input hashes are checked as well)."""
    h = hashlib.sha256()
    for folder in ("solver", "stacks"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def suite_cache_root() -> Path:
    """Where the suite keeps what it builds once for every run (the committed stacks' template
    libraries and capacity factors): CORAL_TEST_CACHE, else the user's cache folder, per
    input digest. Nothing here is an input to a test's verdict: a library is checked against
    its inputs on every load, and a missing one is built."""
    base = os.environ.get("CORAL_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "coral-iac", "tests"
    )
    return Path(base) / _inputs_digest()




def committed_library(stack: str) -> Path:
    """The template-library folder of committed stack `stack`, built and planned once (the
    capacity factors are cached beside it) and shared by every test, worker and run with the
    same inputs. Tests that build, rebuild or break a library use their own folder instead.

    Built under a file lock, so parallel workers wait for one build instead of each building.
    """
    folder = suite_cache_root() / "library" / stack
    folder.parent.mkdir(parents=True, exist_ok=True)
    ready = folder / ".warm"
    with FileLock(str(folder) + ".lock"):
        if not ready.exists():
            from coral_iac.cli.app import app  # deferred: the CLI imports the whole program

            out = folder.parent / f"{stack}.plan.json"
            cwd = Path.cwd()
            os.chdir(REPO)
            try:  # the plan's exit code is the plan tests' business: here it warms the cache
                CliRunner().invoke(
                    app, ["plan", "--stack", stack, "--library", str(folder), "--out", str(out)]
                )
            finally:
                os.chdir(cwd)
            if not any(folder.glob("*.json")):
                raise RuntimeError(f"coral plan --stack {stack} built no library in {folder}")
            ready.touch()
    return folder


@pytest.fixture(scope="session")
def perf() -> PerfModel:
    return load_perf_model()


@pytest.fixture(scope="session")
def helix_files() -> list[CalibrationFile]:
    return load_helix_dir(HELIX_DIR)


@pytest.fixture
def preview(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., PreviewResult]:
    """`preview_stack` with one library cache for the whole session, outside the repository;
    `now` fakes the clock (consecutive deploys), `rebuild_stale` rebuilds a stale library,
    `health_report` is what the gateway last published."""
    library_root = tmp_path_factory.getbasetemp() / "library"

    def run(
        stack: str,
        stacks_dir: Path,
        previous: Plan | None = None,
        previous_outputs: dict[str, Any] | None = None,
        now: datetime | None = None,
        rebuild_stale: bool = False,
        not_offered: set[tuple[str, str]] | None = None,
        health_report: str | None = None,
    ) -> PreviewResult:
        clock = (lambda: now) if now is not None else utc_now
        options = ProgramOptions(stacks_dir, library_root, None, rebuild_stale, clock)
        return preview_stack(
            stack, options, previous, previous_outputs, not_offered, health_report
        )

    return run
