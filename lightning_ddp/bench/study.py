"""The study pipeline every benchmark shares: cells x interleaved repeats run by the one launcher, metric plug-ins,
the load guard, the benchmarks' configs and main, and the results' writers (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from lightning_ddp.bench.launch import base_environment, cpu_threads_per_rank, error_line, fit_command, run_processes
from lightning_ddp.bench.stats import Estimate, interval_text
from lightning_ddp.command_line import check_field_types, parse_dataclass
from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.reporting.provenance import code_version, cpu_model, git_state, invocation, package_version
from lightning_ddp.reporting.tables import csv_text, read_csv

T = TypeVar("T")
K = TypeVar("K")
C = TypeVar("C", bound="BenchConfig")


def run_study(cells: Mapping[str, Sequence[str]], repeats: int, read: Callable[[Path], T], *,
              timeout_s: float = 3600.0) -> dict[str, list[T]]:
    """Every cell's fit ``repeats`` times, ``interleaved``; per cell, what the plug-in ``read`` makes of each run's
    log directory. A failed or timed-out fit raises RuntimeError naming the cell, the repeat and its error line."""
    results: dict[str, list[T]] = {name: [] for name in cells}
    index = {name: i for i, name in enumerate(cells)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, repeat in interleaved(cells, repeats):
            print(f"{name}, repeat {repeat + 1}/{repeats}", flush=True)
            log_dir = Path(tmp) / f"cell{index[name]}" / f"r{repeat}"
            log_dir.mkdir(parents=True)
            command = fit_command(cells[name], log_dir.resolve())
            log = log_dir / "fit.log"
            result = run_processes(command, [base_environment()], [log], timeout_s)
            if result.timed_out or result.returncodes != [0]:
                text = log.read_text(encoding="utf-8", errors="replace")
                print(text[-8000:], file=sys.stderr, flush=True)
                how = f"ran past {timeout_s:.0f} s" if result.timed_out else f"exited {result.returncodes[0]}"
                last = error_line(text) or "no error line"
                raise RuntimeError(f"the fit ({name}, repeat {repeat + 1}) {how}: {last}")
            results[name].append(read(log_dir))
    return results


def interleaved(cells: Iterable[K], repeats: int) -> list[tuple[K, int]]:
    """Every (cell, repeat): repeat 0 of every cell, then repeat 1, ... (a slow drift hits every cell alike)."""
    cells = list(cells)
    return [(cell, k) for k in range(repeats) for cell in cells]


def _rank(rank: int, world: int, port: int, measure: Callable[..., Any], backend: str, cuda: bool, result_file: str,
          *args: Any) -> None:
    """One spawned rank of ``run_ranks``: join the group, ``measure``, rank 0 writes the result to ``result_file``."""
    import torch
    import torch.distributed as dist

    from lightning_ddp.local_group import init_local_process_group
    from lightning_ddp.teardown import exit_without_finalizing, tear_down_process_group

    if cuda:
        torch.cuda.set_device(rank)
    # CPU ranks share the machine's cores, at least one each; oversubscribing them only adds noise.
    threads = None if cuda else cpu_threads_per_rank(world)
    init_local_process_group(rank, world, port, backend, threads=threads)
    try:
        result = measure(rank, world, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    if rank == 0:
        write_atomically(Path(result_file), json.dumps(result))
    tear_down_process_group()
    exit_without_finalizing()  # exit 0: no live gloo thread can abort the finalization (docs/troubleshooting.md)


def run_ranks(world: int, measure: Callable[..., Any], *args: Any, backend: str = "gloo", cuda: bool = False) -> Any:
    """``measure(rank, world, *args)`` in ``world`` spawned ranks of one local process group; rank 0's result (JSON)."""
    import torch.multiprocessing as mp

    from lightning_ddp.local_group import find_free_port

    with tempfile.TemporaryDirectory() as tmp:
        result_file = str(Path(tmp) / "result.json")
        mp.spawn(_rank, args=(world, find_free_port(), measure, backend, cuda, result_file, *args), nprocs=world,
                 join=True)
        return read_json(result_file)


def find_timing_summary(log_dir: Path) -> dict[str, Any] | None:
    """The CommTimer's first ``timing_summary.json`` under ``log_dir``, or ``None`` where the fit wrote none."""
    path = next(iter(sorted(log_dir.rglob("timing_summary.json"))), None)
    return None if path is None else json.loads(path.read_text())


def read_timing_summary(log_dir: Path) -> dict[str, Any]:
    """The CommTimer's first ``timing_summary.json`` under ``log_dir``; RuntimeError where the fit wrote none."""
    summary = find_timing_summary(log_dir)
    if summary is None:
        raise RuntimeError(f"the fit wrote no timing_summary.json under {log_dir}")
    return summary


