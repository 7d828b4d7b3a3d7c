"""``python -m lightning_ddp.bench.memory_per_rank --config configs/memory/cpu.yaml``: per-rank memory and step time
of the data-parallel family beside ``lightning_ddp.memory``'s figures, with verdicts and a plot (docs/benchmarks.md)."""

from __future__ import annotations

import gc
import io
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, NamedTuple, Optional

import torch
import torch.distributed as dist
from jsonargparse.typing import PositiveInt

from lightning_ddp import catalogue
from lightning_ddp.bench.config import strategy_with_memory_model
from lightning_ddp.bench.engine_step import (
    InProcessConfig, all_reduced, random_tokens, seeded_model, sync, timed_step,
)
from lightning_ddp.bench.stats import estimate, interval_text, ratio_estimate, verdict
from lightning_ddp.bench.study import benchmark_main, json_report, provenance, run_ranks, write_outputs
from lightning_ddp.files import write_atomically
from lightning_ddp.memory import FP32, expected_bytes, fsdp2_groups
from lightning_ddp.model import PRESETS
from lightning_ddp.reporting.tables import Column, markdown_table, table, text_cell
from lightning_ddp.sync.memory_model import MiB, bucket_cap_bytes, zero2_buffer_bytes

if TYPE_CHECKING:
    from lightning_ddp.strategies.hsdp import HybridLayout

TENSORS = ("parameters", "gradients", "optimizer_state")  # the categories measured and expected
POINTS = ("setup", "before_step", "after_step")  # after set-up; on the last step, before and after step()
FSDP2 = strategy_with_memory_model("fully_sharded")  # torch's FSDP2, by its catalogue name
HSDP = strategy_with_memory_model("hybrid_sharded")  # FSDP2 over a (replicate, shard) mesh
FULLY_SHARDED_MODES = (FSDP2, HSDP)
# The catalogue engine of each mode that has its own (the others: ``grad_sync``).
ENGINES = {"reduce_scatter": strategy_with_memory_model("zero1"), "zero2": strategy_with_memory_model("zero2")}


class Mode(NamedTuple):
    """A mode's label, its ``ShardedOptimizer`` schedule (None: AdamW) and the one-way passes of the parameters'
    bytes each rank sends per step (bandwidth-optimal collectives)."""

    label: str
    schedule: Optional[str]
    one_ways: int


MODE_TABLE: dict[str, Mode] = {  # the measured modes in order
    "unsharded": Mode("DDP", None, 2),  # an all-reduce
    "allreduce_broadcast": Mode("ZeRO-1 (all-reduce + broadcast)", "allreduce_broadcast", 3),
    "reduce_scatter": Mode("ZeRO-1 (reduce-scatter)", "reduce_scatter", 2),
    "zero2": Mode("ZeRO-2", "reduce_in_backward", 2),
    FSDP2: Mode("FSDP2", None, 3),  # two all-gathers and a reduce-scatter
    HSDP: Mode("HSDP", None, 3),  # FSDP2's in each shard group, and an all-reduce of a shard across the replicas
}
MODES: tuple[str, ...] = tuple(MODE_TABLE)
"""The measured modes' keys, in the order they run and are reported."""
ZERO1 = "reduce_scatter"  # the ZeRO-1 schedule of ZeRO-2's step goal (the same communication volume)
STEP_GOAL = 1.10  # ZeRO-2's step at most 10 % over ZeRO-1's
PLOT_NAME = "memory_vs_step_time.png"
"""The picture written beside results.md: each mode's peak memory against its step time."""


