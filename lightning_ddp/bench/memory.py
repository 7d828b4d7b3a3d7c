"""``python -m lightning_ddp.bench.memory --config configs/memory/cpu.yaml``: per-rank memory and step time of the
data-parallel family beside ``lightning_ddp.memory``'s analytic figures (the measurement; ``memory_report`` the
report; docs/benchmarks.md the recipe)."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist

from lightning_ddp import catalogue
from lightning_ddp.bench.engine_step import forward_backward
from lightning_ddp.bench.memory_report import (
    FSDP2, MODE_LABELS, PLOT_NAME, MiB, family_summary, format_report, summarise_modes, write_memory_plot,
)
from lightning_ddp.bench.study import provenance, read_json, spawn_ranks, write_outputs
from lightning_ddp.files import write_atomically
from lightning_ddp.local_group import cores_per_rank, init_local_process_group
from lightning_ddp.memory import FP32, expected_bytes

__all__ = ["MODES", "MemoryBenchConfig", "main", "parse_config", "run", "write_report"]

MODES: tuple[str, ...] = tuple(MODE_LABELS)
"""The measured configurations: plain AdamW, ZeRO-1 under each schedule, ZeRO-2, then torch's FSDP2."""


@dataclass
class MemoryBenchConfig:
    """Per-rank memory (parameters, gradients, optimizer state, rest) and step time of the data-parallel family."""

    preset: str = "small"
    """Model size by name (``lightning_ddp.model.PRESETS``): tiny, small, medium, large, xl, 2.7b."""
    vocab_size: int = 10_000
    """Vocabulary size of the model (and the range of the random tokens)."""
    batch_size: int = 2
    """Sequences per rank and step."""
    seq_len: int = 64
    """Tokens per sequence (also the model's context length)."""
    devices: int = 2
    """Number of ranks (the world size): processes on CPU, one GPU each on CUDA."""
    steps: int = 12
    """Optimizer steps per mode, warm-up included; the snapshots are taken in the last."""
    warmup_steps: int = 2
    """The first steps, left out of the step time (the first allocates the optimizer state); >= 1, 2 must remain."""
    accelerator: Literal["cpu", "cuda"] = "cpu"
    """Where the model lives. CPU measures our tensors exactly and RSS; CUDA uses ``torch.cuda.memory_allocated``."""
    backend: Optional[Literal["gloo", "nccl"]] = None
    """Process-group backend; default gloo on CPU, NCCL on CUDA."""
    modes: list[str] = field(default_factory=lambda: list(MODES))
    """Which of unsharded, allreduce_broadcast, reduce_scatter, zero2, fsdp2 to measure, in this order."""
    grad_sync: str = catalogue.DEFAULT_ENGINE
    """The engine that all-reduces gradients for unsharded and allreduce_broadcast (a catalogue engine name)."""
    bucket_size_mb: Optional[float] = 25.0
    """Bucket cap in MiB of a ``grad_sync`` algorithm with buckets (null: one bucket); ignored by the others."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (on every parameter: the measurement does not depend on it)."""
    seed: int = 0
    """Seed of the model's initial weights and of the random tokens."""
    separate_processes: bool = True
    """Each mode in fresh processes (an honest RSS per mode); false: one set, faster, an earlier mode's freed memory
    may stay in a later one's RSS."""
    out_dir: str = "logs/memory"
    """Directory for results.json, results.md and the plot (replaced; logs/ is git-ignored)."""
    report_only: bool = False
    """Measure nothing: rebuild results.md and the plot from ``out_dir``'s results.json."""

    def __post_init__(self) -> None:
        from lightning_ddp.model import PRESETS

        if self.preset not in PRESETS:
            raise ValueError(f"{self.preset!r} is not a supported preset; choose one of: {', '.join(PRESETS)} "
                             "(--preset)")
        for name in ("vocab_size", "batch_size", "seq_len", "devices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)} (--{name})")
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}: the first step allocates the "
                             "optimizer state (--warmup_steps 2)")
        if self.steps < self.warmup_steps + 2:
            raise ValueError(f"steps must be >= warmup_steps + 2 = {self.warmup_steps + 2}, got {self.steps}: the "
                             f"step-time interval needs at least 2 measured steps (--steps {self.warmup_steps + 10})")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes {unknown or self.modes!r} are not valid; choose from {', '.join(MODES)} (--modes)")
        if self.backend == "nccl" and self.accelerator != "cuda":
            raise ValueError("backend nccl needs accelerator cuda; use --backend gloo on CPU")
        if self.grad_sync not in catalogue.names(engines_only=True):
            raise ValueError(f"{self.grad_sync!r} is not one of our engines; choose from "
                             f"{', '.join(catalogue.names(engines_only=True))} (--grad_sync)")


