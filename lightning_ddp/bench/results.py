"""``results.csv``: one row per cell, written whole and atomically after every cell.

Columns (``RESULT_COLUMNS``, in order):

=======================  ===========================================================================
column                   value
=======================  ===========================================================================
cell_id                  stable id of the cell (``grid.cell_id``); ``runs/<cell_id>/`` holds its logs
strategy                 a registered algorithm (naive, flat, overlap, bucketed, ...), ddp or reference
bucket_size_mb           algorithms with buckets only: the configured cap in MiB, or ``auto``
batch_size               per-rank batch size
context_length           sequence length
precision                Lightning precision
model                    model preset
world_size               ranks (1 for the reference)
accelerator, backend     cpu/cuda, gloo/nccl (empty for the reference: no process group)
status                   ok, oom, failed, timeout
reason                   why a cell is not ok (its last meaningful error line)
step_ms_median/p10/p90   step time over the measured steps (CommTimer ``step/time_ms``, max over ranks)
exposed_comm_ms          median ``comm/exposed_ms``: communication on the critical path
busy_comm_ms             median ``comm/busy_ms``: time some collective was in flight
comm_share               median ``comm/share`` = exposed / step
overlap                  median ``comm/overlap`` = 1 - exposed / busy
busbw_GBps               median ``comm/busbw_GBps``
tokens_per_s             median ``step/tokens_per_s`` (global)
mfu                      median ``step/mfu`` (CUDA with a known peak only)
peak_memory_MiB          max ``memory/peak_MiB`` over all steps (CUDA: allocated; CPU: process RSS)
resolved_bucket_size_mb  the bucket cap the strategy reported using (``run.bucket_size_mb``; ``auto`` resolved)
measured_steps           steps in the statistics
wall_s                   wall time of the cell, start-up included
load_avg_1m              the machine's 1-minute load average when the cell ended (its own ranks count
                         too): a busy shared machine inflates step times, this says how busy it was
=======================  ===========================================================================
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Iterable

from lightning_ddp.bench.config import REFERENCE, format_bucket, has_bucket_axis
from lightning_ddp.bench.grid import Cell, RankLayout
from lightning_ddp.bench.runner import CellOutcome

__all__ = ["NUMERIC_COLUMNS", "RESULT_COLUMNS", "make_row", "parse_row", "read_results", "write_results",
           "write_text_atomically"]

RESULT_COLUMNS: tuple[str, ...] = (
    "cell_id", "strategy", "bucket_size_mb", "batch_size", "context_length", "precision", "model",
    "world_size", "accelerator", "backend", "status", "reason",
    "step_ms_median", "step_ms_p10", "step_ms_p90", "exposed_comm_ms", "busy_comm_ms", "comm_share", "overlap",
    "busbw_GBps", "tokens_per_s", "mfu", "peak_memory_MiB", "resolved_bucket_size_mb", "measured_steps", "wall_s",
    "load_avg_1m",
)
"""The exact columns of results.csv, in order (see the module docstring)."""

NUMERIC_COLUMNS: frozenset[str] = frozenset(RESULT_COLUMNS[RESULT_COLUMNS.index("step_ms_median"):]) | {
    "batch_size", "context_length", "world_size"}
"""Columns ``parse_row`` turns into numbers (empty cells become ``None``)."""

# (column, CommTimer summary key) of the median-valued columns
_MEDIANS = (
    ("exposed_comm_ms", "comm/exposed_ms"),
    ("busy_comm_ms", "comm/busy_ms"),
    ("comm_share", "comm/share"),
    ("overlap", "comm/overlap"),
    ("busbw_GBps", "comm/busbw_GBps"),
    ("tokens_per_s", "step/tokens_per_s"),
    ("mfu", "step/mfu"),
)


def make_row(
    cell: Cell,
    outcome: CellOutcome,
    model: str | None,
    accelerator: str,
    layout: RankLayout,
    load_avg: float | None = None,
) -> dict[str, Any]:
    """The results.csv row of ``cell`` after it ran (metrics from its ``timing_summary.json`` when ok)."""
    row: dict[str, Any] = {column: "" for column in RESULT_COLUMNS}
    row.update(
        cell_id=cell.id,
        strategy=cell.strategy,
        bucket_size_mb=format_bucket(cell.bucket_size_mb),
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
        load_avg_1m="" if load_avg is None else round(load_avg, 2),
    )
    doc = outcome.summary
    if outcome.status != "ok" or not doc:
        return row
    summary = doc.get("summary", {})
    step = summary.get("step/time_ms", {})
    row.update(
        step_ms_median=step.get("median", ""),
        step_ms_p10=step.get("p10", ""),
        step_ms_p90=step.get("p90", ""),
        measured_steps=int(step.get("n", 0)),
    )
    for column, key in _MEDIANS:
        if key in summary:
            row[column] = summary[key]["median"]
    memory = [s["memory/peak_MiB"] for s in doc.get("steps", []) if "memory/peak_MiB" in s]
    if memory:
        row["peak_memory_MiB"] = max(memory)
    resolved = (doc.get("run") or {}).get("bucket_size_mb")
    if has_bucket_axis(cell.strategy) and isinstance(resolved, (int, float)):  # "auto" if the size was not recorded
        row["resolved_bucket_size_mb"] = resolved
    return row


def parse_row(raw: dict[str, str]) -> dict[str, Any]:
    """A row read back from CSV: numeric columns as floats (ints for the three integer ones), empty as ``None``."""
    row: dict[str, Any] = {}
    for column in RESULT_COLUMNS:
        value = raw.get(column, "")
        if column in NUMERIC_COLUMNS:
            if value in ("", None):
                row[column] = None
            else:
                try:
                    number = float(value)
                except ValueError:  # e.g. resolved_bucket_size_mb "auto" from an unwired strategy
                    row[column] = value
                    continue
                row[column] = int(number) if column in ("batch_size", "context_length", "world_size") else number
        else:
            row[column] = value or ""
    if row["bucket_size_mb"] not in ("", "auto"):
        row["bucket_size_mb"] = float(row["bucket_size_mb"])
    return row


def read_results(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """``{cell_id: parsed row}`` of an existing results.csv (empty if there is none)."""
    path = Path(path)
    if not path.exists():
        return {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return {raw["cell_id"]: parse_row(raw) for raw in reader if raw.get("cell_id")}


def write_results(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> None:
    """Write every row to ``path`` (tmp file + ``os.replace``: a reader or a kill never sees half a file)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(RESULT_COLUMNS), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in RESULT_COLUMNS})
    write_text_atomically(path, buffer.getvalue())


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``<path>.tmp`` in the same directory, fsync, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic within one filesystem
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
