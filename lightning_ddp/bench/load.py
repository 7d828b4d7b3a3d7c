"""The load guard: before each cell repeat, wait until the machine's CPUs are (nearly) idle (``/proc/stat``), and
record how busy they were. The reader, the sleep and the clock are injected, so tests drive it with made-up counters.

>>> busy_fraction((800, 1000), (1550, 2000))  # 750 of the 1000 jiffies since the first reading idle: 25 % busy
0.25
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["LoadCheck", "busy_fraction", "read_proc_stat", "sample_busy", "wait_until_idle"]

CpuTimes = tuple[int, int]
"""``(idle, total)`` jiffies since boot, summed over all cores."""


def read_proc_stat(path: str = "/proc/stat") -> CpuTimes | None:
    """``(idle + iowait, user + nice + system + idle + iowait + irq + softirq + steal)`` of the ``cpu`` line, or
    ``None`` where there is no such file (not Linux)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("cpu "):
                    fields = [int(v) for v in line.split()[1:9]]
                    fields += [0] * (8 - len(fields))  # old kernels have fewer columns
                    return fields[3] + fields[4], sum(fields)
    except (OSError, ValueError):
        return None
    return None


def busy_fraction(before: CpuTimes, after: CpuTimes) -> float:
    """``1 - Δidle / Δtotal`` between two readings; ``0.0`` when no time passed on the counters."""
    d_idle, d_total = after[0] - before[0], after[1] - before[1]
    if d_total <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - d_idle / d_total))


def sample_busy(
    seconds: float,
    reader: Callable[[], CpuTimes | None] = read_proc_stat,
    sleep: Callable[[float], None] = time.sleep,
) -> float | None:
    """The busy fraction over the next ``seconds`` (step 1 of the recipe), or ``None`` without ``/proc/stat``."""
    before = reader()
    if before is None:
        return None
    sleep(seconds)
    after = reader()
    if after is None:
        return None
    return busy_fraction(before, after)


@dataclass(frozen=True)
class LoadCheck:
    """What the guard saw before one cell repeat (the repeats.csv columns of the same names)."""

    busy_before: float | None = None
    """The last busy fraction sampled before the repeat started; ``None`` where it cannot be measured."""
    waited_s: float = 0.0
    """Seconds spent waiting for the machine to go idle (0 when the first sample was below the threshold)."""
    busy: bool | None = None
    """True if the repeat started on a busy machine (still above the threshold when the wait ran out)."""


def wait_until_idle(
    threshold: float,
    max_wait_s: float,
    sample_s: float,
    reader: Callable[[], CpuTimes | None] = read_proc_stat,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> LoadCheck:
    """Sample, and keep sampling while busy, up to ``max_wait_s`` (the module recipe).

    Args:
        threshold: Busy fraction above which the machine counts as busy (``run.busy_threshold``).
        max_wait_s: Longest wait before starting anyway (``run.max_wait_s``).
        sample_s: Length of one sample (``run.load_sample_s``); ``0`` turns the guard off (nothing recorded).
        reader, sleep, clock: ``/proc/stat``, ``time.sleep`` and ``time.monotonic`` unless a test injects fakes.
    """
    if sample_s <= 0:
        return LoadCheck()
    fraction = sample_busy(sample_s, reader, sleep)
    if fraction is None:
        return LoadCheck()
    start = clock()
    waited = 0.0
    while fraction > threshold and waited < max_wait_s:
        latest = sample_busy(sample_s, reader, sleep)
        waited = clock() - start
        if latest is None:  # the file went away: stop waiting, keep what was seen
            break
        fraction = latest
    return LoadCheck(busy_before=fraction, waited_s=waited, busy=fraction > threshold)
