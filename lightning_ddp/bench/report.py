"""``results.md``: the study's tables with intervals, the best bucket size chosen without selection bias, the
bucket-size prediction against the measurement, and the performance goals with verdicts.

The numbers are ``bench.analysis``'s (``analyze``: the selections, the goals, the across-groups summary; its
docstring defines them); this module renders them, with the header (machine, model, versions, load guard), how to
read the numbers, and the cells that did not finish. The analysis names stay importable from here.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_ddp.bench.analysis import (
    ACROSS_GROUPS_TARGET,
    NOT_MEASURABLE,
    Analysis,
    Row,
    analyze,
    bucket_text,
    has_buckets,
    is_ok,
    repeats_text,
    strategy_order,
    variant_of,
)
from lightning_ddp.bench.config import BASELINE, REFERENCE, has_bucket_axis
from lightning_ddp.catalogue import variant_label
from lightning_ddp.bench.stats import bounds_text, estimate_text
from lightning_ddp.bench.study import markdown_table

__all__ = ["build_report"]

_STRATEGY_TITLES = {
    REFERENCE: "reference (1 process, no communication)",
    BASELINE: "ddp (Lightning / torch DDP)",
}


def _cell_text(row: Row | None, bold: bool = False) -> str:
    if row is None:
        return "not run"
    if not is_ok(row):
        return row["status"] or "not run"
    text = f"{row['step_ms_median']:,.1f} ms{bounds_text(row.get('step_ms_lo'), row.get('step_ms_hi'), ',.1f')}"
    if row["strategy"] != REFERENCE and row.get("comm_share") is not None:
        share = bounds_text(row.get("comm_share_lo"), row.get("comm_share_hi"), ".1f", 100)
        wait = row.get("wait_comm_ms")
        # Of the exposed communication, the part spent waiting for the last rank (the CommTimer's comm/wait_ms).
        wait_text = f"; wait {wait:,.2f} ms" if isinstance(wait, (int, float)) and math.isfinite(wait) else ""
        text += f" ({100 * row['comm_share']:.1f} %{share}{wait_text})"
    return f"**{text}**" if bold else text


def _row_key(row: Row, order: list[str]) -> tuple:
    size = row["bucket_size_mb"]
    # strategies in report order; numeric bucket sizes ascending, then auto
    return (order.index(variant_of(row)), 1 if size == "auto" else 0, size if isinstance(size, float) else 0.0)


def _title(variant: str, size: Any) -> str:
    """A table row's name: ``reference (1 process, ...)``, ``naive``, ``bucketed_powersgd 4 MiB rank=4``."""
    if variant in _STRATEGY_TITLES:
        return _STRATEGY_TITLES[variant]
    strategy, _, settings = variant.partition(" ")
    return variant_label(strategy, size if has_bucket_axis(strategy) else None, settings)


def _strategy_tables(analysis: Analysis) -> list[str]:
    lines = []
    groups = analysis.groups
    selected = {s.row["cell_id"] for s in analysis.selections.values()}
    precisions = list(dict.fromkeys(g[0] for g in groups))
    for precision in precisions:
        batches = list(dict.fromkeys(g[1] for g in groups if g[0] == precision))
        for batch in batches:
            contexts = sorted({g[2] for g in groups if g[0] == precision and g[1] == batch})
            lines += [f"### {precision}, batch size {batch} per rank", ""]
            variants: dict[tuple, Row] = {}
            for context in contexts:
                for row in groups[(precision, batch, context)]:
                    variants.setdefault((variant_of(row), row["bucket_size_mb"]), row)
            order = strategy_order(strategy for strategy, _ in variants)
            table = []
            for strategy, size in sorted(variants, key=lambda k: _row_key(variants[k], order)):
                cells = []
                for context in contexts:
                    row = next((r for r in groups[(precision, batch, context)]
                                if variant_of(r) == strategy and r["bucket_size_mb"] == size), None)
                    cells.append(_cell_text(row, bold=row is not None and row["cell_id"] in selected))
                table.append([_title(strategy, size), *cells])
            lines += markdown_table(["strategy", *(f"context {c}" for c in contexts)], table)
            lines.append("")
    lines.append(
        "Each cell: pooled median step time [95 % interval] over all its ok repeats (exposed communication share of "
        "the step [95 % interval]; of it, the median time spent waiting for the last rank to launch). **Bold**: "
        "the bucket size selected on the selection repeats, per algorithm with buckets; its out-of-sample numbers "
        "are in the next section. p10/p90, overlap, transfer, bus bandwidth, tokens/s, memory and the load guard's "
        "counts are in results.csv; every step in steps.csv."
    )
    return lines


