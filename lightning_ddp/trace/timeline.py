"""Runs drawn as stacked timelines (``render_timeline``): per rank a compute row (the training thread's ranges), on
CUDA a GPU-kernel row, and a communication row (each collective launch to completion, the hidden part beneath)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ddp.intervals import Interval, intersect
from lightning_ddp.metrics.comm_track import assign_lanes
from lightning_ddp.sync import ranges
from lightning_ddp.trace.overlap import Overlap, clip
from lightning_ddp.trace.traces import RankTrace, RunTraces

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
    """The picture written."""
    rows: list[Row]
    """Every row drawn: run by run, each rank's rows in turn."""
    overlaps: dict[str, Overlap]
    """Run label (made unique) -> its HTA overlap summed over ranks, over the steps drawn."""

    def summary(self) -> str:
        """One line per run: its label and ``Overlap.describe()``."""
        return "\n".join(f"{label}: {overlap.describe()}" for label, overlap in self.overlaps.items())


@dataclass(frozen=True)
class Panel:
    """How one run's panel is laid out: its time origin and window, each rank's row units, whether GPU rows show."""

    t0: float  # the run's first recorded step's start: 0 ms on the axis
    steps: int | None  # only each rank's first ``steps`` recorded steps (None: all)
    per_rank: float  # row units per rank: compute (+ gpu) + comm
    gpu_rows: bool
    """Whether each rank gets a GPU-kernel row: in every panel once any rank traced GPU kernels."""
    comm_source: str
    """Where the communication row's collectives come from, one of ``COMM_SOURCES``."""

    def bars(self, intervals: list[Interval]) -> list[tuple[float, float]]:
        """``(start, width)`` in ms since ``t0``: what matplotlib's ``broken_barh`` draws."""
        return [((start - self.t0) / 1e3, (end - start) / 1e3) for start, end in intervals]


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
    per_rank = 3.6 if gpu_rows else 2.4
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
        windows = {rank.rank: rank.window(steps) for rank in run.ranks}
        panel = Panel(t0=min(lo for lo, _ in windows.values()), steps=steps, per_rank=per_rank, gpu_rows=gpu_rows,
                      comm_source=comm_source)
        rows += _draw_run(ax, label, run, windows, panel)
        overlaps[label] = run.overlap(comm_source, steps)
        overlap = overlaps[label].describe(f" behind compute, {len(run.ranks)} ranks")
        ax.set_title(f"{label}: {overlap}", fontsize=10, loc="left")
        x_max = max(x_max, *((hi - panel.t0) / 1e3 for _, hi in windows.values()))
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


def _draw_run(ax: Any, label: str, run: RunTraces, windows: dict[int, Interval], panel: Panel) -> list[Row]:
    """One run's panel: every rank's rows (rank 0 on top), the step boundaries and the y labels."""
    rows: list[Row] = []
    ticks: dict[float, str] = {}  # y -> the row's label
    for index, rank in enumerate(run.ranks):
        base = panel.per_rank * (len(run.ranks) - 1 - index)
        drawn, labels = _draw_rank(ax, label, rank, windows[rank.rank], base, panel)
        rows += drawn
        ticks.update(labels)
    for step, (start, _) in run.ranks[0].steps[:panel.steps]:  # step boundaries, from the top rank (rank 0)
        x = (start - panel.t0) / 1e3
        ax.axvline(x, color="black", linewidth=0.6, linestyle=":", zorder=0)
        ax.text(x, panel.per_rank * len(run.ranks) - 0.15, f" step {step}", fontsize=7, va="bottom")
    ax.set_yticks(list(ticks), list(ticks.values()), fontsize=8)
    ax.set_ylim(-0.2, panel.per_rank * len(run.ranks) + 0.25)
    ax.grid(axis="x", linewidth=0.4, alpha=0.5)
    return rows


def _draw_rank(ax: Any, label: str, rank: RankTrace, window: Interval, base: float,
               panel: Panel) -> tuple[list[Row], dict[float, str]]:
    """One rank's compute row, GPU row (with ``panel.gpu_rows``) and communication row: the rows and their y labels."""
    lo, hi = window
    compute_y, gpu_y, comm_y = base + panel.per_rank - 1.2, base + 1.2, base
    # compute row: the training thread's ranges, coloured by kind
    bars = 0
    for name in (ranges.FORWARD, ranges.BACKWARD, ranges.OPTIMIZER, ranges.GRAD_SYNC):
        spans = clip(rank.ranges.get(name, []), lo, hi)
        ax.broken_barh(panel.bars(spans), (compute_y, 1.0), facecolors=LEGEND[name][0], edgecolor="none")
        bars += len(spans)
    # the thread's time inside collective calls (not compute): a strip along the row's bottom
    calls = clip(rank.spans((ranges.COMM_LAUNCH, ranges.COMM_WAIT)), lo, hi)
    ax.broken_barh(panel.bars(calls), (compute_y, 0.2), facecolors=LEGEND["calls"][0], edgecolor="none")
    rows = [Row(run=label, rank=rank.rank, kind="compute", bars=bars)]
    labels = {compute_y + 0.5: f"rank {rank.rank} compute"}
    if panel.gpu_rows:  # the GPU's own view: what overlap counts as compute on CUDA
        kernels = clip(rank.gpu_compute, lo, hi)
        ax.broken_barh(panel.bars(kernels), (gpu_y, 1.0), facecolors=LEGEND["gpu"][0], edgecolor="none")
        rows.append(Row(run=label, rank=rank.rank, kind="gpu", bars=len(kernels)))
    # communication row: each collective from launch to completion, concurrent ones in sub-lanes
    comm = [(max(c.start, lo), min(c.end, hi)) for c in rank.comm(panel.comm_source) if c.end > lo and c.start < hi]
    lanes = assign_lanes(comm)
    n_lanes = min(MAX_COMM_LANES, max(lanes, default=0) + 1)
    lane_height = 0.78 / n_lanes
    for lane in range(n_lanes):
        spans = [interval for interval, assigned in zip(comm, lanes) if assigned % n_lanes == lane]
        ax.broken_barh(panel.bars(spans), (comm_y + 0.22 + lane * lane_height, lane_height),
                       facecolors=LEGEND["comm"][0], edgecolor="white", linewidth=0.3)
    hidden = intersect(comm, clip(rank.compute(), lo, hi))
    ax.broken_barh(panel.bars(hidden), (comm_y, 0.18), facecolors=LEGEND["hidden"][0], edgecolor="none")
    rows.append(Row(run=label, rank=rank.rank, kind="comm", bars=len(comm)))
    overlap = rank.overlap(panel.comm_source, (lo, hi))
    labels[comm_y + 0.5] = f"rank {rank.rank} comm\n{overlap.fraction:.0%} hidden"
    if panel.gpu_rows:
        labels[gpu_y + 0.5] = f"rank {rank.rank} GPU"
    return rows, labels


def _unique(labels: list[str]) -> list[str]:
    """Two runs of one strategy get ``name``, ``name (2)``: each panel and overlap keeps its own key.

    >>> _unique(["naive_ddp", "naive_ddp", "flat_ddp"])
    ['naive_ddp', 'naive_ddp (2)', 'flat_ddp']
    """
    seen: Counter[str] = Counter()
    unique = []
    for label in labels:
        seen[label] += 1
        unique.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return unique
