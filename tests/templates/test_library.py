"""Library artifact: input hashes detect stale files and name the changed input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from solver.errors import CoralError, InputError, StaleLibraryError
from solver.io import digest
from solver.performance.default_model import load_perf_model
from solver.serving.library import (
    build_libraries,
    build_library,
    library_owner,
    load_library,
    save_library,
)
from solver.serving.pruning import prune_dominated
from solver.stack import load_stack

STACKS = Path(__file__).resolve().parents[2] / "stacks"
SIZES = (128, 1024, 4096, 16384)  # prefill tokens of a measured table


def test_library_round_trip_and_stale_detection(perf, tmp_path):
    fleet = load_stack(STACKS, "paper-core")
    lib = build_library(perf, fleet.library_scope(), "gpt-oss-20b", "prefill")
    assert lib.stats.kept == len(lib.templates) > 0
    assert lib.stats.enumerated >= lib.stats.feasible >= lib.stats.kept
    for t in lib.templates:
        assert sum(s.layers for s in t.stages) == perf.card("gpt-oss-20b").layers
        assert len({m.tp for s in t.stages for m in s.members}) == 1  # vLLM: one TP size
    save_library(lib, tmp_path)
    loaded = load_library(tmp_path, perf, fleet.library_scope(), "gpt-oss-20b", "prefill")
    assert loaded.model_dump() == lib.model_dump()  # wall time is not saved
    spec = fleet.models["gpt-oss-20b"]
    changed = fleet.model_copy(
        update={
            "models": fleet.models
            | {"gpt-oss-20b": spec.model_copy(update={"mean_prompt_tokens": 4000})}
        }
    )
    with pytest.raises(InputError, match="slo_and_workload"):
        load_library(tmp_path, perf, changed.library_scope(), "gpt-oss-20b", "prefill")


def test_dominated_templates_are_dropped(perf):
    fleet = load_stack(STACKS, "paper-core")
    lib = build_library(perf, fleet.library_scope(), "phi-4", "prefill")
    kept, dropped = prune_dominated(lib.templates)
    assert dropped == 0  # the saved library is already pruned
    best = {tuple(sorted(t.nodes)): t.throughput for t in lib.templates}
    for nodes, tput in best.items():
        for i in range(len(nodes)):
            sub = nodes[:i] + nodes[i + 1 :]
            assert best.get(sub, 0.0) < tput


def test_parallel_build_matches_serial_and_files_are_byte_identical(perf, tmp_path):
    """Same inputs, same files: worker count changes nothing, and no wall time is saved."""
    fleet = load_stack(STACKS, "paper-core")
    jobs = [("phi-4", "prefill"), ("gpt-oss-20b", "decode")]
    serial = build_libraries(perf, fleet.library_scope(), jobs, workers=1)
    parallel = build_libraries(perf, fleet.library_scope(), jobs, workers=2)
    assert [lib.model_dump() for lib in serial] == [lib.model_dump() for lib in parallel]
    a, b = tmp_path / "a", tmp_path / "b"
    for lib_s, lib_p in zip(serial, parallel, strict=True):
        assert save_library(lib_s, a).read_bytes() == save_library(lib_p, b).read_bytes()


def test_progress_reaches_every_job_total(perf):
    fleet = load_stack(STACKS, "paper-core")
    seen: dict[tuple[str, str], tuple[int, int]] = {}
    libs = build_libraries(
        perf,
        fleet.library_scope(),
        [("phi-4", "decode"), ("gpt-oss-20b", "prefill")],
        progress=lambda job, done, total: seen.__setitem__(job, (done, total)),
    )
    for lib in libs:
        assert seen[(lib.model, lib.phase)] == (lib.stats.enumerated, lib.stats.enumerated)


def test_ray_executor_without_ray_names_the_extra(perf, monkeypatch):
    """Without the ray extra, `--executor ray` says how to install it (ray hidden here)."""
    import importlib

    real = importlib.import_module

    def hide_ray(name, package=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named '{name}'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", hide_ray)
    fleet = load_stack(STACKS, "paper-core")
    with pytest.raises(InputError, match=r"\.\[ray\]"):
        build_libraries(perf, fleet.library_scope(), [("phi-4", "decode")], executor="ray")


@pytest.mark.slow
def test_ray_executor_matches_process_pool(perf):
    """`--executor ray` on a local Ray instance gives the process pool's libraries."""
    fleet = load_stack(STACKS, "paper-core")
    jobs = [("qwen3-32b", "prefill"), ("phi-4", "decode")]
    on_ray = build_libraries(perf, fleet.library_scope(), jobs, workers=2, executor="ray")
    local = build_libraries(perf, fleet.library_scope(), jobs, workers=2)
    assert [lib.model_dump() for lib in on_ray] == [lib.model_dump() for lib in local]


