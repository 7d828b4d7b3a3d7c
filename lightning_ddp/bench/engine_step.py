"""``python -m lightning_ddp.bench.engine_step``: our engines' training step against torch DDP's, without
Lightning (wall and CPU time per step, rounds interleaved; docs/benchmarks.md). Variants are ``ddp`` or
``<engine>[@<bucket MiB>]``. Also the in-process benchmarks' one training step, ``forward_backward``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ddp import catalogue
from lightning_ddp.bench.single import BenchConfig, Column, benchmark_main, run_ranks, table, text_cell
from lightning_ddp.bench.stats import estimate, interval_text, ratio_estimate
from lightning_ddp.bench.study import provenance, read_json, write_outputs
from lightning_ddp.command_line import parse_dataclass
from lightning_ddp.model import GPT, get_config

__all__ = ["EngineStepConfig", "forward_backward", "main", "parse_variant"]


@dataclass
class EngineStepConfig(BenchConfig):
    """What ``python -m lightning_ddp.bench.engine_step`` runs (2 CPU ranks over gloo, in-process engines)."""

    variants: list[str] = field(default_factory=lambda: [
        "ddp", f"{catalogue.DEFAULT_ENGINE}@1", f"{catalogue.DEFAULT_ENGINE}@4"])
    """``ddp`` or ``<engine>[@<bucket MiB>|@auto|@none]``; ``ddp``, the baseline of the ratios, is added first when
    missing."""
    preset: str = "tiny"
    vocab_size: int = 10_000
    batch_size: int = 4
    """Sequences per rank and step."""
    seq_len: int = 64
    repeats: int = 6
    """Rounds: every variant's steps once per round, interleaved."""
    steps: int = 20
    """Measured steps per variant and round, after ``warmup_steps``."""
    warmup_steps: int = 3
    """Steps per variant and round left out, before the measured ones."""
    out_dir: str = "logs/engine_step"
    """Where engine_step.json and .md go (logs/ is git-ignored)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if "ddp" not in self.variants:
            self.variants = ["ddp", *self.variants]
        for variant in self.variants:
            name, _ = parse_variant(variant)
            if name != "ddp":
                catalogue.get(name)  # an unknown name fails here, listing the valid ones


def parse_variant(text: str) -> tuple[str, float | str | None]:
    """``"bucketed_ddp@4"`` -> ``("bucketed_ddp", 4.0)``; ``"ddp"`` -> ``("ddp", None)``; ``@none``: one bucket.

    >>> parse_variant("bucketed_ddp@0.25"), parse_variant("naive_ddp"), parse_variant("bucketed_ddp@auto")
    (('bucketed_ddp', 0.25), ('naive_ddp', None), ('bucketed_ddp', 'auto'))
    """
    name, _, size = text.partition("@")
    if not size:
        return name, None
    if size in ("auto", "none"):
        return name, "auto" if size == "auto" else "none"
    return name, float(size)


def forward_backward(engine: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """Forward, cross-entropy and backward through ``engine`` (ours, torch's or a plain model), gradients synced."""
    if hasattr(engine, "on_train_batch_start"):
        engine.on_train_batch_start()
    F.cross_entropy(engine(inputs).flatten(0, 1), targets.flatten()).backward()
    if hasattr(engine, "finish_gradient_synchronization"):
        engine.finish_gradient_synchronization()


def _build(variant: str, model: torch.nn.Module) -> torch.nn.Module:
    name, size = parse_variant(variant)
    if name == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=False)
    bucket = {} if size is None else {"bucket_size_mb": None if size == "none" else size}
    return catalogue.get(name).make_engine(model, **bucket)


