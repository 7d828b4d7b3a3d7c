"""The ``TraceRecorder``'s traces read back: one ``RankTrace`` per rank's Chrome trace (the training thread's
``ddp/*`` ranges, the communication track, the profiler's own collectives and GPU kernels), a run's ranks together
(``RunTraces``) and the run a logger's folder stands for (``find_traces``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from lightning_ddp.intervals import Interval, merge, subtract
from lightning_ddp.metrics.comm_track import TRACE_SUFFIX
from lightning_ddp.run_folders import run_folder
from lightning_ddp.sync import ranges
from lightning_ddp.trace.overlap import Overlap, clip, comm_compute_overlap

PROFILER_COMM_RE = re.compile(r"^(gloo:|nccl.*Kernel)")  # gloo's ranges on its threads, NCCL kernels (as HTA)
GPU_KERNEL_CATEGORY = "kernel"  # kineto's GPU kernels; gpu_memcpy / gpu_memset are neither compute nor comm (HTA)
COMM_SOURCES = ("auto", "record", "profiler")  # RankTrace.comm's sources; auto: the SyncRecord track if any


@dataclass
class CommEvent:
    """A collective in flight on the trace's axis (microseconds)."""

    start: float
    """When it was launched (the profiler's range start for a profiler event), trace microseconds."""
    end: float
    """When it completed, trace microseconds."""
    name: str
    """The trace event's name: the collective on the SyncRecord track, gloo's or NCCL's own otherwise."""
    label: str = ""
    """What it carried (a bucket's or parameter's label) on the SyncRecord track; empty from the profiler."""


@dataclass
class RankTrace:
    """One rank's trace reduced to what the timeline needs; times in trace microseconds."""

    path: Path
    """The Chrome trace it was read from."""
    rank: int
    """The rank that wrote it (0 when the trace does not say)."""
    label: str
    """The run's name: the strategy the recorder wrote, else the trace's folder name."""
    steps: list[tuple[int, Interval]]  # (step number, (start, end)) of each ddp/step#N range, in time order
    ranges: dict[str, list[Interval]]  # the training thread's ranges (lightning_ddp.sync.ranges), by name
    record_comm: list[CommEvent]  # the SyncRecord track (launch -> completion); empty without a SyncRecord
    profiler_comm: list[CommEvent]  # what the profiler recorded as communication (PROFILER_COMM_RE)
    gpu_compute: list[Interval] = field(default_factory=list)  # merged non-communication GPU kernels (CUDA only)

    def comm(self, source: str = "auto") -> list[CommEvent]:
        """The rank's collectives from ``source``, one of ``COMM_SOURCES``."""
        if source == "record" or (source == "auto" and self.record_comm):
            return self.record_comm
        return self.profiler_comm

    def spans(self, names: Iterable[str]) -> list[Interval]:
        """The training thread's ranges of every one of ``names``, name by name."""
        spans: list[Interval] = []
        for name in names:
            spans += self.ranges.get(name, [])
        return spans

    def compute(self) -> list[Interval]:
        """When the rank computed: on CUDA its non-communication kernels (as HTA), on CPU the training thread's
        forward, backward and optimizer minus its collective calls."""
        if self.gpu_compute:
            return self.gpu_compute
        return subtract(self.spans(ranges.COMPUTE_RANGES), self.spans(ranges.COMM_CALL_RANGES))

    def window(self, steps: int | None = None) -> Interval:
        """From the first recorded step's start to the end of the ``steps``-th (all steps when ``None``)."""
        if not self.steps:
            raise ValueError(f"{self.path} has no {ranges.STEP}#N ranges: "
                             "was it recorded by lightning_ddp's TraceRecorder?")
        shown = self.steps if steps is None else self.steps[:steps]
        first_start, _ = shown[0][1]
        _, last_end = shown[-1][1]
        return first_start, last_end

    def overlap(self, source: str = "auto", window: Interval | None = None) -> Overlap:
        """HTA overlap of this rank (``comm_compute_overlap``) inside ``window`` (default: all steps)."""
        lo, hi = window if window is not None else self.window()
        comm = clip([(c.start, c.end) for c in self.comm(source)], lo, hi)
        return comm_compute_overlap(comm, clip(self.compute(), lo, hi))