def resolved_backend(config: MemoryBenchConfig) -> str:
    return config.backend or ("nccl" if config.accelerator == "cuda" else "gloo")


def _current_rss_bytes() -> int | None:
    """Resident set size now (Linux ``/proc/self/statm``); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _tensor_bytes(tensors, device: torch.device | None = None) -> int:
    """Bytes of distinct tensors (by data pointer), optionally only those on ``device``'s type."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or t.data_ptr() in seen or (device is not None and t.device.type != device.type):
            continue
        seen.add(t.data_ptr())
        total += t.nbytes
    return total


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, Any]:
    """The bytes of this rank's parameters, gradients and optimizer state (local shards), and the process's memory."""
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters()]
    state = [_local(v) for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v)]
    snap: dict[str, Any] = {
        "parameters": _tensor_bytes(params),
        "gradients": _tensor_bytes(grads),
        "optimizer_state": _tensor_bytes(state),
        "optimizer_state_tensors": len(optimizer.state),
    }
    owned = snap["parameters"] + snap["gradients"] + snap["optimizer_state"]
    if device.type == "cuda":
        on_device = _tensor_bytes(params, device) + _tensor_bytes(grads, device) + _tensor_bytes(state, device)
        snap["allocated"] = torch.cuda.memory_allocated(device)
        snap["max_allocated"] = torch.cuda.max_memory_allocated(device)
        # The caching allocator's reservation (blocks cached for reuse, fragmentation): what the GPU really lends.
        snap["reserved"] = torch.cuda.memory_reserved(device)
        snap["max_reserved"] = torch.cuda.max_memory_reserved(device)
        snap["rest"] = snap["allocated"] - on_device
    else:
        rss = _current_rss_bytes()
        snap["rss"] = rss
        snap["rest"] = None if rss is None else rss - owned
        snap["max_rss"] = _peak_rss_bytes()
    return snap


def _peak_rss_bytes() -> int | None:
    """The process's peak resident set size so far (``getrusage``; Linux reports KiB); None where unavailable."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)  # macOS reports bytes


def _build_mode(mode: str, config: MemoryBenchConfig, model: torch.nn.Module, recorder: Any):
    """The mode's engine (FSDP2: the sharded model itself) and optimizer, ours reporting collectives to ``recorder``."""
    from lightning_ddp.sync import DeferredGradSync, ShardedOptimizer

    adamw = {"lr": config.lr, "weight_decay": config.weight_decay}
    if mode == FSDP2:
        from lightning_ddp.strategies.fsdp2 import shard

        shard(model)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if mode == "reduce_scatter":
        engine = DeferredGradSync(model)
    elif mode == "zero2":
        from lightning_ddp.sync.zero2 import ZeRO2DDP

        engine = ZeRO2DDP(model, bucket_size_mb=config.bucket_size_mb)
    else:
        algorithm = catalogue.get(config.grad_sync)
        engine = algorithm.make_engine(model, bucket_size_mb=config.bucket_size_mb if algorithm.has_bucket_size
                                       else "default")
    engine.recorder = recorder
    if mode == "unsharded":
        return engine, torch.optim.AdamW(model.parameters(), **adamw)
    if mode == "zero2":
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, schedule="reduce_in_backward",
                                     placement=engine.owner_of, **adamw)
    else:
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, schedule=mode, **adamw)
    optimizer.recorder = recorder  # the optimizer's collectives join the engine's per-step record
    return engine, optimizer