def _bucket_row(analysis: Analysis, group: tuple, strategy: str, members: list[Row], predicted: str) -> list[Any]:
    """One row of the best-bucket table: the size chosen on the selection repeats, measured on the others."""
    auto = next((r for r in members if variant_of(r) == strategy and r["bucket_size_mb"] == "auto"), None)
    auto_text = "not in grid"
    if auto is not None:
        auto_ok = f"{auto['step_ms_median']:,.1f} ms, {bucket_text(auto)}" if is_ok(auto) else ""
        auto_text = auto_ok or auto["status"] or "not run"
    selection = analysis.selections.get((group, strategy))
    if selection is None:
        return [*group, strategy, "no ok cell", "-", "-", "-", predicted, auto_text]
    evaluated = selection.evaluated
    on = f"{bucket_text(selection.row)}, best of {selection.candidates} on {repeats_text(selection.selection_repeats)}"
    where = (f"in-sample, repeats {repeats_text(evaluated.repeats)}: " if selection.in_sample
             else f"repeats {repeats_text(evaluated.repeats)}: ")
    return [*group, strategy, on, f"{selection.selection_step_ms:,.1f} ms",
            f"{where}{estimate_text(evaluated.step, unit=' ms')}", estimate_text(evaluated.share, ".1f", 100, " %"),
            predicted, auto_text]


def _bucket_section(analysis: Analysis, prediction: dict[str, Any] | None) -> list[str]:
    rows = analysis.rows
    lines = ["## Best bucket size: chosen on some repeats, measured on the others", ""]
    predicted_mb = None
    if prediction and prediction.get("bucket_bytes"):
        predicted_mb = prediction["bucket_bytes"] / 2**20
        o_ms, w = prediction["overhead_s"] * 1e3, prediction.get("bandwidth_Bps")
        w_text = f"{w / 1e9:.3f} GB/s" if w else "unbounded (time did not grow with size)"
        s_mb, largest_mb = prediction["grad_bytes"] / 2**20, prediction["largest_param_bytes"] / 2**20
        sizes = prediction.get("sizes") or []
        span = "the microbenchmark"
        if sizes:
            span = f"{len(sizes)} message sizes, {sizes[0] / 1024:g} KiB to {sizes[-1] / 2**20:g} MiB"
        n_b = prediction["grad_bytes"] / prediction["bucket_bytes"]
        lines += [
            f"All-reduce microbenchmark on the sweep's ranks ({span}, median of {prediction.get('repeats', '?')}): "
            f"least-squares fit `t = o + bytes / w` gives **o = {o_ms:.3f} ms** per call and **w = {w_text}**.",
            f"Gradients: s = {s_mb:.2f} MiB, largest parameter {largest_mb:.2f} MiB. Predicted best bucket "
            f"`b* = max(largest, sqrt(s * w * o))` = **{predicted_mb:.3g} MiB** (about {n_b:.1f} buckets; see "
            "`lightning_ddp/sync/bucket_model.py`).",
            "",
        ]
    elif prediction:
        w = prediction.get("bandwidth_Bps")
        lines += [f"All-reduce fit: o = {prediction['overhead_s'] * 1e3:.3f} ms, w = "
                  f"{f'{w / 1e9:.3f} GB/s' if w else 'unbounded'}; no cell finished yet, so the gradient size (and the "
                  "prediction) is unknown.", ""]
    elif any(has_bucket_axis(r["strategy"]) for r in rows):
        lines += ["No prediction: the all-reduce microbenchmark did not run (`run.predict_bucket_size: false`) or "
                  "failed (see runs/allreduce/).", ""]
    if not any(has_bucket_axis(r["strategy"]) for r in rows):
        return lines + ["No algorithm with buckets in the grid.", ""]
    lines += [
        "Picking the fastest of several noisy bucket sizes and reporting that same measurement is biased low: the "
        "winner is partly the luckiest. So the size is chosen on the *selection* repeats (even indices 0, 2, 4, ...) "
        "and its step time, share and goal ratios come from the *evaluation* repeats (odd indices) only. *In-sample*: "
        "no evaluation repeat exists (fewer than 2 repeats ran), so the choice is reported from the repeats it was "
        "chosen on and its goals are inconclusive.",
        "",
    ]
    predicted = f"{predicted_mb:.3g} MiB" if predicted_mb else "-"
    table = [_bucket_row(analysis, group, strategy, members, predicted)
             for group, members in analysis.groups.items()
             for strategy in strategy_order(variant_of(r) for r in members) if has_buckets(strategy)]
    header = ["precision", "batch", "context", "algorithm", "chosen (of sizes) on repeats", "its step there",
              "step on evaluation repeats [95 %]", "comm share [95 %]", "predicted", "auto cell"]
    lines += markdown_table(header, table, "lrrllrrrll")
    lines += ["", "The model assumes each bucket's backward compute takes as long as its communication; where "
              "compute is much longer than communication (or the reverse) the measured optimum moves away from b*.", ""]
    return lines


