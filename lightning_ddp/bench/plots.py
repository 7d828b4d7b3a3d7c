"""The sweep's PNG plots with 95 % error bars, per precision and batch size: the strategies side by side, and step
time and comm share against the bucket size for each engine with buckets (docs/benchmarks.md)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from lightning_ddp.bench.config import REFERENCE, has_bucket_axis
from lightning_ddp.bench.report import (
    SHARE, STEP, Analysis, Group, Row, is_ok, panels, strategy_order, variant_of,
)
from lightning_ddp.bench.stats import Estimate

# per panel: the estimated column, the scale and the axis label
_PANELS = ((STEP, 1.0, "median step time (ms)"), (SHARE, 100.0, "exposed comm share of step (%)"))


def _cell(analysis: Analysis, row: Row | None, panel: int) -> Estimate | None:
    """An ok cell's pooled median and interval over all its ok repeats (the results.csv numbers)."""
    measured = analysis.measured(row)
    return measured.estimate(panel) if measured else None


def _error(estimates: list[Estimate | None], scale: float) -> tuple[list[float], list[list[float]]]:
    """Bar heights and matplotlib's ``yerr`` (distances below and above) for the estimates (missing: 0)."""
    shown = [e if e is not None and math.isfinite(e.point) else Estimate(0.0, 0.0, 0.0) for e in estimates]
    # max(0.0, nan) is 0.0: an end that is not finite draws no error bar
    below = [max(0.0, (e.point - e.lo) * scale) for e in shown]
    return [e.point * scale for e in shown], [below, [max(0.0, (e.hi - e.point) * scale) for e in shown]]


def _figure() -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # a Figure saves through the Agg canvas without pyplot

    fig = Figure(figsize=(12, 4.2), layout="constrained")
    return fig, fig.subplots(1, 2)


def _finish(fig: Any, ax_step: Any, path: Path, title: str) -> None:
    fig.legend(*ax_step.get_legend_handles_labels(), loc="outside right center", fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def _shown(analysis: Analysis, group: Group, name: str, panel: int) -> Estimate | None:
    """What a strategy bar shows: an algorithm with buckets at its selected size on the evaluation repeats, any other
    strategy's cell over all repeats."""
    if has_bucket_axis(name):
        selection = analysis.selections.get((group, name))
        return selection.evaluated.estimate(panel) if selection else None
    return _cell(analysis, next((r for r in analysis.groups[group] if variant_of(r) == name), None), panel)


def _strategy_figure(path: Path, precision: str, batch: int, analysis: Analysis, contexts: list[int]) -> bool:
    names = strategy_order(variant_of(r) for c in contexts for r in analysis.groups[(precision, batch, c)])
    if not names:
        return False
    fig, axes = _figure()
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(contexts))]
        label = (f"{name} (selected size, evaluation repeats)" if has_bucket_axis(name)
                 else {REFERENCE: "reference (compute only)"}.get(name, name))
        for ax, (panel, scale, _) in zip(axes, _PANELS):
            if panel == SHARE and name == REFERENCE:
                ax.bar(xs, [0.0] * len(xs), width)  # keep the colours of both panels aligned
                continue
            shown = [_shown(analysis, (precision, batch, c), name, panel) for c in contexts]
            heights, yerr = _error(shown, scale)
            ax.bar(xs, heights, width, yerr=yerr, capsize=2, label=label)
    for ax, (*_, ylabel) in zip(axes, _PANELS):
        ax.set_xticks(range(len(contexts)), [f"context {c}" for c in contexts])
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    _finish(fig, axes[0], path, f"Step time and communication share by strategy: {precision}, batch {batch} per "
            "rank (error bars: 95 % intervals)")
    return True


def _bucket_figure(
    path: Path, strategy: str, precision: str, batch: int, analysis: Analysis, contexts: list[int],
    predicted_mb: float | None,
) -> bool:
    fig, axes = _figure()
    drew = selected = False
    for context in contexts:
        group = (precision, batch, context)
        rows = [r for r in analysis.groups[group] if variant_of(r) == strategy and is_ok(r)]
        # (x, row): the fixed sizes ascending; auto at the size it resolved to
        fixed = sorted(((r["bucket_size_mb"], r) for r in rows if r["bucket_size_mb"] != "auto"), key=lambda p: p[0])
        auto = [(r["resolved_bucket_size_mb"], r) for r in rows
                if r["bucket_size_mb"] == "auto" and isinstance(r.get("resolved_bucket_size_mb"), float)]
        if not fixed and not auto:
            continue
        drew = True
        selection = analysis.selections.get((group, strategy))
        chosen = next((p for p in fixed + auto if selection and p[1]["cell_id"] == selection.row["cell_id"]), None)
        color = None
        for ax, (panel, scale, _) in zip(axes, _PANELS):
            if fixed:
                heights, yerr = _error([_cell(analysis, p[1], panel) for p in fixed], scale)
                container = ax.errorbar([p[0] for p in fixed], heights, yerr=yerr, marker="o", capsize=3,
                                        color=color, label=f"context {context}")
                color = container.lines[0].get_color()
            for x, r in auto:
                heights, yerr = _error([_cell(analysis, r, panel)], scale)
                ax.errorbar([x], heights, yerr=yerr, marker="*", markersize=12, linestyle="", capsize=3, color=color)
            point = _cell(analysis, chosen[1], panel).point if chosen is not None else math.nan
            if math.isfinite(point):
                selected = True
                ax.plot([chosen[0]], [point * scale], marker="o", markersize=16,
                        markerfacecolor="none", markeredgewidth=1.5, linestyle="", color=color)
    if not drew:
        return False
    if selected:  # one neutral legend entry for the circles of every context
        axes[0].plot([], [], marker="o", markersize=12, markerfacecolor="none", linestyle="", color="gray",
                     label="selected size (on the selection repeats)")
    for ax, (*_, ylabel) in zip(axes, _PANELS):
        ax.set_xscale("log")
        ax.set_xlabel("bucket size (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        if predicted_mb:
            ax.axvline(predicted_mb, linestyle=":", color="gray", label=f"predicted b* = {predicted_mb:.3g} MiB")
    _finish(fig, axes[0], path, f"{strategy}: step time and comm share vs bucket size: {precision}, batch {batch} "
            "per rank (all repeats, 95 % intervals; stars: auto; circled: selected)")
    return True


def write_plots(out_dir: str | Path, analysis: Analysis, predicted_mb: float | None = None) -> list[Path]:
    """Write the figures of the module docstring for the sweep's ``analysis``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for precision, batch, contexts in panels(analysis.groups):
        path = out_dir / f"strategies_{precision}_bs{batch}.png"
        if _strategy_figure(path, precision, batch, analysis, contexts):
            written.append(path)
        bucketed = strategy_order(variant_of(r) for c in contexts for r in analysis.groups[(precision, batch, c)])
        for strategy in filter(has_bucket_axis, bucketed):
            stem = re.sub(r"[^A-Za-z0-9._-]", "", strategy.replace(" ", "-"))  # as cell ids spell settings: -rank4
            path = out_dir / f"{stem}_{precision}_bs{batch}.png"
            if _bucket_figure(path, strategy, precision, batch, analysis, contexts, predicted_mb):
                written.append(path)
    return written