def _fresh_model(config: MemoryBenchConfig, device: torch.device) -> torch.nn.Module:
    """The seeded GPT on ``device``, after freeing what the previous mode left (and resetting the CUDA peak)."""
    from lightning_ddp.model import GPT, get_config

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(config.seed)
    return GPT(get_config(config.preset, vocab_size=config.vocab_size, context_length=config.seq_len)).to(device)


def _fsdp2_transient_bytes(model: torch.nn.Module) -> int:
    """What FSDP2 holds beyond its shards at the peak, fp32: the largest group's unsharded parameters and gradients
    (one group per block, the root the rest; ``shard``), gathered while that group's backward runs."""
    from lightning_ddp.strategies.fsdp2 import DEFAULT_SHARD_MODULES, modules_to_shard

    blocks, _ = modules_to_shard(model, DEFAULT_SHARD_MODULES)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    groups = [sum(p.numel() for p in block.parameters()) for block in blocks]
    groups.append(sum(p.numel() for p in model.parameters() if id(p) not in in_blocks))
    return 2 * FP32 * max(groups)


def _paused_snapshot(snapshot: Callable[[], dict[str, Any]], device: torch.device) -> tuple[dict[str, Any], float]:
    """``snapshot()`` and the seconds it took (left out of the step's time); the CUDA peak restarts after it, so
    the next snapshot's ``max_allocated`` is what happened in between."""
    _sync(device)
    start = time.perf_counter()
    taken = snapshot()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return taken, time.perf_counter() - start


