"""``python -m lightning_ddp.bench.compression``: what lossy gradient communication costs and saves against exact
fp32 averaging: fits per seed (loss, bytes, step time) and the per-step gradient error (docs/benchmarks.md)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from lightning_ddp import catalogue
from lightning_ddp.bench.engine_step import forward_backward
from lightning_ddp.bench.launch import strategy_argument
from lightning_ddp.bench.stats import hierarchical_bootstrap, interval_text, percentile_interval, rng_for
from lightning_ddp.bench.study import (
    NO_VALIDATION, StudyConfig, benchmark_main, fit_arguments_of, interval_cell, json_report, loss_curve, provenance,
    read_timing_summary, run_ranks, run_study, write_outputs,
)
from lightning_ddp.data import TextBytes
from lightning_ddp.model import GPT, get_config
from lightning_ddp.reporting.tables import Column, markdown_table, table, text_cell
from lightning_ddp.reporting.variants import format_settings, parse_settings
from lightning_ddp.sync.memory_model import MiB

FP32_BASELINE = catalogue.DEFAULT_ENGINE
"""The exact reference every variant is compared with: bucketed averaging in fp32."""


@dataclass(frozen=True)
class Variant:
    """An algorithm with its engine settings (empty: its engine's defaults): a lossy one, or the fp32 baseline."""

    algorithm: str
    """A catalogue name: a lossy engine with buckets, or ``FP32_BASELINE``."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Its engine settings by name, as given; ``effective_settings`` fills in the defaults."""

    @property
    def name(self) -> str:
        """``bucketed_powersgd_ddp rank=4 start_iter=10`` (tables, legends, results.json keys)."""
        return f"{self.algorithm} {format_settings(self.settings)}" if self.settings else self.algorithm

    def effective_settings(self) -> dict[str, Any]:
        """Every setting of its engine, the defaults filled in (what the report states)."""
        return catalogue.get(self.algorithm).check_settings(self.settings)


def parse_variant(text: str) -> Variant:
    """``"NAME:setting=value,..."`` -> that ``Variant`` of a lossy engine with buckets (bad settings fail)."""
    name, _, rest = text.partition(":")
    if name not in _lossy():
        raise ValueError(f"variant {text!r}: {name!r} is not a lossy engine with buckets; choose from "
                         f"{', '.join(_lossy())} (as NAME or NAME:setting=value,...)")
    variant = Variant(name, parse_settings(rest.replace(",", " ")))
    variant.effective_settings()
    return variant


def _lossy() -> list[str]:
    """The catalogue's lossy engines with buckets, in catalogue order: what ``variants`` may name and defaults to."""
    return [e.name for e in catalogue.STRATEGIES.values() if e.is_engine and not e.exact and e.has_bucket_size]


@dataclass
class CompressionConfig(StudyConfig):
    """Per seed one fit of fp32 and of every variant, and the gradient-error run."""

    fit_config: str = "configs/text_bytes.yaml"
    """The fit config of the training runs."""
    variants: list[str] | None = None
    """Lossy algorithms to compare with fp32, as NAME or NAME:setting=value,... (e.g.
    ``bucketed_powersgd_ddp:rank=4,start_iter=10``); default: every lossy engine with buckets at its defaults."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """One fp32 run and one run per variant per seed (``seed_everything``): the seeds are the repeats."""
    repeats: Literal[1] = 1
    """Must be 1: the seeds repeat the runs."""
    text: str = "README.md"
    """The text file (raw bytes) of the gradient-error run."""
    steps: int = 300
    last: int = 20
    """The loss is compared over each run's last N steps."""
    bucket_size_mb: float = 1.0
    """Bucket cap in MiB of every run: the fits and the gradient-error run alike."""
    batch_size: int = 8
    """Sequences per rank in the gradient-error run."""
    seq_len: int = 128
    """Tokens per sequence in the gradient-error run."""
    lr: float = 3e-3
    """AdamW's learning rate in the gradient-error run."""
    out_dir: str = "logs/compression"
    """Where results.json, results.md and loss_curves.png go (logs/ is git-ignored)."""

    def __post_init__(self) -> None:
        """Refuses a repeated seed or variant, a variant that does not parse, and ``last`` outside [1, steps]."""
        super().__post_init__()
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeats a seed; give distinct seeds, e.g. --seeds '[0, 1, 2]'")
        if not 1 <= self.last <= self.steps:
            raise ValueError(f"last must be between 1 and steps ({self.steps}), got {self.last}")
        if len({v.name for v in variants_of(self)}) != len(self.variants or _lossy()):  # parses every variant
            raise ValueError("variants lists a variant twice")


def variants_of(config: CompressionConfig) -> list[Variant]:
    """``config.variants`` parsed (``parse_variant``), or every lossy engine with buckets at its defaults."""
    return [parse_variant(v) for v in config.variants] if config.variants else [Variant(name) for name in _lossy()]


def _run_numbers(log_dir: Path) -> dict[str, Any]:
    """A fit's loss curve and the medians of its step time, exposed comm and bytes (the CommTimer's summary)."""
    summary = read_timing_summary(log_dir)["summary"]
    medians = {"step_ms_median": "step/time_ms", "exposed_ms_median": "comm/exposed_ms",
               "bytes_per_step": "comm/bytes"}
    return {"loss": loss_curve(log_dir), **{name: summary[key]["median"] for name, key in medians.items()}}


def _train(args: CompressionConfig, variants: list[Variant]) -> tuple[dict, dict[str, list[str]]]:
    """Per seed, fp32's run then each variant's: ``runs[seed][name]`` and the fit arguments by cell name."""
    runs_of = [Variant(FP32_BASELINE), *variants]
    cells = {}
    for seed in args.seeds:
        for run in runs_of:
            strategy = strategy_argument(run.algorithm, None, args.bucket_size_mb, run.settings)
            cells[f"{run.name}, seed {seed}"] = [*fit_arguments_of(args, strategy), "--seed_everything", str(seed),
                                                 "--timer.every_n_steps", "1", *NO_VALIDATION]
    measured = run_study(cells, 1, _run_numbers, timeout_s=args.timeout_s)
    runs = {seed: {run.name: measured[f"{run.name}, seed {seed}"][0] for run in runs_of} for seed in args.seeds}
    return runs, cells


def gradient_error(average_fp32: torch.Tensor, average_lossy: torch.Tensor) -> tuple[float, float]:
    """``(||lossy - fp32|| / ||fp32||, max |lossy - fp32|)`` of two averages of the same gradients.

    >>> gradient_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5]))  # 0.5 / 5
    (0.1, 0.5)
    """
    difference = (average_lossy - average_fp32).float()
    norm = average_fp32.float().norm().item()
    relative = difference.norm().item() / norm if norm > 0 else 0.0
    return relative, difference.abs().max().item()


def _error_rank(rank: int, world: int, args: CompressionConfig,
                variants: list[Variant]) -> dict[str, list[tuple[float, float]]]:
    """Per variant, per step of one fp32 run: its average's ``gradient_error`` against the exact one."""
    data = TextBytes(args.text, seq_len=args.seq_len)
    config = get_config("tiny", vocab_size=256, context_length=args.seq_len)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    # Each variant's engine on a copy of the model (bench code builds engines directly, settings and all); the
    # copy is loaded with the trained weights before every step, so it sees the same local gradients.
    engines = {v.name: catalogue.get(v.algorithm).make_engine(GPT(config), bucket_size_mb=args.bucket_size_mb,
                                                              **v.settings) for v in variants}
    errors: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for step in range(args.steps):
        start = (step * world + rank) * args.batch_size
        batch = [data[(start + k) % len(data)] for k in range(args.batch_size)]
        x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        forward_backward(model, x, y)
        exact = torch.cat([p.grad.reshape(-1) for p in params]).div_(world)
        dist.all_reduce(exact)
        for name, engine in engines.items():
            engine.module.load_state_dict(model.state_dict())
            engine.module.zero_grad(set_to_none=True)
            forward_backward(engine, x, y)
            averaged = torch.cat([p.grad.reshape(-1) for p in engine.module.parameters() if p.requires_grad])
            errors[name].append(gradient_error(exact, averaged))
        # train on the exact average: the trajectory is fp32 training's
        for p, average in zip(params, exact.split([p.numel() for p in params])):
            p.grad.copy_(average.view_as(p))
        optimizer.step()
        optimizer.zero_grad()
    return errors


def summarize(runs: dict[int, dict[str, dict[str, Any]]], errors: dict[str, list[tuple[float, float]]],
              variants: list[str], last: int = 20, samples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """results.md's numbers from ``runs[seed][name]`` (``_train``) and each variant's per-step gradient errors."""
    seeds = sorted(runs)

    def last_mean(seed: int, name: str) -> float:
        return statistics.mean(runs[seed][name]["loss"][-last:])

    def numbers(name: str) -> dict[str, Any]:
        """What fp32 and the variants report alike: the first loss, the last steps' mean per seed, the costs."""
        return {"loss_first": runs[seeds[0]][name]["loss"][0],
                "loss_last_mean": {str(seed): last_mean(seed, name) for seed in seeds},
                **{key: statistics.median(runs[seed][name][key] for seed in seeds)
                   for key in ("bytes_per_step", "step_ms_median", "exposed_ms_median")}}

    fp32_last = {seed: last_mean(seed, FP32_BASELINE) for seed in seeds}
    fp32 = {**numbers(FP32_BASELINE), "seed_spread": max(fp32_last.values()) - min(fp32_last.values())}
    out: dict[str, Any] = {"seeds": seeds, "last_steps": last, "baseline": FP32_BASELINE, "fp32": fp32, "variants": {}}
    for name in variants:
        gaps = [np.array(runs[seed][name]["loss"]) - np.array(runs[seed][FP32_BASELINE]["loss"]) for seed in seeds]
        differences = [gap[-last:] for gap in gaps]
        draws = hierarchical_bootstrap(differences, samples, rng_for(seed, "loss gap", name), statistic=np.nanmean)
        lo, hi = percentile_interval(draws)
        step_errors = errors.get(name) or []
        relative = [e for e, _ in step_errors]
        v: dict[str, Any] = {
            **numbers(name),
            "minus_fp32": {str(seed): last_mean(seed, name) - fp32_last[seed] for seed in seeds},
            "minus_fp32_mean": float(np.mean(np.concatenate(differences))),
            "minus_fp32_lo": lo,
            "minus_fp32_hi": hi,
            "loss_max_abs_difference": max(float(np.max(np.abs(gap))) for gap in gaps),
        }
        v["bytes_ratio"] = v["bytes_per_step"] / fp32["bytes_per_step"] if fp32["bytes_per_step"] else None
        if relative:
            exact_steps = next((k for k, e in enumerate(relative) if e > 0), len(relative))
            lossy = relative[exact_steps:] or relative  # the steps it averaged its own way (all of them for bf16)
            v.update(exact_steps=exact_steps,
                     relative_gradient_error_median=statistics.median(lossy),
                     relative_gradient_error_max=max(lossy),
                     absolute_gradient_error_max=max(m for _, m in step_errors))
        out["variants"][name] = v
    return out


def _plot(result: dict[str, Any], out: Path) -> None:
    """loss_curves.png: every run's loss curve, and each variant's per-step gradient error."""
    from matplotlib.figure import Figure

    runs = {int(seed): r for seed, r in result["runs"].items()}
    errors, names = result["gradient_errors"], list(result["variants"])
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    ax_loss, ax_err = fig.subplots(1, 2)
    colors = {name: f"C{k}" for k, name in enumerate([FP32_BASELINE, *names])}
    for seed, by_name in runs.items():
        for name, run in by_name.items():
            label = f"{name} ({run['bytes_per_step'] / MiB:.3g} MiB/step)" if seed == min(runs) else None
            ax_loss.plot(run["loss"], color=colors[name], alpha=0.75, lw=1, label=label)
    for name in names:
        ax_err.plot([100 * e for e, _ in errors.get(name, [])], color=colors[name], label=name)  # x: the step
    ax_loss.set_ylabel(f"train/loss (rank 0), seed {', '.join(map(str, runs))}")
    ax_err.set_ylabel("relative error of the average vs fp32 (%)")
    ax_err.set_yscale("symlog", linthresh=0.1)
    for ax in (ax_loss, ax_err):
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("Lossy gradient communication against fp32: loss curves and per-step gradient error")
    fig.savefig(out / "loss_curves.png", dpi=110)


class Cost(NamedTuple):
    """A cost row of results.md: its title, its results.json key, and how its value is shown."""

    title: str
    key: str
    spec: str
    """Format spec of the shown value, e.g. ``.1f``."""
    scale: float
    """Multiplies the results.json value before it is shown (``1 / MiB``: bytes to MiB)."""
    unit: str
    """Text after the value, e.g. `` ms``."""


COSTS = (Cost(title="bytes communicated per step", key="bytes_per_step", spec=".3g", scale=1 / MiB, unit=" MiB"),
         Cost(title="step time", key="step_ms_median", spec=".1f", scale=1, unit=" ms"),
         Cost(title="exposed communication", key="exposed_ms_median", spec=".1f", scale=1, unit=" ms"))
"""results.md's cost rows, in order: bytes communicated, step time, exposed communication (medians)."""


def _markdown(result: dict[str, Any]) -> str:
    """results.md from what results.json holds; docs/benchmarks.md, "Compression benchmark", says how to read it."""
    s, config = result["summary"], result["config"]
    fp32, last, variants = s["fp32"], s["last_steps"], s["variants"]
    names = list(result["variants"])
    seeds = [str(seed) for seed in s["seeds"]]
    per_seed = []  # a row per seed: fp32's mean loss, and each variant's with its difference
    for seed in seeds:
        losses = [f"{variants[n]['loss_last_mean'][seed]:.3f} ({variants[n]['minus_fp32'][seed]:+.3f})" for n in names]
        per_seed.append([seed, f"{fp32['loss_last_mean'][seed]:.3f}", *losses])
    per_seed_header = ["seed", f"fp32 (`{FP32_BASELINE}`)", *(f"`{n}` (- fp32)" for n in names)]
    rows = [{"variant": f"`{n}`", "spread": fp32["seed_spread"], **variants[n]} for n in names]
    gaps = [Column("variant", text_cell("variant"), "l"),
            Column("loss - fp32 [95 %]", interval_cell("minus_fp32_mean", "+.3f", bounds="minus_fp32")),
            Column("fp32 seed spread", text_cell("spread", ".3f")),
            Column("largest gap at any step", text_cell("loss_max_abs_difference", ".3f"))]
    errors = [Column("variant", text_cell("variant"), "l"), Column("exact steps", text_cell("exact_steps")),
              Column("relative error: median", interval_cell("relative_gradient_error_median", ".3f", scale=100,
                                                             unit=" %")),
              Column("largest", interval_cell("relative_gradient_error_max", ".3f", scale=100, unit=" %")),
              Column("largest absolute error", text_cell("absolute_gradient_error_max", ".3g"))]
    runs = {"fp32": fp32, **{f"`{n}`": variants[n] for n in names}}
    costs = []  # a row per cost, a column per run: its value, and its ratio to fp32's
    for cost in COSTS:
        row = [cost.title]
        for run in runs.values():
            text = interval_text(run[cost.key], spec=cost.spec, scale=cost.scale, unit=cost.unit)
            if fp32[cost.key] and run is not fp32:
                text += f" ({run[cost.key] / fp32[cost.key]:.3g}x)"
            row.append(text)
        costs.append(row)
    return "\n".join([
        f"# Lossy gradient communication vs fp32: {', '.join(f'`{n}`' for n in names)}; {config['steps']} steps, "
        f"2 ranks, bucket {config['bucket_size_mb']:g} MiB, seed {', '.join(seeds)}", "",
        f"Command: `{result['command']}` (torch {result['torch']}).", "",
        *markdown_table(["variant", "engine settings (defaults filled in)"],
                        [[f"`{n}`", format_settings(v["effective_settings"]) or "-"]
                         for n, v in result["variants"].items()], "ll"), "",
        f"## Loss: mean train/loss over the last {last} steps, per seed", "",
        *markdown_table(per_seed_header, per_seed, "r" * len(per_seed_header)), "",
        f"The gap to fp32 pooled over every seed, with its 95 % interval; every run of a seed starts from the same "
        f"weights and data order (first fp32 loss {fp32['loss_first']:.3f}).", "",
        *table(gaps, rows), "",
        "## Gradients, bytes and time", "",
        "Per-step error of each variant's average against the fp32 one, along fp32 training's trajectory.", "",
        *table(errors, [row for row in rows if "relative_gradient_error_median" in row]), "",
        *markdown_table(["median over the seed values of each run's median", *runs], costs, "l" + "r" * len(runs)), "",
        "How to read these tables (the interval, exact steps, bytes, step-time noise): docs/benchmarks.md, "
        "\"Compression benchmark\".", "", "![loss curves and gradient error](loss_curves.png)", ""])


def measure(config: CompressionConfig, command: str) -> None:
    """The fits and the gradient-error run; results.json in ``out_dir``."""
    variants = variants_of(config)
    runs, commands = _train(config, variants)
    print("measuring the per-step gradient error ...", flush=True)
    errors = run_ranks(2, _error_rank, config, variants)  # per variant, per step: [relative, absolute]
    summary = summarize(runs, errors, [v.name for v in variants], config.last, config.bootstrap_samples, config.seed)
    variant_settings = {v.name: {"algorithm": v.algorithm, "settings": v.settings,
                                 "effective_settings": v.effective_settings()} for v in variants}
    result = provenance(config.out_dir, command=command, fit_commands=commands, config=asdict(config),
                        extra_args=config.fit_args, variants=variant_settings, summary=summary,
                        runs={str(seed): r for seed, r in runs.items()}, gradient_errors=errors)
    write_outputs(config.out_dir, {"results.json": result})


main = benchmark_main(CompressionConfig, measure, json_report("results.json", _markdown, _plot))


if __name__ == "__main__":
    main()
