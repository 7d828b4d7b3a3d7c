"""Model-state memory per rank of each simulated strategy: parameters, gradients, optimizer state, engine buffers.

What sharding buys, beside what it costs in step time (``strategies``). Activations are left out: the per-rank batch
is fixed (weak scaling), so they are the same for every strategy and world size (``lightning_ddp.memory`` estimates
them, and the whole peak, for a run). With ``Ψ`` the gradient bytes (``ComputeProfile.grad_bytes``; parameters are
taken to be as wide as their gradients, as in ``32-true`` and ``*-mixed``), ``n`` ranks:

- ``naive``: ``Ψ`` parameters + ``Ψ`` gradients + ``2Ψ`` AdamW state (``exp_avg``, ``exp_avg_sq``); every other
  strategy is this plus or minus:
- ``flat``: + the packed gradients of the sync (transient), ``Ψ``; ``ddp``: + the reducer's buckets, ``Ψ``;
- ``overlap``, ``bucketed``, ``bucketed_bf16``: + every buffered bucket (several tensors, or the last) at its
  bytes (the gradients regrow beside them, as ``lightning_ddp.memory`` counts); bf16 adds the half-width wire copy
  of every bucket; ``bucketed_powersgd``: bucketed's, + the error feedback ``E`` (fp32) and ``Q`` of every
  compressed matrix;
- ``zero1``: AdamW state of the most loaded owner only, ``2Ψ_r``, + the padded reduce-scatter buffer, ``n Ψ_r``;
- ``zero2``: gradients ``Ψ/n`` (padded), + the gradients of buckets being filled (a gradient lives in full until
  its bucket is reduced: counted as the largest bucket, twice), AdamW state ``2Ψ/n``, + the own shard of the
  gathered parameters ``Ψ/n``;
- ``fsdp2``: parameters ``Ψ/n`` + the root's and two blocks' unsharded (the running one and the prefetched one),
  gradients ``Ψ/n`` + one block's unsharded, AdamW state ``2Ψ/n``.

``Ψ_r`` is the most loaded ZeRO-1 owner's bytes (whole tensors per owner). The step's ``0-d`` ``step`` counters
and the optimizer's per-tensor overheads are left out.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_ddp.projection.buckets import assign_owners
from lightning_ddp.projection.strategies import (
    StepModel,
    _buffered,
    _engine_buckets,
    _padded,
    _shard_bytes,
    powersgd_plan,
    transformer_blocks,
)

__all__ = ["ADAM_STATES", "state_bytes"]

ADAM_STATES = 2
"""AdamW keeps ``exp_avg`` and ``exp_avg_sq``, each as wide as the parameter."""


def state_bytes(name: str, model: StepModel, bucket_size_mb: Optional[float] = None,
                settings: Optional[dict[str, Any]] = None) -> int:
    """Model-state bytes on the most loaded rank of strategy ``name`` (module docstring's table)."""
    p, n = model.profile, model.world_size
    params = p.params
    psi = sum(q.bytes for q in params)
    full = psi + psi + ADAM_STATES * psi  # parameters, gradients, optimizer state
    settings = settings or {}
    if name in ("naive",):
        return full
    if name in ("flat", "ddp"):
        return full + psi
    if name in ("overlap", "bucketed", "bucketed_bf16", "bucketed_powersgd"):
        buckets = _engine_buckets(params, 1 / 2**20 if name == "overlap" else (bucket_size_mb or 25.0))
        sizes = [sum(params[i].bytes for i in b) for b in buckets]
        extra = sum(s for s, buffered in zip(sizes, _buffered(buckets)) if buffered)
        if name == "bucketed_bf16":
            extra += sum(2 * sum(params[i].numel for i in b) for b in buckets)
        if name == "bucketed_powersgd" and p.has_shapes:
            plan = powersgd_plan([q.shape for q in params], settings.get("rank", 4),
                                 settings.get("min_compression_rate", 2.0))
            extra += sum(4 * (rows * cols + cols * k) for rows, cols, k in (m for m in plan if m))
        return full + extra
    if name == "zero1":
        synced = [q.bytes for q in params if q.ready_ms is not None]
        loads = [0] * n
        for size, owner in zip(synced, assign_owners(synced, n)):
            loads[owner] += size
        return psi + psi + ADAM_STATES * max(loads) + n * max(loads)
    if name == "zero2":
        buckets = _engine_buckets(params, bucket_size_mb or 25.0)
        padded = sum(round(_padded(sum(params[i].numel for i in b), n) * sum(params[i].bytes for i in b)
                           / max(1, sum(params[i].numel for i in b))) for b in buckets)
        largest = max((sum(params[i].bytes for i in b) for b in buckets), default=0)
        shard = padded // n
        return psi + shard + 2 * largest + ADAM_STATES * shard + shard
    if name == "fsdp2":
        root, blocks = transformer_blocks(params)
        shard = (_shard_bytes(params, root, n) + sum(_shard_bytes(params, b, n) for b in blocks)) // n
        sizes = sorted((sum(params[i].bytes for i in b) for b in blocks), reverse=True)
        root_bytes = sum(params[i].bytes for i in root)
        unsharded = root_bytes + sum(sizes[:2])  # the root, the running block and the prefetched one
        return shard + unsharded + shard + sum(sizes[:1]) + ADAM_STATES * shard
    raise ValueError(f"no memory model for strategy {name!r}: add it to lightning_ddp/projection/memory.py "
                     "(state_bytes) beside its simulate function")
