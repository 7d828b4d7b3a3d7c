"""``results.md``: the study's tables with intervals, the best bucket size chosen without selection bias, the
bucket-size prediction against the measurement, and the performance goals with verdicts.

Everything here works on results.csv rows (``results.parse_row``) plus, for the intervals of ratios and the
selection, the raw steps behind them (``results.CellData`` from steps.csv and repeats.csv), so the report can be
rebuilt from the raw files alone (``--output.report_only true``). Given rows only, each row counts as one
repeat of one step (zero-width intervals, and every best bucket size in-sample). Cells are compared within a
*group*: same precision, per-rank batch size and context length. The statistics are ``bench.stats``'s.

A strategy with engine settings (``grid.engine_settings``) is a *variant* per combination of them
(``variant_of``: ``bucketed_powersgd rank=4``): each variant is reported as a strategy of its own, with its own
line, best bucket size and goal 1.

**Best bucket size without selection bias** (``select_best``). The minimum of several noisy step times is biased
low: the winner is partly the luckiest draw. So for each algorithm with a bucket size, per group, the size with
the lowest pooled median step time on the *selection* repeats (even indices 0, 2, 4, ...) is chosen, and its step
time, share, interval and goal ratios come from the *evaluation* repeats (odd indices) only. With no evaluation
repeat (fewer than 2 repeats ran) the choice is *in-sample*: reported from all its repeats, its goals
``inconclusive``. ``auto`` is one of the candidate sizes.

Performance goals, per group, each a ratio of pooled medians with its 95 % interval (independent bootstraps of
the cells, the ratio per draw; the selected size with its evaluation repeats, every other cell with all of its
repeats) and a verdict: ``met`` if the interval's upper end is <= target, ``missed`` if its lower end is above,
else ``inconclusive``; ``not measurable`` when a needed cell has no ok repeat:

====  ==============================================================  =================================
goal  ratio                                                           target
====  ==============================================================  =================================
1     step(A at its best bucket size) / step(ddp), for ``bucketed``   <= 1
      and every other algorithm A with a bucket size
2     comm_share(overlap) / comm_share(naive), and the same for       <= 1/3
      bucketed at its best bucket size
3     step(bucketed best) / max(step(reference), busy_comm(bucketed   <= 1.10
      best)): how close to the floor set by compute or by the wire
====  ==============================================================  =================================

**Faster than torch DDP, across groups** (``across_groups``): for each algorithm with a bucket size, the geometric
mean over the groups of goal 1's ratio, its interval from the per-draw geometric mean (every group's cells
bootstrapped within each draw), against the target 0.95; and how many groups met, missed or could not decide
goal 1 (<= 1.00) on their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from lightning_ddp.bench.config import (
    BASELINE,
    REFERENCE,
    format_bucket,
    has_bucket_axis,
    sweep_strategies,
    variant_label,
    variant_strategy,
)
from lightning_ddp.bench.results import ESTIMATED_KEYS, CellData, bootstrap_key
from lightning_ddp.bench.stats import Bootstrapper, Estimate, geometric_mean_draws, percentile_interval, pooled_median
from lightning_ddp.bench.stats import verdict as interval_verdict

__all__ = [
    "ACROSS_GROUPS_TARGET",
    "AcrossGroups",
    "Analysis",
    "GoalCheck",
    "Measured",
    "Selection",
    "analyze",
    "build_report",
    "group_rows",
    "strategy_order",
    "variant_of",
]

Row = dict[str, Any]
Group = tuple[str, int, int]

ACROSS_GROUPS_TARGET = 0.95
"""Target of the geometric mean over groups of (best / ddp) step time: 5 % faster than torch DDP."""

NOT_MEASURABLE = "not measurable"

_STEP, _SHARE, _BUSY = range(3)  # columns of ESTIMATED_KEYS

_STRATEGY_TITLES = {
    REFERENCE: "reference (1 process, no communication)",
    BASELINE: "ddp (Lightning / torch DDP)",
}


def variant_of(row: Row) -> str:
    """The row's strategy with its engine settings, what the report compares: ``"bucketed_powersgd rank=4"``, or
    the strategy alone (``"bucketed"``) for a cell that sets none."""
    settings = row.get("engine_settings") or ""
    return f"{row['strategy']} {settings}" if settings else row["strategy"]


def _bucketed(variant: str) -> bool:
    return has_bucket_axis(variant_strategy(variant))


def strategy_order(names: Iterable[str]) -> list[str]:
    """``names`` (strategies or variants, deduplicated) in report order: the reference, the registered algorithms,
    ``ddp``, then any other name; the variants of one strategy, and unknown names, in first-seen order (a strategy
    the registry does not know is shown last, never dropped)."""
    known = [REFERENCE, *[s for s in sweep_strategies() if s != BASELINE], BASELINE]
    position = {s: i for i, s in enumerate(known)}
    present = list(dict.fromkeys(names))
    return sorted(present, key=lambda name: position.get(variant_strategy(name), len(known)))  # stable sort


def group_rows(rows: Iterable[Row]) -> dict[Group, list[Row]]:
    """Rows by ``(precision, batch_size, context_length)``, groups in first-seen order."""
    groups: dict[Group, list[Row]] = {}
    for row in rows:
        groups.setdefault((row["precision"], row["batch_size"], row["context_length"]), []).append(row)
    return groups


def _ok(row: Row | None) -> bool:
    return row is not None and row.get("status") == "ok" and row.get("step_ms_median") is not None


def _find(rows: list[Row], strategy: str) -> Row | None:
    return next((r for r in rows if variant_of(r) == strategy), None)


# ---- measurements of a cell -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """A cell's ``ESTIMATED_KEYS`` (step time, comm share, busy comm) over some of its repeats: pooled medians
    and bootstrap draws."""

    row: Row
    """The cell's results.csv row."""
    repeats: tuple[int, ...]
    """The ok repeats these numbers come from."""
    point: np.ndarray = field(repr=False)
    """``(3,)`` pooled medians."""
    draws: np.ndarray = field(repr=False)
    """``(B, 3)`` hierarchical-bootstrap draws of the medians."""

    def estimate(self, column: int) -> Estimate:
        lo, hi = percentile_interval(self.draws[:, column])
        return Estimate(float(self.point[column]), lo, hi)

    @property
    def step(self) -> Estimate:
        return self.estimate(_STEP)

    @property
    def share(self) -> Estimate:
        return self.estimate(_SHARE)


