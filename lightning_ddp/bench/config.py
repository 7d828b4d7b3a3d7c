"""A sweep's config (``grid``, ``workload``, ``run``, ``output``; field docstrings are ``--help``, errors name the
field to change) and the cells it expands to, with ids a rerun recognises (docs/benchmarks.md)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Any, Literal, Optional, Union

from lightning_ddp import catalogue  # the standard library only: no torch import
from lightning_ddp.bench.launch import REFERENCE
from lightning_ddp.reporting.variants import (
    format_bucket, format_settings, setting_combinations, settings_slug, variant_label, variant_strategy,
)
from lightning_ddp.command_line import check_field_types


def strategy_with_memory_model(model: str) -> str:
    """The one catalogue strategy whose memory model is ``model`` (``none``, ``per_tensor``, ``fully_sharded``)."""
    (name,) = [entry.name for entry in catalogue.STRATEGIES.values() if entry.memory == model]
    return name


def has_bucket_axis(variant: str) -> bool:
    """Whether cells of a strategy (or ``"<strategy> <settings>"``) are repeated over ``grid.bucket_sizes_mb``."""
    strategy = variant_strategy(variant)
    return strategy != REFERENCE and catalogue.get(strategy).has_bucket_size


DDP_BASELINE = "ddp"
"""Lightning's DDP, always in the grid: the yardstick of the first performance goal."""

PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
"""Values of ``grid.precisions`` (Lightning's ``trainer.precision``; ``32-true`` is fp32)."""

BucketSize = Union[float, Literal["auto"]]
"""A grid's bucket size: MiB (> 0), or ``auto`` (the size the all-reduce fit predicts)."""

SWEEP_OWNED_ARGS: dict[str, str] = {
    "--trainer.strategy": "`grid.strategies` (and `grid.bucket_sizes_mb`, `grid.engine_settings`)",
    "--trainer.devices": "`run.devices`",
    "--trainer.num_nodes": "`run.devices`",
    "--trainer.accelerator": "`run.accelerator`",
    "--trainer.precision": "`grid.precisions`",
    "--trainer.max_steps": "`run.warmup_steps` and `run.steps`",
    "--trainer.logger": "`output.out_dir` (each cell repeat logs to runs/<cell id>/r<k>)",
    "--data.batch_size": "`grid.batch_sizes`",
    "--data.seq_len": "`grid.context_lengths`",
    "--model.context_length": "`grid.context_lengths`",
    "--model.preset": "`workload.preset`",
    "--timer.warmup_steps": "`run.warmup_steps`",
    "--timer.every_n_steps": "`run.steps` (the sweep measures every step)",
}
"""CLI arguments the sweep sets for every cell, and the sweep field that controls each."""


