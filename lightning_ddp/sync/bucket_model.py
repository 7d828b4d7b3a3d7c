"""Predict the best gradient-bucket size (``bucket_size_mb: auto``): fit ``t = o + bytes / w`` to a short all-reduce
microbenchmark and take ``sqrt(s * w * o)`` bytes. The derivation: ``docs/algorithms.md``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.comm import backend_from_spec, require_process_group
from lightning_ddp.sync.memory_model import MiB

DEFAULT_SIZES: tuple[int, ...] = tuple(4 * 1024 * 4**k for k in range(8))
"""Message sizes of the microbenchmark in bytes: 4 KiB, 16 KiB, ..., 64 MiB (eight sizes, x4 apart)."""


def fit_latency_bandwidth(
    sizes: Sequence[float], times: Sequence[float], relative: bool = True
) -> tuple[float, float]:
    """Fit ``t = o + bytes / w`` to all-reduce ``times`` (seconds) of ``sizes`` (bytes); return ``(o, w)``.

    ``relative`` weighs by ``1 / t**2``. ``o`` is clipped at 0; ``w`` is ``math.inf`` when time does not grow.
    """
    if len(sizes) != len(times):
        raise ValueError(f"sizes and times must have the same length, got {len(sizes)} and {len(times)}")
    if len(set(sizes)) < 2:
        raise ValueError(f"the fit needs at least two distinct message sizes, got {list(sizes)}")
    if any(not t > 0 for t in times):
        raise ValueError(f"every time must be > 0 seconds, got {list(times)}")
    weights = [1.0 / t**2 if relative else 1.0 for t in times]
    total = sum(weights)
    b_mean = sum(v * b for v, b in zip(weights, sizes)) / total
    t_mean = sum(v * t for v, t in zip(weights, times)) / total
    sxx = sum(v * (b - b_mean) ** 2 for v, b in zip(weights, sizes))
    sxy = sum(v * (b - b_mean) * (t - t_mean) for v, b, t in zip(weights, sizes, times))
    slope = sxy / sxx  # seconds per byte
    overhead = t_mean - slope * b_mean
    bandwidth = 1.0 / slope if slope > 0 else math.inf
    # Round away float dust so that exact data gives exact numbers (e.g. 0.001 rather than 0.0010000000000000002).
    return max(0.0, float(f"{overhead:.12g}")), float(f"{bandwidth:.12g}")


def optimal_bucket_bytes(s: float, o: float, w: float, largest_param_bytes: float = 0) -> int:
    """``b* = sqrt(s * w * o)`` bytes for ``s`` gradient bytes, overhead ``o`` (s) and bandwidth ``w`` (B/s), at
    least ``largest_param_bytes`` and at most ``s``.

    >>> optimal_bucket_bytes(4e8, 1e-4, 1e10)  # sqrt(4e8 * 1e10 * 1e-4) = sqrt(4e14) = 2e7
    20000000
    """
    if not s > 0:
        raise ValueError(
            f"s (gradient bytes) must be > 0, got {s!r}; a model with no trainable parameters needs no buckets"
        )
    if o < 0 or not w > 0:
        raise ValueError(f"need o >= 0 and w > 0, got o={o!r}, w={w!r}; fit them with fit_latency_bandwidth")
    if largest_param_bytes < 0:
        raise ValueError(f"largest_param_bytes must be >= 0, got {largest_param_bytes!r}")
    if math.isinf(w) or o == 0:
        best = 0.0
    else:
        best = math.sqrt(s * w * o)
    return int(round(min(float(s), max(best, float(largest_param_bytes)))))


def measure_allreduce(
    sizes: Iterable[int] = DEFAULT_SIZES,
    repeats: int = 5,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> list[float]:
    """Median seconds of one all-reduce per message size (bytes), MAX over ranks; a collective."""
    require_process_group("measure_allreduce")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sizes = list(sizes)
    if not sizes:
        raise ValueError("sizes is empty; pass at least two message sizes, e.g. DEFAULT_SIZES")
    device = torch.device(device) if device is not None else default_measure_device(group)
    cuda = device.type == "cuda"
    medians = []
    for nbytes in sizes:
        tensor = torch.zeros(max(1, int(nbytes) // 4), dtype=torch.float32, device=device)
        dist.all_reduce(tensor, group=group)  # warm-up: connection set-up, allocator, first-call costs
        samples = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if cuda:
                torch.cuda.synchronize(device)  # NCCL returns once queued; the clock must wait for the kernel
            samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
    agreed = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return [float(t) for t in agreed.tolist()]


def default_measure_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The current CUDA device when ``group`` moves CUDA tensors over NCCL, else the CPU."""
    if backend_from_spec(dist.get_backend_config(group), "cuda") == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class BucketPrediction:
    """The prediction and everything it was computed from (for logging next to the result)."""

    overhead_s: float  # o, the fitted per-call overhead of one all-reduce
    bandwidth_Bps: float  # w, message bytes over time
    grad_bytes: int  # s, every trainable parameter's gradient
    largest_param_bytes: int  # the lower bound on a bucket
    bucket_bytes: int  # b*, the predicted best bucket cap
    sizes: tuple[int, ...] = ()  # the message sizes measured
    times_s: tuple[float, ...] = ()  # median all-reduce time per size, agreed over ranks

    @property
    def bucket_size_mb(self) -> float:
        """``b*`` in MiB, the unit of ``bucket_size_mb``."""
        return self.bucket_bytes / MiB

    @property
    def n_buckets(self) -> float:
        """``s / b*``: about how many buckets the prediction makes."""
        return self.grad_bytes / self.bucket_bytes


def predict_bucket_size(
    module_or_params: nn.Module | Iterable[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    sizes: Iterable[int] = DEFAULT_SIZES,
    repeats: int = 5,
) -> BucketPrediction:
    """Measure, fit and optimise for the trainable parameters of ``module_or_params``; a collective.
    Gradients are assumed to have their parameter's dtype."""
    params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    unique: dict[int, torch.Tensor] = {}
    for p in params:
        if p.requires_grad:
            unique.setdefault(id(p), p)  # a tied tensor is communicated once
    if not unique:
        raise ValueError("no trainable parameters: nothing to put in buckets")
    nbytes = [p.nbytes for p in unique.values()]
    device = next(iter(unique.values())).device
    sizes = tuple(int(s) for s in sizes)
    times = measure_allreduce(sizes, repeats=repeats, group=group, device=device)
    o, w = fit_latency_bandwidth(sizes, times)
    s, largest = sum(nbytes), max(nbytes)
    return BucketPrediction(o, w, s, largest, optimal_bucket_bytes(s, o, w, largest), sizes, tuple(times))

