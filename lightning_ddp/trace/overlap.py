"""The communication/computation overlap of one rank.

The overlap follows Holistic Trace Analysis (HTA, ``get_comm_comp_overlap``)::

    overlap = |comm ∩ compute| / |comm|

where ``comm`` is the union of the intervals in which some collective is in flight and ``compute`` the union of
the intervals in which the rank computes; ``|.|`` is total length. HTA takes both from GPU kernels (NCCL kernels
vs the others). On CPU with gloo we take ``comm`` from each collective's launch -> completion (the engine's
``SyncRecord``, or gloo's own thread events) and ``compute`` from the training thread's forward, backward and
optimizer ranges minus its time inside collective calls (launch, wait). 1.0: every moment of communication was
hidden behind computation; 0.0: the rank computed nothing while communicating (naive and flat DDP).

Intervals are ``(start, end)`` pairs in any one unit; the arithmetic lives in ``lightning_ddp.intervals``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from lightning_ddp.intervals import Interval, intersect, merge, total


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
