"""One ``Recorder`` per training run, shared by every observer (``CommTimer``, ``TraceRecorder``), with every
collective of the run's process groups recorded into it (``sync/recording_group.py``); what the timer can measure of
a run (``comm_recording``); and the communication track the ``TraceRecorder`` adds to a profiler's Chrome trace from
it (``lightning_ddp.trace`` reads it back). ``docs/comm_timer.md``.
"""

from __future__ import annotations

import statistics
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

import torch.distributed as dist

from lightning_ddp.intervals import Interval
from lightning_ddp.metrics.accounting import busy_intervals
from lightning_ddp.sync import ranges
from lightning_ddp.sync.record import Collective, Recorder
from lightning_ddp.sync.recording_group import record_process_groups, stop_recording_process_groups

SUMMARY_SCHEMA = "lightning_ddp.timing_summary/3"
"""``timing_summary.json``'s version: 2 added ``collectives`` (``call_table``), 3 their process ``group``."""

CommRecording = Optional[Literal["full"]]
"""What the ``CommTimer`` measures of a run's communication: every collective (``"full"``), or none (no process
group: one device)."""

_RECORDERS: "weakref.WeakKeyDictionary[Any, Recorder]" = weakref.WeakKeyDictionary()


def recorder_for(trainer: Any) -> Recorder:
    """The recorder of this run (keyed by its strategy), with every collective of the run's process groups recorded
    into it and, for our strategies, the spans of their critical path. Call it before the strategy wraps the model
    (an observer's ``setup``): what captures a process group then captures the recording one."""
    strategy = trainer.strategy
    recorder = _RECORDERS.get(strategy)
    if recorder is None:
        recorder = Recorder(strategy.root_device, open_on_demand=False)  # armed only in the steps observers open
        _RECORDERS[strategy] = recorder
        if dist.is_available() and dist.is_initialized():
            record_process_groups(recorder)
        if hasattr(strategy, "attach_recorder"):
            strategy.attach_recorder(recorder)
    return recorder


def release_recorder(trainer: Any) -> None:
    """Stop recording this run (at the end of fit): the process groups go back to torch's own."""
    strategy = trainer.strategy
    recorder = _RECORDERS.pop(strategy, None)
    if recorder is None:
        return
    recorder.unwatch_gradients()
    if hasattr(strategy, "attach_recorder"):
        strategy.attach_recorder(None)
    if dist.is_available() and dist.is_initialized():
        stop_recording_process_groups()


def comm_recording() -> CommRecording:
    """What the timer measures of this run: every collective of its process groups (``"full"``), or, without a
    process group (one device), no communication at all (``None``)."""
    return "full" if dist.is_available() and dist.is_initialized() else None


def strategy_label(strategy: Any) -> str:
    """The name a strategy is selected by: its ``strategy_name``, else the most specific ``StrategyRegistry`` entry
    of exactly its class whose settings it has (``ddp``, not ``ddp_spawn``), else its class name."""
    name = getattr(strategy, "strategy_name", "")
    if name:
        return name
    from lightning.pytorch.strategies import StrategyRegistry

    def has(key: str, value: Any) -> bool:
        return getattr(strategy, f"_{key}", getattr(strategy, key, object())) == value

    # The most specific entry the instance matches; among equals the shortest name (``ddp`` before its aliases).
    matches = [(len(entry["init_params"]), -len(registered), registered)
               for registered, entry in StrategyRegistry.items()
               if entry["strategy"] is type(strategy) and all(has(k, v) for k, v in entry["init_params"].items())]
    return max(matches)[2] if matches else type(strategy).__name__


def measurement_note(strategy: Any, level: CommRecording) -> str | None:
    """The one line the ``CommTimer`` says at the start of a run it measures without communication (``None``
    otherwise)."""
    if level == "full":
        return None
    measured = "step time, throughput (when the module counts tokens or FLOPs), memory and the compute profile"
    return (f"CommTimer on {strategy_label(strategy)} (one device): measures {measured}; no gradient communication, "
            "no comm/* metrics")


def collective_calls(collectives: Sequence[Any]) -> list[tuple[str, str, int, float]]:
    """``(group, op, bytes, busy ms)`` per collective of a finished step (ms marks): the length of its
    ``busy_intervals``."""
    return [(c.group, c.op, int(c.nbytes), end - start)
            for c, (start, end) in zip(collectives, busy_intervals(collectives))]


def call_table(calls: dict[tuple[str, str, int], list[float]]) -> list[dict[str, Any]]:
    """``timing_summary.json``'s ``collectives``: per (group, op, bytes) of the measured steps after warm-up, the
    count and the median busy ms (what ``python -m lightning_ddp advise`` fits latency and bandwidth to)."""
    return [{"group": group, "op": op, "bytes": nbytes, "count": len(times), "median_ms": statistics.median(times)}
            for (group, op, nbytes), times in sorted(calls.items())]


def format_call_table(calls: Sequence[dict[str, Any]]) -> str:
    """``call_table``'s rows as the aligned text the timer prints at the end of fit, one line per (group, op, bytes).

    >>> print(format_call_table([{"group": "world", "op": "all_reduce", "bytes": 2_097_152, "count": 30,
    ...                           "median_ms": 1.5}]))
    collectives after warm-up, by process group
    group  op          bytes/call  calls  median ms/call
    world  all_reduce   2,097,152     30           1.500
    """
    header = ["group", "op", "bytes/call", "calls", "median ms/call"]
    rows = [[row["group"], row["op"], f"{row['bytes']:,}", str(row["count"]), f"{row['median_ms']:.3f}"]
            for row in calls]
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["collectives after warm-up, by process group"]
    for line in [header, *rows]:
        text = [line[0].ljust(widths[0]), line[1].ljust(widths[1])]
        text += [cell.rjust(width) for cell, width in zip(line[2:], widths[2:])]
        lines.append("  ".join(text).rstrip())
    return "\n".join(lines)


# ---- the communication track of a trace ------------------------------------------------------------------

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
) -> None:
    """Add each step's collectives as ``X`` events on lanes ``COMM_THREAD_NAME`` in process ``pid`` (anchors on
    thread ``tid``; a step without one is skipped), with ``metadata`` under ``trace[METADATA_KEY]``."""
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
