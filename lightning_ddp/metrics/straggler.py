"""Who made the step wait: each rank's launch times, exchanged once per measured step, split exposed communication.

Exposed communication has two causes that call for opposite fixes: moving bytes (buckets, compression, a faster
link) and waiting for a slower rank to arrive (the data loader, a slow GPU, an unbalanced batch, a noisy
neighbour). A collective cannot finish before its last rank has launched it, so the time from this rank's launch
to the last rank's launch is waiting, whatever the link; the rest of the exposed time is transfer.

Pure Python (no torch, no process group), like ``accounting``: the callback's exchange (``rank_exchange``) only
moves the vectors this module builds and hands them back.

1. ``rank_vector``: after a step is finished, each rank packs a fixed-length float64 vector (``VECTOR_HEADER``
   fields, then the launch times of the step's **last** ``max_collectives`` collectives, NaN-padded):

   ====  ====================================================================================================
   slot  value
   ====  ====================================================================================================
   0     the rank's step time, ms (the job's ``step/time_ms`` is the max over ranks: this replaces the ``MAX``
         all-reduce)
   1     the rank's compute, ms: forward + backward, from the step's start to its last gradient computed (NaN
         when a mark is missing)
   2     the rank's 0 ms on rank 0's clock, ms: ``origin_s * 1e3 - clock_offset_ms`` (ranks on one host share
         ``CLOCK_MONOTONIC``, offset 0; across hosts ``clock_offset`` estimates it)
   3     how many collectives the rank launched this step
   4..   launch times, ms on the rank's own axis, of its last ``max_collectives`` collectives in issue order
   ====  ====================================================================================================

2. every rank all-gathers every rank's vector (one collective per measured step, ``rank_exchange``);
3. ``attribute_wait`` pairs the collectives by issue order (collective *i* of every rank is the same collective:
   that is how backends match them) and compares those every rank holds: with counts ``n_r``, rank *r* holds
   indices ``[n_r - min(n_r, K), n_r)``, so the compared indices are ``[max_r(n_r - min(n_r, K)), min_r n_r)``.
   Ranks that launched different numbers (a recorder missing on one rank; it does not happen with a healthy
   strategy) are compared on the indices they share, and ``compared`` says how many that was. Keeping the *last*
   ``K`` keeps the collectives nearest the exposed interval, where waiting costs.

For each compared collective *i*, with ``L_r,i`` its launch on the common clock: this rank waited
``[L_self,i, max_r L_r,i]``; the union of those intervals, clipped to the exposed interval, is ``comm/wait_ms``
(``accounting.step_metrics``). The straggler of collective *i* is ``argmax_r L_r,i`` (the lowest rank on a tie);
``straggler/rank`` is the rank that was last most often (the lowest on a tie) and ``straggler/lag_ms`` the median
over compared collectives of its launch minus the earliest launch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from lightning_ddp.intervals import Interval

if TYPE_CHECKING:  # only for annotations: this module must not import torch
    from lightning_ddp.sync.record import SyncRecord

__all__ = ["VECTOR_HEADER", "StragglerStats", "attribute_wait", "clock_note", "rank_vector", "vector_length"]

VECTOR_HEADER = 4
"""Fields before the launch times: step ms, compute ms, origin on rank 0's clock (ms), number of collectives."""

DEFAULT_MAX_COLLECTIVES = 512
"""Launch times compared per step by default: every bucketed strategy and torch DDP launch far fewer; the naive
engine on the xl model launches one per parameter tensor (~435), still inside. 4 KiB per rank and step."""


def vector_length(max_collectives: int) -> int:
    """The length every rank's vector has (all ranks must agree on ``max_collectives``)."""
    if not (isinstance(max_collectives, int) and max_collectives >= 1):
        raise ValueError(f"max_collectives must be an int >= 1, got {max_collectives!r}; e.g. "
                         f"--timer.straggler_collectives {DEFAULT_MAX_COLLECTIVES}")
    return VECTOR_HEADER + max_collectives


def rank_vector(record: SyncRecord, max_collectives: int, clock_offset_ms: float = 0.0) -> list[float]:
    """This rank's vector (layout in the module docstring) from a finished record (marks in ms, ``origin_s`` set).

    ``clock_offset_ms``: this rank's clock minus rank 0's (``clock_offset.estimate_offset``); 0 on one host.

    >>> from lightning_ddp.sync.record import Collective, SyncRecord
    >>> record = SyncRecord(collectives=[Collective("all_reduce", "b0", 8, 30.0, 40.0)], started=0.0, ended=50.0,
    ...                     last_ready=35.0, origin_s=100.0)
    >>> rank_vector(record, max_collectives=2, clock_offset_ms=1.0)  # 0 ms is 100 s = 100,000 ms, minus 1 ms
    [50.0, 35.0, 99999.0, 1.0, 30.0, nan]
    """
    length = vector_length(max_collectives)
    assert record.origin_s is not None, "only a finished record (Recorder.finish_step) can be exchanged"
    started, last_ready = record.started, record.last_ready
    compute = last_ready - started if started is not None and last_ready is not None else math.nan
    launches = [float(c.launched) for c in record.collectives][-max_collectives:]
    vector = [float(record.step_ms), float(compute), record.origin_s * 1e3 - clock_offset_ms,
              float(len(record.collectives)), *launches]
    return vector + [math.nan] * (length - len(vector))


