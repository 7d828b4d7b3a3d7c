"""The sweep's files (repeats.csv, steps.csv, results.csv), analysis (best bucket sizes, goals, verdicts), results.md
and plots, computed from the raw files alone; docs/benchmarks.md lists every column and defines the analysis."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from lightning_ddp import catalogue, files
from lightning_ddp.bench.config import DDP_BASELINE, REFERENCE, has_bucket_axis, strategy_with_memory_model
from lightning_ddp.bench.stats import (
    Bootstrapper, Estimate, geometric_mean_draws, interval_text, pooled_median, pooled_percentile,
)
from lightning_ddp.bench.stats import verdict as interval_verdict
from lightning_ddp.bench.study import with_interval
from lightning_ddp.reporting.provenance import code_version
from lightning_ddp.reporting.tables import csv_text, markdown_table, read_csv
from lightning_ddp.reporting.variants import format_bucket, variant_label, variant_strategy

Row = dict[str, Any]
"""One CSV row read back (``parse_row``): column -> number, text, bool or ``None`` for an empty cell."""
RepeatKey = tuple[str, int]
"""``(cell_id, repeat)``: one repeat of one cell."""

_COORDINATES = ("strategy", "bucket_size_mb", "engine_settings", "batch_size", "context_length", "precision", "model",
                "world_size", "accelerator", "backend")
"""What places a cell in the grid: the columns every repeat of a cell shares."""

REPEAT_COLUMNS: tuple[str, ...] = (
    "cell_id", "repeat", *_COORDINATES, "status", "reason", "wall_s", "measured_steps", "resolved_bucket_size_mb",
    "busy_before", "waited_s", "busy", "load_avg_1m", "started_at",
)
"""The exact columns of repeats.csv, in order."""

STEP_ID_COLUMNS: tuple[str, ...] = ("cell_id", "repeat", "step")
"""The first columns of steps.csv; the metric keys follow, in first-seen order."""

RESULT_COLUMNS: tuple[str, ...] = (
    "cell_id", *_COORDINATES, "status", "reason", "repeats_ok", "repeats_run",
    "step_ms_median", "step_ms_lo", "step_ms_hi", "step_ms_p10", "step_ms_p90", "exposed_comm_ms", "busy_comm_ms",
    "wait_comm_ms", "transfer_comm_ms", "comm_share", "comm_share_lo", "comm_share_hi", "overlap", "busbw_GBps",
    "tokens_per_s", "mfu", "peak_memory_MiB",
    "resolved_bucket_size_mb", "measured_steps", "wall_s", "load_avg_1m", "busy_repeats", "waited_s",
)
"""The exact columns of results.csv, in order."""

_INTEGER_COLUMNS = frozenset({"batch_size", "context_length", "world_size", "repeat", "repeats_ok", "repeats_run",
                              "busy_repeats"})
"""The ``NUMERIC_COLUMNS`` read back as ``int``; the others are ``float``."""
NUMERIC_COLUMNS: frozenset[str] = frozenset(RESULT_COLUMNS[RESULT_COLUMNS.index("repeats_ok"):]) | _INTEGER_COLUMNS | {
    "bucket_size_mb", "busy_before"}
"""Columns ``parse_row`` turns into numbers (empty cells become ``None``; a bucket size may be ``auto``): results.csv's
from ``repeats_ok`` on, which holds every number of repeats.csv but ``busy_before``."""

ESTIMATED_KEYS: tuple[str, ...] = ("step/time_ms", "comm/share", "comm/busy_ms")
"""The metrics bootstrapped together (the same resampled steps): what the report's intervals and goals need."""
STEP, SHARE, BUSY = range(3)  # their columns

# (column, CommTimer key) of the pooled-median columns without an interval
_MEDIANS = (
    ("exposed_comm_ms", "comm/exposed_ms"),
    ("busy_comm_ms", "comm/busy_ms"),
    ("wait_comm_ms", "comm/wait_ms"),
    ("transfer_comm_ms", "comm/transfer_ms"),
    ("overlap", "comm/overlap"),
    ("busbw_GBps", "comm/busbw_GBps"),
    ("tokens_per_s", "step/tokens_per_s"),
    ("mfu", "step/mfu"),
)


@dataclass(frozen=True)
class Measured:
    """A cell's ``ESTIMATED_KEYS`` over some of its ok ``repeats``: ``(3,)`` pooled medians, ``(B, 3)`` draws."""

    repeats: tuple[int, ...]
    """The ok repeats whose steps it pools."""
    point: np.ndarray = field(repr=False)
    draws: np.ndarray = field(repr=False)

    def estimate(self, column: int) -> Estimate:
        """The point and 95 % interval of ``ESTIMATED_KEYS[column]``."""
        return Estimate.of(self.point[column], self.draws[:, column])

    def ratio(self, other: Measured, column: int) -> Ratio:
        """This over ``other`` in ``column``, draw by draw (paired by their resampled steps)."""
        return Ratio(self.point[column] / other.point[column], self.draws[:, column] / other.draws[:, column])


@dataclass(frozen=True)
class Ratio:
    """A goal's ratio of pooled medians: the ``point`` and one value per bootstrap draw (its 95 % interval)."""

    point: float
    draws: np.ndarray = field(repr=False, compare=False)

    @property
    def estimate(self) -> Estimate:
        """The ratio and its 95 % interval over the draws."""
        return Estimate.of(self.point, self.draws)


