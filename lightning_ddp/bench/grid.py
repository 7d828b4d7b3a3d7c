"""From a ``SweepConfig`` to cells, and from a cell to the processes that run it (pure functions).

Recipe:

1. ``expand_grid``: for each precision, batch size and context length (a *group*, the unit the report
   compares within), one cell per strategy, one per bucket size for an algorithm with buckets (``bucketed``
   ...), times one per combination of the algorithm's ``grid.engine_settings`` (e.g. PowerSGD's ``rank``), plus
   Lightning's ``ddp`` and the 1-process ``reference`` whether listed or not. The reference comes first in each group (its step
   time is the floor the others are compared to), ``ddp`` last unless listed elsewhere.
2. ``cell_id``: a readable slug plus a hash of everything that changes what the cell measures (its grid
   coordinates, the workload, devices, backend, steps, threads, extra environment). The same config gives the
   same ids, so a rerun can skip finished cell repeats; changing e.g. ``run.steps`` gives new ids and reruns
   them. ``run.repeats`` and the load guard are not in the hash: raising the repeats runs only the new ones.
3. ``rank_layout``: how the ranks map onto the machine (backend, devices per node, nodes, GPU per rank).
4. ``cell_command`` and ``rank_environments``: the ``python -m lightning_ddp fit`` command line of a cell and
   the environment of each of its processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ddp.bench.config import (
    BASELINE,
    FSDP2,
    REFERENCE,
    SHARDED,
    SweepConfig,
    format_bucket,
    format_settings,
    has_bucket_axis,
    settings_slug,
    variant_label,
)

__all__ = [
    "Cell",
    "LOOPBACK_INTERFACE",
    "RankLayout",
    "cell_command",
    "cell_id",
    "every_rank_environment",
    "expand_grid",
    "rank_environments",
    "rank_layout",
    "without_launcher_variables",
]

# Variables by which launchers (torchrun, SLURM, MPI, LSF) tell a process its rank. A cell is its own
# single-machine job: inheriting the sweep's own values would make Lightning pick the wrong cluster environment.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "NODE_RANK",
                       "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "LSB_", "JSM_")

LOOPBACK_INTERFACE = "lo0" if sys.platform == "darwin" else "lo"
"""The loopback network interface's name, which the cells' gloo uses (``GLOO_SOCKET_IFNAME``) unless told otherwise."""


@dataclass(frozen=True)
class Cell:
    """One point of the grid: one training run in its own process(es)."""

    id: str
    """Stable identifier (readable slug + config hash); names the rows and the run directories (``runs/<id>/r<k>/``)."""
    strategy: str
    """A registered algorithm's name, ``ddp`` or ``reference``."""
    batch_size: int
    """Per-rank batch size."""
    context_length: int
    """Sequence length."""
    precision: str
    """Lightning precision."""
    bucket_size_mb: float | str | None
    """Bucket cap in MiB or ``"auto"``; ``None`` unless the strategy has a bucket size."""
    world_size: int
    """Ranks: ``run.devices``, or 1 for the reference."""
    engine_settings: tuple[tuple[str, Any], ...] = ()
    """The algorithm's engine settings this cell sets (``grid.engine_settings``), as ``(name, value)`` pairs in the
    config's order; empty: the engine's defaults."""

    @property
    def settings(self) -> dict[str, Any]:
        """``engine_settings`` as a dict, e.g. ``{"rank": 4}``."""
        return dict(self.engine_settings)

    @property
    def group(self) -> tuple[str, int, int]:
        """``(precision, batch_size, context_length)``: the cells the report compares with each other."""
        return (self.precision, self.batch_size, self.context_length)

    @property
    def label(self) -> str:
        """Short human description, e.g. ``bucketed_powersgd 4 MiB rank=4 | batch 2 | ctx 64 | 32-true``."""
        name = variant_label(self.strategy, self.bucket_size_mb, format_settings(self.settings))
        return f"{name} | batch {self.batch_size} | ctx {self.context_length} | {self.precision}"


