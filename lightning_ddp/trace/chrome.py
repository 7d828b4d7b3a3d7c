"""Chrome-trace JSON in and out: our communication track in, per-rank intervals out.

The profiler (kineto) writes ``ts`` in microseconds on its own clock (Unix time minus the file's
``baseTimeNanoseconds``); the engines' ``SyncRecord`` marks are ``time.perf_counter()`` seconds (CPU) or CUDA
events converted to host seconds. To put our intervals on the trace's axis we never compare the two clocks
directly. Instead, each recorded step opens a ``ddp/step#N`` range between two ``perf_counter()`` reads
``before`` and ``after``; the profiler stamps the range's ``ts`` in between, so::

    offset_us  = ts(ddp/step#N) - (before + after) / 2 * 1e6
    ts(mark)   = mark * 1e6 + offset_us                           # error <= (after - before) / 2 * 1e6

The half-width ``(after - before) / 2`` is typically 15-100 us on our loaded 2-core CPU machine, far below a
collective's duration; but a thread descheduled between the two reads widens it to milliseconds (observed:
4.4 ms). So each step uses the anchor, among all steps', with the smallest error bound
``half-width + MAX_DRIFT_US_PER_S * |time between the two anchors|``: its own anchor when that is tight, a
neighbour's when not. Kineto's clock is the wall clock, which NTP may slew by at most 500 ppm against
``perf_counter``'s monotonic clock (observed: offsets of different steps agree within a few microseconds).
The chosen anchor and its bound are stored per step in the metadata.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from lightning_ddp.intervals import Interval, merge, subtract
from lightning_ddp.sync import ranges
from lightning_ddp.trace.overlap import Overlap, comm_compute_overlap

if TYPE_CHECKING:
    from lightning_ddp.sync.record import Collective

MAX_DRIFT_US_PER_S = 500.0
"""Bound on how fast the wall clock (kineto's ``ts``) may drift from ``perf_counter``: NTP's maximum slew, 500 ppm."""
COMM_TID_BASE = 2**30
"""Thread ids of the communication track's lanes: far above any real Linux tid (``pid_max`` <= 2**22)."""
TRACE_SUFFIX = ".pt.trace.json"
PROFILER_COMM_RE = re.compile(r"^(gloo:|nccl.*Kernel)")
"""Profiler events that are communication: gloo's per-collective ranges on its worker threads, NCCL kernels
(HTA's ``^nccl.*Kernel``)."""
GPU_KERNEL_CATEGORY = "kernel"
"""``cat`` of the GPU kernels kineto records (CUDA activity); memory copies and sets are ``gpu_memcpy`` and
``gpu_memset``, which HTA counts as neither computation nor communication."""


@dataclass
class RecordedStep:
    """What the recorder keeps per traced optimizer step: its number, clock anchor and collectives."""

    step: int
    anchor: tuple[float, float]
    """``perf_counter()`` right before and right after opening the ``ddp/step#N`` range."""
    collectives: list[Collective] = field(default_factory=list)
    """The step's collectives with every mark in host seconds (``SyncRecord.in_host_seconds``)."""


def assign_lanes(intervals: list[Interval]) -> list[int]:
    """Greedy lanes so that intervals in one lane never overlap (Chrome ``X`` events on one thread must nest).

    >>> assign_lanes([(0, 4), (1, 2), (3, 5), (4, 6)])
    [0, 1, 1, 0]
    """
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
    """Add each step's collectives as ``X`` events on lanes named ``COMM_THREAD_NAME`` in process ``pid``.

    ``tid`` is the training thread, where the ``ddp/step#N`` anchors are. Steps whose anchor is not in the trace
    (e.g. the profiler's warm-up) are skipped. Writes ``metadata`` plus the per-step anchors under
    ``trace[METADATA_KEY]`` and returns ``trace``.
    """
    anchors = {
        e["name"]: float(e["ts"])
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") == tid and str(e.get("name", "")).startswith(ranges.STEP)
    }
    # (step, anchor midpoint in perf_counter seconds, half-width in us, offset in us) of every anchored step
    measured = []
    for record in steps:
        ts = anchors.get(ranges.step_range_name(record.step))
        if ts is not None:
            before, after = record.anchor
            mid = (before + after) / 2
            measured.append((record.step, mid, (after - before) / 2 * 1e6, ts - mid * 1e6))
    placed: list[tuple[Collective, int, float]] = []  # (collective, step, offset_us)
    step_meta = []
    for step, mid, _, _ in measured:
        record = next(r for r in steps if r.step == step)
        # the tightest anchor for this step: its own, or a neighbour's if this one's reads were far apart
        bound = lambda a: a[2] + MAX_DRIFT_US_PER_S * abs(a[1] - mid)  # noqa: E731
        anchor = min(measured, key=bound)
        step_meta.append({"step": step, "anchor_step": anchor[0], "offset_us": anchor[3], "uncertainty_us": bound(anchor),
                          "own_anchor_uncertainty_us": next(m[2] for m in measured if m[0] == step),
                          "collectives": len(record.collectives)})
        placed.extend((c, step, anchor[3]) for c in record.collectives)
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
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": COMM_TID_BASE + lane, "args": {"name": name}})
        # sort right below the training thread (kineto sorts threads by tid)
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": COMM_TID_BASE + lane,
                       "args": {"sort_index": tid + 1 + lane}})
    trace[ranges.METADATA_KEY] = {**metadata, "pid": pid, "tid": tid, "steps": step_meta}
    return trace


