"""The CommTimer's talk between ranks: one all-gather of per-rank vectors per measured step, and clock offsets.

``StragglerExchange.start()`` counts the hosts and, when asked, estimates clock offsets; ``exchange(record, step)``
all-gathers every rank's ``straggler.rank_vector`` and returns this rank's ``StragglerStats``.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_ddp.metrics.straggler import (ClockOffset, RoundTrip, StragglerStats, attribute_wait, estimate_offset,
                                             rank_vector, vector_length)
from lightning_ddp.sync.record import SyncRecord

__all__ = ["StragglerExchange", "count_hosts", "measure_clock_offsets"]

CLOCK_SYNC_CHOICES = ("auto", "always", "off")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _message_device(device: torch.device) -> torch.device:
    """Where a small message travels: the CPU if the group has a backend for it (gloo), else ``device``."""
    from lightning_ddp.sync.comm import backend_for

    try:
        backend_for(torch.device("cpu"))
        return torch.device("cpu")
    except ValueError:
        return device


def count_hosts() -> int:
    """How many distinct hostnames the ranks run on (one ``all_gather_object``; 1 without a process group)."""
    if not _distributed():
        return 1
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return len(set(names))


def measure_clock_offsets(rounds: int = 8, device: torch.device | str = "cpu",
                          now: Callable[[], float] = time.perf_counter) -> list[ClockOffset]:
    """Every rank's clock offset to rank 0 (index = rank), the same list on every rank; a collective."""
    if not (isinstance(rounds, int) and rounds >= 1):
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}; e.g. --timer.clock_sync_rounds 8")
    if not _distributed():
        return [ClockOffset(0.0, 0.0, 0)]
    world, rank = dist.get_world_size(), dist.get_rank()
    device = _message_device(torch.device(device))
    cuda = device.type == "cuda"

    def read() -> float:  # ms, after the device has delivered what was received
        if cuda:
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
        vector_length(max_collectives)  # validates
        if clock_sync not in CLOCK_SYNC_CHOICES:
            raise ValueError(f"clock_sync must be one of {', '.join(CLOCK_SYNC_CHOICES)}, got {clock_sync!r}; e.g. "
                             "--timer.clock_sync auto")
        for name, value, example in (("clock_sync_every_n_steps", clock_sync_every_n_steps, 1000),
                                     ("clock_sync_rounds", clock_sync_rounds, 8)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}; e.g. --timer.{name} {example}")
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
        self._last_sync: int | None = None

    @property
    def syncing(self) -> bool:
        """Whether clock offsets are estimated in this run (decided in ``start``)."""
        return self.clock_sync == "always" or (self.clock_sync == "auto" and self.hosts > 1)

    def start(self, device: torch.device | str) -> None:
        """At train start, on every rank: count the hosts and, if needed, estimate the offsets a first time."""
        self.device = torch.device(device)
        self.hosts = count_hosts()
        if self.syncing:
            self._sync(None)

    def _sync(self, step: int | None) -> None:
        self.offsets = measure_clock_offsets(self.rounds, self.device, now=self.now)
        self.estimated_at.append(step)
        worst = max(o.uncertainty_ms for o in self.offsets)
        self.max_uncertainty_ms = worst if self.max_uncertainty_ms is None else max(self.max_uncertainty_ms, worst)

    def exchange(self, record: SyncRecord, step: int) -> StragglerStats:
        """Every rank's vector for this finished step, gathered in one collective, as this rank's stats."""
        if self.syncing:
            if self._last_sync is None:  # estimated at train start: counts as this, the first measured step
                self._last_sync = self.estimated_at[-1] = step
            elif step - self._last_sync >= self.every_n_steps:
                self._sync(step)
                self._last_sync = step
        rank = dist.get_rank() if _distributed() else 0
        offset_ms = self.offsets[rank].offset_ms if self.offsets is not None else 0.0
        vector = rank_vector(record, self.max_collectives, offset_ms)
        if not _distributed():
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
