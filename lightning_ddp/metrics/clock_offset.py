"""Each rank's clock offset to rank 0, from NTP-style round trips (pure: no torch, no process group).
The derivation: ``docs/comm_timer.md``, "Clock offsets across hosts".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["ClockOffset", "RoundTrip", "estimate_offset"]


@dataclass(frozen=True)
class RoundTrip:
    """One ping-pong between rank 0 and another rank, all four times in ms."""

    t0: float
    """Rank 0 sends (rank 0's clock)."""
    t1: float
    """The other rank receives (its clock)."""
    t2: float
    """The other rank replies (its clock)."""
    t3: float
    """Rank 0 receives the reply (rank 0's clock)."""

    @property
    def offset_ms(self) -> float:
        """The other rank's clock minus rank 0's, if the two one-way delays were equal."""
        return ((self.t1 - self.t0) + (self.t2 - self.t3)) / 2

    @property
    def round_trip_ms(self) -> float:
        """Time on the wire both ways: the round trip minus the other rank's turnaround (>= 0 on true clocks)."""
        return (self.t3 - self.t0) - (self.t2 - self.t1)


@dataclass(frozen=True)
class ClockOffset:
    """One rank's clock offset to rank 0: subtract ``offset_ms`` from its times to put them on rank 0's clock."""

    offset_ms: float
    """The rank's clock minus rank 0's."""
    uncertainty_ms: float
    """Half the round trip of the sample kept: the true offset lies within ``offset_ms +- uncertainty_ms``."""
    samples: int = 1
    """How many round trips were taken (the one with the shortest delay is kept)."""


def estimate_offset(round_trips: Sequence[RoundTrip]) -> ClockOffset:
    """The offset of the round trip with the shortest delay, +- half that delay.

    Rank *r*'s clock runs 1000 ms ahead; the first ping queued 3 ms on the way out, the second is kept:

    >>> slow = RoundTrip(t0=0.0, t1=1003.1, t2=1003.2, t3=3.3)
    >>> fast = RoundTrip(t0=10.0, t1=1010.1, t2=1010.2, t3=10.3)
    >>> estimate_offset([slow, fast])
    ClockOffset(offset_ms=1000.0, uncertainty_ms=0.1, samples=2)
    """
    if not round_trips:
        raise ValueError("estimate_offset needs at least one round trip; take a few "
                         "(e.g. --timer.clock_sync_rounds 8)")
    best = min(round_trips, key=lambda rt: rt.round_trip_ms)
    # A negative delay can only be clock reading jitter on a very fast link: it bounds nothing below 0.
    uncertainty_ms = round(max(0.0, best.round_trip_ms) / 2, 9)
    return ClockOffset(offset_ms=round(best.offset_ms, 9), uncertainty_ms=uncertainty_ms, samples=len(round_trips))
