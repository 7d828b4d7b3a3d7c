"""The projection's command line: one dataclass per concern, validated at parse time (each error names its field),
and the functions that resolve a section into what it describes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from jsonargparse.typing import NonNegativeFloat, PositiveFloat, PositiveInt, restricted_number_type

from lightning_ddp import catalogue
from lightning_ddp.command_line import check_field_types
from lightning_ddp.projection.comm import Fabric, get_fabric, read_fit
from lightning_ddp.projection.flops import ADAMW_BYTES_PER_PARAM, GPUS, GPUSpec, get_gpu
from lightning_ddp.projection.simulators import CONTENTION, model_settings, simulated_names, simulator

Fraction = restricted_number_type("Fraction", float, [(">", 0), ("<=", 1)])
"""A ``float`` in (0, 1]; jsonargparse refuses anything else with the field's name."""


@dataclass
class ComputeConfig:
    """Per-rank compute of one step: modelled from FLOPs, or read from a measured compute profile."""

    source: Literal["flops", "profile"] = "flops"
    """``flops``: model the preset on ``gpu`` at ``mfu``; ``profile``: read ``profile_path`` (a CommTimer file)."""
    profile_path: Optional[str] = None
    """Compute profile JSON (schema ``lightning_ddp.compute_profile/1``), for ``source: profile``."""
    preset: str = "xl"
    """Model preset (``lightning_ddp.model.PRESETS``: tiny, small, medium, large, xl, 2.7b), for ``source: flops``."""
    batch_size: PositiveInt = 4
    """Per-rank batch size (sequences); the global batch grows with the world size (weak scaling)."""
    seq_len: PositiveInt = 512
    """Sequence length (tokens per sequence)."""
    precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"] = "bf16-mixed"
    """Sets the FLOP peak (TF32 for ``32-true``) and the gradient bytes (fp32 unless ``bf16-true``)."""
    gpu: str = "h100-sxm"
    """A key of ``lightning_ddp.hardware.DEVICES`` (h100-sxm, a100-pcie-40gb, ...): peak FLOP/s and memory bandwidth
    (only the bandwidth, for copies, with ``source: profile``)."""
    mfu: float = 0.4
    """Model FLOPs utilisation of forward + backward, relative to the GPU's dense peak (0.4 = 40 %)."""
    peak_tflops: Optional[PositiveFloat] = None
    """Overrides the GPU's dense bf16 peak, TFLOP/s."""
    memory_bandwidth_GBps: Optional[PositiveFloat] = None
    """Overrides the GPU's memory bandwidth, GB/s (set it for a CPU profile: the copies' bandwidth)."""
    memory_efficiency: Fraction = 0.8
    """Fraction of the memory bandwidth that copies and the optimizer reach."""
    optimizer_bytes_per_param: NonNegativeFloat = ADAMW_BYTES_PER_PARAM
    """Memory traffic of one optimizer step per parameter, bytes (80: torch's foreach AdamW in fp32; 28: fused)."""
    calibrate_step_ms: Optional[PositiveFloat] = None
    """If set (``source: flops``): scale forward and backward so that forward + backward + optimizer equals this
    measured compute-only step time, in ms."""

    def __post_init__(self) -> None:
        """Refuses ``source: profile`` without ``profile_path``, an unknown ``gpu`` and ``mfu`` outside (0, 1]."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        if self.source == "profile" and not self.profile_path:
            raise ValueError("`compute.source: profile` needs `compute.profile_path` (a compute profile JSON file), "
                             "or use `compute.source: flops`")
        get_gpu(self.gpu)
        if not 0 < self.mfu <= 1:
            raise ValueError(f"`compute.mfu` must be in (0, 1], got {self.mfu}; e.g. `compute.mfu: 0.4` for 40 %")


@dataclass
class NetworkConfig:
    """What one collective costs (the formulas are in ``lightning_ddp.projection.comm``)."""

    preset: str = "h100_nvlink_ib"
    """Fabric: h100_nvlink_ib (NVLink 4 in 8-GPU nodes + 8 x InfiniBand NDR per node), nvlink4, pcie_gen4,
    pcie_gen5, ib_ndr; or ``measured`` to extrapolate this project's all-reduce fit (``fit_path``)."""
    fit_path: Optional[str] = None
    """For ``preset: measured``: a JSON file with ``overhead_s`` and ``bandwidth_Bps`` (e.g. the sweep's
    benchmarks/results/cpu/bucket_prediction.json)."""
    overhead_scaling: Literal["per_hop", "per_call"] = "per_hop"
    """For ``measured``: the fitted per-call overhead is per ring step (grows with ranks) or per call (does not)."""
    algorithm: Optional[Literal["ring", "tree", "auto"]] = None
    """All-reduce algorithm; default: the preset's (``auto``: the cheaper of ring and tree per message; ``ring``
    for ``measured``, as gloo)."""
    gpus_per_node: Optional[PositiveInt] = None
    """Overrides the preset's GPUs per node (two-level fabrics)."""
    call_overhead_us: Optional[NonNegativeFloat] = None
    """Overrides the fixed cost per collective, microseconds."""
    contention: Optional[NonNegativeFloat] = None
    """``s``: compute runs ``1 + s`` times slower while a collective is in flight; default: the value fitted for
    the backend (``simulators.CONTENTION``: gloo for a ``measured`` fit recorded on gloo, else NCCL)."""

    def __post_init__(self) -> None:
        """Refuses an unknown ``preset``, and ``preset: measured`` without ``fit_path``."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        if self.preset != "measured":
            get_fabric(self.preset)
        elif not self.fit_path:
            raise ValueError("`network.preset: measured` needs `network.fit_path` (e.g. "
                             "benchmarks/results/cpu/bucket_prediction.json)")


@dataclass
class StudyConfig:
    """The axes of the projection: every strategy at every world size (and bucket size, for those with one)."""

    strategies: list[str] = field(default_factory=simulated_names)
    """Strategies to simulate, by catalogue name; default: every entry with a projection model."""
    world_sizes: list[int] = field(default_factory=lambda: [2, 8, 64, 512, 1024])
    """Data-parallel ranks (one GPU each); on two-level fabrics, those above a node must fill whole nodes."""
    bucket_sizes_mb: list[float] = field(default_factory=lambda: [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000])
    """Bucket caps in MiB for the strategies with buckets; the report picks the best per world size."""
    engine_settings: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    """Per strategy, setting -> values to project, e.g. ``{bucketed_powersgd_ddp: {rank: [1, 4]}}``; every
    combination is a row of its own. Only settings its model takes (those that change the step time) are accepted."""

    def __post_init__(self) -> None:
        """Refuses empty strategies or world sizes, a strategy without a projection model, settings it does not
        model, world sizes below 2, bucket sizes not > 0 (or none for a bucketed strategy); then de-duplicates the
        strategies (order kept) and sorts the world and bucket sizes, in place."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        if not self.strategies or not self.world_sizes:
            raise ValueError("`study.strategies` and `study.world_sizes` take at least one entry each (e.g. "
                             f"`--study.world_sizes [2,8]`); strategies: {', '.join(simulated_names())}")
        for name in self.strategies:
            try:
                simulator(name)
            except ValueError as error:
                raise ValueError(f"{error} (in `study.strategies`)") from None
        self.strategies = list(dict.fromkeys(self.strategies))
        for name, settings in self.engine_settings.items():  # checked whether listed or not (a narrowed list)
            where = f"`study.engine_settings.{name}`"
            try:
                model_settings(name, settings)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            empty = [setting for setting, values in settings.items() if not values]
            if empty:
                raise ValueError(f"{where}.{empty[0]} must be a non-empty list of values, e.g. `{empty[0]}: [4]`")
        if min(self.world_sizes) < 2 or min(self.bucket_sizes_mb, default=1) <= 0:
            raise ValueError("`study.world_sizes` must be >= 2 (data parallelism needs two ranks) and "
                             f"`study.bucket_sizes_mb` > 0 MiB, got {self.world_sizes} and {self.bucket_sizes_mb}")
        if any(catalogue.get(s).has_bucket_size for s in self.strategies) and not self.bucket_sizes_mb:
            raise ValueError("`study.bucket_sizes_mb` is empty but a bucketed strategy is listed; give sizes in MiB, "
                             "e.g. `--study.bucket_sizes_mb [1,25,100]`")
        self.world_sizes = sorted(set(self.world_sizes))
        self.bucket_sizes_mb = sorted(set(float(b) for b in self.bucket_sizes_mb))


