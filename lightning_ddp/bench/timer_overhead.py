"""What the CommTimer costs: steps/s of the same fit with the timer off and on, alternated in one command.

    python -m lightning_ddp.bench.timer_overhead --config configs/quickstart.yaml --out benchmarks/results/cpu

Arguments after ``--`` go to every fit (``-- --trainer.accelerator cuda``).

Each repeat runs the fit twice, timer off then on, so slow drifts of a shared machine hit both alike. Every
step's wall time is taken by ``StepWallTimes``, a callback present in both runs that only reads
``time.perf_counter()`` at the end of each training batch, with no synchronisation of its own: on CUDA a
per-step ``torch.cuda.synchronize()`` in the *measuring* callback would drain the GPU in both arms and hide
exactly the cost of the timer's own synchronize. Over many steps the host cannot run further ahead than the
queue allows, so the host deltas average to the device's step time; the window's total (end of the warm-up to
the end of training, after one final synchronize) is reported too. The overhead is
``median(step | on) / median(step | off) - 1`` over the steps after ``warmup``, pooled over the repeats, with a
95 % interval (bootstrap over repeats, then steps) and a verdict against the goal of under 2 %: on 2 shared
cores two repeats once gave +12 % and four the next minute -0.1 %, so read the interval, not the point.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import Callback

from lightning_ddp.bench.config import fit_arguments
from lightning_ddp.bench.stats import pooled_median, ratio_estimate, verdict
from lightning_ddp.files import write_atomically


class StepWallTimes(Callback):
    """Rank 0 writes the host time between consecutive training-batch ends to ``path`` (JSON list, in ms), and
    as its last entry the mean step of the whole run after one final synchronize (the window's throughput)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.times_ms: list[float] = []
        self._first: float | None = None
        self._last: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()  # no synchronize here: see the module docstring
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
            Path(self.path).write_text(json.dumps({"steps_ms": self.times_ms, "window_ms": window_ms}))


def measure(config: str, steps: int, warmup: int, repeats: int, extra: list[str]) -> dict:
    runs: dict[str, list[list[float]]] = {"off": [], "on": []}  # per repeat, the measured steps
    windows: dict[str, list[float]] = {"off": [], "on": []}  # mean step over each whole run
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for mode in ("off", "on"):
                out = Path(tmp) / f"{mode}{repeat}.json"
                command = [
                    sys.executable, "-m", "lightning_ddp", "fit", "--config", config, *extra,
                    "--trainer.max_steps", str(steps), "--trainer.enable_progress_bar", "false",
                    # No validation inside the measured window (the quickstart validates at step 40).
                    "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
                    "--timer.enabled", "true" if mode == "on" else "false",
                    "--trainer.logger.init_args.save_dir", str(Path(tmp) / "logs"),
                    "--trainer.callbacks+=lightning_ddp.bench.timer_overhead.StepWallTimes",
                    "--trainer.callbacks.path", str(out),
                ]
                print(f"repeat {repeat + 1}/{repeats}, timer {mode}", flush=True)
                proc = subprocess.run(command, capture_output=True, text=True)
                if proc.returncode != 0:
                    from lightning_ddp.bench.runner import error_line

                    # The fit's own error, not the (long) command line CalledProcessError would show.
                    print(proc.stderr[-8000:], file=sys.stderr, flush=True)
                    raise RuntimeError(f"the fit with the timer {mode} exited {proc.returncode}: "
                                       f"{error_line(proc.stdout + proc.stderr) or 'no error line'}")
                measured = json.loads(out.read_text())
                runs[mode].append(measured["steps_ms"][warmup:])
                windows[mode].append(measured["window_ms"] / len(measured["steps_ms"]))
    return summarize(runs, windows) | {"config": config, "extra_args": extra, "steps": steps, "warmup": warmup,
                                       "repeats": repeats, "torch": torch.__version__, "cpu_count": os.cpu_count()}


GOAL = 0.02
"""The timer may add at most 2 % to the median step."""


def summarize(runs: dict[str, list[list[float]]], windows: dict[str, list[float]], samples: int = 2000) -> dict:
    """The overhead from each arm's steps, per repeat: ``median(on) / median(off) - 1`` (pooled medians) with a
    95 % interval from the two-level bootstrap of ``lightning_ddp.bench.stats`` (repeats, then steps), its verdict
    against the 2 % goal, and the same ratio of the whole runs' mean steps (``windows``, no interval)."""
    ratio = ratio_estimate(runs["on"], runs["off"], samples, seed=0, keys=("timer on", "timer off"))
    off, on = pooled_median(runs["off"]), pooled_median(runs["on"])
    mean_off, mean_on = statistics.mean(windows["off"]), statistics.mean(windows["on"])
    return {
        "median_step_ms_timer_off": off, "median_step_ms_timer_on": on, "overhead": ratio.point - 1,
        "overhead_lo": ratio.lo - 1, "overhead_hi": ratio.hi - 1, "verdict": verdict(ratio, 1 + GOAL),
        "window_mean_step_ms_timer_off": mean_off, "window_mean_step_ms_timer_on": mean_on,
        "window_overhead": mean_on / mean_off - 1,
        "steps_measured": {k: sum(map(len, v)) for k, v in runs.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog="python -m lightning_ddp.bench.timer_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/quickstart.yaml", help="the fit config to time")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps per run left out of the median")
    parser.add_argument("--repeats", type=int, default=4, help="off/on pairs (the interval needs several)")
    parser.add_argument("--out", default=None, help="directory for timer_overhead.json and .md")
    parser.add_argument("fit_args", nargs=argparse.REMAINDER,
                        help="after `--`: arguments for every `python -m lightning_ddp fit` run, e.g. "
                             "`-- --trainer.accelerator cuda`")
    args = parser.parse_args(argv)
    extra = fit_arguments(args.fit_args)
    result = measure(args.config, args.steps, args.warmup, args.repeats, extra)
    line = (f"CommTimer overhead: {result['overhead'] * 100:+.2f} % [95 %: {result['overhead_lo'] * 100:+.2f}, "
            f"{result['overhead_hi'] * 100:+.2f}] (median step {result['median_step_ms_timer_off']:.1f} ms "
            f"off, {result['median_step_ms_timer_on']:.1f} ms on; goal < {GOAL:.0%}: {result['verdict']}); over whole runs "
            f"{result['window_overhead'] * 100:+.2f} % ({result['window_mean_step_ms_timer_off']:.1f} vs "
            f"{result['window_mean_step_ms_timer_on']:.1f} ms mean step)")
    print(line)
    if args.out:
        out = Path(args.out)
        command = "python -m lightning_ddp.bench.timer_overhead " + " ".join(argv if argv is not None else sys.argv[1:])
        for name, text in (("timer_overhead.json", json.dumps({**result, "command": command}, indent=2) + "\n"),
                           ("timer_overhead.md", f"{line}\n\nCommand: `{command}`\n")):
            write_atomically(out / name, text)
    return result


if __name__ == "__main__":
    main()
