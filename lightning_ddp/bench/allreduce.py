"""The sweep's all-reduce microbenchmark job: ``python -m lightning_ddp.bench.allreduce --out FILE``.

Started once per sweep on the same ranks, backend and devices as the cells (with the launcher variables
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), it runs
``lightning_ddp.sync.bucket_model.measure_allreduce`` and ``fit_latency_bandwidth`` and rank 0 writes::

    {"overhead_s", "bandwidth_Bps", "sizes", "times_s", "repeats", "world_size", "backend", "device"}

The gradient size, and with it the predicted bucket size, is added by the sweep once a cell has told it the
model's shape (``sweep.gradient_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_ddp.sync.bucket_model import DEFAULT_SIZES, fit_latency_bandwidth, measure_allreduce


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_ddp.bench.allreduce", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the messages live")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size (median kept)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="message sizes in bytes")
    args = parser.parse_args(argv)

    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, init_method="env://", timeout=timedelta(minutes=5))
    try:
        times = measure_allreduce(args.sizes, repeats=args.repeats, device=device)
        o, w = fit_latency_bandwidth(args.sizes, times)
        if dist.get_rank() == 0:
            result = {
                "overhead_s": o,
                "bandwidth_Bps": w if w != float("inf") else None,
                "sizes": args.sizes,
                "times_s": times,
                "repeats": args.repeats,
                "world_size": dist.get_world_size(),
                "backend": args.backend,
                "device": str(device),
            }
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
            print(f"all-reduce fit: o = {o * 1e3:.3f} ms, w = {w / 1e9:.3f} GB/s", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
