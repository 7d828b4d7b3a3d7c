"""ZeRO stage 1: shard the optimizer state over the ranks; each rank updates only the parameters it owns.

Recipe (``ShardedOptimizer``):

1. At construction, give every parameter one owner rank: greedy by bytes, largest first, onto the least-loaded
   rank (``assign_owners``; a pure function, identical on every rank). Build the wrapped optimizer
   (``optimizer_cls``, e.g. AdamW) over the owned parameters only, one inner group per outer group, so only
   the owner ever allocates optimizer state for a parameter.
2. ``step()``: run the closure if given; with ``schedule="reduce_scatter"``, reduce-scatter the gradients so
   each owner holds the average of its own parameters' gradients; copy the outer groups' hyperparameters into
   the inner groups (an LR scheduler writes the outer ones); step the wrapped optimizer (its own shard); then
   send every updated parameter from its owner to the other ranks, so all ranks hold identical weights again.
3. ``add_param_group`` (also later, e.g. when unfreezing layers) assigns the new parameters onto the current
   loads; parameters already placed never move (their state stays where it is).

Two schedules (``schedule=``):

``allreduce_broadcast``
    A DDP engine (``NaiveDDP`` ... ``BucketedDDP``) has already all-reduced every gradient in backward; each
    owner steps its shard and broadcasts its updated parameters.
``reduce_scatter``
    The ZeRO-1 schedule proper. The model's engine must *not* all-reduce (``DeferredGradSync``): in
    ``step()``, a reduce-scatter leaves each owner the average of its shard's gradients, the owner steps, and
    an all-gather of the parameters makes the ranks identical. Reduce-scatter plus all-gather is exactly the
    decomposition of a ring all-reduce, so this moves the volume of plain DDP.

Memory and communication per rank and step. Ψ parameters (4 bytes each, fp32), T parameter tensors, N ranks,
Ψ_r the parameters rank r owns (≈ Ψ/N), K bytes of optimizer state per parameter. For fp32 AdamW, K = 8
(``exp_avg`` and ``exp_avg_sq``) plus a 4-byte ``step`` tensor per parameter tensor; the ZeRO paper's K = 12 is
mixed precision, where an fp32 master copy of the fp16 weights joins the optimizer state. "Sent" counts
bandwidth-optimal algorithms (ring all-reduce 2(N-1)/N·M, reduce-scatter and all-gather (N-1)/N·M each,
broadcast or reduce of M: (N-1)·M summed over ranks, (N-1)/N·M per rank on average over owners):

=========================  ===========  ===========  ==================  ===================================
                           parameters   gradients    optimizer state     sent per rank per step
=========================  ===========  ===========  ==================  ===================================
DDP (all-reduce)           4Ψ           4Ψ           8Ψ + 4T             2(N-1)/N · 4Ψ
ZeRO-1 allreduce_broadcast 4Ψ           4Ψ           8Ψ_r + 4T_r         2(N-1)/N · 4Ψ + (N-1)/N · 4Ψ = 1.5×
ZeRO-1 reduce_scatter      4Ψ           4Ψ           8Ψ_r + 4T_r         (N-1)/N · 4Ψ + (N-1)/N · 4Ψ = 1×
=========================  ===========  ===========  ==================  ===================================

The xl preset (Ψ = 1,998,235,200, T = 435) on N = 2: parameters 7.44 GiB, gradients 7.44 GiB, AdamW state
14.89 GiB unsharded and 7.44 GiB sharded; per rank 29.8 GiB -> 22.3 GiB. Only the optimizer state shrinks
(ZeRO-2, ``lightning_ddp.sync.zero2``, also shards the gradients; ZeRO-3 would shard the parameters). Transient buffers during ``step()``: the packed
gradients (4Ψ, ``reduce_scatter``) and the packed parameters (4Ψ), the size of ``FlatDDP``'s buffer.

What runs on which backend (``collectives=``):

- ``native`` (the default on NCCL): ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` over one flat
  buffer per dtype, each rank's segment padded to the largest segment S (sent: (N-1)·4S each, S ≥ Ψ/N; the
  greedy balance keeps the padding small).
- ``per_owner`` (the default on gloo): for each owner r in turn, ``reduce`` of r's gradient segment to r, and
  ``broadcast`` of r's parameter segment from r: 2N calls, no padding, the same bytes in aggregate. Gloo
  implements ``reduce_scatter_tensor`` as an all-reduce followed by taking a chunk (pytorch#118911), so it costs
  more than the per-owner reduces, and its ``all_gather_into_tensor`` was several times slower than N broadcasts
  when we timed both (2 ranks on one host, 64 MiB); older torch versions' gloo has no reduce-scatter at all.

Invariants: every rank issues the same collectives in the same order. The layout of a step depends only on
the ownership, on ``requires_grad`` and, for ``reduce_scatter``, on one tiny all-reduce of "which parameters
have a gradient here" (as in ``base``): a parameter that has a gradient on no rank keeps ``.grad = None`` and
is skipped by its owner's optimizer, exactly as in torch; one with a gradient on some ranks only is averaged
with zeros from the others. With ``allreduce_broadcast`` the gradients arrive already synchronised, so gradient
presence agrees.
All parameters of the optimizer must live on one device.

Parts (one concern per file): ``partition`` (who owns what, the per-dtype layout), ``collectives`` (the
reduce-scatter and all-gather of a step, native or per owner), ``optimizer`` (``ShardedOptimizer``),
``clipping`` (the global norm over owned gradients),
``checkpoint`` (consolidating and loading the state), ``deferred`` (``DeferredGradSync``).

Checkpoints: ``state_dict()`` is a collective (every rank must call it; Lightning's ``dump_checkpoint`` does)
and returns the *consolidated* state on every rank, on CPU, in exactly the format ``optimizer_cls`` would
produce for all parameters. A checkpoint therefore resumes under any world size, and under plain DDP with an
unsharded optimizer. ``load_state_dict`` takes that full state on every rank (Lightning loads the checkpoint
file on every rank) and keeps only the owned entries. Cost: each rank briefly holds the whole state in host
memory (8Ψ bytes for AdamW) while the checkpoint is written.

Gradient clipping (``lightning_ddp.sync.zero1.clipping``): ``clip_grad_norm_`` / ``clip_grad_value_`` on the
optimizer request clipping for the next ``step()``, which applies it once each owner holds the average of its
gradients (after the reduce-scatter, for ``reduce_scatter``): the global norm is the root of the sum over owners of
their owned gradients' squared norms (one scalar all-reduce), so the update equals one process's with clipping.
The strategies route Lightning's ``gradient_clip_val`` there. ZeRO-2 (``lightning_ddp.sync.zero2``) uses the same
optimizer with ``schedule="reduce_in_backward"``: its engine has reduced each gradient to its owner in backward.

Caveats for ``reduce_scatter``: before ``step()`` the gradients are local (not averaged), so anything reading
them earlier sees one rank's gradient: gradient-norm logging, torch's own ``clip_grad_norm_`` on the parameters
(use the optimizer's), fp16 ``GradScaler``'s inf check. ``allreduce_broadcast`` has none of these limits.
"""

from lightning_ddp.sync.zero1.deferred import DeferredGradSync
from lightning_ddp.sync.zero1.optimizer import (
    COLLECTIVE_IMPLS,
    OPTIMIZER_SCHEDULES,
    SCHEDULES,
    CollectiveImpl,
    OptimizerSchedule,
    Placement,
    Schedule,
    ShardedOptimizer,
    check_collective_impl,
    check_schedule,
)
from lightning_ddp.sync.zero1.partition import assign_owners

__all__ = [
    "COLLECTIVE_IMPLS",
    "OPTIMIZER_SCHEDULES",
    "SCHEDULES",
    "CollectiveImpl",
    "DeferredGradSync",
    "OptimizerSchedule",
    "Placement",
    "Schedule",
    "ShardedOptimizer",
    "assign_owners",
    "check_collective_impl",
    "check_schedule",
]
