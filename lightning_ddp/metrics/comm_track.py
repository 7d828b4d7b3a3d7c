"""The communication track the ``TraceRecorder`` adds to a profiler's Chrome trace: each collective of the
engine's ``SyncRecord``, launch -> completion, on the trace's clock (``lightning_ddp.trace.chrome`` reads it back;
``docs/comm_timer.md``, "Traces: the communication track").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_ddp.intervals import Interval
from lightning_ddp.sync import ranges

if TYPE_CHECKING:
    from lightning_ddp.sync.record import Collective

__all__ = ["COMM_TID_BASE", "MAX_DRIFT_US_PER_S", "TRACE_SUFFIX", "RecordedStep", "add_communication_track",
           "assign_lanes"]

MAX_DRIFT_US_PER_S = 500.0
"""How fast the wall clock (kineto's ``ts``) may drift from ``perf_counter``: NTP's maximum slew, 500 ppm."""
COMM_TID_BASE = 2**30
"""Thread ids of the communication track's lanes: far above any real Linux tid (``pid_max`` <= 2**22)."""
TRACE_SUFFIX = ".pt.trace.json"
"""What every rank's trace file name ends with (``rank{R}.pt.trace.json``)."""


@dataclass
class RecordedStep:
    """What the recorder keeps per traced optimizer step: its number, clock anchor and collectives."""

    step: int
    anchor: tuple[float, float]
    """``perf_counter()`` right before and right after opening the ``ddp/step#N`` range."""
    collectives: list[Collective] = field(default_factory=list)
    """The step's collectives with every mark in host seconds (``SyncRecord.in_host_seconds``)."""


def assign_lanes(intervals: list[Interval]) -> list[int]:
    """Greedy lanes so that intervals in one lane never overlap (Chrome ``X`` events on one thread must nest)."""
    lane_end: list[float] = []
    lanes = []
    for start, end in intervals:
        for lane, busy_until in enumerate(lane_end):
            if busy_until <= start:
                break
        else:
            lane = len(lane_end)
            lane_end.append(start)
        lane_end[lane] = end
        lanes.append(lane)
    return lanes


def add_communication_track(
    trace: dict[str, Any], steps: list[RecordedStep], pid: int, tid: int, metadata: dict[str, Any]
) -> dict[str, Any]:
    """Add each step's collectives as ``X`` events on lanes ``COMM_THREAD_NAME`` in process ``pid`` (anchors on
    thread ``tid``; a step without one is skipped), with ``metadata`` under ``trace[METADATA_KEY]``; returns it."""
    measured = _measured_anchors(trace, steps, pid, tid)
    placed: list[tuple[Collective, int, float]] = []  # (collective, step, offset_us)
    step_meta = []
    for record, mid, own_bound, _ in measured:
        # the tightest anchor for this step: its own, or a neighbour's if this one's reads were far apart
        bound = lambda a: a[2] + MAX_DRIFT_US_PER_S * abs(a[1] - mid)  # noqa: E731
        anchor = min(measured, key=bound)
        step_meta.append({"step": record.step, "anchor_step": anchor[0].step, "offset_us": anchor[3],
                          "uncertainty_us": bound(anchor), "own_anchor_uncertainty_us": own_bound,
                          "collectives": len(record.collectives)})
        placed.extend((c, record.step, anchor[3]) for c in record.collectives)
    placed.sort(key=lambda item: item[0].launched)
    lanes = assign_lanes([(c.launched, c.completed) for c, _, _ in placed])
    events = trace["traceEvents"]
    for (c, step, offset_us), lane in zip(placed, lanes):
        args = {"label": c.label, "bytes": c.nbytes, "step": step}
        if c.wait is not None:
            args["wait_us"] = round((c.wait[1] - c.wait[0]) * 1e6, 3)
        events.append({
            "ph": "X", "cat": ranges.COMM_CATEGORY, "name": c.op, "pid": pid, "tid": COMM_TID_BASE + lane,
            "ts": round(c.launched * 1e6 + offset_us, 3), "dur": round(max(0.0, c.completed - c.launched) * 1e6, 3),
            "args": args,
        })
    for lane in sorted(set(lanes)):
        name = ranges.COMM_THREAD_NAME + (f" #{lane}" if lane else "")
        lane_tid = COMM_TID_BASE + lane
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane_tid, "args": {"name": name}})
        # sort right below the training thread (kineto sorts threads by tid)
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": lane_tid,
                       "args": {"sort_index": tid + 1 + lane}})
    trace[ranges.METADATA_KEY] = {**metadata, "pid": pid, "tid": tid, "steps": step_meta}
    return trace


def _measured_anchors(trace: dict[str, Any], steps: list[RecordedStep], pid: int,
                      tid: int) -> list[tuple[RecordedStep, float, float, float]]:
    """(step, anchor midpoint in perf_counter seconds, half-width in us, offset in us) of every anchored step."""
    anchors = {
        e["name"]: float(e["ts"])
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") == tid
        and str(e.get("name", "")).startswith(ranges.STEP)
    }
    measured = []
    for record in steps:
        ts = anchors.get(ranges.step_range_name(record.step))
        if ts is not None:
            before, after = record.anchor
            mid = (before + after) / 2
            measured.append((record, mid, (after - before) / 2 * 1e6, ts - mid * 1e6))
    return measured
