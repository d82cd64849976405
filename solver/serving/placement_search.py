"""Throughput-optimal placement of one model over one node multiset (paper Sec. 4.2).

Input: for each pipeline-stage count S, a table `tables[S][k, j-1]` = T̂_j of node (or GPU
process) k holding j layers under the per-stage budget SLO/S. Nodes sharing a stage split its load
(data parallelism), so a stage's throughput is the sum of its members' T̂ at its layer count.

Two exact methods that must agree (a property test checks it):

- `place_fast`: for a set partition P of the nodes into S stages, a group G with T̂ non-increasing
  in j can hold J(G, T) = #{j : g(G, j) >= T} layers at throughput T, where g(G, j) is the group's
  summed T̂. P reaches T iff sum_G J(G, T) >= L and every J >= 1, so the best T of P is
  min(L-th largest value of the union of g(G, .) over G in P, min_G g(G, 1)). Computed for every
  partition at once with numpy; identical nodes are deduplicated so symmetric partitions are
  evaluated once.
- `solver.oracles.placement_ilp.place_ilp`: the paper's ILP per S, kept apart as a test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

Tables = dict[int, np.ndarray]  # S -> array (n nodes, L layers)


@dataclass(frozen=True)
class Placement:
    """Stages as tuples of node indices, layers per stage, and the throughput reached."""

    throughput: float
    stages: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]


@cache
def set_partitions(labels: tuple[int, ...]) -> dict[int, np.ndarray]:
    """Set partitions of positions 0..n-1, deduplicated for positions with equal labels.

    Returns S -> int array (partitions, S) of block bitmasks. Equal labels mean identical nodes,
    so two partitions that map onto each other by swapping identical nodes are kept once.
    """
    n = len(labels)
    seen: set[tuple[tuple[int, ...], ...]] = set()
    out: dict[int, list[list[int]]] = {}

    def rec(i: int, blocks: list[list[int]]) -> None:
        if i == n:
            canon = tuple(sorted(tuple(sorted(labels[p] for p in b)) for b in blocks))
            if canon not in seen:
                seen.add(canon)
                out.setdefault(len(blocks), []).append([sum(1 << p for p in b) for b in blocks])
            return
        for b in blocks:
            b.append(i)
            rec(i + 1, blocks)
            b.pop()
        blocks.append([i])
        rec(i + 1, blocks)
        blocks.pop()

    rec(0, [])
    return {s: np.array(parts, dtype=np.int64) for s, parts in sorted(out.items())}


@cache
def _mask_matrix(n: int) -> np.ndarray:
    """(2^n, n) 0/1 matrix: row m has ones at the members of bitmask m."""
    return np.array([[(m >> k) & 1 for k in range(n)] for m in range(1 << n)], dtype=np.float64)


def _monotone(table: np.ndarray) -> np.ndarray:
    """Force T̂ non-increasing in j (a stage may always use the throughput of more layers)."""
    return np.minimum.accumulate(table, axis=-1)


def place_fast(
    tables: Tables,
    n_layers: int,
    labels: tuple[int, ...],
    stage_counts: list[int] | None = None,
    last: Tables | None = None,
) -> Placement | None:
    """Best placement over the given stage counts (default 1..n); None if nothing fits.

    Args:
        tables: S -> T̂ of every node as a stage of an S-stage pipeline.
        n_layers: layers to place (L).
        labels: a label per node; equal labels mark identical nodes.
        stage_counts: the S values to try (default 1..n).
        last: S -> T̂ of every node as the pipeline's last stage, which sends no hop (default:
            `tables`, so the order of the stages does not matter). Each partition then tries
            each of its groups as the last stage; the returned stages end with that group.

    Returns:
        The placement of highest throughput, or None when no placement has T > 0.
    """
    n = len(labels)
    parts = set_partitions(labels)
    best: Found | None = None
    for s in stage_counts or list(range(1, n + 1)):
        if s not in parts or s not in tables or s > n_layers:
            continue
        found = _best_partition(tables[s], None if last is None else last[s], parts[s], n_layers)
        if found[0] > 0 and (best is None or found[0] > best[0] * (1 + 1e-12)):
            best = found
    return None if best is None else _recover(best, n_layers)


# The best of one stage count: (T, every group's summed T̂, the same as the last stage, the
# partition's group bitmasks, the index of its last group).
Found = tuple[float, np.ndarray, np.ndarray, np.ndarray, int]


def _best_partition(
    table: np.ndarray, last: np.ndarray | None, masks: np.ndarray, n_layers: int
) -> Found:
    """Best partition among `masks` (P, S) and its last group.

    Later groups are tried as the last first, so ties keep the sorted order (groups by their
    lowest node); without a `last` table the order does not matter and only that one is tried.
    """
    mm = _mask_matrix(table.shape[0])
    g = mm @ _monotone(table)  # (2^n, L) summed T̂ of every node group
    g_last = g if last is None else mm @ _monotone(last)
    stacked = g[masks]  # (P, S, L)
    s = masks.shape[1]
    if last is None:
        ends, variants = [s - 1], stacked[None]
    else:  # variant v: group ends[v] read from the last-stage table
        ends = list(range(s - 1, -1, -1))
        variants = np.repeat(stacked[None], s, axis=0)  # (S variants, P, S, L)
        variants[np.arange(s), :, ends] = g_last[masks[:, ends]].transpose(1, 0, 2)
    flat = variants.reshape(-1, s, variants.shape[-1])
    lth = -np.partition(-flat.reshape(len(flat), -1), n_layers - 1, axis=1)[:, n_layers - 1]
    values = np.minimum(lth, flat[:, :, 0].min(axis=1)).reshape(len(ends), len(masks))
    best: tuple[float, int, int] = (-1.0, 0, s - 1)  # (T, partition, last group)
    for v, b in enumerate(ends):
        i = int(np.argmax(values[v]))
        if v == 0 or values[v, i] > best[0] * (1 + 1e-12):
            best = (float(values[v, i]), i, b)
    return best[0], g, g_last, masks[best[1]], best[2]


def _recover(found: Found, n_layers: int) -> Placement:
    """The stages in pipeline order (the last group at the end) and their layer counts: each
    group's J at T, the surplus taken off the largest stages first."""
    t, g, g_last, groups, b = found
    order = [k for k in range(len(groups)) if k != b] + [b]
    stage_tables = np.stack([g[groups[k]] for k in order[:-1]] + [g_last[groups[b]]])
    stages = tuple(tuple(k for k in range(64) if (int(groups[m]) >> k) & 1) for m in order)
    js = trim_surplus(layers_at(stage_tables, t), n_layers)
    achieved = min(float(stage_tables[i, js[i] - 1]) for i in range(len(js)))
    return Placement(achieved, stages, tuple(js))


