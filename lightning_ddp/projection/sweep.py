"""The projection grid: every strategy x world size (x bucket size, x engine settings), and the best bucket sizes."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from lightning_ddp import catalogue
from lightning_ddp.profile import ComputeProfile
from lightning_ddp.projection.comm import CommCost
from lightning_ddp.projection.memory import state_bytes
from lightning_ddp.projection.simulators import (
    StepModel,
    StepResult,
    check_settings,
    simulate,
    simulator,
)

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
    """Simulate every strategy at every world size, bucket size (those with one) and combination of
    ``engine_settings[strategy]`` (``{setting: [values]}``)."""
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
    """``(StepResult.variant, world size) -> result`` with the shortest step over bucket sizes."""
    best: dict[tuple[str, int], StepResult] = {}
    for r in results:
        key = (r.variant, r.world_size)
        if key not in best or r.step_ms < best[key].step_ms:
            best[key] = r
    return best


def result_row(result: StepResult, nodes: int = 1, best: bool = False) -> dict[str, Any]:
    """One CSV row (``COLUMNS``): times rounded to 4 decimals, shares to 5."""
    row = {column: round(getattr(result, column), 5 if column in ("comm_share", "overlap") else 4)
           for column in COLUMNS if column.endswith("_ms") or column in ("comm_share", "overlap")}
    return {
        **row,
        "strategy": result.strategy,
        "bucket_size_mb": "" if result.bucket_size_mb is None else f"{result.bucket_size_mb:g}",
        "engine_settings": catalogue.format_settings(result.settings),
        "world_size": result.world_size,
        "nodes": nodes,
        "calls": result.calls,
        "comm_bytes": result.comm_bytes,
        "best_bucket": "true" if best and result.bucket_size_mb is not None else "",
        "memory_gb": "" if result.memory_bytes is None else round(result.memory_bytes / 1e9, 4),
    }
