"""Per-step communication accounting, pure Python (no torch): ``StepTiming`` -> ``step_metrics`` ->
``TimingSummary``. Measuring never raises; only arguments a user chose do. Definitions: ``docs/comm_timer.md``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.intervals import Interval, intersect, total

if TYPE_CHECKING:  # only for annotations: this module must not import torch
    from lightning_ddp.metrics.straggler import StragglerStats
    from lightning_ddp.sync.record import Collective, SyncRecord


class ClockAnomalyWarning(RuntimeWarning):
    """Marks of a measured step contradicted each other and were clamped (``StepTiming``); training goes on."""


def _clamped(name: str, intervals: Sequence[Interval], anomalies: list[str]) -> list[Interval]:
    """``intervals`` with each backwards one clamped to ``end = start`` and noted in ``anomalies``."""
    out: list[Interval] = []
    for start, end in intervals:
        if end < start:
            anomalies.append(f"{name} interval ({start}, {end}) ends {start - end:.3g} ms before it starts")
            end = start
        out.append((start, end))
    return out


# ---- one step, in milliseconds from the step's clock anchor ------------------------------------------


@dataclass
class StepTiming:
    """One optimizer step on one rank, in ms since the record's anchor; contradicting marks are clamped, one line
    of ``anomalies`` each (``docs/comm_timer.md``, "Clocks")."""

    step_ms: float
    """Wall time of the whole optimizer step."""
    exposed: list[Interval] = field(default_factory=list)
    """Critical-path intervals of gradient synchronisation."""
    pack: list[Interval] = field(default_factory=list)
    """Intervals copying gradients into or out of communication buffers."""
    collectives: list[Collective] = field(default_factory=list)
    """Every collective of the step, in launch order."""
    tokens: int | None = None
    """Tokens this rank processed in the step; ``None``: not counted."""
    anomalies: list[str] = field(default_factory=list, init=False, repr=False)
    """What construction clamped, one line per mark."""

    def __post_init__(self) -> None:
        if self.tokens is not None and self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens!r}; count the tokens of the step's micro-batches")
        anomalies = self.anomalies = []
        self.exposed = _clamped("exposed", self.exposed, anomalies)
        self.pack = _clamped("pack", self.pack, anomalies)
        collectives = []
        for c in self.collectives:
            if c.completed < c.launched:
                anomalies.append(f"collective {c.op} {c.label!r} ({c.launched}, {c.completed}) completed "
                                 f"{c.launched - c.completed:.3g} ms before its launch")
                c = dataclasses.replace(c, completed=c.launched)  # a copy: the record stays as it was measured
            collectives.append(c)
        self.collectives = collectives
        if not (self.step_ms > 0 and math.isfinite(self.step_ms)):
            anomalies.append(f"step_ms is {self.step_ms!r}, not a positive time; the step's ratios are set to 0")
            self.step_ms = 0.0
            return
        exposed_ms, busy_ms = total(self.exposed), total(busy_intervals(self.collectives))
        if exposed_ms > self.step_ms:
            anomalies.append(f"exposed time {exposed_ms:.6g} ms exceeds the step's {self.step_ms:.6g} ms")
        if busy_ms > self.step_ms:
            anomalies.append(f"busy time {busy_ms:.6g} ms exceeds the step's {self.step_ms:.6g} ms")

    @classmethod
    def from_record(cls, record: SyncRecord, step_ms: float, tokens: int | None) -> StepTiming:
        """From a finished record. Exposed: every interval training waited for communication, whoever waited: the
        engines' ``exposed`` spans, each collective's recorded wait (FSDP2's all-gathers in forward, a blocking
        collective anyone issued) and ``[last_ready, usable]`` when both are marked (torch DDP waits for its buckets
        inside its reducer, where no wait is seen)."""
        exposed = list(record.exposed)
        exposed.extend(c.wait for c in record.collectives if c.wait is not None)
        if record.last_ready is not None and record.usable is not None:
            exposed.append((record.last_ready, record.usable))
        return cls(
            step_ms=step_ms,
            exposed=exposed,
            pack=list(record.pack),
            collectives=list(record.collectives),
            tokens=tokens,
        )


# ---- step metrics -------------------------------------------------------------------------------------

def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of collective ``op`` over ``world_size`` ranks (``nbytes``: the whole buffer);
    a barrier moves no data (the recording group records it with 0 bytes, as Lightning issues one on resume).

    >>> [bus_factor(op, 4) for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")]
    [1.5, 0.75, 0.75, 1.0, 0.75]
    """
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
               "broadcast": 1.0, "reduce": 1.0, "all_to_all": (n - 1) / n, "barrier": 0.0}
    if op not in factors:
        raise ValueError(f"no bus-bandwidth factor for collective {op!r}; known: {', '.join(factors)}")
    return factors[op]


