"""``python -m lightning_ddp.bench.timer_overhead``: what the CommTimer costs, the same fit with the timer off, on
every step and on every Nth step, alternated (docs/benchmarks.md, "Timer overhead")."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from jsonargparse.typing import restricted_number_type
from lightning.pytorch.callbacks import Callback

from lightning_ddp.bench.stats import pooled_median, ratio_estimate, verdict
from lightning_ddp.bench.study import (
    NO_CHECKPOINTS, NO_VALIDATION, Column, StudyConfig, benchmark_main, interval_cell, json_report, provenance,
    run_study, table, text_cell, with_interval, write_outputs,
)


class StepWallTimes(Callback):
    """Rank 0 writes the ms between training-batch ends and the synchronized window's time to ``FILE``."""

    FILE = "step_wall_times.json"

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.ends.append(time.perf_counter())  # no synchronize here: see docs/benchmarks.md, "Timer overhead"

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # once: the queued tail belongs to the window
        if trainer.is_global_zero and len(self.ends) > 1:
            steps_ms = [(end - start) * 1e3 for start, end in zip(self.ends, self.ends[1:])]
            measured = {"steps_ms": steps_ms, "window_ms": (time.perf_counter() - self.ends[0]) * 1e3}
            (Path(trainer.log_dir) / self.FILE).write_text(json.dumps(measured))


def _wall_times(log_dir: Path) -> dict[str, Any]:
    """The metric plug-in: what ``StepWallTimes`` wrote in a fit's ``log_dir``."""
    return json.loads((log_dir / StepWallTimes.FILE).read_text())


EVERY_STEP = "every step"
"""The arm the top-level keys of the result describe (the timer as the benchmarks run it)."""

AtLeast2 = restricted_number_type("AtLeast2", int, (">=", 2))


@dataclass
class TimerOverheadConfig(StudyConfig):
    """What ``python -m lightning_ddp.bench.timer_overhead`` runs."""

    repeats: int = 4
    """Rounds of the arms (the interval needs several)."""
    steps: int = 110
    """Optimizer steps per run (110: the every-50 arm measures steps 0, 50 and 100)."""
    warmup_steps: int = 5
    """Steps per run left out of the median."""
    sampled_every: AtLeast2 = 50
    """The sampled arm's ``--timer.every_n_steps`` (>= 2: 1 is the every-step arm; run at least twice as many steps)."""
    out_dir: str = "logs/timer_overhead"
    """Where timer_overhead.json and .md go (logs/ is git-ignored)."""


def arms(sampled_every: int) -> dict[str, list[str]]:
    """Arm name -> the timer's CLI arguments, ``off`` first (the denominator of every ratio)."""
    return {
        "off": ["--timer.enabled", "false"],
        EVERY_STEP: ["--timer.enabled", "true", "--timer.every_n_steps", "1"],
        f"every {sampled_every} steps": ["--timer.enabled", "true", "--timer.every_n_steps", str(sampled_every)],
    }


def measure(config: TimerOverheadConfig, command: str) -> None:
    """Every arm's fit ``repeats`` times, interleaved; timer_overhead.json (``summarize``, the settings)."""
    cells = {f"timer {arm}": [
        "--config", config.fit_config, *config.fit_args, "--trainer.max_steps", str(config.steps),
        "--trainer.enable_progress_bar", "false", *timer_args,
        *NO_VALIDATION, *NO_CHECKPOINTS,  # the quickstart validates and keeps a checkpoint at step 40
        "--trainer.callbacks+=lightning_ddp.bench.timer_overhead.StepWallTimes",
    ] for arm, timer_args in arms(config.sampled_every).items()}
    logs = run_study(cells, config.repeats, _wall_times, timeout_s=config.timeout_s)
    measured = {arm: logs[f"timer {arm}"] for arm in arms(config.sampled_every)}
    runs = {arm: [m["steps_ms"][config.warmup_steps:] for m in runs] for arm, runs in measured.items()}
    windows = {arm: [m["window_ms"] / len(m["steps_ms"]) for m in runs] for arm, runs in measured.items()}
    result = provenance(config.out_dir, **summarize(runs, windows, config.bootstrap_samples, config.seed),
                        config=asdict(config), repeats=config.repeats, steps=config.steps,
                        warmup=config.warmup_steps, command=command)
    write_outputs(config.out_dir, {"timer_overhead.json": result})


