"""The sweep's files: the raw data (``repeats.csv``, ``steps.csv``), the per-cell aggregates (``results.csv``) and
``profiles.json``, each written whole and atomically. results.csv and results.md are computed from the raw files
alone; docs/benchmarks.md lists every column.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from lightning_ddp import files
from lightning_ddp.metrics.accounting import COLLECTIVE_KEYS, LANDMARK_KEYS, NOT_RECORDED
from lightning_ddp.bench.config import REFERENCE, has_bucket_axis
from lightning_ddp.bench.grid import Cell
from lightning_ddp.bench.launch import RankLayout
from lightning_ddp.bench.load import LoadCheck
from lightning_ddp.bench.runner import CellOutcome
from lightning_ddp.catalogue import format_bucket, format_settings
from lightning_ddp.bench.stats import Bootstrapper, percentile_interval, pooled_median, pooled_percentile
from lightning_ddp.bench.study import csv_text, read_csv

__all__ = [
    "ESTIMATED_KEYS",
    "NUMERIC_COLUMNS",
    "REPEAT_COLUMNS",
    "RESULT_COLUMNS",
    "CellData",
    "cell_data",
    "bootstrap_key",
    "cell_row",
    "measured_step_rows",
    "parse_row",
    "read_repeats",
    "read_results",
    "read_steps",
    "repeat_row",
    "write_repeats",
    "write_results",
    "write_steps",
]

Row = dict[str, Any]
RepeatKey = tuple[str, int]

_COORDINATES = ("strategy", "bucket_size_mb", "engine_settings", "batch_size", "context_length", "precision", "model",
                "world_size", "accelerator", "backend")

REPEAT_COLUMNS: tuple[str, ...] = (
    "cell_id", "repeat", *_COORDINATES, "status", "reason", "wall_s", "measured_steps", "resolved_bucket_size_mb",
    "busy_before", "waited_s", "busy", "load_avg_1m", "started_at",
)
"""The exact columns of repeats.csv, in order (see the module docstring)."""

STEP_ID_COLUMNS: tuple[str, ...] = ("cell_id", "repeat", "step")
"""The first columns of steps.csv; the metric keys follow, in first-seen order."""

RESULT_COLUMNS: tuple[str, ...] = (
    "cell_id", *_COORDINATES, "status", "reason", "repeats_ok", "repeats_run",
    "step_ms_median", "step_ms_lo", "step_ms_hi", "step_ms_p10", "step_ms_p90", "exposed_comm_ms", "busy_comm_ms",
    "wait_comm_ms", "transfer_comm_ms", "comm_share", "comm_share_lo", "comm_share_hi", "overlap", "busbw_GBps",
    "tokens_per_s", "mfu", "peak_memory_MiB",
    "resolved_bucket_size_mb", "measured_steps", "wall_s", "load_avg_1m", "busy_repeats", "waited_s",
)
"""The exact columns of results.csv, in order (see the module docstring)."""

_INTEGER_COLUMNS = frozenset({"batch_size", "context_length", "world_size", "repeat", "repeats_ok", "repeats_run",
                              "busy_repeats"})
NUMERIC_COLUMNS: frozenset[str] = frozenset(RESULT_COLUMNS[RESULT_COLUMNS.index("repeats_ok"):]) | frozenset(
    REPEAT_COLUMNS[REPEAT_COLUMNS.index("wall_s"):REPEAT_COLUMNS.index("busy")]) | {"load_avg_1m"} | _INTEGER_COLUMNS
"""Columns ``parse_row`` turns into numbers (empty cells become ``None``)."""

ESTIMATED_KEYS: tuple[str, ...] = ("step/time_ms", "comm/share", "comm/busy_ms")
"""The metrics bootstrapped together (the same resampled steps): what the report's intervals and goals need."""

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


# ---- one repeat -------------------------------------------------------------------------------------------


def _bucket_text(size: float | str | None) -> str:
    """A bucket size as the CSV files write it: ``""`` where the strategy has none."""
    return "" if size in (None, "") else format_bucket(size)