@dataclass
class OutputConfig:
    """Where results go."""

    out_dir: str = "logs/projection"
    """Directory of results.csv, results.md, the PNG plots, compute_profile.json and environment.json."""
    plots: bool = True
    """Write the PNG plots (matplotlib, Agg)."""

    def __post_init__(self) -> None:
        check_field_types(self)  # what the command line refuses, refused here too (its message)


@dataclass
class ProjectionConfig:
    """A projection of step time and communication share to larger world sizes, one simulated timeline per cell."""

    name: str = "projection"
    """Title of results.md."""
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    """One rank's step without communication: modelled from FLOPs or a measured profile."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """The interconnect: a fabric preset, one changed by hand, or a measured all-reduce fit."""
    study: StudyConfig = field(default_factory=StudyConfig)
    """The grid: strategies (with engine settings), world sizes, bucket sizes."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Where results and plots go."""

    def __post_init__(self) -> None:
        """Refuses a world size the fabric's nodes cannot hold (not for a measured fit), before anything is
        written."""
        check_field_types(self)  # what the command line refuses, refused here too (its message)
        if self.network.preset != "measured":
            fabric = build_fabric(self.network)
            for n in self.study.world_sizes:
                fabric.nodes(n)  # raises unless n fills whole nodes


# ---- what a section describes, resolved ------------------------------------------------------------------------


