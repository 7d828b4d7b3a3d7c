"""Chrome-trace JSON read back: per-rank intervals of our ranges, our communication track (written by
``lightning_ddp.metrics.recording``) and the profiler's own collectives; and one rank's communication/computation
overlap as Holistic Trace Analysis defines it, ``|comm ∩ compute| / |comm|`` (1.0: all communication hidden).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from lightning_ddp.intervals import Interval, intersect, merge, subtract, total
from lightning_ddp.metrics.recording import TRACE_SUFFIX
from lightning_ddp.sync import ranges

__all__ = ["COMM_SOURCES", "GPU_KERNEL_CATEGORY", "PROFILER_COMM_RE", "CommEvent", "Overlap", "RankTrace", "RunTraces",
           "clip", "comm_compute_overlap", "find_traces", "load_rank_trace", "load_run"]

PROFILER_COMM_RE = re.compile(r"^(gloo:|nccl.*Kernel)")
"""Profiler events that are communication: gloo's per-collective ranges on its worker threads, NCCL kernels
(HTA's ``^nccl.*Kernel``)."""
GPU_KERNEL_CATEGORY = "kernel"
"""``cat`` of the GPU kernels kineto records (CUDA activity); memory copies and sets are ``gpu_memcpy`` and
``gpu_memset``, which HTA counts as neither computation nor communication."""
COMM_SOURCES = ("auto", "record", "profiler")
"""Where ``RankTrace.comm`` takes collectives from: ``record`` (the SyncRecord track), ``profiler`` (gloo threads,
NCCL kernels), ``auto`` (the track where there is one)."""


@dataclass(frozen=True)
class Overlap:
    """How much of one rank's (or several ranks' summed) communication time was hidden behind computation."""

    comm: float
    """Total time with at least one collective in flight (union of the communication intervals)."""
    overlapped: float
    """Of that, the time during which the rank was also computing."""

    @property
    def fraction(self) -> float:
        """``overlapped / comm`` (HTA's comp_comm_overlap ratio); 0.0 when nothing was communicated."""
        return self.overlapped / self.comm if self.comm > 0 else 0.0

    @property
    def exposed(self) -> float:
        """Communication time not hidden behind computation."""
        return self.comm - self.overlapped

    def describe(self, more: str = "") -> str:
        """``overlap 75.0% (3.0 of 4.0 ms communication hidden{more})``, from times in trace microseconds."""
        hidden_ms, comm_ms = self.overlapped / 1e3, self.comm / 1e3
        return f"overlap {self.fraction:.1%} ({hidden_ms:.1f} of {comm_ms:.1f} ms communication hidden{more})"

    def __add__(self, other: Overlap) -> Overlap:
        # Summing over ranks weights each rank by its communication time, as a ratio of sums should.
        return Overlap(self.comm + other.comm, self.overlapped + other.overlapped)


def comm_compute_overlap(comm: Iterable[Interval], compute: Iterable[Interval]) -> Overlap:
    """HTA's communication/computation overlap of one rank.

    >>> comm_compute_overlap(comm=[(0, 4)], compute=[(2, 10)]).fraction  # 2 of 4 ms hidden
    0.5
    """
    comm = merge(comm)
    return Overlap(comm=total(comm), overlapped=total(intersect(comm, compute)))


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
        """The rank's collectives from ``source``, one of ``COMM_SOURCES``."""
        if source not in COMM_SOURCES:
            raise ValueError(f"comm source {source!r} is not one of {', '.join(map(repr, COMM_SOURCES))}")
        if source == "record" or (source == "auto" and self.record_comm):
            return self.record_comm
        return self.profiler_comm

    def compute(self) -> list[Interval]:
        """When the rank computed: on CUDA the non-communication kernels (as HTA does: host ranges only say when
        kernels were queued); on CPU the training thread's forward, backward and optimizer minus its collective calls.
        """
        if self.gpu_compute:
            return self.gpu_compute
        busy = [i for name in ranges.COMPUTE_RANGES for i in self.ranges.get(name, [])]
        calls = [i for name in ranges.COMM_CALL_RANGES for i in self.ranges.get(name, [])]
        return subtract(busy, calls)

    def window(self, steps: int | None = None) -> Interval:
        """From the first recorded step's start to the end of the ``steps``-th (all steps when ``None``)."""
        if not self.steps:
            raise ValueError(f"{self.path} has no {ranges.STEP}#N ranges: "
                             "was it recorded by lightning_ddp's TraceRecorder?")
        shown = self.steps if steps is None else self.steps[:steps]
        return shown[0][1][0], shown[-1][1][1]

    def overlap(self, source: str = "auto", window: Interval | None = None) -> Overlap:
        """HTA overlap of this rank (``comm_compute_overlap``) inside ``window`` (default: all steps)."""
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
    """``path`` if it is a file, else the ``*.pt.trace.json`` files of one run below it (sorted; of several runs,
    the latest with traces)."""
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
    runs: dict[Path, list[Path]] = {}
    for file in found:  # each rank writes <log_dir>/traces/rank{R}.pt.trace.json
        runs.setdefault(file.parent.parent if file.parent.name == "traces" else file.parent, []).append(file)
    versions = {_version(run): run for run in runs if run.parent == path}
    if len(runs) > 1 and len(versions) == len(runs) and None not in versions:
        return runs[versions[max(versions)]]
    return found  # one run, or folders that are not a logger's versions: load_run refuses two traces of a rank


def _version(run_dir: Path) -> int | None:
    """N of Lightning's ``version_N`` run folder, None for any other name."""
    number = run_dir.name.removeprefix("version_")
    return int(number) if run_dir.name.startswith("version_") and number.isdigit() else None


@dataclass
class RunTraces:
    """One training run: its label and one ``RankTrace`` per rank (sorted by rank)."""

    label: str
    ranks: list[RankTrace]

    def overlap(self, source: str = "auto", steps: int | None = None) -> Overlap:
        """The run's overlap: communication and overlapped time summed over ranks (a ratio of sums)."""
        return sum((rank.overlap(source, rank.window(steps)) for rank in self.ranks), Overlap(0.0, 0.0))


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
