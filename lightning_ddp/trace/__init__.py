"""The ``TraceRecorder``'s traces read back: HTA's overlap ``|comm ∩ compute| / |comm|`` of each rank and the runs
drawn as timelines; ``python -m lightning_ddp.trace`` does both (docs/tensorboard.md, "Two overlaps")."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from lightning_ddp.intervals import Interval, intersect, merge, subtract, total
from lightning_ddp.metrics.comm_track import TRACE_SUFFIX, assign_lanes
from lightning_ddp.run_folders import run_folder
from lightning_ddp.sync import ranges

PROFILER_COMM_RE = re.compile(r"^(gloo:|nccl.*Kernel)")  # gloo's ranges on its threads, NCCL kernels (as HTA)
GPU_KERNEL_CATEGORY = "kernel"  # kineto's GPU kernels; gpu_memcpy / gpu_memset are neither compute nor comm (HTA)
COMM_SOURCES = ("auto", "record", "profiler")  # RankTrace.comm's sources; auto: the SyncRecord track if any
OVERLAP_DEFINITION = (
    "overlap here is HTA's: of the time a collective was in flight (launch to completion, over the traced steps, "
    "summed over ranks), the share the rank computed meanwhile, its time inside collective calls not counted. The "
    "CommTimer's comm/overlap counts all busy time before the step's last gradient as hidden and usually reads "
    "higher for the same run: docs/tensorboard.md, \"Two overlaps\", and docs/comm_timer.md")


@dataclass(frozen=True)
class Overlap:
    """How much of one rank's (or several ranks' summed) communication time was hidden behind computation."""

    comm: float  # the time with at least one collective in flight
    overlapped: float  # of that, the time the rank also computed

    @property
    def fraction(self) -> float:
        """``overlapped / comm`` (HTA's comp_comm_overlap ratio); 0.0 when nothing was communicated."""
        return self.overlapped / self.comm if self.comm > 0 else 0.0

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

    def compute(self) -> list[Interval]:
        """When the rank computed: on CUDA its non-communication kernels (as HTA), on CPU the training thread's
        forward, backward and optimizer minus its collective calls."""
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
    trace = json.loads(path.read_text())
    meta = trace.get(ranges.METADATA_KEY, {})
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    pid, tid = meta.get("pid"), meta.get("tid")  # the training thread, where the recorder put the step ranges
    own = {name: [] for name in (*ranges.COMPUTE_RANGES, *ranges.COMM_CALL_RANGES)}
    steps, record_comm, profiler_comm, gpu_compute = [], [], [], []
    for e in events:
        start = float(e["ts"])
        end = start + float(e.get("dur", 0.0))
        name = str(e.get("name", ""))
        on_main = e.get("pid") == pid and e.get("tid") == tid  # the training thread
        if on_main and name in own:
            own[name].append((start, end))
        elif on_main and name.startswith(ranges.STEP + "#"):
            steps.append((int(name.rsplit("#", 1)[1]), (start, end)))
        elif e.get("cat") == ranges.COMM_CATEGORY:
            record_comm.append(CommEvent(start, end, name, e.get("args", {}).get("label", "")))
        elif PROFILER_COMM_RE.match(name) and not on_main:
            profiler_comm.append(CommEvent(start, end, name))
        elif e.get("cat") == GPU_KERNEL_CATEGORY:
            gpu_compute.append((start, end))
    steps.sort(key=lambda s: s[1][0])
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
    ranks: list[RankTrace]

    def overlap(self, source: str = "auto", steps: int | None = None) -> Overlap:
        """The run's overlap: communication and overlapped time summed over ranks (a ratio of sums)."""
        return sum((rank.overlap(source, rank.window(steps)) for rank in self.ranks), Overlap(0.0, 0.0))


def load_run(paths: Iterable[str | Path], label: str | None = None) -> RunTraces:
    """Load one run from its log directory or trace files; one trace per rank."""
    by_rank: dict[int, RankTrace] = {}
    for t in (load_rank_trace(f) for p in paths for f in find_traces(p)):
        if t.rank in by_rank:
            raise ValueError(
                f"two traces for rank {t.rank}: {by_rank[t.rank].path} and {t.path}. Pass one run's directory "
                "(e.g. logs/NAME/version_3) or its trace files, not a directory holding several runs."
            )
        by_rank[t.rank] = t
    ranks = [by_rank[r] for r in sorted(by_rank)]
    return RunTraces(label or ranks[0].label, ranks)


# ---- drawing -------------------------------------------------------------------------------------------------

LEGEND = {
    ranges.FORWARD: ("#4C72B0", "forward"),
    ranges.BACKWARD: ("#DD8452", "backward (incl. gradient hooks)"),
    ranges.OPTIMIZER: ("#55A868", "optimizer step"),
    ranges.GRAD_SYNC: ("#B0B0B0", "finish_gradient_synchronization (waiting)"),
    "calls": ("#5A1A1A", "inside a collective call (launch / wait)"),
    "comm": ("#C44E52", "collective in flight (launch -> completion)"),
    "hidden": ("#2F2F2F", "communication hidden behind compute"),
    "gpu": ("#8172B3", "GPU kernels (not communication)"),
}  # each bar's colour and legend
MAX_COMM_LANES = 4  # concurrent collectives stack in up to this many sub-lanes of the communication row


@dataclass
class Row:
    """One drawn row: which run and rank, ``compute``, ``gpu`` or ``comm``, and how many bars it holds."""

    run: str
    rank: int
    kind: str
    bars: int


@dataclass
class Timeline:
    """What ``render_timeline`` drew: the rows and each run's overlap, for tests and for printing."""

    path: Path
    rows: list[Row]
    overlaps: dict[str, Overlap]

    def summary(self) -> str:
        return "\n".join(f"{label}: {overlap.describe()}" for label, overlap in self.overlaps.items())


def render_timeline(
    runs: list[RunTraces],
    output: str | Path,
    steps: int | None = None,
    comm_source: str = "auto",
    title: str | None = None,
) -> Timeline:
    """Draw ``runs`` (stacked, shared ms axis) into ``output`` (PNG, or any format matplotlib infers); ``steps``:
    only each rank's first ``steps`` recorded steps (None: all); ``comm_source``: one of ``COMM_SOURCES``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not runs:
        raise ValueError("render_timeline needs at least one run")
    gpu_rows = any(rank.gpu_compute for run in runs for rank in run.ranks)
    per_rank = 3.6 if gpu_rows else 2.4  # row units per rank: compute (+ gpu) + comm
    heights = [len(run.ranks) for run in runs]
    fig, axes = plt.subplots(
        len(runs), 1, sharex=True, squeeze=False,
        figsize=(14, 1.1 + sum(0.25 + 1.05 * per_rank / 2.4 * h for h in heights)),
        gridspec_kw={"height_ratios": heights},
    )
    rows: list[Row] = []
    overlaps: dict[str, Overlap] = {}
    x_max = 0.0
    for ax, run, label in zip(axes[:, 0], runs, _unique([run.label for run in runs])):
        windows = {r.rank: r.window(steps) for r in run.ranks}
        t0 = min(lo for lo, _ in windows.values())
        ticks: dict[float, str] = {}  # y -> the row's label
        for index, rank in enumerate(run.ranks):
            base = per_rank * (len(run.ranks) - 1 - index)  # rank 0 on top
            drawn, labels = _draw_rank(ax, label, rank, windows[rank.rank], t0, base, per_rank, gpu_rows, comm_source)
            rows += drawn
            ticks.update(labels)
        for step, (start, _) in run.ranks[0].steps[:steps]:  # step boundaries, from the top rank (rank 0)
            ax.axvline((start - t0) / 1e3, color="black", linewidth=0.6, linestyle=":", zorder=0)
            ax.text((start - t0) / 1e3, per_rank * len(run.ranks) - 0.15, f" step {step}", fontsize=7, va="bottom")
        ax.set_yticks(list(ticks), list(ticks.values()), fontsize=8)
        ax.set_ylim(-0.2, per_rank * len(run.ranks) + 0.25)
        ax.grid(axis="x", linewidth=0.4, alpha=0.5)
        overlaps[label] = run.overlap(comm_source, steps)
        overlap = overlaps[label].describe(f" behind compute, {len(run.ranks)} ranks")
        ax.set_title(f"{label}: {overlap}", fontsize=10, loc="left")
        x_max = max(x_max, *((hi - t0) / 1e3 for _, hi in windows.values()))
    axes[-1, 0].set_xlim(0, x_max * 1.01)
    axes[-1, 0].set_xlabel("time since the run's first recorded step (ms)")
    handles = [Patch(facecolor=color, label=text) for key, (color, text) in LEGEND.items() if key != "gpu" or gpu_rows]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(title or "Compute vs gradient communication (overlap = time computing while communicating / "
                          "communication time, as in HTA)", fontsize=11)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))  # keep ~0.5 inch at the bottom for the legend
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return Timeline(output, rows, overlaps)


def _draw_rank(ax: Any, label: str, rank: RankTrace, window: Interval, t0: float, base: float, per_rank: float,
               gpu_rows: bool, comm_source: str) -> tuple[list[Row], dict[float, str]]:
    """One rank's compute row, GPU row (with ``gpu_rows``) and communication row: the rows and their y labels."""
    lo, hi = window
    ms = lambda intervals: [((s - t0) / 1e3, (e - s) / 1e3) for s, e in intervals]  # noqa: E731
    compute_y, gpu_y, comm_y = base + per_rank - 1.2, base + 1.2, base
    # compute row: the training thread's ranges, coloured by kind
    bars = 0
    for name in (ranges.FORWARD, ranges.BACKWARD, ranges.OPTIMIZER, ranges.GRAD_SYNC):
        spans = clip(rank.ranges.get(name, []), lo, hi)
        ax.broken_barh(ms(spans), (compute_y, 1.0), facecolors=LEGEND[name][0], edgecolor="none")
        bars += len(spans)
    # the thread's time inside collective calls (not compute): a strip along the row's bottom
    calls = clip([i for name in (ranges.COMM_LAUNCH, ranges.COMM_WAIT) for i in rank.ranges.get(name, [])], lo, hi)
    ax.broken_barh(ms(calls), (compute_y, 0.2), facecolors=LEGEND["calls"][0], edgecolor="none")
    rows = [Row(label, rank.rank, "compute", bars)]
    if gpu_rows:  # the GPU's own view: what overlap counts as compute on CUDA
        kernels = clip(rank.gpu_compute, lo, hi)
        ax.broken_barh(ms(kernels), (gpu_y, 1.0), facecolors=LEGEND["gpu"][0], edgecolor="none")
        rows.append(Row(label, rank.rank, "gpu", len(kernels)))
    # communication row: each collective from launch to completion, concurrent ones in sub-lanes
    comm = [(max(c.start, lo), min(c.end, hi)) for c in rank.comm(comm_source) if c.end > lo and c.start < hi]
    lanes = assign_lanes(comm)
    n_lanes = min(MAX_COMM_LANES, max(lanes, default=0) + 1)
    lane_h = 0.78 / n_lanes
    for lane in range(n_lanes):
        spans = [interval for interval, assigned in zip(comm, lanes) if assigned % n_lanes == lane]
        ax.broken_barh(ms(spans), (comm_y + 0.22 + lane * lane_h, lane_h), facecolors=LEGEND["comm"][0],
                       edgecolor="white", linewidth=0.3)
    hidden = intersect(comm, clip(rank.compute(), lo, hi))
    ax.broken_barh(ms(hidden), (comm_y, 0.18), facecolors=LEGEND["hidden"][0], edgecolor="none")
    rows.append(Row(label, rank.rank, "comm", len(comm)))
    overlap = rank.overlap(comm_source, (lo, hi))
    labels = {compute_y + 0.5: f"rank {rank.rank} compute", comm_y + 0.5: f"rank {rank.rank} comm\n"
              f"{overlap.fraction:.0%} hidden", **({gpu_y + 0.5: f"rank {rank.rank} GPU"} if gpu_rows else {})}
    return rows, labels


def _unique(labels: list[str]) -> list[str]:
    """Two runs of one strategy get ``name``, ``name (2)``: each panel and overlap keeps its own key."""
    counts = [labels[:i + 1].count(label) for i, label in enumerate(labels)]
    return [label if n == 1 else f"{label} ({n})" for label, n in zip(labels, counts)]