def busy_intervals(collectives: Sequence[Collective]) -> list[Interval]:
    """When each collective was really in flight, one interval each: ``[max(launched_i, end_{i-1}), completed_i]``
    (they run in order), empty for one that completed before the one before it did.

    >>> from lightning_ddp.sync.record import Collective
    >>> busy_intervals([Collective("all_reduce", "b", 8, launched, completed)
    ...                 for launched, completed in [(0.0, 4.0), (1.0, 6.0), (8.0, 9.0)]])  # the second starts at 4
    [(0.0, 4.0), (4.0, 6.0), (8.0, 9.0)]
    """
    out: list[Interval] = []
    previous_end = -math.inf
    for c in collectives:
        start = max(c.launched, previous_end)
        out.append((start, max(start, c.completed)))
        previous_end = max(previous_end, c.completed)
    return out


METRIC_KEYS: tuple[str, ...] = (
    "step/time_ms",
    "comm/exposed_ms",
    "comm/wait_ms",
    "comm/transfer_ms",
    "comm/pack_ms",
    "comm/share",
    "comm/busy_ms",
    "comm/overlap",
    "comm/algbw_GBps",
    "comm/busbw_GBps",
    "comm/calls",
    "comm/bytes",
    "comm/clock_anomalies",
    "step/tokens_per_s",
    "straggler/rank",
    "straggler/lag_ms",
    "step/rank_spread_ms",
    "step/mfu",
    "memory/peak_MiB",
    "memory/peak_reserved_MiB",
)
"""Every key ``step_metrics`` can produce, in order."""