@dataclass(frozen=True)
class Selection:
    """The best bucket size of one algorithm in one group (module docstring)."""

    group: Group
    strategy: str
    row: Row
    """The chosen cell's results.csv row."""
    selection_repeats: tuple[int, ...]
    """The repeats it was chosen on (even indices; all of them when in-sample)."""
    selection_step_ms: float
    """Its pooled median step time on those repeats: what it won with."""
    evaluated: Measured
    """Its numbers from the evaluation repeats (odd indices; all of them when in-sample)."""
    in_sample: bool
    """No evaluation repeat: the numbers are the ones it was chosen on (biased low), its goals inconclusive."""
    candidates: int
    """Sizes it was chosen from."""


@dataclass(frozen=True)
class GoalCheck:
    """One performance goal evaluated on one group."""

    group: Group
    goal: str
    """What is compared, in words."""
    target: float
    """The goal is met when the interval's upper end is <= ``target``."""
    estimate: Estimate | None = None
    """The ratio and its 95 % interval; ``None`` when a cell it needs has no ok repeat."""
    note: str = ""
    """Why the ratio is missing, which bucket size was best, what the floor was."""
    in_sample: bool = False
    """The ratio involves a best bucket size chosen and measured on the same repeats: never conclusive."""
    algorithm: str = ""
    """For goal 1: the algorithm with a bucket size it is about."""
    draws: np.ndarray | None = field(default=None, repr=False, compare=False)
    """``(B,)`` bootstrap draws of the ratio (for the across-groups geometric mean)."""

    @property
    def verdict(self) -> str:
        """``met``, ``missed``, ``inconclusive`` (``stats.verdict``; always when in-sample) or ``not measurable``."""
        if self.estimate is None:
            return NOT_MEASURABLE
        if self.in_sample:
            return "inconclusive"
        return interval_verdict(self.estimate, self.target)