GOAL = 0.02
"""The timer may add at most 2 % to the median step."""


def summarize(runs: dict[str, list[list[float]]], windows: dict[str, list[float]], samples: int = 2000,
              seed: int = 0) -> dict:
    """Per arm (under ``arms``; the every-step arm's also at the top level), against ``off``: the overhead of the
    median step [95 %] with its verdict, and of the whole runs' mean step (``windows``)."""
    per_arm: dict[str, dict] = {}
    for arm, steps in runs.items():  # off first: every other arm is divided by it
        mean = statistics.mean(windows[arm])
        per_arm[arm] = {"median_step_ms": pooled_median(steps), "window_mean_step_ms": mean,
                        "steps_measured": sum(map(len, steps))}
        if arm != "off":
            ratio = ratio_estimate(steps, runs["off"], samples, seed=seed, keys=(f"timer {arm}", "timer off"))
            per_arm[arm].update(**with_interval("overhead", ratio, shift=-1), verdict=verdict(ratio, 1 + GOAL),
                                window_overhead=mean / per_arm["off"]["window_mean_step_ms"] - 1)
    every = per_arm[EVERY_STEP]
    summary = {}  # the timer off against on every step, then the every-step arm's overhead
    for key in ("median_step_ms", "window_mean_step_ms"):
        summary[f"{key}_timer_off"] = per_arm["off"][key]
        summary[f"{key}_timer_on"] = every[key]
    for key in ("overhead", "overhead_lo", "overhead_hi", "verdict", "window_overhead"):
        summary[key] = every[key]
    return {**summary, "steps_measured": {arm: data["steps_measured"] for arm, data in per_arm.items()},
            "arms": per_arm}


def _markdown(result: dict) -> str:
    """timer_overhead.md: the every-step arm's overhead in one line, every arm's table against ``off``, the command."""
    columns = [Column("timer", text_cell("arm"), "l"), Column("median step ms", text_cell("median_step_ms", ".2f")),
               Column("vs off [95 %]", interval_cell("overhead", "+.2f", scale=100, unit=" %"), "l"),
               Column(f"goal < {GOAL:.0%}", text_cell("verdict"), "l"),
               Column("whole-run mean step ms", text_cell("window_mean_step_ms", ".2f")),
               Column("vs off", interval_cell("window_overhead", "+.2f", scale=100, unit=" %"))]
    arms_table = "\n".join(table(columns, [{"arm": arm, **data} for arm, data in result["arms"].items()]))
    return (f"CommTimer overhead (every step): {result['overhead'] * 100:+.2f} % [95 %: "
            f"{result['overhead_lo'] * 100:+.2f}, {result['overhead_hi'] * 100:+.2f}] (median step "
            f"{result['median_step_ms_timer_off']:.1f} ms off, {result['median_step_ms_timer_on']:.1f} ms on; goal < "
            f"{GOAL:.0%}: {result['verdict']}); over whole runs {result['window_overhead'] * 100:+.2f} % "
            f"({result['window_mean_step_ms_timer_off']:.1f} vs {result['window_mean_step_ms_timer_on']:.1f} ms mean "
            f"step)\n\n{arms_table}\n\nCommand: `{result['command']}`\n")


main = benchmark_main(TimerOverheadConfig, measure, json_report("timer_overhead.json", "timer_overhead.md", _markdown))


if __name__ == "__main__":
    main()