@dataclass
class CellData:
    """One cell's coordinates (``meta``), its repeats.csv rows and the measured steps of its ok repeats (by index)."""

    cell_id: str
    meta: Row
    """The cell's grid coordinates (``_COORDINATES``), from its first repeat's row."""
    repeats: list[Row] = field(default_factory=list)
    """Its repeats.csv rows, every status, in repeat order."""
    steps: dict[int, list[Row]] = field(default_factory=dict)
    """Repeat index -> that repeat's steps.csv rows; only ok repeats have an entry."""

    @property
    def ok_repeats(self) -> list[int]:
        """Indices of the ok repeats that have measured steps, ascending."""
        return sorted(k for k, rows in self.steps.items() if rows)

    def metric_keys(self) -> list[str]:
        """The metric keys of the ok repeats' steps, in first-seen order."""
        keys: dict[str, None] = {}
        for k in self.ok_repeats:
            for step in self.steps[k]:
                keys.update(dict.fromkeys(key for key in step if key not in STEP_ID_COLUMNS))
        return list(keys)

    def values(self, keys: Sequence[str], repeats: Iterable[int] | None = None) -> list[np.ndarray]:
        """One ``(steps, len(keys))`` array per ok repeat of ``repeats`` (default all); NaN for a missing key."""
        return [np.array([[step.get(key, math.nan) for key in keys] for step in self.steps[k]], dtype=float)
                for k in (self.ok_repeats if repeats is None else repeats)]

    def measured(self, bootstrap: Bootstrapper, repeats: Iterable[int] | None = None) -> Measured | None:
        """The cell over ``repeats`` (default: every ok repeat); ``None`` without an ok repeat among them. The draws
        are named ``"<id>|r0,1,2"`` (``stats.rng_for``): the report's ratios reuse those behind results.csv."""
        chosen = tuple(self.ok_repeats if repeats is None else [k for k in repeats if k in self.ok_repeats])
        if not chosen:
            return None
        values = self.values(ESTIMATED_KEYS, chosen)
        draws = bootstrap.draws(f"{self.cell_id}|r" + ",".join(map(str, chosen)), values)
        return Measured(chosen, np.asarray(pooled_median(values), dtype=float), draws)


def cell_data(repeat_rows: Iterable[Row], step_rows: Iterable[Row]) -> dict[str, CellData]:
    """Every cell of ``repeat_rows`` with its steps (steps of a repeat that is not an ok row are ignored)."""
    cells: dict[str, CellData] = {}
    ok: set[RepeatKey] = set()
    for row in sorted(repeat_rows, key=itemgetter("repeat")):
        data = cells.setdefault(row["cell_id"], CellData(row["cell_id"], {c: row.get(c) for c in _COORDINATES}))
        data.repeats.append(row)
        if row["status"] == "ok":
            ok.add((row["cell_id"], row["repeat"]))
    for step in step_rows:
        key = (step["cell_id"], step["repeat"])
        if key in ok:
            cells[key[0]].steps.setdefault(key[1], []).append(step)
    return cells


@dataclass(frozen=True)
class LoadTally:
    """What the load guard saw over some repeats.csv rows."""

    busy: int  # repeats that started on a busy machine (after the guard's longest wait)
    guarded: int  # repeats the guard sampled (the others ran with it off, or where it cannot read the CPU)
    waited_s: float  # seconds the guard waited for an idle machine, in all
    loads: list[float]  # the 1-minute load averages recorded


def load_tally(repeat_rows: Sequence[Row]) -> LoadTally:
    """The load guard over repeats.csv rows."""
    guarded = [r for r in repeat_rows if r.get("busy") not in (None, "")]
    loads = [r["load_avg_1m"] for r in repeat_rows if isinstance(r.get("load_avg_1m"), (int, float))]
    waited = sum(r.get("waited_s") or 0.0 for r in guarded)
    return LoadTally(busy=sum(1 for r in guarded if r["busy"] is True), guarded=len(guarded), waited_s=waited,
                     loads=loads)


def cell_row(data: CellData, bootstrap: Bootstrapper) -> Row:
    """The results.csv row of one cell, intervals from ``bootstrap`` over its ok repeats."""
    row: Row = {column: "" for column in RESULT_COLUMNS}
    row.update(data.meta, cell_id=data.cell_id)
    run = data.repeats
    ok = data.ok_repeats
    failed = [r for r in run if r["status"] != "ok"]
    if ok:
        row["status"] = "ok"
    elif run:
        row["status"] = run[-1]["status"]  # the last repeat's, where none was ok
    if failed:
        first = failed[0]
        more = f" ({len(failed)} of {len(run)} repeats not ok)" if len(run) > 1 else ""
        row["reason"] = f"r{first['repeat']}: {first['status']}: {first['reason']}{more}".rstrip()
    row.update(
        repeats_ok=len(ok),
        repeats_run=len(run),
        wall_s=round(sum(r.get("wall_s") or 0.0 for r in run), 1),
    )
    tally = load_tally(run)
    row["load_avg_1m"] = max(tally.loads, default="")
    if tally.guarded:
        row.update(busy_repeats=tally.busy, waited_s=round(tally.waited_s, 1))
    resolved = [r["resolved_bucket_size_mb"] for r in run
                if r["status"] == "ok" and isinstance(r.get("resolved_bucket_size_mb"), (int, float))]
    if resolved:
        row["resolved_bucket_size_mb"] = float(np.median(resolved))
    if not ok:
        return row

    keys = data.metric_keys()
    values = data.values(keys)
    medians = dict(zip(keys, np.atleast_1d(pooled_median(values))))
    if "step/time_ms" in medians:
        step_values = [v[:, keys.index("step/time_ms")] for v in values]
        measured = data.measured(bootstrap)
        row.update(with_interval("step_ms", measured.estimate(STEP), point="step_ms_median"),
                   step_ms_p10=float(pooled_percentile(step_values, 10)),
                   step_ms_p90=float(pooled_percentile(step_values, 90)),
                   measured_steps=int(sum(np.isfinite(v).sum() for v in step_values)))
        if "comm/share" in medians:
            row.update(with_interval("comm_share", measured.estimate(SHARE)))
    # A cell with no comm/ key (the one-device reference) has no communication: its cells stay empty.
    for name, key in _MEDIANS:
        if key in medians and math.isfinite(medians[key]):
            row[name] = float(medians[key])
    if "memory/peak_MiB" in medians:
        peak = np.nanmax(np.concatenate([v[:, keys.index("memory/peak_MiB")] for v in values]))
        row["peak_memory_MiB"] = float(peak) if math.isfinite(peak) else ""
    for column, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            row[column] = ""  # an empty CSV cell, not "nan"
    return row


# ---- reading and writing ----------------------------------------------------------------------------------


def _parse_value(column: str, value: Any) -> Any:
    """One CSV cell read back: a number in ``NUMERIC_COLUMNS`` (``None`` when empty), ``busy`` a bool, anything else
    its text."""
    if column in NUMERIC_COLUMNS:
        if value in ("", None):
            return None
        try:
            number = float(value)
        except ValueError:  # a bucket size "auto" (resolved_bucket_size_mb too, from an unwired strategy)
            return value
        return int(number) if column in _INTEGER_COLUMNS else number
    if column == "busy":
        return {"true": True, "false": False}.get(str(value).lower())
    return value or ""