def cell_id(coordinates: dict[str, Any], fingerprint: dict[str, Any]) -> str:
    """``<strategy>[-<bucket>mb][-<setting><value>...]-b<batch>-t<ctx>-<precision>-<8 hex>``; the hash covers both
    dicts (``coordinates["engine_settings"]``, if present, included: a changed setting is a new cell).

    >>> cell_id({"strategy": "bucketed", "bucket_size_mb": 4.0, "batch_size": 2, "context_length": 64,
    ...          "precision": "32-true", "world_size": 2}, {})[:-9]
    'bucketed-4mb-b2-t64-32-true'
    >>> cell_id({"strategy": "bucketed_powersgd", "bucket_size_mb": 4.0, "engine_settings": {"rank": 4},
    ...          "batch_size": 2, "context_length": 64, "precision": "32-true", "world_size": 2}, {})[:-9]
    'bucketed_powersgd-4mb-rank4-b2-t64-32-true'
    """
    canonical = json.dumps({"cell": coordinates, "sweep": fingerprint}, sort_keys=True, default=str)
    digest = hashlib.sha1(canonical.encode()).hexdigest()[:8]
    bucket = coordinates.get("bucket_size_mb")
    slug = coordinates["strategy"] + (f"-{format_bucket(bucket)}mb" if bucket not in (None, "auto") else "")
    slug += "-auto" if bucket == "auto" else ""
    slug += settings_slug(coordinates.get("engine_settings") or {})
    slug += f"-b{coordinates['batch_size']}-t{coordinates['context_length']}-{coordinates['precision']}"
    return f"{slug}-{digest}"


def _fingerprint(config: SweepConfig) -> dict[str, Any]:
    """The sweep settings that change what a cell measures (not: out_dir, timeout, launcher, repeats, load guard,
    report options)."""
    run = config.run
    return {
        "workload": dataclasses.asdict(config.workload),
        "accelerator": run.accelerator,
        "devices": run.devices,
        "backend": run.backend,
        "warmup_steps": run.warmup_steps,
        "steps": run.steps,
        "threads_per_rank": run.threads_per_rank,
        "env": dict(sorted(run.env.items())),
    }


def expand_grid(config: SweepConfig) -> list[Cell]:
    """Every cell of the sweep, grouped by (precision, batch size, context length); see the module docstring.

    Per group: ``1`` reference + one cell per listed strategy without buckets (``ddp`` added if missing) +
    ``len(bucket_sizes_mb)`` cells per listed algorithm with buckets; each algorithm's cells times the combinations
    of its ``grid.engine_settings`` (bucket size varying slowest).

    A cell without engine settings hashes exactly as before they existed, so adding the axis to the config of a
    finished sweep reruns only the new cells.
    """
    grid = config.grid
    listed = [s for s in grid.strategies if s != REFERENCE]
    if BASELINE not in listed:
        listed.append(BASELINE)
    fingerprint = _fingerprint(config)
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


@dataclass(frozen=True)
class RankLayout:
    """How the data-parallel ranks of a cell sit on the machine."""

    backend: str
    """``gloo`` or ``nccl``."""
    devices_per_node: int
    """``--trainer.devices``."""
    num_nodes: int
    """``--trainer.num_nodes``; > 1 only when ranks share GPUs (each rank is then a 'node' of one GPU)."""
    gpu_of_rank: tuple[str, ...] | None = None
    """``CUDA_VISIBLE_DEVICES`` of each rank when ranks share GPUs, else ``None``."""

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes


def rank_layout(config: SweepConfig, gpu_count: int = 0, visible_gpus: str | None = None) -> RankLayout:
    """Pick the backend and the rank placement (``run.backend: auto`` resolved here).

    - CPU: gloo, ``devices`` ranks on one node.
    - CUDA with a GPU per rank: nccl (or gloo if asked), rank ``r`` on GPU ``r``.
    - CUDA with fewer GPUs than ranks: NCCL refuses two ranks on one GPU, so gloo with CUDA tensors. Lightning
      also refuses a GPU listed twice in ``devices``, so each rank runs as a "node" of one device
      (``--trainer.num_nodes devices --trainer.devices 1``, ``NODE_RANK = rank``, ``LOCAL_RANK = 0``) and sees one
      GPU (``CUDA_VISIBLE_DEVICES``), GPUs assigned round-robin. Needs ``run.launcher: ranks``.

    Args:
        config: The sweep.
        gpu_count: GPUs visible to the sweep (``torch.cuda.device_count()``).
        visible_gpus: The sweep's ``CUDA_VISIBLE_DEVICES``, if set (so sharing maps onto those GPUs).
    """
    run = config.run
    if run.accelerator == "cpu":
        return RankLayout("gloo", run.devices, 1)
    if gpu_count < 1:
        raise ValueError("`run.accelerator: cuda` but no GPU is visible; use `run.accelerator: cpu` on this machine")
    if gpu_count >= run.devices:
        return RankLayout("nccl" if run.backend in ("auto", "nccl") else "gloo", run.devices, 1)
    if run.backend == "nccl":
        raise ValueError(
            f"`run.backend: nccl` with {run.devices} ranks on {gpu_count} GPU(s): NCCL refuses two ranks on one GPU; "
            "use `run.backend: auto` (gloo with CUDA tensors) or `run.devices` <= the number of GPUs"
        )
    if run.launcher != "ranks":
        raise ValueError(
            f"{run.devices} ranks on {gpu_count} GPU(s) need `run.launcher: ranks` (Lightning's launcher puts one rank "
            "on each GPU and refuses to reuse one)"
        )
    ids = [g.strip() for g in visible_gpus.split(",")] if visible_gpus else [str(i) for i in range(gpu_count)]
    ids = ids[:gpu_count]
    return RankLayout("gloo", 1, run.devices, tuple(ids[r % len(ids)] for r in range(run.devices)))


def strategy_argument(cell: Cell, backend: str) -> str:
    """The value of ``--trainer.strategy``: ``auto`` for the reference, else a class path with its arguments."""
    if cell.strategy == REFERENCE:
        return "auto"
    if cell.strategy == BASELINE:
        return json.dumps({"class_path": "lightning.pytorch.strategies.DDPStrategy",
                           "init_args": {"process_group_backend": backend}})
    if cell.strategy in SHARDED:
        return _sharded_strategy_argument(cell, backend)
    if cell.strategy == FSDP2:
        return json.dumps({"class_path": "lightning_ddp.strategies.FSDP2Strategy",
                           "init_args": {"process_group_backend": backend}})
    # bucket_size_mb always, "default" where the algorithm has none: a bucket size in the base config's strategy
    # (the quickstart's bucketed one) would otherwise be carried over to this class.
    init_args: dict[str, Any] = {"algorithm": cell.strategy, "process_group_backend": backend,
                                 "bucket_size_mb": "default" if cell.bucket_size_mb is None else cell.bucket_size_mb}
    # The engine settings only where the cell sets some (`grid.engine_settings`), so a cell of an algorithm
    # without settings runs the same command as before they existed. (A base config whose strategy sets
    # engine_settings itself would carry them over to a cell that sets none: keep them out of the base config.)
    if cell.engine_settings:
        init_args["engine_settings"] = cell.settings
    return json.dumps({"class_path": "lightning_ddp.strategies.GradSyncStrategy", "init_args": init_args})


def _sharded_strategy_argument(cell: Cell, backend: str) -> str:
    """``zero1`` (``zero1_ddp``, its default ``reduce_scatter`` schedule) or ``zero2`` (``zero2_ddp``, with the cell's
    bucket size), as class paths, like the algorithms' cells."""
    if cell.strategy == "zero1":
        return json.dumps({"class_path": "lightning_ddp.strategies.ZeRO1DDPStrategy",
                           "init_args": {"schedule": "reduce_scatter", "process_group_backend": backend}})
    return json.dumps({"class_path": "lightning_ddp.strategies.ZeRO2DDPStrategy",
                       "init_args": {"bucket_size_mb": cell.bucket_size_mb, "process_group_backend": backend}})