def build_fabric(network: NetworkConfig) -> Fabric:
    """The ``Fabric`` a ``NetworkConfig`` describes (preset or measured fit, with its overrides)."""
    if network.preset == "measured":
        fabric = read_fit(network.fit_path).fabric(network.overhead_scaling, network.algorithm or "ring")
    else:
        fabric = get_fabric(network.preset)
    overhead_s = None if network.call_overhead_us is None else network.call_overhead_us * 1e-6
    changes = {"algorithm": network.algorithm, "gpus_per_node": network.gpus_per_node, "call_overhead_s": overhead_s}
    return dataclasses.replace(fabric, **{k: v for k, v in changes.items() if v is not None})


def contention_of(network: NetworkConfig) -> tuple[float, str]:
    """``(s, where it comes from)`` for a ``NetworkConfig``: ``network.contention``, or the fitted value of its
    backend (``simulators.CONTENTION``: gloo for a ``measured`` fit recorded on gloo, NCCL otherwise)."""
    if network.contention is not None:
        return network.contention, "`network.contention`"
    backend = "gloo" if network.preset == "measured" and read_fit(network.fit_path).backend == "gloo" else "nccl"
    return CONTENTION[backend], f"fitted for {backend} (`python -m lightning_ddp.projection.contention`)"


def gpu_spec(compute: ComputeConfig) -> GPUSpec:
    """The GPU a ``ComputeConfig`` names, with its overrides (peak FLOP/s, memory bandwidth)."""
    changes = {"bf16_flops": compute.peak_tflops and compute.peak_tflops * 1e12,
               "memory_Bps": compute.memory_bandwidth_GBps and compute.memory_bandwidth_GBps * 1e9}
    return dataclasses.replace(GPUS[compute.gpu], **{k: v for k, v in changes.items() if v is not None})


def copy_bandwidth(compute: ComputeConfig) -> float:
    """Bytes per second that buffer copies move (read + write): memory bandwidth x efficiency."""
    return gpu_spec(compute).memory_Bps * compute.memory_efficiency