@dataclass
class MemoryBenchConfig(InProcessConfig):
    """Per-rank memory (parameters, gradients, optimizer state, rest) and step time of the data-parallel family."""

    repeats: int = 1
    """Must be 1: one run per mode."""
    steps: int = 12
    """Optimizer steps per mode, warm-up included; the snapshots are taken in the last."""
    warmup_steps: int = 2
    """The first steps, left out of the step time (the first allocates the optimizer state); >= 1, 2 must remain."""
    seed: int = 0
    """Seed of the model's initial weights, of the random tokens and of the bootstrap."""
    out_dir: str = "logs/memory"
    """Directory for results.json, results.md and the plot (replaced; logs/ is git-ignored)."""
    preset: Literal[tuple(PRESETS)] = "small"  # type: ignore[valid-type]
    """Model size by name (``lightning_ddp.model.PRESETS``)."""
    batch_size: PositiveInt = 2
    """Sequences per rank and step."""
    devices: PositiveInt = 2
    """Number of ranks (the world size): processes on CPU, one GPU each on CUDA."""
    accelerator: Literal["cpu", "cuda"] = "cpu"
    """Where the model lives. CPU measures our tensors exactly and RSS; CUDA uses ``torch.cuda.memory_allocated``."""
    backend: Optional[Literal["gloo", "nccl"]] = None
    """Process-group backend; default (null) gloo on CPU, NCCL on CUDA."""
    modes: list[Literal[MODES]] = field(default_factory=lambda: list(MODES))  # type: ignore[valid-type]
    """Which of unsharded, allreduce_broadcast, reduce_scatter, zero2, fsdp2, hsdp to measure, in this order."""
    hsdp_shard_size: Optional[PositiveInt] = None
    """hsdp's ranks per shard group; null: half the ranks (2 replicas; on 2 ranks 1: replicated). It must divide
    ``devices``."""
    grad_sync: Literal[tuple(catalogue.names(engines_only=True))] = catalogue.DEFAULT_ENGINE  # type: ignore
    """The engine that all-reduces gradients for unsharded and allreduce_broadcast (a catalogue engine name)."""
    bucket_size_mb: Optional[float] = 25.0
    """Bucket cap in MiB of a ``grad_sync`` algorithm with buckets (null: one bucket); ignored by the others."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (on every parameter: the measurement does not depend on it)."""
    separate_processes: bool = True
    """Each mode in fresh processes (an honest RSS per mode); false: one set, faster, an earlier mode's freed memory
    may stay in a later one's RSS."""

    def __post_init__(self) -> None:
        """Refuses repeats other than 1, no modes, fewer than 2 measured steps after at least 1 warm-up step, and
        nccl without CUDA; an unset ``backend`` becomes nccl on CUDA, gloo on CPU."""
        super().__post_init__()
        if self.repeats != 1:
            raise ValueError(f"repeats must be 1 (one run per mode), got {self.repeats}; drop --repeats")
        if not self.modes:
            raise ValueError("modes is empty; e.g. --modes '[unsharded, zero2]'")
        if not 1 <= self.warmup_steps <= self.steps - 2:
            raise ValueError(f"warmup_steps must be >= 1 (the first step allocates the optimizer state) and steps "
                             f">= warmup_steps + 2 = {self.warmup_steps + 2} (2 measured steps), got "
                             f"{self.warmup_steps} and {self.steps}")
        if HSDP in self.modes:
            self.hsdp_shard_size = hybrid_layout(self).shard_size  # refuses one that does not divide the ranks
        if self.backend == "nccl" and self.accelerator != "cuda":
            raise ValueError("backend nccl needs accelerator cuda; use --backend gloo on CPU")
        self.backend = self.backend or ("nccl" if self.accelerator == "cuda" else "gloo")


