"""Model-state bytes per rank of a simulated strategy (parameters, gradients, AdamW state, engine buffers), read
from its compute profile; the model per catalogue ``memory`` key: docs/projection.md."""

from __future__ import annotations

from typing import Optional

from lightning_ddp import catalogue
from lightning_ddp.projection.simulators import (
    MiB,
    StepModel,
    StepResult,
    _buffered,
    _engine_buckets,
    _shard_bytes,
    owner_loads,
    padded_bucket_bytes,
    transformer_blocks,
)

ADAM_STATES = 2  # AdamW's exp_avg and exp_avg_sq, each as wide as the parameter


def state_bytes(result: StepResult, model: StepModel) -> int:
    """Model-state bytes on the most loaded rank of a simulated step (docs/projection.md's table)."""
    memory = catalogue.get(result.strategy).memory
    params = model.profile.params
    psi = sum(q.bytes for q in params)
    replicated = psi + psi + ADAM_STATES * psi  # parameters, gradients, optimizer state
    if memory == "none":
        return replicated
    if memory in ("packed", "full_buckets"):  # the packed gradients of the sync; torch DDP's reducer buckets
        return replicated + psi
    if memory in ("per_tensor", "bucketed"):
        return replicated + _bucket_buffer_bytes(model, result.bucket_size_mb) + result.buffer_bytes
    if memory == "zero1":
        return _zero1_bytes(model, psi)
    if memory == "zero2":
        return _zero2_bytes(model, psi, result.bucket_size_mb)
    if memory == "fully_sharded":
        return _fsdp2_bytes(model)
    raise ValueError(f"no projected memory model {memory!r} (of {result.strategy!r}): add it to "
                     "lightning_ddp/projection/memory.py beside its simulate function")


def _bucket_buffer_bytes(model: StepModel, bucket_size_mb: Optional[float]) -> int:
    """Every buffered bucket at its bytes; no bucket size: one bucket per tensor (as the overlap engine)."""
    params = model.profile.params
    buckets = _engine_buckets(params, 1 / MiB if bucket_size_mb is None else bucket_size_mb)
    sizes = [sum(params[i].bytes for i in b) for b in buckets]
    return sum(s for s, buffered in zip(sizes, _buffered(buckets)) if buffered)


def _zero1_bytes(model: StepModel, psi: int) -> int:
    segment = max(owner_loads(model))
    return psi + psi + ADAM_STATES * segment + model.world_size * segment


def _zero2_bytes(model: StepModel, psi: int, bucket_size_mb: Optional[float]) -> int:
    params, n = model.profile.params, model.world_size
    buckets = _engine_buckets(params, bucket_size_mb or 25.0)
    shard = sum(padded_bucket_bytes(params, b, n) for b in buckets) // n
    largest = max((sum(params[i].bytes for i in b) for b in buckets), default=0)
    return psi + shard + 2 * largest + ADAM_STATES * shard + shard


def _fsdp2_bytes(model: StepModel) -> int:
    params, n = model.profile.params, model.world_size
    root, blocks = transformer_blocks(params)
    shard = (_shard_bytes(params, root, n) + sum(_shard_bytes(params, b, n) for b in blocks)) // n
    sizes = sorted((sum(params[i].bytes for i in b) for b in blocks), reverse=True)
    root_bytes = sum(params[i].bytes for i in root)
    unsharded = root_bytes + sum(sizes[:2])  # the root, the running block and the prefetched one
    return shard + unsharded + shard + sum(sizes[:1]) + ADAM_STATES * shard
