"""The study pipeline every benchmark shares: cells (fit arguments) x interleaved repeats run by the one launcher,
the CommTimer's files read by small metric plug-ins, the load guard before each repeat, and one way to write the
results (CSV, markdown tables, provenance, the command that made them). docs/benchmarks.md describes the benchmarks
built on it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from lightning_ddp.bench.launch import base_environment, error_line, fit_command, run_processes, write_command
from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.projection import tables
from lightning_ddp.provenance import cpu_model, git_state, invocation, package_version

T = TypeVar("T")
K = TypeVar("K")


# ---- running a study ----------------------------------------------------------------------------------------


def run_study(cells: Mapping[str, Sequence[str]], repeats: int, read: Callable[[Path], T], *,
              timeout_s: float = 3600.0) -> dict[str, list[T]]:
    """Every cell's fit (Lightning starts its other ranks) ``repeats`` times, ``interleaved``; per cell, what the
    metric plug-in ``read`` makes of each run's log directory, in repeat order.

    Raises:
        RuntimeError: a fit failed or timed out; names the cell, the repeat and the fit's last error line.
    """
    results: dict[str, list[T]] = {name: [] for name in cells}
    index = {name: i for i, name in enumerate(cells)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, repeat in interleaved(cells, repeats):
            print(f"{name}, repeat {repeat + 1}/{repeats}", flush=True)
            log_dir = Path(tmp) / f"cell{index[name]}" / f"r{repeat}"
            log_dir.mkdir(parents=True)
            command = fit_command(cells[name], log_dir.resolve())
            environment = base_environment()
            write_command(log_dir / "command.txt", command, [environment])
            log = log_dir / "fit.log"
            result = run_processes(command, [environment], [log], timeout_s)
            if result.timed_out or result.returncodes != [0]:
                text = log.read_text(encoding="utf-8", errors="replace")
                print(text[-8000:], file=sys.stderr, flush=True)
                how = f"ran past {timeout_s:.0f} s" if result.timed_out else f"exited {result.returncodes[0]}"
                last = error_line(text) or "no error line"
                raise RuntimeError(f"the fit ({name}, repeat {repeat + 1}) {how}: {last}")
            results[name].append(read(log_dir))
    return results


def interleaved(cells: Iterable[K], repeats: int) -> list[tuple[K, int]]:
    """Every (cell, repeat) in the order a study runs them: repeat 0 of every cell, then repeat 1, ... (a slow drift
    of the machine hits every cell alike)."""
    cells = list(cells)
    return [(cell, k) for k in range(repeats) for cell in cells]


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


def read_timing_summary(log_dir: Path, required: bool = False) -> dict[str, Any] | None:
    """The CommTimer's ``timing_summary.json`` under ``log_dir`` (the first, sorted), or ``None`` (a RuntimeError
    when ``required``)."""
    path = next(iter(sorted(log_dir.rglob("timing_summary.json"))), None)
    if path is None and required:
        raise RuntimeError(f"the fit wrote no timing_summary.json under {log_dir}")
    return None if path is None else json.loads(path.read_text())


def step_rows(log_dir: Path) -> list[dict[str, float]]:
    """Rank 0's measured per-step rows (wait/transfer, lag, step time, exposed comm ...) after the warm-up."""
    summary = read_timing_summary(log_dir, required=True)
    return summary["steps"][summary["warmup_steps"]:]


def summary_medians(keys: Mapping[str, str]) -> Callable[[Path], dict[str, float]]:
    """A plug-in reading the medians of the CommTimer's summary: ``{name: summary[key]["median"]}`` per run
    (step time, exposed comm, bytes ...)."""

    def read(log_dir: Path) -> dict[str, float]:
        timing = read_timing_summary(log_dir, required=True)
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


def csv_value(value: Any, digits: int | None = None) -> Any:
    """A value as a CSV cell holds it: None/NaN as ``""``, booleans as ``true``/``false``."""
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
    values = ({column: csv_value(row.get(column), digits) for column in columns} for row in rows)
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


# ---- the load guard: before each repeat, wait until the machine's CPUs are (nearly) idle ----------------------


CpuTimes = tuple[int, int]
"""``(idle, total)`` jiffies since boot, summed over all cores."""


def read_proc_stat(path: str = "/proc/stat") -> CpuTimes | None:
    """``(idle + iowait, user + nice + system + idle + iowait + irq + softirq + steal)`` of the ``cpu`` line, or
    ``None`` where there is no such file (not Linux)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("cpu "):
                    fields = [int(v) for v in line.split()[1:9]]
                    fields += [0] * (8 - len(fields))  # old kernels have fewer columns
                    return fields[3] + fields[4], sum(fields)
    except (OSError, ValueError):
        return None
    return None


def busy_fraction(before: CpuTimes, after: CpuTimes) -> float:
    """``1 - Δidle / Δtotal`` between two readings; ``0.0`` when no time passed on the counters."""
    d_idle, d_total = after[0] - before[0], after[1] - before[1]
    if d_total <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - d_idle / d_total))


def _sample_busy(seconds: float, reader: Callable[[], CpuTimes | None], sleep: Callable[[float], None]) -> float | None:
    before = reader()
    if before is None:
        return None
    sleep(seconds)
    after = reader()
    return None if after is None else busy_fraction(before, after)


@dataclass(frozen=True)
class LoadCheck:
    """What the guard saw before one repeat (the sweep's repeats.csv columns of the same names): the last busy
    fraction sampled (``None`` where it cannot be measured), the seconds waited for an idle machine, and whether the
    repeat started on a busy one (still above the threshold when the wait ran out)."""

    busy_before: float | None = None
    waited_s: float = 0.0
    busy: bool | None = None


def wait_until_idle(threshold: float, max_wait_s: float, sample_s: float,
                    reader: Callable[[], CpuTimes | None] = read_proc_stat,
                    sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> LoadCheck:
    """Sample the busy fraction over ``sample_s`` (0: guard off), and keep sampling while it is above ``threshold``,
    up to ``max_wait_s``; ``reader``, ``sleep`` and ``clock`` are injected by tests."""
    if sample_s <= 0:
        return LoadCheck()
    fraction = _sample_busy(sample_s, reader, sleep)
    if fraction is None:
        return LoadCheck()
    start = clock()
    waited = 0.0
    while fraction > threshold and waited < max_wait_s:
        latest = _sample_busy(sample_s, reader, sleep)
        waited = clock() - start
        if latest is None:  # the file went away: stop waiting, keep what was seen
            break
        fraction = latest
    return LoadCheck(busy_before=fraction, waited_s=waited, busy=fraction > threshold)