def _verdict_text(verdict: str) -> str:
    return {"missed": "**missed**", NOT_MEASURABLE: "not measurable"}.get(verdict, verdict)


def _goal_section(analysis: Analysis) -> list[str]:
    lines = ["## Performance goals", ""]
    counts = {v: 0 for v in ("met", "missed", "inconclusive", NOT_MEASURABLE)}
    for check in analysis.goals:
        counts[check.verdict] += 1
    lines += [
        f"**{counts['met']} met, {counts['missed']} missed, {counts['inconclusive']} inconclusive, "
        f"{counts[NOT_MEASURABLE]} not measurable** (a needed cell has no ok repeat).",
        "",
        "Per group: the ratio of pooled medians [95 % interval: each cell bootstrapped on its own, the ratio taken per "
        "draw]. **met**: the whole interval is at or below the target; **missed**: the whole interval is above it; "
        "**inconclusive**: the interval straddles the target (or the best size is in-sample). A best bucket size "
        "enters with its evaluation repeats only.",
        "",
    ]
    goals = [[*check.group, check.goal, estimate_text(check.estimate, ".3f"), f"{check.target:.3g}",
              _verdict_text(check.verdict), check.note] for check in analysis.goals]
    lines += markdown_table(["precision", "batch", "context", "goal", "ratio [95 %]", "target", "verdict", "note"],
                            goals, "lrrlrrll")
    lines.append("")
    if analysis.across:
        lines += [
            "### Faster than torch DDP, across groups",
            "",
            f"Geometric mean over the groups of goal 1's ratio (best / ddp step time) [95 % interval: every group's "
            f"cells bootstrapped within each draw], against {ACROSS_GROUPS_TARGET:g} (5 % faster than torch DDP); and "
            "how the groups came out on their own against 1.00.",
            "",
        ]
        across = []
        for summary in analysis.across:
            c = summary.counts
            note = " (some best size in-sample)" if summary.in_sample else ""
            across.append([summary.algorithm, summary.groups, estimate_text(summary.estimate, ".3f"),
                           f"{summary.target:g}", f"{_verdict_text(summary.verdict)}{note}",
                           f"{c['met']} / {c['missed']} / {c['inconclusive']} / {c[NOT_MEASURABLE]}"])
        header = ["algorithm", "groups", "geometric mean of best / ddp [95 %]", "target", "verdict",
                  "groups <= 1.00: met / missed / inconclusive / not measurable"]
        lines += markdown_table(header, across, "lrrrll")
        lines.append("")
    return lines


def _failures(rows: list[Row], repeat_rows: list[Row] | None) -> list[str]:
    """The cell repeats (or, given rows only, the cells) that did not finish, with their reasons."""
    per_repeat = repeat_rows is not None
    bad = [r for r in (repeat_rows if per_repeat else rows) if r["status"] not in ("ok", "")]
    if not bad:
        return []
    header = ["cell", "repeat", "status", "reason"] if per_repeat else ["cell", "status", "reason"]
    table = [[r["cell_id"], *([r["repeat"]] if per_repeat else []), r["status"],
              (r.get("reason") or "").replace("|", "\\|")] for r in bad]
    title = "## Cell repeats that did not finish" if per_repeat else "## Cells that did not finish"
    lines = [title, "", *markdown_table(header, table, "lrll" if per_repeat else "lll")]
    return lines + [""]


def _how_to_read(repeats: Any, samples: int) -> list[str]:
    times = f"{repeats} times" if isinstance(repeats, int) else "several times"
    return [
        "## How to read this",
        "",
        f"Every cell runs {times} (*repeats*), each in fresh processes, interleaved round-robin (repeat 0 of "
        "every cell, then repeat 1 of every cell, ...) so that a slow drift of the machine hits every strategy alike. "
        "A cell's step time (and share, and every other median) is the **pooled median** of all measured steps of "
        "its ok repeats. Its **95 % interval** is a two-level bootstrap: resample the repeats with replacement, then "
        f"the steps within each resampled repeat, take the median; the 2.5th to 97.5th percentiles of {samples} "
        "such draws "
        "(fixed seed: rebuilding the report gives the same numbers). The interval says how far the median could move "
        "if the whole measurement were repeated on this machine; it is wider when repeats disagree. A ratio of two "
        "cells takes both bootstraps independently, ratio per draw. **Best bucket size**: chosen on the even "
        "repeats, reported from the odd ones only (selection vs evaluation; see that section). **Verdict** of a goal "
        "`ratio <= target`: met if the interval's upper end is at most the target, missed if its lower end is above "
        "it, inconclusive if it straddles the target.",
        "",
    ]