@dataclass
class GridConfig:
    """The axes of the sweep; every combination is one cell (``bucket_sizes_mb`` multiplies only the algorithms
    that have a bucket size, e.g. ``bucketed_ddp``)."""

    strategies: list[str] = field(default_factory=lambda: [
        *(entry.name for entry in catalogue.STRATEGIES.values() if entry.is_engine and entry.exact), DDP_BASELINE])
    """Strategies to compare (catalogue names); ``ddp`` and the one-process ``reference`` are always added."""
    batch_sizes: list[int] = field(default_factory=lambda: [2, 4])
    """Per-rank batch sizes (``--data.batch_size``); the global batch is this times the number of ranks."""
    context_lengths: list[int] = field(default_factory=lambda: [64, 128])
    """Sequence lengths (``--model.context_length`` and ``--data.seq_len``)."""
    bucket_sizes_mb: list[BucketSize] = field(default_factory=lambda: [0.25, 1.0, 4.0, 16.0, "auto"])
    """Bucket caps in MiB for the algorithms with buckets; with ``auto`` the strategy picks one (``bucket_model``)."""
    precisions: list[str] = field(default_factory=lambda: ["32-true"])
    """Lightning precisions, e.g. ``32-true`` (fp32) and ``bf16-mixed``."""
    engine_settings: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    """Per engine, setting -> values (``{bucketed_powersgd_ddp: {rank: [1, 4]}}``); each combination is a variant."""

    def __post_init__(self) -> None:
        """Refuses an empty axis, an unknown strategy or precision, a batch or context below 1, a bucket size
        neither > 0 nor ``auto``, and a bucketed strategy without sizes; then de-duplicates every axis in place (order
        kept) and checks each engine's settings."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        axes = (("strategies", "strategy", catalogue.names()), ("precisions", "precision", PRECISIONS),
                ("batch_sizes", "", ()), ("context_lengths", "", ()))  # known values; the last two: integers >= 1
        for axis, one, known in axes:
            values, choices = getattr(self, axis), ", ".join(known)
            if not values:
                hint = f" of {choices}" if known else f", e.g. `--grid.{axis} [2]`"
                raise ValueError(f"the sweep has no cells: `{axis}` is empty; list at least one{hint}")
            # `reference` and `ddp` are always added; listing them is allowed and changes nothing.
            unknown = [value for value in values if value not in known and value != REFERENCE]
            if known and unknown:
                raise ValueError(f"unknown {one} {unknown[0]!r} in `grid.{axis}`; choose from {choices}")
            bad = [v for v in values if not (isinstance(v, int) and v >= 1)]
            if not known and bad:
                raise ValueError(f"`grid.{axis}` must hold integers >= 1, got {bad[0]!r}")
        for size in self.bucket_sizes_mb:
            if size != "auto" and not size > 0:  # check_field_types refused any other text
                raise ValueError(f"`grid.bucket_sizes_mb` takes sizes > 0 (MiB) or `auto`, got {size!r}")
        bucketed = [s for s in self.strategies if has_bucket_axis(s)]
        if bucketed and not self.bucket_sizes_mb:
            raise ValueError(
                f"`{bucketed[0]}` is in `grid.strategies` but `grid.bucket_sizes_mb` is empty; list at least one size, "
                f"e.g. `--grid.bucket_sizes_mb [1,auto]`, or remove `{bucketed[0]}`"
            )
        for axis in ("strategies", "batch_sizes", "context_lengths", "precisions", "bucket_sizes_mb"):
            setattr(self, axis, list(dict.fromkeys(getattr(self, axis))))  # de-duplicate, keep the order
        self.engine_settings = {algorithm: _check_settings(algorithm, settings)
                                for algorithm, settings in self.engine_settings.items()}


def _check_settings(name: str, settings: Any) -> dict[str, list[Any]]:
    """One ``grid.engine_settings`` entry, every combination checked by its engine, values de-duplicated."""
    where = f"`grid.engine_settings.{name}`"
    engines = catalogue.names(engines_only=True)
    if name not in engines:
        raise ValueError(f"{where}: {name!r} is not one of our engines (the others have no engine settings here); "
                         f"choose from {', '.join(engines)}")
    if not isinstance(settings, dict) or not settings:
        raise ValueError(f"{where} must map setting names to lists of values, e.g. `{{rank: [1, 4]}}`; got "
                         f"{settings!r}")
    for setting, values in settings.items():
        if not isinstance(values, list) or not values:
            raise ValueError(
                f"{where}.{setting} must be a non-empty list of values, e.g. `{setting}: [1, 4]`; got {values!r}")
    try:
        for combination in setting_combinations(settings):
            catalogue.get(name).check_settings(combination)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    return {setting: _unique(values) for setting, values in settings.items()}


def _unique(values: list[Any]) -> list[Any]:
    """``values`` without repeats (not dict.fromkeys: 1 and 1.0 and True are equal keys, but distinct settings)."""
    return [v for i, v in enumerate(values) if not any(type(v) is type(seen) and v == seen for seen in values[:i])]


@dataclass
class WorkloadConfig:
    """What each cell trains: a CLI config plus a few overrides (the grid's axes always win)."""

    base_config: str = "configs/quickstart.yaml"
    """The fit config every cell starts from (relative to the current directory); the sweep sets its axes on top."""
    preset: Optional[str] = "tiny"
    """Model preset (``--model.preset``: tiny, small, medium, large, xl, 2.7b); null keeps the base config's."""
    cli_args: list[str] = field(default_factory=list)
    """Extra CLI arguments for every cell, placed before the sweep's own, e.g. ``["--data.vocab_size", "32000"]``."""

    def __post_init__(self) -> None:
        """Refuses an empty ``base_config`` and a ``cli_args`` flag the sweep sets per cell (``SWEEP_OWNED_ARGS``)."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        if not self.base_config:
            raise ValueError("`workload.base_config` is empty; point it at a CLI config, e.g. configs/quickstart.yaml")
        for arg in self.cli_args:
            key = arg.split("=", 1)[0]
            for owned, field_name in SWEEP_OWNED_ARGS.items():
                if key == owned or key.startswith(owned + "."):
                    raise ValueError(
                        f"`{key}` in `workload.cli_args` is set by the sweep for every cell; use {field_name} instead"
                    )


@dataclass
class RunConfig:
    """How each cell runs: where, on how many ranks, for how many steps, for how long at most."""

    accelerator: Literal["cpu", "cuda"] = "cpu"
    """``--trainer.accelerator``."""
    devices: int = 2
    """Ranks (processes) of the data-parallel cells; the reference always runs on one."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: gloo on CPU, nccl with a GPU per rank, else gloo (NCCL refuses two ranks on one GPU)."""
    launcher: Literal["ranks", "lightning"] = "ranks"
    """``ranks``: every rank at once, like torchrun (ranks can share a GPU); ``lightning``: Lightning starts them."""
    warmup_steps: int = 3
    """Optimizer steps run first and left out of the statistics (``--timer.warmup_steps``)."""
    steps: int = 10
    """Measured optimizer steps per cell; each cell runs ``warmup_steps + steps`` (``--trainer.max_steps``)."""
    timeout_s: float = 600.0
    """Wall-clock limit per cell, start-up included; a cell past it is killed and gets status ``timeout``."""
    threads_per_rank: Optional[int] = None
    """``OMP_NUM_THREADS`` of every process; default on CPU cores // devices, unset on CUDA."""
    predict_bucket_size: bool = True
    """Run the all-reduce microbenchmark first: the report puts the predicted best bucket size by the measured one."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every cell, e.g. ``{PYTORCH_CUDA_ALLOC_CONF: "expandable_segments:True"}``."""
    repeats: int = 5
    """Runs of each cell, interleaved round-robin; the best bucket size is chosen on even, measured on odd (>= 2)."""
    busy_threshold: float = 0.2
    """Load guard: before each repeat, wait while more than this fraction of all CPUs is busy (/proc/stat)."""
    max_wait_s: float = 300.0
    """Load guard: longest wait for an idle machine; past it the repeat starts on a busy machine (``busy``)."""
    load_sample_s: float = 1.0
    """Seconds per CPU-usage sample; 0 turns the guard off (as does a missing /proc/stat)."""

    def __post_init__(self) -> None:
        """Refuses fewer than 2 devices, nccl on CPU, and any count or time out of its range, naming the field."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        checks = (
            (self.devices >= 2, f"`run.devices` must be >= 2 for data-parallel cells, got {self.devices}; the "
                                "1-process compute-only reference is added to the grid automatically"),
            (self.accelerator != "cpu" or self.backend != "nccl",
             "`run.backend: nccl` needs CUDA; use `run.backend: gloo` (or `auto`) with `run.accelerator: cpu`"),
            (self.warmup_steps >= 0, f"`run.warmup_steps` must be >= 0, got {self.warmup_steps}"),
            (self.steps >= 1, f"`run.steps` must be >= 1 (the measured steps), got {self.steps}"),
            (self.timeout_s > 0, f"`run.timeout_s` must be > 0 seconds, got {self.timeout_s}"),
            (self.threads_per_rank is None or self.threads_per_rank >= 1,
             f"`run.threads_per_rank` must be >= 1 or null (automatic), got {self.threads_per_rank}"),
            (self.repeats >= 1,
             f"`run.repeats` must be an integer >= 1, got {self.repeats!r}; use at least 2 (e.g. `--run.repeats 6`) "
             "so that the best bucket size can be chosen and measured on different repeats"),
            (0.0 <= self.busy_threshold <= 1.0,
             f"`run.busy_threshold` is a fraction of all CPUs between 0 and 1, got {self.busy_threshold}; "
             "e.g. `--run.busy_threshold 0.2` (1.0 never waits)"),
            (self.max_wait_s >= 0,
             f"`run.max_wait_s` must be >= 0 seconds, got {self.max_wait_s}; 0 records the load without waiting"),
            (self.load_sample_s >= 0,
             f"`run.load_sample_s` must be >= 0 seconds, got {self.load_sample_s}; 0 turns the load guard off"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class OutputConfig:
    """Where results go and what a rerun does."""

    out_dir: str = "logs/bench"
    """Where every file and runs/<cell id>/r<k>/ go (logs/ is git-ignored; committed results name their folder:
    ``--output.out_dir benchmarks/results/cpu``)."""
    retry_failed: bool = False
    """Rerun cell repeats whose repeats.csv row has status oom, failed or timeout (by default none is rerun)."""
    report_only: bool = False
    """Run nothing: rebuild results.csv, results.md and the plots from the raw data, steps.csv and repeats.csv."""
    plots: bool = True
    """Write the PNG plots."""
    bootstrap_samples: int = 2000
    """Draws of the hierarchical bootstrap behind every 95 % interval (``lightning_ddp.bench.stats``)."""
    seed: int = 0
    """Seed of the bootstrap: the same raw data and seed give the same intervals and verdicts."""

    def __post_init__(self) -> None:
        """Refuses fewer than 100 bootstrap draws."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        if self.bootstrap_samples < 100:
            raise ValueError(
                f"`output.bootstrap_samples` must be an integer >= 100 (the 2.5th and 97.5th percentiles of fewer "
                f"draws are mostly noise), got {self.bootstrap_samples!r}; the default is 2000"
            )


@dataclass
class SweepConfig:
    """A benchmark sweep, one subprocess per cell, resumable: ``python -m lightning_ddp.bench --config FILE``."""

    name: str = "sweep"
    """Title of results.md."""
    grid: GridConfig = field(default_factory=GridConfig)
    """The cells: strategies, bucket sizes, engine settings, batch sizes, contexts, precisions."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """What every cell trains: the fit's config file, preset and extra CLI arguments."""
    run: RunConfig = field(default_factory=RunConfig)
    """How each cell runs: devices, accelerator, backend, steps, repeats, timeouts, load guard."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Where results go, whether a call resumes, retries or only reports, plots, the bootstrap."""

    def __post_init__(self) -> None:
        check_field_types(self)  # the sections checked themselves


# ---- the cells ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One point of the grid: one training run in its own process(es). ``id`` (readable slug + config hash) names
    its rows and run directories; ``strategy`` is a catalogue name or ``reference``; ``bucket_size_mb`` is ``None``
    unless the strategy has one; ``engine_settings`` are ``(name, value)`` pairs in the config's order."""

    id: str
    strategy: str
    batch_size: int
    """Sequences per rank (``--data.batch_size``)."""
    context_length: int
    """Tokens per sequence: the model's context and the data's sequence length."""
    precision: str
    """Lightning's ``trainer.precision`` (``PRECISIONS``)."""
    bucket_size_mb: float | str | None
    world_size: int
    """Ranks of the run; 1 for ``reference``."""
    engine_settings: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """Short human description, e.g. ``bucketed_powersgd_ddp 4 MiB rank=4 | batch 2 | ctx 64 | 32-true``."""
        name = variant_label(self.strategy, self.bucket_size_mb, format_settings(dict(self.engine_settings)))
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
    """The cells, per (precision, batch, context) group: the reference, then each strategy (``ddp`` added) times its
    bucket sizes and its ``grid.engine_settings`` combinations."""
    grid = config.grid
    listed = [s for s in grid.strategies if s != REFERENCE]
    if DDP_BASELINE not in listed:
        listed.append(DDP_BASELINE)
    # the sweep settings that change what a cell measures (not: out_dir, timeout, launcher, repeats, load guard,
    # report options); json.dumps sorts every dict's keys, so the hash does not depend on their order
    measured = ("accelerator", "devices", "backend", "warmup_steps", "steps", "threads_per_rank", "env")
    fingerprint = {"workload": asdict(config.workload), **{name: getattr(config.run, name) for name in measured}}
    # every combination of a strategy's engine_settings values, the first setting varying slowest
    variants: list[tuple[str, float | str | None, dict[str, Any]]] = [(REFERENCE, None, {})]
    for strategy in listed:
        sizes = grid.bucket_sizes_mb if has_bucket_axis(strategy) else [None]
        for size in sizes:
            for settings in setting_combinations(grid.engine_settings.get(strategy)):
                variants.append((strategy, size, settings))
    cells = []
    for precision, batch_size, context_length in product(grid.precisions, grid.batch_sizes, grid.context_lengths):
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