def hybrid_layout(config: MemoryBenchConfig) -> HybridLayout:
    """hsdp's replicas x shard groups over ``config.devices`` ranks (``ValueError`` naming the divisors). A function,
    not a method: the command line would offer a config's public method as a subcommand."""
    from lightning_ddp.strategies.hsdp import HybridLayout  # Lightning's import, only where hsdp is measured

    shard_size = config.hsdp_shard_size or max(1, config.devices // 2)
    return HybridLayout.of(config.devices, shard_size, " (--devices; set --hsdp_shard_size)")


def _tensor_bytes(tensors, device: torch.device | None = None) -> int:
    """Bytes of distinct tensors (by data pointer), optionally only those on ``device``'s type."""
    distinct = {t.data_ptr(): t.nbytes for t in tensors
                if t is not None and (device is None or t.device.type == device.type)}
    return sum(distinct.values())


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, Any]:
    """The bytes of this rank's parameters, gradients and optimizer state (local shards), and the process's memory."""
    tensors = {
        "parameters": [_local(p) for p in model.parameters()],
        "gradients": [_local(p.grad) for p in model.parameters()],
        "optimizer_state": [_local(v) for entry in optimizer.state.values() for v in entry.values()
                            if torch.is_tensor(v)],
    }
    snap: dict[str, Any] = {key: _tensor_bytes(values) for key, values in tensors.items()}
    snap["optimizer_state_tensors"] = len(optimizer.state)
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        on_device = _tensor_bytes([t for values in tensors.values() for t in values], device)
        # reserved: the caching allocator's blocks (cached for reuse, fragmentation), what the GPU really lends
        snap.update(allocated=allocated, max_allocated=torch.cuda.max_memory_allocated(device),
                    reserved=torch.cuda.memory_reserved(device), max_reserved=torch.cuda.max_memory_reserved(device),
                    rest=allocated - on_device)
    else:
        import resource

        try:
            with open("/proc/self/statm") as f:  # Linux: the resident pages now
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            rss = None
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # KiB
        snap.update(rss=rss, rest=None if rss is None else rss - sum(snap[k] for k in TENSORS), max_rss=int(peak))
    return snap


def _build_mode(mode: str, config: MemoryBenchConfig, model: torch.nn.Module, recorder: Any):
    """The mode's engine (FSDP2, HSDP: the sharded model itself) and optimizer, their collectives recorded into
    ``recorder`` (ours by the engine and optimizer, FSDP2's at the process group)."""
    from lightning_ddp.sync import ShardedOptimizer

    adamw = {"lr": config.lr, "weight_decay": config.weight_decay}
    if mode in FULLY_SHARDED_MODES:
        from lightning_ddp.strategies.fsdp2 import shard
        from lightning_ddp.strategies.hsdp import hybrid_mesh
        from lightning_ddp.sync.recording_group import record_process_groups

        device_type = next(model.parameters()).device.type
        mesh = hybrid_mesh(device_type, hybrid_layout(config)) if mode == HSDP else None  # its groups first, ...
        record_process_groups(recorder)  # ... then torch's collectives on every group, seen at the process group
        shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    entry = catalogue.get(ENGINES.get(mode, config.grad_sync))
    engine = entry.make_engine(model, bucket_size_mb=config.bucket_size_mb if entry.has_bucket_size else "default")
    engine.recorder = recorder
    schedule = MODE_TABLE[mode].schedule
    if schedule is None:
        return engine, torch.optim.AdamW(model.parameters(), **adamw)
    placement = {"placement": engine.owner_of} if mode == "zero2" else {}
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, schedule=schedule, **placement, **adamw)
    optimizer.recorder = recorder  # the optimizer's collectives join the engine's per-step record
    return engine, optimizer


