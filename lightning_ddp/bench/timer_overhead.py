"""``python -m lightning_ddp.bench.timer_overhead``: what the CommTimer costs under each of a few strategies, the same
fit with the timer off, on every step and on every Nth step (the default sampling), alternated (docs/benchmarks.md,
"Timer overhead")."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from jsonargparse.typing import restricted_number_type
from lightning.pytorch.callbacks import Callback

from lightning_ddp import catalogue
from lightning_ddp.bench.stats import pooled_median, ratio_estimate, verdict
from lightning_ddp.bench.study import (
    NO_CHECKPOINTS, NO_VALIDATION, StudyConfig, benchmark_main, interval_cell, json_report, provenance, run_ranks,
    run_study, with_interval, write_outputs,
)
from lightning_ddp.reporting.tables import Column, table, text_cell


class StepWallTimes(Callback):
    """Rank 0 writes the ms between training-batch ends and the synchronized window's time to ``FILE``."""

    FILE = "step_wall_times.json"
    """JSON in the fit's log dir: ``steps_ms`` (ms between consecutive batch ends) and ``window_ms``
    (first batch end to the end of training, after one synchronize on CUDA)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        """Note the wall clock, unsynchronized: the queued work is paid for in the window."""
        self.ends.append(time.perf_counter())  # no synchronize here: see docs/benchmarks.md, "Timer overhead"

    def on_train_end(self, trainer, pl_module) -> None:
        """Rank 0 writes ``FILE``, given at least two batch ends."""
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # once: the queued tail belongs to the window
        window_ms = (time.perf_counter() - self.ends[0]) * 1e3 if self.ends else 0.0
        log_dir = trainer.log_dir  # on every rank: Lightning broadcasts rank 0's, a collective
        if trainer.is_global_zero and len(self.ends) > 1:
            steps_ms = [(end - start) * 1e3 for start, end in zip(self.ends, self.ends[1:])]
            (Path(log_dir) / self.FILE).write_text(json.dumps({"steps_ms": steps_ms, "window_ms": window_ms}))


def _wall_times(log_dir: Path) -> dict[str, Any]:
    """The metric plug-in: what ``StepWallTimes`` wrote in a fit's ``log_dir``."""
    return json.loads((log_dir / StepWallTimes.FILE).read_text())


EVERY_STEP = "every step"
"""The timer as the benchmarks run it."""

AtLeast2 = restricted_number_type("AtLeast2", int, (">=", 2))
"""An ``int`` of at least 2 (jsonargparse refuses anything less with the field's name)."""


@dataclass
class TimerOverheadConfig(StudyConfig):
    """What ``python -m lightning_ddp.bench.timer_overhead`` runs."""

    strategies: list[str] = field(default_factory=lambda: ["bucketed_ddp", "ddp", "fsdp2"])
    """Strategies measured, each with every arm: ours, torch DDP's and torch FSDP2's collectives all pass the
    timer's recording process groups."""
    repeats: int = 4
    """Rounds of the arms (the interval needs several)."""
    steps: int = 110
    """Optimizer steps per run (110: the every-50 arm measures steps 0, 50 and 100)."""
    warmup_steps: int = 5
    """Steps per run left out of the median."""
    collective_calls: int = 2000
    """Small all-reduces per round of the per-collective cost (``collective_cost``); 0 leaves it out."""
    sampled_every: AtLeast2 = 50
    """The sampled arm's ``--timer.every_n_steps`` (>= 2: 1 is the every-step arm; run at least twice as many steps)."""
    out_dir: str = "logs/timer_overhead"
    """Where timer_overhead.json and .md go (logs/ is git-ignored)."""

    def __post_init__(self) -> None:
        """Refuses what every benchmark refuses (``BenchConfig``), and an empty or unknown strategy list."""
        super().__post_init__()
        if not self.strategies:
            raise ValueError("strategies is empty: name at least one, e.g. --strategies '[bucketed_ddp]'")
        for strategy in self.strategies:
            catalogue.get(strategy)  # an unknown name lists the valid ones


def arms(sampled_every: int) -> dict[str, list[str]]:
    """Arm name -> the timer's CLI arguments, ``off`` first (the denominator of every ratio)."""
    return {
        "off": ["--timer.enabled", "false"],
        EVERY_STEP: ["--timer.enabled", "true", "--timer.every_n_steps", "1"],
        sampled_arm(sampled_every): ["--timer.enabled", "true", "--timer.every_n_steps", str(sampled_every)],
    }