def step_rows(log_dir: Path) -> list[dict[str, float]]:
    """Rank 0's measured per-step rows (wait/transfer, lag, step time, exposed comm ...) after the warm-up."""
    summary = read_timing_summary(log_dir)
    return summary["steps"][summary["warmup_steps"]:]


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


def with_interval(name: str, value: Estimate, point: str = "", shift: float = 0.0) -> dict[str, float]:
    """``{point or name: point, name_lo: lo, name_hi: hi}`` of an estimate, each plus ``shift``."""
    return {point or name: value.point + shift, f"{name}_lo": value.lo + shift, f"{name}_hi": value.hi + shift}


def per_repeat(runs: Sequence[Sequence[Mapping[str, float]]], key: str) -> list[np.ndarray]:
    """One array per repeat of ``key`` over its step rows (NaN where a row lacks it)."""
    return [np.array([row.get(key, math.nan) for row in run], dtype=float) for run in runs]


def _typed(text: str) -> Any:
    """A results.csv cell: booleans, numbers and text as written, an empty cell as ``None``."""
    if text in ("true", "false"):
        return text == "true"
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return text


def provenance(out: str | os.PathLike, **extra: Any) -> dict[str, Any]:
    """The invocation, versions, CPU and git state (``out``, the results' folder, does not make the tree dirty),
    plus ``extra``."""
    return {**invocation(), **extra, "torch": package_version("torch"), "lightning": package_version("lightning"),
            "cpu": {"model": cpu_model(), "count": os.cpu_count()}, **git_state(ignore=[out])}


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


def print_flushed(line: str) -> None:
    """A progress line, printed at once (a long run's log shows where it is while it runs)."""
    print(line, flush=True)


def load_average() -> float | None:
    """The 1-minute load average (recorded next to timings), or ``None`` where the platform has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def interval_cell(name: str, spec: str = ",.1f", bounds: str = "", scale: float = 1.0,
                  unit: str = "") -> Callable[[Mapping[str, Any]], str]:
    """A cell writing ``row[name]`` with its interval ``row[<bounds or name>_lo]``, ``_hi`` where it has one."""
    lo, hi = f"{bounds or name}_lo", f"{bounds or name}_hi"
    return lambda row: interval_text(row.get(name), row.get(lo), row.get(hi), spec, scale, unit)


CpuTimes = tuple[int, int]
"""``(idle, total)`` jiffies since boot, summed over all cores."""


def read_proc_stat(path: str = "/proc/stat") -> CpuTimes | None:
    """``(idle + iowait, all eight counters)`` of the ``cpu`` line, or ``None`` without the file (not Linux)."""
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


@dataclass(frozen=True)
class LoadCheck:
    """What the guard saw before a repeat: the last busy fraction (None: not measurable), seconds waited, busy."""

    busy_before: float | None = None
    """The CPU's busy fraction (0 to 1) in the last sample before the repeat; ``None``: not measurable."""
    waited_s: float = 0.0
    """Seconds the guard waited for the machine to go idle."""
    busy: bool | None = None
    """Whether the repeat started on a busy machine (after the longest wait); ``None``: guard off or CPU unreadable."""


