"""The projection grid (every strategy x world size x bucket size x engine settings) and, from a ``ProjectionConfig``,
the files in ``output.out_dir`` (docs/projection.md lists them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from lightning_ddp import catalogue
from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.profile import ComputeProfile, read_profile, write_profile
from lightning_ddp.projection.comm import CommCost, Fabric
from lightning_ddp.projection.config import build_fabric, contention_of, copy_bandwidth, gpu_spec
from lightning_ddp.projection.flops import ModelShape, modelled_profile
from lightning_ddp.projection.report import build_markdown, write_plots
from lightning_ddp.projection.simulators import StepModel, StepResult, best_by_world_size, simulate
from lightning_ddp.reporting import variants
from lightning_ddp.reporting.provenance import git_state, invocation, package_version
from lightning_ddp.reporting.tables import csv_text

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
    results = []
    for n in world_sizes:
        model = StepModel(profile=profile, comm=comm, world_size=n, copy_bandwidth_Bps=copy_bandwidth_Bps,
                          flops_per_s=flops_per_s, contention=contention)
        for name in strategies:
            sizes: Iterable[Optional[float]] = bucket_sizes_mb if catalogue.get(name).has_bucket_size else [None]
            for size in sizes:
                for settings in variants.setting_combinations((engine_settings or {}).get(name)):
                    results.append(simulate(name, model, size, **settings))
    return results


def result_row(result: StepResult, nodes: int = 1, best: bool = False) -> dict[str, Any]:
    """One CSV row (``COLUMNS``): times rounded to 4 decimals, shares to 5."""
    row = {}
    for column in COLUMNS:
        if column in ("comm_share", "overlap"):
            row[column] = round(getattr(result, column), 5)
        elif column.endswith("_ms"):
            row[column] = round(getattr(result, column), 4)
    return {
        **row,
        "strategy": result.strategy,
        "bucket_size_mb": "" if result.bucket_size_mb is None else f"{result.bucket_size_mb:g}",
        "engine_settings": variants.format_settings(result.settings),
        "world_size": result.world_size,
        "nodes": nodes,
        "calls": result.calls,
        "comm_bytes": result.comm_bytes,
        "best_bucket": "true" if best and result.bucket_size_mb is not None else "",
        "memory_gb": "" if result.memory_bytes is None else round(result.memory_bytes / 1e9, 4),
    }


def build_profile(compute) -> tuple[ComputeProfile, Optional[float]]:
    """The compute profile a ``ComputeConfig`` describes and its forward + backward FLOP/s (PowerSGD's arithmetic;
    ``None`` for a measured profile, whose FLOPs are not recorded)."""
    if compute.source == "profile":
        return read_profile(compute.profile_path), None
    shape = ModelShape.from_preset(compute.preset)
    profile = modelled_profile(shape, compute.batch_size, compute.seq_len, gpu=gpu_spec(compute), mfu=compute.mfu,
                               precision=compute.precision,
                               optimizer_bytes_per_param=compute.optimizer_bytes_per_param,
                               memory_efficiency=compute.memory_efficiency,
                               calibrate_step_ms=compute.calibrate_step_ms, preset=compute.preset)
    flops = compute.batch_size * compute.seq_len * shape.flops_per_token(compute.seq_len)
    return profile, flops / ((profile.forward_ms + profile.backward_ms) / 1e3)


class ProjectionOutcome(NamedTuple):
    """What ``run_projection`` computed and wrote."""

    results: list[StepResult]
    """Every simulated step: per strategy variant, world size and bucket size."""
    rows: list[dict[str, Any]]
    """results.csv's rows, in ``results`` order, each flagged when it is its variant's best size."""
    profile: ComputeProfile
    """The compute profile every step was simulated from (also written as compute_profile.json)."""
    files: list[Path]
    """Every file written: results.csv, results.md, compute_profile.json, environment.json, plots."""


def run_projection(config) -> ProjectionOutcome:
    """Simulate the grid of ``config`` and write every output file (docs/projection.md)."""
    profile, flops_per_s = build_profile(config.compute)
    fabric = build_fabric(config.network)  # its world sizes were checked against it by ProjectionConfig
    results = project(profile, fabric, config.study.strategies, config.study.world_sizes, config.study.bucket_sizes_mb,
                      copy_bandwidth(config.compute), config.study.engine_settings, flops_per_s,
                      contention_of(config.network)[0])
    best = best_by_world_size(results)
    rows = [result_row(r, fabric.nodes(r.world_size), best[(r.variant, r.world_size)] is r) for r in results]
    out_dir = Path(config.output.out_dir)
    files = [
        write_atomically(out_dir / "results.csv", csv_text(rows, COLUMNS)),
        write_atomically(out_dir / "results.md", build_markdown(config, profile, fabric, results)),
        write_profile(profile, out_dir / "compute_profile.json"),
        write_json_atomically(out_dir / "environment.json", describe_environment(config, profile, fabric, flops_per_s),
                              default=str),
    ]
    if config.output.plots:
        files += write_plots(out_dir, results, profile)
    return ProjectionOutcome(results=results, rows=rows, profile=profile, files=files)


def describe_environment(config, profile: ComputeProfile, fabric: Fabric,
                         flops_per_s: Optional[float]) -> dict[str, Any]:
    """What belongs next to the numbers: versions, platform, commit, the full config, the resolved inputs."""
    return {
        **invocation(),
        "versions": {p: package_version(p) for p in ("lightning_ddp", "numpy", "matplotlib", "jsonargparse")},
        **git_state(),
        "config": dataclasses.asdict(config),
        "fabric": dataclasses.asdict(fabric),
        "contention": dict(zip(("s", "source"), contention_of(config.network))),
        "compute_profile": {
            "source": profile.source, "device": profile.device, "forward_ms": profile.forward_ms,
            "backward_ms": profile.backward_ms, "optimizer_ms": profile.optimizer_ms, "params": len(profile.params),
            "grad_bytes": profile.grad_bytes, "compute_only_ms": profile.compute_ms,
            "flops_per_s": flops_per_s,
        },
    }
