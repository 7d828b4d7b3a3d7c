"""From a ``ProjectionConfig`` to the files in ``output.out_dir`` (docs/projection.md lists them)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from lightning_ddp.model_shapes import gpt_parameter_shapes
from lightning_ddp.files import write_atomically
from lightning_ddp.profile import ComputeProfile, read_profile, write_profile
from lightning_ddp.projection.comm import Fabric
from lightning_ddp.projection.config import build_fabric, contention_of, copy_bandwidth, gpu_spec
from lightning_ddp.projection.flops import ModelShape, modelled_profile
from lightning_ddp.projection.report import build_markdown, write_plots
from lightning_ddp.projection.sweep import COLUMNS, best_by_world_size, project, result_row
from lightning_ddp.projection.tables import csv_text
from lightning_ddp.provenance import git_state, invocation, package_version


def with_shapes(profile: ComputeProfile, shapes: dict[str, tuple[int, ...]]) -> ComputeProfile:
    """``profile`` with each parameter's ``shape`` from ``shapes`` (by name; every parameter must be there)."""
    missing = [p.name for p in profile.params if p.name not in shapes]
    if missing:
        raise ValueError(f"no shape for parameter {missing[0]!r} of the compute profile")
    params = tuple(dataclasses.replace(p, shape=shapes[p.name]) for p in profile.params)
    return dataclasses.replace(profile, params=params)


def build_profile(compute) -> ComputeProfile:
    """The compute profile a ``ComputeConfig`` describes (a modelled one with every parameter's shape)."""
    if compute.source == "profile":
        return read_profile(compute.profile_path)
    shape = ModelShape.from_preset(compute.preset)
    profile = modelled_profile(shape, compute.batch_size, compute.seq_len, gpu=gpu_spec(compute), mfu=compute.mfu,
                               precision=compute.precision,
                               optimizer_bytes_per_param=compute.optimizer_bytes_per_param,
                               memory_efficiency=compute.memory_efficiency,
                               calibrate_step_ms=compute.calibrate_step_ms, preset=compute.preset)
    return with_shapes(profile, gpt_parameter_shapes(shape))


def profile_flops_per_s(compute, profile: ComputeProfile) -> Optional[float]:
    """The profile's forward + backward FLOP/s (PowerSGD's arithmetic); ``None`` for a measured profile."""
    if compute.source != "flops":
        return None
    shape = ModelShape.from_preset(compute.preset)
    flops = compute.batch_size * compute.seq_len * shape.flops_per_token(compute.seq_len)
    return flops / ((profile.forward_ms + profile.backward_ms) / 1e3)


@dataclasses.dataclass
class ProjectionOutcome:
    """What ``run_projection`` computed and wrote."""

    results: list
    rows: list[dict[str, Any]]
    profile: ComputeProfile
    fabric: Fabric
    files: list[Path]


def run_projection(config) -> ProjectionOutcome:
    """Simulate the grid of ``config`` and write every output file (docs/projection.md)."""
    profile = build_profile(config.compute)
    fabric = build_fabric(config.network)  # its world sizes were checked against it by ProjectionConfig
    results = project(profile, fabric, config.study.strategies, config.study.world_sizes, config.study.bucket_sizes_mb,
                      copy_bandwidth(config.compute), config.study.engine_settings,
                      profile_flops_per_s(config.compute, profile), contention_of(config.network)[0])
    best = best_by_world_size(results)
    rows = [result_row(r, fabric.nodes(r.world_size), best[(r.variant, r.world_size)] is r) for r in results]
    out_dir = Path(config.output.out_dir)
    files = [
        write_atomically(out_dir / "results.csv", csv_text(rows, COLUMNS, extrasaction="ignore")),
        write_atomically(out_dir / "results.md", build_markdown(config, profile, fabric, results)),
        write_profile(profile, out_dir / "compute_profile.json"),
        write_atomically(out_dir / "environment.json",
                         json.dumps(describe_environment(config, profile, fabric), indent=2, default=str) + "\n"),
    ]
    if config.output.plots:
        files += write_plots(out_dir, results, profile)
    return ProjectionOutcome(results, rows, profile, fabric, files)


def describe_environment(config, profile: ComputeProfile, fabric: Fabric) -> dict[str, Any]:
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
            "flops_per_s": profile_flops_per_s(config.compute, profile),
        },
    }