def layers_at(table: np.ndarray, t: float) -> list[int]:
    """Per row of a non-increasing table: how many layers it can hold at throughput t."""
    return [int(c) for c in (table >= t * (1 - 1e-12)).sum(axis=1)]


def trim_surplus(js: list[int], n_layers: int) -> list[int]:
    """Layer counts summing to n_layers: the surplus comes off the largest stages first.

    Same result as taking one layer at a time off the largest stage (lowest index on ties), in
    closed form: cap every stage at the lowest level h that still holds n_layers, then take the
    remaining surplus off the stages at h, lowest index first.
    """
    if sum(js) <= n_layers:
        return list(js)
    arr = np.asarray(js, dtype=np.int64)
    lo, hi = 1, int(arr.max())
    while lo < hi:  # smallest h with sum(min(js, h)) >= n_layers
        mid = (lo + hi) // 2
        if int(np.minimum(arr, mid).sum()) >= n_layers:
            hi = mid
        else:
            lo = mid + 1
    capped = np.minimum(arr, lo)
    extra = int(capped.sum()) - n_layers
    capped[np.flatnonzero(capped == lo)[:extra]] -= 1
    return [int(v) for v in capped]


def place_chain(table: np.ndarray, n_layers: int) -> Placement | None:
    """One stage per row, in row order (vLLM's pipeline): T = min(L-th largest, each T̂_1)."""
    if table.shape[0] > n_layers:
        return None
    mono = _monotone(table)
    lth = float(-np.partition(-mono.ravel(), n_layers - 1)[n_layers - 1])
    t = min(lth, float(mono[:, 0].min()))
    if t <= 0:
        return None
    js = trim_surplus(layers_at(mono, t), n_layers)
    achieved = min(float(mono[i, js[i] - 1]) for i in range(len(js)))
    return Placement(achieved, tuple((i,) for i in range(len(js))), tuple(js))


# Coupled decode pipelines (`place_coupled`). Bumped when the coupled search changes what a library
# holds, so libraries built before are rebuilt (solver.serving.library.input_hashes).
COUPLED_DECODE_VERSION = "1"


