"""``python -m lightning_ddp.bench.straggler --config configs/straggler/bench.yaml``: does the CommTimer blame an
injected straggler (``SlowRank``) for the right time? Per strategy and delay; docs/benchmarks.md states the goals."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jsonargparse.typing import NonNegativeFloat, NonNegativeInt

from lightning_ddp import catalogue
from lightning_ddp.bench.stats import estimate, verdict
from lightning_ddp.bench.study import (
    StudyConfig, benchmark_main, csv_report, fit_arguments_of, interval_cell, load_average, per_repeat, run_study,
    step_rows, with_interval, write_results,
)
from lightning_ddp.reporting.tables import Column, csv_text, table, text_cell

KEYS: tuple[str, ...] = ("comm/wait_ms", "comm/transfer_ms", "straggler/lag_ms", "step/rank_spread_ms",
                         "step/time_ms", "comm/exposed_ms")
"""The per-step metrics estimated for every (strategy, delay), besides ``straggler/rank``."""

_INTERVALS = (("wait_ms", "comm/wait_ms"), ("transfer_ms", "comm/transfer_ms"), ("lag_ms", "straggler/lag_ms"))
"""The results' columns written with their interval, and the metric each estimates."""


@dataclass
class StragglerBenchConfig(StudyConfig):
    """What ``python -m lightning_ddp.bench.straggler`` runs (``configs/straggler/bench.yaml``)."""

    strategies: list[str] = field(default_factory=lambda: [catalogue.DEFAULT_ENGINE, "ddp"])
    """Values for ``--trainer.strategy``: registered names (``bucketed_ddp``, ``ddp`` ...)."""
    delays_ms: list[NonNegativeFloat] = field(default_factory=lambda: [0.0, 5.0, 20.0, 50.0])
    """SlowRank delays; 0 runs without SlowRank (the control)."""
    slow_rank: NonNegativeInt = 1
    """The rank that sleeps."""
    tolerance_ms: float = 3.0
    """Goal: the median wait within delay +- this."""
    straggler_share: float = 0.9
    """Goal: the slow rank named in at least this share of the steps."""
    idle_wait_ms: float = 2.0
    """Goal: without a delay, the median wait below this."""
    out_dir: str = "logs/straggler"
    """Where results.csv, steps.csv, results.md and environment.json go (logs/ is git-ignored)."""

    def __post_init__(self) -> None:
        """Refuses no strategies, and delays without 0 (the goals compare each delay with the no-delay runs)."""
        super().__post_init__()
        if not self.strategies:
            raise ValueError(f"strategies is empty; e.g. --strategies '[{catalogue.DEFAULT_ENGINE}, ddp]'")
        if 0 not in self.delays_ms:
            raise ValueError(f"delays_ms {self.delays_ms} has no 0: the transfer goal compares with the no-delay runs; "
                             "add 0")


def _fit_arguments(config: StragglerBenchConfig, strategy: str, delay_ms: float) -> list[str]:
    """The fit's arguments for ``strategy``, with the ``SlowRank`` callback delaying ``slow_rank`` by
    ``delay_ms`` each step when it is above 0."""
    arguments = fit_arguments_of(config, strategy)
    if delay_ms > 0:
        arguments += ["--trainer.callbacks+=lightning_ddp.callbacks.SlowRank", "--trainer.callbacks.rank",
                      str(config.slow_rank), "--trainer.callbacks.delay_ms", f"{delay_ms:g}"]
    return arguments


