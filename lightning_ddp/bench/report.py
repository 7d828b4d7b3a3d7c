"""``results.md``: the study's tables, the bucket-size prediction against the measurement, and the goals.

Everything here works on results.csv rows (``results.parse_row``), so the report can be rebuilt from the CSV
alone (``--output.report_only true``). Cells are compared within a *group*: same precision, per-rank batch
size and context length.

Performance goals, each computed per group from the same sweep and stated as met or missed with its ratio:

====  ==============================================================  =================================
goal  ratio                                                           target
====  ==============================================================  =================================
1     step(bucketed at its best bucket size) / step(ddp)              <= 1
2     comm_share(overlap) / comm_share(naive), and the same for       <= 1/3
      bucketed at its best bucket size
3     step(bucketed best) / max(step(reference), busy_comm(bucketed   <= 1.10
      best)): how close to the floor set by compute or by the wire
====  ==============================================================  =================================

"Best bucket size" is the bucketed cell (``auto`` included) with the lowest median step time in the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from lightning_ddp.bench.config import BASELINE, REFERENCE, format_bucket, has_bucket_axis, sweep_strategies

__all__ = ["GoalCheck", "best_bucketed", "best_variant", "build_report", "goal_checks", "group_rows", "strategy_order"]

Row = dict[str, Any]
Group = tuple[str, int, int]

_STRATEGY_TITLES = {
    REFERENCE: "reference (1 process, no communication)",
    BASELINE: "ddp (Lightning / torch DDP)",
}


def strategy_order(names: Iterable[str]) -> list[str]:
    """``names`` (deduplicated) in report order: the reference, the registered algorithms, ``ddp``, then any
    other name in first-seen order (a strategy the registry does not know is shown last, never dropped)."""
    known = [REFERENCE, *[s for s in sweep_strategies() if s != BASELINE], BASELINE]
    present = list(dict.fromkeys(names))
    return [s for s in known if s in present] + [s for s in present if s not in known]


@dataclass(frozen=True)
class GoalCheck:
    """One performance goal evaluated on one group."""

    group: Group
    goal: str
    """What is compared, in words."""
    ratio: float | None
    """The measured ratio; ``None`` when a cell it needs is missing or not ok."""
    target: float
    """The goal is met when ``ratio <= target``."""
    note: str = ""
    """Why the ratio is missing, or which bucket size was best."""

    @property
    def met(self) -> bool | None:
        return None if self.ratio is None else self.ratio <= self.target + 1e-12


def group_rows(rows: Iterable[Row]) -> dict[Group, list[Row]]:
    """Rows by ``(precision, batch_size, context_length)``, groups in first-seen order."""
    groups: dict[Group, list[Row]] = {}
    for row in rows:
        groups.setdefault((row["precision"], row["batch_size"], row["context_length"]), []).append(row)
    return groups


def _ok(row: Row | None) -> bool:
    return row is not None and row.get("status") == "ok" and row.get("step_ms_median") is not None


def _find(rows: list[Row], strategy: str) -> Row | None:
    return next((r for r in rows if r["strategy"] == strategy), None)


def best_variant(rows: list[Row], strategy: str) -> Row | None:
    """The ok row of ``strategy`` with the lowest median step time (over its bucket sizes, ``auto`` included)."""
    candidates = [r for r in rows if r["strategy"] == strategy and _ok(r)]
    return min(candidates, key=lambda r: r["step_ms_median"], default=None)


def best_bucketed(rows: list[Row]) -> Row | None:
    """The ok ``bucketed`` row with the lowest median step time (``auto`` included), or ``None``."""
    return best_variant(rows, "bucketed")


def _bucket_text(row: Row) -> str:
    size = row["bucket_size_mb"]
    if size == "auto":
        resolved = row.get("resolved_bucket_size_mb")
        return f"auto ({resolved:.3g} MiB)" if isinstance(resolved, float) else "auto"
    return f"{format_bucket(size)} MiB"


def _missing(row: Row | None, name: str) -> str:
    if row is None:
        return f"no {name} cell"
    return f"{name} cell {row['status'] or 'not run'}"


def goal_checks(group: Group, rows: list[Row]) -> list[GoalCheck]:
    """The four checks of one group (goal 2 is checked for overlap and for bucketed)."""
    naive, overlap, ddp, reference = (_find(rows, s) for s in ("naive", "overlap", BASELINE, REFERENCE))
    best = best_bucketed(rows)
    best_note = f"best bucket size {_bucket_text(best)}" if best else ""
    checks = []

    if _ok(best) and _ok(ddp):
        checks.append(GoalCheck(group, "1. bucketed (best) step time / ddp step time", best["step_ms_median"] / ddp["step_ms_median"], 1.0, best_note))
    else:
        checks.append(GoalCheck(group, "1. bucketed (best) step time / ddp step time", None, 1.0, _missing(ddp, "ddp") if best else "no ok bucketed cell"))

    for name, row, note in (("overlap", overlap, ""), ("bucketed (best)", best, best_note)):
        goal = f"2. {name} comm share / naive comm share"
        if not _ok(naive) or naive.get("comm_share") in (None, 0):
            checks.append(GoalCheck(group, goal, None, 1 / 3, _missing(naive, "naive") if not _ok(naive) else "naive comm share is 0"))
        elif not _ok(row) or row.get("comm_share") is None:
            checks.append(GoalCheck(group, goal, None, 1 / 3, _missing(row, name.split()[0]) if name == "overlap" else "no ok bucketed cell"))
        else:
            checks.append(GoalCheck(group, goal, row["comm_share"] / naive["comm_share"], 1 / 3, note))

    goal = "3. bucketed (best) step time / max(reference step, busy comm)"
    if _ok(best) and _ok(reference):
        floor = max(reference["step_ms_median"], best.get("busy_comm_ms") or 0.0)
        bound = "compute" if reference["step_ms_median"] >= (best.get("busy_comm_ms") or 0.0) else "communication"
        checks.append(GoalCheck(group, goal, best["step_ms_median"] / floor, 1.10, f"{best_note}; floor {floor:.1f} ms ({bound})"))
    else:
        checks.append(GoalCheck(group, goal, None, 1.10, _missing(reference, "reference") if best else "no ok bucketed cell"))
    return checks


def _cell_text(row: Row | None, bold: bool = False) -> str:
    if row is None:
        return "not run"
    if row["status"] != "ok":
        return row["status"] or "not run"
    text = f"{row['step_ms_median']:,.1f} ms"
    if row["strategy"] != REFERENCE and row.get("comm_share") is not None:
        text += f" ({100 * row['comm_share']:.1f} %)"
    return f"**{text}**" if bold else text


def _row_key(row: Row, order: list[str]) -> tuple:
    size = row["bucket_size_mb"]
    # strategies in report order; numeric bucket sizes ascending, then auto
    return (order.index(row["strategy"]), 1 if size == "auto" else 0, size if isinstance(size, float) else 0.0)


def _strategy_tables(rows: list[Row]) -> list[str]:
    lines = []
    groups = group_rows(rows)
    precisions = list(dict.fromkeys(g[0] for g in groups))
    for precision in precisions:
        batches = list(dict.fromkeys(g[1] for g in groups if g[0] == precision))
        for batch in batches:
            contexts = sorted({g[2] for g in groups if g[0] == precision and g[1] == batch})
            lines += [f"### {precision}, batch size {batch} per rank", ""]
            lines.append("| strategy | " + " | ".join(f"context {c}" for c in contexts) + " |")
            lines.append("|---|" + "---:|" * len(contexts))
            variants: dict[tuple, Row] = {}
            for context in contexts:
                for row in groups[(precision, batch, context)]:
                    variants.setdefault((row["strategy"], row["bucket_size_mb"]), row)
            order = strategy_order(strategy for strategy, _ in variants)
            for strategy, size in sorted(variants, key=lambda k: _row_key(variants[k], order)):
                title = _STRATEGY_TITLES.get(strategy, strategy)
                if has_bucket_axis(strategy):
                    title += f" {'auto' if size == 'auto' else format_bucket(size) + ' MiB'}"
                cells = []
                for context in contexts:
                    row = next((r for r in groups[(precision, batch, context)]
                                if r["strategy"] == strategy and r["bucket_size_mb"] == size), None)
                    best = best_variant(groups[(precision, batch, context)], strategy) if has_bucket_axis(strategy) else None
                    cells.append(_cell_text(row, bold=best is not None and row is best))
                lines.append(f"| {title} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append(
        "Each cell: median step time over the measured steps (exposed communication share of the step). "
        "**Bold**: the best bucket size of that column (per algorithm with buckets). p10/p90, overlap, bus bandwidth, tokens/s and memory are in "
        "results.csv."
    )
    return lines


def _bucket_section(rows: list[Row], prediction: dict[str, Any] | None) -> list[str]:
    lines = ["## Bucket size: predicted vs measured", ""]
    predicted_mb = None
    if prediction and prediction.get("bucket_bytes"):
        predicted_mb = prediction["bucket_bytes"] / 2**20
        o_ms, w = prediction["overhead_s"] * 1e3, prediction.get("bandwidth_Bps")
        w_text = f"{w / 1e9:.3f} GB/s" if w else "unbounded (time did not grow with size)"
        s_mb, largest_mb = prediction["grad_bytes"] / 2**20, prediction["largest_param_bytes"] / 2**20
        sizes = prediction.get("sizes") or []
        span = f"{len(sizes)} message sizes, {sizes[0] / 1024:g} KiB to {sizes[-1] / 2**20:g} MiB" if sizes else "the microbenchmark"
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
    elif any(r["strategy"] == "bucketed" for r in rows):
        lines += ["No prediction: the all-reduce microbenchmark did not run (`run.predict_bucket_size: false`) or "
                  "failed (see runs/allreduce/).", ""]

    lines.append("| precision | batch | context | measured best | its step ms | predicted | auto cell |")
    lines.append("|---|---:|---:|---|---:|---|---|")
    any_bucketed = False
    for group, group_rows_ in group_rows(rows).items():
        bucketed = [r for r in group_rows_ if r["strategy"] == "bucketed"]
        if not bucketed:
            continue
        any_bucketed = True
        best = best_bucketed(bucketed)
        auto = next((r for r in bucketed if r["bucket_size_mb"] == "auto"), None)
        auto_text = "not in grid" if auto is None else (
            f"{auto['step_ms_median']:,.1f} ms, {_bucket_text(auto)}" if _ok(auto) else auto["status"] or "not run")
        predicted = f"{predicted_mb:.3g} MiB" if predicted_mb else "-"
        if best is None:
            lines.append(f"| {group[0]} | {group[1]} | {group[2]} | no ok cell | - | {predicted} | {auto_text} |")
        else:
            lines.append(f"| {group[0]} | {group[1]} | {group[2]} | {_bucket_text(best)} | {best['step_ms_median']:,.1f} | {predicted} | {auto_text} |")
    if not any_bucketed:
        lines.append("| - | - | - | bucketed not in the grid | - | - | - |")
    lines += ["", "The model assumes each bucket's backward compute takes as long as its communication; where "
              "compute is much longer than communication (or the reverse) the measured optimum moves away from b*.", ""]
    return lines


def _goal_section(rows: list[Row]) -> list[str]:
    lines = ["## Performance goals", "",
             "Ratios from this sweep, per group; a goal is met when the ratio is at most the target.", "",
             "| precision | batch | context | goal | ratio | target | result | note |",
             "|---|---:|---:|---|---:|---:|---|---|"]
    met = missed = unknown = 0
    for group, group_rows_ in group_rows(rows).items():
        for check in goal_checks(group, group_rows_):
            if check.met is None:
                unknown += 1
                result, ratio = "n/a", "-"
            else:
                ratio = f"{check.ratio:.3f}"
                result = "met" if check.met else "**missed**"
                met, missed = met + check.met, missed + (not check.met)
            lines.append(f"| {group[0]} | {group[1]} | {group[2]} | {check.goal} | {ratio} | {check.target:.3g} | {result} | {check.note} |")
    lines[2:2] = [f"**{met} met, {missed} missed, {unknown} not measurable** (a needed cell failed or is missing).", ""]
    return lines + [""]


def _failures(rows: list[Row]) -> list[str]:
    bad = [r for r in rows if r["status"] not in ("ok", "")]
    if not bad:
        return []
    lines = ["## Cells that did not finish", "", "| cell | status | reason |", "|---|---|---|"]
    for r in bad:
        reason = (r.get("reason") or "").replace("|", "\\|")
        lines.append(f"| {r['cell_id']} | {r['status']} | {reason} |")
    return lines + [""]


def build_report(
    rows: list[Row],
    title: str = "sweep",
    prediction: dict[str, Any] | None = None,
    environment: dict[str, Any] | None = None,
    pending: int = 0,
) -> str:
    """The whole results.md as a string.

    Args:
        rows: Parsed results.csv rows of the cells of the current grid, in grid order.
        title: The sweep's name.
        prediction: ``bucket_prediction.json`` (fit and, once a cell finished, gradient sizes), if any.
        environment: ``environment.json``, for the header.
        pending: Cells of the grid not run yet (a sweep in progress or killed).
    """
    lines = [f"# Benchmark sweep: {title}", ""]
    if environment:
        run = environment.get("config", {}).get("run", {})
        workload = environment.get("config", {}).get("workload", {})
        device = ", ".join(environment.get("gpus") or []) or environment.get("cpu", {}).get("model", "cpu")
        lines += [
            f"- machine: {device}; {environment.get('cpu', {}).get('count', '?')} CPU cores; "
            f"{run.get('devices', '?')} ranks over {environment.get('backend', '?')} ({run.get('accelerator', '?')})",
            f"- model: preset `{workload.get('preset')}` from `{workload.get('base_config')}` "
            f"{' '.join(workload.get('cli_args') or [])}".rstrip(),
            f"- {run.get('warmup_steps', '?')} warm-up + {run.get('steps', '?')} measured steps per cell; "
            f"torch {environment.get('torch')}, lightning {environment.get('lightning')}, "
            f"commit {str(environment.get('git_commit') or 'unknown')[:12]}"
            + (" **with uncommitted changes** (environment.json lists them)" if environment.get("git_dirty") else ""),
            "- full configuration, versions and hardware: environment.json; per-cell logs: runs/<cell_id>/",
        ]
        loads = [r["load_avg_1m"] for r in rows if isinstance(r.get("load_avg_1m"), float)]
        if loads:
            lines.append(
                f"- 1-minute load average at the end of each cell: {min(loads):.1f} to {max(loads):.1f} on "
                f"{environment.get('cpu', {}).get('count', '?')} cores (the cell's own ranks included); more than "
                "the cores means other work shared them and inflated the times"
            )
        lines.append("")
    done = sum(1 for r in rows if r["status"])
    if pending:
        lines += [f"> {done} of {done + pending} cells done; rerun the same command to finish the others.", ""]
    lines += ["## Step time and communication share", ""]
    lines += _strategy_tables([r for r in rows if r["status"]])
    lines.append("")
    lines += _bucket_section([r for r in rows if r["status"]], prediction)
    lines += _goal_section([r for r in rows if r["status"]])
    lines += _failures(rows)
    return "\n".join(lines).rstrip() + "\n"