@dataclass(frozen=True)
class AcrossGroups:
    """Goal 1 of one algorithm summarised over every group: the geometric mean of (best / ddp)."""

    algorithm: str
    estimate: Estimate | None
    """Geometric mean over the measurable groups and its interval; ``None`` when no group is measurable."""
    groups: int
    """Groups in the mean."""
    counts: dict[str, int]
    """Per-group goal-1 verdicts (target 1.00): met, missed, inconclusive, not measurable."""
    in_sample: bool = False
    """Some group's best size is in-sample: the mean cannot be conclusive either."""
    target: float = ACROSS_GROUPS_TARGET

    @property
    def verdict(self) -> str:
        if self.estimate is None:
            return NOT_MEASURABLE
        if self.in_sample:
            return "inconclusive"
        return interval_verdict(self.estimate, self.target)


class Analysis:
    """Selections, goals and the across-groups summary of a sweep's rows (the module docstring's definitions).

    Args:
        rows: results.csv rows of the grid's cells that ran, in grid order.
        data: Each cell's raw repeats and steps (``results.cell_data``); cells missing here count as one repeat of
            one step holding their row's medians (``CellData.from_result_row``).
        bootstrap: Draws per cell and repeat set, shared with results.csv (default: 2000 draws, seed 0).
    """

    def __init__(self, rows: Sequence[Row], data: Mapping[str, CellData] | None = None,
                 bootstrap: Bootstrapper | None = None) -> None:
        self.rows = [r for r in rows if r.get("status")]
        self.bootstrap = bootstrap or Bootstrapper(2000, 0)
        self.data = {r["cell_id"]: (data or {}).get(r["cell_id"]) or CellData.from_result_row(r) for r in self.rows}
        self.groups = group_rows(self.rows)
        self.selections: dict[tuple[Group, str], Selection] = {}
        for group, members in self.groups.items():
            for strategy in strategy_order(variant_of(r) for r in members):
                if _bucketed(strategy):
                    selection = self._select(group, [r for r in members if variant_of(r) == strategy])
                    if selection is not None:
                        self.selections[(group, strategy)] = selection
        self.goals = [check for group, members in self.groups.items() for check in self._goals(group, members)]
        algorithms = strategy_order(variant_of(r) for r in self.rows if has_bucket_axis(r["strategy"]))
        self.across = [self._across(a) for a in algorithms]

    # -- measurements

    def measured(self, row: Row, repeats: Sequence[int] | None = None) -> Measured | None:
        """``row``'s cell over ``repeats`` (default: every ok repeat); ``None`` without an ok repeat among them."""
        data = self.data.get(row["cell_id"])
        if data is None:
            return None
        chosen = tuple(data.ok_repeats if repeats is None else [k for k in repeats if k in data.ok_repeats])
        if not chosen:
            return None
        values = data.values(ESTIMATED_KEYS, chosen)
        draws = self.bootstrap.draws(bootstrap_key(row["cell_id"], chosen), values)
        return Measured(row, chosen, np.asarray(pooled_median(values), dtype=float), draws)

    def _select(self, group: Group, rows: list[Row]) -> Selection | None:
        """The best bucket size of one algorithm in one group (module docstring)."""
        candidates = []
        for order, row in enumerate(rows):
            ok = self.data[row["cell_id"]].ok_repeats if _ok(row) else []
            if ok:
                candidates.append((order, row, ok))
        if not candidates:
            return None

        def median_on(row: Row, repeats: Sequence[int]) -> float:
            values = self.data[row["cell_id"]].values(ESTIMATED_KEYS[:1], repeats)
            value = float(np.atleast_1d(pooled_median(values))[0]) if values else math.nan
            return value if math.isfinite(value) else math.inf

        with_selection = [(o, r, [k for k in ok if k % 2 == 0]) for o, r, ok in candidates]
        with_selection = [c for c in with_selection if c[2]]
        if with_selection:
            order, row, chosen_on = min(with_selection, key=lambda c: (median_on(c[1], c[2]), c[0]))
            evaluation = [k for k in self.data[row["cell_id"]].ok_repeats if k % 2 == 1]
        else:  # every even repeat failed: nothing to choose on out of sample
            order, row, chosen_on = min(candidates, key=lambda c: (median_on(c[1], c[2]), c[0]))
            evaluation = []
        in_sample = not evaluation
        evaluated = self.measured(row, None if in_sample else evaluation)
        assert evaluated is not None  # the row has ok repeats
        return Selection(group, variant_of(row), row, tuple(chosen_on), median_on(row, chosen_on), evaluated,
                         in_sample, len(candidates))

    # -- goals

    def _ratio(self, group: Group, goal: str, target: float, top: Measured, top_column: int, bottom: Measured,
               bottom_column: int, note: str, in_sample: bool = False, algorithm: str = "") -> GoalCheck:
        with np.errstate(divide="ignore", invalid="ignore"):
            draws = top.draws[:, top_column] / bottom.draws[:, bottom_column]
            point = float(top.point[top_column] / bottom.point[bottom_column])
        lo, hi = percentile_interval(draws)
        return GoalCheck(group, goal, target, Estimate(point, lo, hi), note, in_sample, algorithm, draws)

    def _goals(self, group: Group, rows: list[Row]) -> list[GoalCheck]:
        """Goal 1 for bucketed and every other algorithm with a bucket size, goal 2 twice, goal 3 (module docstring)."""
        naive, overlap, ddp, reference = (_find(rows, s) for s in ("naive", "overlap", BASELINE, REFERENCE))
        m_naive, m_overlap, m_ddp, m_reference = (self.measured(r) if _ok(r) else None
                                                 for r in (naive, overlap, ddp, reference))
        checks = []
        algorithms = ["bucketed", *[s for s in strategy_order(variant_of(r) for r in rows)
                                    if _bucketed(s) and s != "bucketed"]]
        for algorithm in algorithms:
            goal = f"1. {algorithm} (best) step time / ddp step time"
            selection = self.selections.get((group, algorithm))
            if selection is not None and m_ddp is not None:
                checks.append(self._ratio(group, goal, 1.0, selection.evaluated, _STEP, m_ddp, _STEP,
                                          _selection_note(selection), selection.in_sample, algorithm))
            else:
                note = _missing(ddp, "ddp") if selection else f"no ok {algorithm} cell"
                checks.append(GoalCheck(group, goal, 1.0, note=note, algorithm=algorithm))

        best = self.selections.get((group, "bucketed"))
        for name, measured, row in (("overlap", m_overlap, overlap),
                                    ("bucketed (best)", best.evaluated if best else None, best.row if best else None)):
            goal = f"2. {name} comm share / naive comm share"
            naive_share = m_naive.point[_SHARE] if m_naive is not None else math.nan
            if m_naive is None:
                checks.append(GoalCheck(group, goal, 1 / 3, note=_missing(naive, "naive")))
            elif not naive_share > 0:
                checks.append(GoalCheck(group, goal, 1 / 3, note="naive comm share is 0 or missing"))
            elif measured is None or not math.isfinite(measured.point[_SHARE]):
                note = _missing(row, "overlap") if name == "overlap" else "no ok bucketed cell"
                checks.append(GoalCheck(group, goal, 1 / 3, note=note))
            else:
                in_sample = best is not None and name != "overlap" and best.in_sample
                note = _selection_note(best) if name != "overlap" and best else ""
                checks.append(self._ratio(group, goal, 1 / 3, measured, _SHARE, m_naive, _SHARE, note, in_sample))

        goal = "3. bucketed (best) step time / max(reference step, busy comm)"
        if best is not None and m_reference is not None:
            top = best.evaluated
            busy_point = top.point[_BUSY] if math.isfinite(top.point[_BUSY]) else 0.0
            floor_point = max(float(m_reference.point[_STEP]), float(busy_point))
            floor_draws = np.fmax(m_reference.draws[:, _STEP], top.draws[:, _BUSY])  # fmax: a missing busy is no floor
            with np.errstate(divide="ignore", invalid="ignore"):
                draws = top.draws[:, _STEP] / floor_draws
            lo, hi = percentile_interval(draws)
            bound = "compute" if m_reference.point[_STEP] >= busy_point else "communication"
            note = f"{_selection_note(best)}; floor {floor_point:,.1f} ms ({bound})"
            checks.append(GoalCheck(group, goal, 1.10, Estimate(float(top.point[_STEP] / floor_point), lo, hi), note,
                                    best.in_sample, "bucketed", draws))
        else:
            checks.append(GoalCheck(group, goal, 1.10, note=_missing(reference, "reference") if best else "no ok bucketed cell"))
        return checks

    def _across(self, algorithm: str) -> AcrossGroups:
        checks = [c for c in self.goals if c.goal.startswith("1.") and c.algorithm == algorithm]
        counts = {v: 0 for v in ("met", "missed", "inconclusive", NOT_MEASURABLE)}
        for check in checks:
            counts[check.verdict] += 1
        measurable = [c for c in checks if c.estimate is not None and c.draws is not None]
        if not measurable:
            return AcrossGroups(algorithm, None, 0, counts)
        with np.errstate(divide="ignore", invalid="ignore"):
            point = float(np.exp(np.mean(np.log([c.estimate.point for c in measurable]))))
        lo, hi = percentile_interval(geometric_mean_draws([c.draws for c in measurable]))
        return AcrossGroups(algorithm, Estimate(point, lo, hi), len(measurable), counts,
                            any(c.in_sample for c in measurable))