def summarize_cell(config: StragglerBenchConfig, strategy: str, delay_ms: float, runs: list[list[dict[str, float]]],
                   control: dict[str, Any] | None) -> dict[str, Any]:
    """One (strategy, delay)'s results.csv row; ``control``: the strategy's delay-0 row (``None`` for that row)."""
    estimates = {key: estimate(per_repeat(runs, key), config.bootstrap_samples, config.seed,
                               key=f"{strategy}|{delay_ms:g}|{key}") for key in KEYS}
    ranks = np.concatenate(per_repeat(runs, "straggler/rank")) if runs else np.array([])
    # results.csv's columns, in order
    row: dict[str, Any] = {"strategy": strategy, "delay_ms": delay_ms, "repeats_ok": len(runs),
                           "measured_steps": sum(map(len, runs))}
    for name, key in _INTERVALS:
        row.update(with_interval(name, estimates[key]))
    row.update(rank_spread_ms=estimates["step/rank_spread_ms"].point, step_ms=estimates["step/time_ms"].point,
               exposed_ms=estimates["comm/exposed_ms"].point,
               straggler_share=float(np.mean(ranks == config.slow_rank)) if ranks.size else math.nan,
               wait_goal="", straggler_goal="", transfer_goal="", load_avg_1m=load_average())
    wait, tolerance = estimates["comm/wait_ms"], config.tolerance_ms  # the goals: docs/benchmarks.md
    if delay_ms == 0:
        row["wait_goal"] = verdict(wait, config.idle_wait_ms)  # met when the whole interval is below it
        return row
    # met: the interval inside delay +- tolerance (below its top, and above its bottom); missed: entirely outside
    ends = {verdict(wait, delay_ms + tolerance), verdict((-wait.hi, -wait.lo), tolerance - delay_ms)}
    if "missed" in ends:
        row["wait_goal"] = "missed"
    else:
        row["wait_goal"] = "met" if ends == {"met"} else "inconclusive"
    row["straggler_goal"] = "met" if row["straggler_share"] >= config.straggler_share else "missed"
    if control is not None and all(isinstance(control[k], float) and math.isfinite(control[k])
                                   for k in ("transfer_ms_lo", "transfer_ms_hi")):
        inside = control["transfer_ms_lo"] <= row["transfer_ms"] <= control["transfer_ms_hi"]
        row["transfer_goal"] = "met" if inside else "missed"
    return row


def render_markdown(config: StragglerBenchConfig, rows: list[dict[str, Any]], command: str) -> str:
    """results.md: the table with intervals and the goals' verdicts."""
    columns = [Column("strategy", text_cell("strategy"), "l"), Column("delay ms", text_cell("delay_ms", "g")),
               *(Column(key, interval_cell(name, ".2f")) for name, key in _INTERVALS),
               Column("step/rank_spread_ms", interval_cell("rank_spread_ms", ".2f")),
               Column(f"straggler = rank {config.slow_rank}", interval_cell("straggler_share", ".0%")),
               Column("step ms", interval_cell("step_ms", ".1f")),
               *(Column(goal.replace("_", " "), text_cell(goal), "l")
                 for goal in ("wait_goal", "straggler_goal", "transfer_goal"))]
    return "\n".join([
        "# Who made the step wait: an injected straggler", "",
        f"`SlowRank(rank={config.slow_rank}, delay_ms=D)` on {config.fit_config} (2 ranks), {config.repeats} repeat(s) "
        f"x {config.steps - config.warmup_steps} measured steps per row (after {config.warmup_steps} warm-up). "
        "Pooled medians of rank 0's per-step metrics [95 % interval, hierarchical bootstrap over repeats then steps].",
        "", *table(columns, rows), "",
        f"Goals (docs/benchmarks.md, \"Straggler benchmark\"): wait within +-{config.tolerance_ms:g} ms of the delay, "
        f"straggler named in >= {config.straggler_share:.0%} of the steps, transfer inside the no-delay interval; "
        f"without a delay, wait below {config.idle_wait_ms:g} ms.", "",
        f"Command: `{command}`", ""])


def run_benchmark(config: StragglerBenchConfig, command: str) -> None:
    """Every (strategy, delay) ``repeats`` times, interleaved; results.csv, steps.csv and environment.json."""
    delays = sorted(set(config.delays_ms))
    names = {(strategy, delay): f"{strategy}, delay {delay:g} ms" for strategy in config.strategies for delay in delays}
    cells = {name: _fit_arguments(config, *key) for key, name in names.items()}
    measured = run_study(cells, config.repeats, step_rows, timeout_s=config.timeout_s)
    runs = {key: measured[name] for key, name in names.items()}
    rows = []
    for strategy in config.strategies:  # delays[0] is 0 (required, none below): the control of the others
        control = summarize_cell(config, strategy, delays[0], runs[(strategy, delays[0])], None)
        rows.append(control)
        for delay in delays[1:]:
            rows.append(summarize_cell(config, strategy, delay, runs[(strategy, delay)], control))
    step_table = []  # steps.csv: every measured step of every run, with its strategy, delay and repeat
    for (strategy, delay), repeats in runs.items():
        for repeat, steps in enumerate(repeats):
            step_table += [{"strategy": strategy, "delay_ms": delay, "repeat": repeat, **row} for row in steps]
    step_columns = list(dict.fromkeys(key for row in step_table for key in row))
    write_results(config, command, rows, {"steps.csv": csv_text(step_table, step_columns, digits=4)})


main = benchmark_main(StragglerBenchConfig, run_benchmark, csv_report(render_markdown))


if __name__ == "__main__":
    main()
