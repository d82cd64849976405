"""Tensor parallelism inside one node: the layer split over N local ranks with torch.distributed.

Each rank is a process (NCCL on GPUs, one GPU per rank; gloo on the CPU). Every rank builds the
same full-layer weights from the seed and keeps its shard (`shard_weights`), draws the same random
inputs from the same seeded generator, and runs the layer; the attention and MLP outputs are
all-reduced. Rank 0's timings (which include waiting for the all-reduces) are the table. Ranks
must run the same calls, so the per-model time budget does not apply under TP.
"""

from __future__ import annotations

import json
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from solver.catalog.model_cards import ModelCard
from solver.errors import InputError
from solver.performance.profiler.device import pick_device, pick_dtype
from solver.performance.profiler.layer import (
    DecoderLayer,
    LayerShape,
    random_weights,
    shard_weights,
)
from solver.performance.profiler.measure import Grid, MeasureSpec, layer_ms, make_record, run_grid
from solver.performance.profiler.record import MeasurementRecord, PointRecord


def check_tp(card: ModelCard, tp: int, device: torch.device) -> None:
    """Raise InputError unless this node can run the card's layer `tp` ways."""
    try:
        LayerShape.from_card(card).check_tp(tp)
    except ValueError as exc:
        raise InputError("--tp", str(exc), "pick a TP degree vLLM accepts for this model") from exc
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        raise InputError(
            "--tp",
            f"{tp} GPUs asked for, {torch.cuda.device_count()} visible",
            "lower --tp or run on a node with more GPUs",
        )


def measure_tp(
    card: ModelCard, spec: MeasureSpec, progress: Callable[[str], None] = lambda _: None
) -> MeasurementRecord:
    """Measure one (model, phase) with the layer split `spec.tp` ways over local ranks."""
    device = pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device)
    check_tp(card, spec.tp, device)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rank0.json"
        args = (card, spec, _free_port(), str(result))
        spawn(_measure_rank, args, nprocs=spec.tp)  # type: ignore[no-untyped-call]
        data = json.loads(result.read_text(encoding="utf-8"))
    grid = Grid([PointRecord(**p) for p in data["points"]], data["notes"])
    for p in grid.points:
        progress(f"{p.x}: {p.ms_per_layer:.4f} ms")
    backend = "nccl" if device.type == "cuda" else "gloo"
    method = f"torch layer, TP {spec.tp} over local ranks ({backend}): rank 0's median of repeats"
    return make_record(card, spec, device, dtype, grid, method)


def tp_forward(
    card: ModelCard, tp: int, x: torch.Tensor, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """The prefill output of the layer run `tp` ways on the CPU (gloo): for equivalence checks."""
    check_tp(card, tp, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "out.pt"
        args = (card, tp, x, seed, dtype, _free_port(), str(result))
        spawn(_forward_rank, args, nprocs=tp)  # type: ignore[no-untyped-call]
        out: torch.Tensor = torch.load(result)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _shard_layer(
    rank: int, tp: int, card: ModelCard, device: torch.device, dtype: torch.dtype, seed: int
) -> DecoderLayer:
    shape = LayerShape.from_card(card)
    shard, weights = shard_weights(shape, random_weights(shape, device, dtype, seed), rank, tp)
    return DecoderLayer(shard, weights, group=dist.group.WORLD)


def _init(rank: int, tp: int, cuda: bool, port: int) -> torch.device:
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=tp,
    )
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def _measure_rank(rank: int, card: ModelCard, spec: MeasureSpec, port: int, result: str) -> None:
    cuda = pick_device(spec.device).type == "cuda"
    device = _init(rank, spec.tp, cuda, port)
    try:
        layer = _shard_layer(rank, spec.tp, card, device, pick_dtype(spec.dtype, device), spec.seed)
        gen = torch.Generator(device=device).manual_seed(spec.seed + 1)
        grid = run_grid(
            lambda n: layer_ms(layer, card, spec, n, gen, dist.barrier), spec.sizes, None
        )
        if rank == 0:
            points = [p.model_dump() for p in grid.points]
            Path(result).write_text(json.dumps({"points": points, "notes": grid.notes}), "utf-8")
    finally:
        dist.destroy_process_group()


def _forward_rank(
    rank: int,
    card: ModelCard,
    tp: int,
    x: torch.Tensor,
    seed: int,
    dtype: torch.dtype,
    port: int,
    result: str,
) -> None:
    device = _init(rank, tp, False, port)
    try:
        layer = _shard_layer(rank, tp, card, device, dtype, seed)
        with torch.inference_mode():
            out = layer(x)
        if rank == 0:
            torch.save(out, result)
    finally:
        dist.destroy_process_group()
