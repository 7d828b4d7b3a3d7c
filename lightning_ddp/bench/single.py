"""What the single benchmarks share on top of ``study``: tables written from column definitions, results.csv read
back into typed rows, their configs and main (``--report_only true`` rebuilds the report from the recorded results)
and the in-process benchmarks' rank runner.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from lightning_ddp.bench.stats import interval_text
from lightning_ddp.bench.study import (
    command_text, csv_text, markdown_table, provenance, read_csv, read_json, spawn_ranks, write_outputs,
)
from lightning_ddp.files import write_atomically
from lightning_ddp.local_group import cores_per_rank, init_local_process_group

__all__ = ["BenchConfig", "Column", "StudyConfig", "benchmark_main", "fit_arguments_of", "interval_cell", "read_rows",
           "run_ranks", "table", "text_cell", "write_results"]

C = TypeVar("C")
R = TypeVar("R")
Row = Mapping[str, Any]


class Column(NamedTuple):
    """One column of a table: its header, its cell from a row (a mapping, or whatever the table's rows are), its
    alignment (``l`` or ``r``)."""

    header: str
    cell: Callable[[Any], Any]
    align: str = "r"


def table(columns: Sequence[Column], rows: Iterable[Any]) -> list[str]:
    """The markdown table of ``rows`` under ``columns``, as lines."""
    return markdown_table([c.header for c in columns], [[c.cell(row) for c in columns] for row in rows],
                          "".join(c.align for c in columns))


def _text(value: Any, spec: str) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, spec)


def text_cell(name: str, spec: str = "") -> Callable[[Row], str]:
    """A cell writing ``row[name]`` in ``spec``: booleans as yes/no, ``-`` where it is missing or empty."""
    return lambda row: _text(row.get(name), spec)


def interval_cell(name: str, spec: str = ",.1f", bounds: str = "", scale: float = 1.0,
                  unit: str = "") -> Callable[[Row], str]:
    """A cell writing ``row[name]`` (``interval_text``) with its interval where the row has one:
    ``row[<bounds or name>_lo]`` and ``_hi``."""
    lo, hi = f"{bounds or name}_lo", f"{bounds or name}_hi"
    return lambda row: interval_text(row.get(name), row.get(lo), row.get(hi), spec, scale, unit)


def _typed(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    if text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return text


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """A results.csv's rows: booleans, numbers and text as written, empty cells as ``None``."""
    return [{key: _typed(value) for key, value in row.items()} for row in read_csv(path)]


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


def fit_arguments_of(config: StudyConfig, strategy: str) -> list[str]:
    """A fit of ``fit_config`` and ``fit_args`` with ``strategy``, ``steps`` long, ``warmup_steps`` left out."""
    return ["--config", config.fit_config, *config.fit_args, "--trainer.strategy", strategy,
            "--trainer.max_steps", str(config.steps), "--timer.warmup_steps", str(config.warmup_steps),
            "--trainer.enable_progress_bar", "false"]


def write_results(config: StudyConfig, command: str, rows: list[dict[str, Any]], columns: Sequence[str], markdown: str,
                  files: Mapping[str, str] | None = None, **recorded: Any) -> None:
    """results.csv (``columns``, 4 digits), results.md, ``files`` and environment.json (provenance, the command
    line, the config and ``recorded``) into ``config.out_dir``."""
    write_outputs(config.out_dir, {
        "results.csv": csv_text(rows, columns, digits=4), "results.md": markdown, **(files or {}),
        "environment.json": provenance(config.out_dir, command_line=command, config=asdict(config), **recorded),
    })


def _rebuild_results_md(config: Any, render: Callable[[Any, list[dict[str, Any]], str], str]) -> list[dict[str, Any]]:
    """results.md rebuilt from ``config.out_dir``'s results.csv and environment.json (its recorded config)."""
    recorded = read_json(Path(config.out_dir) / "environment.json")
    rows = read_rows(Path(config.out_dir) / "results.csv")
    settings = type(config)(**{**recorded["config"], "report_only": False})
    write_outputs(config.out_dir, {"results.md": render(settings, rows, recorded["command_line"])})
    return rows


def benchmark_main(config: C, module: str, argv: list[str] | None, measure: Callable[[C, str], R],
                   render: Callable[[C, R, str], str] | None = None,
                   rebuild: Callable[[C], R] | None = None) -> R:
    """``python -m <module>`` with its parsed ``config``: ``measure(config, command)`` the results (it writes the
    files), ``render``'s markdown of them printed. With ``report_only`` nothing is measured: ``rebuild(config)``
    rewrites the report from ``out_dir``'s files (default: results.md from results.csv and environment.json)."""
    if config.report_only:
        return rebuild(config) if rebuild is not None else _rebuild_results_md(config, render)
    command = command_text(module, argv)
    result = measure(config, command)
    if render is not None:
        print(render(config, result, command))
    return result


def _rank(rank: int, world: int, port: int, measure: Callable[..., Any], backend: str, cuda: bool,
          *args_and_file: Any) -> None:
    *args, result_file = args_and_file
    if cuda:
        torch.cuda.set_device(rank)
    # CPU ranks share the machine's cores; oversubscribing them only adds noise.
    init_local_process_group(rank, world, port, backend, threads=None if cuda else cores_per_rank(world))
    try:
        result = measure(rank, world, *args)
        if rank == 0:
            write_atomically(Path(result_file), json.dumps(result))
        # Both ranks done with the group before either tears it down: a rank destroying it while its peer's gloo
        # thread still holds the pair aborted ("terminate called without an active exception", SIGABRT) under load.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, measure: Callable[..., Any], *args: Any, backend: str = "gloo", cuda: bool = False) -> Any:
    """The in-process benchmarks' ranks: ``measure(rank, world, *args)`` in ``world`` spawned processes joined in
    one local process group (``backend``; each CPU rank its share of the cores, each CUDA rank its GPU); what rank
    0's ``measure`` returned (through JSON)."""
    return spawn_ranks(_rank, world, measure, backend, cuda, *args)
