"""Interval arithmetic and the communication/computation overlap of one rank.

The overlap follows Holistic Trace Analysis (HTA, ``get_comm_comp_overlap``)::

    overlap = |comm ∩ compute| / |comm|

where ``comm`` is the union of the intervals in which some collective is in flight and ``compute`` the union of
the intervals in which the rank computes; ``|.|`` is total length. HTA takes both from GPU kernels (NCCL kernels
vs the others). On CPU with gloo we take ``comm`` from each collective's launch -> completion (the engine's
``SyncRecord``, or gloo's own thread events) and ``compute`` from the training thread's forward, backward and
optimizer ranges minus its time inside collective calls (launch, wait). 1.0: every moment of communication was
hidden behind computation; 0.0: the rank computed nothing while communicating (naive and flat DDP).

Intervals are ``(start, end)`` pairs in any one unit; all functions return merged, sorted, non-empty intervals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union as sorted, disjoint intervals; touching intervals join, empty ones vanish.

    >>> merge([(3, 5), (0, 1), (1, 2), (4, 6), (7, 7)])
    [(0, 2), (3, 6)]
    """
    out: list[Interval] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union (overlapping parts count once)."""
    return sum(end - start for start, end in merge(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The intervals covered by both ``a`` and ``b``.

    >>> intersect([(0, 4), (6, 10)], [(3, 7)])
    [(3, 4), (6, 7)]
    """
    a, b = merge(a), merge(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:  # advance whichever ends first; the other may still meet the next one
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The parts of ``a`` not covered by ``b``.

    >>> subtract([(0, 10)], [(2, 3), (5, 6)])
    [(0, 2), (3, 5), (6, 10)]
    """
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


@dataclass(frozen=True)
class Overlap:
    """How much of one rank's (or several ranks' summed) communication time was hidden behind computation."""

    comm: float
    """Total time with at least one collective in flight (union of the communication intervals)."""
    overlapped: float
    """Of that, the time during which the rank was also computing."""

    @property
    def fraction(self) -> float:
        """``overlapped / comm`` (HTA's comp_comm_overlap ratio); 0.0 when nothing was communicated."""
        return self.overlapped / self.comm if self.comm > 0 else 0.0

    @property
    def exposed(self) -> float:
        """Communication time not hidden behind computation."""
        return self.comm - self.overlapped

    def __add__(self, other: Overlap) -> Overlap:
        # Summing over ranks weights each rank by its communication time, as a ratio of sums should.
        return Overlap(self.comm + other.comm, self.overlapped + other.overlapped)


def comm_compute_overlap(comm: Iterable[Interval], compute: Iterable[Interval]) -> Overlap:
    """HTA's communication/computation overlap of one rank (see the module docstring).

    >>> o = comm_compute_overlap(comm=[(0, 4)], compute=[(2, 10)])   # 2 of 4 ms hidden
    >>> o.fraction
    0.5
    """
    comm = merge(comm)
    return Overlap(comm=total(comm), overlapped=total(intersect(comm, compute)))