def _write_table(folder: Path, name: str, points: list[tuple[int, float]]) -> None:
    (folder / name).write_text("".join(f"{x},{ms:.6f}\n" for x, ms in points))


def test_remeasured_table_with_the_same_key_makes_the_library_stale(perf, tmp_path):
    """The hash covers a measured table's values, not only its (model, node, phase) key."""
    fleet = load_stack(STACKS, "paper-core")
    name = "gpt-oss-20b__l4x1__prefill.csv"
    points = [(x, perf.layer_time("gpt-oss-20b", "l4x1", "prefill", x, 1024).ms) for x in SIZES]
    measured, libs = tmp_path / "measured", tmp_path / "lib"
    measured.mkdir()
    _write_table(measured, name, points)
    timed = load_perf_model(measured)
    assert timed.layer_time("gpt-oss-20b", "l4x1", "prefill", 1024, 1024).source == "measured"
    save_library(build_library(timed, fleet.library_scope(), "gpt-oss-20b", "prefill"), libs)
    # Same table re-read: still fresh (the hash is deterministic).
    load_library(libs, load_perf_model(measured), fleet.library_scope(), "gpt-oss-20b", "prefill")
    # Re-measured: one value changes, the file name (the table's key) does not.
    _write_table(measured, name, [*points[:-1], (points[-1][0], points[-1][1] * 1.5)])
    with pytest.raises(CoralError, match="perf_model"):
        load_library(
            libs, load_perf_model(measured), fleet.library_scope(), "gpt-oss-20b", "prefill"
        )


def test_format_2_is_a_checked_header_then_columns_and_loads_what_was_saved(perf, tmp_path):
    fleet = load_stack(STACKS, "paper-core")
    lib = build_library(perf, fleet.library_scope(), "phi-4", "prefill")
    path = save_library(lib, tmp_path, stack="paper-core")
    head, body, end = path.read_bytes().split(b"\n")
    assert (
        end == b"" and json.loads(head)["format"] == 2 and json.loads(head)["stack"] == "paper-core"
    )
    assert json.loads(head)["templates"] == len(lib.templates)
    assert len(json.loads(body)["key"]) == len(lib.templates)
    loaded = load_library(tmp_path, perf, fleet.library_scope(), "phi-4", "prefill")
    assert loaded.model_dump() == lib.model_dump() and loaded.templates == lib.templates
    assert library_owner(tmp_path) == {
        "stack": "paper-core",
        "libraries": {lib.filename: digest(lib.input_hashes)},
    }


