"""From a ``SweepConfig`` to cells (``expand_grid``: ids that a rerun recognises), and from a cell to its fit
arguments and processes (the command line itself is the launcher's); docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ddp.bench.config import BASELINE, REFERENCE, SweepConfig, has_bucket_axis
from lightning_ddp.bench.launch import RankLayout, fit_command, rank_environments, rank_layout, strategy_argument
from lightning_ddp.catalogue import format_bucket, format_settings, settings_slug, variant_label

__all__ = ["Cell", "cell_command", "cell_environments", "cell_id", "expand_grid", "sweep_layout", "threads_per_rank"]


@dataclass(frozen=True)
class Cell:
    """One point of the grid: one training run in its own process(es). ``id`` (readable slug + config hash) names
    its rows and run directories; ``strategy`` is a catalogue name or ``reference``; ``bucket_size_mb`` is ``None``
    unless the strategy has one; ``engine_settings`` are ``(name, value)`` pairs in the config's order."""

    id: str
    strategy: str
    batch_size: int
    context_length: int
    precision: str
    bucket_size_mb: float | str | None
    world_size: int
    engine_settings: tuple[tuple[str, Any], ...] = ()

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.engine_settings)

    @property
    def label(self) -> str:
        """Short human description, e.g. ``bucketed_powersgd_ddp 4 MiB rank=4 | batch 2 | ctx 64 | 32-true``."""
        name = variant_label(self.strategy, self.bucket_size_mb, format_settings(self.settings))
        return f"{name} | batch {self.batch_size} | ctx {self.context_length} | {self.precision}"


def cell_id(coordinates: dict[str, Any], fingerprint: dict[str, Any]) -> str:
    """``<strategy>[-<bucket>mb][-<setting><value>...]-b<batch>-t<ctx>-<precision>-<8 hex>``; the hash covers both
    dicts (``coordinates["engine_settings"]``, if present, included: a changed setting is a new cell).

    >>> cell_id({"strategy": "bucketed_ddp", "bucket_size_mb": 4.0, "batch_size": 2, "context_length": 64,
    ...          "precision": "32-true", "world_size": 2}, {})[:-9]
    'bucketed_ddp-4mb-b2-t64-32-true'
    >>> cell_id({"strategy": "bucketed_powersgd_ddp", "bucket_size_mb": 4.0, "engine_settings": {"rank": 4},
    ...          "batch_size": 2, "context_length": 64, "precision": "32-true", "world_size": 2}, {})[:-9]
    'bucketed_powersgd_ddp-4mb-rank4-b2-t64-32-true'
    """
    canonical = json.dumps({"cell": coordinates, "sweep": fingerprint}, sort_keys=True, default=str)
    digest = hashlib.sha1(canonical.encode()).hexdigest()[:8]
    bucket = coordinates.get("bucket_size_mb")
    slug = coordinates["strategy"] + (f"-{format_bucket(bucket)}mb" if bucket not in (None, "auto") else "")
    slug += "-auto" if bucket == "auto" else ""
    slug += settings_slug(coordinates.get("engine_settings") or {})
    slug += f"-b{coordinates['batch_size']}-t{coordinates['context_length']}-{coordinates['precision']}"
    return f"{slug}-{digest}"