def parse_row(raw: Mapping[str, Any], columns: Sequence[str] = RESULT_COLUMNS) -> Row:
    """A row read back from CSV: numbers (ints where integer), empty as ``None``, ``busy`` as a bool."""
    return {column: _parse_value(column, raw.get(column, "")) for column in columns}


def _read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """The raw rows (text) of ``path`` that name a cell; ``[]`` if the file does not exist."""
    return [raw for raw in read_csv(path) if raw.get("cell_id")] if Path(path).exists() else []


def read_rows(path: str | os.PathLike, columns: Sequence[str] = RESULT_COLUMNS) -> dict[Any, Row]:
    """Parsed rows of a results.csv by cell_id, of a repeats.csv (``REPEAT_COLUMNS``) by (cell_id, repeat); or {}."""
    rows = (parse_row(raw, columns) for raw in _read_csv(path))
    return {(row["cell_id"], row["repeat"]) if "repeat" in columns else row["cell_id"]: row for row in rows}


def read_steps(path: str | os.PathLike) -> dict[RepeatKey, list[Row]]:
    """``{(cell_id, repeat): [step rows]}`` of an existing steps.csv; metrics as floats, empty cells left out."""
    steps: dict[RepeatKey, list[Row]] = {}
    for raw in _read_csv(path):
        row: Row = {"cell_id": raw["cell_id"], "repeat": int(raw["repeat"]), "step": int(float(raw["step"]))}
        row.update({k: float(v) for k, v in raw.items() if k not in STEP_ID_COLUMNS and v not in ("", None)})
        steps.setdefault((row["cell_id"], row["repeat"]), []).append(row)
    return steps


def write_csv(path: str | os.PathLike, rows: Iterable[Row], columns: Sequence[str] | None = None) -> None:
    """Rows to ``path`` atomically, bucket sizes as ``format_bucket``; ``columns`` default: steps.csv's."""
    rows = list(rows)
    if columns is None:
        columns = [*STEP_ID_COLUMNS, *dict.fromkeys(key for row in rows for key in row if key not in STEP_ID_COLUMNS)]
    written = []
    for row in rows:
        if row.get("bucket_size_mb"):
            row = {**row, "bucket_size_mb": format_bucket(row["bucket_size_mb"])}
        written.append(row)
    files.write_atomically(path, csv_text(written, columns))


# ---- the analysis: best bucket sizes, goals, verdicts -------------------------------------------------------


Group = tuple[str, int, int]
"""``(precision, batch_size, context_length)``: the cells whose step times the goals compare."""

FASTER_THAN_DDP_TARGET = 1.0
"""Goal 1: an algorithm at its best bucket size takes no longer a step than torch DDP."""
ACROSS_GROUPS_TARGET = 0.95
"""Goal 1 across groups: the geometric mean over groups of (best / ddp) step time, 5 % faster than torch DDP."""
HIDDEN_SHARE_TARGET = 1 / 3
"""Goal 2: overlapping leaves at most a third of naive's exposed communication share."""
NEAR_THE_FLOOR_TARGET = 1.10
"""Goal 3: the best bucketed step within 10 % of its floor, max(the one-process step, the busy communication)."""

NOT_MEASURABLE = "not measurable"
"""A goal's verdict when its ratio cannot be formed (a cell it needs has no ok repeat)."""


def variant_of(row: Row) -> str:
    """What the report compares: the row's strategy and engine settings (``"bucketed_powersgd_ddp rank=4"``)."""
    return variant_label(row["strategy"], settings=row.get("engine_settings") or "")


def strategy_order(names: Iterable[str]) -> list[str]:
    """``names`` deduplicated, in report order: the reference, the catalogue's, ``ddp``, unknown ones; else as seen."""
    known = [REFERENCE, *[s for s in catalogue.names() if s != DDP_BASELINE], DDP_BASELINE]
    position = {s: i for i, s in enumerate(known)}
    present = list(dict.fromkeys(names))
    return sorted(present, key=lambda name: position.get(variant_strategy(name), len(known)))  # stable sort


def panels(groups: Iterable[Group]) -> list[tuple[str, int, list[int]]]:
    """``(precision, batch, contexts)`` of the groups, as tables and plots show them: precisions and batch sizes in
    first-seen order, precision first; contexts ascending."""
    contexts: dict[str, dict[int, set[int]]] = {}  # precision -> batch -> contexts
    for precision, batch, context in groups:
        contexts.setdefault(precision, {}).setdefault(batch, set()).add(context)
    return [(precision, batch, sorted(of_batch))
            for precision, by_batch in contexts.items() for batch, of_batch in by_batch.items()]


def is_ok(row: Row | None) -> bool:
    """Whether ``row`` is a cell that finished with a step time (``status`` ok)."""
    return row is not None and row.get("status") == "ok" and row.get("step_ms_median") is not None


def _verdict_counts(checks: Iterable[GoalCheck]) -> dict[str, int]:
    """How many ``checks`` have each verdict: met, missed, inconclusive, not measurable (zeros kept)."""
    verdicts = [check.verdict for check in checks]
    return {v: verdicts.count(v) for v in ("met", "missed", "inconclusive", NOT_MEASURABLE)}


@dataclass(frozen=True)
class Selection:
    """The best bucket size of one algorithm in one group: the cell ``row`` chosen among ``candidates`` sizes on the
    ``selection_repeats`` (even indices) with ``selection_step_ms``, ``evaluated`` on the odd ones; ``in_sample``:
    no evaluation repeat, so the numbers are the ones it was chosen on (biased low) and its goals inconclusive."""

    row: Row
    selection_repeats: tuple[int, ...]
    selection_step_ms: float
    evaluated: Measured
    in_sample: bool
    candidates: int


