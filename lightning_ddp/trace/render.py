"""Draw runs as timelines: per rank a compute row, on CUDA a GPU-kernel row, and a communication row; runs stacked
on one millisecond axis from each run's first recorded step, each panel titled with its overlap (Agg backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ddp.intervals import intersect
from lightning_ddp.metrics.recording import assign_lanes
from lightning_ddp.sync import ranges
from lightning_ddp.trace.chrome import Overlap, RankTrace, RunTraces, clip

LEGEND = {
    ranges.FORWARD: ("#4C72B0", "forward"),
    ranges.BACKWARD: ("#DD8452", "backward (incl. gradient hooks)"),
    ranges.OPTIMIZER: ("#55A868", "optimizer step"),
    ranges.GRAD_SYNC: ("#B0B0B0", "finish_gradient_synchronization (waiting)"),
    "calls": ("#5A1A1A", "inside a collective call (launch / wait)"),
    "comm": ("#C44E52", "collective in flight (launch -> completion)"),
    "hidden": ("#2F2F2F", "communication hidden behind compute"),
    "gpu": ("#8172B3", "GPU kernels (not communication)"),
}
"""What each bar is: its colour and its legend."""
MAX_COMM_LANES = 4
"""Concurrent collectives are stacked in up to this many sub-lanes of the communication row."""


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
    only each rank's first ``steps`` recorded steps (None: all); ``comm_source``: one of ``chrome.COMM_SOURCES``."""
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
        panel = _Panel(ax, label, per_rank, gpu_rows, comm_source, rows)
        overlaps[label], run_end = _draw_run(panel, run, steps)
        x_max = max(x_max, run_end)
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


@dataclass
class _Panel:
    """One run's axes and what every rank row of it shares."""

    ax: Any
    label: str
    per_rank: float
    gpu_rows: bool
    comm_source: str
    rows: list[Row]


def _draw_run(panel: _Panel, run: RunTraces, steps: int | None) -> tuple[Overlap, float]:
    """Draw every rank of ``run`` into its panel; returns the run's overlap and where its last step ends (ms)."""
    ax, per_rank = panel.ax, panel.per_rank
    windows = {r.rank: r.window(steps) for r in run.ranks}
    t0 = min(lo for lo, _ in windows.values())
    yticks: list[float] = []
    ylabels: list[str] = []
    for index, rank in enumerate(run.ranks):
        base = per_rank * (len(run.ranks) - 1 - index)  # rank 0 on top
        _draw_rank(panel, rank, windows[rank.rank], t0, base, yticks, ylabels)
        if index == 0:  # step boundaries, from the top rank
            for step, (start, _) in rank.steps[:steps]:
                ax.axvline((start - t0) / 1e3, color="black", linewidth=0.6, linestyle=":", zorder=0)
                ax.text((start - t0) / 1e3, per_rank * len(run.ranks) - 0.15, f" step {step}", fontsize=7,
                        va="bottom")
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(-0.2, per_rank * len(run.ranks) + 0.25)
    ax.grid(axis="x", linewidth=0.4, alpha=0.5)
    total = run.overlap(panel.comm_source, steps)
    title = total.describe(f" behind compute, {len(run.ranks)} ranks")
    ax.set_title(f"{panel.label}: {title}", fontsize=10, loc="left")
    return total, max((hi - t0) / 1e3 for _, hi in windows.values())


def _draw_rank(panel: _Panel, rank: RankTrace, window: tuple[float, float], t0: float, base: float,
               yticks: list[float], ylabels: list[str]) -> None:
    """One rank's compute row, GPU row (on CUDA) and communication row."""
    ax, label, lo, hi = panel.ax, panel.label, window[0], window[1]
    ms = lambda intervals: [((s - t0) / 1e3, (e - s) / 1e3) for s, e in intervals]  # noqa: E731
    compute_y, gpu_y, comm_y = base + panel.per_rank - 1.2, base + 1.2, base
    # compute row: the training thread's ranges, coloured by kind
    bars = 0
    for name in (ranges.FORWARD, ranges.BACKWARD, ranges.OPTIMIZER, ranges.GRAD_SYNC):
        spans = clip(rank.ranges.get(name, []), lo, hi)
        ax.broken_barh(ms(spans), (compute_y, 1.0), facecolors=LEGEND[name][0], edgecolor="none")
        bars += len(spans)
    # the thread's time inside collective calls (not compute): a strip along the row's bottom
    calls = clip([i for name in (ranges.COMM_LAUNCH, ranges.COMM_WAIT) for i in rank.ranges.get(name, [])], lo, hi)
    ax.broken_barh(ms(calls), (compute_y, 0.2), facecolors=LEGEND["calls"][0], edgecolor="none")
    panel.rows.append(Row(label, rank.rank, "compute", bars))
    if panel.gpu_rows:  # the GPU's own view: what overlap counts as compute on CUDA
        kernels = clip(rank.gpu_compute, lo, hi)
        ax.broken_barh(ms(kernels), (gpu_y, 1.0), facecolors=LEGEND["gpu"][0], edgecolor="none")
        panel.rows.append(Row(label, rank.rank, "gpu", len(kernels)))
    # communication row: each collective from launch to completion, concurrent ones in sub-lanes
    comm = [(max(c.start, lo), min(c.end, hi)) for c in rank.comm(panel.comm_source) if c.end > lo and c.start < hi]
    lanes = assign_lanes(comm)
    n_lanes = min(MAX_COMM_LANES, max(lanes, default=0) + 1)
    lane_h = 0.78 / n_lanes
    for lane in range(n_lanes):
        spans = [interval for interval, assigned in zip(comm, lanes) if assigned % n_lanes == lane]
        ax.broken_barh(ms(spans), (comm_y + 0.22 + lane * lane_h, lane_h), facecolors=LEGEND["comm"][0],
                       edgecolor="white", linewidth=0.3)
    hidden = intersect(comm, clip(rank.compute(), lo, hi))
    ax.broken_barh(ms(hidden), (comm_y, 0.18), facecolors=LEGEND["hidden"][0], edgecolor="none")
    panel.rows.append(Row(label, rank.rank, "comm", len(comm)))
    overlap = rank.overlap(panel.comm_source, (lo, hi))
    yticks += [compute_y + 0.5, comm_y + 0.5] + ([gpu_y + 0.5] if panel.gpu_rows else [])
    ylabels += [f"rank {rank.rank} compute", f"rank {rank.rank} comm\n{overlap.fraction:.0%} hidden"]
    ylabels += [f"rank {rank.rank} GPU"] if panel.gpu_rows else []


def _unique(labels: list[str]) -> list[str]:
    """Two runs of one strategy get ``name``, ``name (2)``: each panel and overlap keeps its own key."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out