def sampled_arm(sampled_every: int) -> str:
    """The name of the arm that measures every ``sampled_every``-th step: the default sampling, the goal's arm."""
    return f"every {sampled_every} steps"


def measure(config: TimerOverheadConfig, command: str) -> None:
    """Every strategy's arms ``repeats`` times, interleaved; timer_overhead.json (per strategy, ``summarize``)."""
    timer_arms, goal_arm = arms(config.sampled_every), sampled_arm(config.sampled_every)
    cells = {}
    for strategy in config.strategies:
        for arm, timer_args in timer_arms.items():
            cells[f"{strategy}, timer {arm}"] = [
                "--config", config.fit_config, *config.fit_args, "--trainer.strategy", strategy,
                "--trainer.max_steps", str(config.steps), "--trainer.enable_progress_bar", "false", *timer_args,
                *NO_VALIDATION, *NO_CHECKPOINTS,  # the quickstart validates and keeps a checkpoint at step 40
                "--trainer.callbacks+=lightning_ddp.bench.timer_overhead.StepWallTimes",
            ]
    logs = run_study(cells, config.repeats, _wall_times, timeout_s=config.timeout_s)
    per_strategy = {}
    for strategy in config.strategies:
        measured = {arm: logs[f"{strategy}, timer {arm}"] for arm in timer_arms}
        runs = {arm: [m["steps_ms"][config.warmup_steps:] for m in runs] for arm, runs in measured.items()}
        windows = {arm: [m["window_ms"] / len(m["steps_ms"]) for m in runs] for arm, runs in measured.items()}
        per_strategy[strategy] = summarize(runs, windows, goal_arm, config.bootstrap_samples, config.seed)
    per_call = None
    if config.collective_calls:
        per_call = run_ranks(2, collective_cost, config.collective_calls, config.repeats)
    result = provenance(config.out_dir, strategies=per_strategy, goal_arm=goal_arm, collective_cost=per_call,
                        config=asdict(config), repeats=config.repeats, steps=config.steps,
                        warmup=config.warmup_steps, command=command)
    write_outputs(config.out_dir, {"timer_overhead.json": result})


PATHS = ("torch's group", "recording group, step not measured", "recording group, step measured")
"""How a collective is issued in ``collective_cost``: as without the timer; through the timer's recording group in a
step nobody measures (one check); in a measured step (recorded, its wait too)."""


def collective_cost(rank: int, world: int, calls: int, rounds: int) -> dict[str, Any]:
    """Spawned (``run_ranks``): µs per blocking all-reduce of 16 floats on each of ``PATHS``, interleaved for
    ``rounds`` rounds of ``calls`` calls; and ms to start and stop the torch profiler around one such call (what
    recording the collectives with the profiler on each measured step would cost at least)."""
    import torch.distributed as dist

    from lightning_ddp.sync.record import Recorder
    from lightning_ddp.sync.recording_group import record_process_groups, stop_recording_process_groups

    tensor = torch.ones(16)
    per_path: dict[str, list[float]] = {path: [] for path in PATHS}
    profiler_ms: list[float] = []

    def timed_calls() -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
        return (time.perf_counter() - start) / calls * 1e6

    for _ in range(rounds):
        per_path[PATHS[0]].append(timed_calls())
        recorder = Recorder(open_on_demand=False)
        record_process_groups(recorder)
        per_path[PATHS[1]].append(timed_calls())
        recorder.open_step(0)
        per_path[PATHS[2]].append(timed_calls())
        recorder.finish_step()
        stop_recording_process_groups()
        dist.barrier()
        start = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            dist.all_reduce(tensor)
        profiler_ms.append((time.perf_counter() - start) * 1e3)
    return {"calls": calls, "rounds": rounds, "us_per_call": per_path, "profiler_start_stop_ms": profiler_ms}


GOAL = 0.01
"""At the default sampling the timer may add at most 1 % to the median step."""