def repeat_row(
    cell: Cell,
    repeat: int,
    outcome: CellOutcome,
    model: str | None,
    accelerator: str,
    layout: RankLayout,
    load: LoadCheck | None = None,
    load_avg: float | None = None,
    started_at: str = "",
) -> Row:
    """The repeats.csv row of repeat ``repeat`` of ``cell`` after it ran."""
    load = load or LoadCheck()
    row: Row = {column: "" for column in REPEAT_COLUMNS}
    row.update(
        cell_id=cell.id,
        repeat=repeat,
        strategy=cell.strategy,
        bucket_size_mb=_bucket_text(cell.bucket_size_mb),
        engine_settings=format_settings(cell.settings),
        batch_size=cell.batch_size,
        context_length=cell.context_length,
        precision=cell.precision,
        model=model or "",
        world_size=cell.world_size,
        accelerator=accelerator,
        backend="" if cell.strategy == REFERENCE else layout.backend,
        status=outcome.status,
        reason=outcome.reason,
        wall_s=round(outcome.wall_s, 1),
        busy_before="" if load.busy_before is None else round(load.busy_before, 3),
        waited_s=round(load.waited_s, 1) if load.busy_before is not None else "",
        busy="" if load.busy is None else str(load.busy).lower(),
        load_avg_1m="" if load_avg is None else round(load_avg, 2),
        started_at=started_at,
    )
    if outcome.status == "ok" and outcome.summary:
        row["measured_steps"] = len(measured_step_rows(cell.id, repeat, outcome.summary))
        resolved = (outcome.summary.get("run") or {}).get("bucket_size_mb")
        if has_bucket_axis(cell.strategy) and isinstance(resolved, (int, float)):  # "auto" if the size was not recorded
            row["resolved_bucket_size_mb"] = resolved
    return row