def analyze(rows: Sequence[Row], data: Mapping[str, CellData] | None = None,
            bootstrap: Bootstrapper | None = None) -> Analysis:
    """``Analysis(rows, data, bootstrap)``: the selections, goals and across-groups summary of a sweep."""
    return Analysis(rows, data, bootstrap)


# ---- text -------------------------------------------------------------------------------------------------


def _bucket_text(row: Row) -> str:
    size = row["bucket_size_mb"]
    if size == "auto":
        resolved = row.get("resolved_bucket_size_mb")
        return f"auto ({resolved:.3g} MiB)" if isinstance(resolved, float) else "auto"
    return f"{format_bucket(size)} MiB"


def _repeats_text(repeats: Sequence[int]) -> str:
    return ", ".join(map(str, repeats))


def _selection_note(selection: Selection) -> str:
    if selection.in_sample:
        return f"best size {_bucket_text(selection.row)}, in-sample (no evaluation repeat)"
    return f"best size {_bucket_text(selection.row)} (chosen on repeats {_repeats_text(selection.selection_repeats)})"


def _missing(row: Row | None, name: str) -> str:
    if row is None:
        return f"no {name} cell"
    return f"{name} cell {row['status'] or 'not run'}"


def _interval(lo: Any, hi: Any, spec: str, scale: float = 1.0) -> str:
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (lo, hi)):
        return ""
    return f" [{format(lo * scale, spec)}, {format(hi * scale, spec)}]"


