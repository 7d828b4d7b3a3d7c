"""What the study ran on: ``python -m lightning_ddp.bench.gpu_study.environment OUT [--device cuda|cpu]``.

Its own process, so the study's process never creates a CUDA context. Records the devices (name, memory, SMs,
compute capability, MIG slice, the hardware table's row), the driver, torch / CUDA / cuDNN / NCCL, Lightning,
Python, the host and the git state of the code (``bench.study.provenance``).
"""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_ddp.files import write_json_atomically
from lightning_ddp.provenance import package_version

__all__ = ["main"]


def _nvidia_driver() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), or None without nvidia-smi."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def _gpu(index: int) -> dict[str, Any]:
    import torch

    from lightning_ddp.hardware import compute_share, find_device, mig_profile

    p = torch.cuda.get_device_properties(index)
    spec = find_device(p.name)
    return {
        "name": p.name,
        "total_memory_bytes": p.total_memory,
        "sm_count": p.multi_processor_count,
        "compute_capability": f"{p.major}.{p.minor}",
        "uuid": str(getattr(p, "uuid", "")) or None,
        "mig_profile": mig_profile(p.name),
        "compute_share": compute_share(p.name, p.multi_processor_count),
        "hardware_table": None if spec is None else dataclasses.asdict(spec),
    }


def main(out: str, device: str = "cuda") -> int:
    """Describe the machine for ``device`` (``cuda``: every visible GPU; ``cpu``, a dry run's: the host only) and
    write it to ``out`` (JSON; its folder does not make the tree dirty)."""
    import torch

    from lightning_ddp.bench.study import provenance
    from lightning_ddp.memory import memory_budget_bytes

    cuda = device == "cuda" and torch.cuda.is_available()
    nccl = None
    if cuda:
        try:
            version = torch.cuda.nccl.version()  # (2, 21, 5) in torch 2.x; one int (22105) in some older builds
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (AttributeError, RuntimeError):  # a build without NCCL
            nccl = None
    try:
        driver_api = torch._C._cuda_getDriverVersion() if cuda else None  # e.g. 12040 for CUDA 12.4
    except (AttributeError, RuntimeError):
        driver_api = None
    write_json_atomically(Path(out), provenance(
        str(Path(out).parent), device="cuda" if cuda else "cpu",
        gpus=[_gpu(i) for i in range(torch.cuda.device_count())] if cuda else [],
        nvidia_driver=_nvidia_driver() if cuda else None, cuda_driver_api=driver_api,
        torch_cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if cuda else None, nccl=nccl,
        jsonargparse=package_version("jsonargparse"), hostname=platform.node(),
        memory_budget_bytes=memory_budget_bytes("cuda" if cuda else "cpu", 1),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
    ), default=str)
    return 0


if __name__ == "__main__":
    from jsonargparse import auto_cli

    sys.exit(auto_cli(main, prog="python -m lightning_ddp.bench.gpu_study.environment"))
