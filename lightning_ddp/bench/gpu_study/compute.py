"""The study's processes on the device, so that its own never creates a CUDA context (docs/gpu.md, "How the stages
measure"):

- ``python -m lightning_ddp.bench.gpu_study.compute environment OUT [--device cuda|cpu]``: what the study ran on
  (the devices, their MIG slice and hardware table row, driver, torch / CUDA / cuDNN / NCCL, the git state);
- ``python -m lightning_ddp.bench.gpu_study.compute compute REQUEST OUT``: step time, tokens/s, MFU and peak memory
  of a preset at the largest batch that fits, without a Trainer or communication; ``measure`` starts at the memory
  pre-flight's batch and steps down on out-of-memory errors.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from lightning_ddp.bench.launch import is_oom
from lightning_ddp.files import write_json_atomically
from lightning_ddp.provenance import package_version

__all__ = ["batch_candidates", "compute", "environment", "first_that_fits", "measure"]


def batch_candidates(first: int, shrink: float = 0.8) -> list[int]:
    """``first`` and the batches to fall back to on out-of-memory errors, each about 20 % smaller, down to 1."""
    if first < 1:
        return []
    out = [first]
    while out[-1] > 1:
        out.append(min(out[-1] - 1, int(out[-1] * shrink)))
    return out


def first_that_fits(candidates: list[int], attempt: Callable[[int], dict[str, Any]], after_oom: Callable[[], None],
                    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """``attempt(batch)`` for each candidate until one does not run out of memory: its result (or None) and every
    attempt as ``{"batch", "status"}`` (``ok`` or ``oom``); any other error propagates. ``after_oom`` runs once the
    failed attempt's exception, and with it every tensor its frames held, is gone."""
    attempts: list[dict[str, Any]] = []
    for batch in candidates:
        try:
            return attempt(batch), [*attempts, {"batch": batch, "status": "ok"}]
        except BaseException as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
            if not is_oom(f"{type(error).__name__}: {error}"):
                raise
        attempts.append({"batch": batch, "status": "oom"})
        after_oom()
    return None, attempts


def _compute_dtype(precision: str) -> str:
    import torch

    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _peak_flops(device, dtype: str) -> float | None:
    """The device's dense peak for ``dtype`` from ``lightning_ddp.hardware`` (a MIG slice: its share of the SMs)."""
    import torch

    from lightning_ddp.hardware import dense_peak_flops

    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return dense_peak_flops(properties.name, dtype, sm_count=properties.multi_processor_count)
    return dense_peak_flops("cpu", dtype, threads=torch.get_num_threads())


def _timed_steps(model, optimizer, where, batch: int, seq_len: int, precision: str, steps: int,
                 warmup: int) -> dict[str, Any]:
    """``warmup`` + ``steps`` training steps at ``batch``; the times of the last ``steps``."""
    import torch
    import torch.nn.functional as F

    autocast = precision.startswith(("bf16", "16")) and precision.endswith("mixed")
    amp_dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    cuda = where.type == "cuda"
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len + 1), device=where)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if cuda:
        torch.cuda.reset_peak_memory_stats(where)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        with torch.autocast(where.type, dtype=amp_dtype, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(where)  # the step's kernels done: the host clock times the whole step
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {"batch": batch, "step_ms": times}


def measure(preset: str, precision: str, seq_len: int, max_batch: int, steps: int, warmup: int,
            device: str = "cuda") -> dict[str, Any]:
    """Steps of ``preset`` at the largest batch that fits, from the pre-flight's batch down; everything measured."""
    import torch

    from lightning_ddp.memory import estimate_rank_memory, largest_batch, memory_budget_bytes
    from lightning_ddp.model import get_config
    from lightning_ddp.module import LitGPT

    where = torch.device(device)
    cuda = where.type == "cuda"
    config = get_config(preset, context_length=seq_len)
    estimate_kwargs = dict(seq_len=seq_len, precision=precision, strategy="single", world_size=1,
                           device_type=where.type)
    budget = memory_budget_bytes(where.type, 1)
    proposed = largest_batch(config, budget_bytes=budget, max_batch=max_batch, **estimate_kwargs)
    torch.manual_seed(0)
    with torch.device(where):  # built on the device: initialising 2 B parameters on the host takes a minute
        module = LitGPT(preset, context_length=seq_len)
    model, optimizer = module.model, module.configure_optimizers()  # AdamW with the training run's groups

    def free() -> None:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def attempt(batch: int) -> dict[str, Any]:
        return _timed_steps(model, optimizer, where, batch, seq_len, precision, steps, warmup)

    results, attempts = None, []
    if proposed >= 1:
        results, attempts = first_that_fits(batch_candidates(proposed), attempt, free)
    out: dict[str, Any] = {
        "preset": preset, "precision": precision, "seq_len": seq_len, "device": str(where),
        "device_name": torch.cuda.get_device_name(where) if cuda else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()), "budget_bytes": budget,
        "preflight_batch": proposed, "max_batch": max_batch, "attempts": attempts,
        "compute_dtype": _compute_dtype(precision), "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if results is None:
        return out
    batch = results["batch"]
    step_ms = statistics.median(results["step_ms"])
    tokens_per_s = batch * seq_len / (step_ms / 1e3)
    peak = _peak_flops(where, out["compute_dtype"])
    estimate = estimate_rank_memory(config, batch_size=batch, **estimate_kwargs)
    out.update(
        batch=batch, step_ms=results["step_ms"], step_ms_median=step_ms, tokens_per_s=tokens_per_s,
        flops_per_token=model.flops_per_token(seq_len), peak_flops=peak,
        mfu=tokens_per_s * model.flops_per_token(seq_len) / peak if peak else None,
        peak_allocated_bytes=torch.cuda.max_memory_allocated(where) if cuda else None,
        peak_reserved_bytes=torch.cuda.max_memory_reserved(where) if cuda else None,
        estimate_bytes=estimate.total_bytes, estimate_parts=estimate.parts, estimate_table=estimate.table(),
    )
    return out


def compute(request: str, out: str) -> int:
    """Measure with the keyword arguments in the JSON file ``request`` (the study writes it); the result to ``out``."""
    write_json_atomically(out, measure(**json.loads(Path(request).read_text())))
    return 0


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


def environment(out: str, device: str = "cuda") -> int:
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

    sys.exit(auto_cli([environment, compute], prog="python -m lightning_ddp.bench.gpu_study.compute"))
