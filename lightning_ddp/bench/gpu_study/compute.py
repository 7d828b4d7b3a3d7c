"""The compute figures of one device: ``python -m lightning_ddp.bench.gpu_study.compute REQUEST OUT``.

Step time, tokens/s, MFU and peak memory of a preset at the largest batch that fits, without Lightning or
communication; ``measure`` starts at the memory pre-flight's batch and steps down on out-of-memory errors
(docs/gpu.md, "How the stages measure").
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from lightning_ddp.bench.launch import is_oom
from lightning_ddp.files import write_json_atomically

__all__ = ["batch_candidates", "first_that_fits", "measure"]


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


def main(request: str, out: str) -> int:
    """Measure with the keyword arguments in the JSON file ``request`` (the study writes it); the result to ``out``."""
    result = measure(**json.loads(Path(request).read_text()))
    write_json_atomically(out, result)
    return 0


if __name__ == "__main__":
    from jsonargparse import auto_cli

    sys.exit(auto_cli(main, prog="python -m lightning_ddp.bench.gpu_study.compute"))
