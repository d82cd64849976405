"""Dominance pruning by hand: which templates `prune_dominated` drops, and which it must keep."""

from __future__ import annotations

from dataclasses import dataclass

from solver.serving.pruning import prune_dominated


@dataclass(frozen=True)
class Placed:
    nodes: tuple[str, ...]
    throughput: float


def kept_keys(placed: list[Placed]) -> tuple[list[tuple[str, ...]], int]:
    kept, dropped = prune_dominated(placed)
    return [p.nodes for p in kept], dropped


def test_a_superset_with_no_more_throughput_is_dropped():
    placed = [Placed(("a",), 10.0), Placed(("a", "b"), 10.0), Placed(("a", "a"), 7.0)]
    assert kept_keys(placed) == ([("a",)], 2)


def test_a_superset_with_strictly_more_throughput_is_kept():
    placed = [Placed(("a",), 10.0), Placed(("a", "b"), 10.5)]
    assert kept_keys(placed) == ([("a",), ("a", "b")], 0)


def test_unrelated_multisets_are_both_kept():
    placed = [Placed(("a",), 10.0), Placed(("b",), 5.0)]
    assert kept_keys(placed) == ([("a",), ("b",)], 0)


def test_equal_multisets_do_not_dominate_each_other():
    """Only a proper sub-multiset dominates: one multiset (in any node order) is not dropped for
    itself, even at a lower throughput (the library enumerates each multiset once)."""
    placed = [Placed(("a", "b"), 10.0), Placed(("b", "a"), 8.0)]
    assert kept_keys(placed) == ([("a", "b"), ("b", "a")], 0)


def test_a_sub_set_that_is_not_a_sub_multiset_does_not_prune():
    """{a} is a subset of {a, b} as sets, but a*2 is not a sub-multiset of a+b: a+b needs one
    'a' only. So a+b stays, though a*2 delivers more."""
    placed = [Placed(("a", "a"), 30.0), Placed(("a", "b"), 20.0)]
    assert kept_keys(placed) == ([("a", "a"), ("a", "b")], 0)


def test_a_lower_throughput_non_sub_multiset_is_kept():
    """b+c delivers less than a and than a+b, but neither is inside it: it stays."""
    placed = [Placed(("a",), 10.0), Placed(("a", "b"), 15.0), Placed(("b", "c"), 4.0)]
    assert kept_keys(placed) == ([("a",), ("a", "b"), ("b", "c")], 0)


def test_domination_reaches_through_a_missing_child():
    """a+b+c is dropped for a (two nodes fewer) even though a+b and a+c have no placement."""
    placed = [Placed(("b",), 2.0), Placed(("c", "b", "a"), 9.0), Placed(("a",), 10.0)]
    assert kept_keys(placed) == ([("b",), ("a",)], 1)
