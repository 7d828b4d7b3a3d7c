"""The projection grid: every strategy x world size (x bucket size, x engine settings), and the best bucket sizes.

``project`` simulates one compute profile on one fabric; ``best_by_world_size`` picks the bucket size with the
shortest step per variant and world size; ``result_row`` flattens a result into ``COLUMNS``; ``predict_cells``
predicts measured compute profiles on a measured fit (the model against this project's sweep).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Literal, Mapping, Optional, Sequence

from lightning_ddp import catalogue
from lightning_ddp.profile import ComputeProfile, read_profile
from lightning_ddp.projection.comm import CommCost, Fabric, MeasuredFit, read_fit
from lightning_ddp.projection.memory import state_bytes
from lightning_ddp.projection.simulators import (
    StepModel,
    StepResult,
    check_settings,
    simulate,
    simulate_bucketed,
    simulate_ddp,
    simulate_flat,
    simulate_naive,
    simulate_overlap,
    simulated_by,
    simulator,
)

__all__ = ["COLUMNS", "best_by_world_size", "predict_cells", "project", "result_row"]

COLUMNS: tuple[str, ...] = (
    "strategy", "bucket_size_mb", "engine_settings", "world_size", "nodes", "step_ms", "compute_only_ms",
    "exposed_comm_ms", "comm_share",
    "busy_comm_ms", "overlap", "copy_ms", "calls", "comm_bytes", "best_bucket", "contention_ms", "memory_gb",
)
"""results.csv columns (docs/projection.md defines each)."""


def project(profile: ComputeProfile, comm: CommCost, strategies: Sequence[str], world_sizes: Sequence[int],
            bucket_sizes_mb: Sequence[float], copy_bandwidth_Bps: float,
            engine_settings: Mapping[str, Mapping[str, Sequence[Any]]] | None = None,
            flops_per_s: Optional[float] = None, contention: float = 0.0) -> list[StepResult]:
    """Simulate every strategy at every world size (and every bucket size for those that take one, and every
    combination of ``engine_settings[strategy]``, ``{setting: [values]}``, for those given some).

    ``flops_per_s``: the compute stream's arithmetic throughput (``StepModel.flops_per_s``); ``contention``:
    compute slowed by ``1 + contention`` while a collective runs (``StepModel.contention``)."""
    engine_settings = engine_settings or {}
    for name in strategies:
        simulator(name)  # an unknown or unmodelled name fails before anything is simulated
        for settings in catalogue.setting_combinations(engine_settings.get(name)):
            check_settings(name, settings)
    results = []
    for n in world_sizes:
        model = StepModel(profile, comm, n, copy_bandwidth_Bps, flops_per_s, contention)
        for name in strategies:
            sizes: Iterable[Optional[float]] = bucket_sizes_mb if catalogue.get(name).has_bucket_size else [None]
            for size in sizes:
                for settings in catalogue.setting_combinations(engine_settings.get(name)):
                    result = simulate(name, model, size, **settings)
                    result.memory_bytes = state_bytes(result, model)
                    results.append(result)
    return results


def best_by_world_size(results: Iterable[StepResult]) -> dict[tuple[str, int], StepResult]:
    """``(variant, world size) -> result`` with the shortest step (over bucket sizes; the only one otherwise); the
    variant is the strategy with its settings (``StepResult.variant``: ``bucketed_powersgd rank=4``)."""
    best: dict[tuple[str, int], StepResult] = {}
    for r in results:
        key = (r.variant, r.world_size)
        if key not in best or r.step_ms < best[key].step_ms:
            best[key] = r
    return best


def result_row(result: StepResult, nodes: int = 1, best: bool = False) -> dict[str, Any]:
    """One CSV row (``COLUMNS``)."""
    return {
        "strategy": result.strategy,
        "bucket_size_mb": "" if result.bucket_size_mb is None else f"{result.bucket_size_mb:g}",
        "engine_settings": catalogue.format_settings(result.settings),
        "world_size": result.world_size,
        "nodes": nodes,
        "step_ms": round(result.step_ms, 4),
        "compute_only_ms": round(result.compute_only_ms, 4),
        "exposed_comm_ms": round(result.exposed_comm_ms, 4),
        "comm_share": round(result.comm_share, 5),
        "busy_comm_ms": round(result.busy_comm_ms, 4),
        "overlap": round(result.overlap, 5),
        "copy_ms": round(result.copy_ms, 4),
        "calls": result.calls,
        "comm_bytes": result.comm_bytes,
        "best_bucket": "true" if best and result.bucket_size_mb is not None else "",
        "contention_ms": round(result.contention_ms, 4),
        "memory_gb": "" if result.memory_bytes is None else round(result.memory_bytes / 1e9, 4),
    }


def predict_cells(
    profiles: Iterable[ComputeProfile | str | os.PathLike],
    fit: MeasuredFit | Fabric | str | os.PathLike,
    strategies: Optional[Sequence[str]] = None,
    bucket_sizes_mb: Sequence[float] = (0.25, 1.0, 4.0, 16.0),
    world_size: Optional[int] = None,
    copy_bandwidth_Bps: float = 10e9,
    overhead_scaling: Literal["per_hop", "per_call"] = "per_hop",
) -> list[dict[str, Any]]:
    """Predicted step time and share per strategy for measured compute profiles (e.g. the sweep's cells).

    Args:
        profiles: ``ComputeProfile`` objects or paths to profile JSON files.
        fit: The all-reduce fit (a ``MeasuredFit``, or a path to its JSON), or any ``Fabric``.
        strategies: Catalogue names; default: naive, flat, overlap, bucketed and torch DDP.
        world_size: Default: each profile's ``world_size`` (2 if it has none).
        copy_bandwidth_Bps: Bytes read + written per second by buffer copies (10 GB/s: a guess for a 2-core CPU).

    Returns:
        One dict per profile x strategy (x bucket size): the profile's descriptive fields plus ``result_row``'s.
    """
    if isinstance(fit, (str, os.PathLike)):
        fit = read_fit(fit)
    comm = fit.fabric(overhead_scaling) if isinstance(fit, MeasuredFit) else fit
    if strategies is None:
        strategies = simulated_by(simulate_naive, simulate_flat, simulate_overlap, simulate_bucketed, simulate_ddp)
    rows = []
    for item in profiles:
        profile = item if isinstance(item, ComputeProfile) else read_profile(item)
        n = world_size or profile.world_size or 2
        for result in project(profile, comm, strategies, [n], bucket_sizes_mb, copy_bandwidth_Bps):
            rows.append({"profile": profile.label, "preset": profile.preset, "batch_size": profile.batch_size,
                         "seq_len": profile.seq_len, "precision": profile.precision, "device": profile.device,
                         **result_row(result)})
    return rows
