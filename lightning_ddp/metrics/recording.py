"""One ``Recorder`` per training run, shared by every observer (``CommTimer``, ``TraceRecorder``), what it can see
of a strategy (``comm_recording``), and the communication track the ``TraceRecorder`` adds to a profiler's Chrome
trace from it (``lightning_ddp.trace`` reads it back). ``docs/comm_timer.md``.
"""

from __future__ import annotations

import statistics
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp.intervals import Interval
from lightning_ddp.metrics.accounting import busy_intervals
from lightning_ddp.sync import ranges
from lightning_ddp.sync.comm import Communicator
from lightning_ddp.sync.record import Collective, Recorder

SUMMARY_SCHEMA = "lightning_ddp.timing_summary/2"
"""``timing_summary.json``'s version: 2 added ``collectives`` (``call_table``); a summary without one is version 1."""

CommRecording = Optional[Literal["full", "landmarks"]]
COMM_RECORDING_LEVELS: tuple[CommRecording, ...] = ("full", "landmarks", None)
"""What the ``CommTimer`` can see of a strategy's communication: every collective, the landmarks, nothing."""

_RECORDERS: "weakref.WeakKeyDictionary[Any, Recorder]" = weakref.WeakKeyDictionary()


def recorder_for(trainer: Any) -> Recorder:
    """The recorder of this run (keyed by its strategy), with the run's gradient collectives recorded into it."""
    strategy = trainer.strategy
    recorder = _RECORDERS.get(strategy)
    if recorder is None:
        recorder = Recorder(strategy.root_device, open_on_demand=False)  # armed only in the steps observers open
        _RECORDERS[strategy] = recorder
        if hasattr(strategy, "attach_recorder"):
            strategy.attach_recorder(recorder)
        elif isinstance(strategy.model, DistributedDataParallel):
            record_torch_ddp(strategy.model, recorder)
    return recorder


def release_recorder(trainer: Any) -> None:
    """Stop recording this run's collectives into its recorder (at the end of fit)."""
    strategy = trainer.strategy
    recorder = _RECORDERS.pop(strategy, None)
    if recorder is None:
        return
    recorder.unwatch_gradients()
    if hasattr(strategy, "attach_recorder"):
        strategy.attach_recorder(None)


def record_torch_ddp(model: DistributedDataParallel, recorder: Recorder) -> None:
    """Register a comm hook on ``model`` that records its bucket all-reduces into ``recorder``; a warning if the
    model already has one (DDP takes a single hook)."""
    comm = Communicator(model.process_group)
    comm.recorder = recorder

    # No annotations: DDP checks a hook's annotations against dist.GradBucket / Future, and this module's are strings.
    def allreduce_recorded(state, bucket):  # noqa: ANN001, ANN202
        # torch's allreduce_hook (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py): pre-divide, then
        # an async SUM all-reduce of the bucket's flat buffer; the future resolves to the averaged buffer.
        tensor = bucket.buffer()
        with comm.span("pack"):
            tensor.div_(comm.world_size)
        pending = comm.all_reduce(tensor, f"ddp bucket {bucket.index()}")
        return pending.work.get_future().then(lambda future: future.value()[0])

    try:
        model.register_comm_hook(None, allreduce_recorded)
    except RuntimeError as error:  # "register_comm_hook ... can only be called once"
        warnings.warn(
            f"CommTimer cannot record torch DDP's collectives: the model already has a communication hook ({error}). "
            "Its step time and exposed communication are still measured; busy time and bandwidth are not.",
            stacklevel=2,
        )


def comm_recording(strategy: Any) -> CommRecording:
    """How much of ``strategy``'s gradient communication the recorder sees, one of ``COMM_RECORDING_LEVELS``
    (``ValueError`` for a strategy that declares another)."""
    if hasattr(strategy, "comm_recording"):
        declared = strategy.comm_recording
        if declared not in COMM_RECORDING_LEVELS:
            raise ValueError(f"{type(strategy).__name__}.comm_recording is {declared!r}; declare one of "
                             f"{', '.join(map(repr, COMM_RECORDING_LEVELS))}")
        return declared
    from lightning.pytorch.strategies import DDPStrategy

    # ours: the engine records every collective; torch DDP: its buckets are recorded through a comm hook
    return "full" if hasattr(strategy, "attach_recorder") or isinstance(strategy, DDPStrategy) else None


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


def measurement_note(strategy: Any, level: CommRecording, world_size: int) -> str | None:
    """The one line the ``CommTimer`` says once when it cannot measure everything (``None`` for ``"full"``)."""
    if level == "full":
        return None
    name = strategy_label(strategy)
    measured = "step time, throughput (when the module counts tokens or FLOPs), memory and the compute profile"
    see = ' (docs/comm_timer.md, "What each strategy lets us measure")'
    if level == "landmarks":
        return (f"CommTimer on {name}: measures {measured} and comm/exposed_ms, comm/share; its collectives are not "
                f"recorded, so comm/busy_ms, comm/overlap and the bandwidths are not logged{see}")
    if world_size == 1 and not hasattr(strategy, "comm_recording"):
        return f"CommTimer on {name} (one device): measures {measured}; no gradient communication, no comm/* metrics"
    return f"CommTimer cannot record {name}'s communication: it measures {measured}, but no comm/* metrics{see}"


def collective_calls(collectives: Sequence[Any]) -> list[tuple[str, int, float]]:
    """``(op, bytes, busy ms)`` per collective of a finished step (ms marks): the length of its ``busy_intervals``."""
    return [(c.op, int(c.nbytes), end - start) for c, (start, end) in zip(collectives, busy_intervals(collectives))]


def call_table(calls: dict[tuple[str, int], list[float]]) -> list[dict[str, Any]]:
    """``timing_summary.json``'s ``collectives``: per (op, bytes) of the measured steps after warm-up, the count and
    the median busy ms (what ``python -m lightning_ddp advise`` fits latency and bandwidth to)."""
    return [{"op": op, "bytes": nbytes, "count": len(times), "median_ms": statistics.median(times)}
            for (op, nbytes), times in sorted(calls.items())]


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
