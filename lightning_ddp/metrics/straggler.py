"""Who made the step wait: every rank's launch times, all-gathered once per measured step (``StragglerExchange``),
split exposed communication into waiting and transfer (``attribute_wait``), on rank 0's clock (``estimate_offset``).
Vector layout, definitions and the offsets' derivation: ``docs/comm_timer.md``, "Who made the step wait".
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from lightning_ddp.intervals import Interval
from lightning_ddp.sync.base import check_number
from lightning_ddp.sync.comm import backend_from_spec
from lightning_ddp.sync.record import SyncRecord

VECTOR_HEADER = 4
"""Fields before the launch times: step ms, compute ms, origin on rank 0's clock (ms), number of collectives."""

DEFAULT_MAX_COLLECTIVES = 512
"""Launch times compared per step by default (more than the naive engine's ~435 on the xl model)."""
_COLLECTIVES_FIX = f"e.g. --timer.straggler_collectives {DEFAULT_MAX_COLLECTIVES}"


def rank_vector(record: SyncRecord, max_collectives: int, clock_offset_ms: float = 0.0) -> list[float]:
    """This rank's vector from a finished record; ``clock_offset_ms``: this rank's clock minus rank 0's.

    >>> from lightning_ddp.sync.record import Collective, SyncRecord
    >>> record = SyncRecord(collectives=[Collective("all_reduce", "b0", 8, 30.0, 40.0)], started=0.0, ended=50.0,
    ...                     last_ready=35.0, origin_s=100.0)
    >>> rank_vector(record, max_collectives=2, clock_offset_ms=1.0)  # 0 ms is 100 s = 100,000 ms, minus 1 ms
    [50.0, 35.0, 99999.0, 1.0, 30.0, nan]
    """
    check_number("max_collectives", max_collectives, 1, _COLLECTIVES_FIX)
    assert record.origin_s is not None, "only a finished record (Recorder.finish_step) can be exchanged"
    started, last_ready = record.started, record.last_ready
    compute = last_ready - started if started is not None and last_ready is not None else math.nan
    launches = [float(c.launched) for c in record.collectives][-max_collectives:]
    vector = [float(record.step_ms), float(compute), record.origin_s * 1e3 - clock_offset_ms,
              float(len(record.collectives)), *launches]
    return vector + [math.nan] * (VECTOR_HEADER + max_collectives - len(vector))


@dataclass
class StragglerStats:
    """What the exchanged vectors say about one step, seen from one rank (``attribute_wait``)."""

    step_ms: float
    """The slowest rank's step time (the max over ranks)."""
    wait: list[Interval] = field(default_factory=list)
    """On this rank's axis, per compared collective: from this rank's launch to the last rank's."""
    straggler_rank: int | None = None
    """The rank that launched last most often; ``None`` when no collective was compared."""
    lag_ms: float | None = None
    """Median over compared collectives of the straggler's launch minus the earliest launch."""
    rank_spread_ms: float | None = None
    """Slowest minus fastest rank's compute; ``None`` when no rank marked it."""


