"""Dominance pruning: a serving template whose nodes strictly contain another's, for no more
throughput, can never be in a cheapest plan (paper Sec. 4.2), so the library drops it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class _Placed(Protocol):
    @property
    def nodes(self) -> Sequence[str]: ...

    @property
    def throughput(self) -> float: ...


P = TypeVar("P", bound=_Placed)


def prune_dominated(placed: list[P]) -> tuple[list[P], int]:
    """Drop an entry when one on a proper sub-multiset of its nodes delivers at least as much.

    best_below(m) = the most any proper sub-multiset of m delivers, computed once per multiset
    from its children (m minus one node), so each entry costs O(distinct node types).
    """
    value = {tuple(sorted(p.nodes)): p.throughput for p in placed}
    below: dict[tuple[str, ...], float] = {}

    def best_below(ms: tuple[str, ...]) -> float:
        if ms not in below:
            best = 0.0
            for i, n in enumerate(ms):
                if i and ms[i - 1] == n:
                    continue  # removing another copy of the same node gives the same child
                child = ms[:i] + ms[i + 1 :]
                if child:
                    best = max(best, value.get(child, 0.0), best_below(child))
            below[ms] = best
        return below[ms]

    kept = [p for p in placed if best_below(tuple(sorted(p.nodes))) < p.throughput]
    return kept, len(placed) - len(kept)
