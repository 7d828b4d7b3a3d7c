"""HTA's communication/computation overlap, ``|comm ∩ compute| / |comm|``, of one rank or summed over several
(docs/tensorboard.md, "Two overlaps": why it reads lower than the CommTimer's ``comm/overlap``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from lightning_ddp.intervals import Interval, intersect, merge, total

OVERLAP_DEFINITION = (
    "overlap here is HTA's: of the time a collective was in flight (launch to completion, over the traced steps, "
    "summed over ranks), the share the rank computed meanwhile, its time inside collective calls not counted. The "
    "CommTimer's comm/overlap counts all busy time before the step's last gradient as hidden and usually reads "
    "higher for the same run: docs/tensorboard.md, \"Two overlaps\", and docs/comm_timer.md")


@dataclass(frozen=True)
class Overlap:
    """How much of one rank's (or several ranks' summed) communication time was hidden behind computation."""

    comm: float  # the time with at least one collective in flight
    overlapped: float  # of that, the time the rank also computed

    @property
    def fraction(self) -> float:
        """``overlapped / comm`` (HTA's comp_comm_overlap ratio); 0.0 when nothing was communicated."""
        return self.overlapped / self.comm if self.comm > 0 else 0.0

    def describe(self, more: str = "") -> str:
        """``overlap 75.0% (3.0 of 4.0 ms communication hidden{more})``, from times in trace microseconds."""
        hidden_ms, comm_ms = self.overlapped / 1e3, self.comm / 1e3
        return f"overlap {self.fraction:.1%} ({hidden_ms:.1f} of {comm_ms:.1f} ms communication hidden{more})"

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


def clip(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    """``intervals`` cut to the window ``(lo, hi)``, merged.

    >>> clip([(0, 4), (3, 6), (8, 9)], 2, 8)
    [(2, 6)]
    """
    return merge((max(start, lo), min(end, hi)) for start, end in intervals)
