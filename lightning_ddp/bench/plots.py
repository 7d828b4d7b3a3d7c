"""The sweep's PNG plots, from results.csv rows (matplotlib's Agg canvas: no display, no pyplot global state).

One figure per precision and batch size, each with a step-time panel and a comm-share panel:

- ``strategies_<precision>_bs<batch>.png``: bars per context length, one per strategy (an algorithm with buckets
  at its best bucket size), the compute-only reference as a bar of its own; every strategy in the rows is drawn,
  in ``report.strategy_order``;
- ``<algorithm>_<precision>_bs<batch>.png`` for each algorithm with buckets (``bucketed`` ...): step time and comm
  share against the bucket size (log x), one line per context length, like the study's bucket figures; the
  predicted best size is a dotted vertical line and ``auto`` cells are stars at the size they resolved to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_ddp.bench.config import REFERENCE, has_bucket_axis
from lightning_ddp.bench.report import best_variant, group_rows, strategy_order

__all__ = ["write_plots"]

Row = dict[str, Any]


def _ok(row: Row | None) -> bool:
    return row is not None and row["status"] == "ok" and row.get("step_ms_median") is not None


def _figure():
    from matplotlib.figure import Figure  # a Figure saves through the Agg canvas without pyplot

    fig = Figure(figsize=(12, 4.2), layout="constrained")
    return fig, fig.subplots(1, 2)


def _strategy_figure(path: Path, precision: str, batch: int, groups: dict, contexts: list[int]) -> bool:
    names = strategy_order(r["strategy"] for c in contexts for r in groups[(precision, batch, c)])
    if not names:
        return False
    fig, (ax_step, ax_share) = _figure()
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        steps, shares = [], []
        for context in contexts:
            rows = groups[(precision, batch, context)]
            row = best_variant(rows, name) if has_bucket_axis(name) else next((r for r in rows if r["strategy"] == name), None)
            ok = _ok(row)
            steps.append(row["step_ms_median"] if ok else 0.0)
            shares.append(100 * (row.get("comm_share") or 0.0) if ok else 0.0)
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(contexts))]
        label = f"{name} (best size)" if has_bucket_axis(name) else {REFERENCE: "reference (compute only)"}.get(name, name)
        ax_step.bar(xs, steps, width, label=label)
        if name != REFERENCE:
            ax_share.bar(xs, shares, width, label=label)
        else:
            ax_share.bar(xs, [0.0] * len(xs), width)  # keep the colours of both panels aligned
    for ax, ylabel in ((ax_step, "median step time (ms)"), (ax_share, "exposed comm share of step (%)")):
        ax.set_xticks(range(len(contexts)), [f"context {c}" for c in contexts])
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*ax_step.get_legend_handles_labels(), loc="outside right center", fontsize=8)
    fig.suptitle(f"Step time and communication share by strategy: {precision}, batch {batch} per rank")
    fig.savefig(path, dpi=110)
    return True


def _bucket_figure(
    path: Path, strategy: str, precision: str, batch: int, groups: dict, contexts: list[int], predicted_mb: float | None
) -> bool:
    fig, (ax_step, ax_share) = _figure()
    drew = False
    for context in contexts:
        rows = [r for r in groups[(precision, batch, context)] if r["strategy"] == strategy and _ok(r)]
        fixed = sorted((r for r in rows if r["bucket_size_mb"] != "auto"), key=lambda r: r["bucket_size_mb"])
        if fixed:
            drew = True
            sizes = [r["bucket_size_mb"] for r in fixed]
            line, = ax_step.plot(sizes, [r["step_ms_median"] for r in fixed], marker="o", label=f"context {context}")
            ax_share.plot(sizes, [100 * (r.get("comm_share") or 0.0) for r in fixed], marker="o", color=line.get_color(),
                          label=f"context {context}")
            color = line.get_color()
        else:
            color = None
        for r in rows:
            resolved = r.get("resolved_bucket_size_mb")
            if r["bucket_size_mb"] == "auto" and isinstance(resolved, float):
                drew = True
                ax_step.plot([resolved], [r["step_ms_median"]], marker="*", markersize=12, linestyle="", color=color)
                ax_share.plot([resolved], [100 * (r.get("comm_share") or 0.0)], marker="*", markersize=12, linestyle="", color=color)
    if not drew:
        return False
    for ax, ylabel in ((ax_step, "median step time (ms)"), (ax_share, "exposed comm share of step (%)")):
        ax.set_xscale("log")
        ax.set_xlabel("bucket size (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        if predicted_mb:
            ax.axvline(predicted_mb, linestyle=":", color="gray", label=f"predicted b* = {predicted_mb:.3g} MiB")
    fig.legend(*ax_step.get_legend_handles_labels(), loc="outside right center", fontsize=8)
    fig.suptitle(f"{strategy}: step time and comm share vs bucket size: {precision}, batch {batch} per rank (stars: auto)")
    fig.savefig(path, dpi=110)
    return True


def write_plots(out_dir: str | Path, rows: list[Row], predicted_mb: float | None = None) -> list[Path]:
    """Write the figures of the module docstring for ``rows`` (parsed results.csv rows); return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_rows(r for r in rows if r["status"])
    written = []
    for precision in dict.fromkeys(g[0] for g in groups):
        for batch in dict.fromkeys(g[1] for g in groups if g[0] == precision):
            contexts = sorted({g[2] for g in groups if g[0] == precision and g[1] == batch})
            path = out_dir / f"strategies_{precision}_bs{batch}.png"
            if _strategy_figure(path, precision, batch, groups, contexts):
                written.append(path)
            bucketed = strategy_order(r["strategy"] for c in contexts for r in groups[(precision, batch, c)])
            for strategy in filter(has_bucket_axis, bucketed):
                path = out_dir / f"{strategy}_{precision}_bs{batch}.png"
                if _bucket_figure(path, strategy, precision, batch, groups, contexts, predicted_mb):
                    written.append(path)
    return written
