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
    a, b = merge(a), merge(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):  # sweep both sorted disjoint lists once
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:  # advance whichever ends first; the other may still meet the next one
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The parts of ``a`` not covered by ``b``."""
    out: list[Interval] = []
    holes = merge(b)
    for start, end in merge(a):
        cursor = start
        for h_start, h_end in holes:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
        if cursor < end:
            out.append((cursor, end))
    return out