def _measure_ranks(rank: int, world: int, args: EngineStepConfig) -> dict[str, dict[str, list[list[float]]]]:
    """Every variant's measured steps on this rank, per kind (wall, CPU) and variant: one list per round."""
    config = get_config(args.preset, vocab_size=args.vocab_size, context_length=args.seq_len)
    runs = {}
    for variant in args.variants:
        torch.manual_seed(0)
        model = GPT(config)
        engine = _build(variant, model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[variant] = (engine, optimizer)
    generator = torch.Generator().manual_seed(1000 + rank)
    measured: dict[str, dict[str, list[list[float]]]] = {kind: {v: [] for v in args.variants}
                                                         for kind in ("wall", "cpu")}
    for _ in range(args.repeats):
        for variant in args.variants:
            engine, optimizer = runs[variant]
            wall_ms, cpu_ms = [], []
            for step in range(args.warmup_steps + args.steps):
                tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)
                cpu_start = time.process_time()
                start = time.perf_counter()
                forward_backward(engine, tokens[:, :-1], tokens[:, 1:])
                optimizer.step()
                optimizer.zero_grad()
                if step >= args.warmup_steps:
                    wall_ms.append((time.perf_counter() - start) * 1e3)
                    cpu_ms.append((time.process_time() - cpu_start) * 1e3)
            wall = torch.tensor(wall_ms, dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            cpu = torch.tensor(cpu_ms, dtype=torch.float64)
            dist.all_reduce(cpu)  # what the step cost both ranks together
            measured["wall"][variant].append(wall.tolist())
            measured["cpu"][variant].append(cpu.tolist())
    return measured


def write_report(config: EngineStepConfig) -> dict[str, Any]:
    """engine_step.md (per variant, the wall and CPU time per step and their ratios to ddp's) from ``out_dir``'s
    engine_step.json; returns the result."""
    result = read_json(Path(config.out_dir) / "engine_step.json")
    columns = [Column("variant", text_cell("variant"), "l")]
    for kind, title in (("wall", "wall ms per step (max over ranks)"), ("cpu", "CPU ms per step (both ranks)")):
        columns += [Column(f"{title} [95 %]", lambda row, k=kind: interval_text(
                        row[k]["median_ms"], row[k]["lo_ms"], row[k]["hi_ms"], ".1f")),
                    Column("/ ddp [95 %]", lambda row, k=kind: interval_text(
                        row[k]["ratio_vs_ddp"], row[k]["ratio_lo"], row[k]["ratio_hi"], ".3f"))]
    write_outputs(config.out_dir, {"engine_step.md": f"Command: `{result['command']}`\n\n"
                                                     + "\n".join(table(columns, result["rows"])) + "\n"})
    return result


def _rows(measured: dict[str, Any], config: EngineStepConfig) -> list[dict[str, Any]]:
    """Per variant, the median wall and CPU time per step and its ratio to ddp's, with intervals."""
    rows = []
    for variant in config.variants:
        row: dict[str, Any] = {"variant": variant}
        for kind in ("wall", "cpu"):
            step = estimate(measured[kind][variant], config.bootstrap_samples, config.seed, key=f"{kind} {variant}")
            ratio = ratio_estimate(measured[kind][variant], measured[kind]["ddp"], config.bootstrap_samples,
                                   config.seed, keys=(f"{kind} {variant}", f"{kind} ddp"))
            row[kind] = {"median_ms": step.point, "lo_ms": step.lo, "hi_ms": step.hi,
                         "ratio_vs_ddp": ratio.point, "ratio_lo": ratio.lo, "ratio_hi": ratio.hi}
        rows.append(row)
    return rows


def measure(config: EngineStepConfig, command: str) -> dict[str, Any]:
    """Every variant's steps, rounds interleaved, on 2 ranks; engine_step.json and .md in ``out_dir``."""
    measured = run_ranks(2, _measure_ranks, config)
    all_steps = [t for v in measured["wall"].values() for r in v for t in r]
    write_outputs(config.out_dir, {"engine_step.json": provenance(
        config.out_dir, command=command, config=asdict(config), rows=_rows(measured, config), times_ms=measured,
        median_all_ms=statistics.median(all_steps))})
    return write_report(config)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_dataclass(EngineStepConfig, argv, prog="python -m lightning_ddp.bench.engine_step")
    return benchmark_main(config, "lightning_ddp.bench.engine_step", argv, measure,
                          lambda _, __, ___: (Path(config.out_dir) / "engine_step.md").read_text(), write_report)


if __name__ == "__main__":
    main()
