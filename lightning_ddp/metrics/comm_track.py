"""The communication track the ``TraceRecorder`` adds to a rank's Chrome trace: every recorded collective, launch to
completion, placed on the profiler's clock by the ``ddp/step#N`` anchors (``lightning_ddp.trace`` reads it back).
The clock alignment and its error bound: ``docs/comm_timer.md``, "Traces".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_ddp.intervals import Interval
from lightning_ddp.sync import ranges
from lightning_ddp.sync.record import Collective

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


@dataclass(frozen=True)
class StepAnchor:
    """A recorded step whose ``ddp/step#N`` range the profiler stamped: where ``perf_counter`` lies on its clock."""

    recorded: RecordedStep
    midpoint_s: float
    """``perf_counter()`` halfway between the two reads around the range's opening, which the stamp lies between."""
    half_width_us: float
    """Half the time between those reads: how far the stamp can be from the midpoint."""
    offset_us: float
    """The stamp minus the midpoint: ``ts = perf_counter_s * 1e6 + offset_us``."""

    def uncertainty_us(self, at_s: float) -> float:
        """How far off this anchor's offset can be for a moment ``at_s`` (``perf_counter`` seconds): its half-width
        plus the clocks' greatest drift over the time between."""
        return self.half_width_us + MAX_DRIFT_US_PER_S * abs(self.midpoint_s - at_s)


@dataclass(frozen=True)
class PlacedCollective:
    """A collective of step ``step`` with the offset that puts its marks on the profiler's clock."""

    collective: Collective
    step: int
    offset_us: float


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
) -> None:
    """Add each step's collectives as ``X`` events on lanes ``COMM_THREAD_NAME`` in process ``pid`` (anchors on
    thread ``tid``; a step without one is skipped), with ``metadata`` under ``trace[METADATA_KEY]``."""
    anchors = step_anchors(trace, steps, pid, tid)
    placed: list[PlacedCollective] = []
    step_meta = []
    for own in anchors:
        # the tightest anchor for this step: its own, or a neighbour's if this one's reads were far apart
        anchor = min(anchors, key=lambda candidate: candidate.uncertainty_us(own.midpoint_s))
        step = own.recorded.step
        step_meta.append({"step": step, "anchor_step": anchor.recorded.step, "offset_us": anchor.offset_us,
                          "uncertainty_us": anchor.uncertainty_us(own.midpoint_s),
                          "own_anchor_uncertainty_us": own.half_width_us,
                          "collectives": len(own.recorded.collectives)})
        placed += [PlacedCollective(c, step, anchor.offset_us) for c in own.recorded.collectives]
    placed.sort(key=lambda item: item.collective.launched)
    lanes = assign_lanes([(item.collective.launched, item.collective.completed) for item in placed])
    events = trace["traceEvents"]
    for item, lane in zip(placed, lanes):
        events.append(_collective_event(item, pid, COMM_TID_BASE + lane))
    for lane in sorted(set(lanes)):
        events += _lane_name_events(pid, tid, lane)
    trace[ranges.METADATA_KEY] = {**metadata, "pid": pid, "tid": tid, "steps": step_meta}


def _collective_event(item: PlacedCollective, pid: int, lane_tid: int) -> dict[str, Any]:
    """The ``X`` event of one collective, launch to completion, on the profiler's clock."""
    collective = item.collective
    args = {"label": collective.label, "bytes": collective.nbytes, "step": item.step}
    if collective.wait is not None:
        wait_start, wait_end = collective.wait
        args["wait_us"] = round((wait_end - wait_start) * 1e6, 3)
    in_flight_s = max(0.0, collective.completed - collective.launched)
    return {"ph": "X", "cat": ranges.COMM_CATEGORY, "name": collective.op, "pid": pid, "tid": lane_tid,
            "ts": round(collective.launched * 1e6 + item.offset_us, 3), "dur": round(in_flight_s * 1e6, 3),
            "args": args}


def _lane_name_events(pid: int, tid: int, lane: int) -> list[dict[str, Any]]:
    """The metadata events that name lane ``lane`` and sort it right below the training thread ``tid`` (kineto
    sorts threads by tid)."""
    name = ranges.COMM_THREAD_NAME + (f" #{lane}" if lane else "")
    lane_tid = COMM_TID_BASE + lane
    return [{"ph": "M", "name": "thread_name", "pid": pid, "tid": lane_tid, "args": {"name": name}},
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": lane_tid,
             "args": {"sort_index": tid + 1 + lane}}]


def step_anchors(trace: dict[str, Any], steps: list[RecordedStep], pid: int, tid: int) -> list[StepAnchor]:
    """The anchor of every step in ``steps`` whose ``ddp/step#N`` range the trace holds on thread ``tid``."""
    stamps = {}  # step range name -> its ts
    for event in trace["traceEvents"]:
        on_thread = event.get("ph") == "X" and event.get("pid") == pid and event.get("tid") == tid
        if on_thread and str(event.get("name", "")).startswith(ranges.STEP):
            stamps[event["name"]] = float(event["ts"])
    anchors = []
    for recorded in steps:
        stamp = stamps.get(ranges.step_range_name(recorded.step))
        if stamp is not None:
            before, after = recorded.anchor
            midpoint_s = (before + after) / 2
            anchors.append(StepAnchor(recorded=recorded, midpoint_s=midpoint_s,
                                      half_width_us=(after - before) / 2 * 1e6, offset_us=stamp - midpoint_s * 1e6))
    return anchors