@dataclass(frozen=True)
class GoalCheck:
    """One goal on one group, or goal 1 of one ``algorithm`` across groups: its ratio against ``target``."""

    group: Group | tuple[()]
    """``(precision, batch, context)``; empty for goal 1 across groups."""
    goal: str
    """The goal in words, e.g. ``1. bucketed_ddp (best) step time / ddp step time``."""
    target: float
    """The goal is met when the ratio's whole 95 % interval is at or below it (``stats.verdict``)."""
    note: str = ""
    """What the ratio was measured on (the best size and its repeats), or why it could not be."""
    ratio: Ratio | None = None
    """``None``: not measurable (a needed cell has no ok repeat)."""
    in_sample: bool = False
    """The best bucket size had no evaluation repeat: the verdict is inconclusive."""
    algorithm: str = ""
    """The algorithm of goal 1 and 3; empty for goal 2."""
    groups: int = 1
    """How many groups the ratio is over (goal 1 across groups: the measurable ones)."""

    @property
    def estimate(self) -> Estimate | None:
        """The ratio and its 95 % interval; ``None`` when not measurable."""
        return None if self.ratio is None else self.ratio.estimate

    @property
    def verdict(self) -> str:
        """``not measurable`` without an estimate; ``inconclusive`` when in-sample; else ``stats.verdict``."""
        if self.estimate is None:
            return NOT_MEASURABLE
        return "inconclusive" if self.in_sample else interval_verdict(self.estimate, self.target)


class Analysis:
    """The results.csv ``rows``, selections, goals and the across-groups summary of the cells ``data``."""

    def __init__(self, data: Mapping[str, CellData], bootstrap: Bootstrapper | None = None) -> None:
        """Computes it all at once from ``data``: results.csv's rows, each group's best bucket sizes, the goals and
        the across-groups checks; ``bootstrap`` default: 2000 draws, seed 0."""
        self.bootstrap = bootstrap or Bootstrapper(2000, 0)
        self.data = dict(data)
        self.rows = [parse_row(cell_row(cell, self.bootstrap)) for cell in self.data.values()]
        self.groups: dict[Group, list[Row]] = {}  # by (precision, batch_size, context_length), in first-seen order
        for row in self.rows:
            self.groups.setdefault((row["precision"], row["batch_size"], row["context_length"]), []).append(row)
        self.algorithms: dict[Group, list[str]] = {}  # per group, its algorithms with buckets, in report order
        self.selections: dict[tuple[Group, str], Selection] = {}  # the best bucket size of each that has an ok cell
        for group, members in self.groups.items():
            self.algorithms[group] = [v for v in strategy_order(variant_of(r) for r in members) if has_bucket_axis(v)]
            for algorithm in self.algorithms[group]:
                selection = self._select([row for row in members if variant_of(row) == algorithm])
                if selection is not None:
                    self.selections[(group, algorithm)] = selection
        self.goals: list[GoalCheck] = []
        with np.errstate(divide="ignore", invalid="ignore"):
            for group, members in self.groups.items():
                self.goals += self._goals(group, members)
            algorithms = strategy_order(variant_of(r) for r in self.rows if has_bucket_axis(r["strategy"]))
            self.across = [self._across(algorithm) for algorithm in algorithms]

    def measured(self, row: Row | None) -> Measured | None:
        """An ok ``row``'s cell over every ok repeat (its results.csv numbers); ``None`` for any other."""
        return self.data[row["cell_id"]].measured(self.bootstrap) if is_ok(row) else None

    def _select(self, rows: list[Row]) -> Selection | None:
        """The best bucket size of one algorithm in one group (docs/benchmarks.md, "Analysis")."""
        candidates = [(row, self.data[row["cell_id"]].ok_repeats) for row in rows if is_ok(row)]  # ok: ok repeats
        if not candidates:
            return None

        def median_on(row: Row, repeats: Sequence[int]) -> float:
            values = self.data[row["cell_id"]].values(ESTIMATED_KEYS[:1], repeats)  # (steps, 1) per ok repeat
            value = float(pooled_median(values)[0])
            return value if math.isfinite(value) else math.inf

        with_selection = []  # (row, its even repeats): the candidates that can be chosen out of sample
        for row, ok in candidates:
            evens = [k for k in ok if k % 2 == 0]
            if evens:
                with_selection.append((row, evens))
        # every even repeat failed: nothing to choose on out of sample; of equal medians, min keeps the first row
        row, chosen_on = min(with_selection or candidates, key=lambda candidate: median_on(*candidate))
        evaluation = [k for k in self.data[row["cell_id"]].ok_repeats if k % 2 == 1] if with_selection else []
        evaluated = self.data[row["cell_id"]].measured(self.bootstrap, evaluation or None)
        assert evaluated is not None  # the row has ok repeats
        return Selection(row=row, selection_repeats=tuple(chosen_on), selection_step_ms=median_on(row, chosen_on),
                         evaluated=evaluated, in_sample=not evaluation, candidates=len(candidates))

    def _goals(self, group: Group, rows: list[Row]) -> list[GoalCheck]:
        """Goal 1 for bucketed and every other algorithm with buckets, goal 2 twice, goal 3 (docs/benchmarks.md)."""
        cells: dict[str, Row] = {}  # each variant's first row
        for row in rows:
            cells.setdefault(variant_of(row), row)
        bucketed = catalogue.DEFAULT_ENGINE
        checks = [self._faster_than_ddp(group, algorithm, cells.get(DDP_BASELINE))
                  for algorithm in [bucketed, *[s for s in self.algorithms[group] if s != bucketed]]]
        # goal 2's strategies, by what they keep: per-tensor blocking against per-tensor overlapping and buckets
        naive = strategy_with_memory_model("none")
        overlap = strategy_with_memory_model("per_tensor")
        best = self.selections.get((group, bucketed))
        checks.append(self._share_hidden(group, cells.get(naive), overlap, self.measured(cells.get(overlap)),
                                         _missing(cells.get(overlap), overlap), selection=None))
        checks.append(self._share_hidden(group, cells.get(naive), f"{bucketed} (best)", best and best.evaluated,
                                         f"no ok {bucketed} cell", selection=best))
        checks.append(self._near_the_floor(group, bucketed, cells.get(REFERENCE)))
        return checks

    def _faster_than_ddp(self, group: Group, algorithm: str, ddp: Row | None) -> GoalCheck:
        """Goal 1: ``algorithm`` at its best bucket size (evaluation repeats) over ``ddp``'s step time."""
        goal = f"1. {algorithm} (best) step time / ddp step time"
        selection = self.selections.get((group, algorithm))
        measured_ddp = self.measured(ddp)
        if selection is None or measured_ddp is None:
            note = f"no ok {algorithm} cell" if selection is None else _missing(ddp, "ddp")
            return GoalCheck(group=group, goal=goal, target=FASTER_THAN_DDP_TARGET, note=note, algorithm=algorithm)
        return GoalCheck(group=group, goal=goal, target=FASTER_THAN_DDP_TARGET, note=_selection_note(selection),
                         ratio=selection.evaluated.ratio(measured_ddp, STEP), in_sample=selection.in_sample,
                         algorithm=algorithm)

    def _share_hidden(self, group: Group, naive: Row | None, name: str, measured: Measured | None, missing: str,
                      selection: Selection | None) -> GoalCheck:
        """Goal 2: ``name``'s exposed communication share (``measured``; ``missing`` says why there is none) over
        naive's; ``selection``: the best bucket size it is measured at."""
        naive_name = strategy_with_memory_model("none")
        goal = f"2. {name} comm share / {naive_name} comm share"
        measured_naive = self.measured(naive)
        if measured_naive is None or not measured_naive.point[SHARE] > 0:
            note = _missing(naive, naive_name) if measured_naive is None else f"{naive_name} comm share is 0 or missing"
            return GoalCheck(group=group, goal=goal, target=HIDDEN_SHARE_TARGET, note=note)
        if measured is None or not math.isfinite(measured.point[SHARE]):
            return GoalCheck(group=group, goal=goal, target=HIDDEN_SHARE_TARGET, note=missing)
        return GoalCheck(group=group, goal=goal, target=HIDDEN_SHARE_TARGET,
                         note=_selection_note(selection) if selection else "",
                         ratio=measured.ratio(measured_naive, SHARE),
                         in_sample=selection is not None and selection.in_sample)

    def _near_the_floor(self, group: Group, bucketed: str, reference: Row | None) -> GoalCheck:
        """Goal 3: ``bucketed``'s best step over its floor, the slower of the one-process ``reference`` step (the
        compute) and its own busy communication (the wire)."""
        goal = f"3. {bucketed} (best) step time / max(reference step, busy comm)"
        best = self.selections.get((group, bucketed))
        measured_reference = self.measured(reference)
        if best is None or measured_reference is None:
            note = f"no ok {bucketed} cell" if best is None else _missing(reference, REFERENCE)
            return GoalCheck(group=group, goal=goal, target=NEAR_THE_FLOOR_TARGET, note=note)
        top = best.evaluated
        busy_point = top.point[BUSY] if math.isfinite(top.point[BUSY]) else 0.0
        floor_point = max(float(measured_reference.point[STEP]), float(busy_point))
        floor_draws = np.fmax(measured_reference.draws[:, STEP], top.draws[:, BUSY])  # fmax: a missing busy is no floor
        bound = "compute" if measured_reference.point[STEP] >= busy_point else "communication"
        ratio = Ratio(top.point[STEP] / floor_point, top.draws[:, STEP] / floor_draws)
        return GoalCheck(group=group, goal=goal, target=NEAR_THE_FLOOR_TARGET,
                         note=f"{_selection_note(best)}; floor {floor_point:,.1f} ms ({bound})", ratio=ratio,
                         in_sample=best.in_sample, algorithm=bucketed)

    def _across(self, algorithm: str) -> GoalCheck:
        """Goal 1 of ``algorithm`` over every group: the geometric mean of (best / ddp); ``note``: verdict counts."""
        checks = [c for c in self.goals if c.goal.startswith("1.") and c.algorithm == algorithm]
        counts = " / ".join(str(count) for count in _verdict_counts(checks).values())
        note = f"groups <= 1.00 met / missed / inconclusive / not measurable: {counts}"
        goal = f"1. {algorithm} (best) / ddp step time, geometric mean over groups"
        ratios = [c.ratio for c in checks if c.ratio is not None]
        if not ratios:
            return GoalCheck(group=(), goal=goal, target=ACROSS_GROUPS_TARGET, note=note, algorithm=algorithm,
                             groups=0)
        in_sample = any(c.in_sample for c in checks if c.ratio is not None)
        if in_sample:
            note += "; some best size in-sample"
        geometric_mean = Ratio(geometric_mean_draws([r.point for r in ratios]),
                               geometric_mean_draws([r.draws for r in ratios]))
        return GoalCheck(group=(), goal=goal, target=ACROSS_GROUPS_TARGET, note=note, ratio=geometric_mean,
                         in_sample=in_sample, algorithm=algorithm, groups=len(ratios))