def _run_steps(engine: Any, optimizer: torch.optim.Optimizer, config: MemoryBenchConfig, device: torch.device,
               rank: int, snapshot: Callable[[], dict[str, Any]], recorder: Any) -> tuple[dict, list, Any]:
    """``config.steps`` steps on random tokens: the snapshots (set-up, and around the last step's ``step()``),
    every step's ms, max over ranks (the slowest rank sets the pace), and the last step's record of collectives
    (``recorder`` given)."""
    _sync(device)
    snapshots = {"setup": snapshot()}
    generator = torch.Generator().manual_seed(config.seed * 1000 + rank)
    step_ms: list[float] = []
    record = None
    for step in range(config.steps):
        # tokens (B, T + 1): inputs are [:, :-1], targets [:, 1:]
        tokens = torch.randint(config.vocab_size, (config.batch_size, config.seq_len + 1), generator=generator)
        tokens = tokens.to(device)
        if recorder is not None:
            recorder.open_step(step)
        last = step == config.steps - 1
        _sync(device)
        start = time.perf_counter()
        forward_backward(engine, tokens[:, :-1], tokens[:, 1:])
        paused = 0.0
        if last:
            snapshots["before_step"], paused = _paused_snapshot(snapshot, device)
        optimizer.step()
        if last:
            snapshots["after_step"], seconds = _paused_snapshot(snapshot, device)
            paused += seconds
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        step_ms.append((time.perf_counter() - start - paused) * 1e3)
        record = recorder.finish_step() if recorder is not None else None
    times = torch.tensor(step_ms, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return snapshots, times.tolist(), record


def _measure_mode(mode: str, config: MemoryBenchConfig, device: torch.device, rank: int) -> dict[str, Any]:
    from lightning_ddp.memory import zero2_gradient_peak_bytes
    from lightning_ddp.sync import Recorder

    model = _fresh_model(config, device)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    num_params = sum(math.prod(s) for s in shapes)
    world_size = dist.get_world_size()
    transient = _fsdp2_transient_bytes(model) if mode == FSDP2 else 0
    # counts the bytes and calls of every step's collectives; FSDP2's are torch's: none recorded
    recorder = None if mode == FSDP2 else Recorder(device)
    engine, optimizer = _build_mode(mode, config, model, recorder)
    snapshots, step_ms, record = _run_steps(engine, optimizer, config, device, rank,
                                            lambda: _snapshot(model, optimizer, device), recorder)
    result = {
        "mode": mode,
        "rank": rank,
        "snapshots": snapshots,
        "expected": expected_bytes(shapes, world_size, "fully_sharded" if mode == FSDP2 else mode, rank),
        "full_parameter_bytes": FP32 * num_params,
        "step_ms": step_ms,
        "comm_bytes_recorded": None if record is None else record.nbytes,
        "comm_calls": None if record is None else len(record.collectives),
        "num_params": num_params,
        "num_tensors": len(shapes),
        "shard_bytes": getattr(optimizer, "shard_bytes", None),
        "expected_transient": transient,
    }
    if mode == "zero2":
        cap = None if config.bucket_size_mb is None else int(config.bucket_size_mb * MiB)
        result["expected_gradient_peak"] = zero2_gradient_peak_bytes(shapes, world_size, rank, cap)
        # beyond the held shard, during backward: the buckets in flight and the one filling
        result["expected_transient"] = result["expected_gradient_peak"] - result["expected"]["gradients"]
    del engine, optimizer, model
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(rank: int, world_size: int, port: int, config: MemoryBenchConfig, modes: list[str],
               result_file: str) -> None:
    cuda = config.accelerator == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    # CPU ranks share the machine's cores; oversubscribing them only adds noise.
    init_local_process_group(rank, world_size, port, resolved_backend(config),
                             threads=None if cuda else cores_per_rank(world_size))
    try:
        results = [_measure_mode(mode, config, device, rank) for mode in modes]
        gathered: list[Any] = [None] * world_size if rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(results, gathered, dst=0)
        if rank == 0:
            write_atomically(Path(result_file), json.dumps(gathered))
        # Both ranks done with the group before either tears it down: a rank destroying it while its peer's gloo
        # thread still holds the pair aborted ("terminate called without an active exception", SIGABRT) under load.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(config: MemoryBenchConfig) -> dict[str, Any]:
    """Spawn the ranks, measure every mode, write ``results.json`` and ``results.md``; return the results."""
    if config.accelerator == "cuda" and torch.cuda.device_count() < config.devices:
        raise ValueError(f"devices={config.devices} needs as many GPUs, but {torch.cuda.device_count()} are visible; "
                         "lower --devices or use --accelerator cpu")
    out_dir = Path(config.out_dir)
    # Fresh processes per mode: memory an earlier mode freed may stay with the allocator (glibc keeps freed heap
    # pages), which would show up in the next mode's RSS.
    batches = [[mode] for mode in config.modes] if config.separate_processes else [list(config.modes)]
    per_mode = []
    for modes in batches:
        per_rank = spawn_ranks(_rank_main, config.devices, config, modes)  # [rank][mode index] -> one rank's result
        per_mode += [[per_rank[r][m] for r in range(config.devices)] for m in range(len(modes))]
    cuda = config.accelerator == "cuda" and torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine() or "cpu")
    # results.json's environment: the study's provenance, the device, CPUs and backend
    environment = provenance(config.out_dir, device=device, cpu_count=os.cpu_count(),
                             cuda=torch.version.cuda if cuda else None, backend=resolved_backend(config),
                             world_size=config.devices)
    results = {"config": asdict(config), "environment": environment,
               "modes": summarise_modes(config.modes, config.devices, per_mode, warmup_steps=config.warmup_steps,
                                        seed=config.seed)}
    results["family"] = family_summary(results)
    write_outputs(out_dir, {"results.json": results})
    return write_report(results, out_dir)


def write_report(results: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """results.md and the plot from ``results`` (what results.json holds); returns ``results``."""
    report = format_report(results)
    write_outputs(out_dir, {"results.md": report})
    write_memory_plot(results, out_dir / PLOT_NAME)
    print(report, flush=True)
    return results


def parse_config(args: list[str] | None = None) -> MemoryBenchConfig:
    from lightning_ddp.command_line import parse_dataclass

    return parse_dataclass(MemoryBenchConfig, args, prog="python -m lightning_ddp.bench.memory")


def main(args: list[str] | None = None) -> int:
    config = parse_config(args)
    if config.report_only:
        out_dir = Path(config.out_dir)
        results = write_report(read_json(out_dir / "results.json"), out_dir)
    else:
        results = run(config)
    return 0 if all(mode["matches_expected"] for mode in results["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
