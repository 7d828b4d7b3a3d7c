"""Memory pre-flight: the bytes one rank needs for a training step, from the config alone, and whether they fit.

``estimate_rank_memory`` adds the categories and takes the peak over the forward's end and the step; ``preflight``
refuses a run that does not fit, with the fixes. The formulas and how they were measured: ``docs/memory.md``.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, Optional, Protocol, Sequence

from lightning_ddp import catalogue
from lightning_ddp.catalogue import BucketSize
from lightning_ddp.sync.assignment import assign_buckets, assign_owners
from lightning_ddp.sync.memory_model import (
    ADAM_MOMENTS, bucket_cap_bytes, buffer_numel, dim0_shard_numel, fully_sharded_unsharded_peak, owns_buffer,
    zero2_buffer_bytes,
)

if TYPE_CHECKING:
    from lightning_ddp.model import GPTConfig

GiB = 2**30
FP32 = 4
ADAM_STEP_BYTES_PER_TENSOR = FP32  # the 0-d `step` counter (fp32 on the CPU unless capturable/fused)

CUDA_OVERHEAD_BYTES = int(1.5 * GiB)  # the fixed per-rank cost no tensor accounts for (docs/memory.md, "Overhead")
CPU_OVERHEAD_BYTES = int(0.5 * GiB)  # the same per CPU process


class GPTShape(Protocol):
    """What fixes the GPT's parameter shapes, without torch: ``GPTConfig`` or the projection's ``ModelShape``."""

    d_model: int
    d_ff: int
    n_layers: int
    vocab_size: int
    tie_embeddings: bool


def gpt_parameter_shapes(config: GPTShape) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every parameter of ``GPT(config)``, in ``parameters()`` order (a tied table once)."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (v, d)}
    for i in range(config.n_layers):
        b = f"blocks.{i}"
        shapes[f"{b}.attn_norm.weight"] = (d,)
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{b}.attn.{projection}.weight"] = (d, d)
        shapes[f"{b}.ffn_norm.weight"] = (d,)
        shapes.update({f"{b}.ffn.w1.weight": (f, d), f"{b}.ffn.w2.weight": (d, f), f"{b}.ffn.w3.weight": (f, d)})
    shapes["norm.weight"] = (d,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


class _Precision(NamedTuple):
    param_bytes: int  # bytes per parameter, gradient and AdamW state element
    autocast: bool  # matmuls run in 2 bytes on 2-byte weight copies (``*-mixed``)
    block_saved: tuple[int, int, int]  # bytes one Block saves for backward per token: a·d_model + b·d_ff + c


# block_saved: measured and fitted as docs/memory.md says, re-measured by tests/unit/test_memory.py (fp64: 2 x fp32)
_PRECISIONS: dict[str, _Precision] = {
    "32-true": _Precision(4, False, (44, 16, 100)),
    "bf16-mixed": _Precision(4, True, (36, 8, 100)),
    "16-mixed": _Precision(4, True, (36, 8, 100)),
    "bf16-true": _Precision(2, False, (26, 8, 100)),
    "16-true": _Precision(2, False, (26, 8, 100)),
    "64-true": _Precision(8, False, (88, 32, 200)),
}
# Lightning's short names for the same settings.
_PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true", "None": "32-true"}


def normalize_precision(precision: object) -> str:
    """Lightning's precision setting as a key of ``_PRECISIONS`` (``32`` -> ``32-true``, ...)."""
    name = _PRECISION_ALIASES.get(str(precision), str(precision))
    if name not in _PRECISIONS:
        raise ValueError(
            f"precision {precision!r} has no memory model; use one of {', '.join(_PRECISIONS)} "
            "(--trainer.precision), or skip the check with --preflight false."
        )
    return name


