"""One ``Recorder`` per training run, shared by every observer (``CommTimer``, ``TraceRecorder``), with every
collective of the run's process groups recorded into it (``sync/recording_group.py``); what the timer can measure of
a run (``comm_recording``); the collectives' table of ``timing_summary.json``. ``docs/comm_timer.md``.
"""

from __future__ import annotations

import statistics
import weakref
from typing import Any, Literal, Optional, Sequence

import torch.distributed as dist

from lightning_ddp import compat
from lightning_ddp.metrics.accounting import busy_intervals
from lightning_ddp.sync.record import Recorder
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

    def has_settings(entry: dict[str, Any]) -> bool:
        settings = entry["init_params"].items()
        return entry["strategy"] is type(strategy) and all(compat.strategy_setting(strategy, name) == value
                                                           for name, value in settings)

    # The most specific entry the instance matches; among equals the shortest name (``ddp`` before its aliases).
    matches = [(len(entry["init_params"]), -len(registered), registered)
               for registered, entry in StrategyRegistry.items() if has_settings(entry)]
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