def cell_command(cell: Cell, config: SweepConfig, layout: RankLayout, run_dir: Path) -> list[str]:
    """``python -m lightning_ddp fit ...`` for this cell (every process of the cell runs the same command)."""
    run, workload = config.run, config.workload
    reference = cell.strategy == REFERENCE
    logger = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        # name "" and version "": the log dir is save_dir itself, so timing_summary.json lands in runs/<cell id>/r<k>/
        "init_args": {"save_dir": str(run_dir), "name": "", "version": ""},
    }
    args = [sys.executable, "-m", "lightning_ddp", "fit", "--config", workload.base_config, *workload.cli_args]
    if workload.preset is not None:
        args += ["--model.preset", workload.preset]
    args += [
        "--model.context_length", str(cell.context_length),
        "--data.seq_len", str(cell.context_length),
        "--data.batch_size", str(cell.batch_size),
        "--trainer.accelerator", run.accelerator,
        "--trainer.devices", "1" if reference else str(layout.devices_per_node),
        "--trainer.num_nodes", "1" if reference else str(layout.num_nodes),
        "--trainer.strategy", strategy_argument(cell, layout.backend),
        "--trainer.precision", cell.precision,
        "--trainer.max_steps", str(run.warmup_steps + run.steps),
        "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger", json.dumps(logger),
        "--timer.enabled", "true",
        "--timer.every_n_steps", "1",  # every step measured: the statistics are over steps
        "--timer.warmup_steps", str(run.warmup_steps),
    ]
    return args


def threads_per_rank(config: SweepConfig, cpu_count: int | None = None) -> int | None:
    """``run.threads_per_rank``, or on CPU ``cores // devices`` (what Lightning's DDP sets), or ``None`` on CUDA."""
    if config.run.threads_per_rank is not None:
        return config.run.threads_per_rank
    if config.run.accelerator != "cpu":
        return None
    return max(1, (cpu_count or os.cpu_count() or 1) // config.run.devices)


def without_launcher_variables(parent: dict[str, str] | None = None) -> dict[str, str]:
    """``parent`` (default: this process's environment) without the variables launchers tell ranks by, so that a
    job started from inside another (a sweep under SLURM, a study under torchrun) is its own single-machine job."""
    parent = dict(os.environ if parent is None else parent)
    return {k: v for k, v in parent.items() if k not in _LAUNCHER_VARIABLES and not k.startswith(_LAUNCHER_PREFIXES)}


def base_environment(config: SweepConfig, parent: dict[str, str] | None = None) -> dict[str, str]:
    """The sweep's environment without launcher variables, plus ``run.env``, unbuffered output, the threads and
    ``GLOO_SOCKET_IFNAME`` = the loopback interface (unless set)."""
    env = without_launcher_variables(parent)
    env["PYTHONUNBUFFERED"] = "1"  # logs stream to the rank files as they happen (the reason of a crash survives)
    threads = threads_per_rank(config)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)  # Lightning keeps an OMP_NUM_THREADS that is already set
    # Every rank of a cell runs on this host (MASTER_ADDR 127.0.0.1): left to itself, gloo binds to the interface
    # of the host name, which on an isolated host or in a container may not route back to it. A value the user
    # set (in the sweep's environment or in run.env) is kept.
    env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    env.update(config.run.env)
    return env


def rank_environments(
    cell: Cell, config: SweepConfig, layout: RankLayout, port: int, parent: dict[str, str] | None = None
) -> list[dict[str, str]]:
    """One environment per process to start for this cell.

    The reference: one process, no launcher variables (Lightning runs it on one device). ``launcher: lightning``:
    one process; Lightning starts the other ranks itself. ``launcher: ranks``: every rank, with the variables
    Lightning's own launcher would have given it (so Lightning sees processes created externally).
    """
    if cell.strategy == REFERENCE or config.run.launcher == "lightning":
        env = base_environment(config, parent)
        if cell.strategy == REFERENCE and layout.gpu_of_rank:
            env["CUDA_VISIBLE_DEVICES"] = layout.gpu_of_rank[0]
        return [env]
    return every_rank_environment(config, layout, port, parent)


def every_rank_environment(
    config: SweepConfig, layout: RankLayout, port: int, parent: dict[str, str] | None = None
) -> list[dict[str, str]]:
    """The environment of each of ``layout.world_size`` ranks started at once (``launcher: ranks``)."""
    env = base_environment(config, parent)
    envs = []
    for rank in range(layout.world_size):
        node_rank, local_rank = divmod(rank, layout.devices_per_node)
        rank_env = dict(env)
        rank_env.update({
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(layout.world_size),
            "NODE_RANK": str(node_rank),
            "LOCAL_RANK": str(local_rank),
            "RANK": str(rank),  # read by Lightning's rank_zero_only before the strategy sets the rank
        })
        if layout.gpu_of_rank:
            rank_env["CUDA_VISIBLE_DEVICES"] = layout.gpu_of_rank[rank]
        envs.append(rank_env)
    return envs
