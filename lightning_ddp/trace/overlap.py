"""The communication/computation overlap of one rank, as Holistic Trace Analysis defines it:
``|comm ∩ compute| / |comm|`` (1.0: all communication hidden behind computation).
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
    """HTA's communication/computation overlap of one rank.

    >>> comm_compute_overlap(comm=[(0, 4)], compute=[(2, 10)]).fraction  # 2 of 4 ms hidden
    0.5
    """
    comm = merge(comm)
    return Overlap(comm=total(comm), overlapped=total(intersect(comm, compute)))