# ---- results.md ---------------------------------------------------------------------------------------


def bucket_text(row: Row) -> str:
    """The row's bucket size for a reader: ``4 MiB``, or ``auto (12.3 MiB)`` with the size ``auto`` resolved to."""
    size = row["bucket_size_mb"]
    if size == "auto":
        resolved = row.get("resolved_bucket_size_mb")
        return f"auto ({resolved:.3g} MiB)" if isinstance(resolved, float) else "auto"
    return f"{format_bucket(size)} MiB"


def _selection_note(selection: Selection) -> str:
    """A goal's note on its best bucket size: the repeats it was chosen on, or that it is in-sample."""
    if selection.in_sample:
        return f"best size {bucket_text(selection.row)}, in-sample (no evaluation repeat)"
    chosen_on = ", ".join(map(str, selection.selection_repeats))
    return f"best size {bucket_text(selection.row)} (chosen on repeats {chosen_on})"


def _missing(row: Row | None, name: str) -> str:
    """A goal's note when it is not measurable: no ``name`` cell, or that cell's status."""
    return f"no {name} cell" if row is None else f"{name} cell {row['status'] or 'not run'}"


_STRATEGY_TITLES = {
    REFERENCE: "reference (1 process, no communication)",
    DDP_BASELINE: "ddp (Lightning / torch DDP)",
}
"""Table titles of the two rows that are not our engines (``_title`` names every other row)."""


def _cell_text(row: Row | None, selected: set[str]) -> str:
    """A cell of a strategy table; **bold** when it is a ``selected`` best bucket size."""
    if row is None:
        return "not run"
    if not is_ok(row):
        return row["status"] or "not run"
    text = interval_text(row["step_ms_median"], row.get("step_ms_lo"), row.get("step_ms_hi"), unit=" ms")
    if row["strategy"] != REFERENCE and row.get("comm_share") is not None:
        share = interval_text(row["comm_share"], row.get("comm_share_lo"), row.get("comm_share_hi"), ".1f", 100, " %")
        wait = row.get("wait_comm_ms")
        # Of the exposed communication, the part spent waiting for the last rank (the CommTimer's comm/wait_ms).
        wait_text = f"; wait {wait:,.2f} ms" if isinstance(wait, (int, float)) and math.isfinite(wait) else ""
        text += f" ({share}{wait_text})"
    return f"**{text}**" if row["cell_id"] in selected else text