def test_a_corrupt_or_truncated_library_is_refused_as_missing_so_it_is_rebuilt(perf, tmp_path):
    fleet = load_stack(STACKS, "paper-core")
    path = save_library(build_library(perf, fleet.library_scope(), "phi-4", "decode"), tmp_path)
    text = path.read_bytes()
    path.write_bytes(text.replace(b'"throughput":[', b'"throughput":[1.5,', 1))
    with pytest.raises(InputError, match="corrupt library") as exc:
        load_library(tmp_path, perf, fleet.library_scope(), "phi-4", "decode")
    assert not isinstance(exc.value, StaleLibraryError)  # the planner rebuilds it
    path.write_bytes(text[: len(text) // 2])
    with pytest.raises(InputError, match="not a serving-template library|corrupt"):
        load_library(tmp_path, perf, fleet.library_scope(), "phi-4", "decode")


def test_a_format_1_file_is_converted_once_and_says_so(perf, tmp_path, caplog):
    fleet = load_stack(STACKS, "paper-core")
    lib = build_library(perf, fleet.library_scope(), "gpt-oss-20b", "decode")
    old = {**lib.model_dump(mode="json"), "format": 1}
    path = tmp_path / lib.filename
    path.write_text(json.dumps(old, separators=(",", ":")) + "\n")
    with caplog.at_level("WARNING", logger="coral.library"):
        loaded = load_library(tmp_path, perf, fleet.library_scope(), "gpt-oss-20b", "decode")
    assert loaded.model_dump() == lib.model_dump()
    assert "converted" in caplog.text and "format 1" in caplog.text
    assert json.loads(path.read_bytes().split(b"\n")[0])["format"] == 2
    stale = fleet.model_copy(update={"library": fleet.library.model_copy(update={"rho": 3})})
    path.write_text(json.dumps(old, separators=(",", ":")) + "\n")
    with pytest.raises(StaleLibraryError, match="rho"):  # rebuilt, not converted
        load_library(tmp_path, perf, stale.library_scope(), "gpt-oss-20b", "decode")


def test_node_configs_only_the_stack_prices_are_enumerated(perf):
    """paper-helix prices Helix's a100-40gbx1, l4x2 and t4x2 itself (AWS sells none): they are
    in its market, so the library must enumerate them. They used to be dropped as unsold, and
    Helix's four A100s never reached a template."""
    from solver.catalog.market import build_market
    from solver.serving.enumeration import available_node_configs

    fleet = load_stack(STACKS, "paper-helix")
    own = {p.node for p in fleet.prices}
    assert {"a100-40gbx1", "l4x2", "t4x2"} <= own
    sold, unsold = available_node_configs(fleet.market_scope(), perf.catalog)
    assert own <= set(sold) and unsold == []
    market = build_market(fleet.market_scope(), perf.catalog)
    assert {n for (_, n) in market.price} == set(sold)
    catalog_only = fleet.model_copy(update={"prices": []})
    _, unsold = available_node_configs(catalog_only.market_scope(), perf.catalog)
    assert set(unsold) == own


def test_without_mixing_every_template_has_one_gpu_type_and_costs_no_less():
    """`library.mixing: false` keeps the templates of one GPU type (l4x1 with l4x4 still
    combine); the plan on that restricted library never costs less than on the mixed one."""
    from solver.plan.demand import stack_demand
    from solver.plan.planner import plan_stack
    from solver.serving.library import build_libraries, input_hashes
    from tests.allocation_helpers import SMALL_FLEET, fleet, libraries
    from tests.allocation_helpers import perf as small_perf

    unmixed = fleet(library=SMALL_FLEET["library"] | {"mixing": False})
    built = build_libraries(
        small_perf(), unmixed.library_scope(), list(stack_demand(unmixed.models))
    )  # type: ignore[arg-type]
    libs = {(lib.model, lib.phase): lib for lib in built}
    catalog = small_perf().catalog
    gpus = [{catalog.node(n).gpu_id for n in t.nodes} for lib in built for t in lib.templates]
    assert gpus and all(len(g) == 1 for g in gpus)
    mixed = [t for lib in libraries().values() for t in lib.templates]
    assert any(len({catalog.node(n).gpu_id for n in t.nodes}) > 1 for t in mixed)
    assert any({"l4x1", "l4x4"} <= set(t.nodes) for lib in built for t in lib.templates)
    one_type = plan_stack("s", unmixed, catalog, libs)
    both = plan_stack("s", fleet(), catalog, libraries())
    assert one_type.served_fraction == both.served_fraction == 1
    assert one_type.hourly_cost_usd >= both.hourly_cost_usd - 1e-6
    # A library built with mixing is stale for a stack without it, and the other way round.
    model = next(iter(unmixed.models))
    hashes = [
        input_hashes(small_perf(), f.library_scope(), model, "decode") for f in (unmixed, fleet())
    ]
    assert hashes[0]["mixing"] and "mixing" not in hashes[1]


def test_an_interrupted_build_resumes_from_the_libraries_it_finished(perf, tmp_path, monkeypatch):
    """Stopped while the second job builds, the first job's library is on disk, and the next
    run builds only the second."""
    from solver.plan import planner

    fleet = load_stack(STACKS, "paper-core")
    jobs = [("phi-4", "decode"), ("gpt-oss-20b", "prefill")]

    def stop_at_second(job, done, total):
        if job == jobs[1]:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        planner.libraries_for(perf, fleet, jobs, tmp_path, workers=1, progress=stop_at_second)
    assert load_library(tmp_path, perf, fleet.library_scope(), *jobs[0]).templates
    with pytest.raises(InputError):
        load_library(tmp_path, perf, fleet.library_scope(), *jobs[1])

    built: list[tuple[str, str]] = []
    real = planner.build_libraries
    monkeypatch.setattr(
        planner,
        "build_libraries",
        lambda perf_, scope_, todo, *a, **k: (
            built.extend(todo) or real(perf_, scope_, todo, *a, **k)
        ),
    )
    libs = planner.libraries_for(perf, fleet, jobs, tmp_path, workers=1)
    assert built == [jobs[1]]
    assert set(libs) == set(jobs)