def wait_until_idle(threshold: float, max_wait_s: float, sample_s: float,
                    reader: Callable[[], CpuTimes | None] = read_proc_stat,
                    sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> LoadCheck:
    """Sample the busy fraction over ``sample_s`` (0: off), again while above ``threshold``, up to ``max_wait_s``."""
    def sample() -> float | None:
        before = reader()
        if before is None:
            return None
        sleep(sample_s)
        after = reader()
        return None if after is None else busy_fraction(before, after)

    fraction = sample() if sample_s > 0 else None
    start, waited = clock(), 0.0
    while fraction is not None and fraction > threshold and waited < max_wait_s:
        latest = sample()
        waited = clock() - start
        if latest is None:  # the file went away: stop waiting, keep what was seen
            break
        fraction = latest
    return LoadCheck() if fraction is None else LoadCheck(fraction, waited, fraction > threshold)


@dataclass
class BenchConfig:
    """What every single benchmark configures: its repeats, its steps, the bootstrap, the output."""

    repeats: int = 3
    """Interleaved runs (rounds) of every cell, each in fresh processes where the cells are fits."""
    steps: int = 40
    """Optimizer steps per run."""
    warmup_steps: int = 5
    """Steps per run left out (``--timer.warmup_steps``)."""
    bootstrap_samples: int = 2000
    """Draws of every interval."""
    seed: int = 0
    """Seed of the bootstrap."""
    report_only: bool = False
    """Measure nothing: rebuild the report from ``out_dir``'s recorded results."""
    out_dir: str = "logs/study"
    """Where the results and the report go (logs/ is git-ignored)."""

    def __post_init__(self) -> None:
        """Refuses repeats or steps below 1 and a warm-up that leaves no measured step."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        for name in ("repeats", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")


@dataclass
class StudyConfig(BenchConfig):
    """A ``BenchConfig`` whose cells are fits: the fit config and arguments every fit starts from, its timeout."""

    fit_config: str = "configs/quickstart.yaml"
    """The fit config every run starts from (2 CPU ranks over gloo in the quickstart)."""
    fit_args: list[str] = field(default_factory=list)
    """More arguments for every fit, e.g. ``["--data.source", "synthetic"]``."""
    timeout_s: float = 600.0
    """Seconds per run before it is killed and the benchmark fails."""


NO_VALIDATION = ["--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0"]
"""Fit arguments keeping validation out of the timed steps."""
NO_CHECKPOINTS = ["--trainer.enable_checkpointing", "false"]
"""The quickstart keeps a 43 MB checkpoint per run; a study's fits keep none."""


def fit_arguments_of(config: StudyConfig, strategy: str) -> list[str]:
    """A fit of ``fit_config`` and ``fit_args`` with ``strategy``, ``steps`` long, ``warmup_steps`` left out."""
    return ["--config", config.fit_config, *config.fit_args, "--trainer.strategy", strategy,
            "--trainer.max_steps", str(config.steps), "--timer.warmup_steps", str(config.warmup_steps),
            "--trainer.enable_progress_bar", "false", *NO_CHECKPOINTS]


def write_results(config: BenchConfig, command: str, rows: list[dict[str, Any]],
                  files: Mapping[str, str] | None = None, **recorded: Any) -> None:
    """results.csv (the first row's columns, 4 digits), ``files`` and environment.json (provenance, command, config,
    ``recorded``)."""
    write_outputs(config.out_dir, {
        "results.csv": csv_text(rows, list(rows[0]), digits=4), **(files or {}),
        "environment.json": provenance(config.out_dir, command_line=command, config=asdict(config), **recorded),
    })


def with_commit_line(markdown: str, recorded: Mapping[str, Any]) -> str:
    """``markdown`` with its last line: the commit the results were measured at, from their recorded ``provenance``."""
    return f"{markdown.rstrip()}\n\nMeasured at {code_version(recorded)}.\n"


def csv_report(render: Callable[[C, list[dict[str, Any]], str], str]) -> Callable[[C], tuple[list, str]]:
    """A benchmark's ``report``: results.md by ``render`` of out_dir's results.csv, its recorded config and command,
    ending with the commit environment.json records (``with_commit_line``)."""

    def report(config: C) -> tuple[list[dict[str, Any]], str]:
        recorded = read_json(Path(config.out_dir) / "environment.json")
        csv_rows = read_csv(Path(config.out_dir) / "results.csv")
        rows = [{key: _typed(value) for key, value in row.items()} for row in csv_rows]
        markdown = render(type(config)(**{**recorded["config"], "report_only": False}), rows, recorded["command_line"])
        markdown = with_commit_line(markdown, recorded)
        write_outputs(config.out_dir, {"results.md": markdown})
        return rows, markdown

    return report


def json_report(results: str, render: Callable[[dict[str, Any]], str],
                plot: Callable[[dict[str, Any], Path], Any] | None = None) -> Callable[[Any], tuple[dict, str]]:
    """A benchmark's ``report``: by ``render`` of out_dir's JSON ``results`` (``NAME.json``), ``NAME.md``
    ending with the commit the JSON records (at its top, or under ``environment``); and its ``plot``."""

    def report(config: Any) -> tuple[dict[str, Any], str]:
        out = Path(config.out_dir)
        result = read_json(out / results)
        text = with_commit_line(render(result), result.get("environment", result))
        write_outputs(out, {Path(results).with_suffix(".md").name: text})
        if plot is not None:
            plot(result, out)
        return result, text

    return report


def benchmark_main(config_type: type[C], measure: Callable[[C, str], Any],
                   report: Callable[[C], tuple[Any, str]]) -> Callable[[list[str] | None], Any]:
    """The ``main(argv)`` of ``python -m <config_type's module>``: ``config_type`` parsed with jsonargparse,
    ``measure(config, command)`` writes the raw results into ``out_dir`` (skipped with ``report_only``),
    ``report(config)`` the report from them; prints its markdown, returns its result."""
    def main(argv: list[str] | None = None) -> Any:
        module = sys.modules[config_type.__module__].__spec__.name  # its name also when run as __main__
        config = parse_dataclass(config_type, argv, prog=f"python -m {module}")
        if not config.report_only:
            measure(config, f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]))
        result, markdown = report(config)
        print(markdown, flush=True)
        return result

    return main