def _title(variant: str, size: Any) -> str:
    """A table row's name: ``reference (1 process, ...)``, ``naive``, ``bucketed_powersgd 4 MiB rank=4``."""
    if variant in _STRATEGY_TITLES:
        return _STRATEGY_TITLES[variant]
    strategy, _, settings = variant.partition(" ")
    return variant_label(strategy, size if has_bucket_axis(strategy) else None, settings)


def _strategy_tables(analysis: Analysis) -> list[str]:
    """Per precision and batch size, one table: a row per variant and bucket size, a column per context."""
    lines = []
    selected = {s.row["cell_id"] for s in analysis.selections.values()}
    for precision, batch, contexts in panels(analysis.groups):
        cells: dict[tuple, Row] = {}  # (variant, bucket size, context) -> its row
        for context in contexts:
            for row in analysis.groups[(precision, batch, context)]:
                cells.setdefault((variant_of(row), row["bucket_size_mb"], context), row)
        sized = list(dict.fromkeys((variant, size) for variant, size, _ in cells))
        order = strategy_order(variant for variant, _ in sized)

        def report_order(variant_and_size: tuple[str, Any]) -> tuple[int, bool, float]:
            """Variants in report order; numeric bucket sizes ascending, then auto."""
            variant, size = variant_and_size
            return order.index(variant), size == "auto", size if isinstance(size, float) else 0.0

        table = []
        for variant, size in sorted(sized, key=report_order):
            row_cells = [_cell_text(cells.get((variant, size, context)), selected) for context in contexts]
            table.append([_title(variant, size), *row_cells])
        header = ["strategy", *(f"context {c}" for c in contexts)]
        lines += [f"### {precision}, batch size {batch} per rank", "",
                  *markdown_table(header, table, "l" + "r" * len(contexts)), ""]
    return lines


def _bucket_row(analysis: Analysis, group: Group, strategy: str, predicted: str) -> list[Any]:
    """One row of the best-bucket table: the size chosen on the selection repeats, measured on the others."""
    auto = next((r for r in analysis.groups[group] if variant_of(r) == strategy and r["bucket_size_mb"] == "auto"),
                None)
    auto_text = "not in grid"
    if auto is not None:
        auto_ok = f"{auto['step_ms_median']:,.1f} ms, {bucket_text(auto)}" if is_ok(auto) else ""
        auto_text = auto_ok or auto["status"] or "not run"
    selection = analysis.selections.get((group, strategy))
    if selection is None:
        return [*group, strategy, "no ok cell", "-", "-", "-", predicted, auto_text]
    evaluated = selection.evaluated
    chosen_on = ", ".join(map(str, selection.selection_repeats))
    evaluated_on = ", ".join(map(str, evaluated.repeats))
    on = f"{bucket_text(selection.row)}, best of {selection.candidates} on {chosen_on}"
    where = ("in-sample, " if selection.in_sample else "") + f"repeats {evaluated_on}: "
    return [*group, strategy, on, f"{selection.selection_step_ms:,.1f} ms",
            f"{where}{interval_text(evaluated.estimate(STEP), unit=' ms')}",
            interval_text(evaluated.estimate(SHARE), spec=".1f", scale=100, unit=" %"),
            predicted, auto_text]


def _prediction_lines(prediction: dict[str, Any] | None) -> list[str]:
    """The all-reduce fit and the bucket size ``b*`` it predicts (``bucket_bytes``: once a cell gave the model)."""
    if not prediction:
        return ["No prediction: the all-reduce microbenchmark did not run (`run.predict_bucket_size: false`) or "
                "failed (see runs/allreduce/).", ""]
    w, sizes = prediction.get("bandwidth_Bps"), prediction.get("sizes") or []
    span = f"{len(sizes)} message sizes, {sizes[0] / 1024:g} KiB to {sizes[-1] / 2**20:g} MiB" if sizes else ""
    w_text = f"{w / 1e9:.3f} GB/s" if w else "unbounded (time did not grow with size)"
    lines = [f"All-reduce microbenchmark on the sweep's ranks ({span or 'the microbenchmark'}, median of "
             f"{prediction.get('repeats', '?')}): least-squares fit `t = o + bytes / w` gives "
             f"**o = {prediction['overhead_s'] * 1e3:.3f} ms** per call and **w = {w_text}**."]
    if not prediction.get("bucket_bytes"):
        return lines + ["No cell finished yet, so the gradient size (and the prediction) is unknown.", ""]
    s_mb, largest_mb = prediction["grad_bytes"] / 2**20, prediction["largest_param_bytes"] / 2**20
    return lines + [f"Gradients: s = {s_mb:.2f} MiB, largest parameter {largest_mb:.2f} MiB. Predicted best bucket "
                    f"`b* = max(largest, sqrt(s * w * o))` = **{prediction['bucket_bytes'] / 2**20:.3g} MiB** (about "
                    f"{prediction['grad_bytes'] / prediction['bucket_bytes']:.1f} buckets; see "
                    "`lightning_ddp/sync/bucket_model.py`).", ""]


def _bucket_section(analysis: Analysis, prediction: dict[str, Any] | None) -> list[str]:
    """The all-reduce fit's prediction, then per group and algorithm its best bucket size and how it measured."""
    bucketed = any(has_bucket_axis(r["strategy"]) for r in analysis.rows)
    lines = ["## Best bucket size: chosen on some repeats, measured on the others", ""]
    if prediction or bucketed:  # without algorithms with buckets, no prediction is no news
        lines += _prediction_lines(prediction)
    if not bucketed:
        return lines + ["No algorithm with buckets in the grid.", ""]
    bucket_bytes = (prediction or {}).get("bucket_bytes")
    predicted = f"{bucket_bytes / 2**20:.3g} MiB" if bucket_bytes else "-"
    table = [_bucket_row(analysis, group, strategy, predicted)
             for group, algorithms in analysis.algorithms.items() for strategy in algorithms]
    header = ["precision", "batch", "context", "algorithm", "chosen (of sizes) on repeats", "its step there",
              "step on evaluation repeats [95 %]", "comm share [95 %]", "predicted", "auto cell"]
    return lines + markdown_table(header, table, "lrrllrrrll") + [""]


