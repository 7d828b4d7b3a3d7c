"""``python -m lightning_ddp.bench.engine_step``: our engines' training step against torch DDP's, without Lightning
(docs/benchmarks.md); also the in-process benchmarks' model, random tokens and timed step."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from jsonargparse.typing import PositiveInt

from lightning_ddp import catalogue
from lightning_ddp.bench.stats import estimate, interval_text, pooled_median, ratio_estimate
from lightning_ddp.bench.study import BenchConfig, benchmark_main, json_report, provenance, run_ranks, write_outputs
from lightning_ddp.model import GPT, PRESETS, get_config
from lightning_ddp.reporting.tables import Column, table, text_cell


@dataclass
class InProcessConfig(BenchConfig):
    """A ``BenchConfig`` of the in-process benchmarks: the GPT they train on random tokens."""

    preset: Literal[tuple(PRESETS)] = "tiny"  # type: ignore[valid-type]
    """Model size by name (``lightning_ddp.model.PRESETS``)."""
    vocab_size: PositiveInt = 10_000
    """Vocabulary size of the model (and the range of the random tokens)."""
    batch_size: PositiveInt = 4
    """Sequences per rank and step."""
    seq_len: PositiveInt = 64
    """Tokens per sequence (also the model's context length)."""


def seeded_model(config: InProcessConfig, seed: int, device: torch.device | str = "cpu") -> GPT:
    """The GPT of ``config.preset``, seeded with ``seed``, on ``device``."""
    torch.manual_seed(seed)
    return GPT(get_config(config.preset, vocab_size=config.vocab_size, context_length=config.seq_len)).to(device)


def random_tokens(config: InProcessConfig, generator: torch.Generator) -> torch.Tensor:
    """One step's random tokens ``(batch_size, seq_len + 1)``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    return torch.randint(config.vocab_size, (config.batch_size, config.seq_len + 1), generator=generator)


@dataclass
class EngineStepConfig(InProcessConfig):
    """What ``python -m lightning_ddp.bench.engine_step`` runs (2 CPU ranks over gloo, in-process engines)."""

    variants: list[str] = field(default_factory=lambda: [
        "ddp", f"{catalogue.DEFAULT_ENGINE}@1", f"{catalogue.DEFAULT_ENGINE}@4"])
    """``ddp`` or ``<engine>[@<bucket MiB>|@auto|@none]``; ``ddp``, the baseline of the ratios, is added first when
    missing."""
    repeats: int = 6
    """Rounds: every variant's steps once per round, interleaved."""
    steps: int = 20
    """Measured steps per variant and round, after ``warmup_steps``."""
    warmup_steps: int = 3
    """Steps per variant and round left out, before the measured ones."""
    out_dir: str = "logs/engine_step"
    """Where engine_step.json and .md go (logs/ is git-ignored)."""

    def __post_init__(self) -> None:
        """Puts ``ddp`` first among the variants when it is missing; refuses an unknown strategy name."""
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
    return name, size if size in ("auto", "none") else float(size)


def forward_backward(engine: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """Forward, cross-entropy and backward through ``engine`` (ours, torch's or a plain model), gradients synced."""
    if hasattr(engine, "on_train_batch_start"):
        engine.on_train_batch_start()
    F.cross_entropy(engine(inputs).flatten(0, 1), targets.flatten()).backward()
    if hasattr(engine, "finish_gradient_synchronization"):
        engine.finish_gradient_synchronization()


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(engine: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               pause: Callable[[str], float] | None = None) -> tuple[float, float]:
    """One step's wall and CPU ms; ``pause("before_step" | "after_step")`` returns seconds left out of the wall."""
    sync(tokens.device)
    cpu_start, start = time.process_time(), time.perf_counter()
    forward_backward(engine, tokens[:, :-1], tokens[:, 1:])
    paused = pause("before_step") if pause else 0.0
    optimizer.step()
    paused += pause("after_step") if pause else 0.0
    optimizer.zero_grad(set_to_none=True)
    sync(tokens.device)
    return (time.perf_counter() - start - paused) * 1e3, (time.process_time() - cpu_start) * 1e3


def all_reduced(values: list[float], op: Any = dist.ReduceOp.MAX, device: torch.device | str = "cpu") -> list[float]:
    """``values`` reduced over the ranks element by element (default the max: the slowest rank sets the pace)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _measure_ranks(rank: int, world: int, args: EngineStepConfig) -> dict[str, dict[str, list[list[float]]]]:
    """Every variant's measured steps on this rank, per kind (wall, CPU) and variant: one list per round."""
    runs = {}
    for variant in args.variants:
        model = seeded_model(args, 0)
        name, size = parse_variant(variant)
        bucket = {} if size is None else {"bucket_size_mb": None if size == "none" else size}
        engine = (torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=False)
                  if name == "ddp" else catalogue.get(name).make_engine(model, **bucket))
        runs[variant] = (engine, torch.optim.AdamW(model.parameters(), lr=1e-4))
    generator = torch.Generator().manual_seed(1000 + rank)
    measured: dict[str, dict[str, list[list[float]]]] = {kind: {v: [] for v in args.variants}
                                                         for kind in ("wall", "cpu")}
    for _ in range(args.repeats):
        for variant in args.variants:
            steps = range(args.warmup_steps + args.steps)
            times = [timed_step(*runs[variant], random_tokens(args, generator)) for _ in steps]
            wall, cpu = zip(*times[args.warmup_steps:])
            measured["wall"][variant].append(all_reduced(list(wall)))
            measured["cpu"][variant].append(all_reduced(list(cpu), dist.ReduceOp.SUM))  # what both ranks spent
    return measured


def _timed_cell(kind: str, keys: tuple[str, str, str], spec: str) -> Callable[[dict[str, Any]], str]:
    """A cell writing one of a row's ``kind`` (wall or CPU) numbers with its interval: ``keys`` are (point, lo, hi)."""
    def cell(row: dict[str, Any]) -> str:
        point, lo, hi = (row[kind][key] for key in keys)
        return interval_text(point, lo, hi, spec)

    return cell


def _markdown(result: dict[str, Any]) -> str:
    """engine_step.md: per variant, the wall and CPU time per step and their ratios to ddp's."""
    columns = [Column("variant", text_cell("variant"), "l")]
    for kind, title in (("wall", "wall ms per step (max over ranks)"), ("cpu", "CPU ms per step (both ranks)")):
        columns += [Column(f"{title} [95 %]", _timed_cell(kind, ("median_ms", "lo_ms", "hi_ms"), ".1f")),
                    Column("/ ddp [95 %]", _timed_cell(kind, ("ratio_vs_ddp", "ratio_lo", "ratio_hi"), ".3f"))]
    return f"Command: `{result['command']}`\n\n" + "\n".join(table(columns, result["rows"])) + "\n"


def measure(config: EngineStepConfig, command: str) -> None:
    """Every variant's steps, rounds interleaved, on 2 ranks; engine_step.json in ``out_dir``."""
    measured = run_ranks(2, _measure_ranks, config)
    rows = []  # per variant, the median wall and CPU time per step and its ratio to ddp's, with intervals
    for variant in config.variants:
        row: dict[str, Any] = {"variant": variant}
        for kind in ("wall", "cpu"):
            step = estimate(measured[kind][variant], config.bootstrap_samples, config.seed, key=f"{kind} {variant}")
            ratio = ratio_estimate(measured[kind][variant], measured[kind]["ddp"], config.bootstrap_samples,
                                   config.seed, keys=(f"{kind} {variant}", f"{kind} ddp"))
            row[kind] = {"median_ms": step.point, "lo_ms": step.lo, "hi_ms": step.hi,
                         "ratio_vs_ddp": ratio.point, "ratio_lo": ratio.lo, "ratio_hi": ratio.hi}
        rows.append(row)
    every_round = [steps for rounds in measured["wall"].values() for steps in rounds]  # of every variant
    write_outputs(config.out_dir, {"engine_step.json": provenance(
        config.out_dir, command=command, config=asdict(config), rows=rows, times_ms=measured,
        median_all_ms=pooled_median(every_round))})


main = benchmark_main(EngineStepConfig, measure, json_report("engine_step.json", _markdown))


if __name__ == "__main__":
    main()