def _measure_mode(mode: str, config: MemoryBenchConfig, device: torch.device, rank: int) -> dict[str, Any]:
    """``config.steps`` steps of ``mode`` on this rank: its snapshots, step times (max over ranks), recorded
    communication and what ``lightning_ddp.memory`` expects of it."""
    from lightning_ddp.sync import Recorder

    gc.collect()  # free what the previous mode left (and restart the CUDA peak)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = seeded_model(config, config.seed, device)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    num_params = sum(math.prod(s) for s in shapes)
    world_size = dist.get_world_size()
    # FSDP2 holds beyond its shards at the peak, fp32, the largest group's (a block's or the root's) unsharded
    # parameters and gradients, gathered while that group's backward runs (this benchmark's expectation; the
    # pre-flight's peak is ``sync.memory_model.fully_sharded_unsharded_peak``)
    root, blocks = fsdp2_groups(model.config)
    transient = 2 * FP32 * max([root, *blocks]) if mode in FULLY_SHARDED_MODES else 0
    recorder = Recorder(device)  # the bytes and calls of every step's collectives, torch's FSDP2 ones included
    engine, optimizer = _build_mode(mode, config, model, recorder)

    def take(point: str) -> float:
        """``snapshots[point]``, then the CUDA peak restarts; returns the seconds left out of the step's time."""
        sync(device)
        start = time.perf_counter()
        snapshots[point] = _snapshot(model, optimizer, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        return time.perf_counter() - start

    sync(device)  # config.steps steps on random tokens, snapshots at set-up and around the last step's step()
    snapshots = {"setup": _snapshot(model, optimizer, device)}
    generator = torch.Generator().manual_seed(config.seed * 1000 + rank)
    step_ms: list[float] = []
    record = None
    for step in range(config.steps):
        tokens = random_tokens(config, generator).to(device)
        recorder.open_step(step)
        step_ms.append(timed_step(engine, optimizer, tokens, take if step == config.steps - 1 else None)[0])
        record = recorder.finish_step()
    result = {
        "mode": mode,
        "rank": rank,
        "snapshots": snapshots,
        "expected": _expected(mode, config, shapes, world_size, rank),
        "full_parameter_bytes": FP32 * num_params,
        "step_ms": all_reduced(step_ms, device=device),  # max over ranks
        "comm_bytes_recorded": record.nbytes,
        "comm_calls": len(record.collectives),
        "num_params": num_params,
        "num_tensors": len(shapes),
        "shard_bytes": getattr(optimizer, "shard_bytes", None),
        "expected_transient": transient,
    }
    if mode == "zero2":  # beyond the held shard
        result["expected_transient"] = zero2_buffer_bytes(bucket_cap_bytes(config.bucket_size_mb), FP32 * num_params)
        result["expected_gradient_peak"] = result["expected"]["gradients"] + result["expected_transient"]
    return result


def _measure_ranks(rank: int, world_size: int, config: MemoryBenchConfig, modes: list[str]) -> list[Any] | None:
    """Every mode on this rank; on rank 0, every rank's results (``[rank][mode index]``)."""
    device = torch.device("cuda", rank) if config.accelerator == "cuda" else torch.device("cpu")
    results = [_measure_mode(mode, config, device, rank) for mode in modes]
    gathered: list[Any] = [None] * world_size if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(results, gathered, dst=0)
    return gathered


def _expected(mode: str, config: MemoryBenchConfig, shapes: list[tuple[int, ...]], world_size: int,
              rank: int) -> dict[str, int]:
    """What ``lightning_ddp.memory`` expects rank ``rank`` to hold under ``mode``: hsdp's is fsdp2's over its shard
    group, in which the rank's place is ``rank % shard_size`` (``hybrid_mesh``'s groups are consecutive ranks)."""
    if mode == HSDP:
        shard_size = config.hsdp_shard_size  # resolved and checked where the config was built
        return expected_bytes(shapes, shard_size, "fully_sharded", rank % shard_size)
    return expected_bytes(shapes, world_size, "fully_sharded" if mode == FSDP2 else mode, rank)


def sent_bytes_per_rank(param_bytes: int, world_size: int, mode: str, shard_size: int | None = None) -> float:
    """Bytes each rank sends per step by the ring model (docs/algorithms.md): (N - 1) / N per one-way pass; hsdp's
    passes run in its shard group of ``shard_size`` ranks, and across the replicas it all-reduces (two passes) a
    1/``shard_size`` shard."""
    if mode != HSDP:
        return MODE_TABLE[mode].one_ways * (world_size - 1) / world_size * param_bytes
    replicas = world_size // shard_size
    within = MODE_TABLE[mode].one_ways * (shard_size - 1) / shard_size * param_bytes
    return within + 2 * (replicas - 1) / replicas * param_bytes / shard_size


def _largest(values: Iterable[int | None]) -> int | None:
    """The largest of the values that are not None (None if none is)."""
    return max((v for v in values if v is not None), default=None)


def summarise(config: dict[str, Any], per_mode: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """``results.json``'s ``modes`` (a summary per mode) and ``family`` (a row per mode, the most loaded rank's bytes
    measured and expected; the goals) from ``per_mode[m][r]``, rank ``r``'s result in mode ``m``."""
    warmup, samples, seed = config["warmup_steps"], config["bootstrap_samples"], config["seed"]
    # rank 0's step times (already the max over ranks) after the warm-up
    steps = {mode: ranks[0]["step_ms"][warmup:] for mode, ranks in zip(config["modes"], per_mode)}
    summaries, rows = [], {}
    for mode, ranks in zip(config["modes"], per_mode):
        matches = True
        for entry in ranks:
            full = entry["expected"]
            # Before any step: parameters only (AdamW allocates its state lazily, .grad is None).
            entry["expected_at"] = {
                "setup": {"parameters": full["parameters"], "gradients": 0, "optimizer_state": 0},
                "before_step": full,
                "after_step": full,
            }
            matches &= all(entry["snapshots"][point][key] == value
                           for point in POINTS for key, value in entry["expected_at"][point].items())
            # the measured peak: the largest max_allocated (CUDA) or max_rss (CPU) of the snapshots
            entry["peak"] = _largest(snap.get("max_allocated", snap.get("max_rss"))
                                     for snap in entry["snapshots"].values())
            entry["expected_peak"] = sum(full.values()) + entry.get("expected_transient", 0)
        step = asdict(estimate([steps[mode]], samples, seed, key=mode))
        shard_size = config["hsdp_shard_size"] if mode == HSDP else None
        sent = sent_bytes_per_rank(ranks[0]["full_parameter_bytes"], config["devices"], mode, shard_size)
        summaries.append({"mode": mode, "ranks": ranks, "warmup_steps": warmup, "step_ms_median": step["point"],
                          "step_ms": step, "matches_expected": matches, "sent_bytes_per_rank": sent})
        row: dict[str, Any] = {"mode": mode, "label": MODE_TABLE[mode].label, "step_ms": step}
        for key in TENSORS:
            row[key] = _largest(r["snapshots"]["before_step"][key] for r in ranks)
            row[f"expected_{key}"] = max(r["expected"][key] for r in ranks)
        row["peak"] = _largest(r["peak"] for r in ranks)
        row["expected_peak"] = max(r["expected_peak"] for r in ranks)
        if ZERO1 in steps:
            ratio = ratio_estimate([steps[mode]], [steps[ZERO1]], samples, seed, keys=(mode, ZERO1))
            row["step_ratio_to_zero1"] = asdict(ratio)
        rows[mode] = row
    # the two goals' verdicts; the step goal reads ZeRO-2's ratio to ZeRO-1, bootstrapped in its row
    gradients: dict[str, Any] = {"goal": "ZeRO-2 gradients per rank <= DDP's / N + one bucket",
                                 "verdict": "not measurable"}
    if "zero2" in rows and "unsharded" in rows:
        full = rows["unsharded"]["gradients"]
        cap = bucket_cap_bytes(config["bucket_size_mb"])
        bucket = full if cap is None else min(cap, full)  # null: one bucket of every gradient
        target = full / config["devices"] + bucket
        measured = rows["zero2"]["gradients"]
        gradients.update(measured_MiB=measured / MiB, target_MiB=target / MiB,
                         verdict="met" if measured <= target else "missed")
    step_goal: dict[str, Any] = {"goal": f"ZeRO-2 step time / ZeRO-1's ({ZERO1}) <= {STEP_GOAL:.2f}",
                                 "verdict": "not measurable"}
    if "zero2" in rows and ZERO1 in rows:
        ratio = rows["zero2"]["step_ratio_to_zero1"]
        step_goal.update(ratio=ratio, target=STEP_GOAL, verdict=verdict((ratio["lo"], ratio["hi"]), STEP_GOAL))
    return {"modes": summaries, "family": {"rows": list(rows.values()), "goals": [gradients, step_goal]}}


def _mib(value: int | float | None) -> str:
    """Bytes as MiB to 2 decimals; ``""`` for ``None``."""
    return "" if value is None else f"{value / MiB:,.2f}"


def _interval(value: dict[str, float] | None, fmt: str) -> str:
    """An estimate ``{point, lo, hi}`` as ``point [lo, hi]`` in ``fmt``; ``""`` for ``None``."""
    return "" if value is None else interval_text(value["point"], value["lo"], value["hi"], fmt)


def _mib_cell(key: str) -> Callable[[dict[str, Any]], str]:
    """A cell writing ``row[key]`` in MiB."""
    return lambda row: _mib(row[key])


FAMILY_HEADER = ["mode", "parameters", "gradients", "optimizer state", "peak", "step ms",
                 "step / ZeRO-1 (reduce-scatter)"]


def _family_cells(row: dict[str, Any]) -> list[str]:
    """A row of the family table: the mode, its memory by category and its peak in MiB, measured (expected), its
    step time and its step's ratio to ZeRO-1's [95 %] (empty without ZeRO-1)."""
    cells = [row["label"]]
    for key in (*TENSORS, "peak"):
        cells.append(f"{_mib(row[key])} ({_mib(row[f'expected_{key}'])})")
    return [*cells, _interval(row["step_ms"], ",.1f"), _interval(row.get("step_ratio_to_zero1"), ".3f")]


def _goal_cells(goal: dict[str, Any]) -> list[str]:
    """A row of the goals table: the goal, its measured value and its target (empty where not measurable), its
    verdict."""
    measured = target = ""
    if "ratio" in goal:
        measured, target = _interval(goal["ratio"], ".3f"), f"{goal['target']:.2f}"
    elif "measured_MiB" in goal:
        measured, target = f"{goal['measured_MiB']:,.2f} MiB", f"{goal['target_MiB']:,.2f} MiB"
    return [goal["goal"], measured, target, f"**{goal['verdict']}**"]


def write_memory_plot(results: dict[str, Any], path: str | Path) -> Path:
    """Peak memory per rank (the most loaded rank, MiB) against step time (median, 95 % interval as error bars), one
    labelled point per mode; a PNG written atomically. Needs matplotlib (the study's plots only)."""
    from matplotlib.figure import Figure  # a Figure saves through the Agg canvas without pyplot

    config = results["config"]
    rows = results["family"]["rows"]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for row in rows:
        step, peak = row["step_ms"], row["peak"]
        if peak is None or not all(math.isfinite(step[k]) for k in ("point", "lo", "hi")):
            continue
        ax.errorbar([step["point"]], [peak / MiB], xerr=[[step["point"] - step["lo"]], [step["hi"] - step["point"]]],
                    fmt="o", capsize=4, label=row["label"])
        ax.annotate(row["label"], (step["point"], peak / MiB), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xlabel("step time, ms (median, 95 % interval)")
    cuda = config["accelerator"] == "cuda"
    ax.set_ylabel("peak memory per rank, MiB" + (" (max allocated)" if cuda else " (peak RSS)"))
    ax.set_title(f"{config['preset']}, {config['devices']} ranks, {config['accelerator']}")
    ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return write_atomically(path, buffer.getvalue())


# The process-memory columns of a mode's table, per accelerator: snapshot key -> header.
PROCESS_MEMORY = {"cuda": {"allocated": "allocated", "max_allocated": "max allocated", "reserved": "reserved",
                           "max_reserved": "max reserved", "rest": "rest"},
                  "cpu": {"rss": "RSS", "rest": "rest"}}


def format_report(results: dict[str, Any]) -> str:
    """``results.md``: the family's table and goals, then one table per mode (a row per rank and point)."""
    config, env = results["config"], results["environment"]
    family = results["family"]
    lines = [
        f"# Memory benchmark of the data-parallel family: {config['preset']}, {config['devices']} ranks, "
        f"{config['accelerator']}",
        "",
        f"torch {env['torch']}, {env['device']}, {env['cpu_count']} CPUs, backend {env['backend']}; batch "
        f"{config['batch_size']} x {config['seq_len']} tokens per rank, {config['steps']} steps per mode, engine "
        f"{config['grad_sync']}, each mode in {'fresh' if config['separate_processes'] else 'shared'} processes. "
        "Bytes are MiB (2^20); the columns are defined in docs/benchmarks.md, \"Reading the memory report\".",
        "",
        "## The data-parallel family",
        "",
        f"Per rank (the most loaded rank), MiB: measured (expected). Step: median ms over steps "
        f"{config['warmup_steps'] + 1}..{config['steps']} (max over ranks) [95 % interval].",
        "",
        *markdown_table(FAMILY_HEADER, map(_family_cells, family["rows"]), "lrrrrrr"),
        "",
        *markdown_table(["goal", "measured", "target", "verdict"], map(_goal_cells, family["goals"]), "lrrl"),
    ]
    in_mib = {**{k: k.replace("_", " ") for k in (*TENSORS, "tensors", "expected")},
              **PROCESS_MEMORY[config["accelerator"]], "comm": "recorded comm MiB/step"}
    columns = [Column("rank", text_cell("rank")), Column("point", text_cell("point"), "l"),
               *(Column(header, _mib_cell(key)) for key, header in in_mib.items())]
    for mode in results["modes"]:  # its snapshots and the communication per step: a row per rank and point
        rows = [{**r["snapshots"][point], "rank": r["rank"], "point": point,
                 "tensors": sum(r["snapshots"][point][k] for k in TENSORS),
                 "expected": sum(r["expected_at"][point].values()), "comm": r["comm_bytes_recorded"]}
                for r in mode["ranks"] for point in POINTS]
        lines += [
            "",
            f"## {mode['mode']}",
            "",
            f"Step time: median {mode['step_ms_median']:,.1f} ms over steps {mode['warmup_steps'] + 1}.."
            f"{config['steps']} (max over ranks). Sent per rank by the ring model: "
            f"{_mib(mode['sent_bytes_per_rank'])} MiB/step. Measured tensors equal the analytic expectation: "
            f"**{'yes' if mode['matches_expected'] else 'NO'}**.",
            "",
            *table(columns, rows),
        ]
    return "\n".join(lines) + "\n"


def run(config: MemoryBenchConfig, command: str = "") -> None:
    """Spawn the ranks, measure every mode, write ``results.json``."""
    if config.accelerator == "cuda" and torch.cuda.device_count() < config.devices:
        raise ValueError(f"devices={config.devices} needs as many GPUs, but {torch.cuda.device_count()} are visible; "
                         "lower --devices or use --accelerator cpu")
    # Fresh processes per mode: memory an earlier mode freed may stay with the allocator (glibc keeps freed heap
    # pages), which would show up in the next mode's RSS.
    batches = [[mode] for mode in config.modes] if config.separate_processes else [list(config.modes)]
    per_mode = []
    for modes in batches:
        per_rank = run_ranks(config.devices, _measure_ranks, config, modes, backend=config.backend,
                             cuda=config.accelerator == "cuda")  # [rank][mode index] -> one rank's result
        per_mode += [[per_rank[r][m] for r in range(config.devices)] for m in range(len(modes))]
    cuda = config.accelerator == "cuda" and torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine() or "cpu")
    environment = provenance(config.out_dir, device=device, cpu_count=os.cpu_count(),
                             cuda=torch.version.cuda if cuda else None, backend=config.backend,
                             world_size=config.devices)
    results = {"config": asdict(config), "environment": environment, **summarise(asdict(config), per_mode)}
    write_outputs(config.out_dir, {"results.json": results})


def main(args: list[str] | None = None) -> int:
    """The benchmark's main; 1 where a mode's measured tensors differ from the expectation."""
    report = json_report("results.json", format_report,
                         lambda results, out: write_memory_plot(results, out / PLOT_NAME))
    results = benchmark_main(MemoryBenchConfig, run, report)(args)
    return 0 if all(mode["matches_expected"] for mode in results["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