def step_metrics(
    timing: StepTiming,
    world_size: int,
    flops_per_step: float | None = None,
    peak_flops: float | None = None,
    peak_memory_mib: float | None = None,
    peak_reserved_mib: float | None = None,
    straggler: StragglerStats | None = None,
    comm: str | None = "full",
) -> dict[str, float]:
    """The metrics of one optimizer step, each defined where it is computed (``docs/comm_timer.md``, "The keys"); a
    key whose inputs are not given is absent, never 0, and a ratio over a zero denominator is 0. ``comm``: ``"full"``
    every ``comm/`` key, ``None`` (a run without communication: one device) none. ``flops_per_step`` is one rank's,
    ``peak_flops`` the whole job's.
    """
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if comm not in ("full", None):
        raise ValueError(f"comm must be 'full' or None, got {comm!r}")
    for name, value in (("flops_per_step", flops_per_step), ("peak_flops", peak_flops)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 or None (to leave step/mfu out), got {value!r}")
    step_ms = float(timing.step_ms)  # > 0, or 0 where StepTiming clamped a step time that was not
    exposed_ms = total(timing.exposed)
    busy = busy_intervals(timing.collectives)
    busy_ms = total(busy)
    if step_ms > 0:  # more communication than the step is two clocks disagreeing (counted by StepTiming)
        exposed_ms, busy_ms = min(exposed_ms, step_ms), min(busy_ms, step_ms)
    nbytes = sum(c.nbytes for c in timing.collectives)
    bus_bytes = sum(bus_factor(c.op, world_size) * c.nbytes for c in timing.collectives)
    hidden_ms = min(busy_ms, max(0.0, busy_ms - total(intersect(busy, timing.exposed))))
    metrics = {
        # the step's wall time (the timer passes the max over ranks)
        "step/time_ms": step_ms,
        # union(exposed): last gradient computed -> gradients usable, plus the optimizer step's communication
        "comm/exposed_ms": exposed_ms,
        "comm/pack_ms": total(timing.pack),
        "comm/share": exposed_ms / step_ms if step_ms > 0 else 0.0,
        # union(busy_intervals(collectives)): time with a collective in flight
        "comm/busy_ms": busy_ms,
        # the share of busy time outside the exposed intervals
        "comm/overlap": hidden_ms / busy_ms if busy_ms > 0 else 0.0,
        "comm/algbw_GBps": nbytes / (busy_ms / 1e3) / 1e9 if busy_ms > 0 else 0.0,
        "comm/busbw_GBps": bus_bytes / (busy_ms / 1e3) / 1e9 if busy_ms > 0 else 0.0,
        "comm/calls": float(len(timing.collectives)),
        "comm/bytes": float(nbytes),
        "comm/clock_anomalies": float(len(timing.anomalies)),  # marks construction clamped
    }
    if timing.tokens is not None:  # every rank's tokens: this rank's times world_size
        metrics["step/tokens_per_s"] = timing.tokens * world_size / (step_ms / 1e3) if step_ms > 0 else 0.0
    if straggler is not None:
        # waiting for the last rank's launch (overlap of straggler.wait with exposed), and the rest of exposed
        wait_ms = min(total(intersect(straggler.wait, timing.exposed)), exposed_ms)
        metrics.update({"comm/wait_ms": wait_ms, "comm/transfer_ms": exposed_ms - wait_ms})
        if straggler.straggler_rank is not None and straggler.lag_ms is not None:
            # the rank that launched last most often; the median of its launch minus the earliest launch
            metrics["straggler/rank"] = float(straggler.straggler_rank)
            metrics["straggler/lag_ms"] = float(straggler.lag_ms)
        if straggler.rank_spread_ms is not None:  # slowest minus fastest rank's compute
            metrics["step/rank_spread_ms"] = float(straggler.rank_spread_ms)
    if flops_per_step is not None and peak_flops is not None:
        metrics["step/mfu"] = flops_per_step * world_size / (step_ms / 1e3) / peak_flops if step_ms > 0 else 0.0
    if peak_memory_mib is not None:
        metrics["memory/peak_MiB"] = float(peak_memory_mib)
    if peak_reserved_mib is not None:
        metrics["memory/peak_reserved_MiB"] = float(peak_reserved_mib)
    kept = [key for key in METRIC_KEYS if comm == "full" or not key.startswith("comm/")]  # one device: no comm keys
    return {key: metrics[key] for key in kept if key in metrics}


# ---- summary over steps -------------------------------------------------------------------------------


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's default).

    >>> _percentile([10.0, 20.0, 30.0, 40.0, 50.0], 10)  # rank 0.1 * 4 = 0.4: 10 + 0.4 * (20 - 10)
    14.0
    """
    assert sorted_values, "percentile of no values"
    rank = (len(sorted_values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return float(sorted_values[low] + (rank - low) * (sorted_values[high] - sorted_values[low]))


# (column title, metric key, scale, format) of format_table
_TABLE_COLUMNS: tuple[tuple[str, str, float, str], ...] = (
    ("step ms", "step/time_ms", 1.0, ",.1f"),
    ("exposed comm ms", "comm/exposed_ms", 1.0, ",.2f"),
    ("wait ms", "comm/wait_ms", 1.0, ",.2f"),
    ("transfer ms", "comm/transfer_ms", 1.0, ",.2f"),
    ("comm share %", "comm/share", 100.0, ".1f"),
    ("overlap %", "comm/overlap", 100.0, ".1f"),
    ("busbw GB/s", "comm/busbw_GBps", 1.0, ",.3f"),
    ("tokens/s", "step/tokens_per_s", 1.0, ",.0f"),
)


class TimingSummary:
    """Per-step metric dicts of a run (one per optimizer step, steps strictly increasing) and their distribution
    after warm-up."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.metrics: list[dict[str, float]] = []
        self._warned = False

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def clock_anomalies(self) -> int:
        """Marks clamped over every step added, warm-up included."""
        return int(sum(metrics.get("comm/clock_anomalies", 0.0) for metrics in self.metrics))

    def add(self, step: int, metrics: dict[str, float], anomalies: Sequence[str] = ()) -> None:
        """Record step ``step``'s metrics; the first ``anomalies`` of a run warn (``ClockAnomalyWarning``)."""
        if self.steps and step <= self.steps[-1]:
            raise ValueError(
                f"step {step} was added after step {self.steps[-1]}; add metrics once per optimizer step, when "
                "gradient accumulation is over, not once per micro-batch"
            )
        self.steps.append(int(step))
        self.metrics.append({key: float(value) for key, value in metrics.items()})
        if anomalies and not self._warned:
            self._warned = True
            shown = "; ".join(anomalies[:3]) + (f"; and {len(anomalies) - 3} more" if len(anomalies) > 3 else "")
            warnings.warn(f"step {step}: {len(anomalies)} inconsistent timing mark(s) clamped: {shown}; likely two "
                          "clocks joined by one anchor. Training goes on, each step counting them in "
                          "comm/clock_anomalies; warned once per run (docs/comm_timer.md, \"Clocks\")",
                          ClockAnomalyWarning, stacklevel=2)

    def summarize(self, warmup_steps: int) -> dict[str, dict[str, float]]:
        """``{key: {"median", "p10", "p90", "n"}}`` over the steps left after the first ``warmup_steps``."""
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        kept = self.metrics[warmup_steps:]
        if not kept:
            raise ValueError(
                f"ran {len(self.steps)} steps but warmup_steps={warmup_steps}; lower --timer.warmup_steps or run "
                "more steps"
            )
        keys = list(dict.fromkeys(key for metrics in kept for key in metrics))  # first-seen order
        summary: dict[str, dict[str, float]] = {}
        for key in keys:
            values = sorted(metrics[key] for metrics in kept if key in metrics)
            summary[key] = {stat: _percentile(values, q) for stat, q in (("median", 50), ("p10", 10), ("p90", 90))}
            summary[key]["n"] = float(len(values))
        return summary

    def to_rows(self) -> list[dict[str, float]]:
        """One row per step added (warm-up included): ``{"step": step, **metrics}``."""
        return [{"step": step, **metrics} for step, metrics in zip(self.steps, self.metrics)]

    def write_json(self, path: str | os.PathLike, warmup_steps: int, extra: dict[str, Any] | None = None) -> None:
        """Write ``{**extra, "warmup_steps", "summary", "clock_anomalies", "steps"}`` to ``path`` atomically."""
        document = {**(extra or {}), "warmup_steps": warmup_steps, "summary": self.summarize(warmup_steps),
                    "clock_anomalies": self.clock_anomalies}
        document["steps"] = self.to_rows()
        # allow_nan=False: a NaN would make the file invalid JSON; fail here instead of in the reader.
        write_json_atomically(path, document, allow_nan=False)

    def write_csv(self, path: str | os.PathLike) -> None:
        """Write ``to_rows()`` to ``path`` atomically; a missing key is an empty cell."""
        rows = self.to_rows()
        columns = list(dict.fromkeys(key for row in rows for key in row)) or ["step"]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(path, buffer.getvalue())

    def format_table(self, warmup_steps: int, title: str | None = None) -> str:
        """An aligned text table of the headline metrics (median, p10, p90)."""
        summary = self.summarize(warmup_steps)
        # The straggler split is there only when the ranks exchanged launch times: its columns only then.
        columns = [c for c in _TABLE_COLUMNS if c[1] in summary or c[1] not in ("comm/wait_ms", "comm/transfer_ms")]
        heading = f"{len(self.steps) - warmup_steps} steps after {warmup_steps} warm-up"
        lines = [f"{title}: {heading}" if title else heading]
        header = [""] + [name for name, _, _, _ in columns]
        body = []
        for stat in ("median", "p10", "p90"):
            row = [stat]
            for _, key, scale, spec in columns:
                if key in summary:
                    row.append(format(summary[key][stat] * scale, spec))
                else:
                    row.append("-")
            body.append(row)
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        for row in [header, *body]:
            cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
            lines.append("  ".join(cells).rstrip())
        if self.clock_anomalies:
            steps = sum(1 for metrics in self.metrics if metrics.get("comm/clock_anomalies", 0.0) > 0)
            lines.append(f"clock anomalies: {self.clock_anomalies} marks clamped in {steps} of {len(self.steps)} steps "
                         "(comm/clock_anomalies; the first is described in the run's ClockAnomalyWarning)")
        return "\n".join(lines)
