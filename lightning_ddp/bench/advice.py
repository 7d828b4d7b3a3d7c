"""``python -m lightning_ddp.bench.advice --config configs/advice/cpu.yaml``: is ``advise`` right? Per start, its
advice's predicted step and gain against the measured ones, with intervals (docs/advice.md, "The check")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ddp import catalogue
from lightning_ddp.bench.launch import strategy_argument
from lightning_ddp.bench.stats import Estimate, estimate, ratio_estimate
from lightning_ddp.bench.study import (
    StudyConfig, benchmark_main, csv_report, fit_arguments_of, interval_cell, load_average, per_repeat, run_study,
    step_rows, with_interval, write_results,
)
from lightning_ddp.projection.advise import advise, read_run
from lightning_ddp.reporting.tables import Column, table, text_cell


@dataclass
class AdviceBenchConfig(StudyConfig):
    """What ``python -m lightning_ddp.bench.advice`` runs (``configs/advice/cpu.yaml``)."""

    starts: list[str] = field(default_factory=lambda: [catalogue.DEFAULT_ENGINE, f"{catalogue.DEFAULT_ENGINE}:2"])
    """Starting points: a catalogue name, ``name:MiB`` for a bucket size."""
    tolerance: float = 0.10
    """Goal: |predicted / measured - 1| within this."""
    timeout_s: float = 900.0
    """Seconds per run before it is killed."""
    out_dir: str = "logs/advice"
    """Where results.csv, results.md and environment.json go (committed: benchmarks/results/advice_cpu)."""


def _start_arguments(config: AdviceBenchConfig, start: str) -> list[str]:
    """The fit arguments of a start, ``name`` or ``name:MiB``."""
    name, _, size = start.partition(":")
    return fit_arguments_of(config, strategy_argument(name, bucket_size_mb=float(size) if size else None))


def _advice(log_dir: Path) -> dict[str, Any]:
    """The metric plug-in of the first phase: advise on the run, keep what the check needs."""
    document = advise(read_run(log_dir))
    verdict = document["verdict"]
    top = verdict["top"] if verdict["action"] == "change" else None
    if top is None:  # keep (or a straggler): the prediction is the current row's, the start's own step
        row, applied, fit_args = next(r for r in document["recommendations"] if r["current"]), None, []
    else:
        row, fit_args = top, top["fit_args"]
        applied = f"{top['strategy']} {top['settings'].get('bucket_size_mb') or ''}".strip()
    return {"verdict": verdict["action"], "step_ms": document["run"]["step_ms"], "applied": applied,
            "fit_args": fit_args, "predicted": [row["predicted_step_ms"], *row["predicted_step_interval"]]}


def summarize(config: AdviceBenchConfig, start: str, advice: dict[str, Any], runs: dict[str, list]) -> dict[str, Any]:
    """results.csv's row (its columns in order) of one start from its advice and its start and applied runs."""
    steps = {key: per_repeat(runs[key], "step/time_ms") for key in runs}
    applied = "applied" if advice["fit_args"] else "start"
    first = estimate(steps["start"], config.bootstrap_samples, config.seed, f"{start}|start")
    after = estimate(steps[applied], config.bootstrap_samples, config.seed, f"{start}|{applied}")
    gain = ratio_estimate(steps["start"], steps[applied], config.bootstrap_samples, config.seed,
                          (f"{start}|start", f"{start}|applied"))
    predicted = advice["predicted"]
    error = predicted[0] / after.point - 1
    return {"start": start, "verdict": advice["verdict"], "applied": advice["applied"] or "-",
            **with_interval("predicted", Estimate(*predicted), "predicted_ms"),
            **with_interval("start", first, "start_ms"), **with_interval("applied", after, "applied_ms"),
            "error": error, "predicted_gain": advice["step_ms"] / predicted[0] - 1,
            **with_interval("gain", gain, shift=-1), "within_tolerance": abs(error) <= config.tolerance,
            "not_slower": not after.lo > first.hi, "load_avg_1m": load_average()}


def render_markdown(config: AdviceBenchConfig, rows: list[dict[str, Any]], command: str) -> str:
    """results.md: per start, the verdict, predicted against measured step and gain, and the goals."""
    columns = [*(Column(key, text_cell(key), "l") for key in ("start", "verdict", "applied")),
               Column("predicted ms [interval]", interval_cell("predicted_ms", bounds="predicted")),
               Column("start ms [95 %]", interval_cell("start_ms", bounds="start")),
               Column("applied ms [95 %]", interval_cell("applied_ms", bounds="applied")),
               Column("error", text_cell("error", "+.1%")),
               Column("predicted gain", text_cell("predicted_gain", "+.1%")),
               Column("measured gain [95 %]", interval_cell("gain", "+.1%")),
               Column(f"within {config.tolerance:.0%}", text_cell("within_tolerance"), "l"),
               Column("not slower", text_cell("not_slower"), "l")]
    within = sum(bool(r["within_tolerance"]) for r in rows)
    return "\n".join([
        "# Advice, checked by running it", "",
        f"{config.fit_config} on 2 CPU ranks; per start one fit advised on, then the start and the applied advice "
        f"{config.repeats} time(s) each, interleaved, {config.steps - config.warmup_steps} measured steps per run. "
        "Pooled medians [95 % hierarchical bootstrap]; a keep verdict predicts the start's own step.", "",
        *table(columns, rows), "",
        f"Predicted within {config.tolerance:.0%} of measured: {within} of {len(rows)}; applied never slower than the "
        f"start beyond the intervals: {'yes' if all(r['not_slower'] for r in rows) else 'no'}.", "",
        f"Command: `{command}`", ""])


def run_benchmark(config: AdviceBenchConfig, command: str) -> None:
    """Advise on one fit per start, then measure every start and its advice interleaved; write the files."""
    starts = {start: _start_arguments(config, start) for start in config.starts}
    advice = {start: runs[0] for start, runs in run_study(starts, 1, _advice, timeout_s=config.timeout_s).items()}
    cells = {f"{start}|start": arguments for start, arguments in starts.items()}
    cells.update({f"{start}|applied": starts[start] + advice[start]["fit_args"] for start in starts
                  if advice[start]["fit_args"]})
    measured = run_study(cells, config.repeats, step_rows, timeout_s=config.timeout_s)
    runs_by_start: dict[str, dict[str, list]] = {start: {} for start in starts}  # start -> "start"/"applied" -> runs
    for key, runs in measured.items():
        start, run = key.split("|")
        runs_by_start[start][run] = runs
    rows = [summarize(config, start, advice[start], runs_by_start[start]) for start in starts]
    write_results(config, command, rows, advice=advice)


main = benchmark_main(AdviceBenchConfig, run_benchmark, csv_report(render_markdown))


if __name__ == "__main__":
    main()
