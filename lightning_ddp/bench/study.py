"""The study pipeline every benchmark shares: cells (fit arguments) x interleaved repeats run by the one launcher,
the CommTimer's files read by small metric plug-ins, and one way to write the results (CSV, markdown tables,
provenance, the command that made them). docs/benchmarks.md describes the benchmarks built on it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from lightning_ddp.bench.launch import measured_steps, read_timing_summary, run_interleaved
from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.projection import tables
from lightning_ddp.provenance import cpu_model, git_state, invocation, package_version

__all__ = ["command_text", "csv_text", "load_average", "loss_curve", "markdown_table", "per_repeat", "provenance",
           "read_csv", "read_json", "run_study", "spawn_ranks", "step_rows", "summary_medians", "write_outputs"]

T = TypeVar("T")


# ---- running a study ----------------------------------------------------------------------------------------


def run_study(cells: Mapping[str, Sequence[str]], repeats: int, read: Callable[[Path], T], *,
              timeout_s: float = 3600.0) -> dict[str, list[T]]:
    """Every cell's fit ``repeats`` times, interleaved (cell order within each round); per cell, what the metric
    plug-in ``read`` makes of each run's log directory, in repeat order."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = run_interleaved(cells, repeats, Path(tmp), timeout_s=timeout_s)
        return {name: [read(log_dir) for log_dir in dirs] for name, dirs in logs.items()}


def spawn_ranks(rank_main: Callable[..., None], world: int, *args: Any) -> Any:
    """The in-process benchmarks' runner (memory, engine step, gradient error): ``rank_main(rank, world, port,
    *args, result_file)`` in ``world`` spawned processes; what rank 0 wrote to ``result_file`` as JSON."""
    import torch.multiprocessing as mp

    from lightning_ddp.local_group import find_free_port

    with tempfile.TemporaryDirectory() as tmp:
        result_file = str(Path(tmp) / "result.json")
        mp.spawn(rank_main, args=(world, find_free_port(), *args, result_file), nprocs=world, join=True)
        return read_json(result_file)


# ---- metric plug-ins: a run's log directory in, named values out ---------------------------------------------


def step_rows(log_dir: Path) -> list[dict[str, float]]:
    """Rank 0's measured per-step rows (wait/transfer, lag, step time, exposed comm ...) after the warm-up."""
    return measured_steps(log_dir)


def summary_medians(keys: Mapping[str, str]) -> Callable[[Path], dict[str, float]]:
    """A plug-in reading the medians of the CommTimer's summary: ``{name: summary[key]["median"]}`` per run
    (step time, exposed comm, bytes ...)."""

    def read(log_dir: Path) -> dict[str, float]:
        timing = read_timing_summary(log_dir)
        if timing is None:
            raise RuntimeError(f"the fit wrote no timing_summary.json under {log_dir}")
        return {name: timing["summary"][key]["median"] for name, key in keys.items()}

    return read


def loss_curve(log_dir: Path) -> list[float]:
    """Rank 0's ``train/loss`` per logged step, from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses: dict[int, float] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "train/loss" in accumulator.Tags()["scalars"]:
            losses.update({event.step: event.value for event in accumulator.Scalars("train/loss")})
    return [losses[step] for step in sorted(losses)]


def per_repeat(runs: Sequence[Sequence[Mapping[str, float]]], key: str) -> list[np.ndarray]:
    """One array per repeat of ``key`` over its step rows (NaN where a row lacks it): what ``stats`` estimates."""
    return [np.array([row.get(key, math.nan) for row in run], dtype=float) for run in runs]


# ---- writing the results -------------------------------------------------------------------------------------


def _csv_value(value: Any, digits: int | None) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        return round(value, digits) if digits is not None else value
    return value


def csv_text(rows: Iterable[Mapping[str, Any]], columns: Sequence[str], digits: int | None = None) -> str:
    """The study's one CSV writer: ``columns`` in order (others ignored), missing/None/NaN as empty, booleans as
    ``true``/``false``, floats rounded to ``digits`` when given."""
    values = ({column: _csv_value(row.get(column), digits) for column in columns} for row in rows)
    return tables.csv_text(values, columns)


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """The rows of a CSV file as strings (empty cells as ``""``)."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    """A markdown table as lines; ``align`` has one ``l`` or ``r`` per column (default: first left, others right).

    >>> markdown_table(["a", "b"], [[1, 2]])
    ['| a | b |', '|---|---:|', '| 1 | 2 |']
    """
    return tables.markdown_table([str(name) for name in header], rows, align or "l" + "r" * (len(header) - 1))


def command_text(module: str, argv: Sequence[str] | None) -> str:
    """``python -m <module> <arguments>``: how a result was made (``argv`` None: this process's arguments)."""
    return f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])


def provenance(out: str | os.PathLike | None = None, **extra: Any) -> dict[str, Any]:
    """What the results record next to their numbers: the invocation, versions, CPU and git state (``out``, where
    they are written, does not make the tree dirty), plus ``extra``."""
    return {**invocation(), **extra, "torch": package_version("torch"), "lightning": package_version("lightning"),
            "cpu": {"model": cpu_model(), "count": os.cpu_count()},
            **git_state(ignore=[out] if out is not None else [])}


def write_outputs(out: str | os.PathLike, files: Mapping[str, str | dict]) -> None:
    """Each file under ``out`` atomically: text as given, a dict as indented JSON."""
    for name, content in files.items():
        if isinstance(content, str):
            write_atomically(Path(out) / name, content)
        else:
            write_json_atomically(Path(out) / name, content, default=str)


def read_json(path: str | os.PathLike, missing_ok: bool = False) -> Any:
    """A JSON file's content; with ``missing_ok``, ``None`` for a missing or unreadable file."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        if missing_ok:
            return None
        raise


def load_average() -> float | None:
    """The 1-minute load average (recorded next to timings), or ``None`` where the platform has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None