def attribute_wait(vectors: Sequence[Sequence[float]], rank: int) -> StragglerStats:
    """Every rank's vector (index = rank) -> the step's waits as ``rank`` saw them.

    Rank 1 launches both collectives 20 ms late: rank 0 waited 20 ms for each; rank 1 is the straggler.

    >>> v0 = [100.0, 60.0, 0.0, 2.0, 40.0, 55.0]
    >>> v1 = [100.0, 80.0, 0.0, 2.0, 60.0, 75.0]
    >>> s = attribute_wait([v0, v1], rank=0)
    >>> s.wait, s.straggler_rank, s.lag_ms, s.rank_spread_ms
    ([(40.0, 60.0), (55.0, 75.0)], 1, 20.0, 20.0)
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
        last_counts[launches.index(latest)] += 1  # the last to launch; the lowest rank on a tie
        own = vectors[rank][VECTOR_HEADER + i - firsts[rank]]
        wait.append((own, own + latest - launches[rank]))
        earliest = min(launches)
        per_collective.append([value - earliest for value in launches])
    stats = StragglerStats(step_ms=max(v[0] for v in vectors), wait=wait)
    if per_collective:
        straggler = max(range(len(vectors)), key=lambda r: (last_counts[r], -r))
        stats.straggler_rank = straggler
        stats.lag_ms = statistics.median(lag[straggler] for lag in per_collective)
    computes = [v[1] for v in vectors if math.isfinite(v[1])]
    if computes:
        stats.rank_spread_ms = max(computes) - min(computes)
    return stats


def clock_note(uncertainty_ms: float | None, lag_ms: float | None) -> str | None:
    """The summary's line when clock offsets limit the straggler numbers, else ``None``; ``uncertainty_ms``: the
    largest offset uncertainty (``None``: not estimated), ``lag_ms``: the median ``straggler/lag_ms``."""
    if uncertainty_ms is None:
        return ("clock offsets between hosts were not estimated (--timer.clock_sync off): comm/wait_ms, "
                "straggler/rank and straggler/lag_ms compare the launch times of different clocks")
    if lag_ms is not None and uncertainty_ms > lag_ms:
        return (f"clock offsets are known to +-{uncertainty_ms:.3g} ms, more than the median straggler lag "
                f"({lag_ms:.3g} ms): comm/wait_ms, straggler/rank and straggler/lag_ms cannot resolve lags this small")
    return None


@dataclass(frozen=True)
class RoundTrip:
    """One ping-pong between rank 0 and another rank, in ms: ``t0`` rank 0 sends, ``t1`` the other rank receives,
    ``t2`` it replies, ``t3`` rank 0 receives the reply (``t0``, ``t3`` on rank 0's clock, ``t1``, ``t2`` on its)."""

    t0: float
    t1: float
    t2: float
    t3: float

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


CLOCK_SYNC_CHOICES = ("auto", "always", "off")


def distributed() -> bool:
    """Whether this process is one of several ranks of an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _message_device(device: torch.device) -> torch.device:
    """Where a small message travels: the CPU if the group has a backend for it (gloo), else ``device``."""
    cpu = torch.device("cpu")
    return cpu if backend_from_spec(dist.get_backend_config(), cpu) is not None else device


def measure_clock_offsets(rounds: int = 8, device: torch.device | str = "cpu",
                          now: Callable[[], float] = time.perf_counter) -> list[ClockOffset]:
    """Every rank's clock offset to rank 0 (index = rank), the same list on every rank; a collective. ``rounds``:
    checked by ``StragglerExchange``."""
    if not distributed():
        return [ClockOffset(0.0, 0.0, 0)]
    world, rank = dist.get_world_size(), dist.get_rank()
    device = _message_device(torch.device(device))

    def read() -> float:  # ms, after the device has delivered what was received
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return now() * 1e3

    ping = torch.zeros(1, dtype=torch.float64, device=device)
    pong = torch.zeros(2, dtype=torch.float64, device=device)
    table = torch.zeros(world, 3, dtype=torch.float64, device=device)  # offset, uncertainty, samples
    if rank == 0:
        for peer in range(1, world):
            trips = []
            for _ in range(rounds):
                t0 = read()
                dist.send(ping, dst=peer)
                dist.recv(pong, src=peer)
                t3 = read()
                t1, t2 = pong.tolist()
                trips.append(RoundTrip(t0, t1, t2, t3))
            offset = estimate_offset(trips)
            table[peer] = torch.tensor([offset.offset_ms, offset.uncertainty_ms, offset.samples], dtype=torch.float64)
    else:
        for _ in range(rounds):
            dist.recv(ping, src=0)
            t1 = read()
            pong.copy_(torch.tensor([t1, now() * 1e3], dtype=torch.float64))
            dist.send(pong, dst=0)
    dist.broadcast(table, src=0)
    return [ClockOffset(offset, uncertainty, int(samples)) for offset, uncertainty, samples in table.tolist()]


class StragglerExchange:
    """One rank's side of the per-step exchange and of the clock offsets. The settings are ``CommTimer``'s of the
    same names (``max_collectives``: its ``straggler_collectives``, the same on every rank); ``now``: the host clock
    in seconds (tests shift one rank's)."""

    def __init__(self, max_collectives: int, clock_sync: str = "auto", clock_sync_every_n_steps: int = 1000,
                 clock_sync_rounds: int = 8, now: Callable[[], float] = time.perf_counter) -> None:
        check_number("max_collectives", max_collectives, 1, _COLLECTIVES_FIX)
        if clock_sync not in CLOCK_SYNC_CHOICES:
            raise ValueError(f"clock_sync must be one of {', '.join(CLOCK_SYNC_CHOICES)}, got {clock_sync!r}; e.g. "
                             "--timer.clock_sync auto")
        check_number("clock_sync_every_n_steps", clock_sync_every_n_steps, 1,
                     "e.g. --timer.clock_sync_every_n_steps 1000")
        check_number("clock_sync_rounds", clock_sync_rounds, 1, "e.g. --timer.clock_sync_rounds 8")
        self.max_collectives = max_collectives
        self.clock_sync = clock_sync
        self.every_n_steps = clock_sync_every_n_steps
        self.rounds = clock_sync_rounds
        self.now = now
        self.device = torch.device("cpu")
        self.hosts = 1
        self.offsets: list[ClockOffset] | None = None
        """Every rank's offset to rank 0 from the last estimate; ``None`` when none was taken."""
        self.estimated_at: list[int | None] = []
        """The steps at which the offsets were estimated (the one at train start counts as the first measured)."""
        self.max_uncertainty_ms: float | None = None
        """The largest uncertainty over every estimate of the run."""

    def start(self, device: torch.device | str, hosts: int = 1) -> None:
        """At train start, on every rank: the number of distinct hostnames the ranks run on, and, if needed, the
        offsets' first estimate (``offsets`` is then set: the run estimates them)."""
        self.device = torch.device(device)
        self.hosts = hosts
        if self.clock_sync == "always" or (self.clock_sync == "auto" and hosts > 1):
            self._sync(None)

    def _sync(self, step: int | None) -> None:
        self.offsets = measure_clock_offsets(self.rounds, self.device, now=self.now)
        self.estimated_at.append(step)
        worst = max(o.uncertainty_ms for o in self.offsets)
        self.max_uncertainty_ms = worst if self.max_uncertainty_ms is None else max(self.max_uncertainty_ms, worst)

    def exchange(self, record: SyncRecord, step: int) -> StragglerStats:
        """Every rank's vector for this finished step, gathered in one collective, as this rank's stats."""
        if self.offsets is not None:  # clock offsets are estimated in this run
            if self.estimated_at[-1] is None:  # estimated at train start: counts as this, the first measured step
                self.estimated_at[-1] = step
            elif step - self.estimated_at[-1] >= self.every_n_steps:
                self._sync(step)
        rank = dist.get_rank() if distributed() else 0
        offset_ms = self.offsets[rank].offset_ms if self.offsets is not None else 0.0
        vector = rank_vector(record, self.max_collectives, offset_ms)
        if not distributed():
            return attribute_wait([vector], 0)
        local = torch.tensor(vector, dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        return attribute_wait([t.tolist() for t in gathered], rank)

    def describe(self) -> dict[str, Any]:
        """The clocks, for ``timing_summary.json``: hosts, how offsets were found, every rank's offset and bound;
        ``max_uncertainty_ms``: the largest of the run, 0 on one host, ``None`` when hosts were not synchronised."""
        if self.offsets is not None:
            how = f"estimated from {self.rounds} round trips per rank (shortest kept)"
        elif self.hosts > 1:
            how = "not estimated (clock_sync off): launch times of different hosts compared as they are"
        else:
            how = "one host: every rank reads the same CLOCK_MONOTONIC (offset 0)"
        return {
            "hosts": self.hosts,
            "clock_sync": self.clock_sync,
            "offsets": how,
            "offset_ms": [o.offset_ms for o in self.offsets] if self.offsets is not None else None,
            "uncertainty_ms": [o.uncertainty_ms for o in self.offsets] if self.offsets is not None else None,
            "max_uncertainty_ms": 0.0 if self.offsets is None and self.hosts == 1 else self.max_uncertainty_ms,
            "estimated_at_steps": self.estimated_at,
            "compared_collectives_max": self.max_collectives,
        }
