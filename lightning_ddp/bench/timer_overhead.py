"""What the CommTimer costs: the same fit with the timer off, measuring every step and measuring every Nth step,
alternated in one command (``python -m lightning_ddp.bench.timer_overhead --config configs/quickstart.yaml``).
Arguments after ``--`` go to every fit; docs/benchmarks.md says how the step times are taken.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import Callback

from lightning_ddp.bench.config import fit_arguments
from lightning_ddp.bench.single import Column, interval_cell, table, text_cell
from lightning_ddp.bench.stats import pooled_median, ratio_estimate, verdict
from lightning_ddp.bench.study import command_text, provenance, read_json, run_study, write_outputs


class StepWallTimes(Callback):
    """Rank 0 writes the host time between consecutive training-batch ends (ms) and the whole window's time after
    one final synchronize as JSON to ``path`` (default: ``FILE`` in the trainer's log directory)."""

    FILE = "step_wall_times.json"

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.times_ms: list[float] = []
        self._first: float | None = None
        self._last: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()  # no synchronize here: see docs/benchmarks.md, "Timer overhead"
        if self._last is not None:
            self.times_ms.append((now - self._last) * 1e3)
        else:
            self._first = now
        self._last = now

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # once: the queued tail belongs to the window
        if trainer.is_global_zero and self._first is not None and self.times_ms:
            window_ms = (time.perf_counter() - self._first) * 1e3
            path = Path(self.path or Path(trainer.log_dir) / self.FILE)
            path.write_text(json.dumps({"steps_ms": self.times_ms, "window_ms": window_ms}))


SAMPLED_EVERY = 50
"""The sampled arm's ``every_n_steps`` by default (Lightning's default ``log_every_n_steps``)."""

EVERY_STEP = "every step"
"""The arm the top-level keys of the result describe (the timer as the benchmarks run it)."""


def arms(sampled_every: int) -> dict[str, list[str]]:
    """Arm name -> the timer's CLI arguments, ``off`` first (the denominator of every ratio)."""
    return {
        "off": ["--timer.enabled", "false"],
        EVERY_STEP: ["--timer.enabled", "true", "--timer.every_n_steps", "1"],
        f"every {sampled_every} steps": ["--timer.enabled", "true", "--timer.every_n_steps", str(sampled_every)],
    }


def measure(config: str, steps: int, warmup: int, repeats: int, extra: list[str],
            sampled_every: int = SAMPLED_EVERY) -> dict:
    """Every arm's fit ``repeats`` times, interleaved; the summary (``summarize``) and the settings."""
    cells = {f"timer {arm}": [
        "--config", config, *extra, "--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false",
        *timer_args,
        # No validation inside the measured window (the quickstart validates at step 40).
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.callbacks+=lightning_ddp.bench.timer_overhead.StepWallTimes",
    ] for arm, timer_args in arms(sampled_every).items()}
    logs = run_study(cells, repeats, lambda log_dir: json.loads((log_dir / StepWallTimes.FILE).read_text()))
    measured = {arm: logs[f"timer {arm}"] for arm in arms(sampled_every)}
    runs = {arm: [m["steps_ms"][warmup:] for m in runs] for arm, runs in measured.items()}  # measured steps
    windows = {arm: [m["window_ms"] / len(m["steps_ms"]) for m in runs] for arm, runs in measured.items()}
    return summarize(runs, windows) | {"config": config, "extra_args": extra, "steps": steps, "warmup": warmup,
                                       "repeats": repeats, "sampled_every": sampled_every}


GOAL = 0.02
"""The timer may add at most 2 % to the median step."""


def summarize(runs: dict[str, list[list[float]]], windows: dict[str, list[float]], samples: int = 2000) -> dict:
    """Per arm other than ``off`` (under ``arms``; the ``every step`` arm's also at the top level): its overhead
    ``median(arm) / median(off) - 1`` with a 95 % interval and its verdict against the 2 % goal, and the same ratio
    of the whole runs' mean steps (``windows``, no interval)."""
    per_arm: dict[str, dict] = {}
    for arm, steps in runs.items():  # off first: every other arm is divided by it
        mean = statistics.mean(windows[arm])
        per_arm[arm] = {"median_step_ms": pooled_median(steps), "window_mean_step_ms": mean,
                        "steps_measured": sum(map(len, steps))}
        if arm != "off":
            ratio = ratio_estimate(steps, runs["off"], samples, seed=0, keys=(f"timer {arm}", "timer off"))
            per_arm[arm].update(overhead=ratio.point - 1, overhead_lo=ratio.lo - 1, overhead_hi=ratio.hi - 1,
                                verdict=verdict(ratio, 1 + GOAL),
                                window_overhead=mean / per_arm["off"]["window_mean_step_ms"] - 1)
    every = per_arm[EVERY_STEP]
    return {**{f"{key}_timer_{state}": per_arm[arm][key] for key in ("median_step_ms", "window_mean_step_ms")
               for state, arm in (("off", "off"), ("on", EVERY_STEP))},
            **{key: every[key] for key in ("overhead", "overhead_lo", "overhead_hi", "verdict", "window_overhead")},
            "steps_measured": {arm: data["steps_measured"] for arm, data in per_arm.items()}, "arms": per_arm}


def format_table(result: dict) -> str:
    """A markdown table: per arm its median step and, against ``off``, the ratio with its interval and verdict."""
    columns = [Column("timer", text_cell("arm"), "l"), Column("median step ms", text_cell("median_step_ms", ".2f")),
               Column("vs off [95 %]", interval_cell("overhead", "+.2f", scale=100, unit=" %"), "l"),
               Column(f"goal < {GOAL:.0%}", text_cell("verdict"), "l"),
               Column("whole-run mean step ms", text_cell("window_mean_step_ms", ".2f")),
               Column("vs off", interval_cell("window_overhead", "+.2f", scale=100, unit=" %"))]
    return "\n".join(table(columns, [{"arm": arm, **data} for arm, data in result["arms"].items()]))


def summary_line(result: dict) -> str:
    """One line: the every-step arm's overhead with its interval and verdict, and over whole runs."""
    return (f"CommTimer overhead (every step): {result['overhead'] * 100:+.2f} % [95 %: "
            f"{result['overhead_lo'] * 100:+.2f}, {result['overhead_hi'] * 100:+.2f}] (median step "
            f"{result['median_step_ms_timer_off']:.1f} ms off, {result['median_step_ms_timer_on']:.1f} ms on; goal < "
            f"{GOAL:.0%}: {result['verdict']}); over whole runs {result['window_overhead'] * 100:+.2f} % "
            f"({result['window_mean_step_ms_timer_off']:.1f} vs {result['window_mean_step_ms_timer_on']:.1f} ms mean "
            "step)")


def write_report(out: Path, result: dict) -> None:
    """timer_overhead.json and .md in ``out`` (``result`` with its ``command``)."""
    write_outputs(out, {"timer_overhead.json": result,
                        "timer_overhead.md": f"{summary_line(result)}\n\n{format_table(result)}\n\n"
                                             f"Command: `{result['command']}`\n"})


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="python -m lightning_ddp.bench.timer_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml", help="the fit config to time")
    parser.add_argument("--steps", type=int, default=110,
                        help="optimizer steps per run (110: the every-50 arm measures steps 0, 50 and 100)")
    parser.add_argument("--warmup", type=int, default=5, help="steps per run left out of the median")
    parser.add_argument("--repeats", type=int, default=4, help="rounds of the arms (the interval needs several)")
    parser.add_argument("--sampled_every", type=int, default=SAMPLED_EVERY,
                        help="the sampled arm's --timer.every_n_steps (run at least twice as many --steps)")
    parser.add_argument("--out", default=None, help="directory for timer_overhead.json and .md")
    parser.add_argument("--report_only", action="store_true",
                        help="measure nothing: rebuild timer_overhead.md from --out's timer_overhead.json")
    parser.add_argument("fit_args", nargs=argparse.REMAINDER,
                        help="after `--`: arguments for every `python -m lightning_ddp fit` run, e.g. "
                             "`-- --trainer.accelerator cuda`")
    args = parser.parse_args(argv)
    if args.report_only:
        if not args.out:
            parser.error("--report_only needs --out (the directory of timer_overhead.json)")
        result = read_json(Path(args.out) / "timer_overhead.json")
        write_report(Path(args.out), result)
        return result
    if args.sampled_every < 2:
        raise ValueError(f"--sampled_every must be >= 2 (1 is the every-step arm already), got {args.sampled_every}")
    extra = fit_arguments(args.fit_args)
    result = measure(args.config, args.steps, args.warmup, args.repeats, extra, args.sampled_every)
    print(summary_line(result))
    print(format_table(result))
    if args.out:
        command = command_text("lightning_ddp.bench.timer_overhead", argv)
        write_report(Path(args.out), provenance(args.out, **result, command=command))
    return result


if __name__ == "__main__":
    main()