# -- reading ----------------------------------------------------------------------------------------------------


@dataclass
class CommEvent:
    """A collective in flight on the trace's axis (microseconds)."""

    start: float
    end: float
    name: str
    label: str = ""


@dataclass
class RankTrace:
    """One rank's trace reduced to what the timeline needs; times in trace microseconds."""

    path: Path
    rank: int
    label: str
    steps: list[tuple[int, Interval]]
    """``(step number, (start, end))`` of each ``ddp/step#N`` range, in time order."""
    ranges: dict[str, list[Interval]]
    """Our ranges on the training thread (``lightning_ddp.sync.ranges``), by name."""
    record_comm: list[CommEvent]
    """The communication track (SyncRecord: launch -> completion); empty for strategies without a SyncRecord."""
    profiler_comm: list[CommEvent]
    """What the profiler itself recorded as communication: gloo's ranges on its threads, NCCL kernels."""
    gpu_compute: list[Interval] = field(default_factory=list)
    """GPU kernels that are not communication (CUDA traces only; HTA's computation kernels), merged."""

    def comm(self, source: str = "auto") -> list[CommEvent]:
        """Collectives from ``record`` (SyncRecord), ``profiler`` (gloo threads / NCCL kernels), or ``auto``."""
        if source not in ("auto", "record", "profiler"):
            raise ValueError(f"comm source {source!r} is not one of 'auto', 'record', 'profiler'")
        if source == "record" or (source == "auto" and self.record_comm):
            return self.record_comm
        return self.profiler_comm

    def compute(self) -> list[Interval]:
        """When the rank computed.

        On CUDA (the trace has GPU kernels): the non-communication kernels, as HTA does. The host ranges only say
        when the kernels were *queued* (the host runs ahead of the GPU), while communication is in GPU time.
        On CPU: forward, backward and optimizer time on the training thread, minus its time inside collective
        calls.
        """
        if self.gpu_compute:
            return self.gpu_compute
        busy = [i for name in ranges.COMPUTE_RANGES for i in self.ranges.get(name, [])]
        calls = [i for name in ranges.COMM_CALL_RANGES for i in self.ranges.get(name, [])]
        return subtract(busy, calls)

    def window(self, steps: int | None = None) -> Interval:
        """From the first recorded step's start to the end of the ``steps``-th (all steps when ``None``)."""
        if not self.steps:
            raise ValueError(f"{self.path} has no {ranges.STEP}#N ranges: was it recorded by lightning_ddp's TraceRecorder?")
        shown = self.steps if steps is None else self.steps[:steps]
        return shown[0][1][0], shown[-1][1][1]

    def overlap(self, source: str = "auto", window: Interval | None = None) -> Overlap:
        """HTA overlap of this rank (``lightning_ddp.trace.overlap``) inside ``window`` (default: all steps)."""
        lo, hi = window if window is not None else self.window()
        comm = clip([(c.start, c.end) for c in self.comm(source)], lo, hi)
        return comm_compute_overlap(comm, clip(self.compute(), lo, hi))