def _goal_row(check: GoalCheck) -> list[Any]:
    """A row of the goals table: the group (goal 1 across groups: ``all``), the goal, its ratio, target and verdict."""
    group = check.group or ("all", "", f"{check.groups} groups")
    verdict = "**missed**" if check.verdict == "missed" else check.verdict
    return [*group, check.goal, interval_text(check.estimate, spec=".3f"), f"{check.target:.3g}", verdict, check.note]


def _goal_section(analysis: Analysis) -> list[str]:
    """Every goal of every group, then goal 1 across groups, with the verdicts' count first."""
    counts = _verdict_counts(analysis.goals)
    goals = [_goal_row(check) for check in [*analysis.goals, *analysis.across]]
    header = ["precision", "batch", "context", "goal", "ratio [95 %]", "target", "verdict", "note"]
    return ["## Performance goals", "", f"**{counts['met']} met, {counts['missed']} missed, {counts['inconclusive']} "
            f"inconclusive, {counts[NOT_MEASURABLE]} not measurable** (a needed cell has no ok repeat).", "",
            *markdown_table(header, goals, "lrrlrrll"), ""]


def _failures(repeat_rows: list[Row]) -> list[str]:
    """The cell repeats that did not finish, with their reasons (the table escapes a ``|``)."""
    table = [[r["cell_id"], r["repeat"], r["status"], r.get("reason") or ""]
             for r in repeat_rows if r["status"] not in ("ok", "")]
    header = ["cell", "repeat", "status", "reason"]
    return ["## Cell repeats that did not finish", "", *markdown_table(header, table, "lrll"), ""] if table else []


def build_report(
    analysis: Analysis,
    title: str = "sweep",
    prediction: dict[str, Any] | None = None,
    environment: dict[str, Any] | None = None,
    pending: int = 0,
) -> str:
    """results.md of the grid's ``analysis``, its prediction, environment and ``pending`` cell repeats."""
    repeat_rows = [row for cell in analysis.data.values() for row in cell.repeats]
    environment = environment or {}
    run = environment.get("config", {}).get("run", {})
    lines = [f"# Benchmark sweep: {title}", ""]
    if environment:
        lines.append(_environment_line(environment))
    if repeat_rows:
        lines.append(_load_guard_line(load_tally(repeat_rows), run))
    lines += [f"- pooled medians, 95 % intervals of {analysis.bootstrap.samples} hierarchical-bootstrap draws, best "
              "bucket sizes chosen on the *selection* repeats (even indices 0, 2, 4, ...): docs/benchmarks.md, \"How "
              "to read results\"; environment.json, steps.csv, repeats.csv and runs/<cell_id>/r<k>/: \"The sweep's "
              "files\"", ""]
    if pending:
        done = len(repeat_rows)
        lines += [f"> {done} of {done + pending} cell repeats done; rerun the same command to finish the others.", ""]
    lines += ["## Step time and communication share", "", *_strategy_tables(analysis),
              *_bucket_section(analysis, prediction), *_goal_section(analysis), *_failures(repeat_rows)]
    return "\n".join(lines).rstrip() + "\n"


def _environment_line(environment: Mapping[str, Any]) -> str:
    """Where and how the sweep ran: device, ranks, workload, versions, commit (each a resumed sweep ran), repeats."""
    run, workload = (environment.get("config", {}).get(key, {}) for key in ("run", "workload"))
    cpu = environment.get("cpu", {})
    device = ", ".join(environment.get("gpus") or []) or cpu.get("model", "cpu")
    code = code_version(environment)
    sessions = environment.get("sessions") or []
    commits = sorted({code_version(session) for session in sessions})
    if len(commits) > 1:  # a resumed sweep whose sessions ran different code says so
        code += f"; **resumed across {len(sessions)} sessions running different code**: {', '.join(commits)}"
    return (f"- {device}; {cpu.get('count', '?')} CPU cores; {run.get('devices', '?')} ranks "
            f"over {environment.get('backend', '?')} ({run.get('accelerator', '?')}); preset "
            f"`{workload.get('preset')}` from `{workload.get('base_config')}` "
            f"{' '.join(workload.get('cli_args') or [])}; torch {environment.get('torch')}, lightning "
            f"{environment.get('lightning')}, {code}; "
            f"{run.get('repeats', '?')} interleaved repeats per cell of {run.get('warmup_steps', '?')} warm-up + "
            f"{run.get('steps', '?')} measured steps")


def _load_guard_line(tally: LoadTally, run: Mapping[str, Any]) -> str:
    """What the load guard saw: how many cell repeats started busy, how long it waited, the load averages."""
    line = (f"- load guard (busy fraction > {run.get('busy_threshold', '?')} after up to "
            f"{run.get('max_wait_s', '?')} s): ")
    if tally.guarded:
        line += f"**{tally.busy} of {tally.guarded} cell repeats started busy**, {tally.waited_s:,.0f} s waited"
    else:
        line += "off"
    if tally.loads:
        line += f"; 1-minute load average {min(tally.loads):.1f} to {max(tally.loads):.1f}"
    return line


# ---- the plots: 95 % error bars, per precision and batch size --------------------------------------------


# per panel: the estimated column, the scale and the axis label
_PANELS = ((STEP, 1.0, "median step time (ms)"), (SHARE, 100.0, "exposed comm share of step (%)"))


def _error(measured: list[Measured | None], panel: int, scale: float) -> tuple[list[float], list[list[float]]]:
    """Bar heights and matplotlib's ``yerr`` (distances below and above) in ``panel`` (missing: 0)."""
    heights, below, above = [], [], []
    for cell in measured:
        shown = cell.estimate(panel) if cell is not None else Estimate(0.0, 0.0, 0.0)
        if not math.isfinite(shown.point):
            shown = Estimate(0.0, 0.0, 0.0)
        heights.append(shown.point * scale)
        # max(0.0, nan) is 0.0: an end that is not finite draws no error bar
        below.append(max(0.0, (shown.point - shown.lo) * scale))
        above.append(max(0.0, (shown.hi - shown.point) * scale))
    return heights, [below, above]


