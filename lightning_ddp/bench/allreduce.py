"""The sweep's all-reduce microbenchmark job (``python -m lightning_ddp.bench.allreduce --out FILE``): rank 0
writes the fitted per-call overhead and bandwidth as JSON (docs/benchmarks.md)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from jsonargparse import auto_cli

from lightning_ddp.files import write_json_atomically
from lightning_ddp.sync.bucket_model import DEFAULT_SIZES, fit_latency_bandwidth, measure_allreduce
from lightning_ddp.teardown import exit_without_finalizing, tear_down_process_group


def measure(out: str, backend: Literal["gloo", "nccl"] = "gloo", device: Literal["cpu", "cuda"] = "cpu",
            repeats: int = 5, sizes: list[int] = list(DEFAULT_SIZES)) -> None:
    """Time all-reduces of each size on every rank of the launched job; rank 0 writes the fit to ``out``.

    Args:
        out: JSON file rank 0 writes.
        backend: The process group's backend.
        device: Where the messages live (``cuda``: the GPU of ``LOCAL_RANK``).
        repeats: Timed calls per size (the median is kept).
        sizes: Message sizes in bytes, e.g. ``[4096,65536,1048576]``.
    """
    torch_device = torch.device(device, int(os.environ.get("LOCAL_RANK", 0)) if device == "cuda" else None)
    if device == "cuda":
        torch.cuda.set_device(torch_device)
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(minutes=5))
    try:
        times = measure_allreduce(sizes, repeats=repeats, device=torch_device)
        o, w = fit_latency_bandwidth(sizes, times)
        if dist.get_rank() == 0:
            write_json_atomically(out, {
                "overhead_s": o,
                "bandwidth_Bps": w if w != float("inf") else None,
                "sizes": sizes,
                "times_s": times,
                "repeats": repeats,
                "world_size": dist.get_world_size(),
                "backend": backend,
                "device": str(torch_device),
            })
            print(f"all-reduce fit: o = {o * 1e3:.3f} ms, w = {w / 1e9:.3f} GB/s", flush=True)
    except BaseException:
        dist.destroy_process_group()
        raise
    tear_down_process_group()


if __name__ == "__main__":
    auto_cli(measure, prog="python -m lightning_ddp.bench.allreduce", as_positional=False)
    exit_without_finalizing()  # exit 0 without the abort a live gloo thread causes at finalization