def expand_grid(config: SweepConfig) -> list[Cell]:
    """Every cell of the sweep, grouped by (precision, batch size, context length): per group the reference, one
    cell per listed strategy (``ddp`` added if missing) times its bucket sizes (if it has any) times the combinations
    of its ``grid.engine_settings``."""
    grid = config.grid
    listed = [s for s in grid.strategies if s != REFERENCE]
    if BASELINE not in listed:
        listed.append(BASELINE)
    run = config.run
    # the sweep settings that change what a cell measures (not: out_dir, timeout, launcher, repeats, load guard,
    # report options)
    fingerprint = {
        "workload": dataclasses.asdict(config.workload),
        "accelerator": run.accelerator,
        "devices": run.devices,
        "backend": run.backend,
        "warmup_steps": run.warmup_steps,
        "steps": run.steps,
        "threads_per_rank": run.threads_per_rank,
        "env": dict(sorted(run.env.items())),
    }
    cells = []
    for precision in grid.precisions:
        for batch_size in grid.batch_sizes:
            for context_length in grid.context_lengths:
                variants: list[tuple[str, float | str | None, dict[str, Any]]] = [(REFERENCE, None, {})]
                for strategy in listed:
                    sizes = grid.bucket_sizes_mb if has_bucket_axis(strategy) else [None]
                    variants.extend((strategy, size, settings) for size in sizes
                                    for settings in grid.setting_combinations(strategy))
                for strategy, bucket, settings in variants:
                    coordinates: dict[str, Any] = {
                        "strategy": strategy,
                        "bucket_size_mb": bucket,
                        "batch_size": batch_size,
                        "context_length": context_length,
                        "precision": precision,
                        "world_size": 1 if strategy == REFERENCE else config.run.devices,
                    }
                    if settings:  # only then: the ids of cells without settings stay what they were
                        coordinates["engine_settings"] = settings
                    identity = cell_id(coordinates, fingerprint)
                    coordinates["engine_settings"] = tuple(settings.items())
                    cells.append(Cell(id=identity, **coordinates))
    assert len({c.id for c in cells}) == len(cells), "cell ids must be unique"
    return cells


# ---- processes ----------------------------------------------------------------------------------------


def sweep_layout(config: SweepConfig, gpu_count: int = 0, visible_gpus: str | None = None) -> RankLayout:
    """``launch.rank_layout`` for the sweep's ``run`` section."""
    run = config.run
    return rank_layout(run.accelerator, run.devices, run.backend, run.launcher, gpu_count, visible_gpus)


def cell_command(cell: Cell, config: SweepConfig, layout: RankLayout, run_dir: Path) -> list[str]:
    """The cell's ``fit`` command (every process of the cell runs it), logging into ``run_dir`` itself (where its
    timing_summary.json lands)."""
    run, workload = config.run, config.workload
    reference = cell.strategy == REFERENCE
    args = ["--config", workload.base_config, *workload.cli_args]
    if workload.preset is not None:
        args += ["--model.preset", workload.preset]
    strategy = strategy_argument(cell.strategy, layout.backend, cell.bucket_size_mb, cell.settings)
    args += [
        "--model.context_length", str(cell.context_length),
        "--data.seq_len", str(cell.context_length),
        "--data.batch_size", str(cell.batch_size),
        "--trainer.accelerator", run.accelerator,
        "--trainer.devices", "1" if reference else str(layout.devices_per_node),
        "--trainer.num_nodes", "1" if reference else str(layout.num_nodes),
        "--trainer.strategy", strategy,
        "--trainer.precision", cell.precision,
        "--trainer.max_steps", str(run.warmup_steps + run.steps),
        "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--timer.enabled", "true",
        "--timer.every_n_steps", "1",  # every step measured: the statistics are over steps
        "--timer.warmup_steps", str(run.warmup_steps),
    ]
    return fit_command(args, run_dir)


def threads_per_rank(config: SweepConfig, cpu_count: int | None = None) -> int | None:
    """``run.threads_per_rank``, or on CPU ``cores // devices`` (what Lightning's DDP sets), or ``None`` on CUDA."""
    if config.run.threads_per_rank is not None:
        return config.run.threads_per_rank
    if config.run.accelerator != "cpu":
        return None
    return max(1, (cpu_count or os.cpu_count() or 1) // config.run.devices)


def cell_environments(cell: Cell, config: SweepConfig, layout: RankLayout, port: int,
                      parent: dict[str, str] | None = None) -> list[dict[str, str]]:
    """One environment per process to start: one for the reference and for ``launcher: lightning``, else every
    rank's."""
    every_rank = cell.strategy != REFERENCE and config.run.launcher == "ranks"
    return rank_environments(layout, port, every_rank=every_rank, threads=threads_per_rank(config),
                             extra=config.run.env, parent=parent)