def expected_bytes(shapes: list[tuple[int, ...]], world_size: int, mode: str, rank: int | None,
                   param_bytes: int = FP32) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state rank ``rank`` holds (None: the most loaded rank, category by
    category) under ``mode``: ``unsharded``, ``reduce_scatter`` (the state of the tensors ``assign_owners`` gives
    the rank), ``zero2`` (their gradients too) or ``fully_sharded`` (dim-0 rows of every tensor over the
    ``world_size`` ranks sharing the state: fsdp2's world, hsdp's shard group)."""
    p = param_bytes
    if mode == "fully_sharded":  # this rank's dim-0 rows of every parameter, gradient and moment; rank 0 holds most
        held = sum(dim0_shard_numel(shape, world_size, rank or 0) for shape in shapes)
        state = ADAM_MOMENTS * p * held + ADAM_STEP_BYTES_PER_TENSOR * len(shapes)
        return {"parameters": p * held, "gradients": p * held, "optimizer_state": state}
    numels = [math.prod(shape) for shape in shapes]
    owners = assign_owners([p * n for n in numels], world_size)  # ZeRO-1's and ZeRO-2's owners
    per_rank = []
    for r in range(world_size):
        owned = [n for n, owner in zip(numels, owners) if owner == r]
        stated = numels if mode == "unsharded" else owned
        state = ADAM_MOMENTS * p * sum(stated) + ADAM_STEP_BYTES_PER_TENSOR * len(stated)
        per_rank.append((p * sum(numels), p * sum(owned if mode == "zero2" else numels), state))
    values = per_rank[rank] if rank is not None else map(max, zip(*per_rank))
    return dict(zip(("parameters", "gradients", "optimizer_state"), values))


# How ``expected_bytes`` shards each memory model of the catalogue (``Entry.memory``; the rest: unsharded), and the
# memory models whose communication buffers are kept across steps.
# hsdp's model (``hybrid_sharded``) is fsdp2's over its shard group of ``shard_size`` ranks.
_SHARDING = {"zero1": "reduce_scatter", "zero2": "zero2", "fully_sharded": "fully_sharded",
             "hybrid_sharded": "fully_sharded"}
_FULLY_SHARDED = ("fully_sharded", "hybrid_sharded")
_PERSISTENT_BUFFERS = ("per_tensor", "bucketed", "full_buckets", *_FULLY_SHARDED)


def _strategy_memory(strategy: str, world_size: int, bucket_size_mb: BucketSize) -> tuple[str, int | None]:
    """The memory model of ``strategy`` and its bucket cap in bytes (None: one bucket; ``bucket_size_mb`` None:
    the strategy's default), from its catalogue entry."""
    if strategy.startswith("single") or (strategy == "auto" and world_size == 1):  # one process: no buffers
        return "none", None
    # auto on several ranks, and Lightning's DDP variants (spawn, fork, notebook, find_unused_parameters): its DDP
    name = "ddp" if strategy == "auto" or strategy.startswith("ddp") else strategy
    if name not in catalogue.STRATEGIES:
        raise ValueError(
            f"strategy {strategy!r} has no memory model; choose one of auto, {', '.join(catalogue.STRATEGIES)} "
            "(--trainer.strategy), or skip the check with --preflight false."
        )
    entry = catalogue.get(name)
    size = entry.default_bucket_size_mb if bucket_size_mb is None else bucket_size_mb
    if size == "auto":  # predicted at start-up from a microbenchmark; the default cap is representative
        size = catalogue.DEFAULT_BUCKET_SIZE_MB
    if entry.memory == "per_tensor":  # one tensor per bucket (sync/overlap.py): a cap of 1 byte
        return "bucketed", 1
    return entry.memory, bucket_cap_bytes(None if size is None else float(size))


def activation_bytes_per_token(d_model: int, d_ff: int, precision: str = "32-true") -> int:
    """Bytes one ``Block`` saves for backward per token: the fitted ``a·d_model + b·d_ff + c``."""
    a, b, c = _PRECISIONS[normalize_precision(precision)].block_saved
    return a * d_model + b * d_ff + c


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for a training step: ``parts`` by category (parameters, gradients, optimizer_state,
    bucket_buffers, regrown_gradients, low_precision_weights, activations, overhead); ``phases``, groups of parts not
    alive at once (the peak holds the largest group and every part in none); a ``description`` for messages."""

    parts: dict[str, int]
    phases: tuple[tuple[str, ...], ...] = ()
    description: str = ""

    @property
    def total_bytes(self) -> int:
        """The peak: the parts outside ``phases`` plus the largest phase."""
        grouped = {name for phase in self.phases for name in phase}
        persistent = sum(v for k, v in self.parts.items() if k not in grouped)
        largest = max((sum(self.parts.get(k, 0) for k in phase) for phase in self.phases), default=0)
        return persistent + largest

    def table(self) -> str:
        """A small breakdown in GiB: one line per part, then the peak."""
        lines = [f"{name:<22}{value / GiB:>5.2f} GiB" for name, value in self.parts.items()]
        if self.phases:
            phase_text = " | ".join(" + ".join(phase) for phase in self.phases)
            lines.append(f"{'sum of parts':<22}{sum(self.parts.values()) / GiB:>5.2f} GiB (not at once: {phase_text})")
        lines.append(f"{'peak per rank':<22}{self.total_bytes / GiB:>5.2f} GiB")
        return "\n".join(lines)


def _buffer_bytes(config: GPTConfig, model: str, cap: int | None, numels: Sequence[int],
                  p: int) -> tuple[int, int, int]:
    """(buffer bytes, gradient bytes beside the rank's own, scalars whose ``.grad`` is a view into a buffer) of
    memory model ``model``."""
    total = p * sum(numels)
    if model in ("packed", "full_buckets", "zero1"):  # one buffer the size of all gradients (torch DDP's buckets)
        return total, 0, 0
    if model == "zero2":
        return zero2_buffer_bytes(cap, total), 0, 0
    if model in _FULLY_SHARDED:  # unsharded beside the shards: the root group and two blocks, one block's gradients
        root, blocks = fsdp2_groups(config)
        unsharded = fully_sharded_unsharded_peak(root, blocks)
        return p * unsharded.parameters, p * unsharded.gradients, 0
    buffer_bytes = viewed = 0
    if model == "bucketed":  # the buffers the engine keeps (sync/bucketed.py), by the shared rule
        buckets = assign_buckets([p * n for n in numels], ["same"] * len(numels), cap)
        for b, indices in enumerate(buckets):
            if owns_buffer(b, len(buckets), len(indices)):
                gradient_numels = [numels[i] for i in indices]
                viewed += sum(gradient_numels)  # their .grad become views into the buffer
                buffer_bytes += p * buffer_numel(b, len(buckets), gradient_numels)
    return buffer_bytes, 0, viewed


def fsdp2_groups(config: GPTConfig) -> tuple[int, list[int]]:
    """``fsdp2`` on our GPT (one group per ``Block``): scalars of the root group, and of each block in order."""
    root, blocks = 0, {}
    for name, shape in gpt_parameter_shapes(config).items():
        if name.startswith("blocks."):
            key = name.split(".")[1]
            blocks[key] = blocks.get(key, 0) + math.prod(shape)
        else:
            root += math.prod(shape)
    return root, list(blocks.values())


def estimate_rank_memory(
    config: GPTConfig,
    *,
    batch_size: int,
    seq_len: int,
    precision: str,
    strategy: str,
    world_size: int,
    bucket_size_mb: BucketSize = None,
    device_type: Literal["cuda", "cpu"] = "cuda",
    sharded_by: str | None = None,
    shard_size: int | None = None,
) -> MemoryEstimate:
    """Bytes one rank needs to train ``config`` at ``batch_size`` x ``seq_len`` tokens (docs/memory.md); ``strategy``
    a catalogue name or Lightning's ``auto``/``ddp`` variants, ``bucket_size_mb`` None its default,
    ``sharded_by`` the entry sharding the state over the strategy's engine (ZeRO-1 over an all-reducing one),
    ``shard_size`` hsdp's ranks per shard group (None: every rank, one node; the CLI passes the devices per node)."""
    shard_size = world_size if shard_size is None else shard_size
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size),
                        ("shard_size", shard_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    spec = _PRECISIONS[normalize_precision(precision)]
    p = spec.param_bytes
    shapes = list(gpt_parameter_shapes(config).values())
    numels = [math.prod(s) for s in shapes]
    model, cap = _strategy_memory(strategy, world_size, bucket_size_mb)
    mode = _SHARDING.get(model, "reduce_scatter" if sharded_by else "unsharded")
    if model == "hybrid_sharded" and world_size % shard_size:
        raise ValueError(f"hsdp: shard_size {shard_size} does not divide the world of {world_size} ranks; set "
                         "shard_size to a divisor of it (--trainer.strategy.init_args.shard_size)")
    held = expected_bytes(shapes, shard_size if model == "hybrid_sharded" else world_size, mode, None, p)
    buffer_bytes, gathered_gradient, viewed = _buffer_bytes(config, model, cap, numels, p)
    # Autocast's half-precision copies for the matmuls: every matrix but the embedding table, unless it is tied (it
    # then serves as lm_head, and its copy is made for the matmul).
    matmul_weights = sum(n for s, n in zip(shapes, numels) if len(s) == 2)
    if not config.tie_embeddings:
        matmul_weights -= config.vocab_size * config.d_model
    # Saved for backward per token: every block, the final norm and the logits (docs/memory.md).
    half_logits = 2 if (spec.autocast or p == 2) else 0
    per_token = config.n_layers * activation_bytes_per_token(config.d_model, config.d_ff, precision)
    per_token += 8 * config.d_model + (12 + half_logits) * config.vocab_size
    parts = {
        "parameters": held["parameters"],
        "gradients": held["gradients"] + gathered_gradient - p * viewed,
        "optimizer_state": held["optimizer_state"],
        "bucket_buffers": buffer_bytes,
        "regrown_gradients": p * viewed,
        "low_precision_weights": 2 * matmul_weights if spec.autocast else 0,
        "activations": batch_size * seq_len * per_token,
        "overhead": CUDA_OVERHEAD_BYTES if device_type == "cuda" else CPU_OVERHEAD_BYTES,
    }
    step_phase = ("gradients", "regrown_gradients") + (() if model in _PERSISTENT_BUFFERS else ("bucket_buffers",))
    phases = (("activations", "low_precision_weights"), step_phase)
    millions = held["parameters"] / p / 1e6
    description = (
        f"d_model {config.d_model} x {config.n_layers} layers ({millions:,.0f}M parameters), batch {batch_size} x "
        f"{seq_len} tokens, {normalize_precision(precision)}, {strategy}"
        f"{f' (shard_size {shard_size})' if model == 'hybrid_sharded' else ''} on {world_size} {device_type} "
        f"rank{'s' if world_size > 1 else ''}"
    )
    return MemoryEstimate(parts=parts, phases=phases, description=description)


def largest_batch(config: GPTConfig, *, budget_bytes: int, max_batch: int = 1024, **estimate_kwargs: Any) -> int:
    """The largest ``batch_size`` <= ``max_batch`` whose estimate (``estimate_kwargs``) fits; 0 if not even 1 does."""

    def too_large(batch: int) -> bool:
        return estimate_rank_memory(config, batch_size=batch, **estimate_kwargs).total_bytes > budget_bytes

    # The estimate grows with the batch: bisect for the first batch that does not fit (the count of those that do).
    return bisect.bisect_left(range(1, max_batch + 1), True, key=too_large)


def memory_budget_bytes(device_type: Literal["cuda", "cpu"], ranks_per_device: int) -> int:
    """Bytes one rank may use: the current GPU's memory or the host's available RAM, over the ranks sharing it."""
    if not isinstance(ranks_per_device, int) or ranks_per_device < 1:
        raise ValueError(f"ranks_per_device must be a positive integer, got {ranks_per_device!r}")
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device_type 'cuda' but no CUDA device is visible; use device_type='cpu'")
        total, _ = torch.cuda.mem_get_info(torch.cuda.current_device())  # (free, total)
    else:
        total = _available_ram_bytes()
    return total // ranks_per_device


def _available_ram_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (free plus reclaimable cache); elsewhere the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class MemoryPreflightError(ValueError):
    """The estimated peak of one rank exceeds its memory budget (raised before anything starts)."""


def preflight(gpt: Callable[[str], GPTConfig], preset: str, budget_bytes: int, budget_source: str, *,
              batch_size: int, processes: int = 1, **estimate_kwargs: Any) -> None:
    """Raise ``MemoryPreflightError`` if one rank's estimate exceeds ``budget_bytes``, with the breakdown and the fixes
    (each with its peak); ``gpt(preset)`` a preset's model, ``processes`` CPU processes share the host."""
    from lightning_ddp.model import PRESETS  # torch: this module imports it only where a function needs it

    def estimate(name: str = preset, batch: int = batch_size, **overrides: Any) -> MemoryEstimate:
        return estimate_rank_memory(gpt(name), batch_size=batch, **{**estimate_kwargs, **overrides})

    def outcome(e: MemoryEstimate) -> str:
        return f"peak {e.total_bytes / GiB:.1f} GiB, {'fits' if e.total_bytes <= budget_bytes else 'not enough alone'}"

    current = estimate()
    if current.total_bytes <= budget_bytes:
        return
    fixes = []  # each change that lowers the peak, with the peak it would give; the largest batch that fits first
    best = largest_batch(gpt(preset), budget_bytes=budget_bytes, max_batch=max(batch_size - 1, 1), **estimate_kwargs)
    if best and best < batch_size:
        fixes.append(f"--data.batch_size {best} ({outcome(estimate(batch=best))}; the largest that fits)")
    elif batch_size > 1:
        fixes.append(f"--data.batch_size 1 ({outcome(estimate(batch=1))})")
    candidates = []
    if normalize_precision(estimate_kwargs["precision"]) == "32-true":
        candidates.append(("--trainer.precision bf16-mixed", estimate(precision="bf16-mixed")))
    # Each sharding of the catalogue, with what it would make fit (sharding the state changes nothing there); hsdp
    # where its shard group is not the world (there it is fsdp2).
    world_size = estimate_kwargs["world_size"]
    one_group = (estimate_kwargs.get("shard_size") or world_size) >= world_size
    for entry in catalogue.STRATEGIES.values() if world_size > 1 else ():
        if entry.memory == "hybrid_sharded" and one_group:
            continue
        if entry.sharded and entry.name not in (estimate_kwargs["strategy"], estimate_kwargs.get("sharded_by")):
            candidates.append((f"--trainer.strategy {entry.name}", estimate(strategy=entry.name, bucket_size_mb=None)))
    smaller = list(PRESETS)[: list(PRESETS).index(preset)] if preset in PRESETS else []
    fitting = [name for name in smaller if estimate(name).total_bytes <= budget_bytes]
    if fitting:
        candidates.append((f"--model.preset {fitting[-1]}", estimate(fitting[-1])))
    fixes.extend(f"{flag} ({outcome(e)})" for flag, e in candidates if e.total_bytes < current.total_bytes)
    if processes > 1:
        one = estimate(world_size=1)
        if one.total_bytes <= budget_bytes * processes:
            fixes.append(f"--trainer.devices 1 (one process with all {budget_bytes * processes / GiB:.1f} GiB: peak "
                         f"{one.total_bytes / GiB:.1f} GiB, fits)")
    fixes.append("--preflight false skips this check (the estimate and its sources: lightning_ddp/memory.py)")
    # "out of memory" also lets the benchmark sweep's runner record a refused cell as `oom`.
    lines = [f"Memory pre-flight: this run would run out of memory: it needs about {current.total_bytes / GiB:.1f} "
             f"GiB per rank, but a rank has {budget_bytes / GiB:.1f} GiB ({budget_source}).",
             f"Estimated for {current.description}:", *("  " + line for line in current.table().splitlines()),
             "Fixes:", *(f"  - {fix}" for fix in fixes)]
    raise MemoryPreflightError("\n".join(lines))


def print_estimate(
    preset: str = "tiny",
    vocab_size: int = 10_000,
    batch_size: int = 4,
    seq_len: int = 128,
    precision: str = "32-true",
    strategy: str = catalogue.DEFAULT_ENGINE,
    world_size: int = 2,
    bucket_size_mb: Optional[float] = None,
    device_type: Literal["cuda", "cpu"] = "cuda",
    shard_size: Optional[int] = None,
) -> None:
    """Print the estimated peak memory of one rank, category by category (``bucket_size_mb`` None: the strategy's
    own; ``shard_size`` hsdp's ranks per shard group, None: every rank; the options: ``docs/memory.md``)."""
    from lightning_ddp.model import get_config  # torch: this module imports it only where a function needs it

    config = get_config(preset, vocab_size=vocab_size, context_length=seq_len)
    estimate = estimate_rank_memory(
        config, batch_size=batch_size, seq_len=seq_len, precision=precision, strategy=strategy,
        world_size=world_size, bucket_size_mb=bucket_size_mb, device_type=device_type, shard_size=shard_size,
    )
    print(estimate.description)
    print(estimate.table())


if __name__ == "__main__":  # python -m lightning_ddp.memory --preset xl ... (--help)
    from jsonargparse import auto_cli

    auto_cli(print_estimate, prog="python -m lightning_ddp.memory")