def place_coupled(
    upper: Tables,
    upper_last: Tables,
    seqs: dict[int, np.ndarray],
    seqs_last: dict[int, np.ndarray],
    periods: dict[int, np.ndarray],
    n_layers: int,
    labels: tuple[int, ...],
) -> Placement | None:
    """Best decode pipeline when every stage runs the same micro-batch (vLLM's pipeline).

    A decode pipeline of S stages keeps S micro-batches in flight and every micro-batch is the
    same sequences at every stage, so all stages run one micro-batch size B at one period p (the
    slowest stage's time) and the pipeline makes B x 1000 / p tokens/s. The stage that holds the
    least KV (or is slowest) caps B for all. `place_fast` lets each stage pick its own batch (its
    T̂ at its own best size), which is an upper bound of this.

    For a fixed period p the problem has `place_fast`'s structure: node k holding j layers
    serves x_k(j, p) sequences per micro-batch (the most that fit its KV share and finish within
    p), data-parallel members of a stage add up, x is non-increasing in j, and a partition
    reaches micro-batch B iff its groups hold >= L layers at B. So for every partition the best
    B(p) is the L-th largest value of its groups' summed x (and every group holding >= 1 layer),
    and the best pipeline is the maximum of B(p) x 1000 / p over the period grid.

    Partitions are evaluated in decreasing order of their uncoupled throughput (`upper`, the
    same bound `place_fast` uses) and the search stops once that bound is no better than the
    best coupled pipeline found: exact over partitions and layer splits for the period grid.

    Args:
        upper, upper_last: S -> (n, L) uncoupled T̂ (tokens/s) of every node as a middle or
            the last stage: each partition's upper bound.
        seqs, seqs_last: S -> (P, n, L) sequences x_k(j, p) per micro-batch at each period.
        periods: S -> (P,) the period grid (ms), each <= that S's per-stage budget.
        n_layers: layers to place (L).
        labels: a label per node; equal labels mark identical nodes.

    Returns:
        The best coupled placement (throughput in tokens/s), or None when none has B > 0.
        Single-stage pipelines are not considered (S = 1 is not coupled: use `place_fast`).
    """
    n = len(labels)
    parts = set_partitions(labels)
    mm = _mask_matrix(n)
    bounds: list[tuple[float, int, int, int]] = []  # (upper bound, S, partition, last group)
    for s in sorted(seqs):
        if s < 2 or s not in parts or s > n_layers:
            continue
        masks = parts[s]
        g, gl = mm @ _monotone(upper[s]), mm @ _monotone(upper_last[s])
        for b in range(s):
            stacked = g[masks]  # (partitions, S, L), a copy
            stacked[:, b] = gl[masks[:, b]]
            flat = stacked.reshape(len(masks), -1)
            lth = -np.partition(-flat, n_layers - 1, axis=1)[:, n_layers - 1]
            values = np.minimum(lth, stacked[:, :, 0].min(axis=1))
            bounds.extend((float(v), s, i, b) for i, v in enumerate(values) if v > 0)
    bounds.sort(key=lambda r: (-r[0], r[1], r[2], r[3]))  # best first; ties in a fixed order
    best: Placement | None = None
    grouped: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # S -> (P, 2^n, L) summed x
    for bound, s, i, b in bounds:
        if best is not None and bound <= best.throughput * (1 + 1e-12):
            break
        if s not in grouped:
            grouped[s] = (
                np.einsum("gk,pkl->pgl", mm, _monotone(seqs[s])),
                np.einsum("gk,pkl->pgl", mm, _monotone(seqs_last[s])),
            )
        found = _coupled_partition(grouped[s], periods[s], parts[s][i], b, n_layers)
        if found is not None and (best is None or found.throughput > best.throughput * (1 + 1e-12)):
            best = found
    return best


def _coupled_partition(
    grouped: tuple[np.ndarray, np.ndarray],
    periods: np.ndarray,
    groups: np.ndarray,
    last: int,
    n_layers: int,
) -> Placement | None:
    """One partition (group bitmasks, the last group's index) at its best period."""
    gx, gx_last = grouped
    order = [k for k in range(len(groups)) if k != last] + [last]
    tables = np.stack(
        [gx[:, groups[k]] for k in order[:-1]] + [gx_last[:, groups[last]]], axis=1
    )  # (P, S, L) in pipeline order
    flat = tables.reshape(len(periods), -1)
    lth = -np.partition(-flat, n_layers - 1, axis=1)[:, n_layers - 1]
    batch = np.minimum(lth, tables[:, :, 0].min(axis=1))
    rate = batch * 1e3 / periods
    p = int(np.argmax(rate))
    if rate[p] <= 0:
        return None
    js = trim_surplus(layers_at(tables[p], float(batch[p])), n_layers)
    achieved = min(float(tables[p, k, js[k] - 1]) for k in range(len(js)))
    stages = tuple(tuple(k for k in range(64) if (int(groups[m]) >> k) & 1) for m in order)
    return Placement(achieved * 1e3 / float(periods[p]), stages, tuple(js))
