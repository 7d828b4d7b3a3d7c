"""The sweep's analysis, from results.csv rows and the raw steps behind them: per group (precision, batch, context)
the best bucket size chosen on the selection repeats and measured on the evaluation repeats, the goals with
intervals and verdicts, and goal 1 across the groups. docs/benchmarks.md states the goals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from lightning_ddp import catalogue
from lightning_ddp.bench.config import BASELINE, REFERENCE, has_bucket_axis, strategy_with_memory_model
from lightning_ddp.catalogue import format_bucket, variant_strategy
from lightning_ddp.bench.results import ESTIMATED_KEYS, CellData, bootstrap_key
from lightning_ddp.bench.stats import Bootstrapper, Estimate, geometric_mean_draws, percentile_interval, pooled_median
from lightning_ddp.bench.stats import verdict as interval_verdict


__all__ = [
    "ACROSS_GROUPS_TARGET",
    "NOT_MEASURABLE",
    "AcrossGroups",
    "Analysis",
    "GoalCheck",
    "Measured",
    "Selection",
    "analyze",
    "bucket_text",
    "group_rows",
    "has_buckets",
    "is_ok",
    "repeats_text",
    "strategy_order",
    "variant_of",
]

Row = dict[str, Any]
Group = tuple[str, int, int]

ACROSS_GROUPS_TARGET = 0.95
"""Target of the geometric mean over groups of (best / ddp) step time: 5 % faster than torch DDP."""

NOT_MEASURABLE = "not measurable"

_STEP, _SHARE, _BUSY = range(3)  # columns of ESTIMATED_KEYS


def variant_of(row: Row) -> str:
    """The row's strategy with its engine settings, what the report compares: ``"bucketed_powersgd rank=4"``, or
    the strategy alone (``"bucketed"``) for a cell that sets none."""
    settings = row.get("engine_settings") or ""
    return f"{row['strategy']} {settings}" if settings else row["strategy"]


def has_buckets(variant: str) -> bool:
    """Whether the strategy of ``variant`` (a strategy, or a strategy with engine settings) has a bucket size."""
    return has_bucket_axis(variant_strategy(variant))


def strategy_order(names: Iterable[str]) -> list[str]:
    """``names`` (strategies or variants, deduplicated) in report order: the reference, the registered algorithms,
    ``ddp``, then any other name; the variants of one strategy, and unknown names, in first-seen order (a strategy
    the registry does not know is shown last, never dropped)."""
    known = [REFERENCE, *[s for s in catalogue.names() if s != BASELINE], BASELINE]
    position = {s: i for i, s in enumerate(known)}
    present = list(dict.fromkeys(names))
    return sorted(present, key=lambda name: position.get(variant_strategy(name), len(known)))  # stable sort


def group_rows(rows: Iterable[Row]) -> dict[Group, list[Row]]:
    """Rows by ``(precision, batch_size, context_length)``, groups in first-seen order."""
    groups: dict[Group, list[Row]] = {}
    for row in rows:
        groups.setdefault((row["precision"], row["batch_size"], row["context_length"]), []).append(row)
    return groups


def is_ok(row: Row | None) -> bool:
    """Whether ``row`` is a cell that finished with a step time (``status`` ok)."""
    return row is not None and row.get("status") == "ok" and row.get("step_ms_median") is not None


def _find(rows: list[Row], strategy: str) -> Row | None:
    return next((r for r in rows if variant_of(r) == strategy), None)


def _verdict(estimate: Estimate | None, target: float, in_sample: bool) -> str:
    """``not measurable`` without an estimate; ``inconclusive`` when a best size is in-sample; else
    ``stats.verdict``."""
    if estimate is None:
        return NOT_MEASURABLE
    if in_sample:
        return "inconclusive"
    return interval_verdict(estimate, target)


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
        return _verdict(self.estimate, self.target, self.in_sample)


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
        """As ``GoalCheck.verdict``, for the geometric mean against ``target``."""
        return _verdict(self.estimate, self.target, self.in_sample)


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
                if has_buckets(strategy):
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
            ok = self.data[row["cell_id"]].ok_repeats if is_ok(row) else []
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
        # The goals' strategies, by what they keep: per-tensor blocking, per-tensor overlapping, and buckets.
        naive_name, overlap_name = strategy_with_memory_model("none"), strategy_with_memory_model("per_tensor")
        bucketed = catalogue.DEFAULT_ENGINE
        naive, overlap, ddp, reference = (_find(rows, s) for s in (naive_name, overlap_name, BASELINE, REFERENCE))
        m_naive, m_overlap, m_ddp, m_reference = (self.measured(r) if is_ok(r) else None
                                                 for r in (naive, overlap, ddp, reference))
        checks = []
        algorithms = [bucketed, *[s for s in strategy_order(variant_of(r) for r in rows)
                                  if has_buckets(s) and s != bucketed]]
        for algorithm in algorithms:
            goal = f"1. {algorithm} (best) step time / ddp step time"
            selection = self.selections.get((group, algorithm))
            if selection is not None and m_ddp is not None:
                checks.append(self._ratio(group, goal, 1.0, selection.evaluated, _STEP, m_ddp, _STEP,
                                          _selection_note(selection), selection.in_sample, algorithm))
            else:
                note = _missing(ddp, "ddp") if selection else f"no ok {algorithm} cell"
                checks.append(GoalCheck(group, goal, 1.0, note=note, algorithm=algorithm))

        best = self.selections.get((group, bucketed))
        best_measured, best_row = (best.evaluated, best.row) if best else (None, None)
        compared = ((overlap_name, m_overlap, overlap), (f"{bucketed} (best)", best_measured, best_row))
        for name, measured, row in compared:
            goal = f"2. {name} comm share / {naive_name} comm share"
            naive_share = m_naive.point[_SHARE] if m_naive is not None else math.nan
            if m_naive is None:
                checks.append(GoalCheck(group, goal, 1 / 3, note=_missing(naive, naive_name)))
            elif not naive_share > 0:
                checks.append(GoalCheck(group, goal, 1 / 3, note=f"{naive_name} comm share is 0 or missing"))
            elif measured is None or not math.isfinite(measured.point[_SHARE]):
                note = _missing(row, overlap_name) if name == overlap_name else f"no ok {bucketed} cell"
                checks.append(GoalCheck(group, goal, 1 / 3, note=note))
            else:
                in_sample = best is not None and name != overlap_name and best.in_sample
                note = _selection_note(best) if name != overlap_name and best else ""
                checks.append(self._ratio(group, goal, 1 / 3, measured, _SHARE, m_naive, _SHARE, note, in_sample))

        goal = f"3. {bucketed} (best) step time / max(reference step, busy comm)"
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
                                    best.in_sample, bucketed, draws))
        else:
            note = _missing(reference, REFERENCE) if best else f"no ok {bucketed} cell"
            checks.append(GoalCheck(group, goal, 1.10, note=note))
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


# ---- the notes' text ---------------------------------------------------------------------------------------


def bucket_text(row: Row) -> str:
    """The row's bucket size for a reader: ``4 MiB``, or ``auto (12.3 MiB)`` with the size ``auto`` resolved to.

    >>> bucket_text({"bucket_size_mb": 4.0}), bucket_text({"bucket_size_mb": "auto", "resolved_bucket_size_mb": 12.34})
    ('4 MiB', 'auto (12.3 MiB)')
    """
    size = row["bucket_size_mb"]
    if size == "auto":
        resolved = row.get("resolved_bucket_size_mb")
        return f"auto ({resolved:.3g} MiB)" if isinstance(resolved, float) else "auto"
    return f"{format_bucket(size)} MiB"


def repeats_text(repeats: Sequence[int]) -> str:
    """Repeat indices as a list for a reader: ``0, 2, 4``."""
    return ", ".join(map(str, repeats))


def _selection_note(selection: Selection) -> str:
    if selection.in_sample:
        return f"best size {bucket_text(selection.row)}, in-sample (no evaluation repeat)"
    return f"best size {bucket_text(selection.row)} (chosen on repeats {repeats_text(selection.selection_repeats)})"


def _missing(row: Row | None, name: str) -> str:
    if row is None:
        return f"no {name} cell"
    return f"{name} cell {row['status'] or 'not run'}"