def summarize(runs: dict[str, list[list[float]]], windows: dict[str, list[float]], goal_arm: str,
              samples: int = 2000, seed: int = 0) -> dict:
    """One strategy's arms against ``off``: per arm (under ``arms``) the overhead of the median step [95 %] with its
    verdict against ``GOAL``, and of the whole runs' mean step (``windows``); ``goal_arm``'s at the top level."""
    per_arm: dict[str, dict] = {}
    for arm, steps in runs.items():  # off first: every other arm is divided by it
        mean = statistics.mean(windows[arm])
        per_arm[arm] = {"median_step_ms": pooled_median(steps), "window_mean_step_ms": mean,
                        "steps_measured": sum(map(len, steps))}
        if arm != "off":
            ratio = ratio_estimate(steps, runs["off"], samples, seed=seed, keys=(f"timer {arm}", "timer off"))
            per_arm[arm].update(**with_interval("overhead", ratio, shift=-1), verdict=verdict(ratio, 1 + GOAL),
                                window_overhead=mean / per_arm["off"]["window_mean_step_ms"] - 1)
    headline = per_arm[goal_arm]
    summary = {}  # the timer off against the goal's arm (the default sampling), then that arm's overhead
    for key in ("median_step_ms", "window_mean_step_ms"):
        summary[f"{key}_timer_off"] = per_arm["off"][key]
        summary[f"{key}_timer_on"] = headline[key]
    for key in ("overhead", "overhead_lo", "overhead_hi", "verdict", "window_overhead"):
        summary[key] = headline[key]
    return {**summary, "steps_measured": {arm: data["steps_measured"] for arm, data in per_arm.items()},
            "arms": per_arm}


def _markdown(result: dict) -> str:
    """timer_overhead.md: per strategy, the default sampling's overhead in one line; one table of every strategy's
    arms against its ``off``; the command."""
    goal_arm = result["goal_arm"]
    lines = [f"CommTimer overhead at the default sampling ({goal_arm}), goal < {GOAL:.0%} of the median step:", ""]
    rows = []  # the table's: a row per strategy and arm
    for strategy, measured in result["strategies"].items():
        rows += [{"strategy": strategy, "arm": arm, **data} for arm, data in measured["arms"].items()]
        lines.append(f"- `{strategy}`: {measured['overhead'] * 100:+.2f} % "
                     f"[95 %: {measured['overhead_lo'] * 100:+.2f}, "
                     f"{measured['overhead_hi'] * 100:+.2f}] (median step {measured['median_step_ms_timer_off']:.1f} "
                     f"ms off, {measured['median_step_ms_timer_on']:.1f} ms on): **{measured['verdict']}**; over "
                     f"whole runs {measured['window_overhead'] * 100:+.2f} %")
    columns = [Column("strategy", text_cell("strategy"), "l"), Column("timer", text_cell("arm"), "l"),
               Column("median step ms", text_cell("median_step_ms", ".2f")),
               Column("vs off [95 %]", interval_cell("overhead", "+.2f", scale=100, unit=" %"), "l"),
               Column(f"goal < {GOAL:.0%}", text_cell("verdict"), "l"),
               Column("whole-run mean step ms", text_cell("window_mean_step_ms", ".2f")),
               Column("vs off", interval_cell("window_overhead", "+.2f", scale=100, unit=" %"))]
    return "\n".join([*lines, "", *table(columns, rows), "", *_collective_cost_lines(result.get("collective_cost")),
                      f"Command: `{result['command']}`", ""])


def _collective_cost_lines(cost: dict[str, Any] | None) -> list[str]:
    """The per-collective cost's table (median over rounds, and their range), and the profiler's start and stop."""
    if cost is None:
        return []
    columns = [Column("a blocking all-reduce of 16 floats, 2 ranks", text_cell("path"), "l"),
               Column("µs per call, median of rounds", text_cell("median", ".1f")),
               Column("range over rounds", text_cell("range"), "l")]
    rows = [{"path": path, "median": statistics.median(values), "range": f"{min(values):.1f} - {max(values):.1f}"}
            for path, values in cost["us_per_call"].items()]
    profiler = cost["profiler_start_stop_ms"]
    return [f"What one collective costs ({cost['rounds']} rounds of {cost['calls']:,} calls, interleaved):", "",
            *table(columns, rows), "",
            f"Starting and stopping the torch profiler around one such call: {statistics.median(profiler):.1f} ms "
            f"(median of {len(profiler)}; range {min(profiler):.1f} - {max(profiler):.1f}).", ""]


main = benchmark_main(TimerOverheadConfig, measure, json_report("timer_overhead.json", _markdown))


if __name__ == "__main__":
    main()