@dataclass
class StragglerStats:
    """What the exchanged vectors say about one step, seen from one rank (``attribute_wait``)."""

    step_ms: float
    """The slowest rank's step time (the max over ranks)."""
    wait: list[Interval] = field(default_factory=list)
    """On this rank's axis: for each compared collective, from this rank's launch to the last rank's launch."""
    straggler_rank: int | None = None
    """The rank that launched last most often; ``None`` when no collective was compared."""
    lag_ms: float | None = None
    """Median over compared collectives of the straggler's launch minus the earliest launch."""
    rank_spread_ms: float | None = None
    """Slowest minus fastest rank's compute (forward + backward); ``None`` when no rank marked it."""
    compared: int = 0
    """How many collectives every rank held and were compared."""
    world_size: int = 1
    """How many vectors were compared."""


def attribute_wait(vectors: Sequence[Sequence[float]], rank: int) -> StragglerStats:
    """Every rank's vector (index = rank) -> the step's waits as ``rank`` saw them (see the module docstring).

    Rank 1 launches both collectives 20 ms late (same host, same origin): rank 0 waited 20 ms for each, rank 1 not
    at all; rank 1 is the straggler with a 20 ms lag, and its compute was 20 ms longer:

    >>> v0 = [100.0, 60.0, 0.0, 2.0, 40.0, 55.0]
    >>> v1 = [100.0, 80.0, 0.0, 2.0, 60.0, 75.0]
    >>> s = attribute_wait([v0, v1], rank=0)
    >>> s.wait, s.straggler_rank, s.lag_ms, s.rank_spread_ms, s.compared
    ([(40.0, 60.0), (55.0, 75.0)], 1, 20.0, 20.0, 2)
    >>> attribute_wait([v0, v1], rank=1).wait
    [(60.0, 60.0), (75.0, 75.0)]
    """
    if not vectors:
        raise ValueError("attribute_wait needs every rank's vector, got none")
    lengths = {len(v) for v in vectors}
    if len(lengths) != 1 or min(lengths) <= VECTOR_HEADER:
        raise ValueError(f"every rank's vector must have the same length > {VECTOR_HEADER}, got lengths "
                         f"{sorted(lengths)}; give every rank the same CommTimer(straggler_collectives=...)")
    if not 0 <= rank < len(vectors):
        raise ValueError(f"rank {rank} is not one of the {len(vectors)} ranks whose vectors were given")
    k = len(vectors[0]) - VECTOR_HEADER
    counts = [int(v[3]) for v in vectors]
    firsts = [n - min(n, k) for n in counts]  # the index of each rank's first slot
    start, stop = max(firsts), min(counts)
    origins = [v[2] for v in vectors]

    def launch(r: int, i: int) -> float:  # collective i of rank r, on rank 0's clock
        return origins[r] + vectors[r][VECTOR_HEADER + i - firsts[r]]

    wait: list[Interval] = []
    last_counts = [0] * len(vectors)
    per_collective: list[list[float]] = []  # per compared collective: each rank's launch minus the earliest
    for i in range(start, stop):
        launches = [launch(r, i) for r in range(len(vectors))]
        latest = max(launches)
        last = launches.index(latest)  # the lowest rank on a tie
        last_counts[last] += 1
        own = vectors[rank][VECTOR_HEADER + i - firsts[rank]]
        wait.append((own, own + latest - launches[rank]))
        earliest = min(launches)
        per_collective.append([value - earliest for value in launches])
    stats = StragglerStats(step_ms=max(v[0] for v in vectors), wait=wait, compared=len(per_collective),
                           world_size=len(vectors))
    if per_collective:
        straggler = max(range(len(vectors)), key=lambda r: (last_counts[r], -r))
        stats.straggler_rank = straggler
        stats.lag_ms = statistics.median(lag[straggler] for lag in per_collective)
    computes = [v[1] for v in vectors if math.isfinite(v[1])]
    if computes:
        stats.rank_spread_ms = max(computes) - min(computes)
    return stats


def clock_note(uncertainty_ms: float | None, lag_ms: float | None) -> str | None:
    """The line the printed summary adds when clock offsets limit what the straggler numbers can say, else ``None``.

    ``uncertainty_ms``: the largest offset uncertainty over ranks and estimates (0 when every rank reads one host's
    clock; ``None`` when ranks on several hosts were compared without estimating offsets); ``lag_ms``: the median
    ``straggler/lag_ms``.

    >>> clock_note(0.0, 0.01) is None  # one host: one clock, any lag resolves
    True
    >>> clock_note(0.5, 0.2)
    'clock offsets are known to +-0.5 ms, more than the median straggler lag (0.2 ms): comm/wait_ms, straggler/rank and straggler/lag_ms cannot resolve lags this small'
    """
    if uncertainty_ms is None:
        return ("clock offsets between hosts were not estimated (--timer.clock_sync off): comm/wait_ms, straggler/rank "
                "and straggler/lag_ms compare the launch times of different clocks")
    if lag_ms is not None and uncertainty_ms > lag_ms:
        return (f"clock offsets are known to +-{uncertainty_ms:.3g} ms, more than the median straggler lag "
                f"({lag_ms:.3g} ms): comm/wait_ms, straggler/rank and straggler/lag_ms cannot resolve lags this small")
    return None