def _estimate_text(estimate: Estimate | None, spec: str = ",.1f", scale: float = 1.0, unit: str = "") -> str:
    if estimate is None or not math.isfinite(estimate.point):
        return "-"
    return f"{format(estimate.point * scale, spec)}{unit}{_interval(estimate.lo, estimate.hi, spec, scale)}"


def _cell_text(row: Row | None, bold: bool = False) -> str:
    if row is None:
        return "not run"
    if not _ok(row):
        return row["status"] or "not run"
    text = f"{row['step_ms_median']:,.1f} ms{_interval(row.get('step_ms_lo'), row.get('step_ms_hi'), ',.1f')}"
    if row["strategy"] != REFERENCE and row.get("comm_share") is not None:
        share = _interval(row.get("comm_share_lo"), row.get("comm_share_hi"), ".1f", 100)
        text += f" ({100 * row['comm_share']:.1f} %{share})"
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
            lines.append("| strategy | " + " | ".join(f"context {c}" for c in contexts) + " |")
            lines.append("|---|" + "---:|" * len(contexts))
            variants: dict[tuple, Row] = {}
            for context in contexts:
                for row in groups[(precision, batch, context)]:
                    variants.setdefault((variant_of(row), row["bucket_size_mb"]), row)
            order = strategy_order(strategy for strategy, _ in variants)
            for strategy, size in sorted(variants, key=lambda k: _row_key(variants[k], order)):
                title = _title(strategy, size)
                cells = []
                for context in contexts:
                    row = next((r for r in groups[(precision, batch, context)]
                                if variant_of(r) == strategy and r["bucket_size_mb"] == size), None)
                    cells.append(_cell_text(row, bold=row is not None and row["cell_id"] in selected))
                lines.append(f"| {title} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append(
        "Each cell: pooled median step time [95 % interval] over all its ok repeats (exposed communication share of "
        "the step [95 % interval]). **Bold**: the bucket size selected on the selection repeats, per algorithm with "
        "buckets; its out-of-sample numbers are in the next section. p10/p90, overlap, bus bandwidth, tokens/s, "
        "memory and the load guard's counts are in results.csv; every step in steps.csv."
    )
    return lines


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
        "| precision | batch | context | algorithm | chosen (of sizes) on repeats | its step there | step on evaluation "
        "repeats [95 %] | comm share [95 %] | predicted | auto cell |",
        "|---|---:|---:|---|---|---:|---:|---:|---|---|",
    ]
    predicted = f"{predicted_mb:.3g} MiB" if predicted_mb else "-"
    for group, members in analysis.groups.items():
        for strategy in strategy_order(variant_of(r) for r in members):
            if not _bucketed(strategy):
                continue
            head = f"| {group[0]} | {group[1]} | {group[2]} | {strategy} |"
            auto = next((r for r in members if variant_of(r) == strategy and r["bucket_size_mb"] == "auto"), None)
            auto_text = "not in grid" if auto is None else (
                f"{auto['step_ms_median']:,.1f} ms, {_bucket_text(auto)}" if _ok(auto) else auto["status"] or "not run")
            selection = analysis.selections.get((group, strategy))
            if selection is None:
                lines.append(f"{head} no ok cell | - | - | - | {predicted} | {auto_text} |")
                continue
            evaluated = selection.evaluated
            on = (f"{_bucket_text(selection.row)}, best of {selection.candidates} on "
                  f"{_repeats_text(selection.selection_repeats)}")
            where = (f"in-sample, repeats {_repeats_text(evaluated.repeats)}: " if selection.in_sample
                     else f"repeats {_repeats_text(evaluated.repeats)}: ")
            lines.append(
                f"{head} {on} | {selection.selection_step_ms:,.1f} ms | {where}{_estimate_text(evaluated.step, unit=' ms')} | "
                f"{_estimate_text(evaluated.share, '.1f', 100, ' %')} | {predicted} | {auto_text} |")
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
        "| precision | batch | context | goal | ratio [95 %] | target | verdict | note |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for check in analysis.goals:
        group = check.group
        lines.append(f"| {group[0]} | {group[1]} | {group[2]} | {check.goal} | {_estimate_text(check.estimate, '.3f')} | "
                     f"{check.target:.3g} | {_verdict_text(check.verdict)} | {check.note} |")
    lines.append("")
    if analysis.across:
        lines += [
            "### Faster than torch DDP, across groups",
            "",
            f"Geometric mean over the groups of goal 1's ratio (best / ddp step time) [95 % interval: every group's "
            f"cells bootstrapped within each draw], against {ACROSS_GROUPS_TARGET:g} (5 % faster than torch DDP); and "
            "how the groups came out on their own against 1.00.",
            "",
            "| algorithm | groups | geometric mean of best / ddp [95 %] | target | verdict | groups <= 1.00: met / "
            "missed / inconclusive / not measurable |",
            "|---|---:|---:|---:|---|---|",
        ]
        for summary in analysis.across:
            c = summary.counts
            note = " (some best size in-sample)" if summary.in_sample else ""
            lines.append(
                f"| {summary.algorithm} | {summary.groups} | {_estimate_text(summary.estimate, '.3f')} | "
                f"{summary.target:g} | {_verdict_text(summary.verdict)}{note} | {c['met']} / {c['missed']} / "
                f"{c['inconclusive']} / {c[NOT_MEASURABLE]} |")
        lines.append("")
    return lines


def _failures(rows: list[Row], repeat_rows: list[Row] | None) -> list[str]:
    if repeat_rows is not None:
        bad = [r for r in repeat_rows if r["status"] not in ("ok", "")]
        if not bad:
            return []
        lines = ["## Cell repeats that did not finish", "", "| cell | repeat | status | reason |", "|---|---:|---|---|"]
        for r in bad:
            reason = (r.get("reason") or "").replace("|", "\\|")
            lines.append(f"| {r['cell_id']} | {r['repeat']} | {r['status']} | {reason} |")
        return lines + [""]
    bad = [r for r in rows if r["status"] not in ("ok", "")]
    if not bad:
        return []
    lines = ["## Cells that did not finish", "", "| cell | status | reason |", "|---|---|---|"]
    for r in bad:
        reason = (r.get("reason") or "").replace("|", "\\|")
        lines.append(f"| {r['cell_id']} | {r['status']} | {reason} |")
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
        f"the steps within each resampled repeat, take the median; the 2.5th to 97.5th percentiles of {samples} such draws "
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
            rule = (f" (CPUs more than {100 * threshold:.0f} % busy after waiting up to {run.get('max_wait_s', '?'):g} s)"
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