def _figure() -> tuple[Any, Any]:
    """A figure of the two panels (step time, comm share) side by side."""
    from matplotlib.figure import Figure  # a Figure saves through the Agg canvas without pyplot

    fig = Figure(figsize=(12, 4.2), layout="constrained")
    return fig, fig.subplots(1, 2)


def _finish(fig: Any, axes: Any, path: Path, title: str, **grid: Any) -> None:
    """Label and grid both panels, add the legend and the title, save to ``path``."""
    for ax, (*_, ylabel) in zip(axes, _PANELS):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, **grid)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center", fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def _shown(analysis: Analysis, group: Group, name: str) -> Measured | None:
    """A strategy's bar: an algorithm with buckets at its selected size on the evaluation repeats, else its cell."""
    if has_bucket_axis(name):
        selection = analysis.selections.get((group, name))
        return selection.evaluated if selection else None
    return analysis.measured(next((r for r in analysis.groups[group] if variant_of(r) == name), None))


def _strategy_figure(path: Path, precision: str, batch: int, analysis: Analysis, contexts: list[int],
                     names: list[str]) -> None:
    """Step time and comm share of every strategy, a bar group per context, with 95 % error bars."""
    fig, axes = _figure()
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(contexts))]
        label = (f"{name} (selected size, evaluation repeats)" if has_bucket_axis(name)
                 else {REFERENCE: "reference (compute only)"}.get(name, name))
        shown = [_shown(analysis, (precision, batch, c), name) for c in contexts]
        for ax, (panel, scale, _) in zip(axes, _PANELS):
            if panel == SHARE and name == REFERENCE:
                ax.bar(xs, [0.0] * len(xs), width)  # keep the colours of both panels aligned
                continue
            heights, yerr = _error(shown, panel, scale)
            ax.bar(xs, heights, width, yerr=yerr, capsize=2, label=label)
    for ax in axes:
        ax.set_xticks(range(len(contexts)), [f"context {c}" for c in contexts])
    _finish(fig, axes, path, f"Step time and communication share by strategy: {precision}, batch {batch} per "
            "rank (error bars: 95 % intervals)", axis="y")


class BucketPoint(NamedTuple):
    """A cell of a bucket-size plot: its x (the bucket size in MiB; ``auto`` where it resolved to) and its row."""

    size_mb: float
    row: Row


def _bucket_points(rows: list[Row]) -> tuple[list[BucketPoint], list[BucketPoint]]:
    """The ok cells of one algorithm in one group: the fixed sizes ascending, and ``auto`` at its resolved size."""
    fixed, auto = [], []
    for row in rows:
        if row["bucket_size_mb"] != "auto":
            fixed.append(BucketPoint(row["bucket_size_mb"], row))
        elif isinstance(row.get("resolved_bucket_size_mb"), float):
            auto.append(BucketPoint(row["resolved_bucket_size_mb"], row))
    return sorted(fixed, key=lambda point: point.size_mb), auto


def _bucket_figure(
    path: Path, strategy: str, precision: str, batch: int, analysis: Analysis, contexts: list[int],
    predicted_mb: float | None,
) -> bool:
    """Step time and comm share against the bucket size, a line per context, the selected size circled; ``False``
    (nothing written) where no context has an ok cell."""
    fig, axes = _figure()
    drew = selected = False
    for context in contexts:
        group = (precision, batch, context)
        fixed, auto = _bucket_points([r for r in analysis.groups[group] if variant_of(r) == strategy and is_ok(r)])
        if not fixed and not auto:
            continue
        drew = True
        selection = analysis.selections.get((group, strategy))
        chosen = None
        if selection is not None:
            chosen = next((p for p in fixed + auto if p.row["cell_id"] == selection.row["cell_id"]), None)
        color = None
        for ax, (panel, scale, _) in zip(axes, _PANELS):
            if fixed:
                heights, yerr = _error([analysis.measured(p.row) for p in fixed], panel, scale)
                container = ax.errorbar([p.size_mb for p in fixed], heights, yerr=yerr, marker="o", capsize=3,
                                        color=color, label=f"context {context}")
                color = container.lines[0].get_color()
            for point in auto:
                heights, yerr = _error([analysis.measured(point.row)], panel, scale)
                ax.errorbar([point.size_mb], heights, yerr=yerr, marker="*", markersize=12, linestyle="", capsize=3,
                            color=color)
            value = analysis.measured(chosen.row).point[panel] if chosen is not None else math.nan
            if math.isfinite(value):
                selected = True
                ax.plot([chosen.size_mb], [value * scale], marker="o", markersize=16,
                        markerfacecolor="none", markeredgewidth=1.5, linestyle="", color=color)
    if not drew:
        return False
    if selected:  # one neutral legend entry for the circles of every context
        axes[0].plot([], [], marker="o", markersize=12, markerfacecolor="none", linestyle="", color="gray",
                     label="selected size (on the selection repeats)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("bucket size (MiB)")
        if predicted_mb:
            ax.axvline(predicted_mb, linestyle=":", color="gray", label=f"predicted b* = {predicted_mb:.3g} MiB")
    _finish(fig, axes, path, f"{strategy}: step time and comm share vs bucket size: {precision}, batch {batch} "
            "per rank (all repeats, 95 % intervals; stars: auto; circled: selected)", which="both")
    return True


def write_plots(out_dir: str | Path, analysis: Analysis, predicted_mb: float | None = None) -> list[Path]:
    """Write the figures of the module docstring for the sweep's ``analysis``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for precision, batch, contexts in panels(analysis.groups):
        names = strategy_order(variant_of(r) for c in contexts for r in analysis.groups[(precision, batch, c)])
        path = out_dir / f"strategies_{precision}_bs{batch}.png"
        if names:
            _strategy_figure(path, precision, batch, analysis, contexts, names)
            written.append(path)
        for strategy in filter(has_bucket_axis, names):
            stem = re.sub(r"[^A-Za-z0-9._-]", "", strategy.replace(" ", "-"))  # as cell ids spell settings: -rank4
            path = out_dir / f"{stem}_{precision}_bs{batch}.png"
            if _bucket_figure(path, strategy, precision, batch, analysis, contexts, predicted_mb):
                written.append(path)
    return written