def load_rank_trace(path: str | Path) -> RankTrace:
    """Read one rank's Chrome trace (as written by ``TraceRecorder``) into a ``RankTrace``."""
    path = Path(path)
    trace = json.loads(path.read_text())
    meta = trace.get(ranges.METADATA_KEY, {})
    pid, tid = meta.get("pid"), meta.get("tid")  # the training thread, where the recorder put the step ranges
    own: dict[str, list[Interval]] = {name: [] for name in (*ranges.COMPUTE_RANGES, *ranges.COMM_CALL_RANGES)}
    steps, record_comm, profiler_comm, gpu_compute = [], [], [], []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":  # complete events only: metadata and counters are not spans
            continue
        start = float(event["ts"])
        end = start + float(event.get("dur", 0.0))
        name = str(event.get("name", ""))
        on_main = event.get("pid") == pid and event.get("tid") == tid  # the training thread
        if on_main and name in own:
            own[name].append((start, end))
        elif on_main and name.startswith(ranges.STEP + "#"):
            steps.append((int(name.rsplit("#", 1)[1]), (start, end)))
        elif event.get("cat") == ranges.COMM_CATEGORY:
            label = event.get("args", {}).get("label", "")
            record_comm.append(CommEvent(start=start, end=end, name=name, label=label))
        elif PROFILER_COMM_RE.match(name) and not on_main:
            profiler_comm.append(CommEvent(start=start, end=end, name=name))
        elif event.get("cat") == GPU_KERNEL_CATEGORY:
            gpu_compute.append((start, end))
    rank = meta.get("rank", trace.get("distributedInfo", {}).get("rank", 0))
    return RankTrace(
        path=path,
        rank=int(rank),
        label=str(meta.get("strategy", path.parent.name)),
        steps=sorted(steps, key=lambda step: step[1][0]),  # by start time
        ranges={name: sorted(spans) for name, spans in own.items()},
        record_comm=sorted(record_comm, key=lambda c: c.start),
        profiler_comm=sorted(profiler_comm, key=lambda c: c.start),
        gpu_compute=merge(gpu_compute),
    )


def trace_files(folder: Path) -> list[Path]:
    """The ``*.pt.trace.json`` in ``folder`` or, as the ``TraceRecorder`` writes them, in its ``traces/``."""
    return sorted(folder.glob(f"*{TRACE_SUFFIX}")) or sorted((folder / "traces").glob(f"*{TRACE_SUFFIX}"))


def find_traces(path: str | Path) -> list[Path]:
    """``path`` if a file, else the traces of the run the folder stands for (``lightning_ddp.run_folders``: a
    logger's folder stands for its latest run with traces)."""
    path = Path(path)
    if path.is_file():
        return [path]
    folder = run_folder(path, lambda candidate: bool(trace_files(candidate)), f"*{TRACE_SUFFIX} (in it or its traces/)",
                        "record some with `python -m lightning_ddp fit ... --trace.enabled true`")
    return trace_files(folder)


@dataclass
class RunTraces:
    """One training run: its label and one ``RankTrace`` per rank (sorted by rank)."""

    label: str
    """The run's name in the picture and the printed overlaps: given, or its first rank's label."""
    ranks: list[RankTrace]
    """One trace per rank, ascending; ``load_run`` refuses two of one rank."""

    def overlap(self, source: str = "auto", steps: int | None = None) -> Overlap:
        """The run's overlap: communication and overlapped time summed over ranks (a ratio of sums)."""
        return sum((rank.overlap(source, rank.window(steps)) for rank in self.ranks), Overlap(0.0, 0.0))


def load_run(paths: Iterable[str | Path], label: str | None = None) -> RunTraces:
    """Load one run from its log directory or trace files; one trace per rank."""
    by_rank: dict[int, RankTrace] = {}
    for path in paths:
        for file in find_traces(path):
            trace = load_rank_trace(file)
            if trace.rank in by_rank:
                raise ValueError(
                    f"two traces for rank {trace.rank}: {by_rank[trace.rank].path} and {trace.path}. Pass one run's "
                    "directory (e.g. logs/NAME/version_3) or its trace files, not a directory holding several runs."
                )
            by_rank[trace.rank] = trace
    ranks = [by_rank[rank] for rank in sorted(by_rank)]
    return RunTraces(label or ranks[0].label, ranks)