def clip(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    return merge((max(s, lo), min(e, hi)) for s, e in intervals)


def load_rank_trace(path: str | Path) -> RankTrace:
    """Read one rank's Chrome trace (as written by ``TraceRecorder``) into a ``RankTrace``."""
    path = Path(path)
    with open(path) as f:
        trace = json.load(f)
    meta = trace.get(ranges.METADATA_KEY, {})
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    pid, tid = meta.get("pid"), meta.get("tid")
    if tid is None:  # not augmented by the recorder: the training thread is where the step ranges are
        step_events = [e for e in events if str(e.get("name", "")).startswith(ranges.STEP)]
        if step_events:
            pid, tid = step_events[0]["pid"], step_events[0]["tid"]
    main = [e for e in events if e.get("pid") == pid and e.get("tid") == tid]
    own = {name: [] for name in (*ranges.COMPUTE_RANGES, *ranges.COMM_CALL_RANGES)}
    steps = []
    for e in main:
        interval = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        name = e["name"]
        if name in own:
            own[name].append(interval)
        elif name.startswith(ranges.STEP + "#"):
            steps.append((int(name.rsplit("#", 1)[1]), interval))
    steps.sort(key=lambda s: s[1][0])
    record_comm, profiler_comm, gpu_compute = [], [], []
    for e in events:
        start = float(e["ts"])
        end = start + float(e.get("dur", 0.0))
        communication = PROFILER_COMM_RE.match(str(e.get("name", "")))
        if e.get("cat") == ranges.COMM_CATEGORY:
            record_comm.append(CommEvent(start, end, e["name"], e.get("args", {}).get("label", "")))
        elif communication and not (e.get("pid") == pid and e.get("tid") == tid):
            profiler_comm.append(CommEvent(start, end, e["name"]))
        elif e.get("cat") == GPU_KERNEL_CATEGORY:
            gpu_compute.append((start, end))
    rank = meta.get("rank", trace.get("distributedInfo", {}).get("rank", 0))
    return RankTrace(
        path=path,
        rank=int(rank),
        label=str(meta.get("strategy", path.parent.name)),
        steps=steps,
        ranges={name: sorted(v) for name, v in own.items()},
        record_comm=sorted(record_comm, key=lambda c: c.start),
        profiler_comm=sorted(profiler_comm, key=lambda c: c.start),
        gpu_compute=merge(gpu_compute),
    )


def find_traces(path: str | Path) -> list[Path]:
    """``path`` itself if it is a file, else every ``*.pt.trace.json`` below it (sorted)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a run's log directory or its *{TRACE_SUFFIX} files")
    found = sorted(path.rglob(f"*{TRACE_SUFFIX}"))
    if not found:
        raise FileNotFoundError(
            f"no *{TRACE_SUFFIX} under {path}; record one with `python -m lightning_ddp fit ... --trace.enabled true`"
        )
    return found


@dataclass
class RunTraces:
    """One training run: its label and one ``RankTrace`` per rank (sorted by rank)."""

    label: str
    ranks: list[RankTrace]

    def overlap(self, source: str = "auto", steps: int | None = None) -> Overlap:
        """The run's overlap: communication and overlapped time summed over ranks (a ratio of sums)."""
        result = Overlap(0.0, 0.0)
        for rank in self.ranks:
            result = result + rank.overlap(source, rank.window(steps))
        return result


def load_run(paths: Iterable[str | Path], label: str | None = None) -> RunTraces:
    """Load one run from its log directory or trace files; one trace per rank."""
    files = [f for p in paths for f in find_traces(p)]
    traces = [load_rank_trace(f) for f in files]
    by_rank: dict[int, RankTrace] = {}
    for t in traces:
        if t.rank in by_rank:
            raise ValueError(
                f"two traces for rank {t.rank}: {by_rank[t.rank].path} and {t.path}. Pass one run's directory "
                "(e.g. logs/NAME/version_3) or its trace files, not a directory holding several runs."
            )
        by_rank[t.rank] = t
    ranks = [by_rank[r] for r in sorted(by_rank)]
    return RunTraces(label or ranks[0].label, ranks)
