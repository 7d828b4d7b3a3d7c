"""Interval arithmetic on ``(start, end)`` pairs, for the accounting and the trace analysis. Pure Python.

Every function returns merged, sorted intervals and drops empty ones (``end <= start``).
"""

from __future__ import annotations

from typing import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union as sorted, disjoint intervals; touching intervals join, empty ones vanish."""
    out: list[Interval] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union: overlapping time is counted once.

    >>> total([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])  # [0, 3] and [5, 6]
    4.0
    """
    return float(sum(end - start for start, end in merge(intervals)))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The intervals covered by both ``a`` and ``b``; ``total`` of them is the length of the overlap.

    >>> total(intersect([(0.0, 10.0)], [(2.0, 3.0), (9.0, 12.0)]))  # [2, 3] and [9, 10]
    2.0
    >>> intersect([(0.0, 1.0)], [(1.0, 2.0)])  # touching is not overlapping
    []
    """
    return _select(a, b, in_b=True)


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The parts of ``a`` not covered by ``b``."""
    return _select(a, b, in_b=False)


def _select(a: Iterable[Interval], b: Iterable[Interval], in_b: bool) -> list[Interval]:
    """The parts of ``a`` inside ``b`` (``in_b``) or outside it: one sweep over the pieces between the boundaries."""
    a, b = merge(a), merge(b)
    bounds = sorted({x for interval in (*a, *b) for x in interval})
    out: list[Interval] = []
    i = j = 0
    for start, end in zip(bounds, bounds[1:]):
        while i < len(a) and a[i][1] <= start:
            i += 1
        while j < len(b) and b[j][1] <= start:
            j += 1
        if i < len(a) and a[i][0] <= start and (j < len(b) and b[j][0] <= start) == in_b:
            out.append((start, end))
    return merge(out)