def _resumed_across(environment: dict[str, Any]) -> str:
    """A note when a resumed sweep's sessions ran different code (commits, or a dirty tree)."""
    sessions = environment.get("sessions") or []
    code = {(str(x.get("git_commit") or "unknown")[:12], bool(x.get("git_dirty"))) for x in sessions}
    if len(code) <= 1:
        return ""
    described = ", ".join(sorted(c + (" (dirty)" if dirty else "") for c, dirty in code))
    return f"; **resumed across {len(sessions)} sessions running different code**: {described}"


def build_report(
    rows: list[Row],
    title: str = "sweep",
    prediction: dict[str, Any] | None = None,
    environment: dict[str, Any] | None = None,
    pending: int = 0,
    analysis: Analysis | None = None,
    repeat_rows: list[Row] | None = None,
) -> str:
    """The whole results.md as a string.

    Args:
        rows: results.csv rows of the cells of the current grid, in grid order.
        title: The sweep's name.
        prediction: ``bucket_prediction.json`` (fit and, once a cell finished, gradient sizes), if any.
        environment: ``environment.json``, for the header.
        pending: Cell repeats of the grid not run yet (a sweep in progress or killed).
        analysis: ``analyze(rows, data, bootstrap)`` with the raw steps; default: from the rows alone.
        repeat_rows: repeats.csv rows of the grid's cells (load guard, failures); default: none.
    """
    analysis = analysis or analyze(rows)
    config = (environment or {}).get("config", {})
    run = config.get("run", {})
    repeats = run.get("repeats", "?")
    lines = [f"# Benchmark sweep: {title}", ""]
    if environment:
        workload = config.get("workload", {})
        device = ", ".join(environment.get("gpus") or []) or environment.get("cpu", {}).get("model", "cpu")
        cores = environment.get("cpu", {}).get("count", "?")
        lines += [
            f"- machine: {device}; {cores} CPU cores; "
            f"{run.get('devices', '?')} ranks over {environment.get('backend', '?')} ({run.get('accelerator', '?')})",
            f"- model: preset `{workload.get('preset')}` from `{workload.get('base_config')}` "
            f"{' '.join(workload.get('cli_args') or [])}".rstrip(),
            f"- {repeats} repeats per cell, interleaved; each {run.get('warmup_steps', '?')} warm-up + "
            f"{run.get('steps', '?')} measured steps in fresh processes; torch {environment.get('torch')}, "
            f"lightning {environment.get('lightning')}, commit {str(environment.get('git_commit') or 'unknown')[:12]}"
            + (" **with uncommitted changes** (environment.json lists them)" if environment.get("git_dirty") else "")
            + _resumed_across(environment),
            "- full configuration, versions and hardware: environment.json; raw data: steps.csv and repeats.csv; "
            "per-repeat logs: runs/<cell_id>/r<k>/",
        ]
    if repeat_rows:
        guarded = [r for r in repeat_rows if r.get("busy") is not None and r.get("busy") != ""]
        if guarded:
            busy = sum(1 for r in guarded if r["busy"] is True)
            waited = sum(r.get("waited_s") or 0.0 for r in guarded)
            threshold = run.get("busy_threshold")
            rule = (f" (CPUs more than {100 * threshold:.0f} % busy after waiting up to "
                    f"{run.get('max_wait_s', '?'):g} s)"
                    if isinstance(threshold, (int, float)) and isinstance(run.get("max_wait_s"), (int, float)) else "")
            lines.append(f"- load guard: **{busy} of {len(guarded)} cell repeats started on a busy machine**{rule}; "
                         f"{waited:,.0f} s waited for an idle machine in all")
        else:
            lines.append("- load guard: off or unavailable (no /proc/stat): no repeat was checked")
        loads = [r["load_avg_1m"] for r in repeat_rows if isinstance(r.get("load_avg_1m"), float)]
        if loads:
            lines.append(
                f"- 1-minute load average after each repeat: {min(loads):.1f} to {max(loads):.1f} on "
                f"{(environment or {}).get('cpu', {}).get('count', '?')} cores (the repeat's own ranks included)"
            )
    if len(lines) > 2:
        lines.append("")
    done = len(repeat_rows) if repeat_rows is not None else sum(1 for r in rows if r["status"])
    if pending:
        what = "cell repeats" if repeat_rows is not None else "cells"
        lines += [f"> {done} of {done + pending} {what} done; rerun the same command to finish the others.", ""]
    lines += _how_to_read(repeats, analysis.bootstrap.samples)
    lines += ["## Step time and communication share", ""]
    lines += _strategy_tables(analysis)
    lines.append("")
    lines += _bucket_section(analysis, prediction)
    lines += _goal_section(analysis)
    lines += _failures(rows, repeat_rows)
    return "\n".join(lines).rstrip() + "\n"