def measured_step_rows(cell_id: str, repeat: int, summary: Mapping[str, Any]) -> list[Row]:
    """The steps.csv rows of one ok repeat: its ``timing_summary.json`` step rows after the first ``warmup_steps``."""
    warmup = int(summary.get("warmup_steps", 0))
    rows = []
    for step in list(summary.get("steps", []))[warmup:]:
        metrics = {k: v for k, v in step.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        rows.append({"cell_id": cell_id, "repeat": repeat, "step": int(step.get("step", len(rows))), **metrics})
    return rows


# ---- one cell, from its repeats ---------------------------------------------------------------------------


@dataclass
class CellData:
    """One cell's repeats.csv rows and the measured steps of its ok repeats: what its statistics are computed from."""

    cell_id: str
    meta: Row
    """The cell's coordinates (strategy, bucket size, batch, context, precision, ...)."""
    repeats: list[Row] = field(default_factory=list)
    """Its repeats.csv rows, every status, by repeat index."""
    steps: dict[int, list[Row]] = field(default_factory=dict)
    """Measured steps of each ok repeat that has any, by repeat index."""

    @property
    def ok_repeats(self) -> list[int]:
        """Indices of the ok repeats that have measured steps, ascending."""
        return sorted(k for k, rows in self.steps.items() if rows)

    def values(self, keys: Sequence[str], repeats: Iterable[int] | None = None) -> list[np.ndarray]:
        """One ``(steps, len(keys))`` array per ok repeat (of ``repeats``, default all); NaN where a step lacks a
        key."""
        chosen = self.ok_repeats if repeats is None else [k for k in repeats if self.steps.get(k)]
        return [np.array([[_number(step.get(key)) for key in keys] for step in self.steps[k]], dtype=float)
                for k in chosen]

    @classmethod
    def from_result_row(cls, row: Row) -> CellData:
        """A results.csv row without its raw data, as one repeat of one step holding the row's medians.

        Lets the report work on rows alone (an interval of zero width, and the best bucket size chosen in-sample).
        """
        step = {"step/time_ms": row.get("step_ms_median"), "comm/share": row.get("comm_share"),
                "comm/busy_ms": row.get("busy_comm_ms")}
        ok = row.get("status") == "ok" and row.get("step_ms_median") is not None
        return cls(str(row.get("cell_id", "")), dict(row), [], {0: [step]} if ok else {})


def _number(value: Any) -> float:
    if value is None or value == "":
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def cell_data(repeat_rows: Iterable[Row], step_rows: Iterable[Row]) -> dict[str, CellData]:
    """Every cell of ``repeat_rows`` with its steps (steps of a repeat that is not an ok row are ignored)."""
    cells: dict[str, CellData] = {}
    ok: set[RepeatKey] = set()
    for row in sorted(repeat_rows, key=lambda r: (r["repeat"])):
        data = cells.setdefault(row["cell_id"], CellData(row["cell_id"], {c: row.get(c) for c in _COORDINATES}))
        data.repeats.append(row)
        if row["status"] == "ok":
            ok.add((row["cell_id"], row["repeat"]))
    for step in step_rows:
        key = (step["cell_id"], step["repeat"])
        if key in ok:
            cells[key[0]].steps.setdefault(key[1], []).append(step)
    return cells


def bootstrap_key(cell_id: str, repeats: Sequence[int]) -> str:
    """The name a cell's draws over ``repeats`` are drawn under (``stats.rng_for``), e.g. ``"<id>|r0,1,2"``: the
    report's ratios reuse the draws behind results.csv's intervals.

    >>> bootstrap_key("naive-b2", [1, 3])
    'naive-b2|r1,3'
    """
    return f"{cell_id}|r" + ",".join(map(str, repeats))


def cell_row(data: CellData, bootstrap: Bootstrapper) -> Row:
    """The results.csv row of one cell (see the module docstring), intervals from ``bootstrap`` over its ok repeats."""
    row: Row = {column: "" for column in RESULT_COLUMNS}
    row.update(data.meta, cell_id=data.cell_id)
    run = data.repeats
    ok = data.ok_repeats
    failed = [r for r in run if r["status"] != "ok"]
    row["status"] = "ok" if ok else (run[-1]["status"] if run else "")
    if failed:
        first = failed[0]
        more = f" ({len(failed)} of {len(run)} repeats not ok)" if len(run) > 1 else ""
        row["reason"] = f"r{first['repeat']}: {first['status']}: {first['reason']}{more}".rstrip()
    row.update(
        repeats_ok=len(ok),
        repeats_run=len(run),
        wall_s=round(sum(r.get("wall_s") or 0.0 for r in run), 1),
    )
    loads = [r["load_avg_1m"] for r in run if isinstance(r.get("load_avg_1m"), (int, float))]
    row["load_avg_1m"] = max(loads) if loads else ""
    guarded = [r for r in run if r.get("busy") is not None and r.get("busy") != ""]
    if guarded:
        row["busy_repeats"] = sum(1 for r in guarded if r["busy"] is True)
        row["waited_s"] = round(sum(r.get("waited_s") or 0.0 for r in guarded), 1)
    resolved = [r["resolved_bucket_size_mb"] for r in run
                if r["status"] == "ok" and isinstance(r.get("resolved_bucket_size_mb"), (int, float))]
    if resolved:
        row["resolved_bucket_size_mb"] = float(np.median(resolved))
    if not ok:
        return row

    keys = list(dict.fromkeys(key for k in ok for step in data.steps[k] for key in step if key not in STEP_ID_COLUMNS))
    values = data.values(keys)
    medians = dict(zip(keys, np.atleast_1d(pooled_median(values))))
    column = {key: i for i, key in enumerate(keys)}
    step_values = [v[:, column["step/time_ms"]] for v in values] if "step/time_ms" in column else []
    if step_values:
        row.update(step_ms_median=float(medians["step/time_ms"]),
                   step_ms_p10=float(pooled_percentile(step_values, 10)),
                   step_ms_p90=float(pooled_percentile(step_values, 90)),
                   measured_steps=int(sum(np.isfinite(v).sum() for v in step_values)))
        lo, hi = percentile_interval(bootstrap.draws(bootstrap_key(data.cell_id, ok), data.values(ESTIMATED_KEYS)))
        row.update(step_ms_lo=lo[0], step_ms_hi=hi[0])
        if "comm/share" in column:
            row.update(comm_share=float(medians["comm/share"]), comm_share_lo=lo[1], comm_share_hi=hi[1])
    # Landmarks but no collective metric: the strategy's collectives were not recorded (fsdp2; not: no communication).
    # A cell with no comm/ key at all (the one-device reference) has no communication: its cells stay empty.
    unrecorded = any(key in column for key in LANDMARK_KEYS) and not any(key in column for key in COLLECTIVE_KEYS)
    for name, key in _MEDIANS:
        if key in medians and math.isfinite(medians[key]):
            row[name] = float(medians[key])
        elif unrecorded and key in COLLECTIVE_KEYS:
            row[name] = NOT_RECORDED
    if "memory/peak_MiB" in column:
        peak = np.nanmax(np.concatenate([v[:, column["memory/peak_MiB"]] for v in values]))
        row["peak_memory_MiB"] = float(peak) if math.isfinite(peak) else ""
    return {k: ("" if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


# ---- reading and writing ----------------------------------------------------------------------------------


def _parse_value(column: str, value: Any) -> Any:
    if column in NUMERIC_COLUMNS:
        if value in ("", None):
            return None
        try:
            number = float(value)
        except ValueError:  # e.g. resolved_bucket_size_mb "auto" from an unwired strategy
            return value
        return int(number) if column in _INTEGER_COLUMNS else number
    if column == "busy":
        return {"true": True, "false": False}.get(str(value).lower())
    if column == "bucket_size_mb":
        return float(value) if value not in ("", "auto", None) else (value or "")
    return value or ""


def parse_row(raw: Mapping[str, Any], columns: Sequence[str] = RESULT_COLUMNS) -> Row:
    """A row read back from CSV: numeric columns as floats (ints for the integer ones), empty as ``None``, ``busy``
    as a bool, numeric bucket sizes as floats."""
    return {column: _parse_value(column, raw.get(column, "")) for column in columns}


def _read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    if not Path(path).exists():
        return []
    return [raw for raw in read_csv(path) if raw.get("cell_id")]


def read_results(path: str | os.PathLike) -> dict[str, Row]:
    """``{cell_id: parsed row}`` of an existing results.csv (empty if there is none)."""
    return {raw["cell_id"]: parse_row(raw) for raw in _read_csv(path)}


def read_repeats(path: str | os.PathLike) -> dict[RepeatKey, Row]:
    """``{(cell_id, repeat): parsed row}`` of an existing repeats.csv (empty if there is none)."""
    rows = (parse_row(raw, REPEAT_COLUMNS) for raw in _read_csv(path))
    return {(row["cell_id"], row["repeat"]): row for row in rows}


def read_steps(path: str | os.PathLike) -> dict[RepeatKey, list[Row]]:
    """``{(cell_id, repeat): [step rows]}`` of an existing steps.csv; metrics as floats, empty cells left out."""
    steps: dict[RepeatKey, list[Row]] = {}
    for raw in _read_csv(path):
        row: Row = {"cell_id": raw["cell_id"], "repeat": int(raw["repeat"]), "step": int(float(raw["step"]))}
        row.update({k: float(v) for k, v in raw.items() if k not in STEP_ID_COLUMNS and v not in ("", None)})
        steps.setdefault((row["cell_id"], row["repeat"]), []).append(row)
    return steps


def _csv_text(columns: Sequence[str], rows: Iterable[Row]) -> str:
    return csv_text(({**row, "bucket_size_mb": _bucket_text(row.get("bucket_size_mb"))} for row in rows), columns)


def write_results(path: str | os.PathLike, rows: Iterable[Row]) -> None:
    """Write the results.csv rows to ``path`` atomically (a reader or a kill never sees half a file)."""
    files.write_atomically(path, _csv_text(RESULT_COLUMNS, rows))


def write_repeats(path: str | os.PathLike, rows: Iterable[Row]) -> None:
    """Write the repeats.csv rows to ``path`` atomically."""
    files.write_atomically(path, _csv_text(REPEAT_COLUMNS, rows))


def write_steps(path: str | os.PathLike, rows: Iterable[Row]) -> None:
    """Write the steps.csv rows to ``path`` atomically; columns: ``STEP_ID_COLUMNS``, then every metric key seen."""
    rows = list(rows)
    keys = dict.fromkeys(key for row in rows for key in row if key not in STEP_ID_COLUMNS)
    files.write_atomically(path, _csv_text([*STEP_ID_COLUMNS, *keys], rows))
